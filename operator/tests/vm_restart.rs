//! Restart policy of persistent VMs on a real API server: backoff, in-place restart inherited from the
//! class, exhaustion with cool-down, and manual reset.

mod vm_common;

use std::time::{Duration, Instant};

use imp_api::{
    OnExhaustion, VmPhase,
    names::{ANNOTATION_RESET_RESTARTS, reason},
};
use imp_testkit::fixtures;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use vm_common::*;

const WAIT: Duration = Duration::from_secs(15);

fn restarts(vm: &imp_api::ImpVM) -> u32 {
    vm.status
        .as_ref()
        .and_then(|s| s.restarts.as_ref())
        .map_or(0, |r| r.count)
}

#[tokio::test(flavor = "multi_thread")]
async fn in_place_restart_inherited_from_class_exhausts_and_cools_down() {
    let mut h = Harness::start("vmcool").await;
    let node = h.add_node("n", 4, 4096).await;
    let policy = fixtures::restart()
        .in_place()
        .initial_delay("1s")
        .max_delay("1s")
        .max_retries(1)
        .cool_down("2s");
    let class = h.add_class("c", 1, 1024, Some(policy.build())).await;
    h.create_vm(fixtures::vm("svc").class(&class).persistent())
        .await;
    h.wait_phase("svc", VmPhase::Scheduled, WAIT).await;
    h.agent_run("svc").await;

    // Stop 1: restarted in place after the 1s backoff.
    let stopped = Instant::now();
    h.agent_stop("svc", VmPhase::Failed, reason::RUNNER_EXITED_NON_ZERO)
        .await;
    h.wait_event("svc", reason::BACK_OFF, WAIT).await;
    let vm = h
        .wait_vm("svc", "restarted once", WAIT, |vm| {
            phase_of(vm) == Some(VmPhase::Scheduled) && restarts(vm) == 1
        })
        .await;
    let delay = stopped.elapsed();
    eprintln!("in-place restart after {delay:?} (initialDelay 1s)");
    assert!(delay >= Duration::from_millis(900), "{delay:?}");
    assert_eq!(node_of(&vm), Some(node.as_str()), "in-place keeps the node");
    let note = h.wait_event("svc", reason::RESTARTING, WAIT).await;
    assert!(
        note.contains("restart 1 of 1")
            && note.contains("in place")
            && note.contains(reason::RUNNER_EXITED_NON_ZERO),
        "{note}"
    );

    // Stop 2: the budget (1) is spent.
    h.agent_run("svc").await;
    h.agent_stop("svc", VmPhase::Failed, reason::RUNNER_EXITED_NON_ZERO)
        .await;
    let exhausted_at = Instant::now();
    let vm = h.wait_phase("svc", VmPhase::RetryExhausted, WAIT).await;
    let message = vm.status.as_ref().unwrap().message.clone().unwrap();
    assert!(
        message.contains("1 of 1 restarts spent") && message.contains("cool-down"),
        "{message}"
    );
    h.wait_event("svc", reason::RETRY_EXHAUSTED, WAIT).await;

    // After coolDownPeriod: budget reset and restarted in place.
    let vm = h
        .wait_vm("svc", "reset", WAIT, |vm| {
            phase_of(vm) == Some(VmPhase::Scheduled)
        })
        .await;
    let cooled = exhausted_at.elapsed();
    eprintln!("cool-down reset after {cooled:?} (coolDownPeriod 2s)");
    assert!(cooled >= Duration::from_millis(1500), "{cooled:?}");
    assert_eq!(restarts(&vm), 0);
    assert!(
        vm.status
            .as_ref()
            .unwrap()
            .restarts
            .as_ref()
            .unwrap()
            .exhausted_time
            .is_none()
    );
    let note = h
        .wait_event("svc", reason::RESTART_BUDGET_RESET, WAIT)
        .await;
    assert!(note.starts_with(reason::COOL_DOWN_ELAPSED), "{note}");
    let text = h.metrics_text();
    assert!(text.contains("imp_vm_retry_exhausted_total 1"), "{text}");
    assert!(
        text.contains("imp_vm_restart_budget_resets_total{reason=\"CoolDownElapsed\"} 1"),
        "{text}"
    );
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn manual_reset_restarts_an_exhausted_vm_and_consumes_the_annotation() {
    let mut h = Harness::start("vmreset").await;
    h.add_node("n", 4, 4096).await;
    let class = h.add_class("c", 1, 1024, None).await;
    let policy = fixtures::restart()
        .initial_delay("1s")
        .max_retries(1)
        .on_exhaustion(OnExhaustion::ManualReset);
    h.create_vm(
        fixtures::vm("svc")
            .class(&class)
            .persistent()
            .restart(policy.build()),
    )
    .await;
    h.wait_phase("svc", VmPhase::Scheduled, WAIT).await;
    h.agent_run("svc").await;
    h.agent_stop("svc", VmPhase::Succeeded, reason::RUNNER_EXITED)
        .await;
    // One restart (reschedule mode: Pending, then bound again), then the budget of 1 is spent.
    h.wait_vm("svc", "restarted once", WAIT, |vm| {
        phase_of(vm) == Some(VmPhase::Scheduled) && restarts(vm) == 1
    })
    .await;
    h.agent_run("svc").await;
    h.agent_stop("svc", VmPhase::Succeeded, reason::RUNNER_EXITED)
        .await;
    let vm = h.wait_phase("svc", VmPhase::RetryExhausted, WAIT).await;
    assert!(
        vm.status
            .unwrap()
            .message
            .unwrap()
            .contains("imp.dev/reset-restarts")
    );
    // Without the annotation it stays down.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        phase_of(&h.vms().get("svc").await.unwrap()),
        Some(VmPhase::RetryExhausted)
    );

    let patch = json!({"metadata": {"annotations": {ANNOTATION_RESET_RESTARTS: "please"}}});
    h.vms()
        .patch("svc", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    // Reschedule mode: Pending with the node cleared, then bound again.
    let vm = h
        .wait_vm("svc", "rescheduled", WAIT, |vm| {
            phase_of(vm) == Some(VmPhase::Scheduled)
                && !vm
                    .metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(ANNOTATION_RESET_RESTARTS))
        })
        .await;
    assert_eq!(restarts(&vm), 0);
    let note = h
        .wait_event("svc", reason::RESTART_BUDGET_RESET, WAIT)
        .await;
    assert!(note.starts_with(reason::MANUAL_RESET), "{note}");
    h.finish().await;
}
