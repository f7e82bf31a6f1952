//! The simulator's HTTP surface: GitHub REST endpoints (behind the fault/rate-limit layer), the
//! runner protocol (`/_runner/...`) and the admin API (`/_admin/...`).

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use chrono::Utc;
use serde::Deserialize;
use serde_json::{Value, json};

use super::jobs::{JobSpec, JobStatus, random_token, run_status};
use super::jwt::verify_app_jwt;
use super::model::{Fault, FaultRule, RateWindow, SimRunner, SimScope, WebhookFault, labels_match};
use super::registry::register_runner;
use super::shared::Shared;

mod dispatch;
mod scaleset;

type S = State<Arc<Shared>>;

const DOCS: &str = "https://docs.github.com/rest";

/// A GitHub-shaped error response.
struct ApiError {
    status: StatusCode,
    message: String,
    headers: Vec<(&'static str, String)>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            headers: Vec::new(),
        }
    }
    fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "Not Found")
    }
    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "message": self.message,
            "documentation_url": DOCS,
            "status": self.status.as_u16().to_string(),
        });
        let mut resp = (self.status, Json(body)).into_response();
        for (k, v) in self.headers {
            if let Ok(v) = HeaderValue::from_str(&v) {
                resp.headers_mut().insert(HeaderName::from_static(k), v);
            }
        }
        resp
    }
}

type ApiResult = Result<Response, ApiError>;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let api = Router::new()
        .route(
            "/app/installations/{installation_id}/access_tokens",
            post(access_token),
        )
        .route("/orgs/{org}/actions/runner-groups", get(org_runner_groups))
        .route(
            "/orgs/{org}/actions/runners/generate-jitconfig",
            post(org_jit),
        )
        .route("/orgs/{org}/actions/runners", get(org_list_runners))
        .route("/orgs/{org}/actions/runners/downloads", get(org_downloads))
        .route(
            "/repos/{owner}/{repo}/actions/runners/downloads",
            get(repo_downloads),
        )
        .route(
            "/orgs/{org}/actions/runners/{id}",
            get(org_get_runner).delete(org_delete_runner),
        )
        .route(
            "/repos/{owner}/{repo}/actions/runners/generate-jitconfig",
            post(repo_jit),
        )
        .route(
            "/repos/{owner}/{repo}/actions/runners",
            get(repo_list_runners),
        )
        .route(
            "/repos/{owner}/{repo}/actions/runners/{id}",
            get(repo_get_runner).delete(repo_delete_runner),
        )
        .route("/installation/repositories", get(installation_repositories))
        .route("/repos/{owner}/{repo}/actions/runs", get(repo_runs))
        .route(
            "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs",
            get(run_jobs),
        )
        .merge(dispatch::api_routes())
        .route(
            "/orgs/{org}/actions/runners/registration-token",
            post(org_registration_token),
        )
        .route(
            "/repos/{owner}/{repo}/actions/runners/registration-token",
            post(repo_registration_token),
        )
        .fallback(|| async { ApiError::not_found() })
        .layer(middleware::from_fn_with_state(shared.clone(), api_layer));
    let runner = Router::new()
        .route("/_runner/connect", post(runner_connect))
        .route("/_runner/acquire", post(runner_acquire))
        .route("/_runner/jobs/{id}/complete", post(runner_complete));
    let admin = Router::new()
        .route(
            "/_admin/faults",
            post(admin_fault).delete(admin_clear_faults),
        )
        .route("/_admin/webhook-faults", post(admin_webhook_fault))
        .route("/_admin/runner-faults", post(admin_runner_fault))
        .route("/_admin/webhook", put(admin_webhook))
        .route("/_admin/jobs", post(admin_queue_job).get(admin_jobs))
        .route("/_admin/jobs/{id}", get(admin_job))
        .route("/_admin/installation/revoke", post(admin_revoke))
        .route("/_admin/installation/restore", post(admin_restore))
        .route("/_admin/installation/permissions", put(admin_permissions))
        .route("/_admin/tokens/expire", post(admin_expire))
        .route("/_admin/stats", get(admin_stats))
        .route("/_admin/runners", get(admin_runners))
        .route("/_admin/deliveries", get(admin_deliveries))
        .route("/_admin/health", get(|| async { "ok" }))
        .route("/_admin/runners/{id}", delete(admin_remove_runner))
        .merge(dispatch::admin_routes());
    runner
        .merge(admin)
        .merge(scaleset::routes())
        .merge(api)
        .with_state(shared)
}

fn auth_value(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, rest) = v.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") || scheme.eq_ignore_ascii_case("token"))
        .then(|| rest.trim().to_string())
}

