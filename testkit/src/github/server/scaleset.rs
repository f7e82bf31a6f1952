//! The simulator's scale-set endpoints (../scaleset.rs holds the state): the runner-registration
//! exchange, the Actions service (runner groups, scale sets, sessions, acquire, generatejitconfig)
//! and the message queue. The REST registration token is in `server.rs` (behind the REST layer).

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use chrono::Utc;
use serde::Deserialize;
use serde_json::{Value, json};

use super::super::jobs::random_token;
use super::super::model::SimScope;
use super::super::registry::register_runner;
use super::super::scaleset::{
    HEADER_MAX_CAPACITY, MESSAGE_TYPE_JOB_MESSAGES, ScaleSetRefusal, ScaleSetSession, ScaleSets,
    SimScaleSet,
};
use super::super::shared::Shared;

type S = State<Arc<Shared>>;

fn refusal(status: StatusCode, exception: &str, message: String) -> Response {
    (
        status,
        Json(json!({ "typeName": exception, "message": message, "errorCode": 0 })),
    )
        .into_response()
}

fn refused(r: ScaleSetRefusal, set_id: u64) -> Response {
    match r {
        ScaleSetRefusal::NotFound => refusal(
            StatusCode::NOT_FOUND,
            "RunnerScaleSetNotFoundException",
            format!("Runner scale set {set_id} not found."),
        ),
        ScaleSetRefusal::Conflict { owner } => refusal(
            StatusCode::CONFLICT,
            "RunnerScaleSetSessionConflictException",
            format!(
                "The runner scale set {set_id} already has an active session for owner {owner}."
            ),
        ),
        ScaleSetRefusal::Unauthorized => refusal(
            StatusCode::UNAUTHORIZED,
            "UnauthorizedException",
            "The message queue token is not valid for this session.".into(),
        ),
    }
}

fn bearer(headers: &HeaderMap, scheme: &str) -> Option<String> {
    let v = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (s, rest) = v.split_once(' ')?;
    s.eq_ignore_ascii_case(scheme)
        .then(|| rest.trim().to_string())
}

/// The admin token's scope, or 401.
#[allow(clippy::result_large_err)] // the refusal is the handler's answer as it stands
fn admin_scope(shared: &Shared, headers: &HeaderMap) -> Result<SimScope, Response> {
    let unauthorized = || {
        refusal(
            StatusCode::UNAUTHORIZED,
            "UnauthorizedException",
            "The admin token is missing, unknown or expired.".into(),
        )
    };
    let token = bearer(headers, "Bearer").ok_or_else(unauthorized)?;
    let ss = shared.scalesets();
    match ss.admin_tokens.get(&token) {
        Some((scope, exp)) if *exp > Utc::now() => Ok(scope.clone()),
        _ => Err(unauthorized()),
    }
}

/// Routes of the runner-registration exchange, the Actions service and the message queue.
pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/actions/runner-registration", post(runner_registration))
        .route("/_actions/_apis/runtime/runnergroups/", get(runner_groups))
        .route("/_actions/_apis/runtime/runnergroups", get(runner_groups))
        .route(
            "/_actions/_apis/runtime/runnerscalesets",
            get(get_scale_sets).post(create_scale_set),
        )
        .route(
            "/_actions/_apis/runtime/runnerscalesets/{id}",
            get(get_scale_set),
        )
        .route(
            "/_actions/_apis/runtime/runnerscalesets/{id}/sessions",
            post(create_session),
        )
        .route(
            "/_actions/_apis/runtime/runnerscalesets/{id}/sessions/{session}",
            delete(delete_session).patch(refresh_session),
        )
        .route(
            "/_actions/_apis/runtime/runnerscalesets/{id}/acquirejobs",
            post(acquire_jobs),
        )
        .route(
            "/_actions/_apis/runtime/runnerscalesets/{id}/generatejitconfig",
            post(generate_jit_config),
        )
        .route("/_actions/queues/{id}/messages", get(poll_messages))
        .route(
            "/_actions/queues/{id}/messages/{message}",
            delete(delete_message),
        )
        .route("/_admin/scalesets", get(admin_scale_sets))
}

#[derive(Deserialize)]
struct RegistrationBody {
    url: String,
    runner_event: String,
}

