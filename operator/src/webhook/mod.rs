//! The GitHub webhook receiver: `POST /webhooks/github`. A delivery is accepted only with an
//! `X-Hub-Signature-256` made with the global webhook secret or a pool's own; a bad signature answers
//! 401 and changes nothing. Deliveries are de-duplicated by `X-GitHub-Delivery` id and by body digest (a
//! replayed body under a new id is a duplicate). `workflow_job` deliveries update the pools' demand
//! (queued jobs are routed to the pool whose labels contain all of the job's) and wake the pool
//! controller; a delivery changes only jobs of pools that accept the secret that verified it (another
//! tenant's job answers `foreign`). Until the pool controller has read every pool's webhook secret (a
//! new leader's first moments) every delivery answers 503 `not_ready`: a delivery signed with a secret
//! not read yet must not get 401, nor a 2xx that routes it nowhere. Outcomes are counted in
//! `imp_webhook_deliveries_total{result}`.

use std::sync::Arc;
use std::time::Instant;

use axum::{
    Router,
    body::Bytes,
    extract::{DefaultBodyLimit, Path, State},
    http::{HeaderMap, StatusCode},
    routing::post,
};
use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tracing::{debug, info, warn};

use crate::runnerpool::{
    PoolKey, PoolShared,
    demand::{JobState, JobUpdate},
};

/// Path the receiver is mounted at.
pub const WEBHOOK_PATH: &str = "/webhooks/github";
/// One pool's own path: its deliveries are checked against its secret alone (one HMAC), and a
/// flood aimed at one pool costs no other pool's secret a check.
pub const POOL_WEBHOOK_PATH: &str = "/webhooks/github/{namespace}/{pool}";
/// GitHub caps payloads at 25 MB; workflow_job bodies are a few KB.
const MAX_BODY: usize = 1024 * 1024;

/// A router with the receiver, to merge into the operator's HTTP server.
pub fn webhook_router(shared: Arc<PoolShared>) -> Router {
    Router::new()
        .route(WEBHOOK_PATH, post(receive))
        .route(POOL_WEBHOOK_PATH, post(receive_for_pool))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(shared)
}

/// Checks `sha256=<hex>` against the HMAC-SHA256 of `body` in constant time.
pub fn signature_valid(secret: &[u8], body: &[u8], header: &str) -> bool {
    let Some(sig) = header
        .strip_prefix("sha256=")
        .and_then(|h| hex::decode(h.trim()).ok())
    else {
        return false;
    };
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else {
        return false;
    };
    mac.update(body);
    mac.verify_slice(&sig).is_ok()
}

#[derive(Deserialize)]
struct Payload {
    action: String,
    workflow_job: WorkflowJob,
    repository: Repository,
}

#[derive(Deserialize)]
struct WorkflowJob {
    id: u64,
    #[serde(default)]
    run_id: Option<u64>,
    #[serde(default)]
    labels: Vec<String>,
    #[serde(default)]
    runner_name: Option<String>,
    #[serde(default)]
    created_at: Option<String>,
}

#[derive(Deserialize)]
struct Repository {
    full_name: String,
}

/// What became of a delivery (the `result` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryResult {
    Accepted,
    Duplicate,
    BadSignature,
    Unrouted,
    /// Verified, but by a secret the job's pool does not accept: another tenant's job.
    Foreign,
    Ignored,
    Malformed,
    /// The pools' webhook secrets are not all read yet (answered 503, retryable).
    NotReady,
    /// Sent to a pool's own path, but no such pool (or it has no secret to check against).
    UnknownPool,
}

impl DeliveryResult {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryResult::Accepted => "accepted",
            DeliveryResult::Duplicate => "duplicate",
            DeliveryResult::BadSignature => "bad_signature",
            DeliveryResult::Unrouted => "unrouted",
            DeliveryResult::Foreign => "foreign",
            DeliveryResult::Ignored => "ignored",
            DeliveryResult::Malformed => "malformed",
            DeliveryResult::NotReady => "not_ready",
            DeliveryResult::UnknownPool => "unknown_pool",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            DeliveryResult::BadSignature => StatusCode::UNAUTHORIZED,
            DeliveryResult::Malformed => StatusCode::BAD_REQUEST,
            DeliveryResult::NotReady => StatusCode::SERVICE_UNAVAILABLE,
            DeliveryResult::UnknownPool => StatusCode::NOT_FOUND,
            // Unrouted, foreign and ignored deliveries are fine from GitHub's side: no redelivery
            // wanted.
            _ => StatusCode::OK,
        }
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

