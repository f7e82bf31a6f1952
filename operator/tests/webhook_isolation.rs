//! Tenants kept apart at the webhook receiver, against the simulator and the real API server: a
//! delivery signed with pool A's secret cannot change pool B's jobs, a replayed body under a new
//! delivery id is a duplicate, and 100k forged future job ids leave the job map bounded.

mod pool_common;

use std::collections::BTreeMap;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method, StatusCode};
use imp_operator::runnerpool::PoolKey;
use imp_operator::webhook::{DeliveryResult, handle};
use imp_testkit::fixtures;
use imp_testkit::github::{JobSpec, http::HttpClient, sign_body};
use kube::api::PostParams;
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);
const SECRET_A: &str = "tenant-a-webhook-secret";
const TENANT_A: [&str; 3] = ["self-hosted", "imp", "tenant-a"];
const TENANT_B: [&str; 3] = ["self-hosted", "imp", "tenant-b"];

/// Pool `a` (labels TENANT_A, its own secret SECRET_A) and pool `b` (labels TENANT_B, the secret the
/// simulator signs with).
async fn two_tenants(h: &PoolHarness) {
    h.create_secret(
        "wh-a",
        BTreeMap::from([("webhook-secret".to_string(), SECRET_A.to_string())]),
    )
    .await;
    for (name, labels, secret) in [("a", TENANT_A, "wh-a"), ("b", TENANT_B, "webhook")] {
        let pool = fixtures::pool(name)
            .org(h.sim.org())
            .app_secret(APP_SECRET)
            .labels(&labels)
            .class("runner")
            .image("ghcr.io/imp/runner:1")
            .scaling(serde_json::from_value(json!({"maxRunners": 4})).unwrap())
            .webhook_secret(secret)
            .build();
        h.pools()
            .create(&PostParams::default(), &pool)
            .await
            .unwrap();
    }
    for name in ["a", "b"] {
        h.wait("pool status", WAIT, || async {
            (h.pool_status(name).await.observed_generation == Some(1)).then_some(())
        })
        .await;
    }
}

fn body(action: &str, id: u64, labels: &[&str]) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "action": action,
        "workflow_job": {"id": id, "run_id": id, "status": action, "labels": labels,
                         "runner_name": null},
        "repository": {"full_name": "octo-org/octo-repo"},
    }))
    .unwrap()
}

/// The headers of a `workflow_job` delivery `delivery` of `b`, signed with tenant A's secret (for the
/// receiver's handler, called in process).
fn signed_by_a(delivery: &str, b: &[u8]) -> HeaderMap {
    let mut m = HeaderMap::new();
    m.insert("x-github-event", HeaderValue::from_static("workflow_job"));
    m.insert(
        "x-github-delivery",
        HeaderValue::from_str(delivery).unwrap(),
    );
    m.insert(
        "x-hub-signature-256",
        HeaderValue::from_str(&sign_body(SECRET_A, b)).unwrap(),
    );
    m
}

