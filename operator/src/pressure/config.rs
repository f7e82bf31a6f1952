//! How long the pressureLifecycle waits (what it watches is the index's).

use std::time::Duration;

/// How long the lifecycle waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PressureConfig {
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
