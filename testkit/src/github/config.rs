//! The simulator's configuration.

use std::time::Duration;

/// Simulator configuration.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The organization login the App is installed on.
    pub org: String,
    /// Repositories (`owner/repo`) the installation can see.
    pub repos: Vec<String>,
    pub app_id: u64,
    pub installation_id: u64,
    /// Which cached test key (see [`test_key`]) is the App's key.
    pub key_index: usize,
    /// Installation token lifetime (GitHub: 1 hour).
    pub token_ttl: Duration,
    /// Primary rate limit per window (GitHub: 5000 per hour for installations).
    pub rate_limit: u32,
    pub rate_limit_window: Duration,
    /// Organization runner groups besides "Default" (id 1), created with ids 2, 3, ...
    pub runner_groups: Vec<String>,
    /// Where webhooks go (also settable later).
    pub webhook_url: Option<String>,
    pub webhook_secret: String,
    /// The simulator URL written into JIT configs for runners (default: `base_url()`). Set it
    /// when runners reach the simulator through another address (e.g. from a guest VM over the
    /// bridge, with the simulator started by [`GithubSim::start_on`] on that address).
    pub runner_url: Option<String>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            org: "octo-org".into(),
            repos: vec!["octo-org/octo-repo".into()],
            app_id: 4242,
            installation_id: 31337,
            key_index: 0,
            token_ttl: Duration::from_secs(3600),
            rate_limit: 5000,
            rate_limit_window: Duration::from_secs(3600),
            runner_groups: Vec::new(),
            webhook_url: None,
            webhook_secret: "imp-sim-webhook-secret".into(),
            runner_url: None,
        }
    }
}
