//! imp-agent's Prometheus metrics (listed in docs/metrics.md, "imp-agent").

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TriggerLabel {
    pub trigger: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

/// Identifies a VM's guest series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GuestLabels {
    pub vm: String,
    pub namespace: String,
    pub node: String,
}

#[derive(Clone)]
pub struct AgentMetrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    heartbeat_timestamp: Gauge<f64, std::sync::atomic::AtomicU64>,
    heartbeat_failures: Counter,
    handoffs: Family<OutcomeLabel, Counter>,
    handoff_duration: Histogram,
    runner_exits: Family<OutcomeLabel, Counter>,
    vm_failures: Family<ReasonLabel, Counter>,
    boot_latency: Histogram,
    teardowns: Counter,
    backlog: Gauge,
    reconcile_errors: Family<ErrorLabel, Counter>,
    guest_memory_used: Family<GuestLabels, Gauge>,
    guest_disk_used: Family<GuestLabels, Gauge>,
    suspends: Family<TriggerLabel, Counter>,
    resumes: Family<TriggerLabel, Counter>,
    wake_latency: Histogram,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl AgentMetrics {
    pub fn new() -> Self {
        let mut inner = Inner {
            registry: Registry::default(),
            heartbeat_timestamp: Gauge::default(),
            heartbeat_failures: Counter::default(),
            handoffs: Family::default(),
            handoff_duration: Histogram::new(exponential_buckets(0.005, 2.0, 12)),
            runner_exits: Family::default(),
            vm_failures: Family::default(),
            boot_latency: Histogram::new(exponential_buckets(0.05, 2.0, 12)),
            teardowns: Counter::default(),
            backlog: Gauge::default(),
            reconcile_errors: Family::default(),
            guest_memory_used: Family::default(),
            guest_disk_used: Family::default(),
            suspends: Family::default(),
            resumes: Family::default(),
            wake_latency: Histogram::new(exponential_buckets(0.05, 2.0, 12)),
        };
        inner.registry.register(
            "imp_vm_guest_memory_used_bytes",
            "Guest memory in use (MemTotal - MemAvailable), as the guest agent last reported it",
            inner.guest_memory_used.clone(),
        );
        inner.registry.register(
            "imp_vm_guest_disk_used_bytes",
            "Used bytes of the guest's root filesystem, as the guest agent last reported it",
            inner.guest_disk_used.clone(),
        );
        inner.registry.register(
            "imp_agent_heartbeat_timestamp_seconds",
            "Unix time of the last successful renewal of this node's heartbeat Lease",
            inner.heartbeat_timestamp.clone(),
        );
        inner.registry.register(
            "imp_agent_heartbeat_failures",
            "Failed heartbeat Lease renewals",
            inner.heartbeat_failures.clone(),
        );
        inner.registry.register(
            "imp_agent_handoffs",
            "Runner handoffs by outcome (started, ambiguous, spawn_failed, config_missing)",
            inner.handoffs.clone(),
        );
        inner.registry.register(
            "imp_agent_handoff_duration_seconds",
            "JIT Secret read to the guest's Started",
            inner.handoff_duration.clone(),
        );
        inner.registry.register(
            "imp_agent_runner_exits",
            "Runner processes that ended, by outcome (succeeded, failed)",
            inner.runner_exits.clone(),
        );
        inner.registry.register(
            "imp_agent_vm_failures",
            "ImpVMs this agent marked Failed, by reason",
            inner.vm_failures.clone(),
        );
        inner.registry.register(
            "imp_agent_vm_boot_seconds",
            "Firecracker spawn to guest Hello as reported by imp-runtime for VMs this agent started",
            inner.boot_latency.clone(),
        );
        inner.registry.register(
            "imp_agent_teardowns",
            "Teardowns recorded with TornDown=True",
            inner.teardowns.clone(),
        );
        inner.registry.register(
            "imp_agent_backlog_vms",
            "ImpVMs bound to this node and not yet Running (Scheduled or Starting)",
            inner.backlog.clone(),
        );
        inner.registry.register(
            "imp_agent_reconcile_errors",
            "Reconcile passes that failed (retried), by error",
            inner.reconcile_errors.clone(),
        );
        inner.registry.register(
            "imp_agent_vm_suspends",
            "VMs this agent brought to Suspended, by trigger (requested, idle)",
            inner.suspends.clone(),
        );
        inner.registry.register(
            "imp_agent_vm_resumes",
            "Suspended VMs this agent brought back to Running, by trigger (requested, traffic = ScaleToZero wakes, disabled, not_allowed)",
            inner.resumes.clone(),
        );
        inner.registry.register(
            "imp_agent_vm_wake_seconds",
            "ScaleToZero wakes: first sight of a risen wake counter to phase Running",
            inner.wake_latency.clone(),
        );
        Self {
            inner: Arc::new(inner),
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.inner.registry)
            .expect("encoding to a String cannot fail");
        out
    }

    pub fn heartbeat_ok(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or_default();
        self.inner.heartbeat_timestamp.set(now);
    }
    pub fn heartbeat_failed(&self) {
        self.inner.heartbeat_failures.inc();
    }
    pub fn handoff(&self, outcome: &str) {
        self.inner
            .handoffs
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }
    pub fn handoff_duration(&self, secs: f64) {
        self.inner.handoff_duration.observe(secs);
    }
    pub fn runner_exit(&self, outcome: &str) {
        self.inner
            .runner_exits
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }
    pub fn vm_failed(&self, reason: &str) {
        self.inner
            .vm_failures
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }
    pub fn boot(&self, secs: f64) {
        self.inner.boot_latency.observe(secs);
    }
    pub fn teardown(&self) {
        self.inner.teardowns.inc();
    }
    pub fn backlog(&self, n: i64) {
        self.inner.backlog.set(n);
    }
    pub fn guest(&self, labels: &GuestLabels, memory_used: u64, disk_used: u64) {
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.inner
            .guest_memory_used
            .get_or_create(labels)
            .set(clamp(memory_used));
        self.inner
            .guest_disk_used
            .get_or_create(labels)
            .set(clamp(disk_used));
    }

    /// Drops a VM's guest series (the VM left Running or is gone).
    pub fn forget_guest(&self, labels: &GuestLabels) {
        self.inner.guest_memory_used.remove(labels);
        self.inner.guest_disk_used.remove(labels);
    }

    pub fn suspended(&self, trigger: &str) {
        self.inner
            .suspends
            .get_or_create(&TriggerLabel {
                trigger: trigger.to_owned(),
            })
            .inc();
    }

    pub fn resumed(&self, trigger: &str) {
        self.inner
            .resumes
            .get_or_create(&TriggerLabel {
                trigger: trigger.to_owned(),
            })
            .inc();
    }

    pub fn wake(&self, secs: f64) {
        self.inner.wake_latency.observe(secs);
    }

    /// A failed reconcile pass; `error` is [`crate::context::Error::metric_label`].
    pub fn reconcile_error(&self, error: &'static str) {
        self.inner
            .reconcile_errors
            .get_or_create(&ErrorLabel {
                error: error.into(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_exported_and_documented() {
        let m = AgentMetrics::new();
        m.heartbeat_ok();
        m.heartbeat_failed();
        m.handoff("started");
        m.handoff_duration(0.1);
        m.runner_exit("succeeded");
        m.vm_failed(imp_api::names::reason::HANDOFF_AMBIGUOUS);
        m.boot(0.5);
        m.teardown();
        m.backlog(2);
        m.reconcile_error("kube_api");
        m.suspended("idle");
        m.resumed("traffic");
        m.wake(0.7);
        let labels = GuestLabels {
            vm: "v".into(),
            namespace: "ns".into(),
            node: "n".into(),
        };
        m.guest(&labels, 1024, 2048);
        let text = m.encode();
        for want in [
            "imp_agent_heartbeat_failures_total 1",
            "imp_agent_handoffs_total{outcome=\"started\"} 1",
            "imp_agent_handoff_duration_seconds_count 1",
            "imp_agent_runner_exits_total{outcome=\"succeeded\"} 1",
            "imp_agent_vm_failures_total{reason=\"HandoffAmbiguous\"} 1",
            "imp_agent_vm_boot_seconds_count 1",
            "imp_agent_teardowns_total 1",
            "imp_agent_backlog_vms 2",
            "imp_agent_reconcile_errors_total{error=\"kube_api\"} 1",
            "imp_agent_vm_suspends_total{trigger=\"idle\"} 1",
            "imp_agent_vm_resumes_total{trigger=\"traffic\"} 1",
            "imp_agent_vm_wake_seconds_count 1",
            "imp_vm_guest_memory_used_bytes{vm=\"v\",namespace=\"ns\",node=\"n\"} 1024",
            "imp_vm_guest_disk_used_bytes{vm=\"v\",namespace=\"ns\",node=\"n\"} 2048",
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        assert!(
            text.contains("imp_agent_heartbeat_timestamp_seconds 1"),
            "{text}"
        );
        assert_eq!(
            imp_testkit::metrics::assert_every_family_documented(&text),
            15,
            "{text}"
        );
        m.forget_guest(&labels);
        assert!(!m.encode().contains("vm=\"v\""));
    }
}
