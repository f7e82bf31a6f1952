//! The life of an ephemeral VM on a real API server, with the test playing the node agent: scheduling,
//! the agent's Starting/Running/Succeeded, the deletion handshake, and expiry.

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
async fn ephemeral_vm_runs_to_success_and_deletion_waits_for_teardown() {
    let mut h = Harness::start("vmlife").await;
    let node = h.add_node("n", 4, 4096).await;
    let class = h.add_class("c", 1, 1024, None).await;
    h.create_vm(fixtures::vm("vm1").class(&class)).await;
    h.wait_phase("vm1", VmPhase::Scheduled, WAIT).await;

    // Bound but not running: the node's backlog.
    h.wait_metric(&format!("imp_node_vm_backlog{{node=\"{node}\"}} 1"), WAIT)
        .await;
    h.wait_metric("imp_vms{phase=\"Scheduled\"} 1", WAIT).await;

    // The agent's phases are left alone by the operator.
    h.agent_run("vm1").await;
    h.wait_metric("imp_vms{phase=\"Running\"} 1", WAIT).await;
    assert!(
        !h.metrics_text().contains("imp_node_vm_backlog{"),
        "backlog series left behind"
    );
    let vm = h
        .wait_vm("vm1", "Running with NodeHealthy", WAIT, |vm| {
            phase_of(vm) == Some(VmPhase::Running)
                && cond(vm, condition::NODE_HEALTHY).is_some_and(|c| c.0 == "True")
        })
        .await;
    assert_eq!(
        cond(&vm, condition::READY),
        Some(("True".into(), reason::GUEST_READY.into()))
    );
    assert_eq!(
        cond(&vm, condition::SCHEDULED).unwrap().0,
        "True",
        "agent write kept the operator's condition"
    );
    h.agent_stop("vm1", VmPhase::Succeeded, reason::RUNNER_EXITED)
        .await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let vm = h.vms().get("vm1").await.unwrap();
    assert_eq!(
        phase_of(&vm),
        Some(VmPhase::Succeeded),
        "ephemeral VMs are not restarted"
    );
    assert_eq!(node_of(&vm), Some(node.as_str()));

    // Deletion: Terminating, held by the finalizer until the agent records TornDown.
    h.vms()
        .delete("vm1", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_phase("vm1", VmPhase::Terminating, WAIT).await;
    h.wait_event("vm1", reason::TERMINATING, WAIT).await;
    // Longer than the forced-finalizer timeout: a healthy node's VM is never forced.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        h.vms().get_opt("vm1").await.unwrap().is_some(),
        "finalizer removed without teardown"
    );
    h.agent_torn_down("vm1").await;
    let took = h.wait_gone("vm1", WAIT).await;
    eprintln!("finalizer released {took:?} after TornDown");
    let reasons: Vec<String> = h.events("vm1").await.into_iter().map(|e| e.0).collect();
    for r in [reason::SCHEDULED, reason::TERMINATING, reason::TORN_DOWN] {
        assert!(
            reasons.iter().any(|x| x == r),
            "{r} missing from {reasons:?}"
        );
    }
    assert!(
        !reasons.iter().any(|x| x == reason::FINALIZER_FORCED),
        "{reasons:?}"
    );
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unbound_vm_is_released_at_once_on_deletion() {
    let mut h = Harness::start("vmunbound").await;
    let class = h.add_class("c", 1, 1024, None).await;
    // No node at all: the VM never binds.
    h.create_vm(fixtures::vm("vm1").class(&class)).await;
    h.wait_phase("vm1", VmPhase::Pending, WAIT).await;
    h.vms()
        .delete("vm1", &DeleteParams::default())
        .await
        .unwrap();
    let took = h.wait_gone("vm1", WAIT).await;
    eprintln!("unbound VM gone {took:?} after its deletion");
    // "At once" is what the operator did, not a time: a VM it had waited for would have gone by the
    // forced-finalizer timeout, with that reason (a time bound tells the two apart only on an idle
    // machine).
    let reasons: Vec<String> = h.events("vm1").await.into_iter().map(|e| e.0).collect();
    assert!(
        !reasons.iter().any(|x| x == reason::FINALIZER_FORCED),
        "{reasons:?}"
    );
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn expired_vm_is_deleted_with_an_expired_event() {
    let mut h = Harness::start("vmexpire").await;
    h.add_node("n", 4, 4096).await;
    let class = h.add_class("c", 1, 1024, None).await;
    h.create_vm(fixtures::vm("vm1").class(&class).expire_after("2s"))
        .await;
    h.wait_phase("vm1", VmPhase::Scheduled, WAIT).await;
    // Not Running yet: no clock, however long it waits.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        h.vms()
            .get("vm1")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_none(),
        "expired before first Running"
    );

    let running = h.agent_run("vm1").await;
    let first = running.status.unwrap().first_running_time.unwrap().0;
    let started = Instant::now();
    let vm = h
        .wait_vm("vm1", "deleting", WAIT, |vm| {
            vm.metadata.deletion_timestamp.is_some()
        })
        .await;
    let after = started.elapsed();
    eprintln!("expireAfter 2s: deletion began {after:?} after Running (firstRunningTime {first})");
    assert!(
        after >= Duration::from_millis(900),
        "expired too early: {after:?}"
    ); // RFC 3339 seconds resolution
    assert_eq!(
        vm.status.as_ref().unwrap().reason.as_deref(),
        Some(reason::EXPIRED)
    );
    let note = h.wait_event("vm1", reason::EXPIRED, WAIT).await;
    assert!(note.contains("expireAfter"), "{note}");
    h.wait_phase("vm1", VmPhase::Terminating, WAIT).await;
    h.agent_torn_down("vm1").await;
    h.wait_gone("vm1", WAIT).await;
    assert!(h.metrics_text().contains("imp_vm_expired_total 1"));
    h.finish().await;
}
