//! The scale-set intake: a pool with `spec.github.scaleSet` takes its demand from a GitHub runner
//! scale set instead of (or beside) webhooks. Imp creates or adopts the scale set, holds one message
//! session per scale set, long-polls it, records every job in a durable ledger before
//! acknowledging the message, acquires the jobs the pool serves, and mints runners through the
//! scale set's `generatejitconfig` (docs/github.md).
//!
//! [`client`] is the process boundary (typed requests and answers), [`ledger`] the durable record,
//! [`decide`] the pure decisions, [`intake`] the thin executor and the per-pool supervisor.

pub mod client;
pub mod decide;
pub mod error;
pub mod intake;
pub mod ledger;

pub use client::ScaleSetClient;
pub use error::{Call, ScaleSetError};
pub use intake::{IntakeHost, IntakeSpec, ScaleSets, run_intakes};
pub use ledger::{Ledger, LedgerEntry, LedgerState};

use imp_api::GithubRunnerSpec;

/// The labels a pool's jobs are routed by: its labels, plus the scale set's name (what
/// `runs-on` names) when it has one.
pub fn route_labels(github: &GithubRunnerSpec) -> Vec<String> {
    let mut labels = github.labels.clone();
    if let Some(s) = &github.scale_set
        && !labels.iter().any(|l| l.eq_ignore_ascii_case(&s.name))
    {
        labels.push(s.name.clone());
    }
    labels
}
