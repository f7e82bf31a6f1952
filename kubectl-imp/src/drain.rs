//! `kubectl imp drain NODE`: the safe way to empty a node of runner VMs (runbooks/day2-upgrades.md).
//! Cordon the node (Imp's scheduler places no new VM on an unschedulable node); delete the runner VMs
//! that hold no job (idle or still starting: their pools replace them on other nodes); wait for the
//! runner VMs running a job to finish (their pools delete them); leave VMs of no pool to their owner.
//! Then the runtime pod can be rolled (its DaemonSet is `OnDelete`) and the node uncordoned.

use std::time::Duration;

use imp_api::ImpVM;
use kube::Client;
use serde::Serialize;

use crate::observe::{self, Scope};
use crate::status::{RunnerState, runner_state};
use crate::{Error, output::columns};

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Plan {
    /// Runner VMs without a job: deleted now.
    pub delete: Vec<String>,
    /// Runner VMs running a job: waited for.
    pub wait: Vec<String>,
    /// VMs of no runner pool: left alone, named.
    pub others: Vec<String>,
}

fn key(vm: &ImpVM) -> String {
    format!(
        "{}/{}",
        vm.metadata.namespace.clone().unwrap_or_default(),
        vm.metadata.name.clone().unwrap_or_default()
    )
}

/// What to do with the VMs bound to `node`.
pub fn plan(node: &str, vms: &[ImpVM]) -> Plan {
    let mut p = Plan::default();
    for vm in vms
        .iter()
        .filter(|v| v.spec.node_name.as_deref() == Some(node))
    {
        let pooled = vm
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(imp_api::names::LABEL_RUNNER_POOL));
        let state = runner_state(vm);
        if !pooled {
            if state != RunnerState::Finished && state != RunnerState::Failed {
                p.others.push(key(vm));
            }
            continue;
        }
        match state {
            RunnerState::Busy => p.wait.push(key(vm)),
            RunnerState::Idle
            | RunnerState::Starting
            | RunnerState::Minting
            | RunnerState::Failed => {
                if vm.metadata.deletion_timestamp.is_none() {
                    p.delete.push(key(vm));
                }
            }
            // On its way out already.
            RunnerState::Finished => {}
        }
    }
    p
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub node: String,
    pub cordoned: bool,
    pub deleted: Vec<String>,
    pub waited_for: Vec<String>,
    pub left: Vec<String>,
    /// What to do next: the runtime pod's OnDelete roll, uncordon.
    pub next: Vec<String>,
}

impl Outcome {
    pub fn table(&self) -> String {
        let mut rows = vec![["ACTION", "VMS"].map(str::to_owned)];
        let list = |v: &[String]| {
            if v.is_empty() {
                "-".to_owned()
            } else {
                v.join(" ")
            }
        };
        rows.push(["cordoned".into(), format!("node {}", self.node)]);
        rows.push(["deleted (no job)".into(), list(&self.deleted)]);
        rows.push(["waited for (job finished)".into(), list(&self.waited_for)]);
        rows.push(["left (no runner pool)".into(), list(&self.left)]);
        let mut out = columns(&rows);
        for n in &self.next {
            out.push_str(&format!("next: {n}\n"));
        }
        out
    }
}

/// Cordons `node`, deletes its runner VMs without a job, and waits up to `timeout` for the others'
/// jobs (polling every `every`).
pub async fn run(
    client: &Client,
    node: &str,
    imp_namespace: &str,
    timeout: Duration,
    every: Duration,
) -> Result<Outcome, Error> {
    observe::node(client, node).await?;
    observe::cordon(client, node).await?;
    let first = plan(node, &observe::vms(client, &Scope::All).await?);
    for vm in &first.delete {
        let (ns, name) = vm.split_once('/').unwrap_or_default();
        observe::delete_vm(client, ns, name).await?;
    }
    let start = tokio::time::Instant::now();
    let mut current = first.clone();
    loop {
        if current.wait.is_empty() {
            break;
        }
        if start.elapsed() >= timeout {
            return Err(Error::DrainTimeout {
                node: node.to_owned(),
                busy: current.wait.len(),
                waited_s: timeout.as_secs(),
                vms: current.wait.join(" "),
            });
        }
        tokio::time::sleep(every).await;
        current = plan(node, &observe::vms(client, &Scope::All).await?);
    }
    let runtime = observe::runtime_pods(client, imp_namespace)
        .await?
        .into_iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .and_then(|p| p.metadata.name);
    let mut next = Vec::new();
    if let Some(pod) = runtime {
        next.push(format!(
            "roll the runtime now that no job runs here (updateStrategy OnDelete): \
             kubectl -n {imp_namespace} delete pod {pod}"
        ));
    }
    if !current.others.is_empty() {
        next.push(format!(
            "VMs of no runner pool still run here: {}",
            current.others.join(" ")
        ));
    }
    next.push(format!("when done: kubectl uncordon {node}"));
    Ok(Outcome {
        node: node.to_owned(),
        cordoned: true,
        deleted: first.delete,
        waited_for: first.wait,
        left: current.others,
        next,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn vm(name: &str, node: &str, pooled: bool, status: Value) -> ImpVM {
        let labels = if pooled {
            json!({"imp.dev/runner-pool": "p"})
        } else {
            json!({})
        };
        serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": "ns", "labels": labels},
            "spec": {"classRef": {"name": "c"}, "image": "i", "lifecycle": "ephemeral", "nodeName": node, "runnerConfigSecret": "s"},
            "status": status}))
        .unwrap()
    }

    #[test]
    fn idle_runners_go_busy_ones_are_waited_for_others_are_named() {
        let idle = json!({"runner": {"handoff": "Started"}});
        let busy = json!({"runner": {"handoff": "Started"}, "job": {"pickedUpTime": "2026-01-01T00:00:00.000000Z"}});
        let vms = [
            vm("idle", "n1", true, idle.clone()),
            vm("booting", "n1", true, json!({"phase": "Starting"})),
            vm("busy", "n1", true, busy),
            vm("persistent", "n1", false, json!({"phase": "Running"})),
            vm("elsewhere", "n2", true, idle),
        ];
        let p = plan("n1", &vms);
        assert_eq!(p.delete, ["ns/idle", "ns/booting"]);
        assert_eq!(p.wait, ["ns/busy"]);
        assert_eq!(p.others, ["ns/persistent"]);
    }
}
