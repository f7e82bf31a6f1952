//! The imp-operator binary holding a scale set's message session against the simulator and a real
//! API server: a broker that stops answering (deaf) makes the operator not Ready within the stated
//! bound (`--scale-set-poll-timeout` + 15 s) and Ready again once it answers; a queue token that
//! expires (401) is refreshed in place (`PATCH .../sessions/{id}`), without a second session. And
//! two operator binaries (leader election) serving a pool with scale-set intake and no webhook,
//! the leader `kill -9`ed at random moments and once while its ack of a message was in flight
//! (after the ledger write): every job served by exactly one runner, none acquired twice, none
//! lost, one session per operator lifetime.

mod pool_common;

use std::collections::{BTreeMap, HashSet};
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

const CHAOS_SET: &str = "imp-chaos";
/// Jobs of the chaos test, and how many times the leader is killed (scale the kills, not the jobs:
/// each costs a lease expiry, ~15 s, and the wait for the old session).
const CHAOS_JOBS: usize = 200;
const CHAOS_KILLS: usize = 4;
/// The lease of the binary (client-go's 15 s) plus its 2 s retry, and the margin a loaded machine needs.
const FAILOVER: Duration = Duration::from_secs(90);

/// The owner of the set's live session, if any.
fn session_owner(h: &PoolHarness) -> Option<String> {
    h.sim
        .scale_sets()
        .into_iter()
        .find(|s| s.name == CHAOS_SET)
        .and_then(|s| s.session)
        .map(|s| s.owner)
}