/// Fault injection, the primary rate limit and the `x-ratelimit-*` headers of every REST answer.
async fn api_layer(State(shared): S, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let conditional_get = req.method() == axum::http::Method::GET;
    let if_none_match = req
        .headers()
        .get(http::header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let fault = {
        let mut m = shared.model();
        m.stats.api_requests += 1;
        m.take_fault(&path)
    };
    let principal = {
        let m = shared.model();
        match auth_value(req.headers()) {
            Some(t) if m.tokens.contains_key(&t) => {
                format!("installation:{}", shared.config.installation_id)
            }
            Some(t) if t.matches('.').count() == 2 => format!("app:{}", shared.config.app_id),
            // Unknown credentials answer 401 without spending a quota.
            Some(_) => "unauthenticated".to_string(),
            None => "anonymous".to_string(),
        }
    };
    let now = Utc::now().timestamp();
    let window_secs = shared.config.rate_limit_window.as_secs().max(1) as i64;
    let limit = if principal == "anonymous" || principal == "unauthenticated" {
        60
    } else {
        shared.config.rate_limit
    };
    let mut early: Option<Response> = None;
    match fault {
        Some(Fault::Delay { millis }) => tokio::time::sleep(Duration::from_millis(millis)).await,
        Some(Fault::DelayAnswer { .. }) => {}
        Some(Fault::ServerError { status }) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
            early = Some(ApiError::new(status, "Server Error").into_response());
        }
        Some(Fault::RateLimit { retry_after_secs }) => {
            early = Some(
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "Too Many Requests")
                    .header("retry-after", retry_after_secs.to_string())
                    .into_response(),
            );
        }
        Some(Fault::SecondaryRateLimit { retry_after_secs }) => {
            let mut e = ApiError::new(
                StatusCode::FORBIDDEN,
                "You have exceeded a secondary rate limit. Please wait a few minutes before you try again. If you reach out to GitHub Support for help, please include the request ID.",
            );
            if let Some(s) = retry_after_secs {
                e = e.header("retry-after", s.to_string());
            }
            early = Some(e.into_response());
        }
        None => {}
    }
    let (mut window, charged) = {
        let mut m = shared.model();
        let w = m.rate.entry(principal.clone()).or_insert(RateWindow {
            limit,
            used: 0,
            reset_at: now + window_secs,
        });
        if now >= w.reset_at {
            w.used = 0;
            w.reset_at = now + window_secs;
        }
        let charged = early.is_none() && w.remaining() > 0;
        if charged && principal != "unauthenticated" {
            w.used += 1;
        }
        (w.clone(), charged)
    };
    let mut resp = match early {
        Some(r) => r,
        None if !charged => {
            let msg = match principal.split_once(':') {
                Some(("installation", id)) => {
                    format!("API rate limit exceeded for installation ID {id}.")
                }
                _ => "API rate limit exceeded.".to_string(),
            };
            ApiError::new(StatusCode::FORBIDDEN, msg).into_response()
        }
        None => {
            let mut resp = next.run(req).await;
            if let Some(Fault::DelayAnswer { millis }) = fault {
                tokio::time::sleep(Duration::from_millis(millis)).await;
            }
            if conditional_get && resp.status() == StatusCode::OK {
                resp = with_etag(resp, if_none_match.as_deref()).await;
            }
            let mut m = shared.model();
            if resp.status() == StatusCode::NOT_MODIFIED {
                // GitHub does not charge an authorized conditional request answered 304.
                m.stats.not_modified += 1;
                if let Some(w) = m.rate.get_mut(&principal) {
                    w.used = w.used.saturating_sub(1);
                    window = w.clone();
                }
            } else if principal != "unauthenticated" {
                m.stats.charged_requests += 1;
            }
            resp
        }
    };
    let h = resp.headers_mut();
    let mut set = |k: &'static str, v: String| {
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.insert(HeaderName::from_static(k), v);
        }
    };
    set("x-ratelimit-limit", window.limit.to_string());
    set("x-ratelimit-remaining", window.remaining().to_string());
    set("x-ratelimit-reset", window.reset_at.to_string());
    set("x-ratelimit-used", window.used.to_string());
    set("x-ratelimit-resource", "core".to_string());
    set("x-github-media-type", "github.v3; format=json".to_string());
    set(
        "x-github-request-id",
        uuid::Uuid::new_v4().simple().to_string().to_uppercase(),
    );
    resp
}

/// GitHub's conditional requests: every 200 GET carries an `ETag` over its body; a request whose
/// `If-None-Match` names the current one is answered 304 without a body.
async fn with_etag(resp: Response, if_none_match: Option<&str>) -> Response {
    use sha2::Digest;
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "reading the answer").into_response();
    };
    let etag = format!("W/\"{}\"", hex::encode(&sha2::Sha256::digest(&bytes)[..16]));
    if let Ok(v) = HeaderValue::from_str(&etag) {
        parts.headers.insert(http::header::ETAG, v);
    }
    let matches =
        if_none_match.is_some_and(|h| h.split(',').any(|t| t.trim() == etag || t.trim() == "*"));
    if matches {
        parts.status = StatusCode::NOT_MODIFIED;
        parts.headers.remove(http::header::CONTENT_TYPE);
        parts.headers.remove(http::header::CONTENT_LENGTH);
        return Response::from_parts(parts, axum::body::Body::empty());
    }
    Response::from_parts(parts, axum::body::Body::from(bytes))
}

