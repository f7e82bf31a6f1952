//! The ImpVM scheduler: a pure function from (what the VM needs, a snapshot of nodes, the VMs already on
//! them) to a node name or the reason every node was rejected. No I/O; the controller builds the snapshot
//! from its watch caches (see [`NodeInfo::from_node`]).
//!
//! Filters, in order (the first failing one is the node's rejection reason): `imp/enabled=true`, Ready,
//! not cordoned, no Memory/Disk/PID pressure, fresh agent heartbeat, nodeSelector, taints tolerated
//! (NoSchedule and NoExecute; PreferNoSchedule is ignored), known capacity, enough free vCPU and memory, and
//! enough writable-drive disk where the agent published the node's budget.
//! Among the nodes that pass, a VM that asks to start from a snapshot template (a standby pool's,
//! [`VmRequest::template_of`]) goes first to the nodes whose agent reports that pool's template Ready
//! (`imp.dev/templates-ready`): a clone there takes milliseconds, a cold boot elsewhere seconds, and
//! any node still runs it (cold, saying why). Then best fit: the least memory left after placement,
//! then the least CPU left, then the node name, so equal inputs always give the same answer.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
};

use imp_api::names::{
    ANNOTATION_CAPACITY_DISK_MIB, ANNOTATION_CAPACITY_MEMORY_MIB, ANNOTATION_CAPACITY_VCPU,
    ANNOTATION_TEMPLATES_READY, LABEL_NODE_ENABLED,
};
use k8s_openapi::api::core::v1::{Node, Taint, Toleration};

/// What one VM needs from a node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VmRequest {
    pub vcpu: u32,
    pub memory_mib: u64,
    /// Writable drive (the class's `diskGiB`), MiB.
    pub disk_mib: u64,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
    /// `startFrom: Template`: the uid of the pool whose snapshot template the VM is cloned from.
    /// Nodes reporting it Ready are preferred over any fit elsewhere.
    pub template_of: Option<String>,
}

impl VmRequest {
    fn millicpu(&self) -> u64 {
        u64::from(self.vcpu) * 1000
    }
}

/// Freshness of a node agent's heartbeat Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heartbeat {
    Fresh,
    Stale,
    Missing,
}

/// CPU (millicores), memory (MiB) and writable-drive disk (MiB) offered to VMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    pub millicpu: u64,
    pub memory_mib: u64,
    /// None when the agent has not published the node's writable-drive budget: disk is then not
    /// checked here (imp-runtime still refuses a VM past its budget, and the VM fails visibly).
    pub disk_mib: Option<u64>,
}

/// The scheduler's view of one node.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub ready: bool,
    pub unschedulable: bool,
    /// Condition types among MemoryPressure, DiskPressure, PIDPressure whose status is True.
    pub pressures: Vec<String>,
    pub taints: Vec<Taint>,
    pub heartbeat: Heartbeat,
    /// None when neither the agent's annotations nor the node's allocatable say how much there is.
    pub capacity: Option<Capacity>,
    /// Pools (uid) whose snapshot template the node's agent reports Ready.
    pub templates_ready: BTreeSet<String>,
}

/// A VM that occupies capacity on a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resident {
    pub node: String,
    pub vcpu: u32,
    pub memory_mib: u64,
    pub disk_mib: u64,
}

/// Why one node cannot take the VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    NotEnabled,
    NotReady,
    Cordoned,
    Pressure(String),
    AgentHeartbeatStale,
    AgentHeartbeatMissing,
    SelectorMismatch {
        key: String,
    },
    UntoleratedTaint {
        key: String,
        effect: String,
    },
    UnknownCapacity,
    InsufficientCpu {
        requested_millicpu: u64,
        free_millicpu: u64,
    },
    InsufficientMemory {
        requested_mib: u64,
        free_mib: u64,
    },
    InsufficientDisk {
        requested_mib: u64,
        free_mib: u64,
    },
}

impl Rejection {
    /// Short category used when summarising many nodes ("2 insufficient memory").
    fn category(&self) -> String {
        match self {
            Rejection::NotEnabled => format!("not labelled {LABEL_NODE_ENABLED}=true"),
            Rejection::NotReady => "not Ready".into(),
            Rejection::Cordoned => "cordoned".into(),
            Rejection::Pressure(p) => format!("under {p}"),
            Rejection::AgentHeartbeatStale => "agent heartbeat stale".into(),
            Rejection::AgentHeartbeatMissing => "no agent heartbeat".into(),
            Rejection::SelectorMismatch { key } => format!("nodeSelector {key} not matched"),
            Rejection::UntoleratedTaint { key, effect } => {
                format!("untolerated taint {key}:{effect}")
            }
            Rejection::UnknownCapacity => "capacity unknown".into(),
            Rejection::InsufficientCpu { .. } => "insufficient cpu".into(),
            Rejection::InsufficientMemory { .. } => "insufficient memory".into(),
            Rejection::InsufficientDisk { .. } => "insufficient disk".into(),
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::InsufficientCpu {
                requested_millicpu,
                free_millicpu,
            } => {
                write!(
                    f,
                    "insufficient cpu: requested {requested_millicpu}m, free {free_millicpu}m"
                )
            }
            Rejection::InsufficientMemory {
                requested_mib,
                free_mib,
            } => {
                write!(
                    f,
                    "insufficient memory: requested {requested_mib}Mi, free {free_mib}Mi"
                )
            }
            Rejection::InsufficientDisk {
                requested_mib,
                free_mib,
            } => {
                write!(
                    f,
                    "insufficient disk: requested {requested_mib}Mi of writable drive, free {free_mib}Mi"
                )
            }
            other => f.write_str(&other.category()),
        }
    }
}

