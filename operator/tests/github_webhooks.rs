//! Webhook faults of the simulator: dropped, duplicated (same delivery id) and reordered
//! deliveries, through both the handle and the admin HTTP API.

mod github_common;

use std::time::Duration;

use github_common::*;
use imp_testkit::github::{JobSpec, WebhookFault, WebhookSink};

fn job(labels: &[&str]) -> JobSpec {
    JobSpec {
        labels: labels.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn dropped_webhooks_never_arrive() {
    let sink = WebhookSink::start().await.unwrap();
    let sim = sim().await;
    sim.set_webhook(sink.url(), "s");
    sim.inject_webhook_fault(WebhookFault::Drop, 1);
    let a = sim.queue_job(job(&["imp"]));
    let b = sim.queue_job(job(&["imp"]));
    let got = sink.wait_for(1, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ids: Vec<u64> = sink.received().iter().map(|h| h.job_action().0).collect();
    assert_eq!(ids, vec![b.id], "{got:?}");
    let d = sim.deliveries();
    assert_eq!(
        d.iter().find(|d| d.job_id == a.id).unwrap().outcome,
        "dropped"
    );
    // The job itself exists: a sweep of queued jobs would still find it.
    assert!(sim.job(a.id).is_some());
}

#[tokio::test]
async fn duplicated_webhooks_share_the_delivery_id() {
    let sink = WebhookSink::start().await.unwrap();
    let sim = sim().await;
    sim.admin().set_webhook(sink.url(), "s").await.unwrap();
    sim.admin()
        .inject_webhook_fault(WebhookFault::Duplicate, 1)
        .await
        .unwrap();
    let a = sim.admin().queue_job(&job(&["imp"])).await.unwrap();
    let got = sink.wait_for(2, Duration::from_secs(5)).await;
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].job_action(), (a.id, "queued".into()));
    assert_eq!(
        got[0].header("x-github-delivery"),
        got[1].header("x-github-delivery")
    );
    assert_eq!(got[0].body, got[1].body);
    assert_eq!(sim.admin().deliveries().await.unwrap().len(), 2);
    assert_eq!(sim.admin().job(a.id).await.unwrap().id, a.id);
}

#[tokio::test]
async fn reordered_webhooks_arrive_after_the_next_one() {
    let sink = WebhookSink::start().await.unwrap();
    let sim = sim().await;
    sim.set_webhook(sink.url(), "s");
    sim.inject_webhook_fault(WebhookFault::Reorder, 1);
    let a = sim.queue_job(job(&["imp"]));
    let b = sim.queue_job(job(&["imp"]));
    let got = sink.wait_for(2, Duration::from_secs(5)).await;
    let ids: Vec<u64> = got.iter().map(|h| h.job_action().0).collect();
    assert_eq!(ids, vec![b.id, a.id]);
    // A reordered delivery with nothing after it is still delivered, late.
    sim.inject_webhook_fault(WebhookFault::Reorder, 1);
    let c = sim.queue_job(job(&["imp"]));
    let got = sink.wait_for(3, Duration::from_secs(5)).await;
    assert_eq!(got[2].job_action().0, c.id);
}