async fn receive(
    State(shared): State<Arc<PoolShared>>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, &'static str) {
    let result = handle(&shared, None, &headers, &body);
    shared.metrics.delivery(result.as_str());
    (result.status(), result.as_str())
}

async fn receive_for_pool(
    State(shared): State<Arc<PoolShared>>,
    Path((namespace, pool)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, &'static str) {
    let key = PoolKey::new(namespace, pool);
    let result = handle(&shared, Some(&key), &headers, &body);
    shared.metrics.delivery(result.as_str());
    (result.status(), result.as_str())
}

/// Processes one delivery, sent to the shared path (`pool` None) or to a pool's own; pure apart
/// from the shared demand and notifications.
pub fn handle(
    shared: &PoolShared,
    pool: Option<&PoolKey>,
    headers: &HeaderMap,
    body: &[u8],
) -> DeliveryResult {
    let delivery = header(headers, "x-github-delivery").unwrap_or_default();
    if !shared.routes_loaded() {
        info!(
            delivery,
            "webhook before the pools' secrets were read: 503, retry later"
        );
        return DeliveryResult::NotReady;
    }
    let Some(signature) = header(headers, "x-hub-signature-256") else {
        warn!(delivery, "webhook without X-Hub-Signature-256 refused");
        return DeliveryResult::BadSignature;
    };
    let secrets = match pool {
        None => shared.demand().candidate_secrets(),
        Some(key) => match shared.demand().secret_for(key) {
            Some(s) => vec![s],
            None => {
                warn!(delivery, pool = %key, "webhook for an unknown pool refused");
                return DeliveryResult::UnknownPool;
            }
        },
    };
    let Some(signed_with) = secrets.into_iter().find(|s| {
        shared.metrics.webhook_signature_checks.inc();
        signature_valid(s, body, signature)
    }) else {
        warn!(delivery, "webhook with a bad signature refused");
        return DeliveryResult::BadSignature;
    };
    let event = header(headers, "x-github-event").unwrap_or_default();
    if delivery.is_empty() {
        return DeliveryResult::Malformed;
    }
    if event != "workflow_job" {
        debug!(delivery, event, "webhook event ignored");
        return DeliveryResult::Ignored;
    }
    let payload: Payload = match serde_json::from_slice(body) {
        Ok(p) => p,
        Err(e) => {
            warn!(delivery, error = %e, "malformed workflow_job webhook");
            return DeliveryResult::Malformed;
        }
    };
    let Some(state) = JobState::parse(&payload.action) else {
        debug!(delivery, action = %payload.action, "workflow_job action ignored");
        return DeliveryResult::Ignored;
    };
    let now = Instant::now();
    let digest: [u8; 32] = Sha256::digest(body).into();
    let mut d = shared.demand();
    if !d.first_delivery(delivery, digest, now) {
        debug!(delivery, "duplicate delivery");
        return DeliveryResult::Duplicate;
    }
    let known_pool = d.job(payload.workflow_job.id).and_then(|j| j.pool.clone());
    if let Some(pool) = &known_pool
        && !d.accepts(pool, &signed_with)
    {
        warn!(delivery, job_id = payload.workflow_job.id, pool = %pool,
            "workflow_job for another pool's job, signed with a secret that pool does not accept: ignored");
        return DeliveryResult::Foreign;
    }
    let update = JobUpdate {
        id: payload.workflow_job.id,
        state,
        repository: payload.repository.full_name,
        labels: payload.workflow_job.labels,
        runner_name: payload.workflow_job.runner_name,
        run_id: payload.workflow_job.run_id,
        // The delivery's arrival times the step (our clock, to the microsecond).
        since: None,
        created_at: payload
            .workflow_job
            .created_at
            .as_deref()
            .and_then(|t| t.parse().ok()),
    };
    let job_id = update.id;
    let changed = d.observe(update, Some(&signed_with), now);
    let pool = d.job(job_id).and_then(|j| j.pool.clone()).or(known_pool);
    drop(d);
    match pool {
        Some(pool) => {
            info!(delivery, job_id, action = %payload.action, pool = %pool, "workflow_job accepted");
            if let Some(p) = changed {
                shared.notify(p);
            }
            DeliveryResult::Accepted
        }
        None => {
            debug!(delivery, job_id, action = %payload.action, "workflow_job matches no pool");
            DeliveryResult::Unrouted
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::github::{GithubApps, GithubConfig, GithubMetrics, RunnerScope};
    use crate::runnerpool::{
        PoolMetrics,
        demand::{PoolKey, PoolRoute},
    };
    use axum::http::HeaderValue;
    use hmac::Mac;

    fn sign(secret: &[u8], body: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap();
        mac.update(body);
        format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
    }

    /// Shared state whose pool secrets have not been read yet.
    fn unloaded() -> Arc<PoolShared> {
        PoolShared::new(
            Arc::new(GithubApps::new(
                GithubConfig::default(),
                GithubMetrics::default(),
            )),
            PoolMetrics::default(),
        )
    }

    /// Pool ns/p (labels self-hosted + imp, secret `pool-secret`), and the routes marked loaded.
    fn load_pool(s: &PoolShared) {
        s.demand().upsert_pool(
            PoolKey::new("ns", "p"),
            PoolRoute {
                labels: vec!["self-hosted".into(), "imp".into()],
                scope: RunnerScope::org("acme"),
                webhook_secret: Some(b"pool-secret".to_vec()),
            },
        );
        s.mark_routes_loaded();
    }

    fn shared() -> Arc<PoolShared> {
        let s = unloaded();
        load_pool(&s);
        s
    }

    fn body(action: &str, id: u64, labels: &[&str], runner: Option<&str>) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "action": action,
            "workflow_job": {"id": id, "labels": labels, "runner_name": runner, "status": action},
            "repository": {"full_name": "acme/app"},
        }))
        .unwrap()
    }

    fn headers(delivery: &str, event: &str, sig: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "x-github-delivery",
            HeaderValue::from_str(delivery).unwrap(),
        );
        h.insert("x-github-event", HeaderValue::from_str(event).unwrap());
        h.insert("x-hub-signature-256", HeaderValue::from_str(sig).unwrap());
        h
    }

    #[test]
    fn github_signature_test_vector() {
        // GitHub's documented example.
        let sig = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
        assert!(signature_valid(
            b"It's a Secret to Everybody",
            b"Hello, World!",
            sig
        ));
        assert!(!signature_valid(b"wrong", b"Hello, World!", sig));
        assert!(!signature_valid(
            b"It's a Secret to Everybody",
            b"Hello, World!",
            "sha1=757107"
        ));
        assert!(!signature_valid(b"s", b"x", "sha256=zz"));
    }

    #[test]
    fn a_pools_own_path_checks_its_secret_alone() {
        let s = shared();
        let key = PoolKey::new("ns", "p");
        let b = body("queued", 1, &["imp"], None);
        let checks = || s.metrics.webhook_signature_checks.get();
        let unknown = PoolKey::new("ns", "nosuch");
        let good = headers("d1", "workflow_job", &sign(b"pool-secret", &b));
        assert_eq!(
            handle(&s, Some(&unknown), &good, &b),
            DeliveryResult::UnknownPool
        );
        assert_eq!(DeliveryResult::UnknownPool.status(), StatusCode::NOT_FOUND);
        assert_eq!(checks(), 0, "no HMAC for an unknown pool");
        let forged = headers("d1", "workflow_job", &sign(b"nope", &b));
        assert_eq!(
            handle(&s, Some(&key), &forged, &b),
            DeliveryResult::BadSignature
        );
        assert_eq!(checks(), 1);
        assert_eq!(handle(&s, Some(&key), &good, &b), DeliveryResult::Accepted);
        assert_eq!(checks(), 2);
        assert_eq!(s.demand().pool_demand(&key).queued, 1);
    }

    #[test]
    fn deliveries_are_verified_deduplicated_and_routed() {
        let s = shared();
        let key = PoolKey::new("ns", "p");
        let b = body("queued", 1, &["imp"], None);
        // Forged: signed with another secret.
        let r = handle(
            &s,
            None,
            &headers("d1", "workflow_job", &sign(b"nope", &b)),
            &b,
        );
        assert_eq!(r, DeliveryResult::BadSignature);
        assert_eq!(s.demand().pool_demand(&key).queued, 0);
        // A forged delivery does not burn its id.
        let good = headers("d1", "workflow_job", &sign(b"pool-secret", &b));
        assert_eq!(handle(&s, None, &good, &b), DeliveryResult::Accepted);
        assert_eq!(handle(&s, None, &good, &b), DeliveryResult::Duplicate);
        assert_eq!(s.demand().pool_demand(&key).queued, 1);

        let b2 = body("in_progress", 1, &["imp"], Some("p-abc"));
        let h2 = headers("d2", "workflow_job", &sign(b"pool-secret", &b2));
        assert_eq!(handle(&s, None, &h2, &b2), DeliveryResult::Accepted);
        let pd = s.demand().pool_demand(&key);
        assert_eq!(pd.queued, 0);
        assert!(pd.busy_runners.contains("p-abc"));

        let b3 = body("queued", 2, &["gpu"], None);
        let h3 = headers("d3", "workflow_job", &sign(b"pool-secret", &b3));
        assert_eq!(handle(&s, None, &h3, &b3), DeliveryResult::Unrouted);

        let ping = br#"{"zen":"hi"}"#;
        let h4 = headers("d4", "ping", &sign(b"pool-secret", ping));
        assert_eq!(handle(&s, None, &h4, ping), DeliveryResult::Ignored);

        let junk = b"{not json";
        let h5 = headers("d5", "workflow_job", &sign(b"pool-secret", junk));
        assert_eq!(handle(&s, None, &h5, junk), DeliveryResult::Malformed);

        let mut unsigned = headers("d6", "workflow_job", "x");
        unsigned.remove("x-hub-signature-256");
        assert_eq!(
            handle(&s, None, &unsigned, &b),
            DeliveryResult::BadSignature
        );
    }

    #[test]
    fn before_the_secrets_are_read_every_delivery_is_retryable() {
        let s = unloaded();
        let b = body("queued", 1, &["imp"], None);
        let h = headers("early", "workflow_job", &sign(b"pool-secret", &b));
        let r = handle(&s, None, &h, &b);
        assert_eq!(r, DeliveryResult::NotReady);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        // Not burnt as a duplicate: the same delivery is judged once the secrets are known.
        load_pool(&s);
        assert_eq!(handle(&s, None, &h, &b), DeliveryResult::Accepted);
    }

    #[test]
    fn the_global_secret_does_not_reach_pools_with_their_own() {
        let s = shared();
        s.demand().set_global_secret(Some(b"global".to_vec()));
        let b = body("queued", 9, &["imp"], None);
        let h = headers("g1", "workflow_job", &sign(b"global", &b));
        // Signature fine, but the only matching pool has its own secret.
        assert_eq!(handle(&s, None, &h, &b), DeliveryResult::Unrouted);
    }

    #[test]
    fn another_pools_secret_cannot_touch_its_jobs_and_replays_are_duplicates() {
        let s = shared();
        s.demand().upsert_pool(
            PoolKey::new("ns", "other"),
            PoolRoute {
                labels: vec!["self-hosted".into(), "imp".into(), "other".into()],
                scope: RunnerScope::org("acme"),
                webhook_secret: Some(b"other-secret".to_vec()),
            },
        );
        let key = PoolKey::new("ns", "p");
        let b = body("queued", 1, &["imp"], None);
        let h = headers("q1", "workflow_job", &sign(b"pool-secret", &b));
        assert_eq!(handle(&s, None, &h, &b), DeliveryResult::Accepted);
        let done = body("completed", 1, &["imp"], None);
        let h = headers("c1", "workflow_job", &sign(b"other-secret", &done));
        assert_eq!(handle(&s, None, &h, &done), DeliveryResult::Foreign);
        assert_eq!(s.demand().pool_demand(&key).queued, 1);
        // The same body under a new delivery id is a replay.
        let b2 = body("queued", 2, &["imp"], None);
        let h = headers("q2", "workflow_job", &sign(b"pool-secret", &b2));
        assert_eq!(handle(&s, None, &h, &b2), DeliveryResult::Accepted);
        let h = headers("q2-replayed", "workflow_job", &sign(b"pool-secret", &b2));
        assert_eq!(handle(&s, None, &h, &b2), DeliveryResult::Duplicate);
        assert_eq!(s.demand().pool_demand(&key).queued, 2);
    }
}
