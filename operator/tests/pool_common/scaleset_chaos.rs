//! The scale-set chaos scenario (issue 33): two imp-operator binaries under leader election serve
//! a pool with scale-set intake and no webhook while the leader is `kill -9`ed, once while its ack
//! of a message is held in flight after the ledger write, the other times at random; every job is
//! served by exactly one runner, none acquired twice, none lost, one session per operator
//! lifetime. The node side is the caller's: the harness's fake agent
//! (`pool_scaleset_binary.rs`) or real imp-runtime + imp-agent processes (`pool_scaleset_node.rs`).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use imp_api::ScaleSetSpec;
use imp_operator::scaleset::{Ledger, LedgerState, intake::ledger_name};
use imp_testkit::github::scaleset::{ScaleSetJobState, ScaleSetStats};
use imp_testkit::github::{JobSpec, JobStatus, WebhookFault};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;

use super::{APP_SECRET, LABELS, OperatorProcess, PoolHarness};

/// The lease of the binary (client-go's 15 s) plus its 2 s retry, and the margin a loaded machine needs.
pub const FAILOVER: Duration = Duration::from_secs(90);

/// The scenario's pool and its knobs.
pub struct Chaos<'a> {
    /// The pool's name and its scale set's.
    pub pool: &'a str,
    pub set: &'a str,
    /// The pool template's class and image (what the nodes can run).
    pub class: &'a str,
    pub image: &'a str,
    pub max_runners: u32,
    /// Jobs queued, one every `queue_every`, while the leader is killed `kills` times (scale the
    /// kills, not the jobs: each costs a lease expiry, ~15 s, and the wait for the old session).
    pub jobs: usize,
    pub kills: usize,
    pub queue_every: Duration,
    /// How long the jobs may take to complete once all are queued.
    pub settle: Duration,
    /// What the node side logged, for a failure message.
    pub node_logs: &'a (dyn Fn() -> String + Sync),
}

/// What the scenario measured.
pub struct ChaosOutcome {
    /// From the first job queued to the last completed.
    pub took: Duration,
    pub jobs: usize,
    pub restarts: u64,
    pub stats: ScaleSetStats,
    /// The most acquire calls that named one job.
    pub max_acquire_calls: u32,
    /// The operators alive at the end.
    pub operators: Vec<OperatorProcess>,
}

/// The owner of the set's live session, if any.
fn session_owner(h: &PoolHarness, set: &str) -> Option<String> {
    h.sim
        .scale_sets()
        .into_iter()
        .find(|s| s.name == set)
        .and_then(|s| s.session)
        .map(|s| s.owner)
}

