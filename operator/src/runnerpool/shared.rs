//! What the pool controller, the queued-job sweep and the webhook receiver share: the demand, the
//! metrics, the GitHub Apps and the controller's wake-up channel.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::mpsc::UnboundedSender;

use super::demand::{Demand, DemandLimits, PoolKey};
use super::metrics::PoolMetrics;
use crate::github::GithubApps;

/// State shared by the pool controller, the sweep and the webhook receiver.
pub struct PoolShared {
    demand: Mutex<Demand>,
    pub metrics: PoolMetrics,
    pub apps: Arc<GithubApps>,
    /// The scale-set intakes (pools with `spec.github.scaleSet`) and their mint path.
    pub scale_sets: crate::scaleset::ScaleSets,
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
            scale_sets: crate::scaleset::ScaleSets::default(),
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

impl crate::scaleset::IntakeHost for PoolShared {
    fn scale_sets(&self) -> &crate::scaleset::ScaleSets {
        &self.scale_sets
    }

    fn feed_demand(&self, key: &PoolKey, updates: Vec<super::demand::JobUpdate>) {
        let now = std::time::Instant::now();
        let mut changed = false;
        {
            let mut demand = self.demand();
            for u in updates {
                changed |= demand.observe(u, None, now).is_some();
            }
        }
        if changed {
            self.notify(key.clone());
        }
    }
}
