//! Runner freshness against the simulator and the real API server: the pool controller reads
//! GitHub's supported runner versions (the downloads API), compares `spec.github.runnerVersion`,
//! and acts on runners GitHub refuses (exit code 7). Through the imp-operator binary (its ImpVM
//! controller binding the runner VMs to test nodes, its /metrics): a deprecated pool stops minting
//! after its first refused runner, shows RunnerVersionSupported=False and Degraded, and the
//! exported sample fires ImpRunnerVersionDeprecated in `promtool test rules` over the chart's
//! alert rules; changing the pool lets it mint again. A pool within 7 days of the end of GitHub's
//! 30 days shows Expiring (and fires ImpRunnerVersionExpiring). In process: a refusal of GitHub's
//! newest version is an outage: minting goes on, with backoff.

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
    // The binary is the operator here.
    h.stop_operator().await;
    let class = h.add_nodes(1).await;
    // GitHub enforces: the newest is 2.330.0, nothing below 2.329.0 gets messages.
    h.sim.set_runner_releases("2.330.0", Some("2.329.0"), false);
    *h.runner_version.lock().unwrap() = "2.328.0".into();
    h.create_pool("old", json!({"maxRunners": 2})).await;
    set_class(&h, "old", &class).await;
    set_runner_version(&h, "old", "2.328.0").await;
    let dir = tempfile::tempdir().unwrap();
    let op = h.spawn_operator("imp-fresh-dep", &dir.path().join("operator.log"), &[]);
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
    h.start_node_agent(Duration::ZERO);
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
    // What the binary exports, and the alert it fires.
    let key = format!("{}/old", h.ns);
    let stopped = format!("imp_runner_pool_minting_stopped{{pool=\"{key}\"}}");
    assert_eq!(
        op.metric(&stopped).await,
        Some(1.0),
        "{}",
        op.metrics().await
    );
    assert!(
        op.metric(&format!(
            "imp_runner_version_refusals_total{{pool=\"{key}\",verdict=\"deprecated\"}}"
        ))
        .await
        .unwrap_or(0.0)
            >= 1.0
    );
    assert_eq!(
        op.metric(&format!("imp_runner_version_days_left{{pool=\"{key}\"}}"))
            .await,
        Some(0.0)
    );
    alert_fires(
        &stopped,
        1.0,
        "ImpRunnerVersionDeprecated",
        "critical",
        &key,
        "5m",
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
    assert_eq!(op.metric(&stopped).await, Some(0.0));
    // GitHub's versions were read once for all those passes (cached for versions_refresh).
    let calls = h.sim.runner_releases().downloads_calls;
    assert!((1..=2).contains(&calls), "downloads calls: {calls}");
    let (status, logs) = op.stop().await;
    imp_testkit::binlog::assert_graceful_stop(status, &logs, "imp-operator stopped");
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
    // The binary is the operator here.
    h.stop_operator().await;
    h.sim.set_runner_releases("2.331.0", Some("2.329.0"), false);
    h.create_pool("exp", json!({"maxRunners": 1})).await;
    set_runner_version(&h, "exp", "2.330.0").await;
    let dir = tempfile::tempdir().unwrap();
    let op = h.spawn_operator("imp-fresh-exp", &dir.path().join("operator-1.log"), &[]);
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
    let (status, logs) = op.stop().await;
    imp_testkit::binlog::assert_graceful_stop(status, &logs, "imp-operator stopped");
    let then = Timestamp::now() - jiff_days(24);
    let patch = json!({"status": {"runnerVersion": {"supersededTime": Time(then)}}});
    h.pools()
        .patch_status("exp", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let op = h.spawn_operator("imp-fresh-exp", &dir.path().join("operator-2.log"), &[]);
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
    let sample = format!("imp_runner_version_days_left{{pool=\"{key}\"}}");
    let left = h
        .wait("the binary's days-left gauge", WAIT, || async {
            op.metric(&sample).await.filter(|v| *v < 7.0)
        })
        .await;
    assert!((5.9..6.01).contains(&left), "days left {left}");
    // `for: 1h`: firing at 70 minutes.
    alert_fires(
        &sample,
        left,
        "ImpRunnerVersionExpiring",
        "warning",
        &key,
        "70m",
    );
    // The clock is kept, not restarted by the next passes.
    let rv = h.pool_status("exp").await.runner_version.unwrap();
    assert_eq!(
        rv.superseded_time.map(|t| t.0.as_second()),
        Some(then.as_second())
    );
}

/// Points the pool's runner template at `class` (the class of [`PoolHarness::add_nodes`]).
async fn set_class(h: &PoolHarness, pool: &str, class: &str) {
    let patch = json!({"spec": {"template": {"spec": {"classRef": {"name": class}}}}});
    h.pools()
        .patch(pool, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// `promtool test rules` over the chart's alert rules (helm/imp/alerts/imp-alerts.yaml) with the
/// series the operator binary exported (`sample`, `name{labels}`), held at `value` for 150 minutes
/// and scraped in namespace imp-system: `alert` is firing for the pool at `fires`, with
/// `severity`. Skipped without promtool (Debian's prometheus) unless IMP_REQUIRE_PROMETHEUS=1.
fn alert_fires(sample: &str, value: f64, alert: &str, severity: &str, pool: &str, fires: &str) {
    if std::process::Command::new("promtool")
        .arg("--version")
        .output()
        .is_err()
    {
        imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_PROMETHEUS",
            &format!("{alert} in promtool test rules"),
            "promtool is not installed (Debian's prometheus)",
        );
        return;
    }
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../helm/imp/alerts/imp-alerts.yaml")
        .canonicalize()
        .unwrap();
    let series = format!(
        "{},namespace=\"imp-system\"}}",
        sample.trim_end_matches('}')
    );
    // The ALERTS series, not alert_rule_test: the annotations are the rule file's business.
    let test = format!(
        "rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: '{series}'
        values: '{value}x150'
    promql_expr_test:
      - expr: ALERTS{{alertname=\"{alert}\",alertstate=\"firing\"}}
        eval_time: {fires}
        exp_samples:
          - labels: 'ALERTS{{alertname=\"{alert}\",alertstate=\"firing\",severity=\"{severity}\",namespace=\"imp-system\",pool=\"{pool}\"}}'
            value: 1
",
        rules = rules.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("alert.test.yaml");
    std::fs::write(&path, &test).unwrap();
    let out = std::process::Command::new("promtool")
        .args(["test", "rules"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{alert} did not fire on {series} = {value}:\n{}{}\n{test}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("promtool: {alert} fires on {series} = {value} at {fires}");
}

fn jiff_days(days: i64) -> k8s_openapi::jiff::SignedDuration {
    k8s_openapi::jiff::SignedDuration::from_hours(24 * days)
}
