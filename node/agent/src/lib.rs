//! imp-agent, the Kubernetes-facing half of a node (docs/agent.md): watches the ImpVMs bound to
//! its node, drives imp-runtime through its socket, performs the runner handoff over vsock, writes
//! the agent's part of ImpVM status and renews the node's heartbeat Lease.
//!
//! Pure decisions: [`decide`] (next action), [`handoff`] (the handoff state machine), [`binding`]
//! (whose JIT config a VM may receive), [`spec`]
//! (ImpVM -> runtime spec), [`capacity`] (what the Node offers VMs), [`suspend`] (suspend, resume,
//! ScaleToZero). I/O: [`controller`], [`suspender`], [`status`], [`lease`] (heartbeat and capacity
//! publishing), [`http`].

pub mod binding;
pub mod capacity;
pub mod controller;
pub mod decide;
pub mod handoff;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod monitor;
pub mod prebuild;
pub mod spec;
pub mod status;
pub mod suspend;
pub mod suspender;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kube::Client;

pub use metrics::AgentMetrics;

/// Default runner program inside the guest (the runner image's entry point).
pub const DEFAULT_RUNNER_COMMAND: &str = "/usr/local/bin/imp-runner";

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node_name: String,
    /// Namespace of the heartbeat Lease (the operator's).
    pub lease_namespace: String,
    pub runtime_socket: PathBuf,
    pub heartbeat_interval: Duration,
    /// The node's capacity for VMs as published on its Node (flags; the rest from the host).
    pub capacity: capacity::CapacityConfig,
    /// Program started in the guest for runner VMs (argv[0]; the config goes in the environment).
    pub runner_command: String,
    /// Upper bound between two reconciles of a bound VM (runtime state is polled).
    pub poll_interval: Duration,
    /// How often runtime VMs no longer bound here are looked for.
    pub sweep_interval: Duration,
    /// How long one request to a guest (an Exec, a probe, a metrics query) may go unanswered
    /// before the guest counts as unresponsive.
    pub guest_answer_timeout: Duration,
    /// How often a Running VM's guest is asked for its memory and disk use.
    pub guest_metrics_interval: Duration,
    /// `desiredState: ScaleToZero` is honoured (IMP_SCALE_TO_ZERO=true; experimental, not
    /// hardware-validated). Otherwise such a VM keeps running and its condition says why.
    pub scale_to_zero: bool,
}

impl AgentConfig {
    pub fn new(node_name: impl Into<String>, runtime_socket: impl Into<PathBuf>) -> Self {
        Self {
            node_name: node_name.into(),
            lease_namespace: "imp-system".into(),
            runtime_socket: runtime_socket.into(),
            heartbeat_interval: Duration::from_secs(10),
            capacity: capacity::CapacityConfig::default(),
            runner_command: DEFAULT_RUNNER_COMMAND.into(),
            poll_interval: Duration::from_secs(5),
            sweep_interval: Duration::from_secs(15),
            guest_answer_timeout: imp_guest::host::DEFAULT_ANSWER_TIMEOUT,
            guest_metrics_interval: Duration::from_secs(30),
            scale_to_zero: false,
        }
    }
}

/// Runs the agent (watch, sweep, heartbeat, HTTP) until `shutdown` resolves or one part ends (they
/// run forever unless the HTTP listener fails). Then it stops serving and aborts the heartbeat;
/// the VMs keep running in imp-runtime and the next start picks them up again.
pub async fn run(
    client: Client,
    config: AgentConfig,
    http_addr: SocketAddr,
    metrics: AgentMetrics,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(http_addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics and /healthz");
    let heartbeat = tokio::spawn(lease::heartbeat(
        client.clone(),
        config.lease_namespace.clone(),
        config.node_name.clone(),
        config.heartbeat_interval,
        metrics.clone(),
        imp_runtime_api::client::RuntimeClient::new(&config.runtime_socket),
        config.capacity,
    ));
    let _prebuild = prebuild::spawn(client.clone(), &config);
    let ctx = controller::Context::new(client, config, metrics.clone());
    let result = tokio::select! {
        r = http::serve(listener, metrics) => r,
        () = controller::run(ctx) => Ok(()),
        () = shutdown => Ok(()),
    };
    heartbeat.abort();
    result
}