fn require_token(shared: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = auth_value(headers) else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "Requires authentication",
        ));
    };
    let m = shared.model();
    match m.tokens.get(&token) {
        Some(exp) if *exp > Utc::now() && !m.revoked => Ok(()),
        _ => Err(ApiError::new(StatusCode::UNAUTHORIZED, "Bad credentials")),
    }
}

fn require_permission(shared: &Shared, name: &str, write: bool) -> Result<(), ApiError> {
    let m = shared.model();
    let ok = match m.permissions.get(name).map(String::as_str) {
        Some("write") | Some("admin") => true,
        Some("read") => !write,
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        let level = if write { "write" } else { "read" };
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "Resource not accessible by integration",
        )
        .header("x-accepted-github-permissions", format!("{name}={level}")))
    }
}

fn json_response(status: StatusCode, v: Value) -> Response {
    (status, Json(v)).into_response()
}

async fn access_token(
    State(shared): S,
    Path(installation_id): Path<u64>,
    headers: HeaderMap,
) -> ApiResult {
    let Some(jwt) = auth_value(&headers) else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "Requires authentication",
        ));
    };
    let key = shared.key.clone();
    let app_id = shared.config.app_id;
    let verified = verify_app_jwt(
        &jwt,
        |id| (id == app_id).then(|| key.public_key_der().to_vec()),
        Utc::now().timestamp(),
    );
    let mut m = shared.model();
    if let Err(rejection) = verified {
        m.stats.token_exchanges_refused += 1;
        return Err(ApiError::new(StatusCode::UNAUTHORIZED, rejection.message()));
    }
    if installation_id != shared.config.installation_id || m.revoked {
        m.stats.token_exchanges_refused += 1;
        return Err(ApiError::not_found());
    }
    let token = format!("ghs_{}", random_token(36));
    let expires_at =
        Utc::now() + chrono::Duration::from_std(shared.config.token_ttl).unwrap_or_default();
    m.tokens.insert(token.clone(), expires_at);
    m.stats.token_exchanges += 1;
    let permissions = m.permissions.clone();
    Ok(json_response(
        StatusCode::CREATED,
        json!({
            "token": token,
            "expires_at": expires_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            "permissions": permissions,
            "repository_selection": "all",
        }),
    ))
}

#[derive(Deserialize)]
struct PageQuery {
    per_page: Option<usize>,
    page: Option<usize>,
}

/// One page of `items`, and GitHub's `Link` header for it.
fn paginate(
    shared: &Shared,
    path: &str,
    q: &PageQuery,
    items: Vec<Value>,
) -> (Vec<Value>, Option<String>) {
    let per_page = q.per_page.unwrap_or(30).clamp(1, 100);
    let page = q.page.unwrap_or(1).max(1);
    let last = items.len().div_ceil(per_page).max(1);
    let slice: Vec<Value> = items
        .into_iter()
        .skip((page - 1) * per_page)
        .take(per_page)
        .collect();
    let link_to = |p: usize, rel: &str| {
        format!(
            "<{}{}?per_page={per_page}&page={p}>; rel=\"{rel}\"",
            shared.base_url, path
        )
    };
    let mut links = Vec::new();
    if page < last {
        links.push(link_to(page + 1, "next"));
        links.push(link_to(last, "last"));
    }
    if page > 1 {
        links.push(link_to(1, "first"));
        links.push(link_to(page - 1, "prev"));
    }
    (slice, (!links.is_empty()).then(|| links.join(", ")))
}

fn paged_response(key: &str, total: usize, items: Vec<Value>, link: Option<String>) -> Response {
    let mut resp = json_response(StatusCode::OK, json!({ "total_count": total, key: items }));
    if let Some(l) = link.and_then(|l| HeaderValue::from_str(&l).ok()) {
        resp.headers_mut().insert(http::header::LINK, l);
    }
    resp
}

fn check_org(shared: &Shared, org: &str) -> Result<SimScope, ApiError> {
    if org.eq_ignore_ascii_case(&shared.config.org) {
        Ok(SimScope::Organization(shared.config.org.clone()))
    } else {
        Err(ApiError::not_found())
    }
}

fn check_repo(shared: &Shared, owner: &str, repo: &str) -> Result<SimScope, ApiError> {
    let full = format!("{owner}/{repo}");
    shared
        .config
        .repos
        .iter()
        .find(|r| r.eq_ignore_ascii_case(&full))
        .map(|r| SimScope::Repository(r.clone()))
        .ok_or_else(ApiError::not_found)
}

