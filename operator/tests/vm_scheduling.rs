//! Scheduling on a real API server: best fit, unschedulable reasons, capacity shared between VMs and freed
//! by the teardown handshake, taints, and class resolution.

mod vm_common;

use std::time::Duration;

use imp_api::{
    VmPhase,
    names::{FINALIZER_VM_CLEANUP, condition, reason},
};
use imp_operator::vm::Timing;
use imp_testkit::fixtures;
use k8s_openapi::api::core::v1::Toleration;
use kube::{ResourceExt, api::DeleteParams};
use serde_json::json;
use vm_common::*;

const WAIT: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread")]
async fn binds_to_the_best_fit_node_and_kubectl_shows_phase_and_node() {
    let mut h = Harness::start("vmsched").await;
    let big = h.add_node("big", 8, 16384).await;
    let small = h.add_node("small", 2, 2048).await;
    let class = h.add_class("small", 1, 1024, None).await;
    h.create_vm(fixtures::vm("vm1").class(&class)).await;

    let vm = h.wait_phase("vm1", VmPhase::Scheduled, WAIT).await;
    assert_eq!(
        node_of(&vm),
        Some(small.as_str()),
        "best fit leaves the least memory free (big: {big})"
    );
    assert!(vm.finalizers().iter().any(|f| f == FINALIZER_VM_CLEANUP));
    assert_eq!(
        cond(&vm, condition::SCHEDULED),
        Some(("True".into(), reason::NODE_ASSIGNED.into()))
    );
    assert!(vm.status.as_ref().unwrap().scheduled_time.is_some());
    let vm = h
        .wait_vm("vm1", "NodeHealthy=True", WAIT, |vm| {
            cond(vm, condition::NODE_HEALTHY).is_some_and(|c| c.0 == "True")
        })
        .await;
    assert_eq!(
        cond(&vm, condition::NODE_HEALTHY).unwrap().1,
        reason::NODE_READY
    );
    let note = h.wait_event("vm1", reason::SCHEDULED, WAIT).await;
    assert!(note.contains(&small), "{note}");

    let (count, sum) = h.scheduling_latency();
    assert_eq!(count, 1);
    eprintln!("imp_vm_scheduling_latency_seconds: creation -> Scheduled took {sum:.3}s");
    assert!(sum < 10.0, "{sum}");

    let out = h
        .env
        .kubectl()
        .args(["get", "impvm", "vm1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let header = text.lines().next().unwrap();
    assert!(
        header.contains("PHASE") && header.contains("NODE"),
        "{text}"
    );
    let row = text.lines().nth(1).unwrap();
    let phase = format!("{:?}", VmPhase::Scheduled);
    assert!(row.contains(&phase) && row.contains(&small), "{text}");
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unschedulable_vm_waits_pending_with_reasons_then_binds_when_a_node_fits() {
    let mut h = Harness::start("vmunsched").await;
    let cordoned = h
        .add_node_with(
            "cordoned",
            4,
            4096,
            json!({}),
            json!({"unschedulable": true}),
        )
        .await;
    let pressured = h.add_node("pressured", 4, 4096).await;
    h.set_node_condition(&pressured, "MemoryPressure", "True")
        .await;
    h.add_node("tiny", 4, 512).await;
    let class = h.add_class("c", 1, 1024, None).await;
    h.create_vm(fixtures::vm("vm1").class(&class)).await;

    let vm = h
        .wait_vm("vm1", reason::UNSCHEDULABLE, WAIT, |vm| {
            vm.status.as_ref().and_then(|s| s.reason.as_deref()) == Some(reason::UNSCHEDULABLE)
        })
        .await;
    assert_eq!(phase_of(&vm), Some(VmPhase::Pending));
    let message = vm.status.as_ref().unwrap().message.clone().unwrap();
    for part in [
        "0/3 nodes are available",
        "1 cordoned",
        "1 under MemoryPressure",
        "1 insufficient memory",
    ] {
        assert!(message.contains(part), "{part:?} not in {message:?}");
    }
    assert_eq!(
        cond(&vm, condition::SCHEDULED),
        Some(("False".into(), reason::UNSCHEDULABLE.into()))
    );
    let note = h.wait_event("vm1", reason::FAILED_SCHEDULING, WAIT).await;
    assert_eq!(note, message);

    // Uncordoning fixes it: the Node watch (or the retry) binds the VM there.
    h.nodes()
        .patch(
            &cordoned,
            &Default::default(),
            &kube::api::Patch::Merge(json!({"spec": {"unschedulable": false}})),
        )
        .await
        .unwrap();
    let vm = h.wait_phase("vm1", VmPhase::Scheduled, WAIT).await;
    assert_eq!(node_of(&vm), Some(cordoned.as_str()));
    assert_eq!(vm.status.as_ref().unwrap().reason, None);
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn capacity_is_shared_between_vms_and_freed_by_teardown() {
    let mut h = Harness::start("vmcap").await;
    let node = h.add_node("n", 2, 8192).await;
    let class = h.add_class("one-cpu", 1, 1024, None).await;
    // Created together: the scheduler must not place all three on a node with room for two.
    for name in ["a", "b", "c"] {
        h.create_vm(fixtures::vm(name).class(&class)).await;
    }
    let mut bound = vec![];
    let mut waiting = vec![];
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        bound.clear();
        waiting.clear();
        for name in ["a", "b", "c"] {
            let vm = h.vms().get(name).await.unwrap();
            match phase_of(&vm) {
                Some(VmPhase::Scheduled) => bound.push(name),
                Some(VmPhase::Pending)
                    if vm.status.as_ref().unwrap().reason.as_deref()
                        == Some(reason::UNSCHEDULABLE) =>
                {
                    waiting.push(name)
                }
                _ => {}
            }
        }
        if bound.len() + waiting.len() == 3 || std::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        (bound.len(), waiting.len()),
        (2, 1),
        "bound {bound:?}, waiting {waiting:?}"
    );
    let pending = waiting[0];
    let vm = h.vms().get(pending).await.unwrap();
    let message = vm.status.unwrap().message.unwrap();
    assert!(message.contains("1 insufficient cpu"), "{message}");

    // Deleting a bound VM frees its share only after the agent's teardown record.
    let victim = bound[0];
    h.vms()
        .delete(victim, &DeleteParams::default())
        .await
        .unwrap();
    h.wait_phase(victim, VmPhase::Terminating, WAIT).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        phase_of(&h.vms().get(pending).await.unwrap()),
        Some(VmPhase::Pending),
        "capacity reused before teardown"
    );
    h.agent_torn_down(victim).await;
    h.wait_gone(victim, WAIT).await;
    let vm = h.wait_phase(pending, VmPhase::Scheduled, WAIT).await;
    assert_eq!(node_of(&vm), Some(node.as_str()));
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn taints_keep_vms_off_unless_tolerated() {
    let mut h = Harness::start("vmtaint").await;
    // The tainted node is the better fit, so only the taint can keep a VM off it.
    let tainted = h
        .add_node_with("tainted", 2, 2048, json!({}), json!({"taints": [{"key": "imp.dev/dedicated", "value": "gpu", "effect": "NoSchedule"}]}))
        .await;
    let plain = h.add_node("plain", 8, 16384).await;
    let class = h.add_class("c", 1, 1024, None).await;
    h.create_vm(fixtures::vm("plain-vm").class(&class)).await;
    h.create_vm(
        fixtures::vm("tolerant-vm")
            .class(&class)
            .tolerate(Toleration {
                key: Some("imp.dev/dedicated".into()),
                operator: Some("Equal".into()),
                value: Some("gpu".into()),
                effect: Some("NoSchedule".into()),
                toleration_seconds: None,
            }),
    )
    .await;
    let vm = h.wait_phase("plain-vm", VmPhase::Scheduled, WAIT).await;
    assert_eq!(node_of(&vm), Some(plain.as_str()));
    let vm = h.wait_phase("tolerant-vm", VmPhase::Scheduled, WAIT).await;
    assert_eq!(node_of(&vm), Some(tainted.as_str()));
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_class_fails_spec_invalid_and_recovers_when_created() {
    let mut h = Harness::start("vmclass").await;
    h.add_node("n", 4, 4096).await;
    let missing = h.unique("later");
    h.create_vm(fixtures::vm("vm1").class(&missing)).await;
    let vm = h.wait_phase("vm1", VmPhase::Failed, WAIT).await;
    let status = vm.status.clone().unwrap();
    assert_eq!(status.reason.as_deref(), Some(reason::SPEC_INVALID));
    assert!(
        status
            .message
            .unwrap()
            .contains(&format!("ImpVMClass {missing:?} does not exist"))
    );
    assert_eq!(
        cond(&vm, condition::SCHEDULED),
        Some(("False".into(), reason::CLASS_NOT_FOUND.into()))
    );
    h.wait_event("vm1", reason::SPEC_INVALID, WAIT).await;

    // Creating the class: the class watch brings the VM back through scheduling.
    let created = h.add_class("later", 1, 1024, None).await;
    assert_eq!(created, missing);
    h.wait_phase("vm1", VmPhase::Scheduled, WAIT).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn agent_published_capacity_overrides_allocatable() {
    let mut h = Harness::start("vmcapann").await;
    let node = h.add_node("n", 1, 1024).await;
    let class = h.add_class("big", 2, 2048, None).await;
    h.create_vm(fixtures::vm("vm1").class(&class)).await;
    let vm = h
        .wait_vm("vm1", reason::UNSCHEDULABLE, WAIT, |vm| {
            vm.status.as_ref().and_then(|s| s.reason.as_deref()) == Some(reason::UNSCHEDULABLE)
        })
        .await;
    let message = vm.status.unwrap().message.unwrap();
    assert!(message.contains("1 insufficient cpu"), "{message}");

    // The agent publishes what it really offers to VMs: the annotations win over allocatable.
    let patch = json!({"metadata": {"annotations": {
        imp_api::names::ANNOTATION_CAPACITY_VCPU: "4",
        imp_api::names::ANNOTATION_CAPACITY_MEMORY_MIB: "4096",
    }}});
    h.nodes()
        .patch(&node, &Default::default(), &kube::api::Patch::Merge(&patch))
        .await
        .unwrap();
    let vm = h.wait_phase("vm1", VmPhase::Scheduled, WAIT).await;
    assert_eq!(node_of(&vm), Some(node.as_str()));
    h.finish().await;
}

/// A teardown frees its share for the VMs waiting for room at once, not at their next
/// unschedulable retry (60 s here): the chaos suite's replacements waited 15 s for it on a node
/// with room for one runner.
#[tokio::test(flavor = "multi_thread")]
async fn a_teardown_schedules_the_waiting_vm_at_once() {
    let mut h = Harness::start_with(
        "vmnudge",
        Timing {
            unschedulable_retry: Duration::from_secs(60),
            ..fast_timing()
        },
    )
    .await;
    let node = h.add_node("n", 1, 8192).await;
    let class = h.add_class("one-cpu", 1, 1024, None).await;
    h.create_vm(fixtures::vm("first").class(&class)).await;
    h.wait_phase("first", VmPhase::Scheduled, WAIT).await;
    h.create_vm(fixtures::vm("second").class(&class)).await;
    h.wait_vm("second", reason::UNSCHEDULABLE, WAIT, |vm| {
        vm.status.as_ref().and_then(|s| s.reason.as_deref()) == Some(reason::UNSCHEDULABLE)
    })
    .await;
    h.delete_and_tear_down("first", WAIT).await;
    let vm = h
        .wait_phase("second", VmPhase::Scheduled, Duration::from_secs(10))
        .await;
    assert_eq!(node_of(&vm), Some(node.as_str()));
    h.finish().await;
}

/// Issue 30: a user-set spec.nodeName passes the same capacity and taint checks as the
/// scheduler's own choice: a VM pinned to a full or tainted node waits Pending, saying why, and is
/// Scheduled (the agent boots only Scheduled VMs) once the node can take it.
#[tokio::test(flavor = "multi_thread")]
async fn a_user_pinned_vm_waits_for_capacity_and_taints_like_any_other() {
    let mut h = Harness::start("vmpin").await;
    let node = h.add_node("n", 2, 8192).await;
    let tainted = h
        .add_node_with("t", 8, 16384, json!({}), json!({"taints": [{"key": "imp.dev/dedicated", "value": "gpu", "effect": "NoSchedule"}]}))
        .await;
    let class = h.add_class("two-cpu", 2, 1024, None).await;
    h.create_vm(fixtures::vm("first").class(&class)).await;
    let first = h.wait_phase("first", VmPhase::Scheduled, WAIT).await;
    assert_eq!(node_of(&first), Some(node.as_str()), "the untainted node");

    // Pinned by the user to the full node: Pending, Unschedulable naming the node and its lack.
    h.create_vm(fixtures::vm("pinned").class(&class).bound(&node))
        .await;
    let pending = |reason_wanted: &'static str| {
        move |vm: &imp_api::ImpVM| {
            phase_of(vm) == Some(VmPhase::Pending)
                && vm.status.as_ref().unwrap().reason.as_deref() == Some(reason_wanted)
        }
    };
    let vm = h
        .wait_vm(
            "pinned",
            "Pending Unschedulable",
            WAIT,
            pending(reason::UNSCHEDULABLE),
        )
        .await;
    let message = vm.status.as_ref().unwrap().message.clone().unwrap();
    assert_eq!(
        message,
        format!("spec.nodeName {node}: insufficient cpu: requested 2000m, free 0m")
    );
    assert_eq!(
        cond(&vm, condition::SCHEDULED),
        Some(("False".into(), reason::UNSCHEDULABLE.into()))
    );
    // Pinned to the tainted node, no toleration: waits too.
    h.create_vm(fixtures::vm("pinned-t").class(&class).bound(&tainted))
        .await;
    let vm = h
        .wait_vm(
            "pinned-t",
            "Pending Unschedulable",
            WAIT,
            pending(reason::UNSCHEDULABLE),
        )
        .await;
    assert_eq!(
        vm.status.unwrap().message.unwrap(),
        format!("spec.nodeName {tainted}: untolerated taint imp.dev/dedicated:NoSchedule")
    );
    // Still waiting a while later: never Scheduled beyond capacity.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for name in ["pinned", "pinned-t"] {
        assert_eq!(
            phase_of(&h.vms().get(name).await.unwrap()),
            Some(VmPhase::Pending),
            "{name}"
        );
    }

    // The first VM goes: the pinned one fits and is Scheduled on its node.
    h.delete_and_tear_down("first", WAIT).await;
    h.wait_gone("first", WAIT).await;
    let vm = h.wait_phase("pinned", VmPhase::Scheduled, WAIT).await;
    assert_eq!(node_of(&vm), Some(node.as_str()));
    assert_eq!(
        cond(&vm, condition::SCHEDULED),
        Some(("True".into(), reason::NODE_ASSIGNED.into()))
    );
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_standby_vm_goes_to_a_node_holding_its_pool_s_template_ready() {
    use imp_api::{ImpVMRunnerPool, StartFrom, names::ANNOTATION_TEMPLATES_READY};
    use kube::api::{Patch, PatchParams, PostParams};
    let mut h = Harness::start("vmsched-standby").await;
    let big = h.add_node("big", 8, 16384).await;
    let small = h.add_node("small", 2, 2048).await;
    let class = h.add_class("small", 1, 1024, None).await;
    // A pool (no pool controller runs here) whose template only "big" reports Ready.
    let pool = h
        .env
        .api::<ImpVMRunnerPool>()
        .create(&PostParams::default(), &fixtures::pool("standby").build())
        .await
        .unwrap();
    let uid = pool.uid().unwrap();
    let patch = json!({"metadata": {"annotations": {ANNOTATION_TEMPLATES_READY: uid}}});
    h.nodes()
        .patch(&big, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    // The controller's Node cache sees the annotation before the VMs exist.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let owned = |name: &str, start: Option<StartFrom>| {
        let mut vm = fixtures::vm(name).class(&class).build();
        vm.spec.start_from = start;
        vm.metadata.owner_references = Some(vec![
            serde_json::from_value(json!({"apiVersion": "imp.dev/v1alpha1",
                "kind": "ImpVMRunnerPool", "name": "standby", "uid": uid, "controller": true}))
            .unwrap(),
        ]);
        vm
    };
    h.create_vm(owned("clone", Some(StartFrom::Template))).await;
    h.create_vm(owned("boot", None)).await;
    let clone = h.wait_phase("clone", VmPhase::Scheduled, WAIT).await;
    assert_eq!(
        node_of(&clone),
        Some(big.as_str()),
        "the template's node, not the best fit ({small})"
    );
    let boot = h.wait_phase("boot", VmPhase::Scheduled, WAIT).await;
    assert_eq!(node_of(&boot), Some(small.as_str()), "a boot: best fit");
    h.finish().await;
}
