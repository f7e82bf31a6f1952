//! Demand that matches GitHub, against the simulator and the real API server: the queued jobs of a
//! run GitHub already reports in progress stay demand, and are served; a job naming GitHub's default
//! runner labels is served by a pool that lists only its own.

mod pool_common;

use std::time::Duration;

use imp_operator::runnerpool::PoolKey;
use imp_testkit::github::{JobSpec, JobStatus, WebhookFault};
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn queued_jobs_of_an_in_progress_run_are_demand_and_served() {
    let timing = imp_operator::runnerpool::PoolTiming {
        sweep_interval: Duration::from_secs(1),
        ..fast_timing()
    };
    let mut h = PoolHarness::start_with("pool-demand", timing).await;
    h.create_pool("matrix", json!({"maxRunners": 1})).await;
    h.wait("pool status", WAIT, || async {
        (h.pool_status("matrix").await.observed_generation == Some(1)).then_some(())
    })
    .await;
    // Every webhook is lost: only the sweep can know of these jobs.
    h.sim.inject_webhook_fault(WebhookFault::Drop, 1000);
    let spec = |run_id| JobSpec { run_id, ..job() };
    let first = h.sim.queue_job(spec(None));
    let a = h.sim.queue_job(spec(Some(first.run_id)));
    let b = h.sim.queue_job(spec(Some(first.run_id)));
    // A runner outside the pool takes the first job: GitHub reports the run in progress.
    h.sim.start_job(first.id, "hosted-runner-1").unwrap();
    let key = PoolKey::new(h.ns.clone(), "matrix");
    h.wait("the sweep to find both queued jobs", WAIT, || async {
        (h.shared.demand().pool_demand(&key).queued == 2).then_some(())
    })
    .await;
    // Several more sweeps: the queued jobs are not dropped.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(h.shared.demand().pool_demand(&key).queued, 2);
    let vms = h.wait_minted("matrix", 1, WAIT).await;
    assert_eq!(vms.len(), 1, "maxRunners 1");
    assert_eq!(h.pool_status("matrix").await.desired, 1);
    // Unchanged listings were revalidated, not charged.
    h.wait("ETag revalidation", WAIT, || async {
        (h.metric("imp_github_not_modified_total{operation=\"list_workflow_runs\"}") > 0.0)
            .then_some(())
    })
    .await;

    // Runners take the jobs one after the other (maxRunners 1), their webhooks lost too.
    h.start_agent(true, Duration::from_millis(300));
    let max_vms = std::sync::atomic::AtomicUsize::new(0);
    h.wait(
        "both queued jobs served",
        Duration::from_secs(120),
        || async {
            let n = h.runner_vms("matrix").await.len();
            max_vms.fetch_max(n, std::sync::atomic::Ordering::Relaxed);
            let done = [a.id, b.id].iter().all(|id| {
                h.sim
                    .job(*id)
                    .is_some_and(|j| j.status == JobStatus::Completed)
            });
            done.then_some(())
        },
    )
    .await;
    let max_vms = max_vms.into_inner();
    assert!(max_vms <= 1, "never beyond maxRunners: saw {max_vms}");
    h.wait("demand drained", WAIT, || async {
        (h.shared.demand().pool_demand(&key).queued == 0).then_some(())
    })
    .await;
    eprintln!(
        "sweep: {} charged / {} revalidated on the last pass",
        h.metric(&format!(
            "imp_github_sweep_calls{{app_id=\"{}\",kind=\"charged\"}}",
            h.sim.app_id()
        )),
        h.metric(&format!(
            "imp_github_sweep_calls{{app_id=\"{}\",kind=\"revalidated\"}}",
            h.sim.app_id()
        )),
    );
}

