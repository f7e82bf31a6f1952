//! The pressureLifecycle's pure half: views of the watched Nodes and ImpVMs, and [`decide`], which
//! picks the next VM to suspend on each pressured node (or records, stalls, lifts) as a [`Plan`].

use std::{cmp::Reverse, collections::BTreeMap, time::Duration};

use imp_api::{
    DesiredState, ImpVM, Lifecycle, VmPhase,
    conditions::{self, ConditionStatus},
    names::{ANNOTATION_PRESSURE_SUSPENDED_AT, LABEL_RUNNER_POOL, condition, reason},
};
use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};
use kube::{Resource, ResourceExt};

use crate::vm::health;

// ---------------------------------------------------------------------------------------------------
// Observe

/// A watched Node: since when its MemoryPressure condition is True, if it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView {
    pub name: String,
    pub pressure_since: Option<Timestamp>,
}

impl NodeView {
    pub fn from_node(node: &Node) -> Self {
        let pressure = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "MemoryPressure"))
            .filter(|c| c.status == "True");
        NodeView {
            name: node.name_any(),
            // Without a transition time the episode is taken to have always lasted: a VM resumed by
            // hand is then never suspended again by this episode (the cautious side).
            pressure_since: pressure.map(|c| {
                c.last_transition_time
                    .as_ref()
                    .map_or(Timestamp::UNIX_EPOCH, |t| t.0)
            }),
        }
    }
}

/// `namespace/name` of a VM.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VmKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for VmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The `PressureSuspended` condition as the decision needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConditionView {
    pub status: ConditionStatus,
    pub reason: String,
    pub since: Timestamp,
}

/// What the decision needs of one ImpVM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmView {
    pub key: VmKey,
    pub node: Option<String>,
    pub phase: Option<VmPhase>,
    pub desired: DesiredState,
    /// Persistent, not a runner VM (ephemeral, runnerConfigSecret, pool label) and not being deleted.
    pub suspendable: bool,
    pub deleting: bool,
    /// The class's memoryMiB; None when the class is unknown (sorted last).
    pub memory_mib: Option<u64>,
    /// [`ANNOTATION_PRESSURE_SUSPENDED_AT`]; an unreadable value counts as long ago.
    pub marked_at: Option<Timestamp>,
    pub condition: Option<ConditionView>,
}

