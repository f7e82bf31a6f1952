//! The imp-operator binary holding a scale set's message session against the simulator and a real
//! API server: a broker that stops answering (deaf) makes the operator not Ready within the stated
//! bound (`--scale-set-poll-timeout` + 15 s) and Ready again once it answers; a queue token that
//! expires (401) is refreshed in place (`PATCH .../sessions/{id}`), without a second session. And
//! two operator binaries (leader election) serving a pool with scale-set intake and no webhook,
//! the leader `kill -9`ed at random moments and once while its ack of a message was in flight
//! (after the ledger write): every job served by exactly one runner, none acquired twice, none
//! lost, one session per operator lifetime (the scenario: `pool_common/scaleset_chaos.rs`, shared
//! with `pool_scaleset_node.rs`, which runs it on real imp-runtime + imp-agent nodes).

mod pool_common;

use std::time::{Duration, Instant};

use imp_testkit::binlog::{self, get};
use kube::api::{Patch, PatchParams};
use pool_common::*;
use serde_json::json;

const SET: &str = "imp-deaf";
/// The operator's poll window in this test; the deaf bound is this plus 15 s.
const POLL: Duration = Duration::from_secs(2);
const BOUND: Duration = Duration::from_secs(2 + 15);

/// Polls /readyz until `want` (status code); the time it took and the body.
async fn readyz_becomes(
    addr: &str,
    want: u16,
    within: Duration,
    log: &std::path::Path,
) -> (Duration, String) {
    let start = Instant::now();
    loop {
        if let Some((code, body)) = get(addr, "/readyz").await
            && code == want
        {
            return (start.elapsed(), body);
        }
        assert!(
            start.elapsed() < within,
            "/readyz never answered {want} within {within:?}; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deaf_session_makes_the_operator_not_ready_and_a_401_refreshes_the_session() {
    let mut h = PoolHarness::start("pool-deaf").await;
    // The binary is the operator here.
    h.stop_operator().await;
    h.sim
        .set_scale_set_timing(Duration::from_secs(60), Duration::from_secs(1));
    h.create_pool("deaf", json!({ "maxRunners": 2 })).await;
    let patch = json!({"spec": {"github": {"scaleSet": {"name": SET}}}});
    h.pools()
        .patch("deaf", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("operator.log");
    let op = h.spawn_operator("imp-deaf-op", &log, &[("IMP_SCALE_SET_POLL_TIMEOUT", "2s")]);
    let addr = op.addr.clone();
    h.wait(
        "the binary's scale-set session",
        Duration::from_secs(60),
        || async {
            h.sim
                .scale_sets()
                .iter()
                .any(|s| s.name == SET && s.session.is_some())
                .then_some(())
        },
    )
    .await;
    readyz_becomes(&addr, 200, Duration::from_secs(30), &log).await;

    // Deaf: polls hang. Not Ready within the bound (plus the 100 ms the test polls at).
    h.sim.set_scale_set_deaf(true);
    let (took, body) = readyz_becomes(&addr, 503, BOUND + Duration::from_secs(5), &log).await;
    assert!(body.contains("heard nothing"), "{body}");
    assert!(
        took >= BOUND - POLL,
        "not Ready after {took:?}, before a silent poll window could pass"
    );
    eprintln!("deaf -> not Ready after {took:?} (bound {BOUND:?})");
    // The broker answers again: Ready again as soon as a poll is answered.
    h.sim.set_scale_set_deaf(false);
    let (back, _) = readyz_becomes(&addr, 200, Duration::from_secs(10), &log).await;
    eprintln!("answering again -> Ready after {back:?}");

    // The queue token expires: 401 until refreshed; the session is refreshed in place.
    let before = h.sim.scale_set_stats();
    h.sim.expire_scale_set_queue_tokens();
    h.wait(
        "the session refreshed after a 401",
        Duration::from_secs(30),
        || async {
            let s = h.sim.scale_set_stats();
            (s.sessions_refreshed > before.sessions_refreshed && s.polls > before.polls + 2)
                .then_some(())
        },
    )
    .await;
    let after = h.sim.scale_set_stats();
    assert!(after.unauthorized > before.unauthorized, "{after:?}");
    assert_eq!(
        after.sessions_created, before.sessions_created,
        "refreshed, not replaced: {after:?}"
    );
    assert_eq!(
        after.session_conflicts, before.session_conflicts,
        "{after:?}"
    );
    assert_eq!(get(&addr, "/readyz").await.map(|r| r.0), Some(200));

    let (status, logs) = op.stop().await;
    binlog::assert_graceful_stop(status, &logs, "imp-operator stopped");
    for secret in h.sim.scale_set_credentials() {
        assert!(
            !logs.contains(&secret),
            "a scale-set credential reached the log"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_operators_killed_at_random_serve_every_scale_set_job_exactly_once() {
    use pool_common::scaleset_chaos::{Chaos, serve_scale_set_jobs_under_kills};

    let mut h = PoolHarness::start("pool-chaos").await;
    // The binaries are the operators here.
    h.stop_operator().await;
    let class = h.add_nodes(4).await;
    h.start_node_agent(Duration::from_millis(300));
    let dir = tempfile::tempdir().unwrap();
    let chaos = Chaos {
        pool: "chaos",
        set: "imp-chaos",
        class: &class,
        image: "ghcr.io/imp/runner:1",
        max_runners: 20,
        jobs: 200,
        kills: 4,
        queue_every: Duration::from_millis(150),
        settle: Duration::from_secs(400),
        node_logs: &String::new,
    };
    serve_scale_set_jobs_under_kills(&h, &chaos, dir.path()).await;
}
