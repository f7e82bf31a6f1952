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
//! 3. `POST /_runner/jobs/{id}/complete` with `{"conclusion": "success"}`: the job completes
//!    (webhook `completed`) and the ephemeral runner's registration is removed.

pub mod http;

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
    /// The conclusion reported.
    pub conclusion: String,
    /// Talk to this simulator URL instead of the one in the JIT config.
    pub url_override: Option<String>,
}

impl Default for FakeRunnerOptions {
    fn default() -> Self {
        FakeRunnerOptions {
            job_wait: Duration::from_secs(60),
            job_duration: Duration::ZERO,
            conclusion: "success".into(),
            url_override: None,
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
                &[(
                    "authorization",
                    format!("RunnerCredential {}", cfg.credential),
                )],
                None,
            )
            .await?;
        if !resp.status.is_server_error() || tokio::time::Instant::now() >= deadline {
            break resp;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
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
    let job_id = loop {
        let resp = http
            .json(
                Method::POST,
                &format!("{}/_runner/acquire", cfg.url),
                &auth,
                None,
            )
            .await?;
        match resp.status {
            StatusCode::OK => {
                break resp.json()["id"]
                    .as_u64()
                    .ok_or_else(|| anyhow::anyhow!("acquire: a job without an id"))?;
            }
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
    tokio::time::sleep(opts.job_duration).await;
    let body = serde_json::json!({ "conclusion": opts.conclusion });
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
