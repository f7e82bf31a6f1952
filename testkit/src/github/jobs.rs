//! The simulator's jobs: a workflow job, its status, what to queue, and a run's status derived from
//! its jobs. The state ([`super::model`]) and the workflow runs ([`super::workflows`]) both build on
//! these.

use chrono::{DateTime, Utc};
use rand::Rng;
use rand::distr::Alphanumeric;
use serde::{Deserialize, Serialize};

/// Job status, as in `workflow_job.status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    Queued,
    InProgress,
    Completed,
}

/// One step of a job, as a runner receives it. The simulator's runners run `run:` steps only: a
/// `uses:` step (an action) is kept so a runner can say it skipped it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStep {
    /// `name:`, else GitHub's default: `Run <first line of run>`, or `Run <uses>`.
    pub name: String,
    /// The `run:` script.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// The `uses:` action.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uses: Option<String>,
    /// `shell:`, when the step names one (default: bash if present, else sh; GitHub's rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    /// Once the job completed: `success`, `failure` or `skipped`, as its runner reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conclusion: Option<String>,
}

impl JobStep {
    /// A `run:` step with GitHub's default name.
    pub fn run(script: &str) -> JobStep {
        JobStep {
            name: format!("Run {}", script.lines().next().unwrap_or_default().trim()),
            run: Some(script.to_owned()),
            uses: None,
            shell: None,
            conclusion: None,
        }
    }
}

/// A workflow job in the simulator's job model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimJob {
    pub id: u64,
    pub run_id: u64,
    /// `owner/repo`.
    pub repository: String,
    pub name: String,
    pub workflow_name: String,
    pub labels: Vec<String>,
    pub status: JobStatus,
    pub conclusion: Option<String>,
    pub runner_id: Option<u64>,
    pub runner_name: Option<String>,
    pub runner_group_id: Option<u64>,
    pub runner_group_name: Option<String>,
    pub created_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub completed_at: Option<DateTime<Utc>>,
    pub head_sha: String,
    pub head_branch: String,
    /// What the runner runs, in order (none for jobs queued without steps).
    #[serde(default)]
    pub steps: Vec<JobStep>,
}

impl SimJob {
    /// A newly queued job `id` from `spec` (its own run unless `spec.run_id`).
    pub fn queued(id: u64, spec: JobSpec, default_repository: &str) -> SimJob {
        SimJob {
            id,
            run_id: spec.run_id.unwrap_or(2_202_229_000 + id),
            repository: spec
                .repository
                .unwrap_or_else(|| default_repository.to_owned()),
            name: spec.name.unwrap_or_else(|| "build".into()),
            workflow_name: spec.workflow_name.unwrap_or_else(|| "CI".into()),
            labels: spec.labels,
            status: JobStatus::Queued,
            conclusion: None,
            runner_id: None,
            runner_name: None,
            runner_group_id: None,
            runner_group_name: None,
            created_at: Utc::now(),
            started_at: None,
            completed_at: None,
            head_sha: "3484a3fb816e0859fd6e1cea078d76385ff50625".into(),
            head_branch: "main".into(),
            steps: spec.steps,
        }
    }
}

/// What to queue (the admin API's `POST /_admin/jobs` body).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct JobSpec {
    /// The job's `runs-on` labels.
    pub labels: Vec<String>,
    /// `owner/repo`; defaults to the simulator's first repository.
    #[serde(default)]
    pub repository: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub workflow_name: Option<String>,
    /// Joins this workflow run (a matrix or `needs:` job); default: a run of its own.
    #[serde(default)]
    pub run_id: Option<u64>,
    /// The job's steps (from its workflow file when dispatched).
    #[serde(default)]
    pub steps: Vec<JobStep>,
}

/// A workflow run's status as GitHub derives it from its jobs: `queued` until one starts,
/// `completed` when all are done, `in_progress` in between.
pub fn run_status<'a>(jobs: impl IntoIterator<Item = &'a SimJob>) -> JobStatus {
    let (mut any, mut all_queued, mut all_done) = (false, true, true);
    for j in jobs {
        any = true;
        all_queued &= j.status == JobStatus::Queued;
        all_done &= j.status == JobStatus::Completed;
    }
    match (any, all_queued, all_done) {
        (false, _, _) | (true, true, _) => JobStatus::Queued,
        (true, false, true) => JobStatus::Completed,
        _ => JobStatus::InProgress,
    }
}

/// A random alphanumeric string.
pub fn random_token(len: usize) -> String {
    rand::rng()
        .sample_iter(&Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(status: JobStatus) -> SimJob {
        SimJob {
            status,
            ..SimJob::queued(1, JobSpec::default(), "o/r")
        }
    }

    #[test]
    fn a_run_is_in_progress_once_any_job_started_until_all_completed() {
        use JobStatus::*;
        let run = |s: &[JobStatus]| run_status(&s.iter().map(|s| job(*s)).collect::<Vec<_>>());
        assert_eq!(run(&[Queued, Queued]), Queued);
        assert_eq!(run(&[InProgress, Queued, Queued]), InProgress);
        assert_eq!(run(&[Completed, Queued]), InProgress);
        assert_eq!(run(&[Completed, Completed]), Completed);
    }
}
