//! Workflow files, `workflow_dispatch` runs and the tokens that may dispatch them (the cluster
//! smoke's side of the simulator; the HTTP handlers are in `server/dispatch.rs`).
//!
//! A registered workflow file is parsed for what the simulator needs: its name, `run-name`, whether
//! `on:` has `workflow_dispatch` (and its inputs), and each job's `runs-on` labels. A dispatch
//! creates a run whose jobs are queued at once (no `needs:` ordering, no `if:`), each emitting the
//! `queued` `workflow_job` webhook like any queued job; runners then take and finish them through
//! the runner protocol, and the run's status follows its jobs ([`super::jobs::run_status`]).

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::jobs::{JobStatus, JobStep, SimJob, run_status};

/// Why a workflow file was refused (named after the file and the field).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WorkflowError {
    #[error("{path}: not YAML: {error}")]
    Yaml { path: String, error: String },
    #[error("{path}: the top level is not a mapping")]
    NotAMapping { path: String },
    #[error("{path}: no `on:` trigger")]
    NoTrigger { path: String },
    #[error("{path}: no `jobs:` mapping with at least one job")]
    NoJobs { path: String },
    #[error("{path}: jobs.{job}.runs-on: {why}")]
    RunsOn {
        path: String,
        job: String,
        why: &'static str,
    },
    #[error("{path}: jobs.{job}.steps[{index}]: {why}")]
    Step {
        path: String,
        job: String,
        index: usize,
        why: &'static str,
    },
}

/// One job of a workflow file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkflowJobDef {
    /// The key under `jobs:`.
    pub key: String,
    /// `name:`, else the key (what GitHub shows and puts into `workflow_job.name`).
    pub name: String,
    /// The `runs-on` labels a runner must all have.
    pub runs_on: Vec<String>,
    /// `steps:`, in order.
    #[serde(default)]
    pub steps: Vec<JobStep>,
}

/// What the simulator reads from a workflow file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkflowFile {
    /// `name:`, else the file's path (as GitHub names it).
    pub name: String,
    pub run_name: Option<String>,
    /// `on:` includes `workflow_dispatch`.
    pub dispatchable: bool,
    /// `on.workflow_dispatch.inputs`: name -> required.
    pub inputs: BTreeMap<String, bool>,
    pub jobs: Vec<WorkflowJobDef>,
}

fn labels_of(v: &serde_yaml::Value) -> Option<Vec<String>> {
    match v {
        serde_yaml::Value::String(s) => Some(vec![s.clone()]),
        serde_yaml::Value::Sequence(items) => items
            .iter()
            .map(|i| i.as_str().map(str::to_owned))
            .collect(),
        serde_yaml::Value::Mapping(m) => m.get("labels").and_then(labels_of),
        _ => None,
    }
}

/// A job's `steps:`: each a `run:` script or a `uses:` action, with its optional `name:` and
/// `shell:`. Absent steps are none (GitHub requires them; the simulator's own tests omit them).
fn steps_of(
    path: &str,
    job: &str,
    steps: Option<&serde_yaml::Value>,
) -> Result<Vec<JobStep>, WorkflowError> {
    let Some(steps) = steps else {
        return Ok(Vec::new());
    };
    let err = |index, why| WorkflowError::Step {
        path: path.into(),
        job: job.into(),
        index,
        why,
    };
    let items = steps.as_sequence().ok_or_else(|| WorkflowError::Step {
        path: path.into(),
        job: job.into(),
        index: 0,
        why: "steps is not a list",
    })?;
    items
        .iter()
        .enumerate()
        .map(|(i, step)| {
            let text = |key: &str| -> Result<Option<String>, WorkflowError> {
                match step.get(key) {
                    None => Ok(None),
                    Some(v) => v
                        .as_str()
                        .map(|s| Some(s.to_owned()))
                        .ok_or_else(|| err(i, "name, run, uses and shell must be strings")),
                }
            };
            if !step.is_mapping() {
                return Err(err(i, "a step is a mapping"));
            }
            let (run, uses) = (text("run")?, text("uses")?);
            let mut parsed = match (&run, &uses) {
                (Some(script), None) => JobStep::run(script),
                (None, Some(action)) => JobStep {
                    name: format!("Run {action}"),
                    run: None,
                    uses: uses.clone(),
                    shell: None,
                    conclusion: None,
                },
                _ => return Err(err(i, "a step has exactly one of run or uses")),
            };
            if let Some(name) = text("name")? {
                parsed.name = name;
            }
            parsed.shell = text("shell")?;
            Ok(parsed)
        })
        .collect()
}

