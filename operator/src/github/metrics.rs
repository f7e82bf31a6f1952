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
pub struct OperationLabels {
    pub operation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SweepCallLabels {
    pub app_id: String,
    /// `charged` (spent the rate limit) or `revalidated` (304, free).
    pub kind: String,
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
    /// `imp_github_rate_limit_limit{app_id}`: last `x-ratelimit-limit` (the hourly primary limit).
    pub rate_limit_limit: Family<AppLabels, Gauge>,
    /// `imp_github_requests_total{operation,status}`.
    pub requests: Family<RequestLabels, Counter>,
    /// `imp_github_not_modified_total{operation}`: conditional requests answered 304 (not charged).
    pub not_modified: Family<OperationLabels, Counter>,
    /// `imp_github_sweep_calls{app_id,kind}`: calls of the last queued-job sweep.
    pub sweep_calls: Family<SweepCallLabels, Gauge>,
    /// `imp_github_sweep_interval_seconds{app_id}`: wait before the next sweep (adaptive).
    pub sweep_interval: Family<AppLabels, Gauge>,
    /// `imp_github_sweep_budget_calls_per_hour{app_id}`: charged calls per hour the sweep may spend.
    pub sweep_budget: Family<AppLabels, Gauge>,
    /// `imp_github_sweep_projected_calls_per_hour{app_id}`: the last sweep's charged calls at
    /// the chosen interval.
    pub sweep_projected: Family<AppLabels, Gauge>,
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
            rate_limit_limit: Family::default(),
            requests: Family::default(),
            not_modified: Family::default(),
            sweep_calls: Family::default(),
            sweep_interval: Family::default(),
            sweep_budget: Family::default(),
            sweep_projected: Family::default(),
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
            "imp_github_rate_limit_limit",
            "GitHub API primary rate limit per hour, per App",
            self.rate_limit_limit.clone(),
        );
        registry.register(
            "imp_github_requests",
            "GitHub API requests",
            self.requests.clone(),
        );
        registry.register(
            "imp_github_not_modified",
            "Conditional GitHub API requests answered 304 (not charged to the rate limit)",
            self.not_modified.clone(),
        );
        registry.register(
            "imp_github_sweep_calls",
            "GitHub API calls of the last queued-job sweep, charged or revalidated (304)",
            self.sweep_calls.clone(),
        );
        registry.register(
            "imp_github_sweep_interval_seconds",
            "Wait before the next queued-job sweep, adapted to the API budget",
            self.sweep_interval.clone(),
        );
        registry.register(
            "imp_github_sweep_budget_calls_per_hour",
            "Charged GitHub API calls per hour the queued-job sweep may spend",
            self.sweep_budget.clone(),
        );
        registry.register(
            "imp_github_sweep_projected_calls_per_hour",
            "Charged calls per hour the sweep spends at its current cost and interval",
            self.sweep_projected.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_documented() {
        let m = GithubMetrics::default();
        let mut registry = Registry::default();
        m.register(&mut registry);
        let app = AppLabels { app_id: "1".into() };
        m.rate_limit_limit.get_or_create(&app).set(5000);
        m.rate_limit_remaining.get_or_create(&app).set(4000);
        m.token_exchanges.get_or_create(&app).inc();
        m.sweep_budget.get_or_create(&app).set(2500);
        m.sweep_projected.get_or_create(&app).set(0);
        m.sweep_interval.get_or_create(&app).set(60);
        m.requests
            .get_or_create(&RequestLabels {
                operation: "list_workflow_runs".into(),
                status: "3xx".into(),
            })
            .inc();
        m.errors
            .get_or_create(&ErrorLabels {
                operation: "list_workflow_runs".into(),
                error: "timeout".into(),
            })
            .inc();
        m.not_modified
            .get_or_create(&OperationLabels {
                operation: "list_workflow_runs".into(),
            })
            .inc();
        m.sweep_calls
            .get_or_create(&SweepCallLabels {
                app_id: "1".into(),
                kind: "revalidated".into(),
            })
            .set(2);
        let text = crate::metrics::encode(&registry).unwrap();
        for want in [
            "imp_github_rate_limit_limit{app_id=\"1\"} 5000",
            "imp_github_sweep_interval_seconds{app_id=\"1\"} 60",
            "imp_github_not_modified_total{operation=\"list_workflow_runs\"} 1",
            "imp_github_sweep_calls{app_id=\"1\",kind=\"revalidated\"} 2",
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        assert_eq!(
            imp_testkit::metrics::assert_every_family_documented(&text),
            12
        );
    }
}
