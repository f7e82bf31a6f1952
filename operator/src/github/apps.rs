//! One [`GithubApp`] per App installation for the whole operator, so every pool using the same
//! App Secret shares its token cache, mint governor and rate-limit gauge across reconciles.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::Secret;

use super::client::{GithubApp, GithubConfig};
use super::credentials::AppCredentials;
use super::errors::GithubError;
use super::metrics::GithubMetrics;

/// A process-wide set of App clients, keyed by the content of their Secret.
pub struct GithubApps {
    config: GithubConfig,
    metrics: GithubMetrics,
    /// Hash of the Secret's data -> client.
    apps: Mutex<HashMap<u64, GithubApp>>,
}

impl GithubApps {
    pub fn new(config: GithubConfig, metrics: GithubMetrics) -> Self {
        GithubApps {
            config,
            metrics,
            apps: Mutex::new(HashMap::new()),
        }
    }

    /// The client for this App Secret: the existing one while the Secret's data is unchanged
    /// (and for any Secret with identical data), a new one after a rotation. A client for the
    /// same (app, installation) built from older data is dropped.
    pub fn for_secret(&self, secret: &Secret) -> Result<GithubApp, GithubError> {
        let fingerprint = fingerprint(secret);
        if let Some(app) = self
            .apps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&fingerprint)
        {
            return Ok(app.clone());
        }
        let creds = AppCredentials::from_secret(secret)?;
        let app = GithubApp::with_metrics(creds, self.config.clone(), self.metrics.clone())?;
        let mut apps = self.apps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = apps.get(&fingerprint) {
            return Ok(existing.clone());
        }
        apps.retain(|_, a| {
            (a.app_id(), a.installation_id()) != (app.app_id(), app.installation_id())
        });
        apps.insert(fingerprint, app.clone());
        Ok(app)
    }

    /// Number of live clients.
    pub fn len(&self) -> usize {
        self.apps.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn fingerprint(secret: &Secret) -> u64 {
    let mut h = DefaultHasher::new();
    for (k, v) in secret.data.iter().flatten() {
        k.hash(&mut h);
        v.0.hash(&mut h);
    }
    for (k, v) in secret.string_data.iter().flatten() {
        k.hash(&mut h);
        v.hash(&mut h);
    }
    h.finish()
}
