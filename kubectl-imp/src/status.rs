//! `kubectl imp status`: what the pools are doing, whether the nodes are healthy, and the last
//! failures with their reasons, from one read of pools, VMs, nodes, heartbeat Leases, runtime pods and
//! Events.

use std::collections::BTreeMap;

use imp_api::{HandoffState, ImpVM, ImpVMRunnerPool, VmPhase};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;
use serde_json::Value;

use crate::output::columns;
use crate::time::{human, parse_time};
use crate::timeline::dig;

/// Where one runner VM is in its life, as far as the pool's numbers go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunnerState {
    /// Created; its JIT config not minted yet.
    Minting,
    /// Minted; scheduling, booting or handing off.
    Starting,
    /// Runner online, no job.
    Idle,
    /// Running a job.
    Busy,
    Failed,
    /// Runner exited, torn down or being deleted.
    Finished,
}

pub fn runner_state(vm: &ImpVM) -> RunnerState {
    let status = vm.status.clone().unwrap_or_default();
    let runner = status.runner.clone().unwrap_or_default();
    let torn_down = status
        .conditions
        .iter()
        .any(|c| c.type_ == imp_api::names::condition::TORN_DOWN && c.status == "True");
    match status.phase {
        Some(VmPhase::Failed | VmPhase::RetryExhausted) => return RunnerState::Failed,
        Some(VmPhase::Succeeded) => return RunnerState::Finished,
        _ => {}
    }
    if vm.metadata.deletion_timestamp.is_some() || torn_down || runner.exited_time.is_some() {
        return RunnerState::Finished;
    }
    if runner.handoff == Some(HandoffState::Started) {
        let picked = status
            .job
            .as_ref()
            .is_some_and(|j| j.picked_up_time.is_some());
        return if picked {
            RunnerState::Busy
        } else {
            RunnerState::Idle
        };
    }
    if vm.spec.runner_config_secret.is_none() {
        RunnerState::Minting
    } else {
        RunnerState::Starting
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolRow {
    pub namespace: String,
    pub name: String,
    pub desired: u32,
    pub idle: usize,
    pub busy: usize,
    pub starting: usize,
    pub minting: usize,
    pub failing: usize,
    /// Conditions that need attention: `AtCapacity`/`ScalingLimited` when True, any other when False.
    pub conditions: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeRow {
    pub name: String,
    pub ready: bool,
    pub schedulable: bool,
    pub vcpu: Option<String>,
    pub memory_mib: Option<String>,
    pub vms: usize,
    /// Seconds since the agent last renewed its heartbeat Lease.
    pub heartbeat_age_s: Option<f64>,
    /// The node's imp-runtime pod is Ready (none: no runtime pod there).
    pub runtime_ready: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Failure {
    pub time: Option<String>,
    pub object: String,
    pub reason: String,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Status {
    pub pools: Vec<PoolRow>,
    pub nodes: Vec<NodeRow>,
    pub failures: Vec<Failure>,
}

/// Everything `status` reads.
pub struct Observed<'a> {
    pub pools: &'a [ImpVMRunnerPool],
    pub vms: &'a [ImpVM],
    pub nodes: &'a [Node],
    pub leases: &'a [Lease],
    pub runtime_pods: &'a [Pod],
    pub events: &'a [Value],
    pub now: f64,
}

/// How many failures `status` lists.
pub const LAST_FAILURES: usize = 10;

fn pool_row(pool: &ImpVMRunnerPool, vms: &[ImpVM]) -> PoolRow {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let namespace = pool.metadata.namespace.clone().unwrap_or_default();
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for vm in vms.iter().filter(|v| {
        v.metadata.namespace.as_deref() == Some(&namespace)
            && v.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(imp_api::names::LABEL_RUNNER_POOL))
                == Some(&name)
    }) {
        let key = match runner_state(vm) {
            RunnerState::Minting => "minting",
            RunnerState::Starting => "starting",
            RunnerState::Idle => "idle",
            RunnerState::Busy => "busy",
            RunnerState::Failed => "failing",
            RunnerState::Finished => "finished",
        };
        *count.entry(key).or_default() += 1;
    }
    let status = pool.status.clone().unwrap_or_default();
    let conditions = status
        .conditions
        .iter()
        .filter(|c| {
            let limit = matches!(c.type_.as_str(), "AtCapacity" | "ScalingLimited");
            (limit && c.status == "True") || (!limit && c.status == "False")
        })
        .map(|c| format!("{}={} ({})", c.type_, c.status, c.reason))
        .collect();
    let n = |k: &str| count.get(k).copied().unwrap_or_default();
    PoolRow {
        namespace,
        name,
        desired: status.desired,
        idle: n("idle"),
        busy: n("busy"),
        starting: n("starting"),
        minting: n("minting"),
        failing: n("failing"),
        conditions,
    }
}

fn node_row(node: &Node, o: &Observed) -> NodeRow {
    let name = node.metadata.name.clone().unwrap_or_default();
    let annotation = |key: &str| {
        node.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key).cloned())
    };
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let lease = imp_api::names::lease_name(&name);
    let heartbeat_age_s = o
        .leases
        .iter()
        .find(|l| l.metadata.name.as_deref() == Some(lease.as_str()))
        .and_then(|l| l.spec.as_ref()?.renew_time.as_ref())
        .map(|t| (o.now - t.0.as_nanosecond() as f64 / 1e9).max(0.0));
    let runtime_ready = o
        .runtime_pods
        .iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&name))
        .map(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
    let vms = o
        .vms
        .iter()
        .filter(|v| v.spec.node_name.as_deref() == Some(&name))
        .filter(|v| {
            v.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_none_or(|p| !p.is_terminal())
        })
        .count();
    NodeRow {
        name,
        ready,
        schedulable: !node
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false),
        vcpu: annotation(imp_api::names::ANNOTATION_CAPACITY_VCPU),
        memory_mib: annotation(imp_api::names::ANNOTATION_CAPACITY_MEMORY_MIB),
        vms,
        heartbeat_age_s,
        runtime_ready,
    }
}

