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
//!
//! Anyone can POST, and every delivery costs an HMAC over up to [`MAX_BODY`] whatever its
//! signature, so at most [`WebhookLimits::concurrent_checks`] deliveries are read and checked at
//! once (a permit is taken before the body is read: bodies held in memory stay under
//! `concurrent_checks` x [`MAX_BODY`]); the check runs off the async runtime, which the
//! controllers share. A delivery that finds every permit taken for longer than
//! [`WebhookLimits::queue_wait`] answers 503 `busy` with `Retry-After`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::{
    Router,
    body::Bytes,
    extract::{DefaultBodyLimit, Path, Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, header::RETRY_AFTER},
    response::{IntoResponse, Response},
    routing::post,
};
use hmac::{Hmac, Mac};
use prometheus_client::metrics::gauge::Gauge;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
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
pub const MAX_BODY: usize = 1024 * 1024;
/// A delivery still sending its body after this long gives its permit back (408).
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The `Retry-After` of a `busy` answer, in seconds.
const BUSY_RETRY_AFTER_SECS: u64 = 1;

/// How many deliveries are read and checked at once, and how long one waits for its turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WebhookLimits {
    /// Deliveries read and HMAC'd at once (`--webhook-concurrent-checks`).
    pub concurrent_checks: usize,
    /// How long a delivery waits for a permit before it answers 503 `busy`.
    pub queue_wait: Duration,
}

impl Default for WebhookLimits {
    /// 8 checks: 8 MiB of bodies at most, and a few cores' worth of HMACs (a 1 MiB body takes
    /// a few milliseconds), far above GitHub's delivery rate for a fleet.
    fn default() -> Self {
        WebhookLimits {
            concurrent_checks: 8,
            queue_wait: Duration::from_secs(2),
        }
    }
}

/// The bound on signature checks: a permit per check, and the in-flight gauge it keeps.
#[derive(Clone)]
pub struct CheckGate {
    permits: Arc<Semaphore>,
    queue_wait: Duration,
    in_flight: Gauge,
}

/// One delivery's turn to be read and checked; the in-flight gauge drops with it.
pub struct CheckPermit {
    _permit: OwnedSemaphorePermit,
    in_flight: Gauge,
}

impl Drop for CheckPermit {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

impl CheckGate {
    /// `in_flight` is `imp_webhook_signature_checks_in_flight`.
    pub fn new(limits: WebhookLimits, in_flight: Gauge) -> Self {
        CheckGate {
            permits: Arc::new(Semaphore::new(limits.concurrent_checks.max(1))),
            queue_wait: limits.queue_wait,
            in_flight,
        }
    }

    /// A permit, or None when every permit stayed taken for the whole queue wait.
    pub async fn enter(&self) -> Option<CheckPermit> {
        let permit = tokio::time::timeout(self.queue_wait, self.permits.clone().acquire_owned())
            .await
            .ok()?
            .ok()?;
        self.in_flight.inc();
        Some(CheckPermit {
            _permit: permit,
            in_flight: self.in_flight.clone(),
        })
    }
}

#[derive(Clone)]
struct Receiver {
    shared: Arc<PoolShared>,
    gate: CheckGate,
}

/// A router with the receiver and the default [`WebhookLimits`].
pub fn webhook_router(shared: Arc<PoolShared>) -> Router {
    webhook_router_with(shared, WebhookLimits::default())
}

/// A router with the receiver, to merge into the operator's HTTP server.
pub fn webhook_router_with(shared: Arc<PoolShared>, limits: WebhookLimits) -> Router {
    let gate = CheckGate::new(limits, shared.metrics.webhook_checks_in_flight.clone());
    Router::new()
        .route(WEBHOOK_PATH, post(receive))
        .route(POOL_WEBHOOK_PATH, post(receive_for_pool))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(Receiver { shared, gate })
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
    /// Every signature-check permit stayed taken for the queue wait (503 with `Retry-After`).
    Busy,
    /// The body was larger than [`MAX_BODY`] (413).
    TooLarge,
    /// The body did not arrive within the read timeout, or the connection broke (408).
    BodyUnread,
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
            DeliveryResult::Busy => "busy",
            DeliveryResult::TooLarge => "too_large",
            DeliveryResult::BodyUnread => "body_unread",
        }
    }

    /// The HTTP answer: the status, the result as the body, and `Retry-After` when busy.
    pub fn response(self) -> Response {
        let mut r = (self.status(), self.as_str()).into_response();
        if self == DeliveryResult::Busy {
            r.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(BUSY_RETRY_AFTER_SECS));
        }
        r
    }

    fn status(self) -> StatusCode {
        match self {
            DeliveryResult::BadSignature => StatusCode::UNAUTHORIZED,
            DeliveryResult::Malformed => StatusCode::BAD_REQUEST,
            DeliveryResult::NotReady => StatusCode::SERVICE_UNAVAILABLE,
            DeliveryResult::UnknownPool => StatusCode::NOT_FOUND,
            DeliveryResult::Busy => StatusCode::SERVICE_UNAVAILABLE,
            DeliveryResult::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            DeliveryResult::BodyUnread => StatusCode::REQUEST_TIMEOUT,
            // Unrouted, foreign and ignored deliveries are fine from GitHub's side: no redelivery
            // wanted.
            _ => StatusCode::OK,
        }
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

async fn receive(State(r): State<Receiver>, request: Request) -> Response {
    let result = gated(&r, None, request).await;
    r.shared.metrics.delivery(result.as_str());
    result.response()
}

async fn receive_for_pool(
    State(r): State<Receiver>,
    Path((namespace, pool)): Path<(String, String)>,
    request: Request,
) -> Response {
    let key = PoolKey::new(namespace, pool);
    let result = gated(&r, Some(key), request).await;
    r.shared.metrics.delivery(result.as_str());
    result.response()
}

/// Waits for a check permit, then reads the body and runs [`handle`] on a blocking thread.
async fn gated(r: &Receiver, pool: Option<PoolKey>, request: Request) -> DeliveryResult {
    let (parts, body) = request.into_parts();
    let Some(permit) = r.gate.enter().await else {
        let delivery = header(&parts.headers, "x-github-delivery").unwrap_or_default();
        warn!(
            delivery,
            "webhook signature checks saturated: 503, retry later"
        );
        return DeliveryResult::Busy;
    };
    let body: Bytes =
        match tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, MAX_BODY)).await {
            Ok(Ok(b)) => b,
            Ok(Err(e)) if is_length_limit(&e) => return DeliveryResult::TooLarge,
            Ok(Err(_)) | Err(_) => return DeliveryResult::BodyUnread,
        };
    let shared = r.shared.clone();
    let headers = parts.headers;
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        handle(&shared, pool.as_ref(), &headers, &body)
    })
    .await
    // Only a panic in `handle` gets here; the demand is unchanged unless it panicked midway.
    .unwrap_or(DeliveryResult::Malformed)
}

