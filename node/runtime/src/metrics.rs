//! imp-runtime's Prometheus metrics (listed in docs/metrics.md).

use prometheus_client::encoding::EncodeLabelSet;

use crate::rootfs::egress::AddressClassLabel;
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
pub struct BackendLabel {
    pub backend: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

pub struct Metrics {
    registry: Registry,
    pub boot_latency: Histogram,
    /// By VMM backend (one series: the node's backend).
    pub ready: Family<BackendLabel, Gauge>,
    pub vms: Family<StateLabel, Gauge>,
    pub start_failures: Family<ReasonLabel, Counter>,
    pub recovered: Family<OutcomeLabel, Counter>,
    /// Network reconciles (docs/network.md) that failed, by the failing step.
    pub network_setup_failures: Family<ReasonLabel, Counter>,
    pub rootfs: RootfsMetrics,
    /// Successful suspends (request to VMM gone) and resumes (request to Hello), by backend.
    pub suspend_seconds: Family<BackendLabel, Histogram, fn() -> Histogram>,
    pub resume_seconds: Family<BackendLabel, Histogram, fn() -> Histogram>,
    /// Suspends and resumes that failed, by operation and reason.
    pub suspend_failures: Family<OperationReasonLabel, Counter>,
    /// Bytes of suspend snapshots on disk (every Suspended VM's).
    pub snapshot_bytes: Gauge,
    /// Template builds by outcome (`built`, `failed`, `evicted`).
    pub template_builds: Family<OutcomeLabel, Counter>,
    /// Allocated bytes and number of ready templates.
    pub template_bytes: Gauge,
    pub templates: Gauge,
    /// `from_template` starts by outcome: `cloned`, or the fallback reason.
    pub restores: Family<OutcomeLabel, Counter>,
    /// Clones: fresh VMM to the restored guest agent's Hello.
    pub restore_seconds: Histogram,
    /// Clones whose `Reidentify` failed, by kind (`evidence`, `refused`, `timeout`,
    /// `connection`).
    pub reidentify_failures: Family<ReasonLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct OperationReasonLabel {
    pub operation: String,
    pub reason: String,
}

/// 50 ms .. ~100 s: a simulator suspend is milliseconds, a TCG guest's migration many seconds.
fn suspend_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.05, 2.0, 12,
    ))
}

/// The rootfs cache (node/runtime/src/rootfs): shared by the runtime and its image store.
#[derive(Clone)]
pub struct RootfsMetrics {
    pub hits: Counter,
    pub misses: Counter,
    pub build_duration: Histogram,
    pub build_failures: Family<ReasonLabel, Counter>,
    /// Connections of image pulls refused by the egress policy, by address class.
    pub pull_refusals: Family<AddressClassLabel, Counter>,
    pub cache_bytes: Gauge,
    pub cache_images: Gauge,
    pub evictions: Counter,
    /// `POST /v1/images` answers: `built`, `cached` (already there) or `failed`.
    pub prebuilds: Family<OutcomeLabel, Counter>,
    /// Pre-builds being resolved or built right now.
    pub prebuilds_in_progress: Gauge,
}