async fn runner_registration(
    State(shared): S,
    headers: HeaderMap,
    Json(body): Json<RegistrationBody>,
) -> Response {
    let unauthorized = || {
        refusal(
            StatusCode::UNAUTHORIZED,
            "UnauthorizedException",
            "Registration token missing, unknown or expired.".into(),
        )
    };
    let Some(token) = bearer(&headers, "RemoteAuth") else {
        return unauthorized();
    };
    let mut ss = shared.scalesets();
    let Some((scope, exp)) = ss.registration_tokens.get(&token).cloned() else {
        return unauthorized();
    };
    if exp <= Utc::now() {
        return unauthorized();
    }
    let expected = match &scope {
        SimScope::Organization(o) => o.clone(),
        SimScope::Repository(r) => r.clone(),
    };
    let url_path = body
        .url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split_once('/'))
        .map(|(_, p)| p.trim_end_matches('/').to_string())
        .unwrap_or_default();
    if body.runner_event != "register" || !url_path.eq_ignore_ascii_case(&expected) {
        return refusal(
            StatusCode::BAD_REQUEST,
            "ArgumentException",
            format!(
                "url {} does not match the registration token's scope",
                body.url
            ),
        );
    }
    let admin = format!("eyJ0eXAiOiJKV1QifQ.{}.sig", random_token(40));
    let ttl = chrono::Duration::from_std(shared.config.token_ttl).unwrap_or_default();
    ss.admin_tokens
        .insert(admin.clone(), (scope, Utc::now() + ttl));
    ss.stats.admin_connections += 1;
    Json(json!({ "url": format!("{}/_actions/", shared.base_url), "token": admin })).into_response()
}

#[derive(Deserialize)]
struct GroupQuery {
    #[serde(rename = "groupName")]
    group_name: Option<String>,
}

async fn runner_groups(
    State(shared): S,
    Query(q): Query<GroupQuery>,
    headers: HeaderMap,
) -> Result<Response, Response> {
    admin_scope(&shared, &headers)?;
    let m = shared.model();
    let groups: Vec<Value> = m
        .groups
        .iter()
        .filter(|g| {
            q.group_name
                .as_deref()
                .is_none_or(|n| g.name.eq_ignore_ascii_case(n))
        })
        .map(|g| json!({ "id": g.id, "name": g.name, "size": 0, "isDefaultGroup": g.default }))
        .collect();
    Ok(Json(json!({ "count": groups.len(), "value": groups })).into_response())
}

fn scale_set_json(shared: &Shared, s: &SimScaleSet, stats: Value) -> Value {
    json!({
        "id": s.id,
        "name": s.name,
        "runnerGroupId": s.runner_group_id,
        "runnerGroupName": s.runner_group_name,
        "labels": s.labels.iter().map(|l| json!({"type": "System", "name": l})).collect::<Vec<_>>(),
        "RunnerSetting": {},
        "runnerJitConfigUrl": format!(
            "{}/_actions/_apis/runtime/runnerscalesets/{}/generatejitconfig", shared.base_url, s.id),
        "statistics": stats,
    })
}

#[derive(Deserialize)]
struct NameQuery {
    name: Option<String>,
}

async fn get_scale_sets(
    State(shared): S,
    Query(q): Query<NameQuery>,
    headers: HeaderMap,
) -> Result<Response, Response> {
    let scope = admin_scope(&shared, &headers)?;
    let ss = shared.scalesets();
    let sets: Vec<Value> = ss
        .sets
        .values()
        .filter(|s| s.scope == scope)
        .filter(|s| {
            q.name
                .as_deref()
                .is_none_or(|n| s.name.eq_ignore_ascii_case(n))
        })
        .map(|s| scale_set_json(&shared, s, ss.statistics(s.id)))
        .collect();
    Ok(Json(json!({ "count": sets.len(), "value": sets })).into_response())
}