impl VmView {
    pub fn from_vm(vm: &ImpVM, memory_mib: Option<u64>) -> Self {
        let deleting = vm.meta().deletion_timestamp.is_some();
        let runner =
            vm.spec.runner_config_secret.is_some() || vm.labels().contains_key(LABEL_RUNNER_POOL);
        let status = vm.status.as_ref();
        VmView {
            key: VmKey {
                namespace: vm.namespace().unwrap_or_default(),
                name: vm.name_any(),
            },
            node: vm.spec.node_name.clone().filter(|n| !n.is_empty()),
            phase: status.and_then(|s| s.phase),
            desired: vm.spec.desired_state(),
            suspendable: vm.spec.lifecycle == Lifecycle::Persistent && !runner && !deleting,
            deleting,
            memory_mib,
            marked_at: vm
                .annotations()
                .get(ANNOTATION_PRESSURE_SUSPENDED_AT)
                .map(|v| v.parse().unwrap_or(Timestamp::UNIX_EPOCH)),
            condition: status
                .and_then(|s| conditions::find(&s.conditions, condition::PRESSURE_SUSPENDED))
                .map(|c| ConditionView {
                    status: c.status.parse().unwrap_or(ConditionStatus::Unknown),
                    reason: c.reason.clone(),
                    since: c.last_transition_time.0,
                }),
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Decide

/// One write the executor performs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Set `spec.desiredState: Suspended` and the mark; then the Event and the condition.
    Suspend {
        vm: VmKey,
        node: String,
        memory_mib: Option<u64>,
        /// The state to ask for again to resume it (Running or ScaleToZero).
        previous: DesiredState,
    },
    /// The mark is there but the condition is not True (the operator stopped between the two writes):
    /// write the Event and the condition.
    Record { vm: VmKey, node: Option<String> },
    /// A suspend did not reach Suspended within the timeout: Warning Event, condition reason
    /// PressureSuspendStalled; the node's next VM is chosen in the same pass.
    Stall {
        vm: VmKey,
        node: String,
        phase: Option<VmPhase>,
        waited: Duration,
    },
    /// Someone asked for another state than Suspended: drop the mark, condition False.
    Lift { vm: VmKey, desired: DesiredState },
}

/// How a node under MemoryPressure stands after the pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// This VM is being suspended (chosen in this pass).
    Suspending(VmKey),
    /// Waiting for this VM, chosen earlier, to report Suspended.
    Waiting(VmKey),
    /// Nothing left on the node the lifecycle may suspend.
    Exhausted,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// Every node whose MemoryPressure is True, by name.
    pub pressured: BTreeMap<String, NodeState>,
    /// VMs the lifecycle holds at desiredState Suspended (marked, not lifted).
    pub held: usize,
    /// When a wait times out, if sooner than the resync.
    pub requeue_after: Option<Duration>,
}

/// Phases in which a VM still occupies (or is about to occupy) its node's memory.
fn resident(phase: Option<VmPhase>) -> bool {
    matches!(
        phase,
        Some(
            VmPhase::Scheduled
                | VmPhase::Starting
                | VmPhase::Running
                | VmPhase::Suspending
                | VmPhase::Resuming
        )
    )
}

fn is_true(c: &Option<ConditionView>) -> bool {
    c.as_ref()
        .is_some_and(|c| c.status == ConditionStatus::True)
}

fn elapsed(now: Timestamp, since: Timestamp) -> Duration {
    health::until(since, now)
}

/// The pure decision over every watched node and VM.
pub fn decide(
    nodes: &[NodeView],
    vms: &[VmView],
    now: Timestamp,
    suspend_timeout: Duration,
) -> Plan {
    let mut plan = Plan::default();

    // Bookkeeping of VMs already marked, wherever they are and whether or not pressure lasts.
    for vm in vms.iter().filter(|v| !v.deleting) {
        let Some(_) = vm.marked_at else { continue };
        if vm.desired != DesiredState::Suspended {
            plan.steps.push(Step::Lift {
                vm: vm.key.clone(),
                desired: vm.desired,
            });
        } else {
            plan.held += 1;
            if !is_true(&vm.condition) {
                plan.steps.push(Step::Record {
                    vm: vm.key.clone(),
                    node: vm.node.clone(),
                });
            }
        }
    }

    let mut nodes: Vec<&NodeView> = nodes.iter().collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    for node in nodes {
        let Some(since) = node.pressure_since else {
            continue;
        };
        let here: Vec<&VmView> = vms
            .iter()
            .filter(|v| v.node.as_deref() == Some(node.name.as_str()) && !v.deleting)
            .collect();

        // One at a time: a suspend still on its way holds back the next, up to the timeout.
        let mut waiting_on = None;
        for vm in here.iter().filter(|v| {
            v.marked_at.is_some() && v.desired == DesiredState::Suspended && resident(v.phase)
        }) {
            let marked = vm.marked_at.unwrap_or(Timestamp::UNIX_EPOCH);
            let waited = elapsed(now, marked);
            if waited < suspend_timeout {
                let left = suspend_timeout - waited;
                plan.requeue_after =
                    Some(plan.requeue_after.map_or(left, |r: Duration| r.min(left)));
                waiting_on.get_or_insert_with(|| vm.key.clone());
            } else if vm.condition.as_ref().map(|c| c.reason.as_str())
                != Some(reason::PRESSURE_SUSPEND_STALLED)
            {
                plan.steps.push(Step::Stall {
                    vm: vm.key.clone(),
                    node: node.name.clone(),
                    phase: vm.phase,
                    waited,
                });
            }
        }
        if let Some(key) = waiting_on {
            plan.pressured
                .insert(node.name.clone(), NodeState::Waiting(key));
            continue;
        }

        let mut candidates: Vec<&&VmView> = here
            .iter()
            .filter(|v| {
                v.suspendable
                    && v.phase == Some(VmPhase::Running)
                    && v.marked_at.is_none()
                    && v.desired != DesiredState::Suspended
                    // Resumed by someone during this very episode: their call, not ours.
                    && !v.condition.as_ref().is_some_and(|c| {
                        c.reason == reason::PRESSURE_SUSPEND_LIFTED
                            && c.status != ConditionStatus::True
                            && c.since >= since
                    })
            })
            .collect();
        candidates.sort_by_key(|v| (Reverse(v.memory_mib), v.key.clone()));
        match candidates.first() {
            Some(vm) => {
                plan.steps.push(Step::Suspend {
                    vm: vm.key.clone(),
                    node: node.name.clone(),
                    memory_mib: vm.memory_mib,
                    previous: vm.desired,
                });
                plan.pressured
                    .insert(node.name.clone(), NodeState::Suspending(vm.key.clone()));
            }
            None => {
                plan.pressured
                    .insert(node.name.clone(), NodeState::Exhausted);
            }
        }
    }
    plan
}

pub fn state_name(s: DesiredState) -> &'static str {
    match s {
        DesiredState::Running => "Running",
        DesiredState::Suspended => "Suspended",
        DesiredState::ScaleToZero => "ScaleToZero",
    }
}

