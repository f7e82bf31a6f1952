//! Node loss on a real API server: a stale agent heartbeat, a node NotReady past its grace period, a deleted
//! node, and the forced finalizer for a VM whose node is gone.

mod vm_common;

use std::time::{Duration, Instant};

use imp_api::{
    VmPhase,
    names::{condition, reason},
};
use imp_testkit::fixtures;
use kube::api::DeleteParams;
use vm_common::*;

const WAIT: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread")]
async fn stale_heartbeat_fails_ephemeral_vm_with_node_lost() {
    let mut h = Harness::start("vmstale").await;
    let node = h.add_node("n", 4, 4096).await;
    let class = h.add_class("c", 1, 1024, None).await;
    h.create_vm(fixtures::vm("vm1").class(&class)).await;
    h.wait_phase("vm1", VmPhase::Scheduled, WAIT).await;
    h.agent_run("vm1").await;
    h.wait_vm("vm1", "NodeHealthy", WAIT, |vm| {
        cond(vm, condition::NODE_HEALTHY).is_some_and(|c| c.0 == "True")
    })
    .await;

    let stopped = Instant::now();
    h.stop_heartbeat(&node);
    let vm = h.wait_phase("vm1", VmPhase::Failed, WAIT).await;
    eprintln!(
        "stale heartbeat (2s threshold) -> Failed NodeLost in {:?}",
        stopped.elapsed()
    );
    assert!(
        stopped.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        stopped.elapsed()
    );
    let status = vm.status.clone().unwrap();
    assert_eq!(status.reason.as_deref(), Some(reason::NODE_LOST));
    assert!(
        status
            .message
            .unwrap()
            .contains(reason::AGENT_HEARTBEAT_STALE)
    );
    assert_eq!(
        cond(&vm, condition::NODE_HEALTHY),
        Some(("False".into(), reason::AGENT_HEARTBEAT_STALE.into()))
    );
    let note = h.wait_event("vm1", reason::NODE_LOST, WAIT).await;
    assert!(note.contains(&node), "{note}");
    // Failed ephemeral VMs stay (their pool replaces them) and keep the node for the record.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let vm = h.vms().get("vm1").await.unwrap();
    assert_eq!(phase_of(&vm), Some(VmPhase::Failed));
    assert_eq!(node_of(&vm), Some(node.as_str()));
    assert!(
        h.metrics_text()
            .contains("imp_vm_node_lost_total{reason=\"AgentHeartbeatStale\"} 1")
    );
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn not_ready_node_beyond_grace_reschedules_persistent_vm() {
    let mut h = Harness::start("vmnotready").await;
    let first = h.add_node("first", 2, 2048).await;
    let policy = fixtures::restart()
        .in_place()
        .initial_delay("1s")
        .max_retries(3);
    let class = h.add_class("c", 1, 1024, None).await;
    h.create_vm(
        fixtures::vm("svc")
            .class(&class)
            .persistent()
            .restart(policy.build()),
    )
    .await;
    let vm = h.wait_phase("svc", VmPhase::Scheduled, WAIT).await;
    assert_eq!(node_of(&vm), Some(first.as_str()));
    h.agent_run("svc").await;
    let second = h.add_node("second", 8, 16384).await;

    let went_down = Instant::now();
    h.set_node_condition(&first, "Ready", "False").await;
    // Within the grace period: NodeHealthy Unknown, the VM keeps running.
    let vm = h
        .wait_vm("svc", "NodeHealthy Unknown", WAIT, |vm| {
            cond(vm, condition::NODE_HEALTHY).is_some_and(|c| c.0 == "Unknown")
        })
        .await;
    // Running while NodeHealthy is Unknown: a state the operator writes only within the grace period
    // (past it the VM is NodeLost), so no clock is needed to show it was inside.
    assert_eq!(phase_of(&vm), Some(VmPhase::Running));
    // Past it: NodeLost, then rescheduled (in-place is impossible on a lost node) onto the other node.
    let vm = h
        .wait_vm("svc", "failed with NodeLost", WAIT, |vm| {
            vm.status.as_ref().and_then(|s| s.reason.as_deref()) == Some(reason::NODE_LOST)
        })
        .await;
    eprintln!(
        "NotReady (2s grace) -> NodeLost after {:?}",
        went_down.elapsed()
    );
    assert_eq!(
        cond(&vm, condition::NODE_HEALTHY),
        Some(("False".into(), reason::NODE_NOT_READY.into()))
    );
    let vm = h
        .wait_vm("svc", "bound to the second node", WAIT, |vm| {
            node_of(vm) == Some(second.as_str())
        })
        .await;
    assert_eq!(
        vm.status.as_ref().unwrap().restarts.as_ref().unwrap().count,
        1
    );
    h.wait_phase("svc", VmPhase::Scheduled, WAIT).await;
    let note = h.wait_event("svc", reason::RESTARTING, WAIT).await;
    assert!(note.contains("on a newly chosen node"), "{note}");
    assert!(
        h.metrics_text()
            .contains("imp_vm_restarts_total{mode=\"reschedule\"} 1")
    );
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn deleted_node_forces_the_finalizer_after_the_timeout() {
    let mut h = Harness::start("vmforce").await;
    let node = h.add_node("n", 4, 4096).await;
    let class = h.add_class("c", 1, 1024, None).await;
    h.create_vm(fixtures::vm("vm1").class(&class)).await;
    h.wait_phase("vm1", VmPhase::Scheduled, WAIT).await;
    h.agent_run("vm1").await;

    h.nodes()
        .delete(&node, &DeleteParams::default())
        .await
        .unwrap();
    let vm = h.wait_phase("vm1", VmPhase::Failed, WAIT).await;
    assert_eq!(
        cond(&vm, condition::NODE_HEALTHY),
        Some(("False".into(), reason::NODE_DELETED.into()))
    );

    let deleted = Instant::now();
    h.vms()
        .delete("vm1", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_phase("vm1", VmPhase::Terminating, WAIT).await;
    let took = h.wait_gone("vm1", WAIT).await;
    eprintln!("finalizer forced {took:?} after deletion (timeout 2s, node deleted)");
    // deletionTimestamp has whole-second resolution, so the 2s timeout may end up to 1s early.
    assert!(
        deleted.elapsed() >= Duration::from_millis(1000),
        "forced before the timeout: {:?}",
        deleted.elapsed()
    );
    let note = h.wait_event("vm1", reason::FINALIZER_FORCED, WAIT).await;
    assert!(
        note.contains(reason::NODE_DELETED) && note.contains("without a teardown record"),
        "{note}"
    );
    assert!(h.metrics_text().contains("imp_vm_finalizer_forced_total 1"));
    h.finish().await;
}
