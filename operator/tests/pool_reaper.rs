//! The registration reaper and the runner deadlines on the real API server with the GitHub simulator:
//! registrations left by a failed mint, by a VM deleted by hand and by a deleted pool are removed within
//! one reaper period; a busy registration is never deregistered; a runner that never comes online and a
//! VM that never boots are replaced, their registrations deleted, and the queued job served.

mod pool_common;

use std::time::{Duration, Instant};

use imp_api::{
    VmPhase,
    names::{ANNOTATION_RUNNER_ID, ANNOTATION_RUNNER_NAME, reason},
};
use imp_common::ExposeSecret;
use imp_operator::github::{AppCredentials, GithubApp, JitRequest, RunnerScope, runner_name};
use imp_operator::runnerpool::PoolTiming;
use imp_testkit::{
    fixtures,
    github::{
        Fault, FaultRule, JobStatus, KeyFormat,
        runner_protocol::{FakeRunnerOptions, run_fake_runner},
    },
};
use kube::{
    ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(40);
/// Slack on "within one reaper period": the pass that lists, then the deletes, on a loaded machine.
const PASS_SLACK: Duration = Duration::from_secs(4);

fn timing(reap: Duration) -> PoolTiming {
    PoolTiming {
        reap_interval: reap,
        ..fast_timing()
    }
}

/// A GitHub client with the simulator's App, as a user's script (or another operator) would hold.
fn test_app(h: &PoolHarness) -> GithubApp {
    let creds = AppCredentials::from_string_data(&h.sim.secret_data(KeyFormat::Pkcs1)).unwrap();
    GithubApp::new(creds, github_config(&h.sim)).unwrap()
}

/// Registers a runner named as `pool` names its runners, for a VM that does not exist; returns its id
/// and its JIT config.
async fn stray_registration(h: &PoolHarness, pool: &str, uid: &str) -> (u64, String) {
    let minted = test_app(h)
        .generate_jit_config(&JitRequest {
            scope: RunnerScope::org(h.sim.org()),
            runner_name: runner_name(pool, uid),
            labels: labels(),
            runner_group: None,
            work_folder: "_work".into(),
        })
        .await
        .unwrap();
    (
        minted.runner_id,
        minted.encoded_jit_config.expose_secret().to_owned(),
    )
}

fn registered(h: &PoolHarness, id: u64) -> bool {
    h.sim.runners().iter().any(|r| r.id == id)
}

/// Waits until the simulator no longer has runner `id`; returns how long that took.
async fn wait_deregistered(h: &PoolHarness, id: u64, within: Duration) -> Duration {
    let start = Instant::now();
    h.wait(&format!("runner {id} deregistered"), within, || async {
        (!registered(h, id)).then_some(())
    })
    .await;
    start.elapsed()
}

async fn delete_pool_and_wait(h: &PoolHarness, pool: &str) {
    h.pools()
        .delete(pool, &DeleteParams::default())
        .await
        .unwrap();
    h.wait(&format!("pool {pool} gone"), WAIT, || async {
        h.pools()
            .get_opt(pool)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
}

fn runner_id(vm: &imp_api::ImpVM) -> u64 {
    vm.annotations()[ANNOTATION_RUNNER_ID].parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn registrations_left_by_a_failed_mint_or_a_hand_deleted_vm_are_reaped() {
    let reap = Duration::from_secs(3);
    let h = PoolHarness::start_with("pool-reap", timing(reap)).await;
    // The first mint registers the runner and every answer comes too late for the client (timeout 5 s,
    // 3 attempts; the retries find the name taken, and their answers are late too): the mint fails,
    // its VM is deleted, and the registration has no VM.
    h.sim.inject(
        FaultRule::next(3, Fault::DelayAnswer { millis: 6_000 }).on_path("generate-jitconfig"),
    );
    h.create_pool("reap", json!({"minIdle": 1, "maxRunners": 2}))
        .await;
    let lost = h
        .wait("the first attempt's registration", WAIT, || async {
            h.sim.runners().first().map(|r| r.id)
        })
        .await;
    h.wait(reason::MINT_FAILED, WAIT, || async {
        h.events("reap")
            .await
            .iter()
            .any(|(r, _)| r == reason::MINT_FAILED)
            .then_some(())
    })
    .await;
    let took = wait_deregistered(&h, lost, reap + PASS_SLACK).await;
    println!("failed mint's registration reaped {took:?} after the MintFailed Event was seen");
    let vms = h.wait_minted("reap", 1, WAIT).await;
    let held = runner_id(&vms[0]);
    assert_ne!(held, lost);
    assert!(registered(&h, held), "the VM's own registration stays");

    // A VM deleted by hand (no finalizer without the VM controller): its registration is orphaned.
    h.vms()
        .delete(&vms[0].name_any(), &DeleteParams::default())
        .await
        .unwrap();
    let deleted = Instant::now();
    wait_deregistered(&h, held, reap + PASS_SLACK).await;
    println!(
        "hand-deleted VM's registration reaped after {:?}",
        deleted.elapsed()
    );
    // The pool replaced the VM; its registration is the only one left.
    let vms = h.wait_minted("reap", 1, WAIT).await;
    let ids: Vec<u64> = h.sim.runners().iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![runner_id(&vms[0])]);
    assert!(h.metric("imp_runner_orphans_reaped_total") >= 2.0);
    assert!(
        h.events("reap")
            .await
            .iter()
            .any(|(r, n)| r == reason::ORPHAN_RUNNERS_DELETED && n.contains("reap-"))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_busy_registration_without_a_vm_is_never_deregistered() {
    let reap = Duration::from_secs(1);
    let h = PoolHarness::start_with("pool-reapbusy", timing(reap)).await;
    h.create_pool("rb", json!({"maxRunners": 1})).await;
    // A registration of the pool's name pattern with no VM, whose runner takes a job and holds it.
    let (id, config) = stray_registration(&h, "rb", "0123456789ab").await;
    let runner = tokio::spawn(async move {
        let opts = FakeRunnerOptions {
            job_wait: Duration::from_secs(60),
            job_duration: Duration::from_secs(6),
            ..FakeRunnerOptions::default()
        };
        run_fake_runner(&config, &opts).await
    });
    let job = h.sim.queue_job(job());
    h.wait("the stray runner busy", WAIT, || async {
        h.sim
            .runners()
            .iter()
            .any(|r| r.id == id && r.busy)
            .then_some(())
    })
    .await;
    // Several reaper periods while it runs: it stays registered.
    let busy_since = Instant::now();
    while busy_since.elapsed() < 4 * reap {
        let r = h.sim.runners().into_iter().find(|r| r.id == id);
        match r {
            Some(r) if r.busy => {}
            Some(_) => break, // the job finished
            None => panic!("a busy runner was deregistered"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let done = runner.await.unwrap().unwrap();
    assert_eq!(done.id, job.id);
    let j = h
        .sim
        .wait_job(job.id, WAIT, |j| j.status == JobStatus::Completed)
        .await
        .unwrap();
    assert_eq!(j.status, JobStatus::Completed);
    assert_eq!(
        h.metric("imp_runner_deregistrations_total{result=\"busy\"}"),
        0.0,
        "the reaper does not even ask GitHub to delete a busy runner"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_a_pool_removes_its_registrations_before_the_finalizer_goes() {
    // A long reaper period: only the deletion can remove the stray registration.
    let h = PoolHarness::start_with("pool-reapdel", timing(Duration::from_secs(600))).await;
    h.create_pool("gone", json!({"minIdle": 2, "maxRunners": 2}))
        .await;
    let vms = h.wait_minted("gone", 2, WAIT).await;
    let (stray, _) = stray_registration(&h, "gone", "0123456789ab").await;
    // Another pool's registration in the same organization is not touched.
    let (other, _) = stray_registration(&h, "other", "0123456789ab").await;
    delete_pool_and_wait(&h, "gone").await;
    for id in vms.iter().map(runner_id).chain([stray]) {
        assert!(!registered(&h, id), "runner {id} left at GitHub");
    }
    assert!(registered(&h, other));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pool_deleted_after_its_app_secret_says_what_stays_at_github() {
    let h = PoolHarness::start("pool-nosecret").await;
    h.create_secret("app-2", h.sim.secret_data(KeyFormat::Pkcs1))
        .await;
    let pool = fixtures::pool("orphaned")
        .org(h.sim.org())
        .app_secret("app-2")
        .labels(&LABELS)
        .class("runner")
        .image("ghcr.io/imp/runner:1")
        .scaling(serde_json::from_value(json!({"minIdle": 1, "maxRunners": 1})).unwrap())
        .build();
    h.pools()
        .create(&PostParams::default(), &pool)
        .await
        .unwrap();
    let vms = h.wait_minted("orphaned", 1, WAIT).await;
    let name = vms[0].annotations()[ANNOTATION_RUNNER_NAME].clone();
    h.secrets()
        .delete("app-2", &DeleteParams::default())
        .await
        .unwrap();
    let started = Instant::now();
    delete_pool_and_wait(&h, "orphaned").await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "no wait for a deletion timeout that cannot help"
    );
    let events = h.events("orphaned").await;
    assert!(
        events
            .iter()
            .any(|(r, n)| r == reason::REGISTRATIONS_ABANDONED && n.contains(&name)),
        "{events:?}"
    );
    assert!(h.runner_vms("orphaned").await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runner_that_never_comes_online_is_replaced_and_the_job_served() {
    let t = PoolTiming {
        runner_online_deadline: Duration::from_secs(3),
        ..timing(Duration::from_secs(600))
    };
    let mut h = PoolHarness::start_with("pool-online", t).await;
    h.create_pool("ol", json!({"maxRunners": 1})).await;
    let job = h.sim.queue_job(job());
    let vms = h.wait_minted("ol", 1, WAIT).await;
    let zombie = vms[0].clone();
    // The agent reports Started, but the runner never connects to GitHub.
    h.agent_started(&zombie).await;
    h.secrets()
        .delete(
            zombie.spec.runner_config_secret.as_deref().unwrap(),
            &DeleteParams::default(),
        )
        .await
        .unwrap();
    // From here on, agents run real (fake) runners; the zombie's Secret is gone so it stays a zombie.
    h.start_agent(true, Duration::from_millis(500));
    let j = h
        .sim
        .wait_job(job.id, Duration::from_secs(60), |j| {
            j.status == JobStatus::Completed
        })
        .await
        .unwrap();
    assert_eq!(j.status, JobStatus::Completed, "the queued job was served");
    assert_ne!(j.runner_id, Some(runner_id(&zombie)));
    assert!(
        !registered(&h, runner_id(&zombie)),
        "the zombie's registration is deleted"
    );
    assert!(
        h.vms().get_opt(&zombie.name_any()).await.unwrap().is_none(),
        "the zombie VM is deleted"
    );
    assert!(
        h.events("ol")
            .await
            .iter()
            .any(|(r, n)| r == reason::RUNNER_NEVER_ONLINE && n.contains(&zombie.name_any()))
    );
    assert_eq!(
        h.metric("imp_runner_deadline_replacements_total{reason=\"RunnerNeverOnline\"}"),
        1.0
    );
    // The VM that served the job is cleaned up and its job phase observed.
    h.wait("the job phase observed", WAIT, || async {
        (h.metric("imp_runner_vm_phase_seconds_count{phase=\"job\"}") == 1.0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_vm_that_never_boots_is_replaced_after_its_boot_deadline() {
    let t = PoolTiming {
        boot_deadline: Duration::from_secs(2),
        ..timing(Duration::from_secs(600))
    };
    let h = PoolHarness::start_with("pool-boot", t).await;
    h.create_pool("bd", json!({"minIdle": 1, "maxRunners": 1}))
        .await;
    let vms = h.wait_minted("bd", 1, WAIT).await;
    let stuck = vms[0].clone();
    // Scheduled (as the operator writes it), then the node never gets it Running.
    let patch = json!({"status": {"phase": VmPhase::Scheduled,
        "scheduledTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now())}});
    h.vms()
        .patch_status(
            &stuck.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap();
    let replaced = h
        .wait("a replacement VM", WAIT, || async {
            let v = h.runner_vms("bd").await;
            (v.len() == 1
                && v[0].name_any() != stuck.name_any()
                && v[0].spec.runner_config_secret.is_some())
            .then_some(v)
        })
        .await;
    assert!(!registered(&h, runner_id(&stuck)));
    assert!(registered(&h, runner_id(&replaced[0])));
    assert!(
        h.events("bd")
            .await
            .iter()
            .any(|(r, n)| r == reason::BOOT_DEADLINE_EXCEEDED && n.contains(&stuck.name_any()))
    );
    assert_eq!(
        h.metric("imp_runner_deadline_replacements_total{reason=\"BootDeadlineExceeded\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn pools_of_one_scope_share_the_reapers_listing() {
    let reap = Duration::from_secs(2);
    let h = PoolHarness::start_with("pool-reapshare", timing(reap)).await;
    let pools = ["s1", "s2", "s3", "s4"];
    for p in pools {
        h.create_pool(p, json!({"maxRunners": 1})).await;
    }
    // A listing is a 200 or, revalidated by its ETag, a 304.
    let listings = || {
        h.metric("imp_github_requests_total{operation=\"list_runners\",status=\"2xx\"}")
            + h.metric("imp_github_requests_total{operation=\"list_runners\",status=\"3xx\"}")
    };
    h.wait("a first listing", WAIT, || async {
        (listings() >= 1.0).then_some(())
    })
    .await;
    let (start, before) = (Instant::now(), listings());
    tokio::time::sleep(4 * reap).await;
    let intervals = start.elapsed().as_secs_f64() / reap.as_secs_f64();
    let calls = listings() - before;
    // Each pool reaps every interval; a listing is reused for half an interval, so shared that is at
    // most two listings per interval (and one more for an interval begun), not one per pool.
    println!(
        "{calls} listings in {intervals:.1} reaper intervals for {} pools",
        pools.len()
    );
    assert!(calls >= 2.0, "the reaper ran: {calls} listings");
    assert!(
        calls <= 2.0 * intervals.ceil() + 1.0,
        "{calls} listings in {intervals:.1} intervals for {} pools",
        pools.len()
    );
}