#[tokio::test(flavor = "multi_thread")]
async fn two_operators_killed_at_random_serve_every_scale_set_job_exactly_once() {
    use imp_api::ScaleSetSpec;
    use imp_operator::scaleset::{Ledger, LedgerState, intake::ledger_name};
    use imp_testkit::github::scaleset::ScaleSetJobState;
    use imp_testkit::github::{JobSpec, JobStatus, WebhookFault};
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::Api;
    use kube::api::PostParams;

    let mut h = PoolHarness::start("pool-chaos").await;
    // The binaries are the operators here.
    h.stop_operator().await;
    let class = h.add_nodes(4).await;
    // A session outlives the operator's lease (20 s against 15 s): a successor meets the dead
    // leader's session (409) and must wait it out with backoff, not loop.
    h.sim
        .set_scale_set_timing(Duration::from_secs(20), Duration::from_secs(2));
    // No webhook: the pool has no webhook secret, and the simulator delivers nothing.
    h.sim.inject_webhook_fault(WebhookFault::Drop, 100_000);
    let mut pool = imp_testkit::fixtures::pool("chaos")
        .org(h.sim.org())
        .app_secret(APP_SECRET)
        .labels(&LABELS)
        .class(&class)
        .image("ghcr.io/imp/runner:1")
        .scaling(serde_json::from_value(json!({"maxRunners": 20})).unwrap())
        .build();
    pool.spec.github.scale_set = Some(ScaleSetSpec {
        name: CHAOS_SET.into(),
        runner_group: None,
    });
    assert!(pool.spec.webhook_secret_ref.is_none());
    h.pools()
        .create(&PostParams::default(), &pool)
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("IMP_SCALE_SET_POLL_TIMEOUT", "2s"),
        ("IMP_JIT_MINTS_PER_MINUTE", "6000"),
    ];
    let mut generation = 0;
    let mut spawn = |h: &PoolHarness| {
        let id = format!("imp-chaos-op-{generation}");
        generation += 1;
        h.spawn_operator(&id, &dir.path().join(format!("{id}.log")), &env)
    };
    let mut ops = vec![spawn(&h), spawn(&h)];
    h.start_node_agent(Duration::from_millis(300));

    // A job is routed to a scale set that exists when it is queued (as at GitHub).
    h.wait("the scale set and its first session", FAILOVER, || async {
        session_owner(&h)
    })
    .await;
    // The jobs, one every 150 ms, while the leader is killed.
    let queue = async {
        let mut ids = Vec::new();
        for _ in 0..CHAOS_JOBS {
            ids.push(
                h.sim
                    .queue_job(JobSpec {
                        labels: vec![CHAOS_SET.into()],
                        ..Default::default()
                    })
                    .id,
            );
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        ids
    };
    let started = Instant::now();
    let chaos = async {
        let mut killed_in_ack = 0;
        for k in 0..CHAOS_KILLS {
            let leader = h
                .wait("a leader holding the session", FAILOVER, || async {
                    let owner = session_owner(&h)?;
                    ops.iter().position(|o| o.identity == owner)
                })
                .await;
            if k == 0 {
                // Between the ledger write and the ack: the next ack of a message offering a job
                // is held open, and the leader killed while it is in flight.
                let before = h.sim.scale_set_stats();
                h.sim.hold_scale_set_acks(1);
                h.wait("an ack held in flight", FAILOVER, || async {
                    (h.sim.scale_set_stats().acks_held > before.acks_held).then_some(())
                })
                .await;
                let s = h.sim.scale_set_stats();
                assert_eq!(s.acks_held, s.acks_discarded + 1, "in flight: {s:?}");
                killed_in_ack += 1;
            } else {
                tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 6000)).await;
            }
            let mut victim = ops.remove(leader);
            eprintln!(
                "kill -9 {} at {:.1?} (kill {k})",
                victim.identity,
                started.elapsed()
            );
            victim.kill9().await;
            // A new standby at once: there is always a second operator.
            ops.push(spawn(&h));
        }
        killed_in_ack
    };
    let (ids, killed_in_ack) = tokio::join!(queue, chaos);

    let deadline = Instant::now() + Duration::from_secs(400);
    let jobs = loop {
        let jobs: Vec<_> = ids.iter().filter_map(|id| h.sim.job(*id)).collect();
        if jobs.iter().all(|j| j.status == JobStatus::Completed) {
            break jobs;
        }
        if Instant::now() > deadline {
            // What is stuck where, for the failure message.
            let by_status = |st: JobStatus| jobs.iter().filter(|j| j.status == st).count();
            let vms: Vec<String> = h
                .runner_vms("chaos")
                .await
                .iter()
                .map(|v| {
                    format!(
                        "{} node={:?} phase={:?} runner={:?}",
                        v.metadata.name.as_deref().unwrap_or(""),
                        v.spec.node_name,
                        v.status.as_ref().and_then(|s| s.phase),
                        v.status.as_ref().and_then(|s| s.runner.clone())
                    )
                })
                .collect();
            let stuck: Vec<_> = h
                .sim
                .scale_set_jobs()
                .into_iter()
                .filter(|j| !matches!(j.state, ScaleSetJobState::Completed { .. }))
                .collect();
            let api: Api<ConfigMap> = h.env.api();
            let ledger = api
                .get_opt(&ledger_name("chaos"))
                .await
                .ok()
                .flatten()
                .and_then(|cm| Ledger::from_data(&cm.data.unwrap_or_default()).ok())
                .unwrap_or_default();
            let entries: Vec<_> = stuck
                .iter()
                .map(|j| {
                    (
                        j.runner_request_id,
                        ledger.get(j.runner_request_id).cloned(),
                    )
                })
                .collect();
            eprintln!("stuck at the scale set: {stuck:?}\nin the ledger: {entries:?}");
            for f in std::fs::read_dir(dir.path()).unwrap().flatten() {
                let text = std::fs::read_to_string(f.path()).unwrap_or_default();
                for l in text.lines().filter(|l| {
                    stuck
                        .iter()
                        .any(|j| l.contains(&j.runner_request_id.to_string()))
                        || l.contains("scale-set")
                        || l.contains("scale set")
                        || l.contains("leader")
                }) {
                    eprintln!(
                        "{}: {}",
                        f.file_name().to_string_lossy(),
                        &l[..l.len().min(400)]
                    );
                }
            }
            panic!(
                "not every job completed: queued {}, in progress {}, completed {}; stats {:?}; \
                 pool {:?}; VMs {vms:#?}; set {:?}",
                by_status(JobStatus::Queued),
                by_status(JobStatus::InProgress),
                by_status(JobStatus::Completed),
                h.sim.scale_set_stats(),
                h.pool_status("chaos").await,
                h.sim.scale_sets(),
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "{} jobs completed after {:.1?}",
        jobs.len(),
        started.elapsed()
    );

    // Each job ran on a runner of its own, successfully; no runner took two.
    let runners: HashSet<&str> = jobs
        .iter()
        .map(|j| j.runner_name.as_deref().expect("a runner ran it"))
        .collect();
    assert_eq!(runners.len(), jobs.len(), "one runner per job");
    assert!(
        jobs.iter()
            .all(|j| j.conclusion.as_deref() == Some("success"))
    );
    // The scale set acquired each job exactly once (by its runnerRequestId) and saw it complete.
    let set_jobs = h.sim.scale_set_jobs();
    assert_eq!(set_jobs.len(), CHAOS_JOBS);
    assert!(
        set_jobs
            .iter()
            .all(|j| matches!(j.state, ScaleSetJobState::Completed { .. })),
        "{set_jobs:?}"
    );
    let stats = h.sim.scale_set_stats();
    assert_eq!(stats.jobs_acquired, CHAOS_JOBS as u64, "{stats:?}");
    let max_calls = set_jobs.iter().map(|j| j.acquire_calls).max().unwrap_or(0);
    // The ledger bound each runnerRequestId to the one runner that ran its job.
    let key = ledger_name("chaos");
    let ledger = h
        .wait(
            "the ledger to record every completion",
            Duration::from_secs(60),
            || async {
                let api: Api<ConfigMap> = h.env.api();
                let cm = api.get_opt(&key).await.ok()??;
                let l = Ledger::from_data(&cm.data.unwrap_or_default()).ok()?;
                (l.entries.len() == CHAOS_JOBS
                    && l.entries
                        .values()
                        .all(|e| e.state == LedgerState::Completed))
                .then_some(l)
            },
        )
        .await;
    let by_job: BTreeMap<&str, Option<&str>> = ledger
        .entries
        .values()
        .map(|e| (e.job_id.as_str(), e.runner_name.as_deref()))
        .collect();
    for j in &jobs {
        assert_eq!(
            by_job.get(j.id.to_string().as_str()).copied().flatten(),
            j.runner_name.as_deref(),
            "the ledger's runner of job {}",
            j.id
        );
    }
    // The unfinished ack was discarded and its message delivered again, harmlessly.
    assert!(
        stats.acks_discarded >= killed_in_ack && stats.redeliveries >= 1,
        "{stats:?}"
    );
    // One session per operator lifetime: none for a standby, no 409 loop.
    let restarts = CHAOS_KILLS as u64;
    assert!(stats.sessions_created <= restarts + 1, "{stats:?}");
    assert!(
        stats.session_conflicts <= 4 * restarts,
        "backoff, not a tight loop: {stats:?}"
    );
    eprintln!(
        "{CHAOS_JOBS} jobs, {restarts} kills: sessions created {}, 409s {}, expired {}, \
         redeliveries {}, acks held {} / discarded {}, JIT configs {}, most acquire calls naming one job {max_calls}",
        stats.sessions_created,
        stats.session_conflicts,
        stats.sessions_expired,
        stats.redeliveries,
        stats.acks_held,
        stats.acks_discarded,
        stats.jit_configs,
    );
    for op in &ops {
        let logs = op.log_text();
        for secret in h.sim.scale_set_credentials() {
            assert!(
                !logs.contains(&secret),
                "a scale-set credential reached the log"
            );
        }
    }
}
