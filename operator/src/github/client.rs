//! [`GithubApp`]: one GitHub App installation's client. Sends every call through octocrab's HTTP
//! stack (octocrab's own retry disabled) with the request pipeline: installation token, timeout,
//! classification, one re-authentication on 401, backoff for transient errors and rate limits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::BodyExt;
use octocrab::Octocrab;
use octocrab::service::middleware::retry::RetryConfig;
use rand::Rng;

use super::app_auth::{AccessTokenResponse, CachedToken, TokenCache, mint_app_jwt};
use super::budget::RateState;
use super::conditional::{CallCount, EtagCache};
use super::credentials::AppCredentials;
use super::errors::{
    CallContext, GithubError, Operation, classify, header_i64, rate_limit_remaining,
};
use super::governor::MintGovernor;
use super::metrics::{AppLabels, ErrorLabels, GithubMetrics, OperationLabels, RequestLabels};
use super::retry::RetryPolicy;
use imp_common::{ExposeSecret, SecretString};

/// Client configuration.
#[derive(Debug, Clone)]
pub struct GithubConfig {
    /// REST API base, e.g. `https://api.github.com` (GHES: `https://HOST/api/v3`).
    pub api_base_url: String,
    /// Deadline of one HTTP exchange.
    pub request_timeout: Duration,
    pub retry: RetryPolicy,
    /// Re-mint installation tokens this long before they expire (at least 5 minutes).
    pub token_refresh_margin: Duration,
    /// Mint governor rate (JIT configs per minute per App).
    pub jit_mints_per_minute: u32,
    /// Mint governor burst.
    pub jit_mint_burst: u32,
    /// The queued-job sweep's share of the API (docs/github.md).
    pub sweep_budget: super::budget::SweepBudget,
}

impl Default for GithubConfig {
    fn default() -> Self {
        GithubConfig {
            api_base_url: "https://api.github.com".into(),
            request_timeout: Duration::from_secs(30),
            retry: RetryPolicy::default(),
            token_refresh_margin: Duration::from_secs(5 * 60),
            jit_mints_per_minute: 150,
            jit_mint_burst: 20,
            sweep_budget: super::budget::SweepBudget::default(),
        }
    }
}

/// A raw answer GitHub gave.
#[derive(Debug)]
pub(crate) struct ApiResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

pub(crate) struct Inner {
    pub creds: AppCredentials,
    pub config: GithubConfig,
    http: Octocrab,
    tokens: TokenCache,
    pub governor: MintGovernor,
    pub metrics: GithubMetrics,
    /// (org, group name or "" for the default group) -> id.
    pub groups: Mutex<HashMap<(String, String), u64>>,
    /// Last answers of listings, for conditional requests.
    etags: Mutex<EtagCache>,
    /// The installation's primary limit as last seen: (limit, remaining, reset epoch seconds).
    rate: Mutex<Option<(u64, u64, i64)>>,
}

/// A GitHub App installation client. Cheap to clone; clones share the token cache and governor.
#[derive(Clone)]
pub struct GithubApp {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for GithubApp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GithubApp")
            .field("app_id", &self.inner.creds.app_id())
            .field("installation_id", &self.inner.creds.installation_id())
            .field("api", &self.inner.config.api_base_url)
            .finish()
    }
}

impl GithubApp {
    /// A client for `creds` with fresh metrics.
    pub fn new(creds: AppCredentials, config: GithubConfig) -> Result<Self, GithubError> {
        Self::with_metrics(creds, config, GithubMetrics::default())
    }