/// No node can take the VM; `rejections` says why, per node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unschedulable {
    pub rejections: BTreeMap<String, Rejection>,
    /// The node the user named in spec.nodeName, when only that node was considered.
    pub pinned: Option<String>,
}

impl fmt::Display for Unschedulable {
    /// `0/3 nodes are available: 2 insufficient memory, 1 not Ready`, like kube-scheduler, so it can be acted on.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(node) = &self.pinned {
            return match self.rejections.get(node) {
                Some(r) => write!(f, "spec.nodeName {node}: {r}"),
                None => write!(f, "spec.nodeName {node}: no such Node"),
            };
        }
        if self.rejections.is_empty() {
            return write!(
                f,
                "0/0 nodes are available: no node is labelled {LABEL_NODE_ENABLED}=true"
            );
        }
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for r in self.rejections.values() {
            *counts.entry(r.category()).or_default() += 1;
        }
        let mut counts: Vec<_> = counts.into_iter().collect();
        counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let parts: Vec<String> = counts
            .into_iter()
            .map(|(c, n)| format!("{n} {c}"))
            .collect();
        write!(
            f,
            "0/{} nodes are available: {}",
            self.rejections.len(),
            parts.join(", ")
        )
    }
}

/// Picks the node for `vm`, or says why none fits.
pub fn schedule(
    vm: &VmRequest,
    nodes: &[NodeInfo],
    residents: &[Resident],
) -> Result<String, Unschedulable> {
    let mut used: HashMap<&str, Capacity> = HashMap::new();
    for r in residents {
        let u = used.entry(r.node.as_str()).or_default();
        u.millicpu += u64::from(r.vcpu) * 1000;
        u.memory_mib += r.memory_mib;
        *u.disk_mib.get_or_insert(0) += r.disk_mib;
    }
    let mut rejections = BTreeMap::new();
    // (no Ready template wanted here, memory left, cpu left, name): smallest wins.
    let mut best: Option<(bool, u64, u64, &str)> = None;
    for node in nodes {
        match fit(
            vm,
            node,
            used.get(node.name.as_str()).copied().unwrap_or_default(),
        ) {
            Err(r) => {
                rejections.insert(node.name.clone(), r);
            }
            Ok(left) => {
                let key = (
                    !has_template(vm, node),
                    left.memory_mib,
                    left.millicpu,
                    node.name.as_str(),
                );
                if best.is_none_or(|b| key < b) {
                    best = Some(key);
                }
            }
        }
    }
    match best {
        Some((_, _, _, name)) => Ok(name.to_owned()),
        None => Err(Unschedulable {
            rejections,
            pinned: None,
        }),
    }
}

/// Whether `node` reports Ready the snapshot template `vm` wants (false for a VM that wants none).
fn has_template(vm: &VmRequest, node: &NodeInfo) -> bool {
    vm.template_of
        .as_ref()
        .is_some_and(|pool| node.templates_ready.contains(pool))
}

/// Checks the node the user named in spec.nodeName with the taint and capacity filters of
/// [`schedule`]'s own choice: a user-set nodeName does not bypass them. (Readiness, pressure and
/// the agent's heartbeat are the VM controller's node health, as for any bound VM.)
pub fn schedule_pinned(
    vm: &VmRequest,
    node: &str,
    nodes: &[NodeInfo],
    residents: &[Resident],
) -> Result<String, Unschedulable> {
    let refused = |rejections: BTreeMap<String, Rejection>| Unschedulable {
        rejections,
        pinned: Some(node.to_owned()),
    };
    let Some(info) = nodes.iter().find(|n| n.name == node) else {
        return Err(refused(BTreeMap::new()));
    };
    let mut used = Capacity::default();
    for r in residents.iter().filter(|r| r.node == node) {
        used.millicpu += u64::from(r.vcpu) * 1000;
        used.memory_mib += r.memory_mib;
        *used.disk_mib.get_or_insert(0) += r.disk_mib;
    }
    match admits(vm, info, used) {
        Ok(_) => Ok(node.to_owned()),
        Err(r) => Err(refused(BTreeMap::from([(node.to_owned(), r)]))),
    }
}