/// Token, then permission, then scope existence (GitHub checks in about this order).
fn authorize(
    shared: &Shared,
    headers: &HeaderMap,
    scope: &Result<SimScope, ApiError>,
    write: bool,
) -> Result<SimScope, ApiError> {
    require_token(shared, headers)?;
    let perm = match scope {
        Ok(SimScope::Repository(_)) => "administration",
        _ => "organization_self_hosted_runners",
    };
    require_permission(shared, perm, write)?;
    match scope {
        Ok(s) => Ok(s.clone()),
        Err(_) => Err(ApiError::not_found()),
    }
}

async fn org_runner_groups(
    State(shared): S,
    Path(org): Path<String>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> ApiResult {
    authorize(&shared, &headers, &check_org(&shared, &org), false)?;
    let groups: Vec<Value> = shared
        .model()
        .groups
        .iter()
        .map(|g| {
            json!({
                "id": g.id,
                "name": g.name,
                "visibility": "all",
                "default": g.default,
                "runners_url": format!("{}/orgs/{org}/actions/runner-groups/{}/runners", shared.base_url, g.id),
                "inherited": false,
                "allows_public_repositories": false,
                "restricted_to_workflows": false,
                "selected_workflows": [],
            })
        })
        .collect();
    let total = groups.len();
    let (page, link) = paginate(
        &shared,
        &format!("/orgs/{org}/actions/runner-groups"),
        &q,
        groups,
    );
    Ok(paged_response("runner_groups", total, page, link))
}

async fn org_jit(
    State(shared): S,
    Path(org): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> ApiResult {
    let scope = authorize(&shared, &headers, &check_org(&shared, &org), true)?;
    jit(&shared, scope, &body)
}

async fn repo_jit(
    State(shared): S,
    Path((owner, repo)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> ApiResult {
    let scope = authorize(&shared, &headers, &check_repo(&shared, &owner, &repo), true)?;
    jit(&shared, scope, &body)
}

fn invalid(msg: &str) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        format!("Invalid request.\n\n{msg}"),
    )
}

fn jit(shared: &Shared, scope: SimScope, body: &[u8]) -> ApiResult {
    let v: Value = serde_json::from_slice(body)
        .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "Problems parsing JSON"))?;
    let name = v["name"]
        .as_str()
        .ok_or_else(|| invalid("\"name\" wasn't supplied."))?
        .to_string();
    let group_id = v["runner_group_id"]
        .as_u64()
        .ok_or_else(|| invalid("\"runner_group_id\" wasn't supplied."))?;
    let labels: Vec<String> = v["labels"]
        .as_array()
        .ok_or_else(|| invalid("\"labels\" wasn't supplied."))?
        .iter()
        .map(|l| l.as_str().map(str::to_string))
        .collect::<Option<_>>()
        .ok_or_else(|| invalid("For 'items', must be a string."))?;
    if name.is_empty() || name.len() > 64 {
        return Err(invalid("\"name\" must be between 1 and 64 characters."));
    }
    if labels.is_empty() || labels.len() > 100 {
        return Err(invalid("\"labels\" must have between 1 and 100 items."));
    }
    let work_folder = v["work_folder"].as_str().unwrap_or("_work").to_string();
    let mut m = shared.model();
    let group_ok = match scope {
        SimScope::Organization(_) => m.groups.iter().any(|g| g.id == group_id),
        SimScope::Repository(_) => group_id == 1,
    };
    if !group_ok {
        return Err(ApiError::not_found());
    }
    let (runner, encoded) = register_runner(
        &mut m,
        shared.runner_url(),
        scope,
        &name,
        group_id,
        &labels,
        &work_folder,
    )
    .map_err(|name| {
        ApiError::new(
            StatusCode::CONFLICT,
            format!("Already exists - A runner with the name {name} already exists."),
        )
    })?;
    Ok(json_response(
        StatusCode::CREATED,
        json!({ "runner": runner.to_github_json(), "encoded_jit_config": encoded }),
    ))
}

// ---- runner registration tokens (the scale-set protocol's first step) ----

async fn org_registration_token(
    State(shared): S,
    Path(org): Path<String>,
    headers: HeaderMap,
) -> ApiResult {
    let scope = authorize(&shared, &headers, &check_org(&shared, &org), true)?;
    Ok(registration_token(&shared, scope))
}

