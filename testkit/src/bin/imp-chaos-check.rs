//! Checks the chaos invariants (`imp_testkit::chaos`) once a scenario has settled and its pool is
//! gone: prints each violation and exits 1, or prints what it checked and exits 0.
//!
//! JIT configs to look for in the logs are read from stdin, one a line, so they never reach argv
//! or disk. Run it in the node's network namespace (links and nft tables are read from there).

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use imp_testkit::chaos::{self, Observed};
use imp_testkit::github::AdminClient;

#[derive(Parser)]
#[command(
    name = "imp-chaos-check",
    about = "Imp's chaos invariants after a settled scenario"
)]
struct Args {
    /// Namespace of the pool's ImpVMs, Secrets and ImpNetworks (KUBECONFIG names the cluster).
    #[arg(long, default_value = "default")]
    namespace: String,
    /// The GitHub simulator's base URL.
    #[arg(long)]
    sim: String,
    /// A job the scenario queued (repeatable): each must be completed by a runner of its own.
    #[arg(long = "job")]
    jobs: Vec<u64>,
    /// imp-runtime's state directory.
    #[arg(long)]
    state_dir: PathBuf,
    /// A directory of logs to search for JIT configs (repeatable).
    #[arg(long = "logs")]
    logs: Vec<PathBuf>,
    /// A directory under `--logs` not to search (repeatable; e.g. etcd's data).
    #[arg(long = "skip")]
    skip: Vec<PathBuf>,
    /// Read JIT configs from stdin, one a line.
    #[arg(long)]
    jit_configs_stdin: bool,
    /// The pool still runs: check that whatever exists belongs to a live VM (instead of that
    /// nothing is left).
    #[arg(long)]
    settled: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut o = Observed::default();
    let client = kube::Client::try_default()
        .await
        .context("a Kubernetes client from KUBECONFIG")?;
    chaos::observe::kubernetes(&client, &args.namespace, &mut o).await?;
    chaos::observe::github(&AdminClient::new(&args.sim), &args.jobs, &mut o).await?;
    chaos::observe::node(&args.state_dir, &mut o)?;
    let secrets: Vec<String> = if args.jit_configs_stdin {
        std::io::read_to_string(std::io::stdin())
            .context("reading JIT configs from stdin")?
            .lines()
            .map(str::to_owned)
            .filter(|l| !l.is_empty())
            .collect()
    } else {
        Vec::new()
    };
    o.logs_with_jit = chaos::observe::files_containing(&args.logs, &args.skip, &secrets);
    let violations = if args.settled {
        chaos::check_settled(&o)
    } else {
        chaos::check(&o)
    };
    if violations.is_empty() && args.settled {
        println!(
            "settled invariants hold: {} job(s) served by runners of their own; every registration, JIT Secret, IP allocation, TAP, VM directory and VMM process belongs to one of {} live VM(s); {} JIT config(s) in no log",
            o.jobs.len(),
            o.vms.len(),
            secrets.len()
        );
        return Ok(());
    }
    if violations.is_empty() {
        println!(
            "invariants hold: {} job(s) served by runners of their own; no ImpVM, JIT Secret, registration, IP allocation, VMM process, imp link, nft table or VM file left; {} JIT config(s) in no log",
            o.jobs.len(),
            secrets.len()
        );
        return Ok(());
    }
    for v in &violations {
        eprintln!("VIOLATION  {v}");
    }
    std::process::exit(1);
}
