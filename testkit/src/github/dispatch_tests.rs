//! Workflow dispatch at the HTTP level: who may dispatch, GitHub's 204/200/404/422 answers, the
//! queued webhook of each job, and run/job status following the jobs.

use std::time::Duration;

use ::http::{Method, StatusCode};
use serde_json::{Value, json};

use super::http::{HttpClient, HttpResponse};
use super::{GithubSim, SimConfig, WebhookSink};

const SMOKE: &str = include_str!("../../../smoke/workflow.yaml");
const PATH: &str = ".github/workflows/imp-smoke.yaml";
const REPO: &str = "/repos/octo-org/octo-repo";

async fn req(
    sim: &GithubSim,
    method: Method,
    path: &str,
    auth: &str,
    body: Option<Value>,
) -> HttpResponse {
    HttpClient::default()
        .json(
            method,
            &format!("{}{path}", sim.base_url()),
            &[("authorization", format!("Bearer {auth}"))],
            body.as_ref(),
        )
        .await
        .unwrap()
}

#[tokio::test]
async fn a_dispatch_queues_the_workflows_jobs_and_the_run_follows_them() {
    let sink = WebhookSink::start().await.unwrap();
    let sim = GithubSim::start(SimConfig {
        webhook_url: Some(sink.url().to_string()),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let wf = sim.add_workflow(None, PATH, SMOKE).unwrap();
    let token = sim.user_token();
    let dispatches = format!("{REPO}/actions/workflows/imp-smoke.yaml/dispatches");

    // Auth and input errors, as GitHub answers them.
    let r = req(
        &sim,
        Method::POST,
        &dispatches,
        "nope",
        Some(json!({"ref": "main"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = req(&sim, Method::POST, &dispatches, &token, Some(json!({}))).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{:?}", r.json());
    assert!(r.json()["message"].as_str().unwrap().contains("\"ref\""));
    let r = req(
        &sim,
        Method::POST,
        &dispatches,
        &token,
        Some(json!({"ref": "main", "inputs": {"x": "1"}})),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("Unexpected inputs")
    );
    let other = format!("{REPO}/actions/workflows/other.yaml/dispatches");
    let r = req(
        &sim,
        Method::POST,
        &other,
        &token,
        Some(json!({"ref": "main"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    sim.add_workflow(
        None,
        ".github/workflows/push.yaml",
        "on: push\njobs: {a: {runs-on: x}}\n",
    )
    .unwrap();
    let push = format!("{REPO}/actions/workflows/push.yaml/dispatches");
    let r = req(
        &sim,
        Method::POST,
        &push,
        &token,
        Some(json!({"ref": "main"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(sim.jobs().is_empty(), "a refused dispatch queues nothing");

    // The workflow by id and by file name.
    let r = req(
        &sim,
        Method::GET,
        &format!("{REPO}/actions/workflows/{wf}"),
        &token,
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["path"], PATH);
    let r = req(
        &sim,
        Method::GET,
        &format!("{REPO}/actions/workflows"),
        &token,
        None,
    )
    .await;
    assert_eq!(r.json()["total_count"], 2);

    // Without return_run_details: 204 and no body (GitHub's classic answer).
    let r = req(
        &sim,
        Method::POST,
        &dispatches,
        &token,
        Some(json!({"ref": "main"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(r.body.is_empty());
    // With it: 200 and the run's id.
    let r = req(
        &sim,
        Method::POST,
        &dispatches,
        &token,
        Some(json!({"ref": "refs/heads/dev", "return_run_details": true})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let run_id = r.json()["workflow_run_id"].as_u64().unwrap();
    assert!(
        r.json()["run_url"]
            .as_str()
            .unwrap()
            .ends_with(&format!("/actions/runs/{run_id}"))
    );

    let runs = sim.dispatched_runs();
    assert_eq!(runs.len(), 2);
    let jobs = sim.jobs();
    assert_eq!(
        jobs.len(),
        2,
        "one job per run (the smoke workflow has one)"
    );
    let job = jobs.iter().find(|j| j.run_id == run_id).unwrap().clone();
    assert_eq!(job.labels, vec!["self-hosted", "imp"]);
    assert_eq!(job.name, "hello");
    assert_eq!(job.workflow_name, "imp-smoke");
    assert_eq!(job.head_branch, "dev");

    // Each job's queued webhook went to the configured target.
    let hooks = sink.wait_for(2, Duration::from_secs(5)).await;
    let queued: Vec<(u64, String)> = hooks.iter().map(|h| h.job_action()).collect();
    assert!(
        queued.contains(&(job.id, "queued".to_string())),
        "{queued:?}"
    );
    assert_eq!(hooks[0].header("x-github-event"), Some("workflow_job"));

    // The run and its job follow the job's state.
    let run_path = format!("{REPO}/actions/runs/{run_id}");
    let job_path = format!("{REPO}/actions/jobs/{}", job.id);
    let status = |path: String| {
        let (sim, token) = (&sim, token.clone());
        async move { req(sim, Method::GET, &path, &token, None).await.json() }
    };
    let run = status(run_path.clone()).await;
    assert_eq!(
        (run["status"].as_str(), run["event"].as_str()),
        (Some("queued"), Some("workflow_dispatch"))
    );
    assert_eq!(run["workflow_id"], wf);
    assert_eq!(run["display_title"], "imp-smoke");
    sim.start_job(job.id, "imp-runner-1").unwrap();
    assert_eq!(status(run_path.clone()).await["status"], "in_progress");
    let j = status(job_path.clone()).await;
    assert_eq!(
        (j["status"].as_str(), j["runner_name"].as_str()),
        (Some("in_progress"), Some("imp-runner-1"))
    );
    sim.complete_job(job.id, "success").unwrap();
    let run = status(run_path.clone()).await;
    assert_eq!(
        (run["status"].as_str(), run["conclusion"].as_str()),
        (Some("completed"), Some("success"))
    );
    let j = status(job_path).await;
    assert!(j["completed_at"].is_string() && j["started_at"].is_string());
    let r = req(&sim, Method::GET, &format!("{run_path}/jobs"), &token, None).await;
    assert_eq!(r.json()["jobs"][0]["id"], job.id);

    // The workflow's runs, newest first, filtered by event and status.
    let list = |q: &'static str| {
        let (sim, token) = (&sim, token.clone());
        async move {
            let r = req(
                sim,
                Method::GET,
                &format!("{REPO}/actions/workflows/imp-smoke.yaml/runs{q}"),
                &token,
                None,
            )
            .await;
            r.json()["workflow_runs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["id"].as_u64().unwrap())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        list("?event=workflow_dispatch").await.first(),
        Some(&run_id)
    );
    assert_eq!(list("?status=completed").await, vec![run_id]);
    assert!(list("?event=push").await.is_empty());
}

#[tokio::test]
async fn installation_tokens_need_actions_write_to_dispatch_and_admin_registration_checks_the_file()
{
    let sim = GithubSim::start(SimConfig::default()).await.unwrap();
    let admin = sim.admin();
    let err = admin
        .add_workflow(
            None,
            ".github/workflows/bad.yaml",
            "on: workflow_dispatch\njobs: {a: {}}\n",
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("jobs.a.runs-on: missing"), "{err}");
    admin.add_workflow(None, PATH, SMOKE).await.unwrap();
    // An installation token of the App (actions: read) may read runs but not dispatch.
    let jwt = super::jwt::sign_jwt(
        &sim.app_key(),
        &json!({"iat": chrono::Utc::now().timestamp() - 60, "exp": chrono::Utc::now().timestamp() + 540, "iss": sim.app_id()}),
    );
    let path = format!("/app/installations/{}/access_tokens", sim.installation_id());
    let inst = req(&sim, Method::POST, &path, &jwt, None).await.json()["token"]
        .as_str()
        .unwrap()
        .to_string();
    let dispatches = format!("{REPO}/actions/workflows/imp-smoke.yaml/dispatches");
    let r = req(
        &sim,
        Method::POST,
        &dispatches,
        &inst,
        Some(json!({"ref": "main"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.headers["x-accepted-github-permissions"], "actions=write");
    let r = req(
        &sim,
        Method::GET,
        &format!("{REPO}/actions/workflows/imp-smoke.yaml/runs"),
        &inst,
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    sim.set_permission("actions", Some("write"));
    let r = req(
        &sim,
        Method::POST,
        &dispatches,
        &inst,
        Some(json!({"ref": "main"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    // A token from the admin API works like one from the handle.
    let user = admin.user_token().await.unwrap();
    let r = req(
        &sim,
        Method::POST,
        &dispatches,
        &user,
        Some(json!({"ref": "main"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(sim.jobs().len(), 2);
}