/// Whether reading the body failed on the length limit (rather than the connection).
fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
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
    // Which webhook sent it: on the shared path, the secret that verified this hook before is
    // tried first (one HMAC for a known hook).
    let hook = header(headers, "x-github-hook-id").and_then(|h| h.parse::<u64>().ok());
    let secrets = match pool {
        None => shared.demand().candidate_secrets_for(hook),
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
    if pool.is_none()
        && let Some(hook) = hook
    {
        shared.demand().learn_hook(hook, &signed_with);
    }
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

    #[tokio::test]
    async fn the_gate_admits_its_bound_and_answers_busy_past_the_wait() {
        let in_flight = Gauge::default();
        let limits = WebhookLimits {
            concurrent_checks: 2,
            queue_wait: Duration::from_millis(200),
        };
        let gate = CheckGate::new(limits, in_flight.clone());
        let a = gate.enter().await.expect("first permit");
        let b = gate.enter().await.expect("second permit");
        assert_eq!(in_flight.get(), 2);
        // Saturated past the wait: no permit, nothing counted in flight.
        assert!(gate.enter().await.is_none());
        assert_eq!(in_flight.get(), 2);
        // A permit freed within the wait goes to the waiter.
        let waiter = tokio::spawn({
            let gate = gate.clone();
            async move { gate.enter().await.is_some() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(a);
        assert!(waiter.await.unwrap());
        assert_eq!(
            in_flight.get(),
            1,
            "the waiter's permit was dropped with its task"
        );
        drop(b);
        assert_eq!(in_flight.get(), 0);
    }

    #[test]
    fn busy_answers_503_with_retry_after_and_others_do_not() {
        let busy = DeliveryResult::Busy.response();
        assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(busy.headers()[RETRY_AFTER], "1");
        let not_ready = DeliveryResult::NotReady.response();
        assert_eq!(not_ready.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(not_ready.headers().get(RETRY_AFTER).is_none());
        assert_eq!(
            DeliveryResult::TooLarge.response().status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused_before_any_hmac() {
        let s = shared();
        let r = Receiver {
            gate: CheckGate::new(WebhookLimits::default(), Gauge::default()),
            shared: s.clone(),
        };
        let big = vec![b' '; MAX_BODY + 1];
        let req = axum::http::Request::post(WEBHOOK_PATH)
            .header("x-github-delivery", "big")
            .header("x-hub-signature-256", sign(b"pool-secret", &big))
            .body(axum::body::Body::from(big))
            .unwrap();
        assert_eq!(gated(&r, None, req).await, DeliveryResult::TooLarge);
        assert_eq!(s.metrics.webhook_signature_checks.get(), 0);
        let b = body("queued", 1, &["imp"], None);
        let req = axum::http::Request::post(WEBHOOK_PATH)
            .header("x-github-delivery", "small")
            .header("x-github-event", "workflow_job")
            .header("x-hub-signature-256", sign(b"pool-secret", &b))
            .body(axum::body::Body::from(b))
            .unwrap();
        assert_eq!(gated(&r, None, req).await, DeliveryResult::Accepted);
        assert_eq!(r.gate.in_flight.get(), 0, "the permit is given back");
    }
}