async fn repo_registration_token(
    State(shared): S,
    Path((owner, repo)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let scope = authorize(&shared, &headers, &check_repo(&shared, &owner, &repo), true)?;
    Ok(registration_token(&shared, scope))
}

/// A registration token for `scope` (GitHub: valid one hour).
fn registration_token(shared: &Shared, scope: SimScope) -> Response {
    let token = random_token(29).to_uppercase();
    let expires_at = Utc::now() + chrono::Duration::hours(1);
    let mut ss = shared.scalesets();
    ss.registration_tokens
        .insert(token.clone(), (scope, expires_at));
    ss.stats.registration_tokens += 1;
    json_response(
        StatusCode::CREATED,
        json!({
            "token": token,
            "expires_at": expires_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        }),
    )
}

async fn org_list_runners(
    State(shared): S,
    Path(org): Path<String>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> ApiResult {
    let scope = authorize(&shared, &headers, &check_org(&shared, &org), false)?;
    list_runners(&shared, scope, &format!("/orgs/{org}/actions/runners"), &q)
}

/// `GET .../actions/runners/downloads`: the newest runner release per platform (the scope's
/// runner permission, read).
async fn org_downloads(State(shared): S, Path(org): Path<String>, headers: HeaderMap) -> ApiResult {
    authorize(&shared, &headers, &check_org(&shared, &org), false)?;
    let body = shared.model().releases.downloads();
    Ok(json_response(StatusCode::OK, body))
}

async fn repo_downloads(
    State(shared): S,
    Path((owner, repo)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    authorize(
        &shared,
        &headers,
        &check_repo(&shared, &owner, &repo),
        false,
    )?;
    let body = shared.model().releases.downloads();
    Ok(json_response(StatusCode::OK, body))
}

async fn repo_list_runners(
    State(shared): S,
    Path((owner, repo)): Path<(String, String)>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> ApiResult {
    let scope = authorize(
        &shared,
        &headers,
        &check_repo(&shared, &owner, &repo),
        false,
    )?;
    list_runners(
        &shared,
        scope,
        &format!("/repos/{owner}/{repo}/actions/runners"),
        &q,
    )
}

fn list_runners(shared: &Shared, scope: SimScope, path: &str, q: &PageQuery) -> ApiResult {
    let runners: Vec<Value> = shared
        .model()
        .runners
        .values()
        .filter(|r| r.scope == scope)
        .map(SimRunner::to_github_json)
        .collect();
    let total = runners.len();
    let (page, link) = paginate(shared, path, q, runners);
    Ok(paged_response("runners", total, page, link))
}

async fn org_get_runner(
    State(shared): S,
    Path((org, id)): Path<(String, u64)>,
    headers: HeaderMap,
) -> ApiResult {
    let scope = authorize(&shared, &headers, &check_org(&shared, &org), false)?;
    get_runner(&shared, scope, id)
}

async fn repo_get_runner(
    State(shared): S,
    Path((owner, repo, id)): Path<(String, String, u64)>,
    headers: HeaderMap,
) -> ApiResult {
    let scope = authorize(
        &shared,
        &headers,
        &check_repo(&shared, &owner, &repo),
        false,
    )?;
    get_runner(&shared, scope, id)
}

fn get_runner(shared: &Shared, scope: SimScope, id: u64) -> ApiResult {
    let m = shared.model();
    match m.runners.get(&id) {
        Some(r) if r.scope == scope => Ok(json_response(StatusCode::OK, r.to_github_json())),
        _ => Err(ApiError::not_found()),
    }
}

async fn org_delete_runner(
    State(shared): S,
    Path((org, id)): Path<(String, u64)>,
    headers: HeaderMap,
) -> ApiResult {
    let scope = authorize(&shared, &headers, &check_org(&shared, &org), true)?;
    delete_runner(&shared, scope, id)
}

async fn repo_delete_runner(
    State(shared): S,
    Path((owner, repo, id)): Path<(String, String, u64)>,
    headers: HeaderMap,
) -> ApiResult {
    let scope = authorize(&shared, &headers, &check_repo(&shared, &owner, &repo), true)?;
    delete_runner(&shared, scope, id)
}

fn delete_runner(shared: &Shared, scope: SimScope, id: u64) -> ApiResult {
    let mut m = shared.model();
    match m.runners.get(&id) {
        Some(r) if r.scope == scope => {
            if r.busy {
                return Err(ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!(
                        "Bad request - Runner \"{}\" is still running a job\"",
                        r.name
                    ),
                ));
            }
            m.runners.remove(&id);
            m.credentials.retain(|_, rid| *rid != id);
            m.sessions.retain(|_, rid| *rid != id);
            m.stats.runners_deleted += 1;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        _ => Err(ApiError::not_found()),
    }
}

// ---- workflow runs and jobs (the operator's queued-job sweep) ----

async fn installation_repositories(
    State(shared): S,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> ApiResult {
    require_token(&shared, &headers)?;
    let repos: Vec<Value> = shared
        .config
        .repos
        .iter()
        .enumerate()
        .map(|(i, full)| {
            let (owner, name) = full.split_once('/').unwrap_or((full.as_str(), ""));
            json!({
                "id": 186_853_002u64 + i as u64,
                "name": name,
                "full_name": full,
                "private": true,
                "owner": { "login": owner, "type": "Organization" },
                "html_url": format!("https://github.com/{full}"),
            })
        })
        .collect();
    let total = repos.len();
    let (page, link) = paginate(&shared, "/installation/repositories", &q, repos);
    let mut resp = json_response(
        StatusCode::OK,
        json!({ "total_count": total, "repository_selection": "all", "repositories": page }),
    );
    if let Some(l) = link.and_then(|l| HeaderValue::from_str(&l).ok()) {
        resp.headers_mut().insert(http::header::LINK, l);
    }
    Ok(resp)
}

#[derive(Deserialize)]
struct RunsQuery {
    status: Option<String>,
    per_page: Option<usize>,
    page: Option<usize>,
}

fn job_status_str(s: JobStatus) -> &'static str {
    match s {
        JobStatus::Queued => "queued",
        JobStatus::InProgress => "in_progress",
        JobStatus::Completed => "completed",
    }
}

async fn repo_runs(
    State(shared): S,
    Path((owner, repo)): Path<(String, String)>,
    Query(q): Query<RunsQuery>,
    headers: HeaderMap,
) -> ApiResult {
    // A dispatch token (a user's PAT) reads runs too.
    dispatch::authorize_actions(&shared, &headers, false)?;
    let Ok(SimScope::Repository(full)) = check_repo(&shared, &owner, &repo) else {
        return Err(ApiError::not_found());
    };
    let api = format!("https://api.github.com/repos/{full}/actions/runs");
    let runs: Vec<Value> = {
        let m = shared.model();
        let mut by_run: std::collections::BTreeMap<u64, Vec<&super::jobs::SimJob>> =
            Default::default();
        for j in m.jobs.values() {
            if j.repository.eq_ignore_ascii_case(&full) {
                by_run.entry(j.run_id).or_default().push(j);
            }
        }
        by_run
            .into_iter()
            // Newest first, as GitHub lists runs.
            .rev()
            .filter_map(|(run_id, jobs)| {
                let status = run_status(jobs.iter().copied());
                if q.status.as_deref().is_some_and(|s| s != job_status_str(status)) {
                    return None;
                }
                let first = jobs[0];
                let conclusion = (status == JobStatus::Completed).then(|| {
                    if jobs.iter().all(|j| j.conclusion.as_deref() == Some("success")) {
                        "success"
                    } else {
                        "failure"
                    }
                });
                Some(json!({
                    "id": run_id,
                    "name": first.workflow_name,
                    "node_id": format!("WFR_{run_id}"),
                    "head_branch": first.head_branch,
                    "head_sha": first.head_sha,
                    "run_number": run_id % 10_000,
                    "run_attempt": 1,
                    "event": "push",
                    "status": job_status_str(status),
                    "conclusion": conclusion,
                    "workflow_id": 161_335,
                    "url": format!("{api}/{run_id}"),
                    "html_url": format!("https://github.com/{full}/actions/runs/{run_id}"),
                    "jobs_url": format!("{api}/{run_id}/jobs"),
                    "created_at": first.created_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    "updated_at": first.created_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                }))
            })
            .collect()
    };
    let total = runs.len();
    let pq = PageQuery {
        per_page: q.per_page,
        page: q.page,
    };
    let (page, link) = paginate(
        &shared,
        &format!("/repos/{owner}/{repo}/actions/runs"),
        &pq,
        runs,
    );
    Ok(paged_response("workflow_runs", total, page, link))
}

async fn run_jobs(
    State(shared): S,
    Path((owner, repo, run_id)): Path<(String, String, u64)>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> ApiResult {
    // A dispatch token (a user's PAT) reads runs too.
    dispatch::authorize_actions(&shared, &headers, false)?;
    let Ok(SimScope::Repository(full)) = check_repo(&shared, &owner, &repo) else {
        return Err(ApiError::not_found());
    };
    let jobs: Vec<Value> = shared
        .model()
        .jobs
        .values()
        .filter(|j| j.run_id == run_id && j.repository.eq_ignore_ascii_case(&full))
        .map(|j| {
            super::payload::workflow_job_payload(
                j,
                "",
                &shared.config.org,
                shared.config.installation_id,
            )["workflow_job"]
                .take()
        })
        .collect();
    if jobs.is_empty() {
        return Err(ApiError::not_found());
    }
    let total = jobs.len();
    let path = format!("/repos/{owner}/{repo}/actions/runs/{run_id}/jobs");
    let (page, link) = paginate(&shared, &path, &q, jobs);
    Ok(paged_response("jobs", total, page, link))
}

// ---- runner protocol ----

fn runner_auth(headers: &HeaderMap, scheme: &str) -> Option<String> {
    let v = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (s, rest) = v.split_once(' ')?;
    (s == scheme).then(|| rest.trim().to_string())
}

async fn runner_connect(State(shared): S, headers: HeaderMap) -> ApiResult {
    let cred = runner_auth(&headers, "RunnerCredential")
        .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "Requires authentication"))?;
    let mut m = shared.model();
    let id = *m.credentials.get(&cred).ok_or_else(|| {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "JIT configuration unknown or already used",
        )
    })?;
    // A runner held offline keeps its credential and is refused on every try.
    if m.never_online.contains(&id) || m.never_online_next > 0 {
        if m.never_online.insert(id) {
            m.never_online_next -= 1;
        }
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "runner held offline (admin runner-faults never_online)",
        ));
    }
    // GitHub's version enforcement: a deprecated runner never comes online (its credential is
    // spent: the real runner's session is refused after the exchange).
    let version = headers
        .get(imp_fake_runner::VERSION_HEADER)
        .and_then(|v| v.to_str().ok());
    if let Err(message) = m.releases.check(version) {
        m.credentials.remove(&cred);
        return Err(ApiError::new(StatusCode::FORBIDDEN, &message));
    }
    m.credentials.remove(&cred);
    let runner = m.runners.get_mut(&id).ok_or_else(ApiError::not_found)?;
    runner.status = "online".into();
    let body = json!({ "runner_id": id, "runner_name": runner.name, "labels": runner.labels });
    let session = random_token(40);
    m.sessions.insert(session.clone(), id);
    let mut body = body;
    body["session"] = json!(session);
    Ok(json_response(StatusCode::OK, body))
}