    /// A client that reports into shared `metrics`.
    pub fn with_metrics(
        creds: AppCredentials,
        config: GithubConfig,
        metrics: GithubMetrics,
    ) -> Result<Self, GithubError> {
        let http = Octocrab::builder()
            .base_uri(config.api_base_url.as_str())
            .map_err(|_| {
                GithubError::InvalidRequest(format!(
                    "invalid API base URL `{}`",
                    config.api_base_url
                ))
            })?
            .add_retry_config(RetryConfig::None)
            .set_connect_timeout(Some(config.request_timeout))
            .set_read_timeout(Some(config.request_timeout))
            .build()
            .map_err(|e| GithubError::InvalidRequest(format!("building the HTTP client: {e}")))?;
        let governor = MintGovernor::new(config.jit_mints_per_minute, config.jit_mint_burst);
        Ok(GithubApp {
            inner: Arc::new(Inner {
                creds,
                config,
                http,
                tokens: TokenCache::default(),
                governor,
                metrics,
                groups: Mutex::new(HashMap::new()),
                etags: Mutex::new(EtagCache::default()),
                rate: Mutex::new(None),
            }),
        })
    }

    pub fn app_id(&self) -> u64 {
        self.inner.creds.app_id()
    }

    pub fn installation_id(&self) -> u64 {
        self.inner.creds.installation_id()
    }

    pub fn metrics(&self) -> &GithubMetrics {
        &self.inner.metrics
    }

    /// The installation's primary rate limit as the last answer reported it.
    pub fn rate_state(&self) -> Option<RateState> {
        let (limit, remaining, reset) =
            (*self.inner.rate.lock().unwrap_or_else(|e| e.into_inner()))?;
        let reset_in = (reset - chrono::Utc::now().timestamp()).max(0) as u64;
        Some(RateState {
            limit,
            remaining,
            reset_in: Duration::from_secs(reset_in),
        })
    }