impl WorkflowFile {
    /// Parses the workflow file at `path` (used in messages and as the default name).
    pub fn parse(path: &str, yaml: &str) -> Result<WorkflowFile, WorkflowError> {
        let doc: serde_yaml::Value =
            serde_yaml::from_str(yaml).map_err(|e| WorkflowError::Yaml {
                path: path.into(),
                error: e.to_string(),
            })?;
        let top = doc
            .as_mapping()
            .ok_or_else(|| WorkflowError::NotAMapping { path: path.into() })?;
        let on = top
            .get("on")
            .ok_or_else(|| WorkflowError::NoTrigger { path: path.into() })?;
        let dispatch = |v: &serde_yaml::Value| v.as_str() == Some("workflow_dispatch");
        let (dispatchable, inputs) = match on {
            serde_yaml::Value::String(_) => (dispatch(on), BTreeMap::new()),
            serde_yaml::Value::Sequence(s) => (s.iter().any(dispatch), BTreeMap::new()),
            serde_yaml::Value::Mapping(m) => match m.get("workflow_dispatch") {
                None => (false, BTreeMap::new()),
                Some(d) => {
                    let inputs = d
                        .get("inputs")
                        .and_then(|i| i.as_mapping())
                        .map(|i| {
                            i.iter()
                                .filter_map(|(k, v)| {
                                    let required = v
                                        .get("required")
                                        .and_then(serde_yaml::Value::as_bool)
                                        .unwrap_or(false);
                                    Some((k.as_str()?.to_owned(), required))
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    (true, inputs)
                }
            },
            _ => {
                return Err(WorkflowError::NoTrigger { path: path.into() });
            }
        };
        let jobs_map = top
            .get("jobs")
            .and_then(|j| j.as_mapping())
            .filter(|j| !j.is_empty())
            .ok_or_else(|| WorkflowError::NoJobs { path: path.into() })?;
        let mut jobs = Vec::new();
        for (k, v) in jobs_map {
            let key = k.as_str().unwrap_or_default().to_owned();
            let runs_on_err = |why| WorkflowError::RunsOn {
                path: path.into(),
                job: key.clone(),
                why,
            };
            let runs_on = v.get("runs-on").ok_or_else(|| runs_on_err("missing"))?;
            let runs_on = labels_of(runs_on)
                .filter(|l| !l.is_empty())
                .ok_or_else(|| runs_on_err("not a label, a list of labels or {labels: ...}"))?;
            if runs_on.iter().any(|l| l.contains("${{")) {
                // The simulator does not evaluate expressions (matrix labels).
                return Err(runs_on_err(
                    "expressions are not supported by the simulator",
                ));
            }
            let name = v
                .get("name")
                .and_then(|n| n.as_str())
                .map_or_else(|| key.clone(), str::to_owned);
            let steps = steps_of(path, &key, v.get("steps"))?;
            jobs.push(WorkflowJobDef {
                key,
                name,
                runs_on,
                steps,
            });
        }
        Ok(WorkflowFile {
            name: top
                .get("name")
                .and_then(|n| n.as_str())
                .map_or_else(|| path.to_owned(), str::to_owned),
            run_name: top
                .get("run-name")
                .and_then(|n| n.as_str())
                .map(str::to_owned),
            dispatchable,
            inputs,
            jobs,
        })
    }

    /// Why `inputs` do not fit the file's `workflow_dispatch.inputs` (GitHub's 422 messages).
    pub fn check_inputs(&self, inputs: &BTreeMap<String, String>) -> Result<(), String> {
        let unexpected: Vec<&String> = inputs
            .keys()
            .filter(|k| !self.inputs.contains_key(*k))
            .collect();
        if !unexpected.is_empty() {
            return Err(format!("Unexpected inputs provided: {unexpected:?}"));
        }
        match self
            .inputs
            .iter()
            .find(|(k, required)| **required && !inputs.contains_key(*k))
        {
            Some((k, _)) => Err(format!("Required input '{k}' not provided")),
            None => Ok(()),
        }
    }

    /// The run's title: `run-name` with `${{ inputs.X }}` replaced, else the workflow's name.
    pub fn display_title(&self, inputs: &BTreeMap<String, String>) -> String {
        let Some(template) = &self.run_name else {
            return self.name.clone();
        };
        let mut out = template.clone();
        for name in self.inputs.keys() {
            let value = inputs.get(name).map(String::as_str).unwrap_or("");
            for form in [
                format!("${{{{ inputs.{name} }}}}"),
                format!("${{{{inputs.{name}}}}}"),
            ] {
                out = out.replace(&form, value);
            }
        }
        out
    }
}

/// A workflow file registered in a repository.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimWorkflow {
    pub id: u64,
    /// `owner/repo`.
    pub repository: String,
    /// `.github/workflows/<file>`.
    pub path: String,
    pub file: WorkflowFile,
    pub created_at: DateTime<Utc>,
}

impl SimWorkflow {
    /// GitHub accepts the numeric id or the file name (`imp-smoke.yaml`) as `workflow_id`.
    pub fn matches(&self, id_or_file: &str) -> bool {
        id_or_file == self.id.to_string()
            || self.path.rsplit('/').next() == Some(id_or_file)
            || self.path == id_or_file
    }

    /// GitHub's workflow JSON.
    pub fn to_github_json(&self) -> Value {
        let api = format!("https://api.github.com/repos/{}", self.repository);
        let t = self.created_at.to_rfc3339_opts(SecondsFormat::Secs, true);
        json!({
            "id": self.id,
            "node_id": format!("W_kwDO{}", self.id),
            "name": self.file.name,
            "path": self.path,
            "state": "active",
            "created_at": t,
            "updated_at": t,
            "url": format!("{api}/actions/workflows/{}", self.id),
            "html_url": format!("https://github.com/{}/blob/main/{}", self.repository, self.path),
            "badge_url": format!("https://github.com/{}/workflows/{}/badge.svg", self.repository, self.file.name),
        })
    }
}

/// A run created by a dispatch.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimRun {
    pub id: u64,
    pub workflow_id: u64,
    pub repository: String,
    pub name: String,
    pub display_title: String,
    pub path: String,
    pub event: String,
    pub head_branch: String,
    pub created_at: DateTime<Utc>,
}

/// The simulator's workflows, dispatched runs and dispatch tokens (part of its model).
#[derive(Debug, Default)]
pub struct Workflows {
    pub defs: Vec<SimWorkflow>,
    pub runs: BTreeMap<u64, SimRun>,
    next_workflow_id: u64,
    next_run_id: u64,
    /// Tokens a user would create (a PAT with `actions: write`): accepted by the workflow and run
    /// endpoints, not by the runner endpoints.
    pub user_tokens: BTreeSet<String>,
}

impl Workflows {
    /// Registers (or replaces) the file at `path` in `repository`; returns its id.
    pub fn add(&mut self, repository: &str, path: &str, file: WorkflowFile) -> u64 {
        if let Some(w) = self
            .defs
            .iter_mut()
            .find(|w| w.repository.eq_ignore_ascii_case(repository) && w.path == path)
        {
            w.file = file;
            return w.id;
        }
        let id = 161_336 + self.next_workflow_id;
        self.next_workflow_id += 1;
        self.defs.push(SimWorkflow {
            id,
            repository: repository.to_owned(),
            path: path.to_owned(),
            file,
            created_at: Utc::now(),
        });
        id
    }

    pub fn find(&self, repository: &str, id_or_file: &str) -> Option<&SimWorkflow> {
        self.defs
            .iter()
            .find(|w| w.repository.eq_ignore_ascii_case(repository) && w.matches(id_or_file))
    }

    /// A new run id (a range of its own, apart from the ids of jobs queued through the admin API).
    pub fn next_run_id(&mut self) -> u64 {
        self.next_run_id += 1;
        5_100_000_000 + self.next_run_id
    }
}

fn ts(t: Option<DateTime<Utc>>) -> Value {
    t.map(|t| Value::String(t.to_rfc3339_opts(SecondsFormat::Secs, true)))
        .unwrap_or(Value::Null)
}

fn status_str(s: JobStatus) -> &'static str {
    match s {
        JobStatus::Queued => "queued",
        JobStatus::InProgress => "in_progress",
        JobStatus::Completed => "completed",
    }
}

/// GitHub's workflow run JSON for `run`, whose status, conclusion and times follow `jobs`.
pub fn run_json(run: &SimRun, jobs: &[&SimJob]) -> Value {
    let status = run_status(jobs.iter().copied());
    let conclusion = (status == JobStatus::Completed).then(|| {
        if jobs
            .iter()
            .all(|j| j.conclusion.as_deref() == Some("success"))
        {
            "success".to_owned()
        } else {
            // GitHub's run conclusion is the "worst" of its jobs'; the first non-success will do.
            jobs.iter()
                .filter_map(|j| j.conclusion.clone())
                .find(|c| c != "success")
                .unwrap_or_else(|| "failure".into())
        }
    });
    let started = jobs.iter().filter_map(|j| j.started_at).min();
    let updated = jobs
        .iter()
        .flat_map(|j| [Some(j.created_at), j.started_at, j.completed_at])
        .flatten()
        .chain([run.created_at])
        .max();
    let api = format!("https://api.github.com/repos/{}", run.repository);
    json!({
        "id": run.id,
        "name": run.name,
        "display_title": run.display_title,
        "node_id": format!("WFR_{}", run.id),
        "head_branch": run.head_branch,
        "head_sha": jobs.first().map(|j| j.head_sha.clone()),
        "path": run.path,
        "run_number": run.id % 10_000,
        "run_attempt": 1,
        "event": run.event,
        "status": status_str(status),
        "conclusion": conclusion,
        "workflow_id": run.workflow_id,
        "url": format!("{api}/actions/runs/{}", run.id),
        "html_url": format!("https://github.com/{}/actions/runs/{}", run.repository, run.id),
        "jobs_url": format!("{api}/actions/runs/{}/jobs", run.id),
        "created_at": ts(Some(run.created_at)),
        "updated_at": ts(updated),
        "run_started_at": ts(started.or(Some(run.created_at))),
    })
}

#[cfg(test)]
mod tests {
    use super::super::jobs::JobSpec;
    use super::*;

