//! The intake's one error enum.

use std::time::Duration;

/// Which call failed (error messages and metric labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    RegistrationToken,
    AdminConnection,
    RunnerGroup,
    GetScaleSet,
    CreateScaleSet,
    CreateSession,
    RefreshSession,
    DeleteSession,
    GetMessage,
    DeleteMessage,
    AcquireJobs,
    GenerateJitConfig,
}

impl Call {
    pub fn as_str(self) -> &'static str {
        match self {
            Call::RegistrationToken => "registration_token",
            Call::AdminConnection => "admin_connection",
            Call::RunnerGroup => "runner_group",
            Call::GetScaleSet => "get_scale_set",
            Call::CreateScaleSet => "create_scale_set",
            Call::CreateSession => "create_session",
            Call::RefreshSession => "refresh_session",
            Call::DeleteSession => "delete_session",
            Call::GetMessage => "get_message",
            Call::DeleteMessage => "delete_message",
            Call::AcquireJobs => "acquire_jobs",
            Call::GenerateJitConfig => "generate_jitconfig",
        }
    }
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything that can go wrong in the intake.
#[derive(Debug, thiserror::Error)]
pub enum ScaleSetError {
    /// The REST part (registration token) failed; GitHub's classified error.
    #[error("registration token: {0}")]
    Github(crate::github::GithubError),
    /// Another owner's session is live on the scale set (409); it must expire first.
    #[error("create_session: GitHub answered 409 ({message})")]
    SessionConflict { message: String },
    #[error("{call}: GitHub answered 401 (token refused)")]
    Unauthorized { call: Call },
    #[error("{call}: GitHub answered 403 ({message})")]
    RunnerVersionDeprecated { call: Call, message: String },
    #[error("{call}: GitHub answered 404 ({message})")]
    NotFound { call: Call, message: String },
    /// A runner of that name exists (`AgentExistsException`).
    #[error("generate_jitconfig: GitHub answered 409 ({message})")]
    RunnerExists { message: String },
    #[error("{call}: GitHub answered 409 ({message})")]
    Conflict { call: Call, message: String },
    #[error("{call}: GitHub server error {status}")]
    Server { call: Call, status: u16 },
    #[error("{call}: unexpected status {status} ({message})")]
    UnexpectedStatus {
        call: Call,
        status: u16,
        message: String,
    },
    #[error("{call}: no answer within {after:?}")]
    Timeout { call: Call, after: Duration },
    #[error("{call}: transport error: {message}")]
    Transport { call: Call, message: String },
    #[error("{call}: could not decode GitHub's answer: {message}")]
    Decode { call: Call, message: String },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Reading or writing the ledger ConfigMap failed.
    #[error("job ledger: {0}")]
    Ledger(String),
    /// The pool's intake has no scale set or admin connection yet (nothing to mint through).
    #[error("scale set `{0}` is not connected yet")]
    NotConnected(String),
}

impl ScaleSetError {
    /// A stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ScaleSetError::Github(e) => e.metric_label(),
            ScaleSetError::SessionConflict { .. } => "session_conflict",
            ScaleSetError::Unauthorized { .. } => "unauthorized",
            ScaleSetError::RunnerVersionDeprecated { .. } => "runner_version_deprecated",
            ScaleSetError::NotFound { .. } => "not_found",
            ScaleSetError::RunnerExists { .. } => "runner_exists",
            ScaleSetError::Conflict { .. } => "conflict",
            ScaleSetError::Server { .. } => "server_error",
            ScaleSetError::UnexpectedStatus { .. } => "unexpected_status",
            ScaleSetError::Timeout { .. } => "timeout",
            ScaleSetError::Transport { .. } => "transport",
            ScaleSetError::Decode { .. } => "decode",
            ScaleSetError::InvalidRequest(_) => "invalid_request",
            ScaleSetError::Ledger(_) => "ledger",
            ScaleSetError::NotConnected(_) => "not_connected",
        }
    }
}
