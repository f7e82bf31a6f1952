//! One error type for the GitHub client, with a class (what the caller should do) and a stable
//! metric label, and the pure classification of GitHub's answers.

use std::time::Duration;

use http::{HeaderMap, StatusCode};

use super::credentials::CredentialsError;

/// The GitHub call an error came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    TokenExchange,
    ListRunnerGroups,
    GenerateJitConfig,
    GetRunner,
    ListRunners,
    DeleteRunner,
    ListRepositories,
    ListWorkflowRuns,
    ListWorkflowJobs,
    ListRunnerDownloads,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::TokenExchange => "token_exchange",
            Operation::ListRunnerGroups => "list_runner_groups",
            Operation::GenerateJitConfig => "generate_jitconfig",
            Operation::GetRunner => "get_runner",
            Operation::ListRunners => "list_runners",
            Operation::DeleteRunner => "delete_runner",
            Operation::ListRepositories => "list_repositories",
            Operation::ListWorkflowRuns => "list_workflow_runs",
            Operation::ListWorkflowJobs => "list_workflow_jobs",
            Operation::ListRunnerDownloads => "list_runner_downloads",
        }
    }
}

impl std::fmt::Display for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the caller should do about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retrying will not help: fix configuration (credentials, permissions, names).
    Permanent,
    /// Retry with backoff (5xx, timeouts, connection errors).
    Transient,
    /// Retry after the indicated wait.
    RateLimited,
    /// The runner is running a job: try again later.
    Busy,
}

/// Which rate limit GitHub applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateLimitKind {
    /// The hourly quota is used up (`x-ratelimit-remaining: 0`); wait for `x-ratelimit-reset`.
    Primary,
    /// 403 "secondary rate limit" (abuse detection); honour `Retry-After`, else wait a minute.
    Secondary,
    /// 429 Too Many Requests.
    TooManyRequests,
}

/// GitHub client errors. Messages never contain tokens, JWTs, keys or JIT configs.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GithubError {
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error("{operation}: GitHub answered 401 ({message}); {hint}")]
    Unauthorized {
        operation: Operation,
        message: String,
        hint: String,
    },
    #[error("{operation}: GitHub answered 403 ({message}); {hint}")]
    Forbidden {
        operation: Operation,
        message: String,
        hint: String,
    },
    #[error("{operation}: GitHub answered 404; {hint}")]
    NotFound { operation: Operation, hint: String },
    #[error("{operation}: GitHub answered 409 ({message})")]
    Conflict {
        operation: Operation,
        message: String,
    },
    #[error("runner {runner_id} is running a job (422); delete it later")]
    RunnerBusy { runner_id: u64 },
    #[error("{operation}: GitHub rejected the request (422: {message})")]
    Invalid {
        operation: Operation,
        message: String,
    },
    #[error("{operation}: rate limited ({kind:?}), retry after {retry_after:?}")]
    RateLimited {
        operation: Operation,
        kind: RateLimitKind,
        retry_after: Duration,
    },
    #[error("{operation}: GitHub server error {status}")]
    Server { operation: Operation, status: u16 },
    #[error("{operation}: no answer within {after:?}")]
    Timeout {
        operation: Operation,
        after: Duration,
    },
    #[error("{operation}: transport error: {message}")]
    Transport {
        operation: Operation,
        message: String,
    },
    #[error("{operation}: unexpected status {status} ({message})")]
    UnexpectedStatus {
        operation: Operation,
        status: u16,
        message: String,
    },
    #[error("{operation}: could not decode GitHub's answer: {message}")]
    Decode {
        operation: Operation,
        message: String,
    },
    #[error(
        "enterprise runner scope is not supported: GitHub refuses GitHub App installation tokens on enterprise runner endpoints; use organization or repository scope"
    )]
    EnterpriseScopeUnsupported,
    #[error("runner group `{name}` not found in organization `{org}`")]
    RunnerGroupNotFound { org: String, name: String },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A listing with more pages than Imp reads: what was read is not the whole answer, so it
    /// is never taken as one.
    #[error("{operation}: more than {max_pages} pages; the listing was not read to its end")]
    TooManyPages {
        operation: Operation,
        max_pages: usize,
    },
}

impl GithubError {
    pub fn class(&self) -> ErrorClass {
        use GithubError::*;
        match self {
            Server { .. } | Timeout { .. } | Transport { .. } => ErrorClass::Transient,
            RateLimited { .. } => ErrorClass::RateLimited,
            RunnerBusy { .. } => ErrorClass::Busy,
            Credentials(_)
            | Unauthorized { .. }
            | Forbidden { .. }
            | NotFound { .. }
            | Conflict { .. }
            | Invalid { .. }
            | UnexpectedStatus { .. }
            | Decode { .. }
            | TooManyPages { .. }
            | EnterpriseScopeUnsupported
            | RunnerGroupNotFound { .. }
            | InvalidRequest(_) => ErrorClass::Permanent,
        }
    }

