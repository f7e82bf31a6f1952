//! Configuration of the ImpVM controller. Every time-based behaviour is here so tests can shrink it.

use std::time::Duration;

/// Grace periods, timeouts and retry intervals. `Default` gives production values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timing {
    /// A node NotReady this long is lost (kube-controller-manager's default node-monitor grace is 40s).
    pub node_not_ready_grace: Duration,
    /// An agent Lease not renewed for this long means the agent (or its node) is gone.
    pub heartbeat_stale_after: Duration,
    /// With the node lost, a deleting VM's finalizer is forced this long after deletion began.
    pub finalizer_timeout: Duration,
    /// How often an unschedulable VM is tried again (besides Node and Lease changes).
    pub unschedulable_retry: Duration,
    /// Upper bound between two reconciles of any VM, so no timer is ever missed for good.
    pub resync: Duration,
    /// How often the per-phase and per-node backlog gauges are recomputed from the cache.
    pub gauge_refresh: Duration,
    /// How often each ImpNetwork's allocations are swept for VMs that no longer exist (deleted
    /// while the operator was down, or whose release failed).
    pub ipam_sweep: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            node_not_ready_grace: Duration::from_secs(40),
            heartbeat_stale_after: Duration::from_secs(40),
            finalizer_timeout: Duration::from_secs(300),
            unschedulable_retry: Duration::from_secs(15),
            resync: Duration::from_secs(300),
            gauge_refresh: Duration::from_secs(10),
            ipam_sweep: Duration::from_secs(60),
        }
    }
}

/// How the controller behaves (what it watches is the [`crate::index::IndexConfig`]'s).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmControllerConfig {
    /// Reporting controller name on Events.
    pub reporter: String,
    pub timing: Timing,
}

impl VmControllerConfig {
    pub fn new() -> Self {
        VmControllerConfig {
            reporter: imp_api::names::MANAGER_OPERATOR.to_owned(),
            timing: Timing::default(),
        }
    }
}

impl Default for VmControllerConfig {
    fn default() -> Self {
        Self::new()
    }
}