/// `runs-on: [self-hosted, linux, x64, imp]` is served by a pool labelled `[imp]`: GitHub gives its
/// runners the defaults. A job asking for `arm64` is unrouted and never gets a runner.
#[tokio::test(flavor = "multi_thread")]
async fn default_runner_labels_route_to_a_pool_without_them() {
    let mut h = PoolHarness::start("pool-default-labels").await;
    h.create_pool_labelled("plain", &["imp"], json!({"maxRunners": 2}))
        .await;
    h.wait("pool status", WAIT, || async {
        (h.pool_status("plain").await.observed_generation == Some(1)).then_some(())
    })
    .await;
    let labels = |l: &[&str]| JobSpec {
        labels: l.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let arm = h
        .sim
        .queue_job(labels(&["self-hosted", "Linux", "ARM64", "imp"]));
    h.wait(
        "the arm64 job's webhook answered unrouted",
        WAIT,
        || async {
            (h.metric("imp_webhook_deliveries_total{result=\"unrouted\"}") >= 1.0).then_some(())
        },
    )
    .await;
    let x64 = h
        .sim
        .queue_job(labels(&["self-hosted", "linux", "x64", "imp"]));
    let key = PoolKey::new(h.ns.clone(), "plain");
    h.wait("the x64 job routed to the pool", WAIT, || async {
        (h.shared.demand().pool_demand(&key).queued == 1).then_some(())
    })
    .await;
    h.start_agent(true, Duration::from_millis(100));
    h.wait(
        "the x64 job served by a runner of the pool",
        WAIT,
        || async {
            h.sim
                .job(x64.id)
                .is_some_and(|j| j.status == JobStatus::Completed)
                .then_some(())
        },
    )
    .await;
    let arm = h.sim.job(arm.id).unwrap();
    assert_eq!(arm.status, JobStatus::Queued, "no Imp runner takes arm64");
    assert_eq!(h.shared.demand().pool_demand(&key).queued, 0);
}

/// Issue 30: a repository with more active runs than the sweep reads (50 pages of 100) is shown
/// on the pool: DemandListed False with SweepPageCap naming it, its jobs known from webhooks only.
/// Once its runs are done the next sweep lists it in full again.
#[tokio::test(flavor = "multi_thread")]
async fn a_repository_beyond_the_sweep_s_page_cap_is_a_pool_condition() {
    use imp_api::names::{condition, reason};
    let timing = imp_operator::runnerpool::PoolTiming {
        sweep_interval: Duration::from_secs(1),
        ..fast_timing()
    };
    let h = PoolHarness::start_with("pool-pagecap", timing).await;
    h.create_pool("capped", json!({"maxRunners": 1})).await;
    let demand_listed = || async {
        h.pool_status("capped")
            .await
            .conditions
            .into_iter()
            .find(|c| c.type_ == condition::DEMAND_LISTED)
    };
    h.wait("DemandListed SweepComplete", WAIT, || async {
        demand_listed()
            .await
            .filter(|c| c.status == "True" && c.reason == reason::SWEEP_COMPLETE)
    })
    .await;
    // Jobs for labels no pool serves (no runner is wanted), their webhooks lost.
    h.sim.inject_webhook_fault(WebhookFault::Drop, 20_000);
    let others = JobSpec {
        labels: vec!["self-hosted".into(), "gpu".into()],
        ..job()
    };
    let jobs: Vec<u64> = (0..5_001)
        .map(|_| h.sim.queue_job(others.clone()).id)
        .collect();
    let repository = h.sim.job(jobs[0]).expect("job").repository;
    let capped = h
        .wait("DemandListed SweepPageCap", WAIT, || async {
            demand_listed()
                .await
                .filter(|c| c.status == "False" && c.reason == reason::SWEEP_PAGE_CAP)
        })
        .await;
    assert!(
        capped
            .message
            .starts_with(&format!("{repository}: more active runs")),
        "{}",
        capped.message
    );
    for id in jobs {
        h.sim.complete_job(id, "cancelled");
    }
    h.wait("DemandListed SweepComplete again", WAIT, || async {
        demand_listed()
            .await
            .filter(|c| c.status == "True" && c.reason == reason::SWEEP_COMPLETE)
    })
    .await;
}
