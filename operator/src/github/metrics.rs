//! Prometheus metrics of the GitHub client.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AppLabels {
    pub app_id: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub operation: String,
    /// HTTP status class (`2xx`, `4xx`, `5xx`) or `error` when no answer came.
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub operation: String,
    /// [`super::GithubError::metric_label`].
    pub error: String,
}

/// The client's metrics. Clone shares the underlying series.
#[derive(Clone)]
pub struct GithubMetrics {
    /// `imp_github_rate_limit_remaining{app_id}`: last `x-ratelimit-remaining` seen on an
    /// installation-token call.
    pub rate_limit_remaining: Family<AppLabels, Gauge>,
    /// `imp_github_requests_total{operation,status}`.
    pub requests: Family<RequestLabels, Counter>,
    /// `imp_github_errors_total{operation,error}`: errors returned to callers.
    pub errors: Family<ErrorLabels, Counter>,
    /// `imp_github_installation_token_exchanges_total{app_id}`.
    pub token_exchanges: Family<AppLabels, Counter>,
    /// `imp_github_jit_mint_duration_seconds`: successful mints, governor wait included.
    pub jit_mint_duration: Histogram,
    /// `imp_github_jit_governor_wait_seconds`.
    pub governor_wait: Histogram,
}

impl Default for GithubMetrics {
    fn default() -> Self {
        GithubMetrics {
            rate_limit_remaining: Family::default(),
            requests: Family::default(),
            errors: Family::default(),
            token_exchanges: Family::default(),
            jit_mint_duration: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            governor_wait: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
        }
    }
}

impl GithubMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "imp_github_rate_limit_remaining",
            "GitHub API rate limit remaining, per App",
            self.rate_limit_remaining.clone(),
        );
        registry.register(
            "imp_github_requests",
            "GitHub API requests",
            self.requests.clone(),
        );
        registry.register(
            "imp_github_errors",
            "GitHub client errors returned to callers",
            self.errors.clone(),
        );
        registry.register(
            "imp_github_installation_token_exchanges",
            "Installation access token exchanges",
            self.token_exchanges.clone(),
        );
        registry.register(
            "imp_github_jit_mint_duration_seconds",
            "Latency of successful JIT runner config mints",
            self.jit_mint_duration.clone(),
        );
        registry.register(
            "imp_github_jit_governor_wait_seconds",
            "Time JIT mints waited for the mint governor",
            self.governor_wait.clone(),
        );
    }
}
