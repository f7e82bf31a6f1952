//! The GitHub simulator's runner protocol, runner side: what `encoded_jit_config` contains and
//! the calls a runner makes with it. A crate of its own with few dependencies, so the
//! `imp-fake-runner` binary links statically in a minute and runs inside real guests; imp-testkit
//! re-exports it (`imp_testkit::github::runner_protocol`) for the simulator and in-process runs.
//!
//! `encoded_jit_config` = base64(JSON [`JitConfigPayload`]). A runner:
//! 1. `POST /_runner/connect` with `Authorization: RunnerCredential <credential>`: exchanges the
//!    one-time credential for a session (a second exchange answers 401). The runner goes online.
//! 2. `POST /_runner/acquire` with `Authorization: RunnerSession <session>`: 200 with a job whose
//!    labels all match the runner's (the job goes in_progress, webhook `in_progress`), or 204.
//! 3. It runs the job's `run:` steps ([`steps`]) and `POST /_runner/jobs/{id}/complete` with
//!    `{"conclusion": "success" | "failure", "steps": [<each step's conclusion>]}`: the job
//!    completes (webhook `completed`) and the ephemeral runner's registration is removed.

pub mod http;
pub mod steps;

use std::time::Duration;

use ::http::{Method, StatusCode};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};

use crate::http::HttpClient;

/// The env var Imp delivers the JIT config in (never argv).
pub const JITCONFIG_ENV: &str = "ACTIONS_RUNNER_INPUT_JITCONFIG";
/// Optional override of the simulator URL found in the JIT config.
pub const URL_OVERRIDE_ENV: &str = "IMP_FAKE_RUNNER_URL";
/// The runner version the fake runner states (`IMP_FAKE_RUNNER_VERSION`), the simulator's
/// default newest release.
pub const DEFAULT_RUNNER_VERSION: &str = "2.330.0";
/// The header the fake runner states its version in at connect (the broker checks it).
pub const VERSION_HEADER: &str = "x-runner-version";
/// actions/runner's exit code for a deprecated version, when this variable is `1`.
pub const DEPRECATED_EXIT_CODE_ENV: &str = "ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE";

/// GitHub refused the runner's version (its message, which the runner prints).
#[derive(Debug)]
pub struct VersionDeprecated(pub String);

impl std::fmt::Display for VersionDeprecated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for VersionDeprecated {}

/// What the simulator's `encoded_jit_config` decodes to.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JitConfigPayload {
    /// Simulator base URL.
    pub url: String,
    pub runner_id: u64,
    pub runner_name: String,
    pub labels: Vec<String>,
    pub work_folder: String,
    /// One-time runner credential.
    pub credential: String,
}

impl JitConfigPayload {
    pub fn encode(&self) -> String {
        STANDARD.encode(serde_json::to_vec(self).expect("payload serializes"))
    }

    pub fn decode(encoded: &str) -> anyhow::Result<Self> {
        let bytes = STANDARD
            .decode(encoded.trim())
            .map_err(|_| anyhow::anyhow!("JIT config is not base64"))?;
        serde_json::from_slice(&bytes)
            .map_err(|_| anyhow::anyhow!("JIT config is not a simulator JIT config"))
    }
}

/// Options of one fake runner run.
#[derive(Debug, Clone)]
pub struct FakeRunnerOptions {
    /// Give up when no matching job arrived in this time.
    pub job_wait: Duration,
    /// How long the "job" runs.
    pub job_duration: Duration,
    /// The conclusion reported when no step failed (a failed step always reports `failure`).
    pub conclusion: String,
    /// Talk to this simulator URL instead of the one in the JIT config.
    pub url_override: Option<String>,
    /// The runner version stated at connect.
    pub version: String,
}

impl Default for FakeRunnerOptions {
    fn default() -> Self {
        FakeRunnerOptions {
            job_wait: Duration::from_secs(60),
            job_duration: Duration::ZERO,
            conclusion: "success".into(),
            url_override: None,
            version: DEFAULT_RUNNER_VERSION.to_string(),
        }
    }
}

