//! The queued-job sweep: the installation's repositories and the jobs of their active workflow runs,
//! so jobs whose `workflow_job` webhook was lost are still served. GitHub marks a run `in_progress` as
//! soon as any of its jobs starts, so the queued jobs of a matrix beyond capacity or behind `needs:`
//! are found only by listing the jobs of in-progress runs too. Every listing is a conditional request
//! (ETag): an unchanged repository costs two 304s, which GitHub does not charge.

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::budget::next_sweep_interval;
use super::client::GithubApp;
use super::conditional::CallCount;
use super::errors::{CallContext, GithubError, Operation};
use super::metrics::{AppLabels, SweepCallLabels};
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
    pub started_at: Option<String>,
    #[serde(default)]
    pub completed_at: Option<String>,
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

/// Pages of one repository's active runs, or of one run's jobs (100 each): a repository with
/// more fails its listing (`TooManyPages`) and its jobs are left as they are.
const MAX_PAGES: usize = 50;
/// Pages of the installation's repositories (100 each).
const MAX_REPOSITORY_PAGES: usize = 1000;

/// Run statuses whose jobs can be (or become) demand: `queued` (no job started) and `in_progress`
/// (some started, others may still be queued). `waiting` runs wait for an environment approval: not
/// demand until approved (docs/github.md).
const ACTIVE_RUN_STATUSES: [&str; 2] = ["queued", "in_progress"];

/// What one App's sweep saw.
#[derive(Debug, Default)]
pub struct SweepListing {
    /// Repositories whose active runs were all listed: their jobs can be judged by this listing.
    pub repositories: Vec<String>,
    /// `(owner/repo, job)` of every job of those runs, whatever its status.
    pub jobs: Vec<(String, WorkflowJob)>,
    /// Repositories whose listing failed (their jobs are left as they are).
    pub failed: Vec<(String, GithubError)>,
    /// Repositories not listed because the rate limit was down to the reserve left to minting
    /// (listed by a later sweep; their jobs are left as they are).
    pub deferred: Vec<String>,
    /// What the sweep cost.
    pub calls: CallCount,
}

impl GithubApp {
    /// `owner/repo` of every repository the installation can access.
    pub async fn list_installation_repositories(&self) -> Result<Vec<String>, GithubError> {
        self.list_installation_repositories_counted(&mut CallCount::default())
            .await
    }

    async fn list_installation_repositories_counted(
        &self,
        calls: &mut CallCount,
    ) -> Result<Vec<String>, GithubError> {
        let ctx = CallContext {
            operation: Operation::ListRepositories,
            target: format!("installation {}", self.installation_id()),
            permission: "metadata=read",
            installation_id: self.installation_id(),
        };
        let repos: Vec<Repository> = self
            .get_all_pages_counted(
                &ctx,
                "/installation/repositories?per_page=100".into(),
                "repositories",
                MAX_REPOSITORY_PAGES,
                calls,
            )
            .await?;
        Ok(repos.into_iter().map(|r| r.full_name).collect())
    }

    /// Every job of the repository's queued and in-progress workflow runs, whatever its own status.
    pub async fn list_active_jobs(
        &self,
        owner: &str,
        repo: &str,
        calls: &mut CallCount,
    ) -> Result<Vec<WorkflowJob>, GithubError> {
        let base = RunnerScope::repo(owner, repo).actions_path()?;
        let ctx = |operation| CallContext {
            operation,
            target: format!("repository `{owner}/{repo}`"),
            permission: "actions=read",
            installation_id: self.installation_id(),
        };
        // A run that starts between the two listings shows in both or (rarely) neither: the demand
        // side drops a job only after it is missing from two sweeps.
        let mut run_ids = BTreeSet::new();
        for status in ACTIVE_RUN_STATUSES {
            let runs: Vec<WorkflowRun> = self
                .get_all_pages_counted(
                    &ctx(Operation::ListWorkflowRuns),
                    format!("{base}/runs?status={status}&per_page=100"),
                    "workflow_runs",
                    MAX_PAGES,
                    calls,
                )
                .await?;
            run_ids.extend(runs.into_iter().map(|r| r.id));
        }
        let mut jobs = Vec::new();
        for run in run_ids {
            let listed: Vec<WorkflowJob> = self
                .get_all_pages_counted(
                    &ctx(Operation::ListWorkflowJobs),
                    format!("{base}/runs/{run}/jobs?per_page=100"),
                    "jobs",
                    MAX_PAGES,
                    calls,
                )
                .await?;
            jobs.extend(listed);
        }
        Ok(jobs)
    }

