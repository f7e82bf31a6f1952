//! Where the pressureLifecycle looks and how long it waits.

use std::time::Duration;

/// Where the lifecycle looks and how long it waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PressureConfig {
    /// Namespace whose ImpVMs may be suspended; None: every namespace.
    pub vm_namespace: Option<String>,
    /// Label selector of the Nodes watched (the ImpVM controller's `--node-selector`).
    pub node_selector: Option<String>,
    /// Reporting controller name on Events.
    pub reporter: String,
    /// A suspended VM that has not reported Suspended this long no longer holds back the next one.
    pub suspend_timeout: Duration,
    /// Upper bound between two passes without any watch event.
    pub resync: Duration,
}

impl PressureConfig {
    pub fn new() -> Self {
        PressureConfig {
            vm_namespace: None,
            node_selector: None,
            reporter: imp_api::names::MANAGER_OPERATOR.to_owned(),
            suspend_timeout: Duration::from_secs(300),
            resync: Duration::from_secs(30),
        }
    }
}

impl Default for PressureConfig {
    fn default() -> Self {
        Self::new()
    }
}
