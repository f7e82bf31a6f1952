//! The `workflow_job` webhook's body and the event the simulator queues for delivery: pure, so
//! the shared state that queues events and the worker that delivers them both import it.

use serde_json::{Value, json};

use super::jobs::{JobStatus, SimJob};

fn user(login: &str, id: u64, kind: &str) -> Value {
    json!({
        "login": login,
        "id": id,
        "node_id": format!("MDQ6VXNlcj{id}"),
        "avatar_url": format!("https://avatars.githubusercontent.com/u/{id}?v=4"),
        "gravatar_id": "",
        "url": format!("https://api.github.com/users/{login}"),
        "html_url": format!("https://github.com/{login}"),
        "type": kind,
        "site_admin": false,
    })
}

/// The `workflow_job` webhook body for `job` with `action` (queued, in_progress, completed).
pub fn workflow_job_payload(job: &SimJob, action: &str, org: &str, installation_id: u64) -> Value {
    let (owner, repo) = job
        .repository
        .split_once('/')
        .unwrap_or((org, &job.repository));
    let api = format!("https://api.github.com/repos/{}", job.repository);
    let html = format!("https://github.com/{}", job.repository);
    let ts = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map(|t| Value::String(t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)))
            .unwrap_or(Value::Null)
    };
    let status = match job.status {
        JobStatus::Queued => "queued",
        JobStatus::InProgress => "in_progress",
        JobStatus::Completed => "completed",
    };
    let steps = match job.status {
        JobStatus::Queued => json!([]),
        JobStatus::InProgress => json!([{
            "name": "Set up job", "status": "in_progress", "conclusion": null, "number": 1,
            "started_at": ts(job.started_at), "completed_at": null,
        }]),
        JobStatus::Completed => json!([{
            "name": "Set up job", "status": "completed", "conclusion": job.conclusion, "number": 1,
            "started_at": ts(job.started_at), "completed_at": ts(job.completed_at),
        }]),
    };
    let repo_id = 186_853_002u64;
    let mut body = json!({
        "action": action,
        "workflow_job": {
            "id": job.id,
            "run_id": job.run_id,
            "run_url": format!("{api}/actions/runs/{}", job.run_id),
            "run_attempt": 1,
            "node_id": format!("CR_kwDO{}", job.id),
            "head_sha": job.head_sha,
            "head_branch": job.head_branch,
            "url": format!("{api}/actions/jobs/{}", job.id),
            "html_url": format!("{html}/actions/runs/{}/job/{}", job.run_id, job.id),
            "status": status,
            "conclusion": job.conclusion,
            "started_at": ts(job.started_at.or(Some(job.created_at))),
            "created_at": ts(Some(job.created_at)),
            "completed_at": ts(job.completed_at),
            "name": job.name,
            "steps": steps,
            "check_run_url": format!("{api}/check-runs/{}", job.id),
            "labels": job.labels,
            "runner_id": job.runner_id,
            "runner_name": job.runner_name,
            "runner_group_id": job.runner_group_id,
            "runner_group_name": job.runner_group_name,
            "workflow_name": job.workflow_name,
        },
        "repository": {
            "id": repo_id,
            "node_id": "MDEwOlJlcG9zaXRvcnkxODY4NTMwMDI=",
            "name": repo,
            "full_name": job.repository,
            "private": true,
            "owner": user(owner, 38_302_899, "Organization"),
            "html_url": html,
            "description": null,
            "fork": false,
            "url": api,
            "created_at": "2019-05-15T15:19:25Z",
            "updated_at": "2019-05-15T15:19:27Z",
            "pushed_at": "2019-05-15T15:20:32Z",
            "git_url": format!("git://github.com/{}.git", job.repository),
            "ssh_url": format!("git@github.com:{}.git", job.repository),
            "clone_url": format!("{html}.git"),
            "default_branch": "main",
            "visibility": "private",
            "archived": false,
            "disabled": false,
        },
        "sender": user("octocat", 21_031_067, "User"),
        "installation": {
            "id": installation_id,
            "node_id": format!("MDIzOkludGVncmF0aW9uSW5zdGFsbGF0aW9u{installation_id}"),
        },
    });
    if owner == org {
        body["organization"] = json!({
            "login": org,
            "id": 38_302_899,
            "node_id": "MDEyOk9yZ2FuaXphdGlvbjM4MzAyODk5",
            "url": format!("https://api.github.com/orgs/{org}"),
            "repos_url": format!("https://api.github.com/orgs/{org}/repos"),
            "events_url": format!("https://api.github.com/orgs/{org}/events"),
            "hooks_url": format!("https://api.github.com/orgs/{org}/hooks"),
            "issues_url": format!("https://api.github.com/orgs/{org}/issues"),
            "members_url": format!("https://api.github.com/orgs/{org}/members{{/member}}"),
            "public_members_url": format!("https://api.github.com/orgs/{org}/public_members{{/member}}"),
            "avatar_url": "https://avatars.githubusercontent.com/u/38302899?v=4",
            "description": "",
        });
    }
    body
}

/// One webhook to deliver, in order.
pub(crate) struct HookEvent {
    pub action: String,
    pub job_id: u64,
    pub payload: Value,
}
