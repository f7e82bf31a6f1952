//! Runner freshness against the simulator and the real API server: the pool controller reads
//! GitHub's supported runner versions (the downloads API), compares `spec.github.runnerVersion`,
//! and acts on runners GitHub refuses (exit code 7). A deprecated pool stops minting after its
//! first refused runner and shows RunnerVersionSupported=False and Degraded; changing the pool lets
//! it mint again. A refusal of GitHub's newest version is an outage: minting goes on, with
//! backoff. A pool within 7 days of the end of GitHub's 30 days shows Expiring.

mod pool_common;

use std::time::{Duration, Instant};

use imp_api::conditions;
use imp_api::names::{condition, reason};
use imp_testkit::github::JobStatus;
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::api::{Patch, PatchParams};
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

async fn set_runner_version(h: &PoolHarness, pool: &str, version: &str) {
    let patch = json!({"spec": {"github": {"runnerVersion": version}}});
    h.pools()
        .patch(pool, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// (status, reason, message) of a pool condition, once it exists.
async fn condition_of(
    h: &PoolHarness,
    pool: &str,
    type_: &str,
) -> Option<(String, String, String)> {
    let st = h.pool_status(pool).await;
    conditions::find(&st.conditions, type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

async fn wait_condition(
    h: &PoolHarness,
    pool: &str,
    type_: &str,
    status: &str,
    why: &str,
) -> String {
    h.wait(
        &format!("{pool}: {type_}={status} ({why})"),
        WAIT,
        || async {
            condition_of(h, pool, type_)
                .await
                .filter(|(s, r, _)| s == status && r == why)
                .map(|(_, _, m)| m)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deprecated_pool_stops_minting_after_its_first_refused_runner() {
    let mut h = PoolHarness::start("pool-fresh-dep").await;
    // GitHub enforces: the newest is 2.330.0, nothing below 2.329.0 gets messages.
    h.sim.set_runner_releases("2.330.0", Some("2.329.0"), false);
    *h.runner_version.lock().unwrap() = "2.328.0".into();
    h.create_pool("old", json!({"maxRunners": 2})).await;
    set_runner_version(&h, "old", "2.328.0").await;
    // Below the minimum: the condition says so before any runner ran.
    let msg = wait_condition(
        &h,
        "old",
        condition::RUNNER_VERSION_SUPPORTED,
        "False",
        reason::RUNNER_VERSION_DEPRECATED,
    )
    .await;
    assert!(msg.contains("2.329.0"), "{msg}");
    h.start_agent(true, Duration::ZERO);
    let jobs: Vec<u64> = (0..3).map(|_| h.sim.queue_job(job()).id).collect();
    let msg = wait_condition(
        &h,
        "old",
        condition::DEGRADED,
        "True",
        reason::RUNNER_VERSION_DEPRECATED,
    )
    .await;
    assert!(msg.contains("exit code 7"), "{msg}");
    // No retry storm: what was minted by the first refusal is all there is.
    let minted = h.sim.stats().jit_configs_issued;
    assert!(
        (1..=2).contains(&minted),
        "at most maxRunners before the first refusal: {minted}"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        h.sim.stats().jit_configs_issued,
        minted,
        "no runner minted after the refusal"
    );
    let limited = condition_of(&h, "old", condition::SCALING_LIMITED)
        .await
        .unwrap();
    assert_eq!(
        (limited.0.as_str(), limited.1.as_str()),
        ("True", reason::RUNNER_VERSION_DEPRECATED)
    );
    let st = h.pool_status("old").await;
    let rv = st.runner_version.expect("status.runnerVersion");
    assert_eq!(rv.latest.as_deref(), Some("2.330.0"));
    assert!(
        rv.refused_vm.is_some() && rv.refused_generation.is_some(),
        "{rv:?}"
    );
    let events = h.events("old").await;
    assert!(
        events
            .iter()
            .any(|(r, _)| r == reason::RUNNER_VERSION_DEPRECATED),
        "{events:?}"
    );
    let key = format!("{}/old", h.ns);
    assert_eq!(
        h.metric(&format!(
            "imp_runner_pool_minting_stopped{{pool=\"{key}\"}}"
        )),
        1.0
    );
    assert!(
        h.metric(&format!(
            "imp_runner_version_refusals_total{{pool=\"{key}\",verdict=\"deprecated\"}}"
        )) >= 1.0
    );
    assert_eq!(
        h.metric(&format!("imp_runner_version_days_left{{pool=\"{key}\"}}")),
        0.0
    );
    // The fix: a runner layer of GitHub's newest version. The pool changes, minting resumes and
    // every job is served.
    *h.runner_version.lock().unwrap() = "2.330.0".into();
    set_runner_version(&h, "old", "2.330.0").await;
    h.wait(
        "every job served after the upgrade",
        Duration::from_secs(90),
        || async {
            jobs.iter()
                .all(|id| {
                    h.sim
                        .job(*id)
                        .is_some_and(|j| j.status == JobStatus::Completed)
                })
                .then_some(())
        },
    )
    .await;
    wait_condition(
        &h,
        "old",
        condition::DEGRADED,
        "False",
        reason::NOT_DEGRADED,
    )
    .await;
    wait_condition(
        &h,
        "old",
        condition::RUNNER_VERSION_SUPPORTED,
        "True",
        reason::RUNNER_VERSION_CURRENT,
    )
    .await;
    assert_eq!(
        h.metric(&format!(
            "imp_runner_pool_minting_stopped{{pool=\"{key}\"}}"
        )),
        0.0
    );
    // GitHub's versions were read once for all those passes (cached for versions_refresh).
    let calls = h.sim.runner_releases().downloads_calls;
    assert!((1..=2).contains(&calls), "downloads calls: {calls}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refusal_of_the_newest_version_is_an_outage_and_minting_goes_on_with_backoff() {
    let mut h = PoolHarness::start("pool-fresh-outage").await;
    // GitHub refuses everything, its newest release too.
    h.sim.set_runner_releases("2.330.0", Some("2.329.0"), true);
    h.create_pool("cur", json!({"maxRunners": 1})).await;
    set_runner_version(&h, "cur", "2.330.0").await;
    h.start_agent(true, Duration::ZERO);
    let id = h.sim.queue_job(job()).id;
    wait_condition(
        &h,
        "cur",
        condition::DEGRADED,
        "True",
        reason::RUNNER_REFUSED_CURRENT_VERSION,
    )
    .await;
    // Minting goes on (not stopped), paced by the start backoff (500 ms doubling to 2 s here).
    let start = Instant::now();
    let first = h.sim.runner_releases().refusals;
    h.wait("more refused runners: minting goes on", WAIT, || async {
        (h.sim.runner_releases().refusals >= first + 2).then_some(())
    })
    .await;
    let window = start.elapsed();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let later = h.sim.runner_releases().refusals;
    let rate_window = start.elapsed().as_secs_f64();
    assert!(
        (later - first) as f64 <= rate_window / 0.5 + 1.0,
        "{} refusals in {rate_window:.1} s: not paced (first two after {window:?})",
        later - first
    );
    let key = format!("{}/cur", h.ns);
    assert_eq!(
        h.metric(&format!(
            "imp_runner_pool_minting_stopped{{pool=\"{key}\"}}"
        )),
        0.0
    );
    assert!(
        h.metric(&format!(
            "imp_runner_version_refusals_total{{pool=\"{key}\",verdict=\"outage\"}}"
        )) >= 2.0
    );
    let supported = condition_of(&h, "cur", condition::RUNNER_VERSION_SUPPORTED)
        .await
        .unwrap();
    assert_eq!(supported.1, reason::RUNNER_VERSION_CURRENT, "{supported:?}");
    // GitHub recovers: the job is served and the condition clears.
    h.sim.set_runner_releases("2.330.0", Some("2.329.0"), false);
    h.wait(
        "the job served after the outage",
        Duration::from_secs(90),
        || async {
            h.sim
                .job(id)
                .is_some_and(|j| j.status == JobStatus::Completed)
                .then_some(())
        },
    )
    .await;
    wait_condition(
        &h,
        "cur",
        condition::DEGRADED,
        "False",
        reason::NOT_DEGRADED,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pool_within_seven_days_of_expiry_shows_expiring() {
    let mut h = PoolHarness::start("pool-fresh-exp").await;
    h.sim.set_runner_releases("2.331.0", Some("2.329.0"), false);
    h.create_pool("exp", json!({"maxRunners": 1})).await;
    set_runner_version(&h, "exp", "2.330.0").await;
    // Superseded now: the clock starts, 30 days left, still Current.
    let msg = wait_condition(
        &h,
        "exp",
        condition::RUNNER_VERSION_SUPPORTED,
        "True",
        reason::RUNNER_VERSION_CURRENT,
    )
    .await;
    assert!(
        msg.contains("2.331.0") && (msg.contains("29 days left") || msg.contains("30 days left")),
        "{msg}"
    );
    let rv = h.pool_status("exp").await.runner_version.unwrap();
    assert!(rv.superseded_time.is_some(), "{rv:?}");
    // The clock as an operator recorded it 24 days ago, then restarted: the status is what
    // survives (stopped while the status is edited, so no pass in flight writes the old clock).
    h.stop_operator().await;
    let then = Timestamp::now() - jiff_days(24);
    let patch = json!({"status": {"runnerVersion": {"supersededTime": Time(then)}}});
    h.pools()
        .patch_status("exp", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    h.restart_operator().await;
    let msg = wait_condition(
        &h,
        "exp",
        condition::RUNNER_VERSION_SUPPORTED,
        "True",
        reason::RUNNER_VERSION_EXPIRING,
    )
    .await;
    assert!(
        msg.contains("in 5 days") || msg.contains("in 6 days"),
        "{msg}"
    );
    let key = format!("{}/exp", h.ns);
    let left = h.metric(&format!("imp_runner_version_days_left{{pool=\"{key}\"}}"));
    assert!((5.9..6.01).contains(&left), "days left {left}");
    // The clock is kept, not restarted by the next passes.
    let rv = h.pool_status("exp").await.runner_version.unwrap();
    assert_eq!(
        rv.superseded_time.map(|t| t.0.as_second()),
        Some(then.as_second())
    );
}

fn jiff_days(days: i64) -> k8s_openapi::jiff::SignedDuration {
    k8s_openapi::jiff::SignedDuration::from_hours(24 * days)
}
