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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_exported_and_documented() {
        let m = Metrics::new();
        m.boot_latency.observe(0.2);
        m.ready.set(1);
        m.vms
            .get_or_create(&StateLabel {
                state: "Running".into(),
            })
            .set(3);
        m.start_failures
            .get_or_create(&ReasonLabel {
                reason: "KernelMissing".into(),
            })
            .inc();
        m.recovered("reattached");
        let text = m.encode();
        for want in [
            "imp_vm_boot_latency_seconds_count 1",
            "imp_runtime_ready 1",
            "imp_runtime_vms{state=\"Running\"} 3",
            "imp_vm_start_failures_total{reason=\"KernelMissing\"} 1",
            "imp_runtime_recovered_vms_total{outcome=\"reattached\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        let docs = include_str!("../../docs/metrics.md");
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .collect();
        assert_eq!(families.len(), 5, "{text}");
        for line in families {
            let family = line.split_whitespace().next().unwrap();
            let documented = if line.ends_with(" counter") {
                format!("{family}_total")
            } else {
                family.to_owned()
            };
            assert!(
                docs.contains(&format!("`{documented}`")),
                "{documented} is not in docs/metrics.md"
            );
        }
    }
}
