//! Runner pool scaling on the real API server with the GitHub simulator: scale from zero on a webhook
//! through a whole job, minIdle, maxRunners, scale-down (deregister first; a busy runner is kept) and pool
//! deletion.

mod pool_common;

use std::time::Duration;

use imp_api::names::{ANNOTATION_RUNNER_ID, LABEL_SECRET_KIND, SECRET_KIND_JIT, condition, reason};
use imp_testkit::github::{
    Fault, FaultRule, JobStatus, WebhookFault,
    runner_protocol::{FakeRunnerOptions, run_fake_runner},
};
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, ListParams},
};
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

fn cond(s: &imp_api::ImpVMRunnerPoolStatus, t: &str) -> (String, String) {
    imp_api::conditions::find(&s.conditions, t)
        .map(|c| (c.status.clone(), c.reason.clone()))
        .unwrap_or_default()
}

fn runner_ids(vms: &[imp_api::ImpVM]) -> Vec<u64> {
    let mut ids: Vec<u64> = vms
        .iter()
        .map(|v| v.annotations()[ANNOTATION_RUNNER_ID].parse().unwrap())
        .collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread")]
async fn scales_from_zero_on_a_webhook_runs_the_job_and_cleans_up() {
    // The sweep is slow here: only the webhook can bring the runner up in time.
    let mut h = PoolHarness::start("pool-zero").await;
    h.start_agent(true, Duration::from_millis(1500));
    h.create_pool("zero", json!({"maxRunners": 5})).await;
    h.wait("pool status", WAIT, || async {
        let s = h.pool_status("zero").await;
        (s.observed_generation == Some(1)).then_some(())
    })
    .await;
    assert!(h.runner_vms("zero").await.is_empty());

    let job = h.sim.queue_job(job());
    let vm = h.wait_minted("zero", 1, WAIT).await.remove(0);
    // The runner takes the job: the pool counts it busy (from the in_progress webhook).
    h.wait("a busy runner", WAIT, || async {
        (h.pool_status("zero").await.busy == 1).then_some(())
    })
    .await;
    let done = h
        .sim
        .wait_job(job.id, WAIT, |j| j.status == JobStatus::Completed)
        .await
        .unwrap();
    assert_eq!(done.status, JobStatus::Completed);
    assert_eq!(
        done.runner_name.as_deref(),
        vm.annotations()
            .get(imp_api::names::ANNOTATION_RUNNER_NAME)
            .map(String::as_str)
    );
    // The finished VM is deleted and nothing replaces it (minIdle 0, no demand).
    h.wait("the finished VM to go", WAIT, || async {
        h.runner_vms("zero").await.is_empty().then_some(())
    })
    .await;
    let s = h
        .wait("status back at zero", WAIT, || async {
            let s = h.pool_status("zero").await;
            (s.total == 0 && s.desired == 0).then_some(s)
        })
        .await;
    assert!(s.last_scale_time.is_some());
    assert!(h.sim.runners().is_empty(), "{:?}", h.sim.runners());
    assert!(h.metric("imp_runner_job_pickup_latency_seconds_count") >= 1.0);
    assert_eq!(
        h.metric("imp_webhook_deliveries_total{result=\"accepted\"}"),
        3.0
    );
    let reasons: Vec<String> = h.events("zero").await.into_iter().map(|e| e.0).collect();
    assert!(
        reasons.contains(&reason::SCALED_UP.to_string()),
        "{reasons:?}"
    );
    assert!(
        reasons.contains(&reason::RUNNERS_CLEANED_UP.to_string()),
        "{reasons:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn keeps_min_idle_and_respects_max_runners() {
    let mut h = PoolHarness::start("pool-idle").await;
    h.start_agent(false, Duration::ZERO);
    h.create_pool("idle", json!({"minIdle": 2, "maxRunners": 3}))
        .await;
    h.wait_minted("idle", 2, WAIT).await;
    let s = h
        .wait("two idle runners", WAIT, || async {
            let s = h.pool_status("idle").await;
            (s.idle == 2).then_some(s)
        })
        .await;
    assert_eq!((s.desired, s.busy, s.total), (2, 0, 2));
    assert_eq!(cond(&s, condition::READY).0, "True");
    assert_eq!(cond(&s, condition::AT_CAPACITY).0, "False");
    assert_eq!(cond(&s, condition::CREDENTIALS_VALID).0, "True");

    // Five queued jobs nobody runs: the pool grows to maxRunners and no further.
    for _ in 0..5 {
        h.sim.queue_job(job());
    }
    h.wait_minted("idle", 3, WAIT).await;
    let s = h
        .wait("at capacity", WAIT, || async {
            let s = h.pool_status("idle").await;
            (cond(&s, condition::AT_CAPACITY).0 == "True").then_some(s)
        })
        .await;
    assert_eq!(s.desired, 3);
    assert_eq!(
        cond(&s, condition::SCALING_LIMITED),
        ("True".into(), reason::MAX_RUNNERS.into())
    );
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(h.runner_vms("idle").await.len(), 3);
    }
    let gauge = format!(
        "imp_runner_pool_runners{{pool=\"{}/idle\",state=\"desired\"}}",
        h.ns
    );
    assert_eq!(h.metric(&gauge), 3.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn scale_down_deregisters_idle_runners_before_deleting_them() {
    let mut h = PoolHarness::start("pool-down").await;
    h.start_agent(false, Duration::ZERO);
    h.create_pool("down", json!({"minIdle": 3, "maxRunners": 5}))
        .await;
    let vms = h.wait_minted("down", 3, WAIT).await;
    h.wait("three idle", WAIT, || async {
        (h.pool_status("down").await.idle == 3).then_some(())
    })
    .await;
    let before = runner_ids(&vms);
    let registered: Vec<u64> = h.sim.runners().iter().map(|r| r.id).collect();
    assert!(before.iter().all(|id| registered.contains(id)));

    h.patch_scaling("down", json!({"minIdle": 1, "maxRunners": 5}))
        .await;
    let left = h
        .wait("one runner left", WAIT, || async {
            let v = h.runner_vms("down").await;
            (v.len() == 1).then_some(v)
        })
        .await;
    let kept = runner_ids(&left)[0];
    let registered: Vec<u64> = h.sim.runners().iter().map(|r| r.id).collect();
    for id in &before {
        assert_eq!(
            registered.contains(id),
            *id == kept,
            "runner {id}: {registered:?}"
        );
    }
    assert_eq!(
        h.metric("imp_runner_deregistrations_total{result=\"deleted\"}"),
        2.0
    );
    let reasons: Vec<String> = h.events("down").await.into_iter().map(|e| e.0).collect();
    assert!(
        reasons.contains(&reason::SCALED_DOWN.to_string()),
        "{reasons:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runner_github_reports_busy_is_kept_on_scale_down() {
    // No agent: the test plays it, keeping the JIT config to run the fake runner itself.
    let h = PoolHarness::start("pool-busy").await;
    h.create_pool("busy", json!({"minIdle": 1, "maxRunners": 2}))
        .await;
    let vm = h.wait_minted("busy", 1, WAIT).await.remove(0);
    let secret: Secret = h
        .secrets()
        .get(vm.spec.runner_config_secret.as_deref().unwrap())
        .await
        .unwrap();
    let config = String::from_utf8(secret.data.unwrap()["jitconfig"].0.clone()).unwrap();
    h.agent_started(&vm).await;
    // The operator never hears of the job (both webhooks lost, sweep slow): it believes the runner idle.
    h.sim.inject_webhook_fault(WebhookFault::Drop, 2);
    let job = h.sim.queue_job(job());
    let runner = tokio::spawn(async move {
        run_fake_runner(
            &config,
            &FakeRunnerOptions {
                job_duration: Duration::from_secs(4),
                ..FakeRunnerOptions::default()
            },
        )
        .await
    });
    h.sim
        .wait_job(job.id, WAIT, |j| j.status == JobStatus::InProgress)
        .await
        .unwrap();
    h.patch_scaling("busy", json!({"minIdle": 0, "maxRunners": 2}))
        .await;
    h.wait("a busy refusal", WAIT, || async {
        (h.metric("imp_runner_deregistrations_total{result=\"busy\"}") >= 1.0).then_some(())
    })
    .await;
    assert_eq!(
        h.runner_vms("busy").await.len(),
        1,
        "the busy runner's VM is kept"
    );
    // The job ends; the runner exits; the agent records it; the VM goes.
    runner.await.unwrap().unwrap();
    h.agent_exited(&vm.name_any()).await;
    h.wait("the VM to go", WAIT, || async {
        h.runner_vms("busy").await.is_empty().then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_the_pool_removes_vms_secrets_and_runners() {
    let h = PoolHarness::start("pool-del").await;
    h.create_pool("gone", json!({"minIdle": 3, "maxRunners": 3}))
        .await;
    h.wait_minted("gone", 3, WAIT).await;
    let jit = ListParams::default().labels(&format!("{LABEL_SECRET_KIND}={SECRET_KIND_JIT}"));
    assert_eq!(h.secrets().list(&jit).await.unwrap().items.len(), 3);
    assert_eq!(h.sim.runners().len(), 3);

    h.pools()
        .delete("gone", &DeleteParams::default())
        .await
        .unwrap();
    h.wait("the pool to go", WAIT, || async {
        h.pools()
            .get_opt("gone")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert!(h.sim.runners().is_empty(), "{:?}", h.sim.runners());
    let vms: Api<imp_api::ImpVM> = h.vms();
    h.wait("VMs and Secrets to go", Duration::from_secs(60), || async {
        let v = vms.list(&ListParams::default()).await.unwrap().items.len();
        let s = h.secrets().list(&jit).await.unwrap().items.len();
        (v == 0 && s == 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_operator_rebuilds_demand_and_never_mints_twice() {
    let mut h = PoolHarness::start("pool-restart").await;
    h.start_agent(false, Duration::ZERO);
    h.create_pool("rs", json!({"maxRunners": 5})).await;
    // Two queued jobs nobody runs: two idle runners wait for them.
    h.sim.queue_job(job());
    h.sim.queue_job(job());
    let before = h.wait_minted("rs", 2, WAIT).await;
    h.wait("two idle", WAIT, || async {
        (h.pool_status("rs").await.idle == 2).then_some(())
    })
    .await;
    let mut names: Vec<String> = before.iter().map(|v| v.name_any()).collect();
    names.sort();
    let ids = runner_ids(&before);

    // Lost in a restart: the queued jobs, the deliveries, everything in memory. The first sweep after
    // it is slow, so the restarted controller has passes without knowing the demand.
    h.sim.inject(
        FaultRule::next(1, Fault::Delay { millis: 3000 }).on_path("installation/repositories"),
    );
    h.restart_operator().await;
    // Until the sweep has rebuilt the demand nothing is retired; afterwards desired is 2 again.
    h.wait("demand rebuilt by the sweep", WAIT, || async {
        let s = h.pool_status("rs").await;
        (h.metric(&format!(
            "imp_runner_pool_runners{{pool=\"{}/rs\",state=\"desired\"}}",
            h.ns
        )) == 2.0
            && s.desired == 2)
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = h.runner_vms("rs").await;
    let mut after_names: Vec<String> = after.iter().map(|v| v.name_any()).collect();
    after_names.sort();
    assert_eq!(after_names, names, "the same runners survive the restart");
    assert_eq!(runner_ids(&after), ids, "no VM was minted again");
    let mut registered: Vec<u64> = h.sim.runners().iter().map(|r| r.id).collect();
    registered.sort();
    assert_eq!(registered, ids, "no new registration at GitHub");
    assert_eq!(h.metric("imp_runner_jit_mint_duration_seconds_count"), 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn vms_failing_before_their_runner_starts_back_the_pool_off() {
    use kube::api::{Patch, PatchParams};
    use std::collections::BTreeSet;
    let timing = imp_operator::runnerpool::PoolTiming {
        start_backoff: Duration::from_secs(2),
        start_backoff_max: Duration::from_secs(8),
        ..fast_timing()
    };
    let mut h = PoolHarness::start_with("pool-startfail", timing).await;
    h.create_pool("sf", json!({"minIdle": 1, "maxRunners": 3}))
        .await;
    // Play a node with a broken image: every minted VM fails before its runner starts.
    let fail = |name: String| {
        let vms = h.vms();
        async move {
            let patch = json!({"status": {"phase": "Failed", "reason": reason::ROOTFS_REJECTED,
                "message": "layer sha256:1: entry \"../x\": path leaves the image root"}});
            let _ = vms
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
        }
    };
    let begin = std::time::Instant::now();
    let mut failed = BTreeSet::new();
    while begin.elapsed() < Duration::from_secs(9) {
        for vm in h.runner_vms("sf").await {
            if vm.spec.runner_config_secret.is_some()
                && vm.metadata.deletion_timestamp.is_none()
                && failed.insert(vm.name_any())
            {
                fail(vm.name_any()).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Waits of 2 s, then 4 s, then 8 s: three VMs in 9 s. Without the backoff a VM fails and is
    // replaced (and a JIT config minted) every few hundred milliseconds.
    assert!((2..=4).contains(&failed.len()), "{failed:?}");
    let events = h.events("sf").await;
    let notes: Vec<&String> = events
        .iter()
        .filter(|(r, _)| r == reason::VM_START_FAILED)
        .map(|(_, n)| n)
        .collect();
    assert!(!notes.is_empty(), "{events:?}");
    assert!(notes[0].contains(reason::ROOTFS_REJECTED), "{}", notes[0]);
    assert!(
        h.metric("imp_runner_vm_start_failures_total{reason=\"RootfsRejected\"}") >= 2.0,
        "{}",
        h.metrics_text()
    );
    let s = h.pool_status("sf").await;
    assert_eq!(
        cond(&s, condition::SCALING_LIMITED),
        ("True".to_string(), reason::VM_START_FAILING.to_string())
    );

    // The image is fixed: the next VM's runner starts, which resets the backoff.
    h.start_agent(false, Duration::ZERO);
    h.wait("an idle runner and no start backoff", WAIT, || async {
        let s = h.pool_status("sf").await;
        (s.idle == 1 && cond(&s, condition::SCALING_LIMITED).1 != reason::VM_START_FAILING)
            .then_some(())
    })
    .await;
}

/// Runs one job on a pool (minIdle 0: the finished runner is surplus at once) whose fake runners take
/// `exit_delay` after the job to exit; returns the VM's name and when the job completed.
async fn one_job_with_a_slow_exit(
    h: &mut PoolHarness,
    pool: &str,
    exit_delay: Duration,
) -> (String, std::time::Instant) {
    *h.runner_exit_delay.lock().unwrap() = exit_delay;
    h.start_agent(true, Duration::from_millis(500));
    h.create_pool(pool, json!({"maxRunners": 2})).await;
    let job = h.sim.queue_job(job());
    let vm = h.wait_minted(pool, 1, WAIT).await.remove(0).name_any();
    h.sim
        .wait_job(job.id, WAIT, |j| j.status == JobStatus::Completed)
        .await
        .unwrap();
    (vm, std::time::Instant::now())
}

async fn vm_alive(h: &PoolHarness, name: &str) -> bool {
    h.vms()
        .get_opt(name)
        .await
        .unwrap()
        .is_some_and(|v| v.metadata.deletion_timestamp.is_none())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_runner_keeps_its_vm_until_its_exit_is_recorded() {
    // GitHub drops the ephemeral runner as its job completes, but the runner goes on reporting for
    // 4 s before it exits: the VM stays until the agent recorded the exit, then goes at once.
    let mut h = PoolHarness::start("pool-exit").await;
    let (vm, completed) = one_job_with_a_slow_exit(&mut h, "exit", Duration::from_secs(4)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        vm_alive(&h, &vm).await,
        "the VM was deleted while its runner was still exiting"
    );
    let s = h.pool_status("exit").await;
    assert_eq!((s.idle, s.desired), (0, 1), "counted busy, not idle: {s:?}");
    h.wait("the finished VM to go", WAIT, || async {
        (!vm_alive(&h, &vm).await).then_some(())
    })
    .await;
    let after = completed.elapsed();
    assert!(
        after < Duration::from_secs(10),
        "deleted {after:?} after the job: on the recorded exit, not at the end of the 60 s grace"
    );
    // The VM was cleaned up with its exit on record: its job phase (Started -> exited) is observed
    // once the pass that deleted it sees the delete answered, which may be just after the test sees
    // the VM go (a CI run under load caught the metric read in between).
    let job_phases = || h.metric("imp_runner_vm_phase_seconds_count{phase=\"job\"}");
    let observed = tokio::time::timeout(Duration::from_secs(5), async {
        while job_phases() < 1.0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        observed.is_ok() && job_phases() == 1.0,
        "{}",
        h.metrics_text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_runner_that_never_exits_is_deleted_after_the_grace() {
    let timing = imp_operator::runnerpool::PoolTiming {
        runner_exit_grace: Duration::from_secs(3),
        ..fast_timing()
    };
    let mut h = PoolHarness::start_with("pool-noexit", timing).await;
    let (vm, completed) =
        one_job_with_a_slow_exit(&mut h, "noexit", Duration::from_secs(3600)).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(vm_alive(&h, &vm).await, "deleted within the exit grace");
    h.wait("the VM deleted after the grace", WAIT, || async {
        (!vm_alive(&h, &vm).await).then_some(())
    })
    .await;
    let after = completed.elapsed();
    assert!(
        after >= Duration::from_millis(2500) && after < Duration::from_secs(10),
        "deleted {after:?} after the job, grace 3 s"
    );
    // No exit was recorded: no job phase; the pool is back at zero.
    assert_eq!(
        h.metric("imp_runner_vm_phase_seconds_count{phase=\"job\"}"),
        0.0
    );
    h.wait("status back at zero", WAIT, || async {
        let s = h.pool_status("noexit").await;
        (s.total == 0 && s.busy == 0).then_some(())
    })
    .await;
}