/// The Event note and condition message of a suspend: why, and how to resume.
pub fn suspend_message(
    vm: &VmKey,
    node: Option<&str>,
    memory_mib: Option<u64>,
    previous: DesiredState,
) -> String {
    let size = memory_mib.map_or_else(String::new, |m| format!(" ({m} MiB)"));
    let node = node.unwrap_or("its node");
    let resume = state_name(if previous == DesiredState::Suspended {
        DesiredState::Running
    } else {
        previous
    });
    format!(
        "node {node} reports MemoryPressure: the operator's pressureLifecycle suspended this VM{size}, the \
         largest resident persistent VM there, to free memory. It is never resumed automatically: once the \
         node has memory again, set spec.desiredState: {resume} (kubectl -n {ns} patch impvm {name} --type \
         merge -p '{{\"spec\":{{\"desiredState\":\"{resume}\"}}}}')",
        ns = vm.namespace,
        name = vm.name,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const T0: i64 = 1_800_000_000;
    const TIMEOUT: Duration = Duration::from_secs(300);

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(T0 + s).unwrap()
    }

    fn node(name: &str, since: Option<i64>) -> NodeView {
        NodeView {
            name: name.into(),
            pressure_since: since.map(at),
        }
    }

    fn key(name: &str) -> VmKey {
        VmKey {
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    /// A Running persistent VM on `node` with `mib` of memory.
    fn vm(name: &str, node: &str, mib: u64) -> VmView {
        VmView {
            key: key(name),
            node: Some(node.into()),
            phase: Some(VmPhase::Running),
            desired: DesiredState::Running,
            suspendable: true,
            deleting: false,
            memory_mib: Some(mib),
            marked_at: None,
            condition: None,
        }
    }

    /// `v` as the lifecycle left it `ago` seconds before `now`, the agent reporting `phase`.
    fn marked(mut v: VmView, marked: i64, phase: VmPhase) -> VmView {
        v.marked_at = Some(at(marked));
        v.desired = DesiredState::Suspended;
        v.phase = Some(phase);
        v.condition = Some(ConditionView {
            status: ConditionStatus::True,
            reason: reason::SUSPENDED_FOR_MEMORY_PRESSURE.into(),
            since: at(marked),
        });
        v
    }

    fn suspends(plan: &Plan) -> Vec<String> {
        plan.steps
            .iter()
            .filter_map(|s| match s {
                Step::Suspend { vm, .. } => Some(vm.name.clone()),
                _ => None,
            })
            .collect()
    }

    fn run(nodes: &[NodeView], vms: &[VmView], now: i64) -> Plan {
        decide(nodes, vms, at(now), TIMEOUT)
    }

    #[test]
    fn without_pressure_nothing_is_suspended() {
        let vms = [vm("a", "n1", 1024), vm("b", "n1", 2048)];
        let plan = run(&[node("n1", None)], &vms, 10);
        assert_eq!(plan, Plan::default());
    }

    #[test]
    fn the_largest_resident_vm_goes_first() {
        let vms = [
            vm("small", "n1", 512),
            vm("big", "n1", 4096),
            vm("mid", "n1", 2048),
        ];
        let plan = run(&[node("n1", Some(0))], &vms, 10);
        assert_eq!(suspends(&plan), ["big"]);
        assert_eq!(
            plan.steps[0],
            Step::Suspend {
                vm: key("big"),
                node: "n1".into(),
                memory_mib: Some(4096),
                previous: DesiredState::Running
            }
        );
        assert_eq!(plan.pressured["n1"], NodeState::Suspending(key("big")));
    }

    #[test]
    fn ties_break_by_name_and_unknown_sizes_go_last() {
        let mut unknown = vm("a-unknown", "n1", 0);
        unknown.memory_mib = None;
        let vms = [unknown.clone(), vm("z", "n1", 1024), vm("b", "n1", 1024)];
        assert_eq!(suspends(&run(&[node("n1", Some(0))], &vms, 1)), ["b"]);
        assert_eq!(
            suspends(&run(&[node("n1", Some(0))], &[unknown], 1)),
            ["a-unknown"]
        );
    }

    #[test]
    fn the_next_waits_until_the_first_reports_suspended() {
        let nodes = [node("n1", Some(0))];
        for phase in [VmPhase::Running, VmPhase::Suspending] {
            let vms = [
                marked(vm("big", "n1", 4096), 5, phase),
                vm("mid", "n1", 2048),
            ];
            let plan = run(&nodes, &vms, 10);
            assert!(suspends(&plan).is_empty(), "{phase:?}: {plan:?}");
            assert_eq!(plan.pressured["n1"], NodeState::Waiting(key("big")));
            assert_eq!(plan.requeue_after, Some(Duration::from_secs(295)));
            assert_eq!(plan.held, 1);
        }
        let vms = [
            marked(vm("big", "n1", 4096), 5, VmPhase::Suspended),
            vm("mid", "n1", 2048),
            vm("small", "n1", 512),
        ];
        assert_eq!(suspends(&run(&nodes, &vms, 10)), ["mid"]);
    }

    #[test]
    fn a_suspend_that_stalls_past_the_timeout_lets_the_next_go_once() {
        let nodes = [node("n1", Some(0))];
        let vms = [
            marked(vm("big", "n1", 4096), 0, VmPhase::Suspending),
            vm("mid", "n1", 2048),
        ];
        let plan = run(&nodes, &vms, 299);
        assert!(suspends(&plan).is_empty());
        let plan = run(&nodes, &vms, 300);
        assert_eq!(
            plan.steps,
            [
                Step::Stall {
                    vm: key("big"),
                    node: "n1".into(),
                    phase: Some(VmPhase::Suspending),
                    waited: TIMEOUT
                },
                Step::Suspend {
                    vm: key("mid"),
                    node: "n1".into(),
                    memory_mib: Some(2048),
                    previous: DesiredState::Running
                }
            ]
        );
        // Once recorded as stalled, no second Stall step.
        let mut stalled = vms.clone();
        stalled[0].condition.as_mut().unwrap().reason = reason::PRESSURE_SUSPEND_STALLED.into();
        let plan = run(&nodes, &stalled, 400);
        assert_eq!(suspends(&plan), ["mid"]);
        assert!(!plan.steps.iter().any(|s| matches!(s, Step::Stall { .. })));
    }

    #[test]
    fn only_running_persistent_vms_are_candidates() {
        let nodes = [node("n1", Some(0))];
        let mut runner = vm("runner", "n1", 8192);
        runner.suspendable = false;
        let mut starting = vm("starting", "n1", 8192);
        starting.phase = Some(VmPhase::Starting);
        let mut failed = vm("failed", "n1", 8192);
        failed.phase = Some(VmPhase::Failed);
        let mut user_suspended = vm("user", "n1", 8192);
        user_suspended.desired = DesiredState::Suspended;
        user_suspended.phase = Some(VmPhase::Suspended);
        let mut deleting = vm("deleting", "n1", 8192);
        deleting.deleting = true;
        deleting.suspendable = false;
        let elsewhere = vm("elsewhere", "n2", 8192);
        let vms = [
            runner,
            starting,
            failed,
            user_suspended,
            deleting,
            elsewhere,
        ];
        let plan = run(&nodes, &vms, 1);
        assert!(plan.steps.is_empty(), "{plan:?}");
        assert_eq!(plan.pressured["n1"], NodeState::Exhausted);
        let mut with_one = vms.to_vec();
        with_one.push(vm("svc", "n1", 256));
        assert_eq!(suspends(&run(&nodes, &with_one, 1)), ["svc"]);
    }

    #[test]
    fn a_user_suspend_in_flight_does_not_hold_back_the_lifecycle() {
        // Not marked: the lifecycle did not choose it and does not wait for it.
        let mut user = vm("user", "n1", 8192);
        user.desired = DesiredState::Suspended;
        user.phase = Some(VmPhase::Suspending);
        let plan = run(&[node("n1", Some(0))], &[user, vm("svc", "n1", 256)], 1);
        assert_eq!(suspends(&plan), ["svc"]);
    }

    #[test]
    fn scale_to_zero_vms_are_suspended_and_told_to_ask_for_scale_to_zero_again() {
        let mut s2z = vm("s2z", "n1", 1024);
        s2z.desired = DesiredState::ScaleToZero;
        let plan = run(&[node("n1", Some(0))], &[s2z], 1);
        let Step::Suspend { previous, .. } = &plan.steps[0] else {
            panic!("{plan:?}")
        };
        assert_eq!(*previous, DesiredState::ScaleToZero);
        let msg = suspend_message(&key("s2z"), Some("n1"), Some(1024), *previous);
        assert!(msg.contains("set spec.desiredState: ScaleToZero"), "{msg}");
        assert!(msg.contains("kubectl -n ns patch impvm s2z"), "{msg}");
        assert!(msg.contains("node n1 reports MemoryPressure"), "{msg}");
        assert!(msg.contains("never resumed automatically"), "{msg}");
    }

    #[test]
    fn nodes_are_independent_one_in_flight_per_node() {
        let nodes = [node("n1", Some(0)), node("n2", Some(0)), node("n3", None)];
        let vms = [
            marked(vm("a1", "n1", 4096), 5, VmPhase::Suspending),
            vm("a2", "n1", 2048),
            vm("b1", "n2", 1024),
            vm("b2", "n2", 2048),
            vm("c1", "n3", 8192),
        ];
        let plan = run(&nodes, &vms, 10);
        assert_eq!(suspends(&plan), ["b2"]);
        assert_eq!(
            plan.pressured,
            BTreeMap::from([
                ("n1".into(), NodeState::Waiting(key("a1"))),
                ("n2".into(), NodeState::Suspending(key("b2")))
            ])
        );
    }

    #[test]
    fn clearing_the_pressure_stops_further_suspends_and_resumes_nothing() {
        let vms = [
            marked(vm("big", "n1", 4096), 5, VmPhase::Suspended),
            vm("mid", "n1", 2048),
        ];
        let plan = run(&[node("n1", None)], &vms, 10);
        assert!(plan.steps.is_empty(), "{plan:?}");
        assert!(plan.pressured.is_empty());
        assert_eq!(plan.held, 1);
    }

    #[test]
    fn a_resume_by_hand_lifts_the_mark_and_is_respected_while_the_pressure_lasts() {
        let nodes = [node("n1", Some(0))];
        let mut resumed = marked(vm("big", "n1", 4096), 5, VmPhase::Resuming);
        resumed.desired = DesiredState::Running;
        let plan = run(&nodes, &[resumed.clone()], 20);
        assert_eq!(
            plan.steps,
            [Step::Lift {
                vm: key("big"),
                desired: DesiredState::Running
            }]
        );
        // A marked VM no longer asking for Suspended does not hold the node back.
        assert_eq!(plan.pressured["n1"], NodeState::Exhausted);
        assert_eq!(plan.held, 0);

        // After the lift: condition False PressureSuspendLifted since t=20, running again.
        let mut lifted = vm("big", "n1", 4096);
        lifted.condition = Some(ConditionView {
            status: ConditionStatus::False,
            reason: reason::PRESSURE_SUSPEND_LIFTED.into(),
            since: at(20),
        });
        let others = [lifted.clone(), vm("mid", "n1", 2048)];
        assert_eq!(suspends(&run(&nodes, &others, 30)), ["mid"]);
        // A new pressure episode (since after the lift) may suspend it again.
        assert_eq!(
            suspends(&run(&[node("n1", Some(25))], &others, 30)),
            ["big"]
        );
    }

    #[test]
    fn a_mark_without_its_condition_is_recorded() {
        let mut v = marked(vm("big", "n1", 4096), 5, VmPhase::Suspending);
        v.condition = None;
        let plan = run(&[node("n1", None)], &[v], 10);
        assert_eq!(
            plan.steps,
            [Step::Record {
                vm: key("big"),
                node: Some("n1".into())
            }]
        );
    }

    #[test]
    fn deleting_vms_are_left_alone() {
        let mut v = marked(vm("big", "n1", 4096), 5, VmPhase::Running);
        v.deleting = true;
        v.desired = DesiredState::Running;
        let plan = run(&[node("n1", Some(0))], &[v], 10);
        assert!(plan.steps.is_empty(), "{plan:?}");
        assert_eq!(plan.pressured["n1"], NodeState::Exhausted);
    }

    #[test]
    fn views_read_the_node_condition_and_the_vm() {
        let n: Node = serde_json::from_value(json!({"metadata": {"name": "n1"}, "status": {"conditions": [
            {"type": "MemoryPressure", "status": "True", "lastTransitionTime": "2027-01-15T08:00:00Z"}]}}))
        .unwrap();
        assert_eq!(
            NodeView::from_node(&n).pressure_since,
            Some("2027-01-15T08:00:00Z".parse().unwrap())
        );
        let calm: Node = serde_json::from_value(
            json!({"metadata": {"name": "n1"}, "status": {"conditions": [
            {"type": "MemoryPressure", "status": "False"}]}}),
        )
        .unwrap();
        assert_eq!(NodeView::from_node(&calm).pressure_since, None);

        let base = json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "v", "namespace": "ns",
                         "annotations": {ANNOTATION_PRESSURE_SUSPENDED_AT: "2027-01-15T08:01:00Z"}},
            "spec": {"classRef": {"name": "c"}, "image": "i", "lifecycle": "persistent", "nodeName": "n1",
                     "desiredState": "Suspended"},
            "status": {"phase": "Suspending"}});
        let v = VmView::from_vm(&serde_json::from_value(base.clone()).unwrap(), Some(512));
        assert!(v.suspendable);
        assert_eq!(v.marked_at, Some("2027-01-15T08:01:00Z".parse().unwrap()));
        assert_eq!(
            (v.phase, v.desired),
            (Some(VmPhase::Suspending), DesiredState::Suspended)
        );
        assert_eq!(v.node.as_deref(), Some("n1"));

        let mut runner = base.clone();
        runner["spec"]["runnerConfigSecret"] = json!("s");
        assert!(!VmView::from_vm(&serde_json::from_value(runner).unwrap(), None).suspendable);
        let mut pooled = base.clone();
        pooled["metadata"]["labels"] = json!({LABEL_RUNNER_POOL: "p"});
        assert!(!VmView::from_vm(&serde_json::from_value(pooled).unwrap(), None).suspendable);
        let mut ephemeral = base.clone();
        ephemeral["spec"]["lifecycle"] = json!("ephemeral");
        assert!(!VmView::from_vm(&serde_json::from_value(ephemeral).unwrap(), None).suspendable);
        let mut garbled = base;
        garbled["metadata"]["annotations"][ANNOTATION_PRESSURE_SUSPENDED_AT] = json!("yesterday");
        assert_eq!(
            VmView::from_vm(&serde_json::from_value(garbled).unwrap(), None).marked_at,
            Some(Timestamp::UNIX_EPOCH)
        );
    }
}