    /// Whether retrying (after a wait) may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.class(),
            ErrorClass::Transient | ErrorClass::RateLimited
        )
    }

    /// A stable label for error metrics.
    pub fn metric_label(&self) -> &'static str {
        use GithubError::*;
        match self {
            Credentials(_) => "credentials",
            Unauthorized { .. } => "unauthorized",
            Forbidden { .. } => "forbidden",
            NotFound { .. } => "not_found",
            Conflict { .. } => "conflict",
            RunnerBusy { .. } => "runner_busy",
            Invalid { .. } => "invalid",
            RateLimited { .. } => "rate_limited",
            Server { .. } => "server_error",
            Timeout { .. } => "timeout",
            Transport { .. } => "transport",
            UnexpectedStatus { .. } => "unexpected_status",
            Decode { .. } => "decode",
            EnterpriseScopeUnsupported => "enterprise_scope_unsupported",
            RunnerGroupNotFound { .. } => "runner_group_not_found",
            InvalidRequest(_) => "invalid_request",
            TooManyPages { .. } => "too_many_pages",
        }
    }
}

/// The wait GitHub asks for, from `Retry-After` (seconds).
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

pub(crate) fn header_i64(headers: &HeaderMap, name: &str) -> Option<i64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

/// `x-ratelimit-remaining`, if present.
pub fn rate_limit_remaining(headers: &HeaderMap) -> Option<i64> {
    header_i64(headers, "x-ratelimit-remaining")
}

/// GitHub's `message` field, or a placeholder.
fn message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.get("message")
                .and_then(|m| m.as_str())
                .map(str::to_string)
        })
        .map(|m| m.chars().take(300).collect())
        .unwrap_or_else(|| "no message".to_string())
}

/// Context for hints: which permission the call needs and on what.
#[derive(Debug, Clone)]
pub struct CallContext {
    pub operation: Operation,
    /// e.g. `organization octo-org` or `repository octo-org/octo-repo`.
    pub target: String,
    /// The App permission the call needs, e.g. `organization_self_hosted_runners=write`.
    pub permission: &'static str,
    pub installation_id: u64,
}

