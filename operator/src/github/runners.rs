//! Runners: get, list (paginated), delete (idempotent; busy runners are refused with 422).

use http::{Method, StatusCode};
use serde::{Deserialize, Serialize};

use super::client::GithubApp;
use super::errors::{GithubError, Operation};
use super::scope::RunnerScope;

/// A self-hosted runner as GitHub reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Runner {
    pub id: u64,
    pub name: String,
    #[serde(default)]
    pub os: String,
    /// `online` or `offline`.
    pub status: String,
    pub busy: bool,
    #[serde(default)]
    pub ephemeral: bool,
    #[serde(default)]
    pub runner_group_id: Option<u64>,
    #[serde(default)]
    pub labels: Vec<RunnerLabel>,
}

impl Runner {
    pub fn label_names(&self) -> Vec<&str> {
        self.labels.iter().map(|l| l.name.as_str()).collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerLabel {
    #[serde(default)]
    pub id: Option<u64>,
    pub name: String,
    /// `read-only` or `custom`.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

/// What a delete did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteOutcome {
    Deleted,
    /// GitHub had no such runner (404): already deregistered, which is success.
    AlreadyGone,
}

const MAX_PAGES: usize = 1000;

impl GithubApp {
    /// The runner, or `None` if GitHub has no such runner.
    pub async fn get_runner(
        &self,
        scope: &RunnerScope,
        runner_id: u64,
    ) -> Result<Option<Runner>, GithubError> {
        let ctx = scope.context(Operation::GetRunner, self.installation_id(), false);
        let path = format!("{}/runners/{runner_id}", scope.actions_path()?);
        let resp = self
            .call(&ctx, Method::GET, &path, None, &[StatusCode::NOT_FOUND])
            .await?;
        if resp.status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        serde_json::from_slice(&resp.body).map(Some).map_err(|e| {
            self.record(GithubError::Decode {
                operation: Operation::GetRunner,
                message: e.to_string(),
            })
        })
    }

    /// Every runner registered in `scope` (all pages).
    pub async fn list_runners(&self, scope: &RunnerScope) -> Result<Vec<Runner>, GithubError> {
        let ctx = scope.context(Operation::ListRunners, self.installation_id(), false);
        let path = format!("{}/runners?per_page=100", scope.actions_path()?);
        self.get_all_pages(&ctx, path, "runners", MAX_PAGES).await
    }

    /// Deregisters a runner. 404 is success ([`DeleteOutcome::AlreadyGone`]); a runner running a
    /// job answers 422 and gives [`GithubError::RunnerBusy`]: try again later.
    pub async fn delete_runner(
        &self,
        scope: &RunnerScope,
        runner_id: u64,
    ) -> Result<DeleteOutcome, GithubError> {
        let ctx = scope.context(Operation::DeleteRunner, self.installation_id(), true);
        let path = format!("{}/runners/{runner_id}", scope.actions_path()?);
        let resp = self
            .call(
                &ctx,
                Method::DELETE,
                &path,
                None,
                &[StatusCode::NOT_FOUND, StatusCode::UNPROCESSABLE_ENTITY],
            )
            .await?;
        match resp.status {
            StatusCode::NOT_FOUND => {
                tracing::debug!(%scope, runner_id, "runner already gone");
                Ok(DeleteOutcome::AlreadyGone)
            }
            StatusCode::UNPROCESSABLE_ENTITY => {
                Err(self.record(GithubError::RunnerBusy { runner_id }))
            }
            _ => {
                tracing::info!(%scope, runner_id, "deregistered runner");
                Ok(DeleteOutcome::Deleted)
            }
        }
    }
}
