//! A fake GitHub Actions runner for the GitHub simulator, used inside guests in tests (static:
//! `RUSTFLAGS='-C target-feature=+crt-static' cargo build --target x86_64-unknown-linux-gnu -p
//! imp-fake-runner`, smoke/imp-smoke.sh --guest qemu).
//!
//! Like `actions/runner run --jitconfig <config>`, it takes a one-time JIT config, connects,
//! takes one queued job whose labels match, runs its `run:` steps (as its own user: the guest
//! starts it as the pool's runner user), reports the job's conclusion and exits 0, also when
//! the job failed (as actions/runner does). Imp delivers the
//! config in the environment variable `ACTIONS_RUNNER_INPUT_JITCONFIG` (so it never appears in
//! process listings); `--jitconfig <value>` is accepted for parity with actions/runner.
//!
//! Exit codes: 0 job completed (whatever its conclusion); 2 usage (no JIT config); 7 GitHub refused
//! the runner's version (`IMP_FAKE_RUNNER_VERSION`) as deprecated and
//! `ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE=1` (as actions/runner; 1 without it, after
//! printing GitHub's message); 1 any other failure.

use std::time::Duration;

use clap::Parser;
use imp_fake_runner::{
    DEFAULT_RUNNER_VERSION, DEPRECATED_EXIT_CODE_ENV, FakeRunnerOptions, JITCONFIG_ENV,
    VersionDeprecated,
};

#[derive(Parser)]
#[command(
    name = "imp-fake-runner",
    about = "Fake actions/runner for Imp's GitHub simulator"
)]
struct Args {
    /// The JIT config (prefer the ACTIONS_RUNNER_INPUT_JITCONFIG env var).
    #[arg(long)]
    jitconfig: Option<String>,
    /// Seconds to wait for a matching job before failing.
    #[arg(long, env = "IMP_FAKE_RUNNER_JOB_WAIT_SECS", default_value_t = 60)]
    job_wait_secs: u64,
    /// Seconds the job "runs".
    #[arg(long, env = "IMP_FAKE_RUNNER_JOB_SECS", default_value_t = 0)]
    job_secs: u64,
    /// Conclusion to report.
    #[arg(long, env = "IMP_FAKE_RUNNER_CONCLUSION", default_value = "success")]
    conclusion: String,
    /// Simulator URL to use instead of the one in the JIT config.
    #[arg(long, env = "IMP_FAKE_RUNNER_URL")]
    url: Option<String>,
    /// The runner version to state (GitHub's broker refuses deprecated ones).
    #[arg(long, env = "IMP_FAKE_RUNNER_VERSION", default_value = DEFAULT_RUNNER_VERSION)]
    version: String,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let config = match std::env::var(JITCONFIG_ENV)
        .ok()
        .filter(|v| !v.is_empty())
        .or(args.jitconfig)
    {
        Some(c) => c,
        None => {
            eprintln!("imp-fake-runner: no JIT config: set {JITCONFIG_ENV} (or pass --jitconfig)");
            std::process::exit(2);
        }
    };
    let opts = FakeRunnerOptions {
        job_wait: Duration::from_secs(args.job_wait_secs),
        job_duration: Duration::from_secs(args.job_secs),
        conclusion: args.conclusion,
        url_override: args.url,
        version: args.version,
    };
    match imp_fake_runner::run(&config, &opts).await {
        Ok(job) => {
            // Like actions/runner, a failed job is still a completed run: exit 0.
            println!(
                "imp-fake-runner: job {} completed ({})",
                job["id"],
                job["conclusion"].as_str().unwrap_or("unknown")
            );
        }
        Err(e) => {
            if let Some(VersionDeprecated(msg)) = e.downcast_ref::<VersionDeprecated>() {
                // actions/runner's line, which the runner layer's wrapper also watches for.
                println!("{msg}");
                let code = if std::env::var(DEPRECATED_EXIT_CODE_ENV).as_deref() == Ok("1") {
                    7
                } else {
                    1
                };
                std::process::exit(code);
            }
            eprintln!("imp-fake-runner: {e:#}");
            std::process::exit(1);
        }
    }
}