/// Runs one fake runner like `actions/runner --jitconfig`: connect, take one matching job, report
/// completion. Returns the completed job as the simulator answered it (JSON; imp-testkit reads it
/// as its `SimJob`).
pub async fn run(encoded: &str, opts: &FakeRunnerOptions) -> anyhow::Result<serde_json::Value> {
    let mut cfg = JitConfigPayload::decode(encoded)?;
    if let Some(url) = &opts.url_override {
        cfg.url = url.trim_end_matches('/').to_string();
    }
    let http = HttpClient::new(Duration::from_secs(10));
    let deadline = tokio::time::Instant::now() + opts.job_wait;
    // Like actions/runner, a 5xx on connect is retried (until the job wait runs out): the
    // runner stays offline meanwhile.
    let resp = loop {
        let resp = http
            .json(
                Method::POST,
                &format!("{}/_runner/connect", cfg.url),
                &[
                    (
                        "authorization",
                        format!("RunnerCredential {}", cfg.credential),
                    ),
                    (VERSION_HEADER, opts.version.clone()),
                ],
                None,
            )
            .await?;
        if !resp.status.is_server_error() || tokio::time::Instant::now() >= deadline {
            break resp;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // GitHub's enforcement: "Runner version vX is deprecated and cannot receive messages." (403).
    if resp.status == StatusCode::FORBIDDEN
        && let Some(msg) = resp.json()["message"].as_str()
        && msg.contains("is deprecated")
    {
        return Err(VersionDeprecated(msg.to_string()).into());
    }
    anyhow::ensure!(
        resp.status == StatusCode::OK,
        "connect refused: {} {}",
        resp.status,
        resp.json()
    );
    let session = resp.json()["session"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("connect: no session"))?
        .to_string();
    let auth = [("authorization", format!("RunnerSession {session}"))];
    let job = loop {
        let resp = http
            .json(
                Method::POST,
                &format!("{}/_runner/acquire", cfg.url),
                &auth,
                None,
            )
            .await?;
        match resp.status {
            StatusCode::OK => break resp.json(),
            StatusCode::NO_CONTENT => {}
            s => anyhow::bail!("acquire failed: {s} {}", resp.json()),
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no job matching {:?} within {:?}",
            cfg.labels,
            opts.job_wait
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let job_id = job["id"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("acquire: a job without an id"))?;
    let job_steps: Vec<steps::Step> = match &job["steps"] {
        serde_json::Value::Null => Vec::new(),
        v => serde_json::from_value(v.clone())
            .map_err(|e| anyhow::anyhow!("acquire: job {job_id} has malformed steps: {e}"))?,
    };
    tokio::time::sleep(opts.job_duration).await;
    let outcomes = if job_steps.is_empty() {
        Vec::new()
    } else {
        let repository = job["repository"].as_str().unwrap_or("repo");
        let (dirs, scratch) = job_dirs(&cfg, repository)?;
        let env = job_env(&job, &cfg, &dirs);
        println!(
            "imp-fake-runner: job {job_id} ({}) in {}: {} step(s)",
            job["name"].as_str().unwrap_or_default(),
            dirs.workspace.display(),
            job_steps.len()
        );
        let outcomes = steps::run_steps(&job_steps, &dirs, &env).await;
        if let Some(dir) = scratch {
            let _ = std::fs::remove_dir_all(dir);
        }
        outcomes
    };
    let conclusion = match steps::job_conclusion(&outcomes) {
        "success" => opts.conclusion.as_str(),
        failed => failed,
    };
    let step_conclusions: Vec<&str> = outcomes.iter().map(|o| o.conclusion()).collect();
    let body = serde_json::json!({ "conclusion": conclusion, "steps": step_conclusions });
    let resp = http
        .json(
            Method::POST,
            &format!("{}/_runner/jobs/{job_id}/complete", cfg.url),
            &auth,
            Some(&body),
        )
        .await?;
    anyhow::ensure!(
        resp.status == StatusCode::OK,
        "complete failed: {} {}",
        resp.status,
        resp.json()
    );
    Ok(resp.json())
}

/// The job's directories under the work folder, which is relative to the runner's directory
/// (where the wrapper starts it, as actions/runner's is to its root). A runner started where it
/// may not write, or in `/` (a host process: the Firecracker simulator's guest) works under a scratch
/// directory in the temp dir instead, returned for removal after the job.
fn job_dirs(
    cfg: &JitConfigPayload,
    repository: &str,
) -> anyhow::Result<(steps::JobDirs, Option<std::path::PathBuf>)> {
    let work = std::path::Path::new(&cfg.work_folder);
    let in_root = std::env::current_dir().is_ok_and(|d| d == std::path::Path::new("/"));
    let created = if in_root && work.is_relative() {
        // Never a work folder at the top of a host's filesystem.
        Err(std::io::ErrorKind::PermissionDenied.into())
    } else {
        steps::JobDirs::create(work, repository)
    };
    match created {
        Ok(dirs) => Ok((dirs, None)),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied && work.is_relative() => {
            let scratch = std::env::temp_dir().join(format!("imp-fake-runner-{}", cfg.runner_id));
            let dirs = steps::JobDirs::create(&scratch.join(work), repository)
                .map_err(|e| anyhow::anyhow!("work folder {}: {e}", scratch.display()))?;
            Ok((dirs, Some(scratch)))
        }
        Err(e) => anyhow::bail!("work folder {}: {e}", cfg.work_folder),
    }
}

/// The variables actions/runner gives every step (the ones a `run:` script commonly reads).
fn job_env(
    job: &serde_json::Value,
    cfg: &JitConfigPayload,
    dirs: &steps::JobDirs,
) -> Vec<(String, String)> {
    let text = |k: &str| job[k].as_str().unwrap_or_default().to_owned();
    vec![
        ("CI".into(), "true".into()),
        ("GITHUB_ACTIONS".into(), "true".into()),
        ("GITHUB_JOB".into(), text("name")),
        ("GITHUB_REPOSITORY".into(), text("repository")),
        ("GITHUB_RUN_ID".into(), job["run_id"].to_string()),
        ("GITHUB_SHA".into(), text("head_sha")),
        ("GITHUB_REF_NAME".into(), text("head_branch")),
        (
            "GITHUB_WORKSPACE".into(),
            dirs.workspace.display().to_string(),
        ),
        ("RUNNER_NAME".into(), cfg.runner_name.clone()),
        ("RUNNER_OS".into(), "Linux".into()),
        ("RUNNER_TEMP".into(), dirs.temp.display().to_string()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload() -> JitConfigPayload {
        JitConfigPayload {
            url: "http://198.51.100.1:8080".into(),
            runner_id: 7,
            runner_name: "imp-x".into(),
            labels: vec!["self-hosted".into(), "imp".into()],
            work_folder: "_work".into(),
            credential: "cred".into(),
        }
    }

    #[test]
    fn a_jit_config_round_trips() {
        let back = JitConfigPayload::decode(&payload().encode()).unwrap();
        assert_eq!(
            (back.runner_id, back.url.as_str()),
            (7, "http://198.51.100.1:8080")
        );
    }

    #[test]
    fn a_foreign_config_is_refused_without_echoing_it() {
        let e = JitConfigPayload::decode("not-base64!")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "JIT config is not base64");
        let e = JitConfigPayload::decode(&STANDARD.encode(b"{\"secret\":1}"))
            .unwrap_err()
            .to_string();
        assert!(!e.contains("secret"), "{e}");
    }
}