    /// Answers remembered for conditional requests.
    pub fn etag_entries(&self) -> usize {
        self.inner
            .etags
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    fn app_labels(&self) -> AppLabels {
        AppLabels {
            app_id: self.app_id().to_string(),
        }
    }

    /// A valid installation token (cached; exchanged when missing or within the refresh margin).
    pub async fn installation_token(&self) -> Result<SecretString, GithubError> {
        let margin = self.inner.config.token_refresh_margin;
        self.inner
            .tokens
            .get(self.installation_id(), margin, || self.exchange_token())
            .await
    }

    async fn exchange_token(&self) -> Result<CachedToken, GithubError> {
        let installation_id = self.installation_id();
        let ctx = CallContext {
            operation: Operation::TokenExchange,
            target: format!("installation {installation_id}"),
            permission: "(App JWT)",
            installation_id,
        };
        let path = format!("/app/installations/{installation_id}/access_tokens");
        let mut retry = 0;
        loop {
            let jwt = mint_app_jwt(&self.inner.creds, chrono::Utc::now().timestamp())?;
            let result = self
                .send_once(
                    Operation::TokenExchange,
                    Method::POST,
                    &path,
                    None,
                    jwt.expose_secret(),
                    None,
                )
                .await;
            let err = match result {
                Ok(r) if r.status == StatusCode::CREATED || r.status == StatusCode::OK => {
                    self.inner
                        .metrics
                        .token_exchanges
                        .get_or_create(&self.app_labels())
                        .inc();
                    tracing::info!(
                        app_id = self.app_id(),
                        installation_id,
                        "exchanged App JWT for an installation token"
                    );
                    return AccessTokenResponse::parse(&r.body);
                }
                Ok(r) => classify(
                    &ctx,
                    r.status,
                    &r.headers,
                    &r.body,
                    chrono::Utc::now().timestamp(),
                ),
                Err(e) => e,
            };
            let jitter: f64 = rand::rng().random();
            match self.inner.config.retry.delay_for(&err, retry, jitter) {
                Some(wait) => {
                    tracing::warn!(operation = %Operation::TokenExchange, error = %err, ?wait, retry, "retrying GitHub call");
                    tokio::time::sleep(wait).await;
                    retry += 1;
                }
                None => return Err(self.record_error(err)),
            }
        }
    }

    fn record_error(&self, err: GithubError) -> GithubError {
        let op = match &err {
            GithubError::Unauthorized { operation, .. }
            | GithubError::Forbidden { operation, .. }
            | GithubError::NotFound { operation, .. }
            | GithubError::Conflict { operation, .. }
            | GithubError::Invalid { operation, .. }
            | GithubError::RateLimited { operation, .. }
            | GithubError::Server { operation, .. }
            | GithubError::Timeout { operation, .. }
            | GithubError::Transport { operation, .. }
            | GithubError::UnexpectedStatus { operation, .. }
            | GithubError::Decode { operation, .. }
            | GithubError::TooManyPages { operation, .. } => operation.as_str(),
            GithubError::RunnerBusy { .. } => Operation::DeleteRunner.as_str(),
            _ => "client",
        };
        self.inner
            .metrics
            .errors
            .get_or_create(&ErrorLabels {
                operation: op.to_string(),
                error: err.metric_label().to_string(),
            })
            .inc();
        err
    }

    /// One HTTP exchange with bearer `auth`; no retries.
    async fn send_once(
        &self,
        op: Operation,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
        auth: &str,
        if_none_match: Option<&HeaderValue>,
    ) -> Result<ApiResponse, GithubError> {
        let mut authz = HeaderValue::from_str(&format!("Bearer {auth}")).map_err(|_| {
            GithubError::InvalidRequest("credential is not a valid header value".into())
        })?;
        authz.set_sensitive(true);
        let mut req = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(http::header::AUTHORIZATION, authz)
            .header(http::header::ACCEPT, "application/vnd.github+json")
            .header("x-github-api-version", "2022-11-28")
            .header(http::header::USER_AGENT, "imp-operator");
        if let Some(etag) = if_none_match {
            req = req.header(http::header::IF_NONE_MATCH, etag);
        }
        let body = match body {
            Some(v) => {
                req = req.header(http::header::CONTENT_TYPE, "application/json");
                serde_json::to_string(v).map_err(|e| GithubError::InvalidRequest(e.to_string()))?
            }
            None => String::new(),
        };
        let req = req
            .body(body)
            .map_err(|e| GithubError::InvalidRequest(format!("{path}: {e}")))?;
        let timeout = self.inner.config.request_timeout;
        let exchange = async {
            let resp = self
                .inner
                .http
                .execute(req)
                .await
                .map_err(|e| GithubError::Transport {
                    operation: op,
                    message: transport_message(&e),
                })?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.map_err(|e| GithubError::Transport {
                operation: op,
                message: transport_message(&e),
            })?;
            Ok(ApiResponse {
                status: parts.status,
                headers: parts.headers,
                body: body.to_bytes(),
            })
        };
        let result =
            tokio::time::timeout(timeout, exchange)
                .await
                .unwrap_or(Err(GithubError::Timeout {
                    operation: op,
                    after: timeout,
                }));
        let status = match &result {
            Ok(r) => format!("{}xx", r.status.as_u16() / 100),
            Err(_) => "error".to_string(),
        };
        self.inner
            .metrics
            .requests
            .get_or_create(&RequestLabels {
                operation: op.as_str().to_string(),
                status,
            })
            .inc();
        match &result {
            Ok(r) => {
                // The token exchange reports the App's own (JWT) quota; the gauge tracks the
                // installation's, which every other call spends.
                if let Some(remaining) = rate_limit_remaining(&r.headers)
                    && op != Operation::TokenExchange
                {
                    self.inner
                        .metrics
                        .rate_limit_remaining
                        .get_or_create(&self.app_labels())
                        .set(remaining);
                    let limit = header_i64(&r.headers, "x-ratelimit-limit");
                    let reset = header_i64(&r.headers, "x-ratelimit-reset");
                    if let (Some(limit), Some(reset)) = (limit, reset) {
                        self.inner
                            .metrics
                            .rate_limit_limit
                            .get_or_create(&self.app_labels())
                            .set(limit);
                        *self.inner.rate.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((limit.max(0) as u64, remaining.max(0) as u64, reset));
                    }
                }
                tracing::debug!(operation = %op, %method, path, status = r.status.as_u16(), "GitHub call");
            }
            Err(e) => {
                tracing::debug!(operation = %op, %method, path, error = %e, "GitHub call failed")
            }
        }
        result
    }

    /// A call with the installation token and the full pipeline. Success statuses and those in
    /// `accept` are returned; everything else becomes a classified error.
    pub(crate) async fn call(
        &self,
        ctx: &CallContext,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
        accept: &[StatusCode],
    ) -> Result<ApiResponse, GithubError> {
        self.call_conditional(ctx, method, path, body, accept, None)
            .await
    }

    /// [`GithubApp::call`] with an `If-None-Match` (a 304 is returned, not an error).
    async fn call_conditional(
        &self,
        ctx: &CallContext,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
        accept: &[StatusCode],
        if_none_match: Option<&HeaderValue>,
    ) -> Result<ApiResponse, GithubError> {
        let mut retry = 0;
        let mut reauthenticated = false;
        loop {
            let token = self.installation_token().await?;
            let result = self
                .send_once(
                    ctx.operation,
                    method.clone(),
                    path,
                    body,
                    token.expose_secret(),
                    if_none_match,
                )
                .await;
            let err = match result {
                Ok(r) if r.status.is_success() || accept.contains(&r.status) => return Ok(r),
                Ok(r) if r.status == StatusCode::NOT_MODIFIED && if_none_match.is_some() => {
                    return Ok(r);
                }
                Ok(r) => classify(
                    ctx,
                    r.status,
                    &r.headers,
                    &r.body,
                    chrono::Utc::now().timestamp(),
                ),
                Err(e) => e,
            };
            if matches!(err, GithubError::Unauthorized { .. }) && !reauthenticated {
                tracing::info!(operation = %ctx.operation, "installation token refused; re-minting once");
                self.inner
                    .tokens
                    .invalidate(self.installation_id(), &token)
                    .await;
                reauthenticated = true;
                continue;
            }
            let jitter: f64 = rand::rng().random();
            match self.inner.config.retry.delay_for(&err, retry, jitter) {
                Some(wait) => {
                    tracing::warn!(operation = %ctx.operation, error = %err, ?wait, retry, "retrying GitHub call");
                    tokio::time::sleep(wait).await;
                    retry += 1;
                }
                None => return Err(self.record_error(err)),
            }
        }
    }

    pub(crate) fn record(&self, err: GithubError) -> GithubError {
        self.record_error(err)
    }

    /// GETs `path` as a conditional request when an answer is remembered: a 304 (free on the rate
    /// limit) is served from the cache. Counts what it cost into `calls`.
    pub(crate) async fn get_revalidated(
        &self,
        ctx: &CallContext,
        path: &str,
        calls: &mut CallCount,
    ) -> Result<ApiResponse, GithubError> {
        let etag = self.etags().etag(path);
        let mut resp = self
            .call_conditional(ctx, Method::GET, path, None, &[], etag.as_ref())
            .await?;
        if resp.status == StatusCode::NOT_MODIFIED {
            calls.revalidated += 1;
            self.inner
                .metrics
                .not_modified
                .get_or_create(&OperationLabels {
                    operation: ctx.operation.as_str().to_string(),
                })
                .inc();
            let Some(hit) = self.etags().revalidated(path) else {
                // Evicted meanwhile: ask again without the condition.
                self.etags().forget(path);
                calls.charged += 1;
                return self.call(ctx, Method::GET, path, None, &[]).await;
            };
            resp.status = StatusCode::OK;
            resp.body = hit.body;
            if let Some(link) = hit.link {
                resp.headers.insert(http::header::LINK, link);
            }
            return Ok(resp);
        }
        calls.charged += 1;
        if etag.is_none() {
            calls.first += 1;
        }
        match resp.headers.get(http::header::ETAG) {
            Some(etag) => self.etags().store(
                path,
                etag.clone(),
                resp.body.clone(),
                resp.headers.get(http::header::LINK).cloned(),
            ),
            None => self.etags().forget(path),
        }
        Ok(resp)
    }

    fn etags(&self) -> std::sync::MutexGuard<'_, EtagCache> {
        self.inner.etags.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// GETs `first_path` and every following page (`Link: rel="next"`, at most `max_pages`),
    /// collecting the array under `key`. Pages are revalidated with their ETags. A listing with
    /// more pages is [`GithubError::TooManyPages`], never a short answer taken as the whole.
    pub(crate) async fn get_all_pages<T: serde::de::DeserializeOwned>(
        &self,
        ctx: &CallContext,
        first_path: String,
        key: &str,
        max_pages: usize,
    ) -> Result<Vec<T>, GithubError> {
        self.get_all_pages_counted(ctx, first_path, key, max_pages, &mut CallCount::default())
            .await
    }

    /// [`GithubApp::get_all_pages`], counting what it cost into `calls`.
    pub(crate) async fn get_all_pages_counted<T: serde::de::DeserializeOwned>(
        &self,
        ctx: &CallContext,
        first_path: String,
        key: &str,
        max_pages: usize,
        calls: &mut CallCount,
    ) -> Result<Vec<T>, GithubError> {
        let mut path = first_path;
        let mut all = Vec::new();
        for number in 1..=max_pages {
            let resp = self.get_revalidated(ctx, &path, calls).await?;
            let decode = |message: String| {
                self.record(GithubError::Decode {
                    operation: ctx.operation,
                    message,
                })
            };
            let mut page: serde_json::Value =
                serde_json::from_slice(&resp.body).map_err(|e| decode(e.to_string()))?;
            let items = page
                .get_mut(key)
                .map(serde_json::Value::take)
                .ok_or_else(|| decode(format!("no `{key}` in the answer")))?;
            let items: Vec<T> = serde_json::from_value(items).map_err(|e| decode(e.to_string()))?;
            all.extend(items);
            match next_link(&resp.headers) {
                Some(_) if number == max_pages => {
                    return Err(self.record(GithubError::TooManyPages {
                        operation: ctx.operation,
                        max_pages,
                    }));
                }
                Some(next) => path = next,
                None => break,
            }
        }
        Ok(all)
    }
}

/// A transport error's message, walking the source chain (no request data is in it).
fn transport_message(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// The path and query of a `Link: <...>; rel="next"` target, if any.
pub(crate) fn next_link(headers: &HeaderMap) -> Option<String> {
    let link = headers.get(http::header::LINK)?.to_str().ok()?;
    link.split(',').find_map(|part| {
        let (url, params) = part.split_once(';')?;
        let is_next = params.split(';').any(|p| p.trim() == "rel=\"next\"");
        if !is_next {
            return None;
        }
        let url = url.trim().trim_start_matches('<').trim_end_matches('>');
        let uri: http::Uri = url.parse().ok()?;
        uri.path_and_query().map(|pq| pq.as_str().to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Callers spawn these futures on a multi-threaded runtime.
    #[allow(dead_code)]
    fn futures_are_send(
        app: GithubApp,
        scope: super::super::RunnerScope,
        req: super::super::JitRequest,
    ) {
        fn send<T: Send>(_: T) {}
        send(app.installation_token());
        send(app.generate_jit_config(&req));
        send(app.list_runners(&scope));
        send(app.get_runner(&scope, 1));
        send(app.delete_runner(&scope, 1));
        send(app.runner_group_id(&scope, None));
    }

    #[test]
    fn next_link_parsing() {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::LINK,
            HeaderValue::from_static(
                "<https://api.github.com/orgs/o/actions/runners?per_page=2&page=3>; rel=\"next\", <https://api.github.com/orgs/o/actions/runners?per_page=2&page=9>; rel=\"last\"",
            ),
        );
        assert_eq!(
            next_link(&h).as_deref(),
            Some("/orgs/o/actions/runners?per_page=2&page=3")
        );
        h.insert(
            http::header::LINK,
            HeaderValue::from_static("<https://api.github.com/x?page=1>; rel=\"prev\""),
        );
        assert_eq!(next_link(&h), None);
        assert_eq!(next_link(&HeaderMap::new()), None);
    }
}
