//! imp-agent: the Kubernetes-facing half of a node (watches ImpVMs bound to its node, drives imp-runtime,
//! performs the runner handoff, writes status, renews the heartbeat Lease). docs/agent.md.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use imp_node::agent::{AgentConfig, AgentMetrics};

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
    #[arg(long, env = "IMP_HEARTBEAT_INTERVAL", default_value = "10s", value_parser = parse_interval)]
    heartbeat_interval: std::time::Duration,
    /// Suspend ScaleToZero VMs first under node memory pressure.
    #[arg(long, env = "IMP_PRESSURE_LIFECYCLE", default_value_t = false, action = clap::ArgAction::Set)]
    pressure_lifecycle: bool,
    /// TCP address for Prometheus scraping.
    #[arg(long, env = "IMP_HTTP_ADDR", default_value = "0.0.0.0:9090")]
    http_addr: SocketAddr,
    /// Program the guest starts for runner VMs (the JIT config goes in its environment).
    #[arg(long, env = "IMP_RUNNER_COMMAND", default_value = imp_node::agent::DEFAULT_RUNNER_COMMAND)]
    runner_command: String,
    /// Upper bound between two reconciles of a bound VM, e.g. "5s".
    #[arg(long, env = "IMP_POLL_INTERVAL", default_value = "5s", value_parser = parse_interval)]
    poll_interval: std::time::Duration,
    /// How often runtime VMs no longer bound to this node are released, e.g. "15s".
    #[arg(long, env = "IMP_SWEEP_INTERVAL", default_value = "15s", value_parser = parse_interval)]
    sweep_interval: std::time::Duration,
}

fn parse_interval(s: &str) -> Result<std::time::Duration, String> {
    imp_api::parse_duration(s).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if args.pressure_lifecycle {
        tracing::warn!("--pressure-lifecycle is accepted but not implemented yet (docs/agent.md)");
    }
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("imp-agent: no Kubernetes client configuration: {e}");
            return ExitCode::FAILURE;
        }
    };
    let config = AgentConfig {
        node_name: args.node_name,
        lease_namespace: args.namespace,
        runtime_socket: args.runtime_socket,
        heartbeat_interval: args.heartbeat_interval,
        runner_command: args.runner_command,
        poll_interval: args.poll_interval,
        sweep_interval: args.sweep_interval,
    };
    tracing::info!(node = %config.node_name, socket = %config.runtime_socket.display(), "imp-agent starting");
    let run = imp_node::agent::run(client, config, args.http_addr, AgentMetrics::new());
    tokio::select! {
        r = run => match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("imp-agent: {e:#}");
                ExitCode::FAILURE
            }
        },
        _ = tokio::signal::ctrl_c() => ExitCode::SUCCESS,
    }
}
