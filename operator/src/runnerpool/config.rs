//! The pool controller's settings: where it looks, its timing, the global webhook secret.

use std::time::Duration;

/// Default key of the webhook secret inside its Secret.
pub const DEFAULT_WEBHOOK_SECRET_KEY: &str = "webhook-secret";
/// Time-based behaviour of the pool controller; `Default` gives production values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolTiming {
    /// How often queued jobs are listed through the REST API (catches lost webhooks).
    pub sweep_interval: Duration,
    /// First wait after a failed mint; doubles per consecutive failure up to `mint_backoff_max`.
    pub mint_backoff: Duration,
    pub mint_backoff_max: Duration,
    /// First wait before the next VM after one failed to start (no runner ever started); doubles
    /// per consecutive start failure up to `start_backoff_max`, resets when a runner starts.
    pub start_backoff: Duration,
    pub start_backoff_max: Duration,
    /// Next pass while a scale-up is still held back by scaleUpStep.
    pub scaling_requeue: Duration,
    /// Next pass while a runner to remove is busy at GitHub or a call failed.
    pub retry: Duration,
    /// Upper bound between two passes of a pool.
    pub resync: Duration,
    /// Bursts of VM status changes within this window cause one pass.
    pub debounce: Duration,
    /// A deleted pool whose runners cannot be deregistered (busy, GitHub down) lets go after this long.
    pub deletion_timeout: Duration,
    /// How often each pool's runners are listed at GitHub and registrations without a VM deleted.
    pub reap_interval: Duration,
    /// How long GitHub's supported runner versions (the downloads API) are reused before they are
    /// read again (one call per GitHub instance, revalidated with its ETag); a failed read is
    /// retried after a tenth of it.
    pub versions_refresh: Duration,
    /// A minted VM scheduled this long ago whose runner has not started is replaced
    /// (`BootDeadlineExceeded`).
    pub boot_deadline: Duration,
    /// A runner Started this long ago that GitHub never listed online (or busy) is replaced
    /// (`RunnerNeverOnline`).
    pub runner_online_deadline: Duration,
    /// A runner whose job completed but whose exit the node agent has not recorded yet is kept this
    /// long after the completion before its VM is deleted anyway: a real runner reports and uploads
    /// its logs for seconds after the job, and the exit code it then leaves is what the pool reads
    /// (freshness, `RunnerExitedNonZero`). Bounded so a runner that never exits does not pin a slot.
    pub runner_exit_grace: Duration,
}

impl Default for PoolTiming {
    fn default() -> Self {
        PoolTiming {
            sweep_interval: Duration::from_secs(60),
            mint_backoff: Duration::from_secs(5),
            mint_backoff_max: Duration::from_secs(300),
            start_backoff: Duration::from_secs(10),
            start_backoff_max: Duration::from_secs(300),
            scaling_requeue: Duration::from_millis(200),
            retry: Duration::from_secs(10),
            resync: Duration::from_secs(300),
            debounce: Duration::from_millis(100),
            deletion_timeout: Duration::from_secs(600),
            reap_interval: Duration::from_secs(120),
            versions_refresh: Duration::from_secs(3600),
            boot_deadline: Duration::from_secs(600),
            runner_online_deadline: Duration::from_secs(300),
            runner_exit_grace: Duration::from_secs(60),
        }
    }
}

/// A Secret key read from the operator's namespace (the global webhook secret).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretKeySelector {
    pub namespace: String,
    pub name: String,
    pub key: String,
}

/// Where the pool controller looks and how it behaves.
#[derive(Clone, Debug)]
pub struct PoolControllerConfig {
    /// Namespace whose pools are managed; None manages every namespace.
    pub namespace: Option<String>,
    /// Verifies deliveries for pools without a webhook secret of their own.
    pub global_webhook_secret: Option<SecretKeySelector>,
    /// Reporting controller name on Events.
    pub reporter: String,
    /// Concurrent runner creations (create VM + mint + Secret) within one pass.
    pub create_concurrency: usize,
    pub timing: PoolTiming,
}

impl PoolControllerConfig {
    pub fn new() -> Self {
        PoolControllerConfig {
            namespace: None,
            global_webhook_secret: None,
            reporter: imp_api::names::MANAGER_OPERATOR.to_owned(),
            create_concurrency: 8,
            timing: PoolTiming::default(),
        }
    }
}

impl Default for PoolControllerConfig {
    fn default() -> Self {
        Self::new()
    }
}
