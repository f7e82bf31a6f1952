//! The node's capacity for VMs, published on its Node as annotations the scheduler reads
//! (`imp.dev/capacity-vcpu`, `-memory-mib`, `-disk-mib`; docs/vm-lifecycle.md rule 6): vCPU and
//! memory from the host (or the operator's settings), disk from imp-runtime's writable-drive
//! budget (`GET /v1/capacity`). Published with each heartbeat, when it changed: a runtime
//! restarted with another budget is followed within one heartbeat interval.

use std::collections::BTreeMap;

use imp_api::VmPhase;
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

/// What the node offers VMs before template builds (vCPU and memory annotations), from the
/// settings or the host. A value that can be known neither way is left out (the scheduler then
/// falls back to the Node's allocatable) rather than guessed.
pub fn offered(config: &CapacityConfig, host: HostFacts) -> BTreeMap<String, String> {
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
    out
}

/// The offer for the capacities the Node publishes (`published`, its annotations), the limits
/// [`admit`] checks against: a capacity not published is not checked (as the scheduler, which
/// then falls back to the Node's allocatable), and a published one is checked against the offer,
/// not the published value, which had the builds of its heartbeat subtracted (the builds now are
/// counted as shares instead).
pub fn limits(
    offered: BTreeMap<String, String>,
    published: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    offered
        .into_iter()
        .filter(|(k, _)| published.contains_key(k))
        .collect()
}

/// The VMs the runtime's template builds run (queued or running), as shares of the node.
pub fn builds(runtime: &imp_runtime_api::api::Capacity) -> Vec<VmSize> {
    runtime
        .template_builds
        .iter()
        .map(|b| VmSize {
            vcpu: b.vcpu,
            memory_mib: b.memory_mib,
        })
        .collect()
}

/// The annotations to publish: what the node offers minus what the runtime's template builds
/// take (nothing else counts their VMs: the scheduler sees a build within one heartbeat), and
/// the runtime's writable-drive budget.
pub fn annotations(
    config: &CapacityConfig,
    host: HostFacts,
    runtime: &imp_runtime_api::api::Capacity,
) -> BTreeMap<String, String> {
    let mut out = offered(config, host);
    let building = builds(runtime);
    let vcpu: u64 = building.iter().map(|b| u64::from(b.vcpu)).sum();
    let memory: u64 = building.iter().map(|b| b.memory_mib).sum();
    for (key, minus) in [
        (ANNOTATION_CAPACITY_VCPU, vcpu),
        (ANNOTATION_CAPACITY_MEMORY_MIB, memory),
    ] {
        if let Some(v) = out.get_mut(key)
            && let Ok(n) = v.parse::<u64>()
        {
            *v = n.saturating_sub(minus).to_string();
        }
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

/// What one VM takes of the node: its class's vCPUs and memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmSize {
    pub vcpu: u32,
    pub memory_mib: u64,
}

impl VmSize {
    pub fn of(class: &imp_api::ImpVMClassSpec) -> Self {
        VmSize {
            vcpu: class.vcpu,
            memory_mib: u64::from(class.memory_mib),
        }
    }
}

/// The phases in which a VM holds its share of the node: from Starting (written before the
/// runtime is asked) until it stops; Scheduled ones have not passed [`admit`] yet.
pub fn holds_capacity(phase: Option<VmPhase>) -> bool {
    matches!(
        phase,
        Some(
            VmPhase::Starting
                | VmPhase::Running
                | VmPhase::Suspending
                | VmPhase::Suspended
                | VmPhase::Resuming
        )
    )
}

/// The agent's own admission, independent of the scheduler (a user may bind a VM to the node,
/// or write its phase, past the operator's checks), and the gate of a template build: `vm` is
/// refused when, with the VMs that already hold a share (`held`) and the template builds in
/// flight (`builds`), it would exceed the vCPUs or memory the node offers (`offered`, see
/// [`offered`]: what it publishes when nothing builds). A capacity not offered is not checked
/// (as the scheduler, which then falls back to the Node's allocatable). Err is the refusal's
/// message.
pub fn admit(
    offered: &BTreeMap<String, String>,
    held: &[VmSize],
    builds: &[VmSize],
    vm: VmSize,
) -> Result<(), String> {
    let read = |key: &str| offered.get(key).and_then(|v| v.trim().parse::<u64>().ok());
    let all = || held.iter().chain(builds);
    let used_vcpu: u64 = all().map(|h| u64::from(h.vcpu)).sum();
    let used_mem: u64 = all().map(|h| h.memory_mib).sum();
    let count = |n: usize, one: &str, many: &str| match n {
        1 => format!("1 {one}"),
        n => format!("{n} {many}"),
    };
    let mut others = count(held.len(), "other VM", "other VMs");
    // What the node offers is what it publishes only while nothing builds.
    let offers = if builds.is_empty() {
        "publishes"
    } else {
        others += &format!(
            " and {}",
            count(builds.len(), "template build", "template builds")
        );
        "offers"
    };
    if let Some(cap) = read(ANNOTATION_CAPACITY_VCPU)
        && used_vcpu + u64::from(vm.vcpu) > cap
    {
        return Err(format!(
            "the VM's {} vCPU do not fit: the node {offers} {cap} ({ANNOTATION_CAPACITY_VCPU}), \
             {used_vcpu} held by {others}",
            vm.vcpu
        ));
    }
    if let Some(cap) = read(ANNOTATION_CAPACITY_MEMORY_MIB)
        && used_mem + vm.memory_mib > cap
    {
        return Err(format!(
            "the VM's {} MiB do not fit: the node {offers} {cap} MiB \
             ({ANNOTATION_CAPACITY_MEMORY_MIB}), {used_mem} MiB held by {others}",
            vm.memory_mib
        ));
    }
    Ok(())
}

/// What [`admit`] weighs on a node now: what it offers for the capacities its Node publishes
/// ([`offered`], [`limits`]), the shares its VMs hold ([`held`]) and its runtime's template
/// builds in flight ([`builds`]). The VM admission and the standby pass both take it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    pub offered: BTreeMap<String, String>,
    pub held: Vec<VmSize>,
    pub builds: Vec<VmSize>,
}