/// Classifies a non-success answer. `now_unix` is used for `x-ratelimit-reset`.
pub fn classify(
    ctx: &CallContext,
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    now_unix: i64,
) -> GithubError {
    let operation = ctx.operation;
    let msg = message(body);
    let default_wait = Duration::from_secs(60);
    match status.as_u16() {
        429 => GithubError::RateLimited {
            operation,
            kind: RateLimitKind::TooManyRequests,
            retry_after: retry_after(headers).unwrap_or(default_wait),
        },
        403 if rate_limit_remaining(headers) == Some(0) => {
            let until_reset = header_i64(headers, "x-ratelimit-reset")
                .map(|reset| Duration::from_secs((reset - now_unix).max(1) as u64));
            GithubError::RateLimited {
                operation,
                kind: RateLimitKind::Primary,
                retry_after: retry_after(headers).or(until_reset).unwrap_or(default_wait),
            }
        }
        403 if msg.to_ascii_lowercase().contains("secondary rate limit") || retry_after(headers).is_some() => {
            GithubError::RateLimited {
                operation,
                kind: RateLimitKind::Secondary,
                retry_after: retry_after(headers).unwrap_or(default_wait),
            }
        }
        401 => GithubError::Unauthorized {
            operation,
            message: msg,
            hint: match operation {
                Operation::TokenExchange => format!(
                    "the App JWT was refused: check `app-id` and that `private-key` is the App's current key (installation {})",
                    ctx.installation_id
                ),
                _ => "the installation token was refused (expired, or the installation was suspended)".to_string(),
            },
        },
        403 => {
            let accepted = headers
                .get("x-accepted-github-permissions")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
                .unwrap_or_else(|| ctx.permission.to_string());
            GithubError::Forbidden {
                operation,
                message: msg,
                hint: format!("the GitHub App lacks the permission `{accepted}` on {}", ctx.target),
            }
        }
        404 => GithubError::NotFound {
            operation,
            hint: match operation {
                Operation::TokenExchange => format!(
                    "installation {} not found: the App was uninstalled, suspended or `installation-id` is wrong",
                    ctx.installation_id
                ),
                _ => format!(
                    "{} not found or not visible to the App: check the name, that the App is installed there, and its permission `{}`",
                    ctx.target, ctx.permission
                ),
            },
        },
        409 => GithubError::Conflict { operation, message: msg },
        422 => GithubError::Invalid { operation, message: msg },
        s if s >= 500 => GithubError::Server { operation, status: s },
        s => GithubError::UnexpectedStatus { operation, status: s, message: msg },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn ctx(op: Operation) -> CallContext {
        CallContext {
            operation: op,
            target: "organization octo-org".into(),
            permission: "organization_self_hosted_runners=write",
            installation_id: 9,
        }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn run(status: u16, hs: &[(&'static str, &str)], body: &str) -> GithubError {
        classify(
            &ctx(Operation::GenerateJitConfig),
            StatusCode::from_u16(status).unwrap(),
            &headers(hs),
            body.as_bytes(),
            1000,
        )
    }

    #[test]
    fn rate_limits() {
        let e = run(429, &[("retry-after", "7")], "{}");
        assert!(
            matches!(e, GithubError::RateLimited { kind: RateLimitKind::TooManyRequests, retry_after, .. } if retry_after == Duration::from_secs(7))
        );
        assert_eq!(e.class(), ErrorClass::RateLimited);
        let e = run(
            403,
            &[
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "1030"),
            ],
            r#"{"message":"API rate limit exceeded"}"#,
        );
        assert!(
            matches!(e, GithubError::RateLimited { kind: RateLimitKind::Primary, retry_after, .. } if retry_after == Duration::from_secs(30))
        );
        // A reset in the past still waits a little.
        let e = run(
            403,
            &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "900")],
            "{}",
        );
        assert!(
            matches!(e, GithubError::RateLimited { retry_after, .. } if retry_after == Duration::from_secs(1))
        );
        let e = run(
            403,
            &[("x-ratelimit-remaining", "4000")],
            r#"{"message":"You have exceeded a secondary rate limit. Please wait."}"#,
        );
        assert!(
            matches!(e, GithubError::RateLimited { kind: RateLimitKind::Secondary, retry_after, .. } if retry_after == Duration::from_secs(60))
        );
        let e = run(
            403,
            &[("retry-after", "3")],
            r#"{"message":"You have exceeded a secondary rate limit."}"#,
        );
        assert!(
            matches!(e, GithubError::RateLimited { kind: RateLimitKind::Secondary, retry_after, .. } if retry_after == Duration::from_secs(3))
        );
        assert_eq!(e.metric_label(), "rate_limited");
    }

    #[test]
    fn permanent_errors_carry_permission_hints() {
        let e = run(
            403,
            &[(
                "x-accepted-github-permissions",
                "organization_self_hosted_runners=write",
            )],
            r#"{"message":"Resource not accessible by integration"}"#,
        );
        assert_eq!(e.class(), ErrorClass::Permanent);
        assert_eq!(e.metric_label(), "forbidden");
        let s = e.to_string();
        assert!(
            s.contains("organization_self_hosted_runners=write")
                && s.contains("Resource not accessible"),
            "{s}"
        );
        let e = run(404, &[], r#"{"message":"Not Found"}"#);
        assert_eq!(e.class(), ErrorClass::Permanent);
        assert!(
            e.to_string().contains("organization_self_hosted_runners"),
            "{e}"
        );
        let e = classify(
            &ctx(Operation::TokenExchange),
            StatusCode::NOT_FOUND,
            &HeaderMap::new(),
            b"{}",
            0,
        );
        assert!(e.to_string().contains("installation 9"), "{e}");
        let e = run(401, &[], r#"{"message":"Bad credentials"}"#);
        assert!(matches!(e, GithubError::Unauthorized { .. }));
        assert_eq!(e.class(), ErrorClass::Permanent);
        assert_eq!(run(409, &[], "{}").metric_label(), "conflict");
        assert_eq!(run(422, &[], "{}").class(), ErrorClass::Permanent);
        assert_eq!(
            run(418, &[], "not json").metric_label(),
            "unexpected_status"
        );
    }

    #[test]
    fn server_errors_are_transient() {
        for s in [500, 502, 503, 504] {
            let e = run(s, &[], "");
            assert_eq!(e.class(), ErrorClass::Transient, "{s}");
            assert!(e.is_retryable());
            assert_eq!(e.metric_label(), "server_error");
        }
        let t = GithubError::Timeout {
            operation: Operation::GetRunner,
            after: Duration::from_secs(1),
        };
        assert_eq!(t.class(), ErrorClass::Transient);
        assert_eq!(
            GithubError::RunnerBusy { runner_id: 1 }.class(),
            ErrorClass::Busy
        );
        assert!(!GithubError::RunnerBusy { runner_id: 1 }.is_retryable());
        assert_eq!(
            GithubError::EnterpriseScopeUnsupported.class(),
            ErrorClass::Permanent
        );
    }
}
