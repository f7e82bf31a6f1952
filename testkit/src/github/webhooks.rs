//! `workflow_job` webhooks: payloads shaped like GitHub's (see
//! reference/github/webhooks/), HMAC-SHA256 signing, an ordered delivery worker that applies
//! webhook faults, and [`WebhookSink`], a capturing receiver for tests.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use hmac::{Hmac, Mac};
use http::Method;
use serde_json::Value;
use sha2::Sha256;
use tokio::sync::mpsc;

use super::http::HttpClient;
use super::model::{Delivery, WebhookFault};
use super::payload::HookEvent;
use super::shared::Shared;

/// `sha256=<hex>` HMAC of `body` with `secret`, as in `X-Hub-Signature-256`.
pub fn sign_body(secret: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

/// Checks an `X-Hub-Signature-256` value in constant time.
pub fn verify_signature(secret: &str, body: &[u8], header: &str) -> bool {
    let Some(hex_sig) = header.strip_prefix("sha256=") else {
        return false;
    };
    let Ok(sig) = hex::decode(hex_sig) else {
        return false;
    };
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(body);
    mac.verify_slice(&sig).is_ok()
}

struct Prepared {
    delivery_id: String,
    action: String,
    job_id: u64,
    body: Vec<u8>,
}

/// The delivery worker: sends events in order, applying webhook faults.
pub(crate) async fn delivery_worker(
    shared: Arc<Shared>,
    mut rx: mpsc::UnboundedReceiver<HookEvent>,
) {
    let client = HttpClient::new(Duration::from_secs(5));
    let mut held: Option<Prepared> = None;
    loop {
        let next = if held.is_some() {
            match tokio::time::timeout(Duration::from_millis(500), rx.recv()).await {
                Ok(ev) => ev,
                Err(_) => {
                    // Nothing followed a reordered delivery: release it rather than lose it.
                    if let Some(p) = held.take() {
                        send(&shared, &client, &p).await;
                    }
                    continue;
                }
            }
        } else {
            rx.recv().await
        };
        let Some(ev) = next else { break };
        let prepared = Prepared {
            delivery_id: uuid::Uuid::new_v4().to_string(),
            action: ev.action,
            job_id: ev.job_id,
            body: serde_json::to_vec(&ev.payload).expect("payload serializes"),
        };
        let fault = shared.model().take_webhook_fault();
        match fault {
            Some(WebhookFault::Drop) => {
                tracing::info!(job_id = prepared.job_id, action = %prepared.action, "github-sim: dropping webhook (fault)");
                record(&shared, &prepared, "dropped".into(), None);
            }
            Some(WebhookFault::Duplicate) => {
                send(&shared, &client, &prepared).await;
                send(&shared, &client, &prepared).await;
            }
            Some(WebhookFault::Reorder) => {
                if let Some(p) = held.take() {
                    send(&shared, &client, &p).await;
                }
                held = Some(prepared);
                continue;
            }
            None => send(&shared, &client, &prepared).await,
        }
        if let Some(p) = held.take() {
            send(&shared, &client, &p).await;
        }
    }
    if let Some(p) = held.take() {
        send(&shared, &client, &p).await;
    }
}

fn record(shared: &Shared, p: &Prepared, outcome: String, status: Option<u16>) {
    shared.model().deliveries.push(Delivery {
        delivery_id: p.delivery_id.clone(),
        event: "workflow_job".into(),
        action: p.action.clone(),
        job_id: p.job_id,
        outcome,
        status,
    });
}

async fn send(shared: &Shared, client: &HttpClient, p: &Prepared) {
    let target = shared.model().webhook.clone();
    let Some((url, secret)) = target else {
        record(shared, p, "no-url".into(), None);
        return;
    };
    let headers = [
        ("x-github-event", "workflow_job".to_string()),
        ("x-github-delivery", p.delivery_id.clone()),
        ("x-github-hook-id", "424242".to_string()),
        (
            "x-github-hook-installation-target-type",
            "integration".to_string(),
        ),
        (
            "x-github-hook-installation-target-id",
            shared.config.app_id.to_string(),
        ),
        ("x-hub-signature-256", sign_body(&secret, &p.body)),
        ("user-agent", "GitHub-Hookshot/imp-sim".to_string()),
        ("content-type", "application/json".to_string()),
    ];
    match client
        .send(Method::POST, &url, &headers, Some(p.body.clone().into()))
        .await
    {
        Ok(resp) => record(shared, p, "delivered".into(), Some(resp.status.as_u16())),
        Err(e) => record(shared, p, format!("failed: {e}"), None),
    }
}

/// One webhook received by a [`WebhookSink`].
#[derive(Debug, Clone)]
pub struct ReceivedHook {
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl ReceivedHook {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// `workflow_job.id` and `action`.
    pub fn job_action(&self) -> (u64, String) {
        let v = self.json();
        (
            v["workflow_job"]["id"].as_u64().unwrap_or_default(),
            v["action"].as_str().unwrap_or_default().to_string(),
        )
    }
}

/// A webhook receiver on 127.0.0.1 that records every request (answers 200).
pub struct WebhookSink {
    url: String,
    received: Arc<Mutex<Vec<ReceivedHook>>>,
    task: tokio::task::JoinHandle<()>,
}

impl WebhookSink {
    pub async fn start() -> anyhow::Result<Self> {
        let received: Arc<Mutex<Vec<ReceivedHook>>> = Arc::default();
        let app = Router::new()
            .route("/{*path}", post(sink))
            .with_state(received.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/webhooks/github", listener.local_addr()?);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(WebhookSink {
            url,
            received,
            task,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn received(&self) -> Vec<ReceivedHook> {
        self.received.lock().expect("sink lock").clone()
    }

    /// Waits until at least `n` hooks arrived (or `timeout`), then returns all received.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> Vec<ReceivedHook> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let got = self.received();
            if got.len() >= n || tokio::time::Instant::now() >= deadline {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for WebhookSink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn sink(
    State(received): State<Arc<Mutex<Vec<ReceivedHook>>>>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    received
        .lock()
        .expect("sink lock")
        .push(ReceivedHook { headers, body });
    StatusCode::OK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_roundtrip() {
        let sig = sign_body("It's a Secret to Everybody", b"Hello, World!");
        // GitHub's documented test vector.
        assert_eq!(
            sig,
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
        );
        assert!(verify_signature(
            "It's a Secret to Everybody",
            b"Hello, World!",
            &sig
        ));
        assert!(!verify_signature("wrong", b"Hello, World!", &sig));
        assert!(!verify_signature(
            "It's a Secret to Everybody",
            b"Hello, World?",
            &sig
        ));
    }
}