/// Capacity left on `node` after placing `vm`, or why it cannot be placed.
fn fit(vm: &VmRequest, node: &NodeInfo, used: Capacity) -> Result<Capacity, Rejection> {
    if node.labels.get(LABEL_NODE_ENABLED).map(String::as_str) != Some("true") {
        return Err(Rejection::NotEnabled);
    }
    if !node.ready {
        return Err(Rejection::NotReady);
    }
    if node.unschedulable {
        return Err(Rejection::Cordoned);
    }
    if let Some(p) = node.pressures.first() {
        return Err(Rejection::Pressure(p.clone()));
    }
    match node.heartbeat {
        Heartbeat::Fresh => {}
        Heartbeat::Stale => return Err(Rejection::AgentHeartbeatStale),
        Heartbeat::Missing => return Err(Rejection::AgentHeartbeatMissing),
    }
    for (key, value) in &vm.node_selector {
        if node.labels.get(key) != Some(value) {
            return Err(Rejection::SelectorMismatch { key: key.clone() });
        }
    }
    admits(vm, node, used)
}

/// The taint and capacity filters: what a node must pass for any VM put on it, also one the
/// user bound there (whose node's health the VM controller watches instead).
fn admits(vm: &VmRequest, node: &NodeInfo, used: Capacity) -> Result<Capacity, Rejection> {
    for taint in &node.taints {
        let blocking = matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute");
        if blocking && !vm.tolerations.iter().any(|t| tolerates(t, taint)) {
            return Err(Rejection::UntoleratedTaint {
                key: taint.key.clone(),
                effect: taint.effect.clone(),
            });
        }
    }
    let cap = node.capacity.ok_or(Rejection::UnknownCapacity)?;
    let free_cpu = cap.millicpu.saturating_sub(used.millicpu);
    let free_mem = cap.memory_mib.saturating_sub(used.memory_mib);
    if vm.millicpu() > free_cpu {
        return Err(Rejection::InsufficientCpu {
            requested_millicpu: vm.millicpu(),
            free_millicpu: free_cpu,
        });
    }
    if vm.memory_mib > free_mem {
        return Err(Rejection::InsufficientMemory {
            requested_mib: vm.memory_mib,
            free_mib: free_mem,
        });
    }
    let disk_left = match cap.disk_mib {
        None => None,
        Some(budget) => {
            let free = budget.saturating_sub(used.disk_mib.unwrap_or(0));
            if vm.disk_mib > free {
                return Err(Rejection::InsufficientDisk {
                    requested_mib: vm.disk_mib,
                    free_mib: free,
                });
            }
            Some(free - vm.disk_mib)
        }
    };
    Ok(Capacity {
        millicpu: free_cpu - vm.millicpu(),
        memory_mib: free_mem - vm.memory_mib,
        disk_mib: disk_left,
    })
}

/// Kubernetes toleration semantics (shared with the agent's pre-build, which serves the same pools).
pub use imp_api::tolerates;

impl NodeInfo {
    /// The scheduler's view of a Node object; `heartbeat` comes from the agent's Lease.
    pub fn from_node(node: &Node, heartbeat: Heartbeat) -> Self {
        let spec = node.spec.as_ref();
        let status = node.status.as_ref();
        let conditions = status
            .and_then(|s| s.conditions.as_deref())
            .unwrap_or_default();
        let ready = conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let pressures = conditions
            .iter()
            .filter(|c| {
                matches!(
                    c.type_.as_str(),
                    "MemoryPressure" | "DiskPressure" | "PIDPressure"
                ) && c.status == "True"
            })
            .map(|c| c.type_.clone())
            .collect();
        NodeInfo {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            ready,
            unschedulable: spec.and_then(|s| s.unschedulable).unwrap_or(false),
            pressures,
            taints: spec.and_then(|s| s.taints.clone()).unwrap_or_default(),
            heartbeat,
            capacity: node_capacity(node),
            templates_ready: templates_ready(node),
        }
    }
}

