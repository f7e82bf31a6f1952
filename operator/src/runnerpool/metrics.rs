//! Prometheus metrics of the runner pools and the webhook receiver (listed in docs/metrics.md).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::metrics::{ControllerLabels, ErrorLabels, PhaseLabels, ReasonLabels, ResultLabels};

/// Values of the `state` label of `imp_runner_pool_runners`.
pub const STATES: [&str; 5] = ["desired", "idle", "busy", "booting", "total"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolStateLabels {
    /// `namespace/name`.
    pub pool: String,
    /// `desired`, `idle`, `busy`, `booting`, `total`.
    pub state: String,
}

/// Runner pool metrics. Clones share the series.
#[derive(Clone)]
pub struct PoolMetrics {
    /// `imp_runner_pool_runners{pool,state}`.
    pub runners: Family<PoolStateLabels, Gauge>,
    /// `imp_runner_jit_mint_duration_seconds`: successful mints, as the pool saw them.
    pub jit_mint_duration: Histogram,
    /// `imp_runner_jit_mint_errors_total{reason}`.
    pub jit_mint_errors: Family<ReasonLabels, Counter>,
    /// `imp_webhook_deliveries_total{result}`.
    pub webhook_deliveries: Family<ResultLabels, Counter>,
    /// `imp_webhook_signature_checks_total`: HMACs computed over delivery bodies (a delivery to a
    /// pool's own path costs one; to the shared path, one per distinct secret until one matches).
    pub webhook_signature_checks: Counter,
    /// `imp_webhook_signature_checks_in_flight`: deliveries being read and checked now (at most
    /// `--webhook-concurrent-checks`).
    pub webhook_checks_in_flight: Gauge,
    /// `imp_runner_job_pickup_latency_seconds`: queued job learnt -> a runner Started for it.
    pub job_pickup_latency: Histogram,
    /// `imp_runner_deregistrations_total{result}`: `deleted`, `already_gone`, `busy`, `error`.
    pub deregistrations: Family<ResultLabels, Counter>,
    /// `imp_runner_vm_start_failures_total{reason}`: runner VMs that failed before their runner
    /// started, by the VM's failure reason.
    pub vm_start_failures: Family<ReasonLabels, Counter>,
    /// `imp_runner_vm_starts_total{from,fallback}`: runner VMs started, `boot` or `clone`, with the
    /// reason a VM asked to start from a template booted (`none` when it did not fall back).
    pub vm_starts: Family<StartLabels, Counter>,
    /// `imp_runner_deadline_replacements_total{reason}`: `BootDeadlineExceeded`, `RunnerNeverOnline`.
    pub deadline_replacements: Family<ReasonLabels, Counter>,
    /// `imp_runner_orphans_reaped_total`: registrations without a VM deleted by the reaper.
    pub orphans_reaped: Counter,
    /// `imp_runner_vm_phase_seconds{phase}`: time finished runner VMs spent per phase
    /// ([`super::decide::VM_PHASES`]).
    pub vm_phase: Family<PhaseLabels, Histogram>,
    /// `imp_runner_job_phase_seconds{phase}`: how long served jobs waited for each step
    /// ([`super::slo::JOB_PHASES`]).
    pub job_phase: Family<PhaseLabels, Histogram>,
    /// `imp_runner_job_wait_seconds`: served jobs, queued -> picked up by a runner.
    pub job_wait: Histogram,
    /// The operator's reconcile metrics (`imp_operator_reconcile_*`), shared with the VM controller by
    /// [`PoolMetrics::sharing_reconcile`]; registered there, not here.
    pub reconcile_duration: Family<ControllerLabels, Histogram>,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    /// `imp_runner_demand_jobs_evicted_total`, `imp_runner_demand_jobs` (issue 16b).
    pub demand: super::demand::DemandMetrics,
    /// `imp_runner_version_days_left{pool}`: days of GitHub's 30 left to the pool's superseded
    /// runner version (0 when deprecated; absent while current or unknown).
    pub version_days_left: Family<PoolLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// `imp_runner_version_refusals_total{pool,verdict}`: runners GitHub refused (exit code 7),
    /// `deprecated` or `outage`.
    pub version_refusals: Family<RefusalLabels, Counter>,
    /// `imp_runner_pool_minting_stopped{pool}`: 1 while a deprecated refusal stops the pool's minting.
    pub minting_stopped: Family<PoolLabels, Gauge>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StartLabels {
    /// `boot` or `clone`.
    pub from: String,
    /// The fallback reason (`TemplateMissing`, ...) or `none`.
    pub fallback: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// `namespace/name`.
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub pool: String,
    /// `deprecated` or `outage`.
    pub verdict: String,
}

impl Default for PoolMetrics {
    fn default() -> Self {
        PoolMetrics {
            runners: Family::default(),
            jit_mint_duration: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            jit_mint_errors: Family::default(),
            webhook_deliveries: Family::default(),
            webhook_signature_checks: Counter::default(),
            webhook_checks_in_flight: Gauge::default(),
            // 0.25 s .. ~34 min: cold boots take seconds, a saturated pool minutes.
            job_pickup_latency: Histogram::new(exponential_buckets(0.25, 2.0, 14)),
            deregistrations: Family::default(),
            vm_start_failures: Family::default(),
            vm_starts: Family::default(),
            deadline_replacements: Family::default(),
            orphans_reaped: Counter::default(),
            // 0.1 s .. ~27 min: scheduling takes milliseconds, boots seconds, jobs minutes.
            vm_phase: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.1, 2.0, 14))
            }),
            // 0.05 s .. ~55 min: a mint takes milliseconds, a boot seconds, a run up to an hour.
            job_phase: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.05, 2.0, 17))
            }),
            job_wait: Histogram::new(exponential_buckets(0.05, 2.0, 17)),
            reconcile_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 14))
            }),
            reconcile_errors: Family::default(),
            demand: Default::default(),
            version_days_left: Family::default(),
            version_refusals: Family::default(),
            minting_stopped: Family::default(),
        }
    }
}

