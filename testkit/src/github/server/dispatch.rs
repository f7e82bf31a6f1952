//! The workflow endpoints: list/get workflows, `workflow_dispatch`, a workflow's runs, one run, one
//! job (GitHub's REST shapes), and the admin calls that register a workflow file and create a
//! dispatch token. A child of `server` so it shares its error type, auth and pagination.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::Utc;
use serde::Deserialize;
use serde_json::{Value, json};

use super::super::jobs::{JobSpec, SimJob, random_token};
use super::super::model::SimScope;
use super::super::shared::Shared;
use super::super::workflows::{SimRun, WorkflowFile, run_json};
use super::{
    ApiError, ApiResult, PageQuery, S, auth_value, check_repo, invalid, json_response,
    paged_response, paginate, require_permission, require_token,
};

/// The REST routes (behind the fault and rate-limit layer).
pub(super) fn api_routes() -> Router<Arc<Shared>> {
    Router::new()
        .route(
            "/repos/{owner}/{repo}/actions/workflows",
            get(list_workflows),
        )
        .route(
            "/repos/{owner}/{repo}/actions/workflows/{workflow}",
            get(get_workflow),
        )
        .route(
            "/repos/{owner}/{repo}/actions/workflows/{workflow}/dispatches",
            post(dispatch),
        )
        .route(
            "/repos/{owner}/{repo}/actions/workflows/{workflow}/runs",
            get(workflow_runs),
        )
        .route("/repos/{owner}/{repo}/actions/runs/{run_id}", get(get_run))
        .route("/repos/{owner}/{repo}/actions/jobs/{job_id}", get(get_job))
}

/// The admin routes.
pub(super) fn admin_routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/_admin/workflows", post(admin_add_workflow))
        .route("/_admin/user-tokens", post(admin_user_token))
}

/// A dispatch token, or an installation token with `actions` at `write` (or `read` for reads).
pub(super) fn authorize_actions(
    shared: &Shared,
    headers: &HeaderMap,
    write: bool,
) -> Result<(), ApiError> {
    if let Some(t) = auth_value(headers)
        && shared.model().workflows.user_tokens.contains(&t)
    {
        return Ok(());
    }
    require_token(shared, headers)?;
    require_permission(shared, "actions", write)
}

fn repo_of(shared: &Shared, owner: &str, repo: &str) -> Result<String, ApiError> {
    match check_repo(shared, owner, repo)? {
        SimScope::Repository(full) => Ok(full),
        SimScope::Organization(_) => Err(ApiError::not_found()),
    }
}

