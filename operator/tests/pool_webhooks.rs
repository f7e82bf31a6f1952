//! The webhook receiver and the sweep against the simulator and the real API server: a dropped
//! webhook is caught by the sweep, a duplicated delivery counts once, a forged signature creates nothing.

mod pool_common;

use std::time::Duration;

use http::{Method, StatusCode};
use imp_testkit::github::{WebhookFault, http::HttpClient, sign_body};
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_webhook_is_caught_by_the_sweep() {
    let timing = imp_operator::runnerpool::PoolTiming {
        sweep_interval: Duration::from_secs(1),
        ..fast_timing()
    };
    let h = PoolHarness::start_with("pool-sweep", timing).await;
    h.create_pool("sweep", json!({"maxRunners": 4})).await;
    h.wait("pool status", WAIT, || async {
        (h.pool_status("sweep").await.observed_generation == Some(1)).then_some(())
    })
    .await;
    h.sim.inject_webhook_fault(WebhookFault::Drop, 1);
    let job = h.sim.queue_job(job());
    let started = std::time::Instant::now();
    h.wait_minted("sweep", 1, Duration::from_secs(10)).await;
    eprintln!(
        "sweep caught the lost job {} after {:?}",
        job.id,
        started.elapsed()
    );
    assert_eq!(
        h.sim
            .deliveries()
            .iter()
            .find(|d| d.job_id == job.id)
            .unwrap()
            .outcome,
        "dropped"
    );
    assert_eq!(
        h.metric("imp_webhook_deliveries_total{result=\"accepted\"}"),
        0.0
    );
    // The sweep keeps seeing the same queued job: still one runner.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(h.runner_vms("sweep").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicated_delivery_is_counted_once() {
    let h = PoolHarness::start("pool-dup").await;
    h.create_pool("dup", json!({"maxRunners": 4})).await;
    h.wait("pool status", WAIT, || async {
        (h.pool_status("dup").await.observed_generation == Some(1)).then_some(())
    })
    .await;
    h.sim.inject_webhook_fault(WebhookFault::Duplicate, 1);
    h.sim.queue_job(job());
    h.wait("both deliveries", WAIT, || async {
        (h.metric("imp_webhook_deliveries_total{result=\"duplicate\"}") == 1.0).then_some(())
    })
    .await;
    assert_eq!(
        h.metric("imp_webhook_deliveries_total{result=\"accepted\"}"),
        1.0
    );
    h.wait_minted("dup", 1, WAIT).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.runner_vms("dup").await.len(), 1);
    assert_eq!(h.pool_status("dup").await.desired, 1);
}

fn queued_body(job_id: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "action": "queued",
        "workflow_job": {"id": job_id, "run_id": 1, "status": "queued", "labels": ["self-hosted", "imp"],
                         "runner_name": null},
        "repository": {"full_name": "octo-org/octo-repo"},
    }))
    .unwrap()
}

async fn post(url: &str, delivery: &str, signature: Option<String>, body: Vec<u8>) -> StatusCode {
    let mut headers = vec![
        ("x-github-event", "workflow_job".to_string()),
        ("x-github-delivery", delivery.to_string()),
        ("content-type", "application/json".to_string()),
    ];
    if let Some(s) = signature {
        headers.push(("x-hub-signature-256", s));
    }
    HttpClient::new(Duration::from_secs(5))
        .send(Method::POST, url, &headers, Some(body.into()))
        .await
        .unwrap()
        .status
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_signature_creates_nothing() {
    let h = PoolHarness::start("pool-forged").await;
    h.create_pool("forged", json!({"maxRunners": 4})).await;
    h.wait("pool status", WAIT, || async {
        (h.pool_status("forged").await.observed_generation == Some(1)).then_some(())
    })
    .await;
    let url = &h.webhook_url;
    let forged = sign_body("not-the-secret", &queued_body(77));
    assert_eq!(
        post(url, "f1", Some(forged), queued_body(77)).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        post(url, "f2", None, queued_body(78)).await,
        StatusCode::UNAUTHORIZED
    );
    // Signed for a different body (tampered payload).
    let other = sign_body(WEBHOOK_SECRET, &queued_body(1));
    assert_eq!(
        post(url, "f3", Some(other), queued_body(79)).await,
        StatusCode::UNAUTHORIZED
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(h.runner_vms("forged").await.is_empty());
    assert_eq!(
        h.metric("imp_webhook_deliveries_total{result=\"bad_signature\"}"),
        3.0
    );
    assert_eq!(h.pool_status("forged").await.desired, 0);

    // The same delivery properly signed is accepted: the refusals were about the signature alone.
    let good = sign_body(WEBHOOK_SECRET, &queued_body(77));
    assert_eq!(
        post(url, "f1", Some(good), queued_body(77)).await,
        StatusCode::OK
    );
    h.wait_minted("forged", 1, WAIT).await;
    assert_eq!(
        h.metric("imp_webhook_deliveries_total{result=\"accepted\"}"),
        1.0
    );
}

/// A new leader (fresh in-memory state) that has not read the pools' webhook secrets yet answers a
/// properly signed delivery 503, never 401 or an unrouted 2xx; once its controller has read them, the
/// same delivery (same id: a 503 burns nothing) is accepted and its job served.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_leader_answers_503_until_it_has_read_the_pool_secrets() {
    use std::sync::Arc;

    use imp_operator::github::{GithubApps, GithubMetrics};
    use imp_operator::index::{Index, IndexConfig};
    use imp_operator::runnerpool::{
        PoolControllerConfig, PoolMetrics, PoolShared, run_runnerpool_controller,
    };
    use imp_operator::webhook::webhook_router;

    let mut h = PoolHarness::start("pool-newleader").await;
    h.create_pool("nl", json!({"maxRunners": 4})).await;
    h.wait("pool status", WAIT, || async {
        (h.pool_status("nl").await.observed_generation == Some(1)).then_some(())
    })
    .await;
    h.stop_operator().await;

    let apps = Arc::new(GithubApps::new(
        github_config(&h.sim),
        GithubMetrics::default(),
    ));
    let shared = PoolShared::new(apps, PoolMetrics::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/webhooks/github", listener.local_addr().unwrap());
    let router = webhook_router(shared.clone());
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let body = queued_body(4242);
    let signed = || Some(sign_body(WEBHOOK_SECRET, &body));
    assert_eq!(
        post(&url, "nl-1", signed(), body.clone()).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "before the pool secrets are read"
    );
    assert!(!shared.routes_loaded());

    let mut config = PoolControllerConfig::new();
    config.namespace = Some(h.ns.clone());
    config.timing = fast_timing();
    let index = Index::start(h.client.clone(), IndexConfig::namespace(&h.ns));
    let controller = tokio::spawn(run_runnerpool_controller(
        h.client.clone(),
        index,
        config,
        shared.clone(),
    ));
    let answer = h
        .wait("an answer other than 503", WAIT, || async {
            let s = post(&url, "nl-1", signed(), body.clone()).await;
            (s != StatusCode::SERVICE_UNAVAILABLE).then_some(s)
        })
        .await;
    assert_eq!(answer, StatusCode::OK);
    assert_eq!(
        shared
            .demand()
            .job(4242)
            .and_then(|j| j.pool.clone())
            .map(|p| p.name),
        Some("nl".to_string()),
        "routed to the pool whose secret signed it"
    );
    h.wait_minted("nl", 1, WAIT).await;
    controller.abort();
    server.abort();
}