fn session_runner(shared: &Shared, headers: &HeaderMap) -> Result<u64, ApiError> {
    let s = runner_auth(headers, "RunnerSession")
        .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "Requires authentication"))?;
    let m = shared.model();
    let id = *m
        .sessions
        .get(&s)
        .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "Bad credentials"))?;
    if !m.runners.contains_key(&id) {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "Runner registration removed",
        ));
    }
    Ok(id)
}

async fn runner_acquire(State(shared): S, headers: HeaderMap) -> ApiResult {
    let runner_id = session_runner(&shared, &headers)?;
    let job = {
        let mut m = shared.model();
        let runner = m
            .runners
            .get(&runner_id)
            .cloned()
            .ok_or_else(ApiError::not_found)?;
        if runner.busy {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "Runner already has a job",
            ));
        }
        let group_name = m
            .groups
            .iter()
            .find(|g| g.id == runner.runner_group_id)
            .map(|g| g.name.clone());
        let candidate = m.jobs.values().find(|j| {
            j.status == JobStatus::Queued
                && labels_match(&j.labels, &runner.labels)
                && shared.scalesets().runner_may_take(runner.id, j.id)
                && match &runner.scope {
                    SimScope::Organization(o) => j
                        .repository
                        .split('/')
                        .next()
                        .is_some_and(|owner| owner.eq_ignore_ascii_case(o)),
                    SimScope::Repository(r) => j.repository.eq_ignore_ascii_case(r),
                }
        });
        let Some(job_id) = candidate.map(|j| j.id) else {
            return Ok(StatusCode::NO_CONTENT.into_response());
        };
        let job = m.jobs.get_mut(&job_id).expect("found above");
        job.status = JobStatus::InProgress;
        job.started_at = Some(Utc::now());
        job.runner_id = Some(runner.id);
        job.runner_name = Some(runner.name.clone());
        job.runner_group_id = Some(runner.runner_group_id);
        job.runner_group_name = group_name;
        let job = job.clone();
        let r = m.runners.get_mut(&runner_id).expect("checked");
        r.busy = true;
        r.job_id = Some(job_id);
        job
    };
    shared.emit(&job, "in_progress");
    Ok(json_response(
        StatusCode::OK,
        serde_json::to_value(&job).expect("job serializes"),
    ))
}