async fn list_workflows(
    State(shared): S,
    Path((owner, repo)): Path<(String, String)>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> ApiResult {
    authorize_actions(&shared, &headers, false)?;
    let full = repo_of(&shared, &owner, &repo)?;
    let items: Vec<Value> = shared
        .model()
        .workflows
        .defs
        .iter()
        .filter(|w| w.repository.eq_ignore_ascii_case(&full))
        .map(|w| w.to_github_json())
        .collect();
    let total = items.len();
    let path = format!("/repos/{owner}/{repo}/actions/workflows");
    let (page, link) = paginate(&shared, &path, &q, items);
    Ok(paged_response("workflows", total, page, link))
}

async fn get_workflow(
    State(shared): S,
    Path((owner, repo, workflow)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    authorize_actions(&shared, &headers, false)?;
    let full = repo_of(&shared, &owner, &repo)?;
    let m = shared.model();
    let w = m
        .workflows
        .find(&full, &workflow)
        .ok_or_else(ApiError::not_found)?;
    Ok(json_response(StatusCode::OK, w.to_github_json()))
}

#[derive(Deserialize)]
struct DispatchBody {
    #[serde(rename = "ref")]
    git_ref: Option<String>,
    #[serde(default)]
    inputs: BTreeMap<String, Value>,
    #[serde(default)]
    return_run_details: bool,
}

/// `POST .../dispatches`: 204, or with `return_run_details` 200 and the run's id and URLs (GitHub,
/// since February 2026). Creates the run and queues each of its jobs (a `queued` webhook each).
async fn dispatch(
    State(shared): S,
    Path((owner, repo, workflow)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> ApiResult {
    authorize_actions(&shared, &headers, true)?;
    let full = repo_of(&shared, &owner, &repo)?;
    let body: DispatchBody = serde_json::from_slice(&body)
        .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "Problems parsing JSON"))?;
    let git_ref = body
        .git_ref
        .filter(|r| !r.is_empty())
        .ok_or_else(|| invalid("\"ref\" wasn't supplied."))?;
    // GitHub's inputs are strings (booleans and numbers are accepted and stringified).
    let inputs: BTreeMap<String, String> = body
        .inputs
        .into_iter()
        .map(|(k, v)| {
            let s = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            (k, s)
        })
        .collect();
    let jobs: Vec<SimJob> = {
        let mut m = shared.model();
        let w = m
            .workflows
            .find(&full, &workflow)
            .cloned()
            .ok_or_else(ApiError::not_found)?;
        if !w.file.dispatchable {
            return Err(invalid(
                "Workflow does not have 'workflow_dispatch' trigger",
            ));
        }
        w.file.check_inputs(&inputs).map_err(|e| invalid(&e))?;
        let run_id = m.workflows.next_run_id();
        let branch = git_ref
            .strip_prefix("refs/heads/")
            .unwrap_or(&git_ref)
            .to_owned();
        m.workflows.runs.insert(
            run_id,
            SimRun {
                id: run_id,
                workflow_id: w.id,
                repository: full.clone(),
                name: w.file.name.clone(),
                display_title: w.file.display_title(&inputs),
                path: w.path.clone(),
                event: "workflow_dispatch".into(),
                head_branch: branch.clone(),
                created_at: Utc::now(),
            },
        );
        let mut jobs = Vec::new();
        for def in &w.file.jobs {
            let id = m.next_job_id;
            m.next_job_id += 1;
            let spec = JobSpec {
                labels: def.runs_on.clone(),
                repository: Some(full.clone()),
                name: Some(def.name.clone()),
                workflow_name: Some(w.file.name.clone()),
                run_id: Some(run_id),
                steps: def.steps.clone(),
            };
            let mut job = SimJob::queued(id, spec, &full);
            job.head_branch = branch.clone();
            m.jobs.insert(id, job.clone());
            jobs.push(job);
        }
        jobs
    };
    let run_id = jobs[0].run_id;
    for job in &jobs {
        shared.emit(job, "queued");
    }
    if !body.return_run_details {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Ok(json_response(
        StatusCode::OK,
        json!({
            "workflow_run_id": run_id,
            "run_url": format!("{}/repos/{full}/actions/runs/{run_id}", shared.base_url),
            "html_url": format!("https://github.com/{full}/actions/runs/{run_id}"),
        }),
    ))
}

#[derive(Deserialize)]
struct RunsQuery {
    event: Option<String>,
    status: Option<String>,
    per_page: Option<usize>,
    page: Option<usize>,
}

/// A dispatched run as JSON, following its jobs (None for a run no dispatch created).
fn dispatched_run_json(shared: &Shared, run_id: u64) -> Option<Value> {
    let m = shared.model();
    let run = m.workflows.runs.get(&run_id)?;
    let jobs: Vec<&SimJob> = m.jobs.values().filter(|j| j.run_id == run_id).collect();
    Some(run_json(run, &jobs))
}

async fn workflow_runs(
    State(shared): S,
    Path((owner, repo, workflow)): Path<(String, String, String)>,
    Query(q): Query<RunsQuery>,
    headers: HeaderMap,
) -> ApiResult {
    authorize_actions(&shared, &headers, false)?;
    let full = repo_of(&shared, &owner, &repo)?;
    let ids: Vec<u64> = {
        let m = shared.model();
        let w = m
            .workflows
            .find(&full, &workflow)
            .ok_or_else(ApiError::not_found)?;
        m.workflows
            .runs
            .values()
            .rev() // newest first, as GitHub lists runs
            .filter(|r| r.workflow_id == w.id)
            .filter(|r| q.event.as_deref().is_none_or(|e| e == r.event))
            .map(|r| r.id)
            .collect()
    };
    let runs: Vec<Value> = ids
        .into_iter()
        .filter_map(|id| dispatched_run_json(&shared, id))
        .filter(|r| q.status.as_deref().is_none_or(|s| r["status"] == s))
        .collect();
    let total = runs.len();
    let pq = PageQuery {
        per_page: q.per_page,
        page: q.page,
    };
    let path = format!("/repos/{owner}/{repo}/actions/workflows/{workflow}/runs");
    let (page, link) = paginate(&shared, &path, &pq, runs);
    Ok(paged_response("workflow_runs", total, page, link))
}

async fn get_run(
    State(shared): S,
    Path((owner, repo, run_id)): Path<(String, String, u64)>,
    headers: HeaderMap,
) -> ApiResult {
    authorize_actions(&shared, &headers, false)?;
    let full = repo_of(&shared, &owner, &repo)?;
    match dispatched_run_json(&shared, run_id) {
        Some(run) if run["url"].as_str().is_some_and(|u| u.contains(&full)) => {
            Ok(json_response(StatusCode::OK, run))
        }
        _ => Err(ApiError::not_found()),
    }
}

async fn get_job(
    State(shared): S,
    Path((owner, repo, job_id)): Path<(String, String, u64)>,
    headers: HeaderMap,
) -> ApiResult {
    authorize_actions(&shared, &headers, false)?;
    let full = repo_of(&shared, &owner, &repo)?;
    let job = shared
        .model()
        .jobs
        .get(&job_id)
        .filter(|j| j.repository.eq_ignore_ascii_case(&full))
        .cloned()
        .ok_or_else(ApiError::not_found)?;
    let mut payload = super::super::payload::workflow_job_payload(
        &job,
        "",
        &shared.config.org,
        shared.config.installation_id,
    );
    Ok(json_response(
        StatusCode::OK,
        payload["workflow_job"].take(),
    ))
}

#[derive(Deserialize)]
struct AddWorkflow {
    /// `owner/repo`; default the simulator's first repository.
    repository: Option<String>,
    /// `.github/workflows/<file>`.
    path: String,
    /// The file's YAML.
    content: String,
}

async fn admin_add_workflow(State(shared): S, Json(b): Json<AddWorkflow>) -> ApiResult {
    let repository = b
        .repository
        .or_else(|| shared.config.repos.first().cloned())
        .ok_or_else(|| invalid("no repository"))?;
    let file = WorkflowFile::parse(&b.path, &b.content).map_err(|e| invalid(&e.to_string()))?;
    let mut m = shared.model();
    let id = m.workflows.add(&repository, &b.path, file);
    let w = m.workflows.find(&repository, &id.to_string()).cloned();
    Ok(json_response(
        StatusCode::CREATED,
        w.map(|w| w.to_github_json()).unwrap_or_default(),
    ))
}

async fn admin_user_token(State(shared): S) -> Response {
    let token = format!("github_pat_{}", random_token(40));
    shared.model().workflows.user_tokens.insert(token.clone());
    json_response(StatusCode::CREATED, json!({ "token": token }))
}
