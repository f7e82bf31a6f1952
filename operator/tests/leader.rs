//! Leader election against the real API server: one leader among candidates, a released Lease is
//! taken over at once, a crashed leader's after the lease duration, and never two leaders at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use imp_operator::leader::{ElectionConfig, run_elector};
use imp_testkit::cluster::TestEnv;
use k8s_openapi::api::coordination::v1::Lease;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

struct Candidate {
    leading: watch::Receiver<bool>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

/// How long a silent holder keeps the Lease. Long enough that a released handover (a few retry
/// periods) and a wait for expiry stay apart on a loaded 2-core machine.
const LEASE_DURATION: Duration = Duration::from_secs(10);

fn fast(env: &TestEnv, identity: &str) -> ElectionConfig {
    ElectionConfig {
        lease_duration: LEASE_DURATION,
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(200),
        ..ElectionConfig::new(&env.namespace, "imp-operator-leader", identity)
    }
}

fn start(env: &TestEnv, identity: &str) -> Candidate {
    let (tx, rx) = watch::channel(false);
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(run_elector(
        env.client.clone(),
        fast(env, identity),
        tx,
        async {
            let _ = stopped.await;
        },
    ));
    Candidate {
        leading: rx,
        stop: Some(stop),
        task,
    }
}

async fn wait_leader(cands: &[&Candidate], within: Duration) -> usize {
    let start = Instant::now();
    loop {
        if let Some(i) = cands.iter().position(|c| *c.leading.borrow()) {
            return i;
        }
        assert!(start.elapsed() < within, "no leader within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_leader_a_released_lease_moves_at_once_and_a_crashed_leader_is_replaced() {
    let env = TestEnv::new("leader").await;
    let mut a = start(&env, "operator-a");
    let mut b = start(&env, "operator-b");
    // A watcher samples both: never two leaders.
    let both = Arc::new(AtomicUsize::new(0));
    let (ra, rb, both2) = (a.leading.clone(), b.leading.clone(), both.clone());
    let watcher = tokio::spawn(async move {
        loop {
            if *ra.borrow() && *rb.borrow() {
                both2.fetch_add(1, Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let first = wait_leader(&[&a, &b], Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        wait_leader(&[&a, &b], Duration::ZERO).await,
        first,
        "stable"
    );
    let (leader, follower) = if first == 0 {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    // A graceful stop (the Deployment roll's SIGTERM) releases the Lease: the other takes over
    // within a few retry periods, far sooner than the lease duration.
    let t = Instant::now();
    leader.stop.take().unwrap().send(()).unwrap();
    (&mut leader.task).await.unwrap();
    assert!(!*leader.leading.borrow());
    wait_leader(&[follower], Duration::from_secs(10)).await;
    let handover = t.elapsed();
    // Generous for a loaded machine (a few 200 ms retry periods is the norm), and still well short
    // of the lease duration an unreleased Lease would cost.
    assert!(
        handover < LEASE_DURATION / 2,
        "released handover took {handover:?}"
    );

    // A crash (no release): a new candidate waits out the lease duration, then takes over.
    let api: kube::Api<Lease> = env.api();
    let before = api.get("imp-operator-leader").await.unwrap();
    follower.task.abort();
    let t = Instant::now();
    let c = start(&env, "operator-c");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !*c.leading.borrow(),
        "the crashed leader's Lease is still live"
    );
    wait_leader(&[&c], LEASE_DURATION * 3).await;
    let takeover = t.elapsed();
    assert!(takeover >= LEASE_DURATION, "took over after {takeover:?}");
    let after = api.get("imp-operator-leader").await.unwrap();
    let spec = after.spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("operator-c"));
    assert_eq!(
        spec.lease_transitions.unwrap(),
        before.spec.unwrap().lease_transitions.unwrap() + 1
    );
    watcher.abort();
    c.task.abort();
    assert_eq!(both.load(Ordering::SeqCst), 0, "two leaders at once");
    eprintln!("released handover {handover:?}, crash takeover {takeover:?}");
}
