//! A job's steps end to end through the real interfaces: a workflow file registered at the
//! simulator and dispatched over its REST API, JIT configs minted over its REST API, the real
//! `imp-fake-runner` binary (a process, as in a guest) taking each job, running its `run:` steps
//! and reporting the conclusions, which the simulator records.

use std::process::Command;

use ::http::{Method, StatusCode};
use serde_json::json;

use super::sim_tests::{req, token};
use super::{GithubSim, SimConfig};

const WORKFLOW: &str = r#"
name: steps
on: workflow_dispatch
jobs:
  ok:
    runs-on: [imp, ok]
    steps:
      - name: First
        run: |
          echo "one in $PWD"
          echo "workspace=$GITHUB_WORKSPACE ci=$CI"
          echo "config=${ACTIONS_RUNNER_INPUT_JITCONFIG:-unset}"
      - uses: actions/checkout@v4
      - run: echo two
  fails:
    runs-on: [imp, fails]
    steps:
      - run: |
          echo before
          exit 3
          echo after-exit
      - name: Never
        run: echo never-runs
"#;

/// Mints a JIT config for a runner with `labels`, runs the fake runner binary with it in `dir`,
/// and returns its exit code and stdout.
async fn run_runner(
    sim: &GithubSim,
    labels: &[&str],
    dir: &std::path::Path,
) -> (i32, String, String) {
    let t = token(sim).await;
    let body = json!({"name": format!("r-{}", labels.join("-")), "runner_group_id": 1, "labels": labels, "work_folder": "_work"});
    let r = req(
        sim,
        Method::POST,
        "/orgs/octo-org/actions/runners/generate-jitconfig",
        Some(&t),
        Some(body),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    let config = r.json()["encoded_jit_config"].as_str().unwrap().to_owned();
    let bin =
        crate::bins::ensure_built(&[("imp-fake-runner", "imp-fake-runner")], &["fake-runner"])
            .unwrap()
            .remove(0);
    let out = tokio::task::spawn_blocking({
        let (dir, config) = (dir.to_owned(), config.clone());
        move || {
            Command::new(bin)
                .current_dir(dir)
                .env("ACTIONS_RUNNER_INPUT_JITCONFIG", config)
                .env("IMP_FAKE_RUNNER_JOB_WAIT_SECS", "20")
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        !stdout.contains(&config),
        "the JIT config reached the runner's output"
    );
    (
        out.status.code().unwrap_or(-1),
        stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_runner_runs_the_jobs_steps_and_a_failing_step_fails_the_job() {
    let sim = GithubSim::start(SimConfig::default()).await.unwrap();
    sim.add_workflow(None, ".github/workflows/steps.yaml", WORKFLOW)
        .unwrap();
    let user = sim.user_token();
    let r = req(
        &sim,
        Method::POST,
        "/repos/octo-org/octo-repo/actions/workflows/steps.yaml/dispatches",
        Some(&user),
        Some(json!({"ref": "main", "return_run_details": true})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json());
    let run = r.json()["workflow_run_id"].as_u64().unwrap();
    let jobs = req(
        &sim,
        Method::GET,
        &format!("/repos/octo-org/octo-repo/actions/runs/{run}/jobs"),
        Some(&user),
        None,
    )
    .await
    .json();
    let id_of = |name: &str| {
        jobs["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["name"] == name)
            .and_then(|j| j["id"].as_u64())
            .unwrap_or_else(|| panic!("no job {name}: {jobs}"))
    };
    let (ok, fails) = (id_of("ok"), id_of("fails"));
    let dir = tempfile::tempdir().unwrap();

    let (code, out, err) = run_runner(&sim, &["imp", "ok"], dir.path()).await;
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let workspace = dir
        .path()
        .canonicalize()
        .unwrap()
        .join("_work/octo-repo/octo-repo");
    let first = out.find("one in ").expect(&out);
    let two = out.find("\ntwo\n").expect(&out);
    assert!(first < two, "steps out of order:\n{out}");
    assert!(
        out.contains(&format!("one in {}", workspace.display())),
        "{out}"
    );
    assert!(
        out.contains(&format!("workspace={} ci=true", workspace.display())),
        "{out}"
    );
    // The job never sees the runner's credential.
    assert!(out.contains("config=unset"), "{out}");
    assert!(out.contains("actions/checkout@v4) are not run"), "{out}");
    let job = sim.job(ok).unwrap();
    assert_eq!(job.conclusion.as_deref(), Some("success"));
    let steps: Vec<_> = job.steps.iter().map(|s| s.conclusion.as_deref()).collect();
    assert_eq!(steps, [Some("success"), Some("skipped"), Some("success")]);

    // Like actions/runner, the runner exits 0 after a failed job: the job's conclusion says it.
    let (code, out, err) = run_runner(&sim, &["imp", "fails"], dir.path()).await;
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("before\n"), "{out}");
    assert!(
        out.contains("##[error]Process completed with exit code 3."),
        "{out}"
    );
    assert!(
        !out.contains("after-exit") && !out.contains("never-runs"),
        "{out}"
    );
    assert!(
        out.contains("\"Never\" skipped: an earlier step failed"),
        "{out}"
    );
    assert!(out.contains("completed (failure)"), "{out}");
    let job = sim.job(fails).unwrap();
    assert_eq!(job.conclusion.as_deref(), Some("failure"));
    let steps: Vec<_> = job.steps.iter().map(|s| s.conclusion.as_deref()).collect();
    assert_eq!(steps, [Some("failure"), Some("skipped")]);
}
