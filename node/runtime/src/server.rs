//! The node-local HTTP/JSON API of imp-runtime (ARCHITECTURE §4), served on a Unix socket.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use imp_api::names::reason;

use crate::api::{
    Capacity, ErrorBody, LinkStats, MAX_BODY_BYTES, PrebuildRequest, PrebuildStatus, Readiness,
    ResumeInfo, SnapshotInfo, SnapshotRequest, SuspendInfo, TemplateDryRun, TemplateList,
    TemplateRequest, TemplateStatus, VmList, VmSpec, VmStatus, VsockInfo,
};
use crate::runtime::{Ensured, Runtime, RuntimeError};

struct ApiError(StatusCode, ErrorBody);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(self.1)).into_response()
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> Self {
        let status = match &e {
            RuntimeError::InvalidUid(_)
            | RuntimeError::InvalidSpec(_)
            | RuntimeError::InvalidTemplateKey(_) => StatusCode::BAD_REQUEST,
            // The request is fine; this node has no room for it now.
            RuntimeError::DiskBudgetExceeded { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            RuntimeError::NotFound(_) => StatusCode::NOT_FOUND,
            RuntimeError::SpecConflict(_)
            | RuntimeError::NotRunning { .. }
            | RuntimeError::NoNetwork(_)
            | RuntimeError::NotSuspended { .. }
            | RuntimeError::SnapshotUnsupported { .. } => StatusCode::CONFLICT,
            // The VM could not be started on this host: the agent reads `error` for the reason.
            RuntimeError::Boot { .. }
            | RuntimeError::Failed { .. }
            | RuntimeError::NetworkSetupFailed { .. }
            | RuntimeError::CgroupSetupFailed { .. }
            | RuntimeError::QemuStart { .. }
            | RuntimeError::Jail { .. }
            | RuntimeError::Jailer { .. }
            | RuntimeError::JailerPreflight(_)
            | RuntimeError::DiskSetupFailed { .. }
            | RuntimeError::WritableDrive { .. }
            | RuntimeError::Rootfs { .. }
            | RuntimeError::Prebuild { .. }
            | RuntimeError::StartCancelled { .. }
            | RuntimeError::ReidentifyFailed { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            RuntimeError::LinkStats { .. }
            | RuntimeError::Snapshot { .. }
            | RuntimeError::Resume { .. }
            | RuntimeError::Inventory(_)
            | RuntimeError::StateDir { .. }
            | RuntimeError::RootfsStore(_)
            | RuntimeError::WritableTemplates(_)
            | RuntimeError::Cgroups(_)
            | RuntimeError::Templates(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(
            status,
            ErrorBody {
                error: e.reason().to_string(),
                message: e.to_string(),
                field: e.field().map(str::to_string),
            },
        )
    }
}

fn bad_json(rej: JsonRejection) -> ApiError {
    let too_large = rej.status() == StatusCode::PAYLOAD_TOO_LARGE;
    ApiError(
        if too_large {
            StatusCode::PAYLOAD_TOO_LARGE
        } else {
            StatusCode::BAD_REQUEST
        },
        ErrorBody {
            error: if too_large {
                reason::BODY_TOO_LARGE.into()
            } else {
                reason::INVALID_BODY.into()
            },
            message: if too_large {
                format!("the request body is larger than {MAX_BODY_BYTES} bytes")
            } else {
                rej.body_text()
            },
            field: Some("body".into()),
        },
    )
}

type Rt = State<Arc<Runtime>>;

async fn put_vm(
    State(rt): Rt,
    UrlPath(uid): UrlPath<String>,
    body: Result<Json<VmSpec>, JsonRejection>,
) -> Result<(StatusCode, Json<VmStatus>), ApiError> {
    let Json(spec) = body.map_err(bad_json)?;
    let (ensured, status) = rt.ensure_running(&uid, spec).await?;
    let code = match ensured {
        Ensured::Created => StatusCode::CREATED,
        Ensured::Existing => StatusCode::OK,
    };
    Ok((code, Json(status)))
}

async fn get_vm(State(rt): Rt, UrlPath(uid): UrlPath<String>) -> Result<Json<VmStatus>, ApiError> {
    Ok(Json(rt.inspect(&uid).await?))
}

async fn list_vms(State(rt): Rt) -> Result<Json<VmList>, ApiError> {
    Ok(Json(VmList {
        vms: rt.list().await?,
    }))
}

async fn delete_vm(State(rt): Rt, UrlPath(uid): UrlPath<String>) -> Result<StatusCode, ApiError> {
    rt.delete(&uid).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn linkstats(
    State(rt): Rt,
    UrlPath(uid): UrlPath<String>,
) -> Result<Json<LinkStats>, ApiError> {
    Ok(Json(rt.linkstats(&uid).await?))
}

async fn vsock(State(rt): Rt, UrlPath(uid): UrlPath<String>) -> Result<Json<VsockInfo>, ApiError> {
    Ok(Json(VsockInfo {
        path: rt.vsock_path(&uid).await?,
        guest_agent_port: imp_guest::protocol::AGENT_VSOCK_PORT,
    }))
}

async fn snapshot(
    State(rt): Rt,
    UrlPath(uid): UrlPath<String>,
    body: Option<Json<SnapshotRequest>>,
) -> Result<Json<SnapshotInfo>, ApiError> {
    let resume = body.and_then(|Json(b)| b.resume).unwrap_or(true);
    Ok(Json(rt.snapshot(&uid, resume).await?))
}

/// Runs in a task of its own: a client that goes away mid-snapshot does not leave the VM
/// half suspended.
async fn suspend(
    State(rt): Rt,
    UrlPath(uid): UrlPath<String>,
) -> Result<Json<SuspendInfo>, ApiError> {
    let done = tokio::spawn(async move { rt.suspend(&uid).await })
        .await
        .map_err(task_failed)??;
    Ok(Json(done))
}

async fn resume(
    State(rt): Rt,
    UrlPath(uid): UrlPath<String>,
) -> Result<Json<ResumeInfo>, ApiError> {
    let done = tokio::spawn(async move { rt.resume(&uid).await })
        .await
        .map_err(task_failed)??;
    Ok(Json(done))
}

fn task_failed(e: tokio::task::JoinError) -> ApiError {
    ApiError(
        StatusCode::INTERNAL_SERVER_ERROR,
        ErrorBody {
            error: reason::SNAPSHOT_FAILED.into(),
            message: format!("the suspend/resume task failed: {e}"),
            field: None,
        },
    )
}

/// The build runs in a task of its own: an agent that goes away (a restart) does not abandon it.
async fn prebuild(
    State(rt): Rt,
    body: Result<Json<PrebuildRequest>, JsonRejection>,
) -> Result<Json<PrebuildStatus>, ApiError> {
    let Json(req) = body.map_err(bad_json)?;
    let built = tokio::spawn(async move { rt.prebuild(&req).await })
        .await
        .map_err(|e| {
            ApiError(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorBody {
                    error: reason::ROOTFS_BUILD_FAILED.into(),
                    message: format!("the pre-build task failed: {e}"),
                    field: None,
                },
            )
        })??;
    Ok(Json(built))
}

/// `POST /v1/templates`: answered at once, the build runs in the background.
async fn ensure_template(
    State(rt): Rt,
    body: Result<Json<TemplateRequest>, JsonRejection>,
) -> Result<Json<TemplateStatus>, ApiError> {
    let Json(req) = body.map_err(bad_json)?;
    Ok(Json(rt.ensure_template(&req.spec).await?))
}

/// `POST /v1/templates/dry-run`: what a `POST /v1/templates` would do, without doing it.
async fn template_dry_run(
    State(rt): Rt,
    body: Result<Json<TemplateRequest>, JsonRejection>,
) -> Result<Json<TemplateDryRun>, ApiError> {
    let Json(req) = body.map_err(bad_json)?;
    Ok(Json(rt.template_dry_run(&req.spec).await?))
}

async fn list_templates(State(rt): Rt) -> Json<TemplateList> {
    Json(TemplateList {
        templates: rt.templates(),
    })
}

async fn delete_template(
    State(rt): Rt,
    UrlPath(key): UrlPath<String>,
) -> Result<StatusCode, ApiError> {
    rt.delete_template(&key).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn capacity(State(rt): Rt) -> Result<Json<Capacity>, ApiError> {
    let (used, budget) = rt.disk_usage().await?;
    let (template_budget, template_used, builds) = rt.template_capacity();
    Ok(Json(Capacity {
        writable_budget_bytes: budget,
        writable_used_bytes: used,
        template_budget_bytes: template_budget,
        template_used_bytes: template_used,
        template_builds: builds,
    }))
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(rt): Rt) -> (StatusCode, Json<Readiness>) {
    let r = rt.readiness();
    let code = if r.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(r))
}

pub async fn metrics(State(rt): Rt) -> impl IntoResponse {
    rt.readiness();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        rt.metrics.encode(),
    )
}

async fn not_found() -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        ErrorBody {
            error: reason::NO_SUCH_ROUTE.into(),
            message: "no such route; the API is under /v1".into(),
            field: None,
        },
    )
}

pub fn router(rt: Arc<Runtime>) -> Router {
    Router::new()
        .route("/v1/vms", get(list_vms))
        .route("/v1/capacity", get(capacity))
        .route("/v1/images", post(prebuild))
        .route("/v1/templates", get(list_templates).post(ensure_template))
        .route("/v1/templates/dry-run", post(template_dry_run))
        .route(
            "/v1/templates/{key}",
            axum::routing::delete(delete_template),
        )
        .route("/v1/vms/{uid}", get(get_vm).put(put_vm).delete(delete_vm))
        .route("/v1/vms/{uid}/linkstats", get(linkstats))
        .route("/v1/vms/{uid}/vsock", get(vsock))
        .route("/v1/vms/{uid}/snapshot", post(snapshot))
        .route("/v1/vms/{uid}/suspend", post(suspend))
        .route("/v1/vms/{uid}/resume", post(resume))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(rt)
}

/// Bind the API socket (replacing a stale one left by a crash), mode 0660.
pub fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok(listener)
}
