//! imp-agent: the Kubernetes-facing half of a node (watches ImpVMs bound to its node, drives imp-runtime,
//! performs the runner handoff, writes status, renews the heartbeat Lease). Flags and environment are
//! final; the agent is not built yet, so the binary validates its configuration and refuses to start.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

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
}

fn parse_interval(s: &str) -> Result<std::time::Duration, String> {
    imp_api::parse_duration(s).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args = Args::parse();
    eprintln!(
        "imp-agent: configuration accepted (node {}, runtime socket {}), but the agent (ImpVM watch, handoff, \
         heartbeat) is not built yet; refusing to start",
        args.node_name,
        args.runtime_socket.display()
    );
    ExitCode::FAILURE
}
