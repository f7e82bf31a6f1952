//! imp-agent: the Kubernetes-facing half of a node (watches ImpVMs bound to its node, drives imp-runtime,
//! performs the runner handoff, writes status, renews the heartbeat Lease). docs/agent.md.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use imp_agent::{AgentConfig, AgentMetrics};
use imp_common::telemetry::{LogArgs, ShutdownSignal};

use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "imp-agent", version, about = "Imp node agent")]
struct Args {
    /// Node this agent serves (downward API spec.nodeName).
    #[arg(long, env = "IMP_NODE_NAME")]
    node_name: String,
    /// Namespace of the heartbeat Leases.
    #[arg(long, env = "IMP_NAMESPACE", default_value = "imp-system")]
    namespace: String,
    /// imp-runtime's Unix socket.
    #[arg(
        long,
        env = "IMP_RUNTIME_SOCKET",
        default_value = "/run/imp/runtime.sock"
    )]
    runtime_socket: PathBuf,
    /// Heartbeat Lease renewal interval, e.g. "10s".
    #[arg(long, env = "IMP_HEARTBEAT_INTERVAL", default_value = "10s", value_parser = imp_api::parse_duration)]
    heartbeat_interval: Duration,
    /// vCPUs this node offers to VMs (Node annotation imp.dev/capacity-vcpu); default: the
    /// host's online CPUs.
    #[arg(long, env = "IMP_CAPACITY_VCPU", value_parser = clap::value_parser!(u32).range(1..))]
    capacity_vcpu: Option<u32>,
    /// MiB of memory this node offers to VMs (imp.dev/capacity-memory-mib); default: the host's
    /// MemTotal minus --reserved-memory-mib.
    #[arg(long, env = "IMP_CAPACITY_MEMORY_MIB")]
    capacity_memory_mib: Option<u64>,
    /// MiB kept for the host when the memory offered to VMs is derived from MemTotal.
    #[arg(long, env = "IMP_RESERVED_MEMORY_MIB", default_value_t = 1024)]
    reserved_memory_mib: u64,
    /// TCP address for Prometheus scraping.
    #[arg(long, env = "IMP_HTTP_ADDR", default_value = "0.0.0.0:9090")]
    http_addr: SocketAddr,
    /// Program the guest starts for runner VMs (the JIT config goes in its environment).
    #[arg(long, env = "IMP_RUNNER_COMMAND", default_value = imp_agent::DEFAULT_RUNNER_COMMAND)]
    runner_command: String,
    /// Guest paths a standby pool's snapshot template reads into its page cache before the
    /// snapshot (repeatable; env: comma-separated). Default: /opt/actions-runner and
    /// --runner-command (when it is a path).
    #[arg(
        long = "template-warm-path",
        env = "IMP_TEMPLATE_WARM_PATHS",
        value_delimiter = ','
    )]
    template_warm_path: Vec<String>,
    /// Warm templates' page cache at all (false: snapshots are taken without reading anything).
    #[arg(long, env = "IMP_TEMPLATE_WARM", default_value_t = true, action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new())]
    template_warm: bool,
    /// Upper bound between two reconciles of a bound VM, e.g. "5s".
    #[arg(long, env = "IMP_POLL_INTERVAL", default_value = "5s", value_parser = imp_api::parse_duration)]
    poll_interval: Duration,
    /// How often runtime VMs no longer bound to this node are released, e.g. "15s".
    #[arg(long, env = "IMP_SWEEP_INTERVAL", default_value = "15s", value_parser = imp_api::parse_duration)]
    sweep_interval: Duration,
    /// How long one request to a guest (Exec, probe, metrics) may go unanswered, e.g. "30s".
    #[arg(long, env = "IMP_GUEST_ANSWER_TIMEOUT", default_value = "30s", value_parser = imp_api::parse_duration)]
    guest_answer_timeout: Duration,
    /// How often a Running VM's guest is asked for its memory and disk use, e.g. "30s".
    #[arg(long, env = "IMP_GUEST_METRICS_INTERVAL", default_value = "30s", value_parser = imp_api::parse_duration)]
    guest_metrics_interval: Duration,
    /// Honour `desiredState: ScaleToZero` (experimental; wake-on-traffic is not
    /// hardware-validated): suspend a VM after idleTimeout without link traffic, resume it when
    /// packets arrive for its address. Off: such VMs keep running (condition Suspended says why).
    #[arg(long, env = "IMP_SCALE_TO_ZERO", default_value_t = false, action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new())]
    scale_to_zero: bool,
    #[command(flatten)]
    log: LogArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = args.log.init() {
        eprintln!("imp-agent: {e}");
        return ExitCode::from(2);
    }
    let shutdown = match ShutdownSignal::install() {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "installing the SIGTERM/SIGINT handlers failed");
            return ExitCode::FAILURE;
        }
    };
    let template_warm_paths = match imp_agent::config::template_warm_paths(
        args.template_warm,
        &args.template_warm_path,
        &args.runner_command,
    ) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("imp-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "no Kubernetes client configuration");
            return ExitCode::FAILURE;
        }
    };
    let config = AgentConfig {
        node_name: args.node_name,
        lease_namespace: args.namespace,
        runtime_socket: args.runtime_socket,
        heartbeat_interval: args.heartbeat_interval,
        capacity: imp_agent::capacity::CapacityConfig {
            vcpu: args.capacity_vcpu,
            memory_mib: args.capacity_memory_mib,
            reserved_memory_mib: args.reserved_memory_mib,
        },
        runner_command: args.runner_command,
        template_warm_paths,
        poll_interval: args.poll_interval,
        sweep_interval: args.sweep_interval,
        guest_answer_timeout: args.guest_answer_timeout,
        guest_metrics_interval: args.guest_metrics_interval,
        scale_to_zero: args.scale_to_zero,
    };
    tracing::info!(node = %config.node_name, socket = %config.runtime_socket.display(), "imp-agent starting");
    let run = imp_agent::run(
        client,
        config,
        args.http_addr,
        AgentMetrics::new(),
        shutdown.recv(),
    );
    match run.await {
        Ok(()) => {
            tracing::info!("imp-agent stopped; VMs left running in imp-runtime");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "imp-agent failed");
            ExitCode::FAILURE
        }
    }
}
