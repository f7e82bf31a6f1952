//! The per-job SLO against the simulator and the real API server: a job served by the pool ends up on
//! its VM's status (job id, run id, repository, every step's time) and in the phase histograms.

mod pool_common;

use std::time::Duration;

use imp_api::names::ANNOTATION_RUNNER_NAME;
use imp_operator::runnerpool::slo::{CLONE_PHASES, STEP_PHASES};
use imp_testkit::github::JobStatus;
use kube::ResourceExt;
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// Once the one job wait is observed: each of `phases` observed once, their seconds adding up to
/// the wait's; the wait's seconds.
async fn wait_of_phases<'a>(h: &PoolHarness, phases: impl Iterator<Item = &'a &'a str>) -> f64 {
    h.wait("the wait histogram", WAIT, || async {
        (h.metric("imp_runner_job_wait_seconds_count") == 1.0).then_some(())
    })
    .await;
    let mut sum = 0.0;
    for phase in phases {
        let sample = format!("imp_runner_job_phase_seconds_count{{phase=\"{phase}\"}}");
        assert_eq!(h.metric(&sample), 1.0, "{sample}:\n{}", h.metrics_text());
        sum += h.metric(&format!(
            "imp_runner_job_phase_seconds_sum{{phase=\"{phase}\"}}"
        ));
    }
    let wait = h.metric("imp_runner_job_wait_seconds_sum");
    assert!(
        (sum - wait).abs() < 1e-3,
        "phases add up to the wait: {sum} vs {wait}"
    );
    wait
}

#[tokio::test(flavor = "multi_thread")]
async fn a_served_job_is_on_its_vm_status_and_in_the_phase_histograms() {
    let mut h = PoolHarness::start("pool-slo").await;
    h.create_pool("slo", json!({"maxRunners": 2})).await;
    h.wait("pool status", WAIT, || async {
        (h.pool_status("slo").await.observed_generation == Some(1)).then_some(())
    })
    .await;
    h.start_agent(true, Duration::from_secs(4));
    let queued = std::time::Instant::now();
    let job = h.sim.queue_job(job());

    let (vm, runner, rec) = h
        .wait("the served job on its VM's status", WAIT, || async {
            h.runner_vms("slo").await.into_iter().find_map(|vm| {
                let rec = vm.status.as_ref()?.job.clone()?;
                (rec.job_id == Some(job.id as i64)).then(|| {
                    let runner = vm.annotations().get(ANNOTATION_RUNNER_NAME).cloned();
                    (vm.name_any(), runner, rec)
                })
            })
        })
        .await;
    let served = h.sim.job(job.id).expect("the simulator knows the job");
    assert_eq!(
        served.runner_name, runner,
        "the VM recorded is the one whose runner took the job"
    );
    assert_eq!(rec.run_id, Some(served.run_id as i64));
    assert_eq!(rec.repository.as_deref(), Some(served.repository.as_str()));
    let at = |what: &str, t: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime>| {
        t.as_ref()
            .unwrap_or_else(|| panic!("{what} missing from {rec:?}"))
            .0
    };
    let q = at("queuedTime", &rec.queued_time);
    let created = at("vmCreatedTime", &rec.vm_created_time);
    let minted = at("mintedTime", &rec.minted_time);
    at("scheduledTime", &rec.scheduled_time);
    at("bootedTime", &rec.booted_time);
    let started = at("runnerStartedTime", &rec.runner_started_time);
    let picked = at("pickedUpTime", &rec.picked_up_time);
    // The pool was empty: this VM was created for the job, minted after, and picked it up last (the
    // agent's times are to the second).
    assert!(q <= created && created <= minted, "{rec:?}");
    assert!(started <= picked && minted <= picked, "{rec:?}");
    eprintln!("VM {vm} served job {}: {rec:?}", job.id);

    // Every step up to the pickup observed once, adding up to the wait.
    let wait = wait_of_phases(&h, STEP_PHASES.iter()).await;
    assert!(
        wait > 0.0 && wait <= queued.elapsed().as_secs_f64() + 1.0,
        "wait {wait} s within the test's own clock"
    );

    // The job completes: its run is observed, and the record says when.
    h.wait("the job completed", WAIT, || async {
        h.sim
            .job(job.id)
            .is_some_and(|j| j.status == JobStatus::Completed)
            .then_some(())
    })
    .await;
    h.wait("the run phase", WAIT, || async {
        (h.metric("imp_runner_job_phase_seconds_count{phase=\"run\"}") == 1.0).then_some(())
    })
    .await;
    let run = h.metric("imp_runner_job_phase_seconds_sum{phase=\"run\"}");
    assert!((3.0..30.0).contains(&run), "the 4 s job ran {run} s");
    // No other job was served, so nothing else was observed.
    assert_eq!(h.metric("imp_runner_job_wait_seconds_count"), 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_standby_pool_s_clone_adds_restore_and_reidentify_to_its_job_s_phases() {
    let mut h = PoolHarness::start("pool-slo-standby").await;
    h.create_pool("slo", json!({"maxRunners": 2, "standby": true}))
        .await;
    h.wait("pool status", WAIT, || async {
        (h.pool_status("slo").await.observed_generation == Some(1)).then_some(())
    })
    .await;
    // The harness's agent starts a standby VM as a clone (restore 30 ms, reidentify 5 ms).
    h.start_agent(true, Duration::from_secs(1));
    let job = h.sim.queue_job(job());
    h.wait("the served job on its VM's status", WAIT, || async {
        h.runner_vms("slo").await.into_iter().find_map(|vm| {
            let rec = vm.status.as_ref()?.job.clone()?;
            (rec.job_id == Some(job.id as i64)).then_some(())
        })
    })
    .await;
    // Every phase up to the pickup observed once, the clone's two among them, adding up to the wait.
    wait_of_phases(&h, STEP_PHASES.iter().chain(&CLONE_PHASES)).await;
    for phase in CLONE_PHASES {
        let d = h.metric(&format!(
            "imp_runner_job_phase_seconds_sum{{phase=\"{phase}\"}}"
        ));
        assert!(
            (0.0..=0.03).contains(&d),
            "{phase} {d} s: at most what the node reported"
        );
    }
    // The start counted once, as a clone.
    h.wait("the start counted", WAIT, || async {
        (h.metric("imp_runner_vm_starts_total{from=\"clone\",fallback=\"none\"}") >= 1.0)
            .then_some(())
    })
    .await;
    assert_eq!(
        h.metric("imp_runner_vm_starts_total{from=\"boot\",fallback=\"none\"}"),
        0.0
    );
}
