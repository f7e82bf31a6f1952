//! A GitHub API simulator for tests: an axum server on 127.0.0.1 that follows GitHub's REST shapes,
//! status codes and auth rules for the endpoints Imp uses (App JWT -> installation token, runner
//! groups, generate-jitconfig, runners), keeps a runner registry and a job model, emits signed
//! `workflow_job` webhooks, speaks a small runner protocol for the fake runner
//! (`imp-fake-runner`), and injects faults on demand. See docs/github.md.

mod config;
#[cfg(test)]
mod dispatch_tests;
pub mod http;
pub mod jobs;
pub mod jwt;
pub mod keys;
pub mod model;
mod payload;
mod registry;
pub mod releases;
pub mod runner_protocol;
pub mod scaleset;
#[cfg(test)]
mod scaleset_tests;
mod server;
mod shared;
#[cfg(test)]
mod sim_tests;
#[cfg(test)]
mod steps_tests;
pub mod webhooks;
pub mod workflows;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use tokio::sync::mpsc;

pub use config::SimConfig;
pub use jobs::{JobSpec, JobStatus, SimJob};
pub use keys::{AppKey, test_key};
pub use model::{
    Delivery, Fault, FaultRule, SimRunner, SimRunnerGroup, SimScope, SimStats, WebhookFault,
};
pub use webhooks::{ReceivedHook, WebhookSink, sign_body, verify_signature};

use jobs::random_token;
use model::{Model, RateWindow};
use shared::Shared;

/// The Secret keys Imp reads App credentials from (docs/github.md).
pub const SECRET_KEY_APP_ID: &str = "app-id";
pub const SECRET_KEY_INSTALLATION_ID: &str = "installation-id";
pub const SECRET_KEY_PRIVATE_KEY: &str = "private-key";

/// Which PEM form of the App key to hand out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFormat {
    /// `BEGIN RSA PRIVATE KEY` (what GitHub's "Generate a private key" downloads).
    Pkcs1,
    /// `BEGIN PRIVATE KEY`.
    Pkcs8,
}

/// A running simulator. Dropping it stops the server.
pub struct GithubSim {
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
    worker: tokio::task::JoinHandle<()>,
}

impl Drop for GithubSim {
    fn drop(&mut self) {
        self.server.abort();
        self.worker.abort();
    }
}

impl GithubSim {
    /// Starts a simulator on 127.0.0.1 with an ephemeral port.
    pub async fn start(config: SimConfig) -> anyhow::Result<GithubSim> {
        Self::start_on(config, "127.0.0.1:0").await
    }

    /// Starts a simulator on the given address (the standalone `github-sim` binary uses this).
    pub async fn start_on(config: SimConfig, addr: &str) -> anyhow::Result<GithubSim> {
        Self::start_listening(config, tokio::net::TcpListener::bind(addr).await?).await
    }

    /// Starts a simulator on a listener the caller bound (e.g. in another network namespace).
    pub async fn start_listening(
        config: SimConfig,
        listener: tokio::net::TcpListener,
    ) -> anyhow::Result<GithubSim> {
        let key = test_key(config.key_index);
        let base_url = format!("http://{}", listener.local_addr()?);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut groups = vec![SimRunnerGroup {
            id: 1,
            name: "Default".into(),
            default: true,
        }];
        for (i, name) in config.runner_groups.iter().enumerate() {
            groups.push(SimRunnerGroup {
                id: i as u64 + 2,
                name: name.clone(),
                default: false,
            });
        }
        let permissions = BTreeMap::from([
            (
                "organization_self_hosted_runners".to_string(),
                "write".to_string(),
            ),
            ("administration".to_string(), "write".to_string()),
            ("actions".to_string(), "read".to_string()),
            ("metadata".to_string(), "read".to_string()),
        ]);
        let model = Model {
            revoked: false,
            permissions,
            tokens: HashMap::new(),
            rate: HashMap::<String, RateWindow>::new(),
            groups,
            runners: BTreeMap::new(),
            next_runner_id: 1,
            credentials: HashMap::new(),
            sessions: HashMap::new(),
            jobs: BTreeMap::new(),
            next_job_id: 1_000_001,
            faults: VecDeque::new(),
            webhook_faults: VecDeque::new(),
            webhook: config
                .webhook_url
                .clone()
                .map(|u| (u, config.webhook_secret.clone())),
            deliveries: Vec::new(),
            stats: SimStats::default(),
            workflows: Default::default(),
            never_online_next: 0,
            never_online: Default::default(),
            releases: Default::default(),
        };
        let shared = Arc::new(Shared {
            config,
            key,
            base_url,
            model: Mutex::new(model),
            scalesets: Mutex::new(Default::default()),
            hooks: tx,
        });
        let worker = tokio::spawn(webhooks::delivery_worker(shared.clone(), rx));
        let router = server::router(shared.clone());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Ok(GithubSim {
            shared,
            server,
            worker,
        })
    }

