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
use serde_json::{Value, json};
use sha2::Sha256;
use tokio::sync::mpsc;

use super::Shared;
use super::http::HttpClient;
use super::jobs::{JobStatus, SimJob};
use super::model::{Delivery, WebhookFault};

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

fn user(login: &str, id: u64, kind: &str) -> Value {
    json!({
        "login": login,
        "id": id,
        "node_id": format!("MDQ6VXNlcj{id}"),
        "avatar_url": format!("https://avatars.githubusercontent.com/u/{id}?v=4"),
        "gravatar_id": "",
        "url": format!("https://api.github.com/users/{login}"),
        "html_url": format!("https://github.com/{login}"),
        "type": kind,
        "site_admin": false,
    })
}

/// The `workflow_job` webhook body for `job` with `action` (queued, in_progress, completed).
pub fn workflow_job_payload(job: &SimJob, action: &str, org: &str, installation_id: u64) -> Value {
    let (owner, repo) = job
        .repository
        .split_once('/')
        .unwrap_or((org, &job.repository));
    let api = format!("https://api.github.com/repos/{}", job.repository);
    let html = format!("https://github.com/{}", job.repository);
    let ts = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map(|t| Value::String(t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)))
            .unwrap_or(Value::Null)
    };
    let status = match job.status {
        JobStatus::Queued => "queued",
        JobStatus::InProgress => "in_progress",
        JobStatus::Completed => "completed",
    };
    let steps = match job.status {
        JobStatus::Queued => json!([]),
        JobStatus::InProgress => json!([{
            "name": "Set up job", "status": "in_progress", "conclusion": null, "number": 1,
            "started_at": ts(job.started_at), "completed_at": null,
        }]),
        JobStatus::Completed => json!([{
            "name": "Set up job", "status": "completed", "conclusion": job.conclusion, "number": 1,
            "started_at": ts(job.started_at), "completed_at": ts(job.completed_at),
        }]),
    };
    let repo_id = 186_853_002u64;
    let mut body = json!({
        "action": action,
        "workflow_job": {
            "id": job.id,
            "run_id": job.run_id,
            "run_url": format!("{api}/actions/runs/{}", job.run_id),
            "run_attempt": 1,
            "node_id": format!("CR_kwDO{}", job.id),
            "head_sha": job.head_sha,
            "head_branch": job.head_branch,
            "url": format!("{api}/actions/jobs/{}", job.id),
            "html_url": format!("{html}/actions/runs/{}/job/{}", job.run_id, job.id),
            "status": status,
            "conclusion": job.conclusion,
            "started_at": ts(job.started_at.or(Some(job.created_at))),
            "created_at": ts(Some(job.created_at)),
            "completed_at": ts(job.completed_at),
            "name": job.name,
            "steps": steps,
            "check_run_url": format!("{api}/check-runs/{}", job.id),
            "labels": job.labels,
            "runner_id": job.runner_id,
            "runner_name": job.runner_name,
            "runner_group_id": job.runner_group_id,
            "runner_group_name": job.runner_group_name,
            "workflow_name": job.workflow_name,
        },
        "repository": {
            "id": repo_id,
            "node_id": "MDEwOlJlcG9zaXRvcnkxODY4NTMwMDI=",
            "name": repo,
            "full_name": job.repository,
            "private": true,
            "owner": user(owner, 38_302_899, "Organization"),
            "html_url": html,
            "description": null,
            "fork": false,
            "url": api,
            "created_at": "2019-05-15T15:19:25Z",
            "updated_at": "2019-05-15T15:19:27Z",
            "pushed_at": "2019-05-15T15:20:32Z",
            "git_url": format!("git://github.com/{}.git", job.repository),
            "ssh_url": format!("git@github.com:{}.git", job.repository),
            "clone_url": format!("{html}.git"),
            "default_branch": "main",
            "visibility": "private",
            "archived": false,
            "disabled": false,
        },
        "sender": user("octocat", 21_031_067, "User"),
        "installation": {
            "id": installation_id,
            "node_id": format!("MDIzOkludGVncmF0aW9uSW5zdGFsbGF0aW9u{installation_id}"),
        },
    });
    if owner == org {
        body["organization"] = json!({
            "login": org,
            "id": 38_302_899,
            "node_id": "MDEyOk9yZ2FuaXphdGlvbjM4MzAyODk5",
            "url": format!("https://api.github.com/orgs/{org}"),
            "repos_url": format!("https://api.github.com/orgs/{org}/repos"),
            "events_url": format!("https://api.github.com/orgs/{org}/events"),
            "hooks_url": format!("https://api.github.com/orgs/{org}/hooks"),
            "issues_url": format!("https://api.github.com/orgs/{org}/issues"),
            "members_url": format!("https://api.github.com/orgs/{org}/members{{/member}}"),
            "public_members_url": format!("https://api.github.com/orgs/{org}/public_members{{/member}}"),
            "avatar_url": "https://avatars.githubusercontent.com/u/38302899?v=4",
            "description": "",
        });
    }
    body
}

/// One webhook to deliver, in order.
pub(crate) struct HookEvent {
    pub action: String,
    pub job_id: u64,
    pub payload: Value,
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
