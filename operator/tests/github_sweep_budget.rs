//! The queued-job sweep's API budget against the simulator: 1,000 repositories, ETag revalidation,
//! the adaptive interval and the reserve left to minting. Numbers are printed for docs/github.md.

mod github_common;

use std::collections::HashSet;
use std::time::Duration;

use github_common::*;
use imp_testkit::github::{GithubSim, JobSpec};

const MIN_INTERVAL: Duration = Duration::from_secs(60);

fn repos(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("octo-org/repo-{i:04}")).collect()
}

/// One run per repository in `active`: its first job in progress on a runner outside Imp, two
/// queued. Returns the ids of the in-progress jobs.
fn matrix_runs(sim: &GithubSim, active: &[String]) -> Vec<u64> {
    active
        .iter()
        .map(|repo| {
            let spec = |run_id| JobSpec {
                labels: vec!["self-hosted".into(), "imp".into()],
                repository: Some(repo.clone()),
                run_id,
                ..Default::default()
            };
            let first = sim.queue_job(spec(None));
            sim.queue_job(spec(Some(first.run_id)));
            sim.queue_job(spec(Some(first.run_id)));
            sim.start_job(first.id, "hosted-1").unwrap();
            first.id
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_repositories_stay_within_the_sweep_budget() {
    let all = repos(1000);
    let sim = sim_with(|c| c.repos = all.clone()).await;
    let app = app(&sim);
    let started = matrix_runs(&sim, &all[..10]);
    let orgs = HashSet::from(["octo-org".to_string()]);
    let none = HashSet::new();

    // Cold: every listing is a first fetch. 10 repository pages + 2 run listings per repository +
    // one job listing per active run.
    let t = std::time::Instant::now();
    let cold = app.sweep_jobs(&orgs, &none).await.unwrap();
    let cold_time = t.elapsed();
    assert_eq!(cold.repositories.len(), 1000);
    assert!(cold.failed.is_empty() && cold.deferred.is_empty());
    let queued = cold
        .jobs
        .iter()
        .filter(|(_, j)| j.status == "queued")
        .count();
    assert_eq!(
        (cold.jobs.len(), queued),
        (30, 20),
        "queued jobs of in-progress runs"
    );
    assert_eq!(cold.calls.charged, 2020);
    assert_eq!(cold.calls.first, 2020);
    let cold_next = app.record_sweep(cold.calls, MIN_INTERVAL);

    // Warm and unchanged: everything revalidates with 304, nothing is charged.
    let charged_before = sim.stats().charged_requests;
    let t = std::time::Instant::now();
    let warm = app.sweep_jobs(&orgs, &none).await.unwrap();
    let warm_time = t.elapsed();
    assert_eq!(warm.calls.charged, 0);
    assert_eq!(warm.calls.revalidated, 2020);
    assert_eq!(warm.jobs.len(), 30, "a 304 serves the remembered listing");
    assert_eq!(sim.stats().charged_requests, charged_before);
    assert!(sim.stats().not_modified >= 2020);
    let idle_next = app.record_sweep(warm.calls, MIN_INTERVAL);
    // 2,020 requests at 600 per minute.
    assert_eq!(idle_next, Duration::from_secs(202));

    // Activity: a job completes in each of 5 repositories. Their runs stay in progress (same
    // run listing); each changed job listing costs one charged call.
    for id in &started[..5] {
        sim.complete_job(*id, "success").unwrap();
    }
    let busy = app.sweep_jobs(&orgs, &none).await.unwrap();
    assert_eq!(busy.calls.charged, 5);
    assert_eq!(busy.calls.revalidated, 2015);
    let busy_next = app.record_sweep(busy.calls, MIN_INTERVAL);

    let per_hour = |charged: u64, next: Duration| charged as f64 * 3600.0 / next.as_secs_f64();
    let budget = app.sweep_budget_per_hour();
    assert_eq!(budget, 2500.0);
    let idle_hour = per_hour(warm.calls.charged, idle_next);
    let busy_hour = per_hour(busy.calls.charged, busy_next);
    eprintln!(
        "1000 repositories: cold sweep {} charged ({:?}), next in {:?}; idle sweep {} charged + {} \
         revalidated ({:?}), next in {:?} = {:.0} charged/hour; 5 changes: {} charged, next in {:?} = \
         {:.0} charged/hour; budget {budget:.0}/hour; remaining {}",
        cold.calls.charged,
        cold_time,
        cold_next,
        warm.calls.charged,
        warm.calls.revalidated,
        warm_time,
        idle_next,
        idle_hour,
        busy.calls.charged,
        busy_next,
        busy_hour,
        sim.installation_rate_remaining(),
    );
    assert!(busy_hour <= budget && idle_hour <= budget);
    assert!(3600.0 / busy_next.as_secs_f64() * busy.calls.total() as f64 <= 600.0 * 60.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_stops_at_the_reserve_left_to_minting() {
    let all = repos(1000);
    // 3,000 per hour: the sweep may take half, so it stops with 1,500 left.
    let sim = sim_with(|c| {
        c.repos = all.clone();
        c.rate_limit = 3000;
    })
    .await;
    let app = app(&sim);
    let orgs = HashSet::from(["octo-org".to_string()]);
    let cold = app.sweep_jobs(&orgs, &HashSet::new()).await.unwrap();
    assert!(!cold.deferred.is_empty(), "the cold sweep cannot fit");
    assert_eq!(cold.repositories.len() + cold.deferred.len(), 1000);
    let remaining = sim.installation_rate_remaining();
    assert!(
        (1_497..=1_500).contains(&remaining),
        "stopped at the reserve: {remaining} left"
    );
    // While at the reserve the next sweep waits for the window's reset.
    let next = app.record_sweep(cold.calls, MIN_INTERVAL);
    assert!(next > Duration::from_secs(3000), "{next:?}");
    // Minting still has its share.
    let minted = app
        .generate_jit_config(&jit(org(&sim), "after-sweep"))
        .await;
    assert!(minted.is_ok());
    eprintln!(
        "rate limit 3000: cold sweep listed {} repositories, deferred {}, {remaining} left; next in {next:?}",
        cold.repositories.len(),
        cold.deferred.len()
    );
}

/// Issue 30: a repository with more active runs than the sweep reads (50 pages of 100) used to be
/// recorded as fully listed from its first 5,000 runs; now its listing fails with
/// `TooManyPages` (counted under `too_many_pages`), so its jobs are left as they are, and the other
/// repositories are swept as before.
#[tokio::test(flavor = "multi_thread")]
async fn a_repository_with_more_runs_than_the_sweep_reads_is_not_taken_as_fully_listed() {
    let all = repos(2);
    let sim = sim_with(|c| c.repos = all.clone()).await;
    let app = app(&sim);
    for _ in 0..5_001 {
        sim.queue_job(JobSpec {
            labels: vec!["self-hosted".into(), "imp".into()],
            repository: Some(all[0].clone()),
            ..Default::default()
        });
    }
    let small = sim.queue_job(JobSpec {
        labels: vec!["self-hosted".into(), "imp".into()],
        repository: Some(all[1].clone()),
        ..Default::default()
    });
    let swept = app
        .sweep_jobs(&HashSet::new(), &all.iter().cloned().collect())
        .await
        .unwrap();
    assert_eq!(swept.repositories, [all[1].clone()]);
    assert!(swept.jobs.iter().all(|(repo, _)| *repo == all[1]));
    assert!(swept.jobs.iter().any(|(_, j)| j.id == small.id));
    let [(repo, error)] = &swept.failed[..] else {
        panic!("{:?}", swept.failed)
    };
    assert_eq!(repo, &all[0]);
    assert_eq!(error.metric_label(), "too_many_pages", "{error}");
    assert!(error.to_string().contains("more than 50 pages"), "{error}");
}