    /// `http://127.0.0.1:<port>`: the REST API base (pass to `OctocrabBuilder::base_uri`).
    pub fn base_url(&self) -> &str {
        &self.shared.base_url
    }

    pub fn config(&self) -> &SimConfig {
        &self.shared.config
    }

    pub fn app_id(&self) -> u64 {
        self.shared.config.app_id
    }

    pub fn installation_id(&self) -> u64 {
        self.shared.config.installation_id
    }

    pub fn org(&self) -> &str {
        &self.shared.config.org
    }

    /// The App's private key.
    pub fn app_key(&self) -> Arc<AppKey> {
        self.shared.key.clone()
    }

    /// The App's private key as PEM.
    pub fn private_key_pem(&self, format: KeyFormat) -> String {
        match format {
            KeyFormat::Pkcs1 => self.shared.key.pkcs1_pem(),
            KeyFormat::Pkcs8 => self.shared.key.pkcs8_pem(),
        }
    }

    /// The data of an App credentials Secret for this simulator (`app-id`, `installation-id`,
    /// `private-key`).
    pub fn secret_data(&self, format: KeyFormat) -> BTreeMap<String, String> {
        BTreeMap::from([
            (SECRET_KEY_APP_ID.to_string(), self.app_id().to_string()),
            (
                SECRET_KEY_INSTALLATION_ID.to_string(),
                self.installation_id().to_string(),
            ),
            (
                SECRET_KEY_PRIVATE_KEY.to_string(),
                self.private_key_pem(format),
            ),
        ])
    }

    /// A client for the HTTP admin API (the same operations as the methods below).
    pub fn admin(&self) -> AdminClient {
        AdminClient::new(self.base_url())
    }

    /// Injects a REST fault.
    pub fn inject(&self, rule: FaultRule) {
        self.shared.model().faults.push_back(rule);
    }

    /// Removes all pending REST faults.
    pub fn clear_faults(&self) {
        self.shared.model().faults.clear();
    }

    /// Applies `fault` to the next `count` webhook deliveries.
    pub fn inject_webhook_fault(&self, fault: WebhookFault, count: u32) {
        self.shared.model().webhook_faults.push_back((fault, count));
    }

    /// Revokes the App installation: its tokens stop working and token exchange answers 404.
    pub fn revoke_installation(&self) {
        let mut m = self.shared.model();
        m.revoked = true;
        m.tokens.clear();
    }

    pub fn restore_installation(&self) {
        self.shared.model().revoked = false;
    }

    /// Sets (or with `None` removes) an App permission, e.g. `organization_self_hosted_runners`.
    pub fn set_permission(&self, name: &str, level: Option<&str>) {
        let mut m = self.shared.model();
        match level {
            Some(l) => m.permissions.insert(name.to_string(), l.to_string()),
            None => m.permissions.remove(name),
        };
    }

    /// Expires every installation token now (the next use answers 401 Bad credentials).
    pub fn expire_tokens(&self) {
        let past = Utc::now() - chrono::Duration::seconds(1);
        for exp in self.shared.model().tokens.values_mut() {
            *exp = past;
        }
    }

    /// Sets where webhooks go and the secret that signs them.
    pub fn set_webhook(&self, url: &str, secret: &str) {
        self.shared.model().webhook = Some((url.to_string(), secret.to_string()));
    }