impl RootfsMetrics {
    fn new() -> Self {
        Self {
            // 0.25 s .. ~17 min: a cached-layer rebuild is seconds, a cold multi-GiB pull minutes.
            build_duration: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.25, 2.0, 13),
            ),
            hits: Counter::default(),
            misses: Counter::default(),
            build_failures: Family::default(),
            pull_refusals: Family::default(),
            cache_bytes: Gauge::default(),
            cache_images: Gauge::default(),
            evictions: Counter::default(),
            prebuilds: Family::default(),
            prebuilds_in_progress: Gauge::default(),
        }
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "imp_rootfs_cache_hits",
            "VM starts whose base image was already in the rootfs cache",
            self.hits.clone(),
        );
        registry.register(
            "imp_rootfs_cache_misses",
            "VM starts that had to build their base image (pull, flatten, mkfs)",
            self.misses.clone(),
        );
        registry.register(
            "imp_rootfs_build_duration_seconds",
            "Successful base image builds, from resolve to the renamed ext4 file",
            self.build_duration.clone(),
        );
        registry.register(
            "imp_rootfs_build_failures",
            "Base image builds that failed, by reason",
            self.build_failures.clone(),
        );
        registry.register(
            "imp_rootfs_pull_refused_connections",
            "Connections of image pulls refused: the node's own, loopback, link-local, unspecified or multicast address, by class",
            self.pull_refusals.clone(),
        );
        registry.register(
            "imp_rootfs_cache_bytes",
            "Bytes of base images in the rootfs cache",
            self.cache_bytes.clone(),
        );
        registry.register(
            "imp_rootfs_cache_images",
            "Base images in the rootfs cache",
            self.cache_images.clone(),
        );
        registry.register(
            "imp_rootfs_cache_evictions",
            "Unreferenced base images deleted to keep the cache under its size budget",
            self.evictions.clone(),
        );
        registry.register(
            "imp_rootfs_prebuilds",
            "Base images built ahead of their first VM (POST /v1/images), by outcome",
            self.prebuilds.clone(),
        );
        registry.register(
            "imp_rootfs_prebuilds_in_progress",
            "Pre-builds being resolved or built now",
            self.prebuilds_in_progress.clone(),
        );
    }
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
        let ready = Family::<BackendLabel, Gauge>::default();
        let vms = Family::<StateLabel, Gauge>::default();
        let start_failures = Family::<ReasonLabel, Counter>::default();
        let recovered = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "imp_vm_boot_latency_seconds",
            "VMM spawn to guest agent Hello",
            boot_latency.clone(),
        );
        registry.register(
            "imp_runtime_ready",
            "1 when the node's VMM backend can run VMs (its binaries and the kernel are present; KVM for Firecracker), by backend",
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
        let network_setup_failures = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "imp_network_setup_failures",
            "Network reconciles (bridge, TAP ports, nft rules) that failed, by failing step",
            network_setup_failures.clone(),
        );
        let rootfs = RootfsMetrics::new();
        rootfs.register(&mut registry);
        let suspend_seconds =
            Family::<BackendLabel, Histogram, fn() -> Histogram>::new_with_constructor(
                suspend_histogram as fn() -> Histogram,
            );
        let resume_seconds =
            Family::<BackendLabel, Histogram, fn() -> Histogram>::new_with_constructor(
                suspend_histogram as fn() -> Histogram,
            );
        let suspend_failures = Family::<OperationReasonLabel, Counter>::default();
        let snapshot_bytes = Gauge::default();
        registry.register(
            "imp_runtime_suspend_seconds",
            "Successful suspends, from the request to the VMM gone (snapshot written), by backend",
            suspend_seconds.clone(),
        );
        registry.register(
            "imp_runtime_resume_seconds",
            "Successful resumes, from the request to the guest agent's Hello on the new VMM, by backend",
            resume_seconds.clone(),
        );
        registry.register(
            "imp_runtime_suspend_failures",
            "Suspends and resumes that failed, by operation (suspend, resume) and reason",
            suspend_failures.clone(),
        );
        registry.register(
            "imp_runtime_snapshot_bytes",
            "Bytes on disk of the snapshots of every Suspended VM",
            snapshot_bytes.clone(),
        );
        let template_builds = Family::<OutcomeLabel, Counter>::default();
        let template_bytes = Gauge::default();
        let templates = Gauge::default();
        let restores = Family::<OutcomeLabel, Counter>::default();
        let restore_seconds = suspend_histogram();
        let reidentify_failures = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "imp_runtime_template_builds",
            "VM template builds (boot, warm, snapshot), by outcome (built, failed, evicted)",
            template_builds.clone(),
        );
        registry.register(
            "imp_runtime_template_bytes",
            "Bytes on disk (allocated) of the ready VM templates",
            template_bytes.clone(),
        );
        registry.register(
            "imp_runtime_templates",
            "Ready VM templates on this node",
            templates.clone(),
        );
        registry.register(
            "imp_runtime_template_restores",
            "from_template VM starts, by outcome (cloned, or the fallback reason of a cold boot)",
            restores.clone(),
        );
        registry.register(
            "imp_runtime_restore_seconds",
            "Clones: from the fresh VMM's start to the restored guest agent's Hello",
            restore_seconds.clone(),
        );
        registry.register(
            "imp_runtime_reidentify_failures",
            "Clones whose Reidentify failed (they end Failed), by kind (evidence, refused, timeout, connection)",
            reidentify_failures.clone(),
        );
        Self {
            template_builds,
            template_bytes,
            templates,
            restores,
            restore_seconds,
            reidentify_failures,
            suspend_seconds,
            resume_seconds,
            suspend_failures,
            snapshot_bytes,
            network_setup_failures,
            registry,
            rootfs,
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
        m.ready
            .get_or_create(&BackendLabel {
                backend: "qemu".into(),
            })
            .set(1);
        m.vms
            .get_or_create(&StateLabel {
                state: "Running".into(),
            })
            .set(3);
        m.start_failures
            .get_or_create(&ReasonLabel {
                reason: imp_api::names::reason::KERNEL_MISSING.into(),
            })
            .inc();
        m.recovered("reattached");
        m.network_setup_failures
            .get_or_create(&ReasonLabel {
                reason: "no_egress".into(),
            })
            .inc();
        m.rootfs.hits.inc();
        m.rootfs.misses.inc();
        m.rootfs.build_duration.observe(3.0);
        m.rootfs
            .build_failures
            .get_or_create(&ReasonLabel {
                reason: imp_api::names::reason::ROOTFS_REJECTED.into(),
            })
            .inc();
        m.rootfs.cache_bytes.set(1 << 20);
        m.rootfs.cache_images.set(1);
        m.rootfs.evictions.inc();
        m.rootfs
            .prebuilds
            .get_or_create(&OutcomeLabel {
                outcome: "built".into(),
            })
            .inc();
        m.rootfs.prebuilds_in_progress.set(2);
        let fc = BackendLabel {
            backend: "firecracker".into(),
        };
        m.suspend_seconds.get_or_create(&fc).observe(0.1);
        m.resume_seconds.get_or_create(&fc).observe(0.1);
        m.suspend_failures
            .get_or_create(&OperationReasonLabel {
                operation: "resume".into(),
                reason: imp_api::names::reason::RESUME_FAILED.into(),
            })
            .inc();
        m.snapshot_bytes.set(4096);
        m.template_builds
            .get_or_create(&OutcomeLabel {
                outcome: "built".into(),
            })
            .inc();
        m.template_bytes.set(8192);
        m.templates.set(1);
        m.restores
            .get_or_create(&OutcomeLabel {
                outcome: "cloned".into(),
            })
            .inc();
        m.restore_seconds.observe(0.5);
        m.reidentify_failures
            .get_or_create(&ReasonLabel {
                reason: "evidence".into(),
            })
            .inc();
        let text = m.encode();
        for want in [
            "imp_vm_boot_latency_seconds_count 1",
            "imp_runtime_ready{backend=\"qemu\"} 1",
            "imp_runtime_vms{state=\"Running\"} 3",
            "imp_vm_start_failures_total{reason=\"KernelMissing\"} 1",
            "imp_runtime_recovered_vms_total{outcome=\"reattached\"} 1",
            "imp_network_setup_failures_total{reason=\"no_egress\"} 1",
            "imp_rootfs_cache_hits_total 1",
            "imp_runtime_suspend_seconds_count{backend=\"firecracker\"} 1",
            "imp_runtime_resume_seconds_count{backend=\"firecracker\"} 1",
            "imp_runtime_suspend_failures_total{operation=\"resume\",reason=\"ResumeFailed\"} 1",
            "imp_runtime_snapshot_bytes 4096",
            "imp_runtime_template_builds_total{outcome=\"built\"} 1",
            "imp_runtime_template_bytes 8192",
            "imp_runtime_templates 1",
            "imp_runtime_template_restores_total{outcome=\"cloned\"} 1",
            "imp_runtime_restore_seconds_count 1",
            "imp_runtime_reidentify_failures_total{reason=\"evidence\"} 1",
            "imp_rootfs_cache_misses_total 1",
            "imp_rootfs_build_duration_seconds_count 1",
            "imp_rootfs_build_failures_total{reason=\"RootfsRejected\"} 1",
            "imp_rootfs_cache_bytes 1048576",
            "imp_rootfs_cache_images 1",
            "imp_rootfs_prebuilds_total{outcome=\"built\"} 1",
            "imp_rootfs_prebuilds_in_progress 2",
            "imp_rootfs_cache_evictions_total 1",
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        assert_eq!(
            imp_testkit::metrics::assert_every_family_documented(&text),
            25,
            "{text}"
        );
    }
}
