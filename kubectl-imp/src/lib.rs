//! `kubectl imp`: the questions operators of an Imp installation ask, answered from the API server.
//!
//! - `status`: pools, nodes and the last failures ([`status`]);
//! - `why JOB|VM`: a job's wait per SLO phase, the slowest, its likely cause ([`why`]);
//! - `timeline VM`: every phase of one VM with times and sources ([`timeline`], also the smoke's);
//! - `console VM [-f]`: the guest's serial log through the node's runtime pod, redacted ([`console`]);
//! - `drain NODE`: cordon, move idle runners away, wait for running jobs ([`drain`]).
//!
//! Each verb reads through [`observe`], decides in a pure function, and prints a table or, with
//! `-o json|yaml`, the same data for scripts. Exit codes: [`Error::exit_code`].

pub mod cli;
pub mod console;
pub mod drain;
pub mod observe;
pub mod output;
pub mod status;
pub mod time;
pub mod timeline;
pub mod why;

use std::path::PathBuf;

/// Everything that can go wrong, each with the exit code scripts can rely on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot reach the cluster: {0}")]
    Config(String),
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{kind} {name} not found in namespace {namespace}")]
    NotFound {
        kind: &'static str,
        name: String,
        namespace: String,
    },
    #[error("no ImpVM in namespace {namespace} served job {job}")]
    JobNotFound { job: i64, namespace: String },
    #[error("ImpVM {vm} is on no node yet (not scheduled): it has no console")]
    NotScheduled { vm: String },
    #[error(
        "no imp-runtime pod on node {node} in namespace {namespace} \
         (label app.kubernetes.io/component=runtime)"
    )]
    NoRuntimePod { node: String, namespace: String },
    #[error("reading the console through {pod}: {message}")]
    Exec { pod: String, message: String },
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("json: {0}")]
    Json(serde_json::Error),
    #[error("yaml: {0}")]
    Yaml(serde_yaml::Error),
    #[error("node {node} still runs {busy} job(s) after {waited_s}s: {vms}")]
    DrainTimeout {
        node: String,
        busy: usize,
        waited_s: u64,
        vms: String,
    },
    #[error("the timeline misses phases: {0}")]
    PhasesMissing(String),
}

impl Error {
    /// 1: the cluster or a file could not be read; 3: the named object does not exist; 4: the node
    /// still runs jobs; 5: the timeline misses phases. (2 is a usage error, from clap.)
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::NotFound { .. } | Error::JobNotFound { .. } => 3,
            Error::DrainTimeout { .. } => 4,
            Error::PhasesMissing(_) => 5,
            _ => 1,
        }
    }
}

fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Api { what, source }
}