/// The pools whose template the node's agent reports Ready ([`ANNOTATION_TEMPLATES_READY`]).
pub fn templates_ready(node: &Node) -> BTreeSet<String> {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_TEMPLATES_READY))
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Capacity for VMs: the agent's annotations if present (each independently), else the node's allocatable.
/// Disk comes only from the agent's annotation (the node's ephemeral-storage is the pods', not the
/// writable-drive budget of imp-runtime).
pub fn node_capacity(node: &Node) -> Option<Capacity> {
    let annotations = node.metadata.annotations.as_ref();
    let annotated = |key: &str| {
        annotations
            .and_then(|a| a.get(key))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let millicpu = annotated(ANNOTATION_CAPACITY_VCPU)
        .map(|v| v * 1000)
        .or_else(|| {
            allocatable
                .and_then(|a| a.get("cpu"))
                .and_then(|q| parse_cpu_millis(&q.0))
        })?;
    let memory_mib = annotated(ANNOTATION_CAPACITY_MEMORY_MIB).or_else(|| {
        allocatable
            .and_then(|a| a.get("memory"))
            .and_then(|q| parse_bytes(&q.0))
            .map(|b| b / (1024 * 1024))
    })?;
    Some(Capacity {
        millicpu,
        memory_mib,
        disk_mib: annotated(ANNOTATION_CAPACITY_DISK_MIB),
    })
}

/// A CPU quantity ("4", "3500m", "1.5") in millicores.
pub fn parse_cpu_millis(q: &str) -> Option<u64> {
    if let Some(m) = q.strip_suffix('m') {
        return m.parse().ok();
    }
    let (whole, frac) = q.split_once('.').unwrap_or((q, ""));
    let whole: u64 = whole.parse().ok()?;
    let frac_millis = if frac.is_empty() {
        0
    } else {
        let digits: String = frac.chars().chain("000".chars()).take(3).collect();
        digits.parse::<u64>().ok()?
    };
    whole.checked_mul(1000)?.checked_add(frac_millis)
}

/// A memory quantity ("16Gi", "512Mi", "1G", "1048576", "1e9") in bytes.
pub fn parse_bytes(q: &str) -> Option<u64> {
    const SUFFIXES: [(&str, u64); 12] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("Pi", 1 << 50),
        ("Ei", 1 << 60),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
        ("P", 1_000_000_000_000_000),
        ("E", 1_000_000_000_000_000_000),
    ];
    for (suffix, mult) in SUFFIXES {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().ok()?.checked_mul(mult);
        }
    }
    if let Some((m, e)) = q.split_once(['e', 'E']) {
        return m
            .parse::<u64>()
            .ok()?
            .checked_mul(10u64.checked_pow(e.parse().ok()?)?);
    }
    q.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::{
        api::core::v1::{NodeCondition, NodeSpec, NodeStatus},
        apimachinery::pkg::api::resource::Quantity,
    };

    fn node(name: &str, vcpu: u64, mem: u64) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            labels: [(LABEL_NODE_ENABLED.to_owned(), "true".to_owned())].into(),
            ready: true,
            unschedulable: false,
            pressures: vec![],
            taints: vec![],
            heartbeat: Heartbeat::Fresh,
            capacity: Some(Capacity {
                millicpu: vcpu * 1000,
                memory_mib: mem,
                disk_mib: None,
            }),
            templates_ready: BTreeSet::new(),
        }
    }

    /// `node` with a published writable-drive budget of `disk` MiB.
    fn node_with_disk(name: &str, vcpu: u64, mem: u64, disk: u64) -> NodeInfo {
        let mut n = node(name, vcpu, mem);
        n.capacity.as_mut().unwrap().disk_mib = Some(disk);
        n
    }

    fn req_disk(vcpu: u32, mem: u64, disk: u64) -> VmRequest {
        VmRequest {
            disk_mib: disk,
            ..req(vcpu, mem)
        }
    }

    fn req(vcpu: u32, mem: u64) -> VmRequest {
        VmRequest {
            vcpu,
            memory_mib: mem,
            ..Default::default()
        }
    }

    fn resident(node: &str, vcpu: u32, mem: u64) -> Resident {
        Resident {
            node: node.into(),
            vcpu,
            memory_mib: mem,
            disk_mib: 0,
        }
    }

    fn resident_disk(node: &str, disk: u64) -> Resident {
        Resident {
            disk_mib: disk,
            ..resident(node, 0, 0)
        }
    }

    #[test]
    fn a_template_vm_prefers_nodes_with_its_pool_s_template_ready_else_fits_anywhere() {
        // "big" is the best fit by memory; "small" has the pool's template Ready.
        let mut nodes = [node("big", 8, 4096), node("small", 8, 16384)];
        nodes[1].templates_ready = ["pool-uid".to_owned()].into();
        let boot = req(1, 1024);
        assert_eq!(schedule(&boot, &nodes, &[]).unwrap(), "big");
        let clone = VmRequest {
            template_of: Some("pool-uid".into()),
            ..boot.clone()
        };
        assert_eq!(schedule(&clone, &nodes, &[]).unwrap(), "small");
        // Another pool's template is no reason: best fit as for any VM.
        let other = VmRequest {
            template_of: Some("other-uid".into()),
            ..boot.clone()
        };
        assert_eq!(schedule(&other, &nodes, &[]).unwrap(), "big");
        // A node with the template that cannot fit the VM does not win: the clone boots cold
        // elsewhere rather than wait.
        let residents = [resident("small", 8, 0)];
        assert_eq!(schedule(&clone, &nodes, &residents).unwrap(), "big");
        // Among nodes with the template, best fit again.
        nodes[0].templates_ready = ["pool-uid".to_owned()].into();
        assert_eq!(schedule(&clone, &nodes, &[]).unwrap(), "big");
    }

    #[test]
    fn templates_ready_are_read_from_the_agent_s_annotation() {
        let mut n = Node::default();
        assert!(templates_ready(&n).is_empty());
        n.metadata.annotations = Some(
            [(
                ANNOTATION_TEMPLATES_READY.to_owned(),
                " a-uid,b-uid,, ".to_owned(),
            )]
            .into(),
        );
        assert_eq!(
            templates_ready(&n),
            BTreeSet::from(["a-uid".to_owned(), "b-uid".to_owned()])
        );
        assert_eq!(
            NodeInfo::from_node(&n, Heartbeat::Fresh)
                .templates_ready
                .len(),
            2
        );
    }

    #[test]
    fn writable_disks_must_fit_the_published_budget() {
        let nodes = [node_with_disk("n", 8, 8192, 10 * 1024)];
        // Two 4 GiB VMs are resident: 2 GiB left; a 4 GiB VM does not fit, a 2 GiB one does.
        let residents = [resident_disk("n", 4096), resident_disk("n", 4096)];
        assert_eq!(
            rejection(schedule(&req_disk(1, 128, 4096), &nodes, &residents), "n"),
            Rejection::InsufficientDisk {
                requested_mib: 4096,
                free_mib: 2048
            }
        );
        assert_eq!(
            schedule(&req_disk(1, 128, 2048), &nodes, &residents).unwrap(),
            "n"
        );
        // Residents beyond the budget (a budget lowered under running VMs) leave zero, not an underflow.
        let over = [resident_disk("n", 8192), resident_disk("n", 8192)];
        assert_eq!(
            rejection(schedule(&req_disk(1, 128, 1), &nodes, &over), "n"),
            Rejection::InsufficientDisk {
                requested_mib: 1,
                free_mib: 0
            }
        );
    }

    #[test]
    fn disk_is_checked_after_cpu_and_memory_and_only_where_published() {
        // No budget published (an older agent): disk is not a reason to reject.
        let unpublished = [node("n", 8, 8192)];
        assert_eq!(
            schedule(&req_disk(1, 128, 1 << 30), &unpublished, &[]).unwrap(),
            "n"
        );
        // Memory is short too: memory is the reason given.
        let nodes = [node_with_disk("n", 8, 1024, 1024)];
        assert_eq!(
            rejection(schedule(&req_disk(1, 2048, 4096), &nodes, &[]), "n"),
            Rejection::InsufficientMemory {
                requested_mib: 2048,
                free_mib: 1024
            }
        );
        // The VM goes to the node whose disk fits, even where the other has more memory left.
        let nodes = [
            node_with_disk("small-disk", 8, 4096, 1024),
            node_with_disk("big-disk", 8, 16384, 8192),
        ];
        assert_eq!(
            schedule(&req_disk(1, 512, 4096), &nodes, &[]).unwrap(),
            "big-disk"
        );
        let err = schedule(&req_disk(1, 512, 9000), &nodes, &[]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "0/2 nodes are available: 2 insufficient disk"
        );
        assert_eq!(
            err.rejections["big-disk"].to_string(),
            "insufficient disk: requested 9000Mi of writable drive, free 8192Mi"
        );
    }

    #[test]
    fn disk_annotation_is_read_and_never_taken_from_allocatable() {
        let n = k8s_node(
            &[(ANNOTATION_CAPACITY_DISK_MIB, "20480")],
            &[
                ("cpu", "2"),
                ("memory", "2Gi"),
                ("ephemeral-storage", "100Gi"),
            ],
            &[],
        );
        assert_eq!(node_capacity(&n).unwrap().disk_mib, Some(20480));
        let n = k8s_node(
            &[(ANNOTATION_CAPACITY_DISK_MIB, "much")],
            &[
                ("cpu", "2"),
                ("memory", "2Gi"),
                ("ephemeral-storage", "100Gi"),
            ],
            &[],
        );
        assert_eq!(node_capacity(&n).unwrap().disk_mib, None);
    }

    fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(Into::into),
            effect: effect.into(),
            time_added: None,
        }
    }

    fn toleration(
        key: Option<&str>,
        op: Option<&str>,
        value: Option<&str>,
        effect: Option<&str>,
    ) -> Toleration {
        Toleration {
            key: key.map(Into::into),
            operator: op.map(Into::into),
            value: value.map(Into::into),
            effect: effect.map(Into::into),
            toleration_seconds: None,
        }
    }

    fn rejection(r: Result<String, Unschedulable>, node: &str) -> Rejection {
        r.unwrap_err().rejections.get(node).cloned().unwrap()
    }

    #[test]
    fn a_pinned_node_passes_the_same_filters_and_says_why_not() {
        let mut tainted = node("t", 8, 8192);
        tainted.taints = vec![taint("dedicated", Some("gpu"), "NoSchedule")];
        let nodes = [node("small", 2, 1024), node("big", 8, 8192), tainted];
        let residents = [resident("small", 1, 768)];
        // Capacity: the other node would fit, but the user named this one.
        let full = schedule_pinned(&req(1, 512), "small", &nodes, &residents).unwrap_err();
        assert_eq!(
            full.to_string(),
            "spec.nodeName small: insufficient memory: requested 512Mi, free 256Mi"
        );
        assert_eq!(full.rejections.len(), 1, "only the named node is judged");
        // Taints.
        assert_eq!(
            schedule_pinned(&req(1, 512), "t", &nodes, &[])
                .unwrap_err()
                .to_string(),
            "spec.nodeName t: untolerated taint dedicated:NoSchedule"
        );
        let mut tolerant = req(1, 512);
        tolerant.tolerations = vec![Toleration {
            key: Some("dedicated".into()),
            operator: Some("Exists".into()),
            ..Default::default()
        }];
        assert_eq!(schedule_pinned(&tolerant, "t", &nodes, &[]).unwrap(), "t");
        // Health is not the scheduler's to judge for a bound VM (the VM controller watches it).
        let mut pressured = node("p", 8, 8192);
        pressured.pressures = vec!["MemoryPressure".into()];
        assert_eq!(
            schedule_pinned(&req(1, 512), "p", &[pressured], &[]).unwrap(),
            "p"
        );
        // A node that is not there.
        assert_eq!(
            schedule_pinned(&req(1, 512), "gone", &nodes, &[])
                .unwrap_err()
                .to_string(),
            "spec.nodeName gone: no such Node"
        );
        // Fits: the named node, not the best fit.
        assert_eq!(
            schedule_pinned(&req(1, 128), "big", &nodes, &residents).unwrap(),
            "big"
        );
    }

    #[test]
    fn picks_the_only_fitting_node() {
        let nodes = [node("a", 2, 1024), node("b", 8, 8192)];
        assert_eq!(schedule(&req(4, 2048), &nodes, &[]).unwrap(), "b");
    }

    #[test]
    fn best_fit_prefers_least_memory_left_then_cpu_then_name() {
        let nodes = [
            node("big", 16, 16384),
            node("small", 4, 4096),
            node("mid", 8, 8192),
        ];
        assert_eq!(schedule(&req(2, 2048), &nodes, &[]).unwrap(), "small");
        // Same memory left: less CPU left wins.
        let nodes = [node("x", 16, 4096), node("y", 4, 4096)];
        assert_eq!(schedule(&req(2, 1024), &nodes, &[]).unwrap(), "y");
        // Full tie: the name decides, whatever the input order.
        let nodes = [
            node("n2", 4, 4096),
            node("n1", 4, 4096),
            node("n3", 4, 4096),
        ];
        assert_eq!(schedule(&req(1, 512), &nodes, &[]).unwrap(), "n1");
        let mut reversed = nodes.clone();
        reversed.reverse();
        assert_eq!(schedule(&req(1, 512), &reversed, &[]).unwrap(), "n1");
    }

    #[test]
    fn residents_consume_capacity() {
        let nodes = [node("a", 4, 4096), node("b", 4, 8192)];
        // Without residents `a` fits best; with `a` nearly full, `b`.
        assert_eq!(schedule(&req(1, 2048), &nodes, &[]).unwrap(), "a");
        let residents = [resident("a", 1, 3072)];
        assert_eq!(schedule(&req(1, 2048), &nodes, &residents).unwrap(), "b");
        // Residents on other nodes do not count against `a`.
        assert_eq!(
            schedule(&req(1, 2048), &nodes, &[resident("zzz", 4, 99999)]).unwrap(),
            "a"
        );
    }

    #[test]
    fn exact_fit_is_allowed_and_one_more_is_not() {
        let nodes = [node("a", 2, 2048)];
        assert_eq!(
            schedule(&req(1, 1024), &nodes, &[resident("a", 1, 1024)]).unwrap(),
            "a"
        );
        let r = rejection(
            schedule(&req(1, 1025), &nodes, &[resident("a", 1, 1024)]),
            "a",
        );
        assert_eq!(
            r,
            Rejection::InsufficientMemory {
                requested_mib: 1025,
                free_mib: 1024
            }
        );
        let r = rejection(
            schedule(&req(2, 512), &nodes, &[resident("a", 1, 1024)]),
            "a",
        );
        assert_eq!(
            r,
            Rejection::InsufficientCpu {
                requested_millicpu: 2000,
                free_millicpu: 1000
            }
        );
    }

    #[test]
    fn overcommitted_node_reports_zero_free() {
        let nodes = [node("a", 1, 1024)];
        let r = rejection(
            schedule(&req(1, 128), &nodes, &[resident("a", 2, 2048)]),
            "a",
        );
        assert_eq!(
            r,
            Rejection::InsufficientCpu {
                requested_millicpu: 1000,
                free_millicpu: 0
            }
        );
    }

    #[test]
    fn each_filter_rejects_with_its_reason() {
        let base = node("a", 8, 8192);
        let cases: Vec<(NodeInfo, Rejection)> = vec![
            (
                {
                    let mut n = base.clone();
                    n.labels.clear();
                    n
                },
                Rejection::NotEnabled,
            ),
            (
                {
                    let mut n = base.clone();
                    n.labels.insert(LABEL_NODE_ENABLED.into(), "false".into());
                    n
                },
                Rejection::NotEnabled,
            ),
            (
                {
                    let mut n = base.clone();
                    n.ready = false;
                    n
                },
                Rejection::NotReady,
            ),
            (
                {
                    let mut n = base.clone();
                    n.unschedulable = true;
                    n
                },
                Rejection::Cordoned,
            ),
            (
                {
                    let mut n = base.clone();
                    n.pressures = vec!["DiskPressure".into()];
                    n
                },
                Rejection::Pressure("DiskPressure".into()),
            ),
            (
                {
                    let mut n = base.clone();
                    n.heartbeat = Heartbeat::Stale;
                    n
                },
                Rejection::AgentHeartbeatStale,
            ),
            (
                {
                    let mut n = base.clone();
                    n.heartbeat = Heartbeat::Missing;
                    n
                },
                Rejection::AgentHeartbeatMissing,
            ),
            (
                {
                    let mut n = base.clone();
                    n.capacity = None;
                    n
                },
                Rejection::UnknownCapacity,
            ),
            (
                {
                    let mut n = base.clone();
                    n.taints = vec![taint("gpu", Some("yes"), "NoSchedule")];
                    n
                },
                Rejection::UntoleratedTaint {
                    key: "gpu".into(),
                    effect: "NoSchedule".into(),
                },
            ),
            (
                {
                    let mut n = base.clone();
                    n.taints = vec![taint("drain", None, "NoExecute")];
                    n
                },
                Rejection::UntoleratedTaint {
                    key: "drain".into(),
                    effect: "NoExecute".into(),
                },
            ),
        ];
        for (n, want) in cases {
            assert_eq!(
                rejection(schedule(&req(1, 512), std::slice::from_ref(&n), &[]), "a"),
                want,
                "{n:?}"
            );
        }
    }

    #[test]
    fn health_filters_come_before_capacity() {
        // A NotReady node that is also full reports NotReady: the more fundamental problem.
        let mut n = node("a", 1, 512);
        n.ready = false;
        assert_eq!(
            rejection(schedule(&req(4, 4096), &[n], &[]), "a"),
            Rejection::NotReady
        );
    }

    #[test]
    fn prefer_no_schedule_taints_do_not_block() {
        let mut n = node("a", 8, 8192);
        n.taints = vec![taint("soft", None, "PreferNoSchedule")];
        assert_eq!(schedule(&req(1, 512), &[n], &[]).unwrap(), "a");
    }

    #[test]
    fn node_selector_must_match_every_label() {
        let mut n = node("a", 8, 8192);
        n.labels.insert("zone".into(), "z1".into());
        n.labels.insert("arch".into(), "amd64".into());
        let mut r = req(1, 512);
        r.node_selector = [("zone".to_owned(), "z1".to_owned())].into();
        assert!(schedule(&r, std::slice::from_ref(&n), &[]).is_ok());
        r.node_selector.insert("arch".into(), "arm64".into());
        assert_eq!(
            rejection(schedule(&r, &[n], &[]), "a"),
            Rejection::SelectorMismatch { key: "arch".into() }
        );
    }

    #[test]
    fn toleration_semantics() {
        let t = taint("gpu", Some("yes"), "NoSchedule");
        assert!(tolerates(
            &toleration(Some("gpu"), None, Some("yes"), None),
            &t
        ));
        assert!(tolerates(
            &toleration(Some("gpu"), Some("Equal"), Some("yes"), Some("NoSchedule")),
            &t
        ));
        assert!(!tolerates(
            &toleration(Some("gpu"), Some("Equal"), Some("no"), None),
            &t
        ));
        assert!(!tolerates(
            &toleration(Some("gpu"), Some("Equal"), Some("yes"), Some("NoExecute")),
            &t
        ));
        assert!(tolerates(
            &toleration(Some("gpu"), Some("Exists"), None, None),
            &t
        ));
        assert!(!tolerates(
            &toleration(Some("cpu"), Some("Exists"), None, None),
            &t
        ));
        // Empty key + Exists tolerates everything.
        assert!(tolerates(&toleration(None, Some("Exists"), None, None), &t));
        // Empty key with Equal tolerates nothing.
        assert!(!tolerates(&toleration(None, Some("Equal"), None, None), &t));
        assert!(!tolerates(
            &toleration(Some("gpu"), Some("Bogus"), Some("yes"), None),
            &t
        ));
        let no_value = taint("dedicated", None, "NoSchedule");
        assert!(tolerates(
            &toleration(Some("dedicated"), None, None, None),
            &no_value
        ));
    }

    #[test]
    fn tolerated_taint_lets_the_vm_in() {
        let mut n = node("a", 8, 8192);
        n.taints = vec![taint("imp/dedicated", Some("ci"), "NoSchedule")];
        let mut r = req(1, 512);
        r.tolerations = vec![toleration(
            Some("imp/dedicated"),
            None,
            Some("ci"),
            Some("NoSchedule"),
        )];
        assert_eq!(schedule(&r, &[n], &[]).unwrap(), "a");
    }

    #[test]
    fn unschedulable_summary_counts_reasons() {
        let mut not_ready = node("a", 8, 8192);
        not_ready.ready = false;
        let nodes = [not_ready, node("b", 1, 1024), node("c", 1, 1024)];
        let err = schedule(&req(1, 2048), &nodes, &[]).unwrap_err();
        assert_eq!(err.rejections.len(), 3);
        assert_eq!(
            err.to_string(),
            "0/3 nodes are available: 2 insufficient memory, 1 not Ready"
        );
        let none = schedule(&req(1, 1), &[], &[]).unwrap_err();
        assert_eq!(
            none.to_string(),
            "0/0 nodes are available: no node is labelled imp/enabled=true"
        );
        assert_eq!(
            Rejection::InsufficientMemory {
                requested_mib: 2048,
                free_mib: 1024
            }
            .to_string(),
            "insufficient memory: requested 2048Mi, free 1024Mi"
        );
    }

    #[test]
    fn quantities_parse() {
        assert_eq!(parse_cpu_millis("4"), Some(4000));
        assert_eq!(parse_cpu_millis("3500m"), Some(3500));
        assert_eq!(parse_cpu_millis("1.5"), Some(1500));
        assert_eq!(parse_cpu_millis("0.1234"), Some(123));
        assert_eq!(parse_cpu_millis("x"), None);
        assert_eq!(parse_bytes("16Gi"), Some(16 << 30));
        assert_eq!(parse_bytes("512Mi"), Some(512 << 20));
        assert_eq!(parse_bytes("1G"), Some(1_000_000_000));
        assert_eq!(parse_bytes("1048576"), Some(1 << 20));
        assert_eq!(parse_bytes("1e9"), Some(1_000_000_000));
        assert_eq!(parse_bytes("129k"), Some(129_000));
        assert_eq!(parse_bytes("lots"), None);
    }

    fn k8s_node(
        annotations: &[(&str, &str)],
        allocatable: &[(&str, &str)],
        conditions: &[(&str, &str)],
    ) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("n".into());
        n.metadata.labels = Some([(LABEL_NODE_ENABLED.to_owned(), "true".to_owned())].into());
        n.metadata.annotations = Some(
            annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        n.spec = Some(NodeSpec {
            unschedulable: Some(true),
            ..Default::default()
        });
        n.status = Some(NodeStatus {
            allocatable: Some(
                allocatable
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
                    .collect(),
            ),
            conditions: Some(
                conditions
                    .iter()
                    .map(|(t, s)| NodeCondition {
                        type_: (*t).into(),
                        status: (*s).into(),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        });
        n
    }

    #[test]
    fn node_info_reads_conditions_cordon_and_capacity() {
        let n = k8s_node(
            &[],
            &[("cpu", "3500m"), ("memory", "8Gi")],
            &[
                ("Ready", "True"),
                ("MemoryPressure", "True"),
                ("DiskPressure", "False"),
            ],
        );
        let info = NodeInfo::from_node(&n, Heartbeat::Fresh);
        assert!(info.ready && info.unschedulable);
        assert_eq!(info.pressures, vec!["MemoryPressure".to_owned()]);
        assert_eq!(
            info.capacity,
            Some(Capacity {
                millicpu: 3500,
                memory_mib: 8192,
                disk_mib: None
            })
        );
        let not_ready = k8s_node(&[], &[], &[("Ready", "Unknown")]);
        let info = NodeInfo::from_node(&not_ready, Heartbeat::Missing);
        assert!(!info.ready);
        assert_eq!(info.capacity, None);
    }

    #[test]
    fn agent_annotations_override_allocatable_independently() {
        let n = k8s_node(
            &[(ANNOTATION_CAPACITY_VCPU, "6")],
            &[("cpu", "8"), ("memory", "4Gi")],
            &[],
        );
        assert_eq!(
            node_capacity(&n),
            Some(Capacity {
                millicpu: 6000,
                memory_mib: 4096,
                disk_mib: None
            })
        );
        let n = k8s_node(
            &[
                (ANNOTATION_CAPACITY_VCPU, "2"),
                (ANNOTATION_CAPACITY_MEMORY_MIB, "1000"),
            ],
            &[],
            &[],
        );
        assert_eq!(
            node_capacity(&n),
            Some(Capacity {
                millicpu: 2000,
                memory_mib: 1000,
                disk_mib: None
            })
        );
        // A garbled annotation falls back to allocatable rather than inventing a number.
        let n = k8s_node(
            &[(ANNOTATION_CAPACITY_MEMORY_MIB, "lots")],
            &[("cpu", "2"), ("memory", "2Gi")],
            &[],
        );
        assert_eq!(
            node_capacity(&n),
            Some(Capacity {
                millicpu: 2000,
                memory_mib: 2048,
                disk_mib: None
            })
        );
    }
}