    const SMOKE: &str = include_str!("../../../smoke/workflow.yaml");

    #[test]
    fn the_smoke_workflow_is_dispatchable_with_one_job_for_the_pool_labels() {
        let f = WorkflowFile::parse(".github/workflows/imp-smoke.yaml", SMOKE).unwrap();
        assert!(f.dispatchable);
        assert_eq!(f.name, "imp-smoke");
        assert_eq!(f.jobs.len(), 1);
        assert_eq!(f.jobs[0].runs_on, vec!["self-hosted", "imp"]);
        let steps = &f.jobs[0].steps;
        assert_eq!(steps.len(), 1);
        let run = steps[0].run.as_deref().unwrap();
        assert!(run.contains("uname -a") && run.contains("\nid\n"), "{run}");
    }

    #[test]
    fn steps_are_run_or_uses_with_names_and_shells() {
        let f = WorkflowFile::parse(
            "w.yaml",
            "on: push\njobs:\n  a:\n    runs-on: x\n    steps:\n      - run: |\n          make\n          make test\n      - {name: Co, uses: actions/checkout@v4}\n      - {run: ls, shell: sh}\n",
        )
        .unwrap();
        let s = &f.jobs[0].steps;
        assert_eq!(
            (s[0].name.as_str(), s[0].run.as_deref()),
            ("Run make", Some("make\nmake test\n"))
        );
        assert_eq!(
            (s[1].name.as_str(), s[1].uses.as_deref()),
            ("Co", Some("actions/checkout@v4"))
        );
        assert_eq!(s[2].shell.as_deref(), Some("sh"));
        for (steps, why) in [
            ("[{run: a, uses: b}]", "exactly one of run or uses"),
            ("[{name: n}]", "exactly one of run or uses"),
            ("[x]", "a step is a mapping"),
            ("{a: b}", "steps is not a list"),
        ] {
            let yaml = format!("on: push\njobs:\n  a:\n    runs-on: x\n    steps: {steps}\n");
            let e = WorkflowFile::parse("w.yaml", &yaml)
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("w.yaml: jobs.a.steps[") && e.contains(why),
                "{e}"
            );
        }
    }

