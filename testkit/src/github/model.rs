//! The simulator's state: installation, tokens, rate-limit windows, runner groups, runner registry,
//! jobs, faults and webhook deliveries. Plain data behind one mutex; handlers never hold it across
//! an await.

use std::collections::{BTreeMap, HashMap, VecDeque};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::jobs::SimJob;

/// Where a runner is registered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "name")]
pub enum SimScope {
    /// An organization (login).
    Organization(String),
    /// A repository (`owner/repo`).
    Repository(String),
}

/// A registered self-hosted runner.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimRunner {
    pub id: u64,
    pub name: String,
    pub scope: SimScope,
    pub labels: Vec<String>,
    pub runner_group_id: u64,
    pub work_folder: String,
    /// "offline" until the runner connects, then "online".
    pub status: String,
    pub busy: bool,
    pub job_id: Option<u64>,
}

impl SimRunner {
    /// GitHub's runner JSON.
    pub fn to_github_json(&self) -> Value {
        let labels: Vec<Value> = self
            .labels
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let read_only = ["self-hosted", "linux", "x64", "arm64"]
                    .iter()
                    .any(|s| s.eq_ignore_ascii_case(l));
                json!({
                    "id": i as u64 + 1,
                    "name": l,
                    "type": if read_only { "read-only" } else { "custom" },
                })
            })
            .collect();
        json!({
            "id": self.id,
            "name": self.name,
            "os": "Linux",
            "status": self.status,
            "busy": self.busy,
            "ephemeral": true,
            "runner_group_id": self.runner_group_id,
            "labels": labels,
        })
    }
}

/// A runner group (organization scope).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimRunnerGroup {
    pub id: u64,
    pub name: String,
    pub default: bool,
}

/// An injected REST fault (the admin API's `POST /_admin/faults` body).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultRule {
    pub fault: Fault,
    /// How many matching calls it applies to.
    #[serde(default = "one")]
    pub count: u32,
    /// Only calls whose path contains this (e.g. `generate-jitconfig`, `access_tokens`).
    #[serde(default)]
    pub path_contains: Option<String>,
}

fn one() -> u32 {
    1
}

impl FaultRule {
    /// `fault` for the next `count` REST calls of any path.
    pub fn next(count: u32, fault: Fault) -> Self {
        FaultRule {
            fault,
            count,
            path_contains: None,
        }
    }

    /// Restricts the rule to paths containing `fragment`.
    pub fn on_path(mut self, fragment: &str) -> Self {
        self.path_contains = Some(fragment.to_string());
        self
    }
}

/// The kinds of REST fault.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Fault {
    /// Answer with this 5xx status.
    ServerError { status: u16 },
    /// 429 with `Retry-After`.
    RateLimit { retry_after_secs: u64 },
    /// 403 with GitHub's secondary-rate-limit message, and `Retry-After` if given.
    SecondaryRateLimit { retry_after_secs: Option<u64> },
    /// Delay the call, then serve it normally.
    Delay { millis: u64 },
    /// Serve the call, then hold the answer back: a client that times out meanwhile loses an
    /// answer whose effect (e.g. a registered runner) already happened.
    DelayAnswer { millis: u64 },
}

/// Webhook delivery faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookFault {
    /// Never send the delivery.
    Drop,
    /// Send the delivery twice with the same `X-GitHub-Delivery`.
    Duplicate,
    /// Hold the delivery back and send it after the next one.
    Reorder,
}

/// One webhook delivery attempt as recorded by the simulator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Delivery {
    pub delivery_id: String,
    pub event: String,
    pub action: String,
    pub job_id: u64,
    /// "delivered", "dropped", "no-url" or "failed: <error>".
    pub outcome: String,
    pub status: Option<u16>,
}

/// Counters a test can assert on.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SimStats {
    /// Successful installation token exchanges.
    pub token_exchanges: u64,
    /// Refused token exchanges (bad JWT, revoked installation).
    pub token_exchanges_refused: u64,
    pub jit_configs_issued: u64,
    pub runners_deleted: u64,
    /// REST calls answered (including faults and errors).
    pub api_requests: u64,
    /// REST calls charged to a primary rate limit (GitHub does not charge a 304).
    pub charged_requests: u64,
    /// Conditional GETs answered 304 Not Modified.
    pub not_modified: u64,
    pub faults_injected: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct RateWindow {
    pub limit: u32,
    pub used: u32,
    pub reset_at: i64,
}

impl RateWindow {
    pub fn remaining(&self) -> u32 {
        self.limit.saturating_sub(self.used)
    }
}

pub(crate) struct Model {
    pub revoked: bool,
    pub permissions: BTreeMap<String, String>,
    pub tokens: HashMap<String, DateTime<Utc>>,
    pub rate: HashMap<String, RateWindow>,
    pub groups: Vec<SimRunnerGroup>,
    pub runners: BTreeMap<u64, SimRunner>,
    pub next_runner_id: u64,
    /// Unused JIT credentials -> runner id (one-time).
    pub credentials: HashMap<String, u64>,
    /// Runner sessions -> runner id.
    pub sessions: HashMap<String, u64>,
    pub jobs: BTreeMap<u64, SimJob>,
    pub next_job_id: u64,
    pub faults: VecDeque<FaultRule>,
    pub webhook_faults: VecDeque<(WebhookFault, u32)>,
    pub webhook: Option<(String, String)>,
    pub deliveries: Vec<Delivery>,
    pub stats: SimStats,
    /// Workflow files, dispatched runs and dispatch tokens (`workflows.rs`).
    pub workflows: super::workflows::Workflows,
    /// How many of the next runners to connect are held offline (`POST /_admin/runner-faults`).
    pub never_online_next: u32,
    /// Runners held offline: their connect answers 503 for good (a runner that never comes online).
    pub never_online: std::collections::BTreeSet<u64>,
    /// The newest runner release and the broker's version enforcement (`releases.rs`).
    pub releases: super::releases::RunnerReleases,
}

impl Model {
    /// Takes the first fault matching `path`, if any.
    pub fn take_fault(&mut self, path: &str) -> Option<Fault> {
        let idx = self.faults.iter().position(|r| {
            r.count > 0 && r.path_contains.as_deref().is_none_or(|p| path.contains(p))
        })?;
        let rule = &mut self.faults[idx];
        rule.count -= 1;
        let fault = rule.fault.clone();
        if rule.count == 0 {
            self.faults.remove(idx);
        }
        self.stats.faults_injected += 1;
        Some(fault)
    }

    pub fn take_webhook_fault(&mut self) -> Option<WebhookFault> {
        let front = self.webhook_faults.front_mut()?;
        front.1 -= 1;
        let f = front.0;
        if front.1 == 0 {
            self.webhook_faults.pop_front();
        }
        Some(f)
    }
}

/// GitHub's label match: every job label is among the runner's labels (case-insensitive).
pub fn labels_match(job: &[String], runner: &[String]) -> bool {
    job.iter()
        .all(|j| runner.iter().any(|r| r.eq_ignore_ascii_case(j)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_matching_is_subset_and_case_insensitive() {
        let runner = vec![
            "self-hosted".to_string(),
            "imp".to_string(),
            "Linux".to_string(),
        ];
        assert!(labels_match(&["imp".into(), "linux".into()], &runner));
        assert!(!labels_match(&["imp".into(), "gpu".into()], &runner));
        assert!(labels_match(&[], &runner));
    }
}
