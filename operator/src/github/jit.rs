//! Just-in-time runner configurations (`generate-jitconfig`) for organization and repository scope.

use std::time::Instant;

use http::{Method, StatusCode};
use serde::Deserialize;
use serde_json::json;

use super::client::GithubApp;
use super::errors::{GithubError, Operation};
use super::runners::Runner;
use super::scope::RunnerScope;
use imp_common::SecretString;

/// GitHub's limit on runner name length.
pub const MAX_RUNNER_NAME_LEN: usize = 64;
/// Characters of the VM uid kept in runner names.
const UID_PREFIX_LEN: usize = 12;

/// The runner name for an ImpVM: `<pool>-<first 12 hex digits of the VM uid>`, unique per VM and
/// traceable to it. The pool part is shortened to keep the name within 64 characters.
pub fn runner_name(pool: &str, vm_uid: &str) -> String {
    let uid: String = vm_uid
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(UID_PREFIX_LEN)
        .collect();
    let pool: String = pool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .take(MAX_RUNNER_NAME_LEN - 1 - uid.len())
        .collect();
    format!("{pool}-{uid}")
}

/// What to mint.
#[derive(Debug, Clone)]
pub struct JitRequest {
    pub scope: RunnerScope,
    /// See [`runner_name`].
    pub runner_name: String,
    /// The pool's labels.
    pub labels: Vec<String>,
    /// Runner group name; `None` = the default group.
    pub runner_group: Option<String>,
    /// The runner's work folder (GitHub default `_work`).
    pub work_folder: String,
}

/// A minted registration.
#[derive(Debug, Clone)]
pub struct JitRunner {
    pub runner_id: u64,
    pub runner_name: String,
    pub runner_group_id: u64,
    /// The one-time config to hand to the runner (`ACTIONS_RUNNER_INPUT_JITCONFIG`).
    pub encoded_jit_config: SecretString,
}

#[derive(Deserialize)]
struct JitResponse {
    runner: Runner,
    encoded_jit_config: String,
}

impl GithubApp {
    /// Mints a JIT runner config, paced by the mint governor. If GitHub reports the name taken by
    /// an offline, idle registration (an earlier attempt whose answer was lost), that stale
    /// registration is deleted and the mint retried once.
    pub async fn generate_jit_config(&self, req: &JitRequest) -> Result<JitRunner, GithubError> {
        let started = Instant::now();
        let base = req.scope.actions_path()?;
        if req.labels.is_empty() || req.labels.iter().any(|l| l.trim().is_empty()) {
            return Err(GithubError::InvalidRequest(
                "a runner needs at least one non-empty label".into(),
            ));
        }
        if req.runner_name.is_empty() || req.runner_name.len() > super::jit::MAX_RUNNER_NAME_LEN {
            return Err(GithubError::InvalidRequest(format!(
                "runner name must be 1 to {MAX_RUNNER_NAME_LEN} characters"
            )));
        }
        let group_id = self
            .runner_group_id(&req.scope, req.runner_group.as_deref())
            .await?;
        let waited = self.inner.governor.acquire().await;
        self.inner
            .metrics
            .governor_wait
            .observe(waited.as_secs_f64());
        let ctx = req
            .scope
            .context(Operation::GenerateJitConfig, self.installation_id(), true);
        let path = format!("{base}/runners/generate-jitconfig");
        let body = json!({
            "name": req.runner_name,
            "runner_group_id": group_id,
            "labels": req.labels,
            "work_folder": req.work_folder,
        });
        let mut cleared_stale = false;
        let resp = loop {
            match self.call(&ctx, Method::POST, &path, Some(&body), &[]).await {
                Err(GithubError::Conflict { .. })
                    if !cleared_stale && self.clear_stale_registration(req).await? =>
                {
                    cleared_stale = true;
                }
                other => break other?,
            }
        };
        if resp.status != StatusCode::CREATED && resp.status != StatusCode::OK {
            return Err(self.record(GithubError::UnexpectedStatus {
                operation: Operation::GenerateJitConfig,
                status: resp.status.as_u16(),
                message: "expected 201".into(),
            }));
        }
        let parsed: JitResponse = serde_json::from_slice(&resp.body).map_err(|e| {
            self.record(GithubError::Decode {
                operation: Operation::GenerateJitConfig,
                message: format!(
                    "generate-jitconfig answer: {:?} at line {} column {}",
                    e.classify(),
                    e.line(),
                    e.column()
                ),
            })
        })?;
        self.inner
            .metrics
            .jit_mint_duration
            .observe(started.elapsed().as_secs_f64());
        tracing::info!(
            scope = %req.scope,
            runner_name = %parsed.runner.name,
            runner_id = parsed.runner.id,
            runner_group_id = group_id,
            "minted JIT runner config"
        );
        Ok(JitRunner {
            runner_id: parsed.runner.id,
            runner_name: parsed.runner.name,
            runner_group_id: group_id,
            encoded_jit_config: SecretString::from(parsed.encoded_jit_config),
        })
    }

    /// Deletes an offline, idle registration named like `req`; true if one was deleted.
    async fn clear_stale_registration(&self, req: &JitRequest) -> Result<bool, GithubError> {
        let runners = self.list_runners(&req.scope).await?;
        let Some(stale) = runners.iter().find(|r| {
            r.name.eq_ignore_ascii_case(&req.runner_name) && r.status == "offline" && !r.busy
        }) else {
            return Ok(false);
        };
        tracing::warn!(scope = %req.scope, runner_id = stale.id, runner_name = %stale.name, "deleting stale registration with the same name before re-minting");
        self.delete_runner(&req.scope, stale.id).await?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runner_names_are_traceable_and_bounded() {
        assert_eq!(
            runner_name("ci-pool", "3f2b8c1e-77aa-4c1d-9e0f-0123456789ab"),
            "ci-pool-3f2b8c1e77aa"
        );
        let long = "p".repeat(100);
        let n = runner_name(&long, "3f2b8c1e-77aa-4c1d-9e0f-0123456789ab");
        assert_eq!(n.len(), MAX_RUNNER_NAME_LEN);
        assert!(n.ends_with("-3f2b8c1e77aa"));
        assert_eq!(runner_name("a b/c", "ff"), "a-b-c-ff");
    }
}
