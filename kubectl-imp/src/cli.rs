//! The command line: global flags like kubectl's, one subcommand per question.

use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::observe::{self, Scope};
use crate::output::{Format, render};
use crate::{Error, console, drain, status, timeline, why};

#[derive(Debug, Parser)]
#[command(
    name = "kubectl-imp",
    bin_name = "kubectl imp",
    version,
    about = "Imp's runner pools from the API server: status, why a job waited, a VM's timeline and \
             console, draining a node",
    after_help = "Exit codes: 0 done; 1 the cluster (or a file) could not be read; 2 usage; 3 no such \
                  VM, job or node; 4 drain: jobs still running at the timeout; 5 timeline: phases \
                  missing (recorded timelines only)."
)]
pub struct Cli {
    /// Namespace of the pools and VMs (default: the kubeconfig context's).
    #[arg(short, long, global = true)]
    pub namespace: Option<String>,
    /// Every namespace (status).
    #[arg(short = 'A', long, global = true)]
    pub all_namespaces: bool,
    /// Where Imp's operator, agents' heartbeat Leases and runtime pods live.
    #[arg(
        long,
        global = true,
        default_value = "imp-system",
        env = "IMP_NAMESPACE"
    )]
    pub imp_namespace: String,
    /// Output: a table for people, json or yaml for scripts.
    #[arg(short, long, global = true, value_enum, default_value = "table")]
    pub output: Format,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context.
    #[arg(long, global = true)]
    pub context: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Pools (desired, idle, busy, starting, minting, failing), nodes (capacity, VMs, heartbeat age,
    /// runtime ready) and the last failures with their reasons.
    Status,
    /// A job's wait per phase (by job id or the VM that served it), the slowest phase, the likely cause.
    Why {
        /// An ImpVM name, or a GitHub job id.
        target: String,
    },
    /// Every phase of one VM with its time and source.
    Timeline(TimelineArgs),
    /// The guest's serial log, through the runtime pod on the VM's node; secrets redacted.
    Console {
        vm: String,
        /// Keep printing what the guest writes.
        #[arg(short, long)]
        follow: bool,
    },
    /// Cordon the node, move runners without a job away, wait for running jobs, then say how to roll
    /// the runtime pod (OnDelete) and uncordon.
    Drain {
        node: String,
        /// How long to wait for running jobs (s, m or h).
        #[arg(long, default_value = "1h", value_parser = parse_duration)]
        timeout: Duration,
        /// How often to look again.
        #[arg(long, default_value = "5s", value_parser = parse_duration, hide = true)]
        poll: Duration,
    },
    /// Shell completion: `source <(kubectl-imp completion bash)`.
    Completion { shell: clap_complete::Shell },
}

/// `timeline VM`, from the API server; or, with `--impvms`, from a smoke run's recording.
#[derive(Debug, clap::Args)]
pub struct TimelineArgs {
    pub vm: String,
    /// A recording of the VMs' watch stream (one JSON watch event per line with the time seen, "t").
    #[arg(long)]
    pub impvms: Option<PathBuf>,
    /// A recording of the Events' watch stream.
    #[arg(long, requires = "impvms")]
    pub events: Option<PathBuf>,
    /// GitHub's jobs as a JSON list (created_at, started_at, completed_at), with --job.
    #[arg(long, requires = "job")]
    pub jobs: Option<PathBuf>,
    #[arg(long)]
    pub job: Option<String>,
    /// The VM the pool started in place of this one.
    #[arg(long)]
    pub replacement: Option<String>,
    /// Unix time the operator's metrics first counted the job's webhook as accepted.
    #[arg(long)]
    pub accepted_at: Option<f64>,
    /// The node runtime's metrics (Prometheus text) for the rootfs build time.
    #[arg(long)]
    pub runtime_metrics: Option<PathBuf>,
    /// Which guest path ran (recorded in the JSON).
    #[arg(long)]
    pub path: Option<String>,
    /// Also write the JSON report here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `90s`, `10m`, `1h`, or seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n
        .parse()
        .map_err(|_| format!("not a duration: {s} (e.g. 90s, 10m, 1h)"))?;
    let mult = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(format!("not a duration: {s} (e.g. 90s, 10m, 1h)")),
    };
    Ok(Duration::from_secs(n * mult))
}

async fn client(cli: &Cli) -> Result<(Client, String), Error> {
    let options = KubeConfigOptions {
        context: cli.context.clone(),
        ..Default::default()
    };
    let config = match &cli.kubeconfig {
        Some(path) => {
            let kubeconfig =
                Kubeconfig::read_from(path).map_err(|e| Error::Config(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options).await
        }
        None => kube::Config::from_kubeconfig(&options).await,
    }
    .map_err(|e| Error::Config(e.to_string()))?;
    let namespace = cli
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).map_err(|e| Error::Config(e.to_string()))?;
    Ok((client, namespace))
}

fn read(path: &PathBuf) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|source| Error::File {
        path: path.clone(),
        source,
    })
}

