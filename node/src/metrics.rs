//! imp-runtime's Prometheus metrics (listed in docs/metrics.md).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

pub struct Metrics {
    registry: Registry,
    pub boot_latency: Histogram,
    pub ready: Gauge,
    pub vms: Family<StateLabel, Gauge>,
    pub start_failures: Family<ReasonLabel, Counter>,
    pub recovered: Family<OutcomeLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        // 50 ms .. ~100 s: simulator boots land low, real guests around a second.
        let boot_latency = Histogram::new(
            prometheus_client::metrics::histogram::exponential_buckets(0.05, 2.0, 12),
        );
        let ready = Gauge::default();
        let vms = Family::<StateLabel, Gauge>::default();
        let start_failures = Family::<ReasonLabel, Counter>::default();
        let recovered = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "imp_vm_boot_latency_seconds",
            "Firecracker spawn to guest agent Hello",
            boot_latency.clone(),
        );
        registry.register(
            "imp_runtime_ready",
            "1 when KVM is usable and the Firecracker binary and kernel are present",
            ready.clone(),
        );
        registry.register(
            "imp_runtime_vms",
            "VMs in the inventory by state",
            vms.clone(),
        );
        registry.register(
            "imp_vm_start_failures",
            "VM starts that failed, by reason",
            start_failures.clone(),
        );
        registry.register(
            "imp_runtime_recovered_vms",
            "Inventory records handled at startup, by outcome (reattached, cleaned, exited, orphan_killed)",
            recovered.clone(),
        );
        Self {
            registry,
            boot_latency,
            ready,
            vms,
            start_failures,
            recovered,
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("encoding to a String cannot fail");
        out
    }

    pub fn recovered(&self, outcome: &str) {
        self.recovered
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }
}