impl PoolMetrics {
    /// Pool metrics whose reconcile duration and errors land in the VM controller's series (labelled
    /// `controller="impvmrunnerpool"`).
    pub fn sharing_reconcile(vm: &crate::metrics::VmMetrics) -> Self {
        PoolMetrics {
            reconcile_duration: vm.reconcile_duration.clone(),
            reconcile_errors: vm.reconcile_errors.clone(),
            ..PoolMetrics::default()
        }
    }

    pub fn reconcile_failed(&self, controller: &str, error: &crate::error::Error) {
        crate::metrics::count_reconcile_error(&self.reconcile_errors, controller, error);
    }

    pub fn reconcile_took(&self, controller: &str, d: std::time::Duration) {
        self.reconcile_duration
            .get_or_create(&ControllerLabels {
                controller: controller.to_owned(),
            })
            .observe(d.as_secs_f64());
    }

    pub fn deadline_replacement(&self, reason: &str) {
        self.deadline_replacements
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn orphan_reaped(&self) {
        self.orphans_reaped.inc();
    }

    pub fn vm_phase(&self, phase: &str, d: std::time::Duration) {
        self.vm_phase
            .get_or_create(&PhaseLabels {
                phase: phase.to_owned(),
            })
            .observe(d.as_secs_f64());
    }

    pub fn vm_started(&self, s: &super::starts::Start) {
        self.vm_starts
            .get_or_create(&StartLabels {
                from: s.from.to_owned(),
                fallback: s.fallback.clone(),
            })
            .inc();
    }

    pub fn job_phase(&self, phase: &str, d: std::time::Duration) {
        self.job_phase
            .get_or_create(&PhaseLabels {
                phase: phase.to_owned(),
            })
            .observe(d.as_secs_f64());
    }

    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "imp_runner_pool_runners",
            "Runner VMs of each pool by state (desired, idle, busy, booting, total)",
            self.runners.clone(),
        );
        registry.register(
            "imp_runner_jit_mint_duration_seconds",
            "Latency of successful JIT runner config mints by the pool controller",
            self.jit_mint_duration.clone(),
        );
        registry.register(
            "imp_runner_vm_start_failures",
            "Runner VMs that failed before their runner started, by reason (the pool backs off)",
            self.vm_start_failures.clone(),
        );
        registry.register(
            "imp_runner_vm_starts",
            "Runner VMs started, by how (boot, clone) and the reason a clone asked for fell back to a boot (none)",
            self.vm_starts.clone(),
        );
        registry.register(
            "imp_runner_jit_mint_errors",
            "Failed JIT runner config mints, by GitHub error",
            self.jit_mint_errors.clone(),
        );
        registry.register(
            "imp_webhook_deliveries",
            "GitHub webhook deliveries by result",
            self.webhook_deliveries.clone(),
        );
        registry.register(
            "imp_webhook_signature_checks",
            "HMAC-SHA256 checks of webhook delivery bodies",
            self.webhook_signature_checks.clone(),
        );
        registry.register(
            "imp_webhook_signature_checks_in_flight",
            "Webhook deliveries being read and signature-checked now (bounded by --webhook-concurrent-checks)",
            self.webhook_checks_in_flight.clone(),
        );
        registry.register(
            "imp_runner_job_pickup_latency_seconds",
            "Time from learning of a queued job to a runner of its pool reaching Started",
            self.job_pickup_latency.clone(),
        );
        registry.register(
            "imp_runner_deadline_replacements",
            "Runner VMs replaced past a deadline, by reason (BootDeadlineExceeded, RunnerNeverOnline)",
            self.deadline_replacements.clone(),
        );
        registry.register(
            "imp_runner_vm_phase_seconds",
            "Time finished runner VMs spent per phase (scheduling, booting, handoff, job)",
            self.vm_phase.clone(),
        );
        registry.register(
            "imp_runner_job_phase_seconds",
            "Time served workflow jobs waited per step (vm_create, mint, schedule, boot, restore, reidentify, runner_start, pickup, run)",
            self.job_phase.clone(),
        );
        registry.register(
            "imp_runner_job_wait_seconds",
            "Time from a workflow job queued to a runner of its pool picking it up",
            self.job_wait.clone(),
        );
        registry.register(
            "imp_runner_orphans_reaped",
            "GitHub runner registrations without a VM deleted by the reaper",
            self.orphans_reaped.clone(),
        );
        registry.register(
            "imp_runner_deregistrations",
            "GitHub runner deregistrations by result",
            self.deregistrations.clone(),
        );
        registry.register(
            "imp_runner_version_days_left",
            "Days left before GitHub stops giving jobs to the pool's superseded runner version (0: deprecated)",
            self.version_days_left.clone(),
        );
        registry.register(
            "imp_runner_version_refusals",
            "Runners of the pool GitHub refused as deprecated (exit code 7), by verdict (deprecated, outage)",
            self.version_refusals.clone(),
        );
        registry.register(
            "imp_runner_pool_minting_stopped",
            "1 while the pool mints no runner because GitHub refused its runner version as deprecated",
            self.minting_stopped.clone(),
        );
        self.demand.register(registry);
    }

    /// The freshness gauges of a pool: days left (None: removed) and whether minting is stopped.
    pub fn set_freshness(&self, pool: &str, days_left: Option<f64>, stopped: bool) {
        let key = PoolLabels {
            pool: pool.to_owned(),
        };
        match days_left {
            Some(d) => {
                self.version_days_left.get_or_create(&key).set(d);
            }
            None => {
                self.version_days_left.remove(&key);
            }
        }
        self.minting_stopped
            .get_or_create(&key)
            .set(i64::from(stopped));
    }

    pub fn version_refused(&self, pool: &str, verdict: &str) {
        self.version_refusals
            .get_or_create(&RefusalLabels {
                pool: pool.to_owned(),
                verdict: verdict.to_owned(),
            })
            .inc();
    }

    pub fn delivery(&self, result: &str) {
        self.webhook_deliveries
            .get_or_create(&ResultLabels {
                result: result.to_owned(),
            })
            .inc();
    }

    pub fn deregistration(&self, result: &str) {
        self.deregistrations
            .get_or_create(&ResultLabels {
                result: result.to_owned(),
            })
            .inc();
    }

    pub fn set_pool(&self, pool: &str, state: &str, value: u32) {
        self.runners
            .get_or_create(&PoolStateLabels {
                pool: pool.to_owned(),
                state: state.to_owned(),
            })
            .set(i64::from(value));
    }

    pub fn remove_pool(&self, pool: &str) {
        let key = PoolLabels {
            pool: pool.to_owned(),
        };
        self.version_days_left.remove(&key);
        self.minting_stopped.remove(&key);
        for verdict in ["deprecated", "outage"] {
            self.version_refusals.remove(&RefusalLabels {
                pool: pool.to_owned(),
                verdict: verdict.to_owned(),
            });
        }
        for state in STATES {
            self.runners.remove(&PoolStateLabels {
                pool: pool.to_owned(),
                state: state.to_owned(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exported_under_documented_names() {
        let m = PoolMetrics::default();
        let mut registry = Registry::default();
        m.register(&mut registry);
        m.set_pool("ns/p", "idle", 3);
        m.delivery("accepted");
        m.deregistration("deleted");
        m.jit_mint_errors
            .get_or_create(&ReasonLabels {
                reason: "server_error".into(),
            })
            .inc();
        m.jit_mint_duration.observe(0.1);
        m.job_pickup_latency.observe(2.0);
        m.vm_start_failures
            .get_or_create(&ReasonLabels {
                reason: imp_api::names::reason::ROOTFS_REJECTED.into(),
            })
            .inc();
        m.deadline_replacement(imp_api::names::reason::RUNNER_NEVER_ONLINE);
        m.orphan_reaped();
        m.vm_started(&super::super::starts::Start {
            from: "clone",
            fallback: super::super::starts::NO_FALLBACK.into(),
        });
        m.vm_phase("booting", std::time::Duration::from_secs(3));
        m.job_phase("pickup", std::time::Duration::from_secs(1));
        m.job_wait.observe(4.0);
        m.set_freshness("ns/p", Some(6.5), true);
        m.version_refused("ns/p", "deprecated");
        let text = crate::metrics::encode(&registry).unwrap();
        for want in [
            "imp_runner_pool_runners{pool=\"ns/p\",state=\"idle\"} 3",
            "imp_webhook_deliveries_total{result=\"accepted\"} 1",
            "imp_runner_jit_mint_errors_total{reason=\"server_error\"} 1",
            "imp_runner_jit_mint_duration_seconds_count 1",
            "imp_runner_job_pickup_latency_seconds_count 1",
            "imp_runner_deregistrations_total{result=\"deleted\"} 1",
            "imp_runner_vm_start_failures_total{reason=\"RootfsRejected\"} 1",
            "imp_runner_deadline_replacements_total{reason=\"RunnerNeverOnline\"} 1",
            "imp_runner_orphans_reaped_total 1",
            "imp_runner_vm_starts_total{from=\"clone\",fallback=\"none\"} 1",
            "imp_runner_vm_phase_seconds_count{phase=\"booting\"} 1",
            "imp_runner_job_phase_seconds_count{phase=\"pickup\"} 1",
            "imp_runner_job_wait_seconds_count 1",
            "imp_runner_version_days_left{pool=\"ns/p\"} 6.5",
            "imp_runner_pool_minting_stopped{pool=\"ns/p\"} 1",
            "imp_runner_version_refusals_total{pool=\"ns/p\",verdict=\"deprecated\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        imp_testkit::metrics::assert_every_family_documented(&text);
        m.remove_pool("ns/p");
        let text = crate::metrics::encode(&registry).unwrap();
        assert!(!text.contains("pool=\"ns/p\""));
    }
}
