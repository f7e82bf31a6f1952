//! ImpVMRunnerPool: keeps the right number of ephemeral runner VMs, each with a one-time JIT config in a
//! Secret owned by its VM, and cleans up after every job. Pure parts: [`classify`] (what a runner VM is
//! doing), [`plan`] (how many runners), [`decide`] (the whole pass: mint policy, deadlines, the
//! registration reaper, status), [`demand`] (jobs from webhooks and the sweep), [`labels`] (which
//! jobs a pool's runners take), [`slo`] (which job a VM
//! served and how long it waited for each step). I/O: [`controller`]
//! (observe, execute, and the queued-job sweep). The webhook receiver is in [`crate::webhook`]. See
//! docs/runner-pool.md.

pub mod classify;
pub mod controller;
pub mod decide;
pub mod demand;
pub mod labels;
pub mod metrics;
pub mod plan;
pub mod slo;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;

pub use controller::run_runnerpool_controller;
pub use demand::{Demand, DemandLimits, PoolKey};
pub use metrics::PoolMetrics;

use crate::github::GithubApps;

/// Default key of the webhook secret inside its Secret.
pub const DEFAULT_WEBHOOK_SECRET_KEY: &str = "webhook-secret";
/// Values of the `state` label of `imp_runner_pool_runners`.
pub const STATES: [&str; 5] = ["desired", "idle", "busy", "booting", "total"];

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
    /// A minted VM scheduled this long ago whose runner has not started is replaced
    /// (`BootDeadlineExceeded`).
    pub boot_deadline: Duration,
    /// A runner Started this long ago that GitHub never listed online (or busy) is replaced
    /// (`RunnerNeverOnline`).
    pub runner_online_deadline: Duration,
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
            boot_deadline: Duration::from_secs(600),
            runner_online_deadline: Duration::from_secs(300),
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

/// State shared by the pool controller, the sweep and the webhook receiver.
pub struct PoolShared {
    demand: Mutex<Demand>,
    pub metrics: PoolMetrics,
    pub apps: Arc<GithubApps>,
    notify: Mutex<Option<UnboundedSender<PoolKey>>>,
    /// Every existing pool's webhook secret (and the global one) has been read since start. Until then a
    /// delivery that verifies with no known secret may be a pool's we have not read yet: the receiver
    /// answers 503 (GitHub may redeliver) rather than 401 or an unrouted 2xx.
    routes_loaded: AtomicBool,
}

impl PoolShared {
    pub fn new(apps: Arc<GithubApps>, metrics: PoolMetrics) -> Arc<Self> {
        Self::with_limits(apps, metrics, DemandLimits::default())
    }

    pub fn with_limits(
        apps: Arc<GithubApps>,
        metrics: PoolMetrics,
        limits: DemandLimits,
    ) -> Arc<Self> {
        Arc::new(PoolShared {
            demand: Mutex::new(Demand::new(limits).with_metrics(metrics.demand.clone())),
            metrics,
            apps,
            notify: Mutex::new(None),
            routes_loaded: AtomicBool::new(false),
        })
    }

    /// Whether every pool's webhook secret has been read (see [`PoolShared::mark_routes_loaded`]).
    pub fn routes_loaded(&self) -> bool {
        self.routes_loaded.load(Ordering::SeqCst)
    }

    /// The pools' routes and secrets are known: deliveries are judged from now on. The pool controller
    /// calls it after its first read of every pool; a receiver without a controller (tests, benches)
    /// calls it itself.
    pub fn mark_routes_loaded(&self) {
        self.routes_loaded.store(true, Ordering::SeqCst);
    }

    pub fn demand(&self) -> MutexGuard<'_, Demand> {
        self.demand.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks the controller to reconcile a pool (its demand changed).
    pub fn notify(&self, key: PoolKey) {
        if let Some(tx) = self
            .notify
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let _ = tx.send(key);
        }
    }

    pub(crate) fn set_notifier(&self, tx: UnboundedSender<PoolKey>) {
        *self.notify.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
    }
}