async fn get_scale_set(
    State(shared): S,
    Path(id): Path<u64>,
    headers: HeaderMap,
) -> Result<Response, Response> {
    let scope = admin_scope(&shared, &headers)?;
    let ss = shared.scalesets();
    match ss.sets.get(&id).filter(|s| s.scope == scope) {
        Some(s) => Ok(Json(scale_set_json(&shared, s, ss.statistics(id))).into_response()),
        None => Err(refused(ScaleSetRefusal::NotFound, id)),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CreateBody {
    name: String,
    runner_group_id: u64,
    #[serde(default)]
    labels: Vec<LabelBody>,
}

#[derive(Deserialize)]
struct LabelBody {
    name: String,
}

async fn create_scale_set(
    State(shared): S,
    headers: HeaderMap,
    Json(body): Json<CreateBody>,
) -> Result<Response, Response> {
    let scope = admin_scope(&shared, &headers)?;
    if body.name.is_empty() || body.name.len() > 45 {
        return Err(refusal(
            StatusCode::BAD_REQUEST,
            "ArgumentException",
            "name must be between 1 and 45 characters".into(),
        ));
    }
    let group = shared
        .model()
        .groups
        .iter()
        .find(|g| g.id == body.runner_group_id)
        .cloned();
    let Some(group) = group else {
        return Err(refusal(
            StatusCode::NOT_FOUND,
            "RunnerGroupNotFoundException",
            format!("Runner group {} not found.", body.runner_group_id),
        ));
    };
    let labels: Vec<String> = body.labels.into_iter().map(|l| l.name).collect();
    let mut ss = shared.scalesets();
    let created = ss
        .create(scope, &body.name, (group.id, group.name), &labels)
        .cloned();
    match created {
        Some(s) => Ok(Json(scale_set_json(&shared, &s, ss.statistics(s.id))).into_response()),
        None => Err(refusal(
            StatusCode::CONFLICT,
            "RunnerScaleSetExistsException",
            format!("A runner scale set named {} already exists.", body.name),
        )),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SessionBody {
    owner_name: String,
}

async fn create_session(
    State(shared): S,
    Path(id): Path<u64>,
    headers: HeaderMap,
    Json(body): Json<SessionBody>,
) -> Result<Response, Response> {
    let scope = admin_scope(&shared, &headers)?;
    let mut ss = shared.scalesets();
    if ss.sets.get(&id).is_none_or(|s| s.scope != scope) {
        return Err(refused(ScaleSetRefusal::NotFound, id));
    }
    let session = ss
        .create_session(id, &body.owner_name, Utc::now())
        .map_err(|r| refused(r, id))?;
    Ok(session_json(&shared, &ss, id, &session))
}

/// A session as GitHub answers its creation or refresh: the set, the queue and its token.
fn session_json(shared: &Shared, ss: &ScaleSets, id: u64, session: &ScaleSetSession) -> Response {
    let set = ss.sets.get(&id).expect("the session's set");
    let stats = ss.statistics(id);
    Json(json!({
        "sessionId": session.id,
        "ownerName": session.owner,
        "runnerScaleSet": scale_set_json(shared, set, stats.clone()),
        "messageQueueUrl": format!("{}/_actions/queues/{id}/messages", shared.base_url),
        "messageQueueAccessToken": session.queue_token,
        "statistics": stats,
    }))
    .into_response()
}

fn session_not_found(session: &str) -> Response {
    refusal(
        StatusCode::NOT_FOUND,
        "RunnerScaleSetSessionNotFoundException",
        format!("Session {session} not found."),
    )
}

async fn delete_session(
    State(shared): S,
    Path((id, session)): Path<(u64, String)>,
    headers: HeaderMap,
) -> Result<Response, Response> {
    admin_scope(&shared, &headers)?;
    if shared.scalesets().delete_session(id, &session) {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(session_not_found(&session))
    }
}

/// `PATCH .../sessions/{id}`: the session with a new queue token (admin token).
async fn refresh_session(
    State(shared): S,
    Path((id, session)): Path<(u64, String)>,
    headers: HeaderMap,
) -> Result<Response, Response> {
    admin_scope(&shared, &headers)?;
    let mut ss = shared.scalesets();
    let refreshed = ss
        .refresh_session(id, &session, Utc::now())
        .map_err(|_| session_not_found(&session))?;
    Ok(session_json(&shared, &ss, id, &refreshed))
}

#[derive(Deserialize)]
struct PollQuery {
    #[serde(rename = "lastMessageId")]
    last_message_id: Option<u64>,
}

async fn poll_messages(
    State(shared): S,
    Path(id): Path<u64>,
    Query(q): Query<PollQuery>,
    headers: HeaderMap,
) -> Response {
    let Some(token) = bearer(&headers, "Bearer") else {
        return refused(ScaleSetRefusal::Unauthorized, id);
    };
    let capacity = headers
        .get(HEADER_MAX_CAPACITY)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u32>().ok());
    let last = q.last_message_id.unwrap_or(0);
    let (wake, timeout) = {
        let mut ss = shared.scalesets();
        ss.stats.polls += 1;
        (ss.wake.clone(), ss.poll_timeout)
    };
    // A deaf broker: the poll hangs (the listener's own deadline ends it) until it hears again.
    while shared.scalesets().deaf {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        // Registered before the check so a message pushed in between still wakes this poll.
        let notified = wake.notified();
        let found = shared
            .scalesets()
            .poll(id, &token, last, capacity, Utc::now());
        match found {
            Err(r) => return refused(r, id),
            Ok(Some(d)) => {
                return Json(json!({
                    "messageId": d.message_id,
                    "messageType": MESSAGE_TYPE_JOB_MESSAGES,
                    "body": serde_json::to_string(&d.jobs).expect("json"),
                    "statistics": d.statistics,
                }))
                .into_response();
            }
            Ok(None) => {}
        }
        // Wake at least every second: the session must not expire under a waiting poll.
        let step = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .min(Duration::from_secs(1));
        if step.is_zero() {
            shared.scalesets().stats.empty_polls += 1;
            return StatusCode::ACCEPTED.into_response();
        }
        let _ = tokio::time::timeout(step, notified).await;
    }
}

async fn delete_message(
    State(shared): S,
    Path((id, message)): Path<(u64, u64)>,
    headers: HeaderMap,
) -> Response {
    let Some(token) = bearer(&headers, "Bearer") else {
        return refused(ScaleSetRefusal::Unauthorized, id);
    };
    if shared.scalesets().hold_ack(id, message) {
        return held_ack(&shared, id, &token).await;
    }
    let mut ss = shared.scalesets();
    if ss.failing_acks > 0 {
        ss.failing_acks -= 1;
        return refusal(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerErrorException",
            "injected: the message was not deleted".into(),
        );
    }
    match ss.delete_message(id, &token, message, Utc::now()) {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => refused(r, id),
    }
}

/// Counts a held ack discarded once, whether its handler ends (the session is gone) or is dropped
/// (the connection closed under it).
struct Discard(Arc<Shared>);

impl Drop for Discard {
    fn drop(&mut self) {
        self.0.scalesets().stats.acks_discarded += 1;
    }
}

/// A held ack: no answer while the listener's session lives; the message stays undeleted.
async fn held_ack(shared: &Arc<Shared>, id: u64, token: &str) -> Response {
    let _discard = Discard(shared.clone());
    while shared.scalesets().session_live(id, token, Utc::now()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    refused(ScaleSetRefusal::Unauthorized, id)
}

async fn acquire_jobs(
    State(shared): S,
    Path(id): Path<u64>,
    headers: HeaderMap,
    Json(ids): Json<Vec<i64>>,
) -> Response {
    let Some(token) = bearer(&headers, "Bearer") else {
        return refused(ScaleSetRefusal::Unauthorized, id);
    };
    // The model first, then the scale sets (the order every holder of both keeps).
    let m = shared.model();
    let acquired = shared
        .scalesets()
        .acquire(id, &token, &ids, &m.jobs, Utc::now());
    match acquired {
        Ok(acquired) => Json(json!({ "count": acquired.len(), "value": acquired })).into_response(),
        Err(r) => refused(r, id),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JitBody {
    name: String,
    #[serde(default)]
    work_folder: Option<String>,
}

async fn generate_jit_config(
    State(shared): S,
    Path(id): Path<u64>,
    headers: HeaderMap,
    Json(body): Json<JitBody>,
) -> Result<Response, Response> {
    let scope = admin_scope(&shared, &headers)?;
    let set = shared
        .scalesets()
        .sets
        .get(&id)
        .filter(|s| s.scope == scope)
        .cloned()
        .ok_or_else(|| refused(ScaleSetRefusal::NotFound, id))?;
    let work_folder = body.work_folder.unwrap_or_else(|| "_work".into());
    let mut m = shared.model();
    let (runner, encoded) = register_runner(
        &mut m,
        shared.runner_url(),
        scope,
        &body.name,
        set.runner_group_id,
        &set.labels,
        &work_folder,
    )
    .map_err(|name| {
        refusal(
            StatusCode::CONFLICT,
            "AgentExistsException",
            format!("A runner with the name {name} already exists."),
        )
    })?;
    shared.scalesets().register_runner(id, runner.id);
    Ok(Json(json!({
        "runner": { "id": runner.id, "name": runner.name, "runnerScaleSetId": id },
        "encodedJITConfig": encoded,
    }))
    .into_response())
}

async fn admin_scale_sets(State(shared): S) -> Response {
    let ss = shared.scalesets();
    Json(json!({
        "sets": ss.sets.values().collect::<Vec<_>>(),
        "jobs": ss.jobs.values().collect::<Vec<_>>(),
        "stats": ss.stats,
    }))
    .into_response()
}