/// Warning Events about Imp's objects, and failed VMs, newest first.
fn failures(o: &Observed) -> Vec<Failure> {
    let imp_kinds = [
        "ImpVM",
        "ImpVMRunnerPool",
        "ImpNetwork",
        "ImpVMClass",
        "Node",
    ];
    let mut out: Vec<(f64, Failure)> = o
        .events
        .iter()
        .filter(|e| dig(e, "type").and_then(Value::as_str) == Some("Warning"))
        .filter(|e| {
            dig(e, "regarding.kind")
                .and_then(Value::as_str)
                .is_some_and(|k| imp_kinds.contains(&k))
        })
        .map(|e| {
            let s = |p: &str| {
                dig(e, p)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            let time = [
                "eventTime",
                "deprecatedLastTimestamp",
                "metadata.creationTimestamp",
            ]
            .iter()
            .map(|p| s(p))
            .find(|t| !t.is_empty());
            let at = time.as_deref().and_then(parse_time).unwrap_or_default();
            let failure = Failure {
                object: format!("{}/{}", s("regarding.kind"), s("regarding.name")),
                reason: s("reason"),
                message: s("note"),
                time,
            };
            (at, failure)
        })
        .collect();
    for vm in o.vms {
        let status = vm.status.clone().unwrap_or_default();
        if !matches!(
            status.phase,
            Some(VmPhase::Failed | VmPhase::RetryExhausted)
        ) {
            continue;
        }
        let object = format!("ImpVM/{}", vm.metadata.name.clone().unwrap_or_default());
        let reason = status.reason.clone().unwrap_or_default();
        // The VM's own failure, unless an Event already says the same.
        if out
            .iter()
            .any(|(_, f)| f.object == object && f.reason == reason)
        {
            continue;
        }
        let t = status
            .conditions
            .iter()
            .map(|c| c.last_transition_time.0)
            .max()
            .or(vm.metadata.creation_timestamp.as_ref().map(|t| t.0));
        out.push((
            t.map_or(0.0, |t| t.as_nanosecond() as f64 / 1e9),
            Failure {
                time: t.map(|t| t.to_string()),
                object,
                reason,
                message: status.message.clone().unwrap_or_default(),
            },
        ));
    }
    out.sort_by(|a, b| b.0.total_cmp(&a.0));
    out.into_iter()
        .take(LAST_FAILURES)
        .map(|(_, f)| f)
        .collect()
}

pub fn build(o: &Observed) -> Status {
    Status {
        pools: o.pools.iter().map(|p| pool_row(p, o.vms)).collect(),
        nodes: o.nodes.iter().map(|n| node_row(n, o)).collect(),
        failures: failures(o),
    }
}

impl Status {
    pub fn table(&self) -> String {
        let mut out = String::new();
        let mut pools = vec![
            [
                "NAMESPACE",
                "POOL",
                "DESIRED",
                "IDLE",
                "BUSY",
                "STARTING",
                "MINTING",
                "FAILING",
                "CONDITIONS",
            ]
            .map(str::to_owned),
        ];
        for p in &self.pools {
            pools.push([
                p.namespace.clone(),
                p.name.clone(),
                p.desired.to_string(),
                p.idle.to_string(),
                p.busy.to_string(),
                p.starting.to_string(),
                p.minting.to_string(),
                p.failing.to_string(),
                if p.conditions.is_empty() {
                    "ok".to_owned()
                } else {
                    p.conditions.join(", ")
                },
            ]);
        }
        out.push_str(&columns(&pools));
        out.push('\n');
        let mut nodes = vec![
            [
                "NODE",
                "READY",
                "SCHEDULABLE",
                "VCPU",
                "MEMORY(MiB)",
                "VMS",
                "HEARTBEAT",
                "RUNTIME",
            ]
            .map(str::to_owned),
        ];
        for n in &self.nodes {
            nodes.push([
                n.name.clone(),
                n.ready.to_string(),
                n.schedulable.to_string(),
                n.vcpu.clone().unwrap_or_else(|| "-".into()),
                n.memory_mib.clone().unwrap_or_else(|| "-".into()),
                n.vms.to_string(),
                n.heartbeat_age_s
                    .map_or("none".into(), |a| format!("{} ago", human(a))),
                match n.runtime_ready {
                    Some(true) => "ready".into(),
                    Some(false) => "not ready".into(),
                    None => "no pod".into(),
                },
            ]);
        }
        out.push_str(&columns(&nodes));
        out.push('\n');
        if self.failures.is_empty() {
            out.push_str("no recent failures\n");
        } else {
            let mut rows = vec![["TIME", "OBJECT", "REASON", "MESSAGE"].map(str::to_owned)];
            for f in &self.failures {
                rows.push([
                    f.time.clone().unwrap_or_default(),
                    f.object.clone(),
                    f.reason.clone(),
                    f.message.clone(),
                ]);
            }
            out.push_str(&columns(&rows));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(name: &str, spec_secret: bool, status: Value) -> ImpVM {
        let mut spec = json!({"classRef": {"name": "c"}, "image": "i", "lifecycle": "ephemeral"});
        if spec_secret {
            spec["runnerConfigSecret"] = json!("jit");
        }
        serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": "ns", "labels": {"imp.dev/runner-pool": "p"}},
            "spec": spec, "status": status}))
        .unwrap()
    }

    #[test]
    fn runner_states_follow_the_handoff_and_the_served_job() {
        assert_eq!(
            runner_state(&vm("a", false, json!({}))),
            RunnerState::Minting
        );
        assert_eq!(
            runner_state(&vm("a", true, json!({"phase": "Starting"}))),
            RunnerState::Starting
        );
        let started = json!({"phase": "Running", "runner": {"handoff": "Started"}});
        assert_eq!(runner_state(&vm("a", true, started)), RunnerState::Idle);
        let busy = json!({"phase": "Running", "runner": {"handoff": "Started"},
                          "job": {"jobId": 1, "pickedUpTime": "2026-01-01T00:00:00.000000Z"}});
        assert_eq!(runner_state(&vm("a", true, busy)), RunnerState::Busy);
        assert_eq!(
            runner_state(&vm("a", true, json!({"phase": "Failed"}))),
            RunnerState::Failed
        );
        let exited =
            json!({"runner": {"handoff": "Started", "exitedTime": "2026-01-01T00:00:00Z"}});
        assert_eq!(runner_state(&vm("a", true, exited)), RunnerState::Finished);
    }

    #[test]
    fn failures_are_warnings_about_imp_objects_and_failed_vms_newest_first() {
        let events = [
            json!({"type": "Warning", "reason": imp_api::names::reason::MINT_FAILED, "note": "401", "eventTime": "2026-01-01T00:00:05.000000Z",
                   "regarding": {"kind": "ImpVMRunnerPool", "name": "p"}}),
            json!({"type": "Normal", "reason": "Booted", "eventTime": "2026-01-01T00:00:06.000000Z",
                   "regarding": {"kind": "ImpVM", "name": "a"}}),
            json!({"type": "Warning", "reason": imp_api::names::reason::BACK_OFF, "eventTime": "2026-01-01T00:00:07.000000Z",
                   "regarding": {"kind": "Pod", "name": "x"}}),
        ];
        let failed = vm(
            "b",
            true,
            json!({"phase": "Failed", "reason": "BootTimeout", "message": "no Hello",
            "conditions": [{"type": "Ready", "status": "False", "reason": "BootTimeout", "message": "",
                            "lastTransitionTime": "2026-01-01T00:00:09Z"}]}),
        );
        let s = build(&Observed {
            pools: &[],
            vms: &[failed],
            nodes: &[],
            leases: &[],
            runtime_pods: &[],
            events: &events,
            now: 0.0,
        });
        let reasons: Vec<_> = s.failures.iter().map(|f| f.reason.as_str()).collect();
        assert_eq!(
            reasons,
            ["BootTimeout", imp_api::names::reason::MINT_FAILED]
        );
        assert!(s.table().contains("ImpVM/b"));
    }
}