#[derive(Deserialize)]
struct CompleteBody {
    conclusion: Option<String>,
    /// Each step's conclusion, in order (as many as the job has steps).
    #[serde(default)]
    steps: Option<Vec<String>>,
}

async fn runner_complete(
    State(shared): S,
    Path(job_id): Path<u64>,
    headers: HeaderMap,
    body: Option<Json<CompleteBody>>,
) -> ApiResult {
    let runner_id = session_runner(&shared, &headers)?;
    let (conclusion, step_conclusions) = match body {
        Some(Json(b)) => (b.conclusion, b.steps),
        None => (None, None),
    };
    let conclusion = conclusion.unwrap_or_else(|| "success".into());
    const CONCLUSIONS: [&str; 4] = ["success", "failure", "cancelled", "skipped"];
    if !CONCLUSIONS.contains(&conclusion.as_str()) {
        return Err(invalid(
            "conclusion must be success, failure, cancelled or skipped",
        ));
    }
    if let Some(steps) = &step_conclusions
        && steps.iter().any(|c| !CONCLUSIONS.contains(&c.as_str()))
    {
        return Err(invalid(
            "steps[]: each must be success, failure, cancelled or skipped",
        ));
    }
    let job = {
        let mut m = shared.model();
        if m.runners.get(&runner_id).and_then(|r| r.job_id) != Some(job_id) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "Job is not assigned to this runner",
            ));
        }
        let job = m.jobs.get_mut(&job_id).ok_or_else(ApiError::not_found)?;
        if let Some(steps) = step_conclusions {
            if steps.len() != job.steps.len() {
                return Err(invalid(&format!(
                    "steps: {} conclusions for a job with {} steps",
                    steps.len(),
                    job.steps.len()
                )));
            }
            for (step, c) in job.steps.iter_mut().zip(steps) {
                step.conclusion = Some(c);
            }
        }
        job.status = JobStatus::Completed;
        job.conclusion = Some(conclusion);
        job.completed_at = Some(Utc::now());
        let job = job.clone();
        // Ephemeral: the registration goes away with the job.
        m.runners.remove(&runner_id);
        m.sessions.retain(|_, rid| *rid != runner_id);
        shared.scalesets().runner_removed(runner_id);
        job
    };
    shared.emit(&job, "completed");
    Ok(json_response(
        StatusCode::OK,
        serde_json::to_value(&job).expect("job serializes"),
    ))
}