/// A timeline from a smoke run's recording: no API server involved.
fn recorded_timeline(a: &TimelineArgs, impvms: &PathBuf) -> Result<timeline::Timeline, Error> {
    let versions = timeline::parse_record(&read(impvms)?);
    let events = match &a.events {
        Some(p) => timeline::events_of_record(&timeline::parse_record(&read(p)?)),
        None => Vec::new(),
    };
    let jobs: Vec<serde_json::Value> = match &a.jobs {
        Some(p) => serde_json::from_str(&read(p)?).map_err(Error::Json)?,
        None => Vec::new(),
    };
    let job = jobs.iter().find(|j| {
        j.get("id")
            .map(|id| id.to_string().trim_matches('"').to_owned())
            == a.job.clone()
    });
    let metrics = match &a.runtime_metrics {
        Some(p) => Some(read(p)?),
        None => None,
    };
    Ok(timeline::compute(&timeline::Inputs {
        vm: &a.vm,
        replacement: a.replacement.as_deref(),
        impvms: &versions,
        events: &events,
        job,
        job_id: a.job.as_deref(),
        accepted_at: a.accepted_at,
        rootfs_build_s: metrics
            .as_deref()
            .and_then(|m| timeline::metric_sum(m, "imp_rootfs_build_duration_seconds_sum")),
        path: a.path.as_deref(),
    }))
}

/// Runs the command; what it prints on success.
pub async fn run(cli: Cli) -> Result<String, Error> {
    let format = cli.output;
    if let Command::Completion { shell } = &cli.command {
        let mut buf = Vec::new();
        // Named as the binary: kubectl's own completion of plugins calls `kubectl-imp`.
        let mut cmd = Cli::command().bin_name("kubectl-imp");
        clap_complete::generate(*shell, &mut cmd, "kubectl-imp", &mut buf);
        return Ok(String::from_utf8_lossy(&buf).into_owned());
    }
    if let Command::Timeline(a) = &cli.command
        && let Some(impvms) = &a.impvms
    {
        let tl = recorded_timeline(a, impvms)?;
        if let Some(out) = &a.out {
            let json = serde_json::to_string_pretty(&tl).map_err(Error::Json)?;
            std::fs::write(out, json).map_err(|source| Error::File {
                path: out.clone(),
                source,
            })?;
        }
        let shown = render(format, &tl, timeline::Timeline::table)?;
        let missing = tl.missing();
        if !missing.is_empty() {
            print!("{shown}");
            return Err(Error::PhasesMissing(missing.join(", ")));
        }
        return Ok(shown);
    }
    let (client, namespace) = client(&cli).await?;
    let scope = if cli.all_namespaces {
        Scope::All
    } else {
        Scope::Namespace(namespace.clone())
    };
    match &cli.command {
        Command::Status => {
            let (pools, vms, nodes, leases, pods, events) = tokio::try_join!(
                observe::pools(&client, &scope),
                observe::vms(&client, &scope),
                observe::nodes(&client),
                observe::leases(&client, &cli.imp_namespace),
                observe::runtime_pods(&client, &cli.imp_namespace),
                observe::events(&client, &scope),
            )?;
            let s = status::build(&status::Observed {
                pools: &pools,
                vms: &vms,
                nodes: &nodes,
                leases: &leases,
                runtime_pods: &pods,
                events: &events,
                now: crate::time::now(),
            });
            render(format, &s, status::Status::table)
        }
        Command::Why { target } => {
            let vm = observe::vm_or_job(&client, &namespace, target).await?;
            let pool = vm
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(imp_api::names::LABEL_RUNNER_POOL).cloned());
            let conditions = match pool {
                Some(p) => observe::pool_conditions(&client, &namespace, &p).await?,
                None => Vec::new(),
            };
            let w = why::explain(&vm, &conditions, crate::time::now());
            render(format, &w, why::Why::table)
        }
        Command::Timeline(a) => {
            let vm = observe::vm(&client, &namespace, &a.vm).await?;
            let events = observe::events(&client, &Scope::Namespace(namespace.clone())).await?;
            let object = serde_json::to_value(&vm).map_err(Error::Json)?;
            let tl = timeline::compute(&timeline::Inputs {
                vm: &a.vm,
                impvms: &[timeline::Seen::live(object)],
                events: &events,
                ..Default::default()
            });
            render(format, &tl, |t| {
                let mut out = t.table();
                let missing = t.missing();
                if !missing.is_empty() {
                    out.push_str(&format!("not yet: {}\n", missing.join(", ")));
                }
                out
            })
        }
        Command::Console { vm, follow } => {
            let vm = observe::vm(&client, &namespace, vm).await?;
            let pods = observe::runtime_pods(&client, &cli.imp_namespace).await?;
            let target = console::target(&vm, &pods, &cli.imp_namespace, *follow)?;
            console::stream(&client, &target).await?;
            Ok(String::new())
        }
        Command::Drain {
            node,
            timeout,
            poll,
        } => {
            let outcome = drain::run(&client, node, &cli.imp_namespace, *timeout, *poll).await?;
            render(format, &outcome, drain::Outcome::table)
        }
        Command::Completion { .. } => unreachable!("handled above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }
}
