//! imp-agent, the Kubernetes-facing half of a node (docs/agent.md): watches the ImpVMs bound to
//! its node, drives imp-runtime through its socket, performs the runner handoff over vsock, writes
//! the agent's part of ImpVM status and renews the node's heartbeat Lease.
//!
//! Pure decisions: [`decide`] (a VM's next action, suspend's plan folded in), [`handoff`] (the
//! handoff's order of steps), [`binding`] (whose JIT config a VM may receive), [`spec`] (ImpVM ->
//! runtime spec), [`capacity`] (what the Node offers VMs), [`suspend`] (suspend, resume,
//! ScaleToZero). I/O: [`controller`] (watch, observe, the one executor, sweep), [`boot`] and
//! [`runner`] (the per-VM tasks), [`suspender`], [`monitor`], [`status`] (guarded writes),
//! [`lease`] (heartbeat and capacity publishing), [`prebuild`] (images and, with [`standby`],
//! snapshot templates of the pools the node serves), [`http`]. Shared one floor below them:
//! [`context`], [`config`].

pub mod binding;
pub mod boot;
pub mod capacity;
pub mod config;
pub mod context;
pub mod controller;
pub mod decide;
pub mod handoff;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod monitor;
pub mod prebuild;
pub mod runner;
pub mod spec;
pub mod standby;
pub mod status;
pub mod suspend;
pub mod suspender;

use std::net::SocketAddr;

use kube::Client;

pub use config::{AgentConfig, DEFAULT_RUNNER_COMMAND};
pub use metrics::AgentMetrics;

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
    let ctx = context::Context::new(client, config, metrics.clone());
    let result = tokio::select! {
        r = http::serve(listener, metrics) => r,
        () = controller::run(ctx) => Ok(()),
        () = shutdown => Ok(()),
    };
    heartbeat.abort();
    result
}
