//! Runs Imp's GitHub API simulator standalone (for the local smoke test and manual poking).
//!
//! Prints the base URL on stdout, optionally writes an App credentials Secret's files
//! (`app-id`, `installation-id`, `private-key`) into `--secret-dir`, and serves until killed.
//! The admin API (`/_admin/...`) and runner protocol (`/_runner/...`) are on the same port.

use std::time::Duration;

use clap::Parser;
use imp_testkit::github::{GithubSim, KeyFormat, SimConfig};

#[derive(Parser)]
#[command(name = "github-sim", about = "Imp's GitHub API simulator")]
struct Args {
    /// Listen address (loopback, or TEST-NET inside a test's network namespace).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    #[arg(long, default_value = "octo-org")]
    org: String,
    /// Repositories (`owner/repo`), repeatable.
    #[arg(long = "repo", default_value = "octo-org/octo-repo")]
    repos: Vec<String>,
    #[arg(long, default_value_t = 4242)]
    app_id: u64,
    #[arg(long, default_value_t = 31337)]
    installation_id: u64,
    /// Where workflow_job webhooks go.
    #[arg(long)]
    webhook_url: Option<String>,
    #[arg(long, default_value = "imp-sim-webhook-secret")]
    webhook_secret: String,
    /// Installation token lifetime in seconds.
    #[arg(long, default_value_t = 3600)]
    token_ttl_secs: u64,
    /// URL written into JIT configs for runners (default: the listen URL).
    #[arg(long)]
    runner_url: Option<String>,
    /// Write `app-id`, `installation-id`, `private-key` (PKCS#1 PEM) files here.
    #[arg(long)]
    secret_dir: Option<std::path::PathBuf>,
    /// Register this workflow file in the first repository as `.github/workflows/<file name>`
    /// (repeatable). `smoke/workflow.yaml` is registered as `imp-smoke.yaml`, the file name
    /// `imp-smoke.sh --cluster` dispatches.
    #[arg(long = "workflow")]
    workflows: Vec<std::path::PathBuf>,
    /// Write a token that may dispatch workflows to this file (mode 0600).
    #[arg(long)]
    user_token_file: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let ip: std::net::SocketAddr = args.listen.parse()?;
    // Loopback, or a TEST-NET address (RFC 5737: never routed), which only a test's own network
    // namespace has (smoke/imp-smoke.sh puts the simulator on 198.51.100.1).
    let test_net = match ip.ip() {
        std::net::IpAddr::V4(v4) => matches!(
            v4.octets(),
            [192, 0, 2, _] | [198, 51, 100, _] | [203, 0, 113, _]
        ),
        std::net::IpAddr::V6(_) => false,
    };
    anyhow::ensure!(
        ip.ip().is_loopback() || test_net,
        "the simulator listens on loopback or a TEST-NET address only"
    );
    let config = SimConfig {
        org: args.org,
        repos: args.repos,
        app_id: args.app_id,
        installation_id: args.installation_id,
        token_ttl: Duration::from_secs(args.token_ttl_secs),
        webhook_url: args.webhook_url,
        webhook_secret: args.webhook_secret,
        runner_url: args.runner_url,
        ..SimConfig::default()
    };
    let sim = GithubSim::start_on(config, &args.listen).await?;
    if let Some(dir) = args.secret_dir {
        std::fs::create_dir_all(&dir)?;
        for (k, v) in sim.secret_data(KeyFormat::Pkcs1) {
            let path = dir.join(k);
            std::fs::write(&path, v)?;
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
            }
        }
    }
    for path in &args.workflows {
        let yaml = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--workflow {}: {e}", path.display()))?;
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| anyhow::anyhow!("--workflow {}: no file name", path.display()))?;
        let name = if name == "workflow.yaml" {
            "imp-smoke.yaml"
        } else {
            name
        };
        sim.add_workflow(None, &format!(".github/workflows/{name}"), &yaml)?;
    }
    if let Some(path) = args.user_token_file {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| anyhow::anyhow!("--user-token-file {}: {e}", path.display()))?;
        f.write_all(sim.user_token().as_bytes())?;
    }
    println!("{}", sim.base_url());
    tokio::signal::ctrl_c().await?;
    Ok(())
}
