//! The agent's settings (flags and environment of the binary, docs/agent.md "Configuration").

use std::path::PathBuf;
use std::time::Duration;

use super::capacity;

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