    /// Queues a job with these labels; emits the `queued` webhook.
    pub fn queue_job(&self, spec: JobSpec) -> SimJob {
        self.shared.queue_job(spec)
    }

    pub fn job(&self, id: u64) -> Option<SimJob> {
        self.shared.model().jobs.get(&id).cloned()
    }

    /// A runner outside Imp (e.g. GitHub-hosted) takes the queued job: in progress under
    /// `runner_name`; emits the `in_progress` webhook. None if the job is not queued.
    pub fn start_job(&self, id: u64, runner_name: &str) -> Option<SimJob> {
        let job = {
            let mut m = self.shared.model();
            let job = m
                .jobs
                .get_mut(&id)
                .filter(|j| j.status == JobStatus::Queued)?;
            job.status = JobStatus::InProgress;
            job.started_at = Some(Utc::now());
            job.runner_name = Some(runner_name.to_string());
            job.clone()
        };
        self.shared.emit(&job, "in_progress");
        Some(job)
    }

    /// Completes the job (cancelled while queued, or finished by a runner outside Imp); emits
    /// the `completed` webhook. None if it is unknown or already completed.
    pub fn complete_job(&self, id: u64, conclusion: &str) -> Option<SimJob> {
        let job = {
            let mut m = self.shared.model();
            let job = m
                .jobs
                .get_mut(&id)
                .filter(|j| j.status != JobStatus::Completed)?;
            job.status = JobStatus::Completed;
            job.conclusion = Some(conclusion.to_string());
            job.completed_at = Some(Utc::now());
            job.clone()
        };
        self.shared.emit(&job, "completed");
        Some(job)
    }

    pub fn jobs(&self) -> Vec<SimJob> {
        self.shared.model().jobs.values().cloned().collect()
    }

    pub fn runners(&self) -> Vec<SimRunner> {
        self.shared.model().runners.values().cloned().collect()
    }

    pub fn stats(&self) -> SimStats {
        self.shared.model().stats.clone()
    }

    pub fn deliveries(&self) -> Vec<Delivery> {
        self.shared.model().deliveries.clone()
    }

    /// Remaining primary rate limit of the installation.
    pub fn installation_rate_remaining(&self) -> u32 {
        let key = format!("installation:{}", self.installation_id());
        let m = self.shared.model();
        m.rate
            .get(&key)
            .map(|w| w.remaining())
            .unwrap_or(self.shared.config.rate_limit)
    }