    /// One sweep of this App: the repositories of `orgs` the installation can access plus `repos`,
    /// each listed with [`GithubApp::list_active_jobs`], stopping when the rate limit's remaining
    /// calls are down to the reserve left to minting. Fails only if the repository list does.
    pub async fn sweep_jobs(
        &self,
        orgs: &HashSet<String>,
        repos: &HashSet<String>,
    ) -> Result<SweepListing, GithubError> {
        let mut out = SweepListing::default();
        let mut all: BTreeSet<String> = repos.iter().cloned().collect();
        if !orgs.is_empty() {
            let listed = self
                .list_installation_repositories_counted(&mut out.calls)
                .await?;
            all.extend(listed.into_iter().filter(|r| {
                r.split_once('/')
                    .is_some_and(|(o, _)| orgs.contains(&o.to_ascii_lowercase()))
            }));
        }
        let budget = &self.inner.config.sweep_budget;
        for repo in all {
            if !out.deferred.is_empty()
                || self
                    .rate_state()
                    .is_some_and(|r| r.remaining <= budget.reserve(r.limit))
            {
                out.deferred.push(repo);
                continue;
            }
            let Some((owner, name)) = repo.split_once('/') else {
                continue;
            };
            match self.list_active_jobs(owner, name, &mut out.calls).await {
                Ok(jobs) => {
                    out.jobs.extend(jobs.into_iter().map(|j| (repo.clone(), j)));
                    out.repositories.push(repo);
                }
                Err(e) => out.failed.push((repo, e)),
            }
        }
        Ok(out)
    }
}

impl GithubApp {
    /// Charged calls per hour the sweep may spend, under the limit GitHub last reported (or the
    /// default 5,000 before any answer).
    pub fn sweep_budget_per_hour(&self) -> f64 {
        let limit = self
            .rate_state()
            .map_or(super::budget::DEFAULT_RATE_LIMIT, |r| r.limit);
        self.inner.config.sweep_budget.charged_per_hour(limit)
    }

    /// Records what a sweep cost (the `imp_github_sweep_*` gauges) and returns how long until this
    /// App's next sweep may run: at least `min`, within the sweep's budget ([`next_sweep_interval`]).
    pub fn record_sweep(&self, calls: CallCount, min: Duration) -> Duration {
        let budget = &self.inner.config.sweep_budget;
        let rate = self.rate_state();
        let (next, cause) = next_sweep_interval(budget, min, calls, rate);
        let m = &self.inner.metrics;
        let app = AppLabels {
            app_id: self.app_id().to_string(),
        };
        for (kind, n) in [
            ("charged", calls.charged),
            ("revalidated", calls.revalidated),
        ] {
            m.sweep_calls
                .get_or_create(&SweepCallLabels {
                    app_id: app.app_id.clone(),
                    kind: kind.into(),
                })
                .set(n as i64);
        }
        m.sweep_interval
            .get_or_create(&app)
            .set(next.as_secs() as i64);
        m.sweep_budget
            .get_or_create(&app)
            .set(self.sweep_budget_per_hour() as i64);
        let projected = calls.charged as f64 * 3600.0 / next.as_secs_f64().max(1.0);
        m.sweep_projected.get_or_create(&app).set(projected as i64);
        tracing::debug!(
            app_id = self.app_id(),
            charged = calls.charged,
            revalidated = calls.revalidated,
            next = ?next,
            cause = cause.as_str(),
            "sweep cost"
        );
        next
    }
}