/// Runs the scenario against `h` (its own operator stopped; nodes and class in place, their
/// agents started by the caller) and asserts what it must prove; logs go to `dir`.
pub async fn serve_scale_set_jobs_under_kills(
    h: &PoolHarness,
    c: &Chaos<'_>,
    dir: &std::path::Path,
) -> ChaosOutcome {
    assert!(c.kills >= 1, "the first kill is the one during the ack");
    // A session outlives the operator's lease (20 s against 15 s): a successor meets the dead
    // leader's session (409) and must wait it out with backoff, not loop.
    h.sim
        .set_scale_set_timing(Duration::from_secs(20), Duration::from_secs(2));
    // No webhook: the pool has no webhook secret, and the simulator delivers nothing.
    h.sim.inject_webhook_fault(WebhookFault::Drop, 100_000);
    let mut pool = imp_testkit::fixtures::pool(c.pool)
        .org(h.sim.org())
        .app_secret(APP_SECRET)
        .labels(&LABELS)
        .class(c.class)
        .image(c.image)
        .scaling(serde_json::from_value(json!({"maxRunners": c.max_runners})).unwrap())
        .build();
    pool.spec.github.scale_set = Some(ScaleSetSpec {
        name: c.set.into(),
        runner_group: None,
    });
    assert!(pool.spec.webhook_secret_ref.is_none());
    h.pools()
        .create(&PostParams::default(), &pool)
        .await
        .unwrap();

    let env = [
        ("IMP_SCALE_SET_POLL_TIMEOUT", "2s"),
        ("IMP_JIT_MINTS_PER_MINUTE", "6000"),
    ];
    let mut generation = 0;
    let mut spawn = |h: &PoolHarness| {
        let id = format!("imp-{}-op-{generation}", c.pool);
        generation += 1;
        h.spawn_operator(&id, &dir.join(format!("{id}.log")), &env)
    };
    let mut ops = vec![spawn(h), spawn(h)];

    // A job is routed to a scale set that exists when it is queued (as at GitHub).
    h.wait("the scale set and its first session", FAILOVER, || async {
        session_owner(h, c.set)
    })
    .await;
    // The jobs, one every `queue_every`, while the leader is killed.
    let queue = async {
        let mut ids = Vec::new();
        for _ in 0..c.jobs {
            ids.push(
                h.sim
                    .queue_job(JobSpec {
                        labels: vec![c.set.into()],
                        ..Default::default()
                    })
                    .id,
            );
            tokio::time::sleep(c.queue_every).await;
        }
        ids
    };
    let started = Instant::now();
    let chaos = async {
        let mut killed_in_ack = 0;
        for k in 0..c.kills {
            let leader = h
                .wait("a leader holding the session", FAILOVER, || async {
                    let owner = session_owner(h, c.set)?;
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
            ops.push(spawn(h));
        }
        killed_in_ack
    };
    let (ids, killed_in_ack) = tokio::join!(queue, chaos);

    let deadline = Instant::now() + c.settle;
    let jobs = loop {
        let jobs: Vec<_> = ids.iter().filter_map(|id| h.sim.job(*id)).collect();
        if jobs.iter().all(|j| j.status == JobStatus::Completed) {
            break jobs;
        }
        if Instant::now() > deadline {
            eprintln!("{}", (c.node_logs)());
            stuck(h, c, dir, &jobs).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let took = started.elapsed();
    eprintln!("{} jobs completed after {took:.1?}", jobs.len());

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
    assert_eq!(set_jobs.len(), c.jobs);
    assert!(
        set_jobs
            .iter()
            .all(|j| matches!(j.state, ScaleSetJobState::Completed { .. })),
        "{set_jobs:?}"
    );
    let stats = h.sim.scale_set_stats();
    assert_eq!(stats.jobs_acquired, c.jobs as u64, "{stats:?}");
    let max_acquire_calls = set_jobs.iter().map(|j| j.acquire_calls).max().unwrap_or(0);
    // The ledger bound each runnerRequestId to the one runner that ran its job.
    let key = ledger_name(c.pool);
    let ledger = h
        .wait(
            "the ledger to record every completion",
            Duration::from_secs(60),
            || async {
                let api: Api<ConfigMap> = h.env.api();
                let cm = api.get_opt(&key).await.ok()??;
                let l = Ledger::from_data(&cm.data.unwrap_or_default()).ok()?;
                (l.entries.len() == c.jobs
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
    let restarts = c.kills as u64;
    assert!(stats.sessions_created <= restarts + 1, "{stats:?}");
    assert!(
        stats.session_conflicts <= 4 * restarts,
        "backoff, not a tight loop: {stats:?}"
    );
    eprintln!(
        "{} jobs, {restarts} kills: sessions created {}, 409s {}, expired {}, \
         redeliveries {}, acks held {} / discarded {}, JIT configs {}, most acquire calls naming one job {max_acquire_calls}",
        c.jobs,
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
    ChaosOutcome {
        took,
        jobs: jobs.len(),
        restarts,
        stats,
        max_acquire_calls,
        operators: ops,
    }
}

/// Not every job completed in time: what is stuck where, then the panic.
async fn stuck(
    h: &PoolHarness,
    c: &Chaos<'_>,
    dir: &std::path::Path,
    jobs: &[imp_testkit::github::SimJob],
) -> ! {
    let by_status = |st: JobStatus| jobs.iter().filter(|j| j.status == st).count();
    let vms: Vec<String> = h
        .runner_vms(c.pool)
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
        .get_opt(&ledger_name(c.pool))
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
    for f in std::fs::read_dir(dir).unwrap().flatten() {
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
        h.pool_status(c.pool).await,
        h.sim.scale_sets(),
    );
}
