//! Two operator processes (in process: elector, leader-gated webhook receiver, pool controller while
//! leading) against one simulator and API server, and a restart of the leader: never more runner VMs
//! than maxRunners, no JitConfigLost, every job served, no delivery answered 2xx by a standby, none
//! answered 401 by a new leader that had not read the pool secrets yet.

mod pool_common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use imp_api::names::reason;
use imp_operator::github::{GithubApps, GithubMetrics};
use imp_operator::index::{Index, IndexConfig};
use imp_operator::leader::{ElectionConfig, leader_only, run_elector, while_leading};
use imp_operator::runnerpool::{
    PoolControllerConfig, PoolMetrics, PoolShared, run_runnerpool_controller,
};
use imp_operator::webhook::webhook_router;
use imp_testkit::github::JobStatus;
use pool_common::*;
use serde_json::json;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

const LEASE: &str = "imp-operator-leader";

struct Operator {
    name: String,
    leading: watch::Receiver<bool>,
    webhook_url: String,
    release: Option<oneshot::Sender<()>>,
    elector: JoinHandle<()>,
    work: Vec<JoinHandle<()>>,
}

impl Operator {
    async fn start(h: &PoolHarness, name: &str) -> Operator {
        let apps = Arc::new(GithubApps::new(
            github_config(&h.sim),
            GithubMetrics::default(),
        ));
        let shared = PoolShared::new(apps, PoolMetrics::default());
        let (tx, leading) = watch::channel(false);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let webhook_url = format!("http://{}/webhooks/github", listener.local_addr().unwrap());
        let router = webhook_router(shared.clone()).layer(axum::middleware::from_fn_with_state(
            leading.clone(),
            leader_only,
        ));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        let cfg = ElectionConfig {
            lease_duration: Duration::from_secs(3),
            renew_deadline: Duration::from_secs(2),
            retry_period: Duration::from_millis(200),
            ..ElectionConfig::new(&h.ns, LEASE, name)
        };
        let (release, released) = oneshot::channel::<()>();
        let elector = tokio::spawn(run_elector(h.client.clone(), cfg, tx, async {
            let _ = released.await;
        }));
        let mut config = PoolControllerConfig::new();
        config.namespace = Some(h.ns.clone());
        config.timing = imp_operator::runnerpool::PoolTiming {
            sweep_interval: Duration::from_secs(1),
            ..fast_timing()
        };
        // As in the operator: the index is built when leadership begins.
        let client = h.client.clone();
        let watched = IndexConfig::namespace(&h.ns);
        let controller = async move {
            let index = Index::start(client.clone(), watched);
            run_runnerpool_controller(client, index, config, shared).await
        };
        let gate = leading.clone();
        let lead = tokio::spawn(async move {
            let _ = while_leading(gate, controller).await;
        });
        Operator {
            name: name.to_owned(),
            leading,
            webhook_url,
            release: Some(release),
            elector,
            work: vec![server, lead],
        }
    }

    fn leads(&self) -> bool {
        *self.leading.borrow()
    }

    /// SIGTERM: the controllers stop first, then the Lease is released.
    async fn stop(mut self) {
        for t in self.work.drain(..) {
            t.abort();
            let _ = t.await;
        }
        let _ = self.release.take().unwrap().send(());
        let _ = (&mut self.elector).await;
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.elector.abort();
        for t in &self.work {
            t.abort();
        }
    }
}

/// The name of the one that leads (waits for one).
async fn leader(h: &PoolHarness, ops: &[&Operator]) -> String {
    h.wait("one leader", Duration::from_secs(20), || async {
        let leading: Vec<&&Operator> = ops.iter().filter(|o| o.leads()).collect();
        assert!(leading.len() <= 1, "two leaders");
        leading.first().map(|o| o.name.clone())
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn two_operators_and_a_leader_restart_never_double_runners_or_lose_jobs() {
    let mut h = PoolHarness::start("leader-ops").await;
    h.stop_operator().await;
    let a = Operator::start(&h, "operator-a").await;
    let b = Operator::start(&h, "operator-b").await;
    let first_name = leader(&h, &[&a, &b]).await;
    let (old, standby) = if first_name == a.name { (a, b) } else { (b, a) };
    // The Service routes to the Ready pod: the leader.
    h.sim.set_webhook(&old.webhook_url, WEBHOOK_SECRET);
    assert!(!standby.leads());

    h.create_pool("ha", json!({"maxRunners": 3})).await;
    h.wait("pool status", Duration::from_secs(30), || async {
        (h.pool_status("ha").await.observed_generation == Some(1)).then_some(())
    })
    .await;
    h.start_agent(true, Duration::from_secs(2));
    let max_vms = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (vms, max) = (h.vms(), max_vms.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(l) = vms.list(&Default::default()).await {
                    let live = l
                        .items
                        .iter()
                        .filter(|v| v.metadata.deletion_timestamp.is_none())
                        .count();
                    max.fetch_max(live, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let mut jobs: Vec<u64> = (0..3).map(|_| h.sim.queue_job(job()).id).collect();
    h.wait(
        "the first jobs running",
        Duration::from_secs(60),
        || async {
            jobs.iter()
                .all(|id| {
                    h.sim
                        .job(*id)
                        .is_some_and(|j| j.status != JobStatus::Queued)
                })
                .then_some(())
        },
    )
    .await;

    // A rolling restart of the leader: it stops (releasing the Lease) and a new pod joins.
    old.stop().await;
    let c = Operator::start(&h, "operator-c").await;
    // Whichever candidate wins the released Lease leads (the standby or the new pod).
    let next = leader(&h, &[&standby, &c]).await;
    let url = if next == standby.name {
        &standby.webhook_url
    } else {
        &c.webhook_url
    };
    h.sim.set_webhook(url, WEBHOOK_SECRET);
    jobs.extend((0..3).map(|_| h.sim.queue_job(job()).id));
    h.wait("every job served", Duration::from_secs(120), || async {
        jobs.iter()
            .all(|id| {
                h.sim
                    .job(*id)
                    .is_some_and(|j| j.status == JobStatus::Completed)
            })
            .then_some(())
    })
    .await;
    sampler.abort();
    let max = max_vms.load(Ordering::SeqCst);
    assert!(max <= 3, "never beyond maxRunners: saw {max} VMs");
    let reasons: Vec<String> = h.events("ha").await.into_iter().map(|(r, _)| r).collect();
    assert!(
        !reasons.iter().any(|r| r == reason::JIT_CONFIG_LOST),
        "{reasons:?}"
    );
    // The first jobs' deliveries reached the leader and were answered 2xx. After the handover a
    // delivery is answered 2xx (in the new leader's demand) or 503 (retryable: the new leader had not
    // read the pool's secret yet; the sweep served its job, as asserted above), never 401.
    let deliveries = h.sim.deliveries();
    let status = |id: &u64| {
        deliveries
            .iter()
            .find(|d| d.job_id == *id && d.action == "queued")
            .and_then(|d| d.status)
    };
    for id in &jobs[..3] {
        assert_eq!(status(id), Some(200));
    }
    for d in &deliveries {
        assert_ne!(d.status, Some(401), "a delivery refused as forged: {d:?}");
    }
    let after: Vec<Option<u16>> = jobs[3..].iter().map(status).collect();
    eprintln!(
        "first leader {first_name}, then {next}; max {max} runner VMs; {} deliveries; queued \
         deliveries after the handover answered {after:?}",
        deliveries.len()
    );
    c.stop().await;
}