/// What [`holdings`] could not read.
#[derive(Debug, thiserror::Error)]
pub enum HoldingsError {
    #[error("the VMs bound here: {0}")]
    Kube(#[from] kube::Error),
    #[error("imp-runtime's capacity: {0}")]
    Runtime(#[from] imp_runtime_api::client::ClientError),
}

/// [`Holdings`] of Node `node`, whose annotations are `published`, with the operator's
/// settings `config`; the VM `except` holds no share of its own admission.
pub async fn holdings(
    client: &kube::Client,
    runtime: &imp_runtime_api::client::RuntimeClient,
    node: &str,
    published: &BTreeMap<String, String>,
    config: &CapacityConfig,
    except: Option<&str>,
) -> Result<Holdings, HoldingsError> {
    let held = held(client, node, except).await?;
    let builds = builds(&runtime.capacity().await?);
    Ok(Holdings {
        offered: limits(offered(config, HostFacts::read()), published),
        held,
        builds,
    })
}

/// The shares held by the VMs bound to `node` (but `except`): those in a phase that
/// [`holds_capacity`], sized by their classes.
pub async fn held(
    client: &kube::Client,
    node: &str,
    except: Option<&str>,
) -> Result<Vec<VmSize>, kube::Error> {
    use kube::ResourceExt as _;
    let vms: Api<imp_api::ImpVM> = Api::all(client.clone());
    let bound = vms
        .list(&kube::api::ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?;
    let classes: Api<imp_api::ImpVMClass> = Api::all(client.clone());
    let classes = classes.list(&kube::api::ListParams::default()).await?;
    Ok(bound
        .items
        .iter()
        .filter(|v| except.is_none() || v.uid().as_deref() != except)
        .filter(|v| holds_capacity(v.status.as_ref().and_then(|s| s.phase)))
        .filter_map(|v| {
            let class = classes
                .items
                .iter()
                .find(|c| c.name_any() == v.spec.class_ref.name)?;
            Some(VmSize::of(&class.spec))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(vcpu: u32, memory_mib: u64) -> VmSize {
        VmSize { vcpu, memory_mib }
    }

    fn published(vcpu: &str, mem: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (ANNOTATION_CAPACITY_VCPU.to_owned(), vcpu.to_owned()),
            (ANNOTATION_CAPACITY_MEMORY_MIB.to_owned(), mem.to_owned()),
        ])
    }

    #[test]
    fn a_vm_beyond_the_published_capacity_is_refused_naming_what_does_not_fit() {
        let p = published("4", "8192");
        assert_eq!(admit(&p, &[size(2, 4096)], &[], size(2, 4096)), Ok(()));
        assert_eq!(
            admit(&p, &[size(2, 1024), size(1, 1024)], &[], size(2, 1024)).unwrap_err(),
            "the VM's 2 vCPU do not fit: the node publishes 4 (imp.dev/capacity-vcpu), 3 held by 2 \
             other VMs"
        );
        assert_eq!(
            admit(&p, &[size(1, 8000)], &[], size(1, 256)).unwrap_err(),
            "the VM's 256 MiB do not fit: the node publishes 8192 MiB \
             (imp.dev/capacity-memory-mib), 8000 MiB held by 1 other VM"
        );
        // Alone and too big.
        assert!(admit(&p, &[], &[], size(5, 1)).is_err());
    }

    #[test]
    fn what_is_not_published_is_not_checked() {
        assert_eq!(
            admit(
                &BTreeMap::new(),
                &[size(64, 1 << 20)],
                &[],
                size(64, 1 << 20)
            ),
            Ok(())
        );
        let only_cpu = BTreeMap::from([(ANNOTATION_CAPACITY_VCPU.to_owned(), "2".to_owned())]);
        assert_eq!(admit(&only_cpu, &[], &[], size(2, 1 << 30)), Ok(()));
        assert!(admit(&only_cpu, &[], &[], size(3, 1)).is_err());
        // Unreadable counts as not published, as for the scheduler.
        assert_eq!(
            admit(&published("lots", "x"), &[], &[], size(99, 99)),
            Ok(())
        );
    }

    #[test]
    fn only_vms_past_their_own_admission_hold_a_share() {
        for held in [
            VmPhase::Starting,
            VmPhase::Running,
            VmPhase::Suspending,
            VmPhase::Suspended,
            VmPhase::Resuming,
        ] {
            assert!(holds_capacity(Some(held)), "{held:?}");
        }
        for not in [
            VmPhase::Pending,
            VmPhase::Scheduled,
            VmPhase::Succeeded,
            VmPhase::Failed,
            VmPhase::RetryExhausted,
            VmPhase::Terminating,
        ] {
            assert!(!holds_capacity(Some(not)), "{not:?}");
        }
        assert!(!holds_capacity(None));
    }

    #[test]
    fn only_published_capacities_are_checked_against_the_offer() {
        let offer = published("8", "16384");
        // Published with a build subtracted: the limit is the offer.
        let on_node = BTreeMap::from([
            (ANNOTATION_CAPACITY_VCPU.to_owned(), "6".to_owned()),
            (ANNOTATION_CAPACITY_DISK_MIB.to_owned(), "100".to_owned()),
        ]);
        assert_eq!(
            limits(offer.clone(), &on_node),
            BTreeMap::from([(ANNOTATION_CAPACITY_VCPU.to_owned(), "8".to_owned())])
        );
        // Nothing published (no Node, or not yet): nothing checked.
        assert!(limits(offer, &BTreeMap::new()).is_empty());
    }

    #[test]
    fn template_builds_hold_a_share_like_vms() {
        let p = published("4", "8192");
        // Room for the VM alone, not beside a build of the same size.
        assert_eq!(admit(&p, &[size(2, 4096)], &[], size(2, 4096)), Ok(()));
        assert_eq!(
            admit(&p, &[size(2, 4096)], &[size(2, 4096)], size(2, 4096)).unwrap_err(),
            "the VM's 2 vCPU do not fit: the node offers 4 (imp.dev/capacity-vcpu), 4 held by 1 \
             other VM and 1 template build"
        );
        assert_eq!(
            admit(&p, &[], &[size(1, 4096), size(1, 3000)], size(1, 2048)).unwrap_err(),
            "the VM's 2048 MiB do not fit: the node offers 8192 MiB \
             (imp.dev/capacity-memory-mib), 7096 MiB held by 0 other VMs and 2 template builds"
        );
        // A build alone: room while nothing else holds any.
        assert_eq!(admit(&p, &[], &[], size(4, 8192)), Ok(()));
        assert!(admit(&p, &[size(1, 1)], &[], size(4, 8192)).is_err());
    }

    fn rt(budget: u64) -> imp_runtime_api::api::Capacity {
        imp_runtime_api::api::Capacity {
            writable_budget_bytes: budget,
            ..Default::default()
        }
    }

    fn building(vcpu: u32, memory_mib: u64) -> imp_runtime_api::api::TemplateBuild {
        imp_runtime_api::api::TemplateBuild {
            key: format!("{vcpu}-{memory_mib}"),
            vcpu,
            memory_mib,
        }
    }

    #[test]
    fn published_capacity_is_the_offer_minus_the_template_builds() {
        let host = HostFacts {
            cpus: Some(8),
            memory_mib: Some(16384),
        };
        let mut runtime = rt(1 << 30);
        runtime.template_builds = vec![building(2, 2048), building(1, 512)];
        let a = annotations(&CapacityConfig::default(), host, &runtime);
        assert_eq!(a[ANNOTATION_CAPACITY_VCPU], "5");
        assert_eq!(
            a[ANNOTATION_CAPACITY_MEMORY_MIB],
            (15360 - 2560).to_string()
        );
        assert_eq!(a[ANNOTATION_CAPACITY_DISK_MIB], "1024");
        // The offer itself does not move.
        assert_eq!(
            offered(&CapacityConfig::default(), host)[ANNOTATION_CAPACITY_VCPU],
            "8"
        );
        // A build bigger than the node leaves zero, not an underflow.
        runtime.template_builds = vec![building(16, 1 << 20)];
        let a = annotations(&CapacityConfig::default(), host, &runtime);
        assert_eq!(a[ANNOTATION_CAPACITY_VCPU], "0");
        assert_eq!(a[ANNOTATION_CAPACITY_MEMORY_MIB], "0");
        // Nothing offered, nothing subtracted from.
        let a = annotations(&CapacityConfig::default(), HostFacts::default(), &runtime);
        assert!(!a.contains_key(ANNOTATION_CAPACITY_VCPU));
        assert_eq!(
            builds(&runtime),
            [VmSize {
                vcpu: 16,
                memory_mib: 1 << 20
            }]
        );
    }

    #[test]
    fn an_old_runtimes_capacity_has_no_template_fields() {
        let old: imp_runtime_api::api::Capacity =
            serde_json::from_str(r#"{"writable_budget_bytes": 5, "writable_used_bytes": 1}"#)
                .unwrap();
        assert_eq!(old.writable_budget_bytes, 5);
        assert!(old.template_builds.is_empty());
        assert_eq!(old.template_budget_bytes, 0);
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
