//! The queued-job sweep: the installation's repositories and their queued workflow jobs, so jobs
//! whose `workflow_job` webhook was lost are still served.

use serde::{Deserialize, Serialize};

use super::client::GithubApp;
use super::errors::{CallContext, GithubError, Operation};
use super::scope::RunnerScope;

/// A queued workflow job, as the sweep sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkflowJob {
    pub id: u64,
    pub run_id: u64,
    pub name: String,
    /// `queued`, `in_progress`, `completed` or `waiting`.
    pub status: String,
    #[serde(default)]
    pub labels: Vec<String>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub runner_name: Option<String>,
}

#[derive(Deserialize)]
struct Repository {
    full_name: String,
}

#[derive(Deserialize)]
struct WorkflowRun {
    id: u64,
}

const MAX_PAGES: usize = 50;

impl GithubApp {
    /// `owner/repo` of every repository the installation can access.
    pub async fn list_installation_repositories(&self) -> Result<Vec<String>, GithubError> {
        let ctx = CallContext {
            operation: Operation::ListRepositories,
            target: format!("installation {}", self.installation_id()),
            permission: "metadata=read",
            installation_id: self.installation_id(),
        };
        let repos: Vec<Repository> = self
            .get_all_pages(
                &ctx,
                "/installation/repositories?per_page=100".into(),
                "repositories",
                MAX_PAGES,
            )
            .await?;
        Ok(repos.into_iter().map(|r| r.full_name).collect())
    }

    /// The repository's queued jobs: queued workflow runs, then their jobs still queued.
    pub async fn list_queued_jobs(
        &self,
        owner: &str,
        repo: &str,
    ) -> Result<Vec<WorkflowJob>, GithubError> {
        let base = RunnerScope::repo(owner, repo).actions_path()?;
        let ctx = |operation| CallContext {
            operation,
            target: format!("repository `{owner}/{repo}`"),
            permission: "actions=read",
            installation_id: self.installation_id(),
        };
        let runs: Vec<WorkflowRun> = self
            .get_all_pages(
                &ctx(Operation::ListWorkflowRuns),
                format!("{base}/runs?status=queued&per_page=100"),
                "workflow_runs",
                MAX_PAGES,
            )
            .await?;
        let mut queued = Vec::new();
        for run in runs {
            let jobs: Vec<WorkflowJob> = self
                .get_all_pages(
                    &ctx(Operation::ListWorkflowJobs),
                    format!("{base}/runs/{}/jobs?per_page=100", run.id),
                    "jobs",
                    MAX_PAGES,
                )
                .await?;
            queued.extend(jobs.into_iter().filter(|j| j.status == "queued"));
        }
        Ok(queued)
    }
}