async fn post(url: &str, delivery: &str, secret: &str, body: Vec<u8>) -> (StatusCode, String) {
    let headers = vec![
        ("x-github-event", "workflow_job".to_string()),
        ("x-github-delivery", delivery.to_string()),
        ("content-type", "application/json".to_string()),
        ("x-hub-signature-256", sign_body(secret, &body)),
    ];
    let r = HttpClient::new(Duration::from_secs(5))
        .send(Method::POST, url, &headers, Some(body.into()))
        .await
        .unwrap();
    (r.status, String::from_utf8_lossy(&r.body).into_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_completed_signed_with_another_pools_secret_changes_nothing() {
    let h = PoolHarness::start("wh-iso").await;
    two_tenants(&h).await;
    let b = PoolKey::new(h.ns.clone(), "b");
    let queued = body("queued", 42, &TENANT_B);
    assert_eq!(
        post(&h.webhook_url, "q-42", WEBHOOK_SECRET, queued.clone()).await,
        (StatusCode::OK, "accepted".into())
    );
    h.wait_minted("b", 1, WAIT).await;
    // Tenant A's secret verifies the signature, but job 42 is B's.
    let forged = body("completed", 42, &TENANT_B);
    assert_eq!(
        post(&h.webhook_url, "c-42", SECRET_A, forged).await,
        (StatusCode::OK, "foreign".into())
    );
    // A replay of B's delivery under a new id is a duplicate.
    assert_eq!(
        post(&h.webhook_url, "q-42-again", WEBHOOK_SECRET, queued).await,
        (StatusCode::OK, "duplicate".into())
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.shared.demand().pool_demand(&b).queued, 1);
    assert_eq!(h.runner_vms("b").await.len(), 1);
    assert_eq!(h.runner_vms("a").await.len(), 0);
    assert_eq!(
        h.metric("imp_webhook_deliveries_total{result=\"foreign\"}"),
        1.0
    );

    // The shared path learns which secret verifies each webhook (`X-GitHub-Hook-ID`): after its
    // first delivery, a known hook's delivery costs one HMAC. Signed with whichever tenant's
    // secret the plain search tries second, so the search is seen to cost more.
    let order = h.shared.demand().candidate_secrets();
    let (secret, labels) = if order[0] == SECRET_A.as_bytes() {
        (WEBHOOK_SECRET, TENANT_B)
    } else {
        (SECRET_A, TENANT_A)
    };
    let position = order.iter().position(|s| s == secret.as_bytes()).unwrap();
    assert!(position >= 1, "{order:?}");
    let delivery = |id: u64, hook: Option<&'static str>| {
        let b = body("queued", id, &labels);
        let mut m = signed_by_a(&format!("s-{id}"), &b);
        m.insert(
            "x-hub-signature-256",
            HeaderValue::from_str(&sign_body(secret, &b)).unwrap(),
        );
        if let Some(hook) = hook {
            m.insert("x-github-hook-id", HeaderValue::from_static(hook));
        }
        assert_eq!(handle(&h.shared, None, &m, &b), DeliveryResult::Accepted);
    };
    let checks = || h.metric("imp_webhook_signature_checks_total");
    let before = checks();
    for id in 1_000..1_010 {
        delivery(id, None);
    }
    assert_eq!(
        checks() - before,
        10.0 * (position + 1) as f64,
        "no hook id: the search"
    );
    let before = checks();
    delivery(1_010, Some("4242"));
    assert_eq!(
        checks() - before,
        (position + 1) as f64,
        "an unknown hook: the search"
    );
    let before = checks();
    for id in 1_011..1_111 {
        delivery(id, Some("4242"));
    }
    assert_eq!(
        checks() - before,
        100.0,
        "a known hook's delivery costs one HMAC"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn forged_future_job_ids_leave_memory_bounded_and_cannot_suppress_another_pools_jobs() {
    let timing = imp_operator::runnerpool::PoolTiming {
        sweep_interval: Duration::from_secs(1),
        ..fast_timing()
    };
    let h = PoolHarness::start_with("wh-flood", timing).await;
    two_tenants(&h).await;
    // Tenant A floods `completed` for 100k future job ids (in process: the receiver's handler).
    let t = std::time::Instant::now();
    for id in 50_000_000..50_100_000u64 {
        let b = body("completed", id, &TENANT_A);
        assert_eq!(
            handle(&h.shared, None, &signed_by_a(&format!("f-{id}"), &b), &b),
            DeliveryResult::Accepted
        );
    }
    let held = h.shared.demand().job_count();
    let evicted = h.metric("imp_runner_demand_jobs_evicted_total");
    eprintln!(
        "100k forged completed deliveries in {:?}: {held} jobs held, {evicted} evicted",
        t.elapsed()
    );
    assert!(held <= 20_000, "bounded: {held}");
    assert_eq!(evicted, (100_000 - held) as f64);
    assert_eq!(h.metric("imp_runner_demand_jobs"), held as f64);

    // Tenant A pre-sends `completed` for the next job ids the simulator will hand out...
    let next = h.sim.queue_job(JobSpec {
        labels: TENANT_B.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    });
    let b_key = PoolKey::new(h.ns.clone(), "b");
    h.wait_minted("b", 1, WAIT).await;
    for id in next.id + 1..next.id + 4 {
        let b = body("completed", id, &TENANT_A);
        handle(&h.shared, None, &signed_by_a(&format!("pre-{id}"), &b), &b);
    }
    // ... then B's real job with such an id arrives: its delivery is refused (the record is A's),
    // but the sweep, GitHub's own view, routes it to B.
    let real = h.sim.queue_job(JobSpec {
        labels: TENANT_B.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    });
    assert_eq!(real.id, next.id + 1);
    h.wait("B's second job served", WAIT, || async {
        (h.shared.demand().pool_demand(&b_key).queued == 2).then_some(())
    })
    .await;
    h.wait_minted("b", 2, WAIT).await;
    assert_eq!(h.runner_vms("a").await.len(), 0);
}

/// Issue 30: tenant A floods 100k validly signed `queued` deliveries (a repository the sweep never
/// lists, ids GitHub never made); tenant B's queued job stays in the demand and is served. Before,
/// one table of 20,000 jobs evicted oldest first across all pools, B's job among the first.
#[tokio::test(flavor = "multi_thread")]
async fn one_tenants_flood_of_queued_jobs_leaves_anothers_job_served() {
    // No sweep during the test: it would find B's job again and hide an eviction.
    let timing = imp_operator::runnerpool::PoolTiming {
        sweep_interval: Duration::from_secs(3600),
        ..fast_timing()
    };
    let h = PoolHarness::start_with("wh-qflood", timing).await;
    two_tenants(&h).await;
    let b_key = PoolKey::new(h.ns.clone(), "b");
    let b_body = body("queued", 7, &TENANT_B);
    assert_eq!(
        post(&h.webhook_url, "b-7", WEBHOOK_SECRET, b_body).await.0,
        StatusCode::OK
    );
    assert_eq!(h.shared.demand().pool_demand(&b_key).queued, 1);
    // Each pool's own path checks its own secret only: one HMAC per delivery, and another
    // tenant's secret or an unknown pool gets nowhere (through the real HTTP receiver).
    let own = |pool: &str| format!("{}/{}/{pool}", h.webhook_url, h.ns);
    let b8 = body("queued", 8, &TENANT_B);
    assert_eq!(
        post(&own("b"), "b-8", SECRET_A, b8.clone()).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        post(&own("nosuch"), "b-8", WEBHOOK_SECRET, b8.clone())
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    let checks = h.metric("imp_webhook_signature_checks_total");
    assert_eq!(
        post(&own("b"), "b-8", WEBHOOK_SECRET, b8).await.0,
        StatusCode::OK
    );
    assert_eq!(h.metric("imp_webhook_signature_checks_total") - checks, 1.0);
    assert_eq!(h.shared.demand().pool_demand(&b_key).queued, 2);

    let a_key = PoolKey::new(h.ns.clone(), "a");
    let checks = h.metric("imp_webhook_signature_checks_total");
    let t = std::time::Instant::now();
    for id in 60_000_000..60_100_000u64 {
        let b = body("queued", id, &TENANT_A);
        assert_eq!(
            handle(
                &h.shared,
                Some(&a_key),
                &signed_by_a(&format!("q-{id}"), &b),
                &b
            ),
            DeliveryResult::Accepted
        );
    }
    assert_eq!(
        h.metric("imp_webhook_signature_checks_total") - checks,
        100_000.0,
        "a delivery to a pool's own path costs one HMAC"
    );
    let (a, b) = {
        let d = h.shared.demand();
        (d.pool_demand(&a_key).queued, d.pool_demand(&b_key).queued)
    };
    eprintln!(
        "100k queued deliveries for pool a in {:?}: a holds {a}, b holds {b}",
        t.elapsed()
    );
    assert_eq!(b, 2, "tenant A's flood evicted tenant B's queued jobs");
    assert_eq!(a, 5_000, "pool a held at its own cap");
    assert_eq!(
        h.metric("imp_runner_demand_jobs_evicted_total"),
        (100_000 - 5_000) as f64
    );
    h.wait_minted("b", 2, WAIT).await;
}

/// Issue 30: a flood of 1 MiB deliveries (a wrong signature costs the HMAC all the same) is checked
/// at most `concurrent_checks` at a time through the real HTTP receiver; the rest answer 503 `busy`
/// with Retry-After, counted; pool b's queued job is still served.
#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_deliveries_is_checked_within_the_bound_and_another_pool_is_served() {
    use imp_operator::webhook::{MAX_BODY, WebhookLimits, webhook_router_with};
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

    let timing = imp_operator::runnerpool::PoolTiming {
        sweep_interval: Duration::from_secs(1),
        ..fast_timing()
    };
    let h = PoolHarness::start_with("wh-bound", timing).await;
    two_tenants(&h).await;
    const BOUND: usize = 2;
    let limits = WebhookLimits {
        concurrent_checks: BOUND,
        queue_wait: Duration::from_millis(20),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/webhooks/github", listener.local_addr().unwrap());
    let router = webhook_router_with(h.shared.clone(), limits);
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    // The simulator's deliveries (b's job) go through the bounded receiver too.
    h.sim.set_webhook(&base, WEBHOOK_SECRET);

    let gauge = h.shared.metrics.webhook_checks_in_flight.clone();
    let (stop, peak) = (
        std::sync::Arc::new(AtomicBool::new(false)),
        std::sync::Arc::new(AtomicI64::new(0)),
    );
    let sampler = std::thread::spawn({
        let (stop, peak) = (stop.clone(), peak.clone());
        move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(gauge.get(), Ordering::Relaxed);
                std::thread::yield_now();
            }
        }
    });
    let checks = h.metric("imp_webhook_signature_checks_total");
    let a_path = format!("{base}/{}/a", h.ns);
    let big = bytes::Bytes::from(vec![b' '; MAX_BODY]);
    const FLOOD: usize = 64;
    let mut flood = tokio::task::JoinSet::new();
    for i in 0..FLOOD {
        let (url, body) = (a_path.clone(), big.clone());
        flood.spawn(async move {
            let headers = vec![
                ("x-github-event", "workflow_job".to_string()),
                ("x-github-delivery", format!("flood-{i}")),
                ("x-hub-signature-256", sign_body("not-the-secret", &body)),
            ];
            let r = HttpClient::new(Duration::from_secs(60))
                .send(Method::POST, &url, &headers, Some(body))
                .await
                .unwrap();
            (r.status, r.headers.contains_key(http::header::RETRY_AFTER))
        });
    }
    // b's job is queued at GitHub while the flood runs.
    h.sim.queue_job(JobSpec {
        labels: TENANT_B.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    });
    let (mut refused, mut busy) = (0, 0);
    while let Some(r) = flood.join_next().await {
        match r.unwrap() {
            (StatusCode::UNAUTHORIZED, _) => refused += 1,
            (StatusCode::SERVICE_UNAVAILABLE, true) => busy += 1,
            other => panic!("unexpected answer to a flood delivery: {other:?}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let peak = peak.load(Ordering::Relaxed);
    eprintln!("{FLOOD} deliveries of 1 MiB: {refused} checked (401), {busy} busy, peak {peak}");
    assert!(peak >= 1, "the sampler never saw a check in flight");
    assert!(
        peak <= BOUND as i64,
        "{peak} checks in flight, bound {BOUND}"
    );
    assert!(
        busy > 0,
        "a flood of {FLOOD} never saturated a bound of {BOUND}"
    );
    assert_eq!(refused + busy, FLOOD);
    // The simulator's own delivery of b's job may have found the receiver busy too.
    let counted = h.metric("imp_webhook_deliveries_total{result=\"busy\"}");
    assert!(
        counted == busy as f64 || counted == busy as f64 + 1.0,
        "busy counted {counted}, answered {busy}"
    );
    assert_eq!(
        h.metric("imp_webhook_signature_checks_total") - checks,
        refused as f64,
        "a busy delivery costs no HMAC"
    );
    assert_eq!(h.metric("imp_webhook_signature_checks_in_flight"), 0.0);
    h.wait_minted("b", 1, WAIT).await;
    assert_eq!(h.runner_vms("a").await.len(), 0);
    server.abort();
}
