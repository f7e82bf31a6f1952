//! The node's capacity for VMs, published on its Node as annotations the scheduler reads
//! (`imp.dev/capacity-vcpu`, `-memory-mib`, `-disk-mib`; docs/vm-lifecycle.md rule 6): vCPU and
//! memory from the host (or the operator's settings), disk from imp-runtime's writable-drive
//! budget (`GET /v1/capacity`). Published with each heartbeat, when it changed: a runtime
//! restarted with another budget is followed within one heartbeat interval.

use std::collections::BTreeMap;

use imp_api::names::{
    ANNOTATION_CAPACITY_DISK_MIB, ANNOTATION_CAPACITY_MEMORY_MIB, ANNOTATION_CAPACITY_VCPU,
};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};

const MIB: u64 = 1 << 20;

/// What the operator of the node sets (flags); unset values come from the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapacityConfig {
    /// vCPUs offered to VMs; default: the host's online CPUs.
    pub vcpu: Option<u32>,
    /// MiB offered to VMs; default: the host's MemTotal minus `reserved_memory_mib`.
    pub memory_mib: Option<u64>,
    /// MiB kept for the host (kubelet, imp-runtime, the VMMs' own memory) when memory is derived.
    pub reserved_memory_mib: u64,
}

impl Default for CapacityConfig {
    fn default() -> Self {
        Self {
            vcpu: None,
            memory_mib: None,
            reserved_memory_mib: 1024,
        }
    }
}

/// The host's size as the kernel reports it (None where it could not be read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostFacts {
    pub cpus: Option<u32>,
    pub memory_mib: Option<u64>,
}

impl HostFacts {
    /// `/sys/devices/system/cpu/online` and `/proc/meminfo`: the host's, also in a container (a
    /// cgroup CPU quota of the agent's own pod says nothing about what VMs may use).
    pub fn read() -> Self {
        Self {
            cpus: std::fs::read_to_string("/sys/devices/system/cpu/online")
                .ok()
                .and_then(|s| parse_cpu_list(&s)),
            memory_mib: std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|s| parse_mem_total_mib(&s)),
        }
    }
}

/// Number of CPUs in a kernel CPU list (`0-3,6,8-9` -> 7).
pub fn parse_cpu_list(s: &str) -> Option<u32> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    let mut n: u32 = 0;
    for part in s.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (
                lo.trim().parse::<u32>().ok()?,
                hi.trim().parse::<u32>().ok()?,
            ),
            None => {
                let c = part.trim().parse::<u32>().ok()?;
                (c, c)
            }
        };
        if hi < lo {
            return None;
        }
        n = n.checked_add(hi - lo + 1)?;
    }
    Some(n)
}

/// `MemTotal` of /proc/meminfo, MiB.
pub fn parse_mem_total_mib(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib / 1024)
}

/// The annotations to publish. A value that can be known neither from the settings nor from the
/// host is left out (the scheduler then falls back to the Node's allocatable) rather than guessed.
pub fn annotations(
    config: &CapacityConfig,
    host: HostFacts,
    runtime: &imp_runtime_api::api::Capacity,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(v) = config.vcpu.or(host.cpus) {
        out.insert(ANNOTATION_CAPACITY_VCPU.to_owned(), v.to_string());
    }
    let memory = config.memory_mib.or_else(|| {
        host.memory_mib
            .map(|m| m.saturating_sub(config.reserved_memory_mib))
    });
    if let Some(m) = memory {
        out.insert(ANNOTATION_CAPACITY_MEMORY_MIB.to_owned(), m.to_string());
    }
    out.insert(
        ANNOTATION_CAPACITY_DISK_MIB.to_owned(),
        (runtime.writable_budget_bytes / MIB).to_string(),
    );
    out
}

/// Publishes `wanted` on Node `node` (merge patch of the annotations only; others' annotations
/// are left alone).
pub async fn publish(
    nodes: &Api<Node>,
    node: &str,
    wanted: &BTreeMap<String, String>,
) -> Result<(), kube::Error> {
    let patch = serde_json::json!({"metadata": {"annotations": wanted}});
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt(budget: u64) -> imp_runtime_api::api::Capacity {
        imp_runtime_api::api::Capacity {
            writable_budget_bytes: budget,
            writable_used_bytes: 0,
        }
    }

    #[test]
    fn cpu_lists_count_every_cpu() {
        assert_eq!(parse_cpu_list("0\n"), Some(1));
        assert_eq!(parse_cpu_list("0-1\n"), Some(2));
        assert_eq!(parse_cpu_list("0-3,6,8-9"), Some(7));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("0-x"), None);
    }

    #[test]
    fn mem_total_is_read_in_mib() {
        let meminfo = "MemTotal:       24576000 kB\nMemFree:         1000 kB\n";
        assert_eq!(parse_mem_total_mib(meminfo), Some(24000));
        assert_eq!(parse_mem_total_mib("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total_mib("MemTotal: lots kB\n"), None);
    }

    #[test]
    fn host_facts_minus_the_reserve_and_the_runtimes_disk_budget() {
        let host = HostFacts {
            cpus: Some(8),
            memory_mib: Some(16384),
        };
        let a = annotations(&CapacityConfig::default(), host, &rt((20 << 30) + 5));
        assert_eq!(a[ANNOTATION_CAPACITY_VCPU], "8");
        assert_eq!(a[ANNOTATION_CAPACITY_MEMORY_MIB], "15360");
        // Whole MiB, rounded down: never more than the runtime will hand out.
        assert_eq!(a[ANNOTATION_CAPACITY_DISK_MIB], "20480");
        // A reserve above the host's memory leaves zero, not an underflow.
        let tiny = HostFacts {
            cpus: Some(1),
            memory_mib: Some(512),
        };
        let a = annotations(&CapacityConfig::default(), tiny, &rt(0));
        assert_eq!(a[ANNOTATION_CAPACITY_MEMORY_MIB], "0");
        assert_eq!(a[ANNOTATION_CAPACITY_DISK_MIB], "0");
    }

    #[test]
    fn settings_override_the_host_and_unknowns_are_left_out() {
        let config = CapacityConfig {
            vcpu: Some(3),
            memory_mib: Some(4000),
            reserved_memory_mib: 1024,
        };
        let host = HostFacts {
            cpus: Some(64),
            memory_mib: Some(1 << 20),
        };
        let a = annotations(&config, host, &rt(1 << 30));
        assert_eq!(a[ANNOTATION_CAPACITY_VCPU], "3");
        assert_eq!(a[ANNOTATION_CAPACITY_MEMORY_MIB], "4000");
        let a = annotations(
            &CapacityConfig::default(),
            HostFacts::default(),
            &rt(1 << 30),
        );
        assert_eq!(
            a.keys().collect::<Vec<_>>(),
            vec![ANNOTATION_CAPACITY_DISK_MIB]
        );
    }
}