    /// Waits until `pred` holds for the job (or `timeout`); returns the job's last state.
    pub async fn wait_job(
        &self,
        id: u64,
        timeout: Duration,
        pred: impl Fn(&SimJob) -> bool,
    ) -> Option<SimJob> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let job = self.job(id);
            if job.as_ref().is_some_and(&pred) || tokio::time::Instant::now() >= deadline {
                return job;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Client for the simulator's HTTP admin API (`/_admin/...`), for processes that don't hold the
/// [`GithubSim`] handle (the smoke test, other test binaries).
#[derive(Clone)]
pub struct AdminClient {
    base: String,
    http: http::HttpClient,
}

impl AdminClient {
    pub fn new(base_url: &str) -> Self {
        AdminClient {
            base: base_url.trim_end_matches('/').to_string(),
            http: Default::default(),
        }
    }

    async fn call(
        &self,
        method: ::http::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> anyhow::Result<serde_json::Value> {
        let url = format!("{}{}", self.base, path);
        let resp = self.http.json(method, &url, &[], body.as_ref()).await?;
        anyhow::ensure!(
            resp.status.is_success(),
            "{path}: {} {}",
            resp.status,
            resp.json()
        );
        Ok(resp.json())
    }

    pub async fn inject(&self, rule: &FaultRule) -> anyhow::Result<()> {
        self.call(
            ::http::Method::POST,
            "/_admin/faults",
            Some(serde_json::to_value(rule)?),
        )
        .await
        .map(drop)
    }

    pub async fn clear_faults(&self) -> anyhow::Result<()> {
        self.call(::http::Method::DELETE, "/_admin/faults", None)
            .await
            .map(drop)
    }

    pub async fn inject_webhook_fault(
        &self,
        fault: WebhookFault,
        count: u32,
    ) -> anyhow::Result<()> {
        let body = serde_json::json!({ "fault": fault, "count": count });
        self.call(::http::Method::POST, "/_admin/webhook-faults", Some(body))
            .await
            .map(drop)
    }

    pub async fn set_webhook(&self, url: &str, secret: &str) -> anyhow::Result<()> {
        let body = serde_json::json!({ "url": url, "secret": secret });
        self.call(::http::Method::PUT, "/_admin/webhook", Some(body))
            .await
            .map(drop)
    }

    pub async fn queue_job(&self, spec: &JobSpec) -> anyhow::Result<SimJob> {
        let v = self
            .call(
                ::http::Method::POST,
                "/_admin/jobs",
                Some(serde_json::to_value(spec)?),
            )
            .await?;
        Ok(serde_json::from_value(v)?)
    }

    pub async fn job(&self, id: u64) -> anyhow::Result<SimJob> {
        let v = self
            .call(::http::Method::GET, &format!("/_admin/jobs/{id}"), None)
            .await?;
        Ok(serde_json::from_value(v)?)
    }

    pub async fn revoke_installation(&self) -> anyhow::Result<()> {
        self.call(::http::Method::POST, "/_admin/installation/revoke", None)
            .await
            .map(drop)
    }

    pub async fn restore_installation(&self) -> anyhow::Result<()> {
        self.call(::http::Method::POST, "/_admin/installation/restore", None)
            .await
            .map(drop)
    }

    pub async fn expire_tokens(&self) -> anyhow::Result<()> {
        self.call(::http::Method::POST, "/_admin/tokens/expire", None)
            .await
            .map(drop)
    }

    pub async fn stats(&self) -> anyhow::Result<SimStats> {
        let v = self
            .call(::http::Method::GET, "/_admin/stats", None)
            .await?;
        Ok(serde_json::from_value(v)?)
    }

    pub async fn runners(&self) -> anyhow::Result<Vec<SimRunner>> {
        let v = self
            .call(::http::Method::GET, "/_admin/runners", None)
            .await?;
        Ok(serde_json::from_value(v)?)
    }

    pub async fn deliveries(&self) -> anyhow::Result<Vec<Delivery>> {
        let v = self
            .call(::http::Method::GET, "/_admin/deliveries", None)
            .await?;
        Ok(serde_json::from_value(v)?)
    }
}

impl GithubSim {
    /// Registers the workflow file `path` (`.github/workflows/<file>`) with `yaml` in `repository`
    /// (default: the first); returns its id.
    pub fn add_workflow(
        &self,
        repository: Option<&str>,
        path: &str,
        yaml: &str,
    ) -> Result<u64, workflows::WorkflowError> {
        let file = workflows::WorkflowFile::parse(path, yaml)?;
        let repo = repository
            .map(str::to_owned)
            .or_else(|| self.shared.config.repos.first().cloned())
            .unwrap_or_default();
        Ok(self.shared.model().workflows.add(&repo, path, file))
    }

    /// A token that may dispatch workflows and read runs and jobs (what a user's PAT is to GitHub).
    pub fn user_token(&self) -> String {
        let token = format!("github_pat_{}", random_token(40));
        self.shared
            .model()
            .workflows
            .user_tokens
            .insert(token.clone());
        token
    }

    /// The runs dispatches created.
    pub fn dispatched_runs(&self) -> Vec<workflows::SimRun> {
        self.shared
            .model()
            .workflows
            .runs
            .values()
            .cloned()
            .collect()
    }
}

impl AdminClient {
    /// [`GithubSim::add_workflow`] over the admin API.
    pub async fn add_workflow(
        &self,
        repository: Option<&str>,
        path: &str,
        yaml: &str,
    ) -> anyhow::Result<u64> {
        let body = serde_json::json!({ "repository": repository, "path": path, "content": yaml });
        let v = self
            .call(::http::Method::POST, "/_admin/workflows", Some(body))
            .await?;
        v["id"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("/_admin/workflows answered {v}"))
    }

    /// [`GithubSim::user_token`] over the admin API.
    pub async fn user_token(&self) -> anyhow::Result<String> {
        let v = self
            .call(::http::Method::POST, "/_admin/user-tokens", None)
            .await?;
        v["token"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| anyhow::anyhow!("/_admin/user-tokens answered no token"))
    }
}

/// Path of the `imp-fake-runner` binary: `$IMP_FAKE_RUNNER_BIN`; else the one beside the running
/// test when it is newer than every testkit source; else built once per process with
/// `cargo build -p imp-fake-runner --bin imp-fake-runner` into the target dir the test lives in.
pub fn fake_runner_binary() -> anyhow::Result<std::path::PathBuf> {
    static BUILT: std::sync::OnceLock<Result<std::path::PathBuf, String>> =
        std::sync::OnceLock::new();
    if let Some(p) = std::env::var_os("IMP_FAKE_RUNNER_BIN") {
        return Ok(p.into());
    }
    BUILT
        .get_or_init(|| {
            crate::bins::ensure_built(
                &[("imp-fake-runner", "imp-fake-runner")],
                &["fake-runner/src", "fake-runner/Cargo.toml"],
            )
            .map(|mut paths| paths.remove(0))
        })
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

impl GithubSim {
    /// The scale sets, their sessions and queues.
    pub fn scale_sets(&self) -> Vec<scaleset::SimScaleSet> {
        self.shared.scalesets().sets.values().cloned().collect()
    }

    /// The jobs routed to scale sets, by runner request id.
    pub fn scale_set_jobs(&self) -> Vec<scaleset::ScaleSetJob> {
        self.shared.scalesets().jobs.values().cloned().collect()
    }

    pub fn scale_set_stats(&self) -> scaleset::ScaleSetStats {
        self.shared.scalesets().stats.clone()
    }

    /// Every credential the scale-set protocol handed out (registration, admin and queue tokens):
    /// what a test checks never reached a log.
    pub fn scale_set_credentials(&self) -> Vec<String> {
        let ss = self.shared.scalesets();
        ss.registration_tokens
            .keys()
            .chain(ss.admin_tokens.keys())
            .cloned()
            .chain(
                ss.sets
                    .values()
                    .filter_map(|s| s.session.as_ref().map(|x| x.queue_token.clone())),
            )
            .collect()
    }

    /// The next `count` message deletes fail (500) without deleting: the message is redelivered.
    /// Sets the runner releases: GitHub's newest (what the downloads API lists), the minimum the
    /// broker accepts (older runners are refused as deprecated) and whether it refuses every
    /// version (an outage).
    pub fn set_runner_releases(&self, latest: &str, minimum: Option<&str>, refuse_all: bool) {
        let mut m = self.shared.model();
        m.releases.latest = latest.to_string();
        m.releases.minimum = minimum.map(str::to_string);
        m.releases.refuse_all = refuse_all;
    }

    /// The runner release state with its counters (refusals, downloads calls).
    pub fn runner_releases(&self) -> releases::RunnerReleases {
        self.shared.model().releases.clone()
    }

    /// The broker stops answering long polls (they hang) while `deaf`, and answers again after.
    pub fn set_scale_set_deaf(&self, deaf: bool) {
        self.shared.scalesets().deaf = deaf;
    }

    /// Every live session's queue token expires: queue calls answer 401 until the listener
    /// refreshes its session (`PATCH .../sessions/{id}`).
    pub fn expire_scale_set_queue_tokens(&self) {
        self.shared.scalesets().expire_queue_tokens();
    }

    pub fn fail_scale_set_acks(&self, count: u32) {
        self.shared.scalesets().failing_acks = count;
    }

    /// Holds the next `count` acks of a message offering a job open until the listener goes away
    /// (killed, its session ended); the message is then not deleted. `acks_held` and
    /// `acks_discarded` in [`Self::scale_set_stats`] count them.
    pub fn hold_scale_set_acks(&self, count: u32) {
        self.shared.scalesets().holding_acks = count;
    }

    /// Sets how long an unpolled session lives and how long a poll waits before answering 202.
    pub fn set_scale_set_timing(&self, session_ttl: Duration, poll_timeout: Duration) {
        let mut ss = self.shared.scalesets();
        ss.session_ttl = session_ttl;
        ss.poll_timeout = poll_timeout;
    }
}