    #[test]
    fn triggers_runs_on_forms_and_names() {
        let p = "w.yaml";
        let f = WorkflowFile::parse(
            p,
            "on: [push, workflow_dispatch]\njobs:\n  a: {runs-on: x}\n  b: {name: Bee, runs-on: {group: g, labels: [y, z]}}\n",
        )
        .unwrap();
        assert!(f.dispatchable);
        assert_eq!(f.name, "w.yaml");
        assert_eq!(f.jobs[0].runs_on, vec!["x"]);
        assert_eq!(f.jobs[1].name, "Bee");
        assert_eq!(f.jobs[1].runs_on, vec!["y", "z"]);
        let push = WorkflowFile::parse(p, "on: push\njobs: {a: {runs-on: x}}\n").unwrap();
        assert!(!push.dispatchable);
        let map = WorkflowFile::parse(p, "on: {push: {}}\njobs: {a: {runs-on: x}}\n").unwrap();
        assert!(!map.dispatchable);
    }

    #[test]
    fn bad_files_name_the_file_and_the_field() {
        let p = ".github/workflows/x.yaml";
        let e = WorkflowFile::parse(p, "on: workflow_dispatch\njobs: {a: {steps: []}}\n");
        assert_eq!(
            e.unwrap_err().to_string(),
            ".github/workflows/x.yaml: jobs.a.runs-on: missing"
        );
        let e = WorkflowFile::parse(p, "on: workflow_dispatch\njobs: {}\n").unwrap_err();
        assert_eq!(e, WorkflowError::NoJobs { path: p.into() });
        let e = WorkflowFile::parse(p, "jobs: {a: {runs-on: x}}\n").unwrap_err();
        assert_eq!(e, WorkflowError::NoTrigger { path: p.into() });
        let e = WorkflowFile::parse(
            p,
            "on: workflow_dispatch\njobs: {a: {runs-on: '${{ matrix.os }}'}}\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("expressions"), "{e}");
        assert!(matches!(
            WorkflowFile::parse(p, "[").unwrap_err(),
            WorkflowError::Yaml { .. }
        ));
    }

    #[test]
    fn inputs_are_checked_and_fill_the_run_name() {
        let f = WorkflowFile::parse(
            "w.yaml",
            "name: W\nrun-name: smoke ${{ inputs.id }}\non:\n  workflow_dispatch:\n    inputs:\n      id: {required: true}\n      extra: {}\njobs: {a: {runs-on: x}}\n",
        )
        .unwrap();
        let inputs = |kv: &[(&str, &str)]| {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        assert_eq!(
            f.check_inputs(&inputs(&[])).unwrap_err(),
            "Required input 'id' not provided"
        );
        assert!(
            f.check_inputs(&inputs(&[("id", "1"), ("nope", "2")]))
                .unwrap_err()
                .starts_with("Unexpected inputs provided")
        );
        assert!(f.check_inputs(&inputs(&[("id", "1")])).is_ok());
        assert_eq!(f.display_title(&inputs(&[("id", "abc")])), "smoke abc");
        let plain = WorkflowFile::parse("w.yaml", SMOKE).unwrap();
        assert_eq!(plain.display_title(&inputs(&[])), "imp-smoke");
    }

    #[test]
    fn workflows_are_found_by_id_or_file_name_and_replaced_in_place() {
        let mut w = Workflows::default();
        let f = WorkflowFile::parse("x", SMOKE).unwrap();
        let id = w.add("o/r", ".github/workflows/imp-smoke.yaml", f.clone());
        assert_eq!(w.add("o/r", ".github/workflows/imp-smoke.yaml", f), id);
        assert!(w.find("O/R", "imp-smoke.yaml").is_some());
        assert!(w.find("o/r", &id.to_string()).is_some());
        assert!(w.find("o/r", "other.yaml").is_none());
        assert!(w.find("o/other", "imp-smoke.yaml").is_none());
        assert_ne!(w.next_run_id(), w.next_run_id());
    }

    #[test]
    fn a_run_follows_its_jobs_and_takes_the_worst_conclusion() {
        let run = SimRun {
            id: 7,
            workflow_id: 1,
            repository: "o/r".into(),
            name: "W".into(),
            display_title: "W".into(),
            path: ".github/workflows/w.yaml".into(),
            event: "workflow_dispatch".into(),
            head_branch: "main".into(),
            created_at: Utc::now(),
        };
        let mut a = SimJob::queued(1, JobSpec::default(), "o/r");
        let mut b = SimJob::queued(2, JobSpec::default(), "o/r");
        let v = run_json(&run, &[&a, &b]);
        assert_eq!(v["status"], "queued");
        assert_eq!(v["conclusion"], Value::Null);
        a.status = JobStatus::Completed;
        a.conclusion = Some("success".into());
        a.started_at = Some(Utc::now());
        assert_eq!(run_json(&run, &[&a, &b])["status"], "in_progress");
        b.status = JobStatus::Completed;
        b.conclusion = Some("cancelled".into());
        let v = run_json(&run, &[&a, &b]);
        assert_eq!(v["status"], "completed");
        assert_eq!(v["conclusion"], "cancelled");
        assert_eq!(v["event"], "workflow_dispatch");
        b.conclusion = Some("success".into());
        assert_eq!(run_json(&run, &[&a, &b])["conclusion"], "success");
    }
}