// ---- admin ----

async fn admin_fault(State(shared): S, Json(rule): Json<FaultRule>) -> StatusCode {
    shared.model().faults.push_back(rule);
    StatusCode::NO_CONTENT
}

async fn admin_clear_faults(State(shared): S) -> StatusCode {
    shared.model().faults.clear();
    StatusCode::NO_CONTENT
}

#[derive(Deserialize)]
struct WebhookFaultBody {
    fault: WebhookFault,
    count: u32,
}

async fn admin_webhook_fault(State(shared): S, Json(b): Json<WebhookFaultBody>) -> StatusCode {
    shared.model().webhook_faults.push_back((b.fault, b.count));
    StatusCode::NO_CONTENT
}

#[derive(Deserialize)]
struct RunnerFaultBody {
    /// The next this many runners to connect never come online.
    never_online: u32,
}

async fn admin_runner_fault(State(shared): S, Json(b): Json<RunnerFaultBody>) -> StatusCode {
    shared.model().never_online_next += b.never_online;
    StatusCode::NO_CONTENT
}

#[derive(Deserialize)]
struct WebhookBody {
    url: String,
    secret: String,
}

async fn admin_webhook(State(shared): S, Json(b): Json<WebhookBody>) -> StatusCode {
    shared.model().webhook = Some((b.url, b.secret));
    StatusCode::NO_CONTENT
}

async fn admin_queue_job(State(shared): S, Json(spec): Json<JobSpec>) -> Response {
    let job = shared.queue_job(spec);
    json_response(
        StatusCode::CREATED,
        serde_json::to_value(job).expect("job serializes"),
    )
}

async fn admin_jobs(State(shared): S) -> Response {
    let jobs: Vec<_> = shared.model().jobs.values().cloned().collect();
    json_response(
        StatusCode::OK,
        serde_json::to_value(jobs).expect("jobs serialize"),
    )
}

async fn admin_job(State(shared): S, Path(id): Path<u64>) -> ApiResult {
    let job = shared
        .model()
        .jobs
        .get(&id)
        .cloned()
        .ok_or_else(ApiError::not_found)?;
    Ok(json_response(
        StatusCode::OK,
        serde_json::to_value(job).expect("job serializes"),
    ))
}

async fn admin_revoke(State(shared): S) -> StatusCode {
    let mut m = shared.model();
    m.revoked = true;
    m.tokens.clear();
    StatusCode::NO_CONTENT
}

async fn admin_restore(State(shared): S) -> StatusCode {
    shared.model().revoked = false;
    StatusCode::NO_CONTENT
}

async fn admin_permissions(
    State(shared): S,
    Json(b): Json<serde_json::Map<String, Value>>,
) -> StatusCode {
    let mut m = shared.model();
    for (k, v) in b {
        match v.as_str() {
            Some(level) => m.permissions.insert(k, level.to_string()),
            None => m.permissions.remove(&k),
        };
    }
    StatusCode::NO_CONTENT
}

async fn admin_expire(State(shared): S) -> StatusCode {
    let past = Utc::now() - chrono::Duration::seconds(1);
    for exp in shared.model().tokens.values_mut() {
        *exp = past;
    }
    StatusCode::NO_CONTENT
}

async fn admin_stats(State(shared): S) -> Response {
    json_response(
        StatusCode::OK,
        serde_json::to_value(&shared.model().stats).expect("stats serialize"),
    )
}

async fn admin_runners(State(shared): S) -> Response {
    let runners: Vec<_> = shared.model().runners.values().cloned().collect();
    json_response(
        StatusCode::OK,
        serde_json::to_value(runners).expect("runners serialize"),
    )
}

async fn admin_remove_runner(State(shared): S, Path(id): Path<u64>) -> StatusCode {
    match shared.model().runners.remove(&id) {
        Some(_) => StatusCode::NO_CONTENT,
        None => StatusCode::NOT_FOUND,
    }
}

async fn admin_deliveries(State(shared): S) -> Response {
    json_response(
        StatusCode::OK,
        serde_json::to_value(&shared.model().deliveries).expect("deliveries serialize"),
    )
}
