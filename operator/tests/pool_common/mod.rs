//! Shared harness of the runner-pool tests: a GitHub simulator whose webhooks go to an in-process webhook
//! server, the pool controller scoped to the test's namespace, fixtures, and a fake node agent that plays
//! the node side by writing ImpVM status (and optionally runs the simulator's fake runner with the VM's
//! JIT config, so jobs really go in_progress and complete at the simulator).

#![allow(dead_code)] // each test binary uses a different subset

pub mod scaleset_chaos;

use std::{
    collections::BTreeMap,
    io::Write,
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use imp_api::{
    HandoffState, ImpVM, ImpVMRunnerPool, ImpVMStatus, RunnerStatus, VmPhase,
    names::{
        ANNOTATION_RUNNER_ID, ANNOTATION_RUNNER_NAME, LABEL_RUNNER_POOL, SECRET_KEY_JITCONFIG,
    },
};
use imp_operator::{
    github::{GithubApps, GithubConfig, GithubMetrics, RetryPolicy},
    index::{Index, IndexConfig},
    metrics::encode,
    runnerpool::{
        PoolControllerConfig, PoolMetrics, PoolShared, PoolTiming, run_runnerpool_controller,
    },
    webhook::webhook_router,
};
use imp_testkit::{
    TestEnv, fixtures,
    github::{
        GithubSim, KeyFormat, SimConfig,
        runner_protocol::{FakeRunnerOptions, VersionDeprecated, run_fake_runner},
    },
};
use k8s_openapi::{
    api::core::v1::Secret, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::{ListParams, Patch, PatchParams, PostParams},
};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

pub const WEBHOOK_SECRET: &str = "pool-test-webhook-secret";
pub const APP_SECRET: &str = "github-app";
pub const LABELS: [&str; 3] = ["self-hosted", "imp", "linux"];

/// Everything the controller logs, across all tests of the binary (the secrets test scans it).
pub fn captured_logs() -> String {
    String::from_utf8_lossy(&LOGS.lock().unwrap()).into_owned()
}

static LOGS: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct Capture;

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGS.lock().unwrap().extend_from_slice(buf);
        if std::env::var_os("IMP_LOG").is_some() {
            let _ = std::io::stderr().write_all(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn init_logging() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // Everything at debug and above from the operator, including the GitHub client.
        let _ = tracing_subscriber::fmt()
            .with_env_filter("imp_operator=trace,imp_agent=debug,imp_testkit=info")
            .with_writer(|| Capture)
            .with_ansi(false)
            .try_init();
    });
}

/// Fast production-shaped timings.
pub fn fast_timing() -> PoolTiming {
    PoolTiming {
        sweep_interval: Duration::from_secs(60),
        mint_backoff: Duration::from_millis(500),
        mint_backoff_max: Duration::from_secs(2),
        start_backoff: Duration::from_millis(500),
        start_backoff_max: Duration::from_secs(2),
        scaling_requeue: Duration::from_millis(100),
        retry: Duration::from_millis(500),
        resync: Duration::from_secs(5),
        debounce: Duration::from_millis(50),
        deletion_timeout: Duration::from_secs(30),
        ..PoolTiming::default()
    }
}

pub fn github_config(sim: &GithubSim) -> GithubConfig {
    GithubConfig {
        api_base_url: sim.base_url().to_string(),
        request_timeout: Duration::from_secs(5),
        retry: RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(20),
            max_delay: Duration::from_millis(100),
            max_rate_limit_wait: Duration::from_secs(2),
        },
        jit_mints_per_minute: 1_000_000,
        jit_mint_burst: 100_000,
        ..GithubConfig::default()
    }
}

pub struct PoolHarness {
    pub env: TestEnv,
    pub client: Client,
    pub ns: String,
    pub sim: GithubSim,
    pub shared: Arc<PoolShared>,
    pub webhook_url: String,
    registry: Registry,
    tasks: Vec<JoinHandle<()>>,
    /// The in-process "operator": webhook server and pool controller.
    operator: Vec<JoinHandle<()>>,
    timing: PoolTiming,
    /// The runner version the fake agent's runners state (the simulator's broker checks it).
    pub runner_version: Arc<Mutex<String>>,
    /// How long the fake agent's runners take to exit after their job (a real runner reports and
    /// uploads its logs first); the exit is recorded after it.
    pub runner_exit_delay: Arc<Mutex<Duration>>,
    /// Nodes and the class of [`Self::add_nodes`] (cluster-scoped: deleted on drop).
    nodes: Vec<String>,
    class: Option<String>,
}

impl PoolHarness {
    pub async fn start(prefix: &str) -> Self {
        Self::start_with(prefix, fast_timing()).await
    }

    pub async fn start_with(prefix: &str, timing: PoolTiming) -> Self {
        init_logging();
        let env = TestEnv::new(prefix).await;
        let client = env.client.clone();
        let ns = env.namespace.clone();
        let sim = GithubSim::start(SimConfig::default())
            .await
            .expect("simulator starts");
        let mut h = PoolHarness {
            env,
            client,
            ns,
            sim,
            shared: PoolShared::new(
                Arc::new(GithubApps::new(
                    GithubConfig::default(),
                    GithubMetrics::default(),
                )),
                PoolMetrics::default(),
            ),
            webhook_url: String::new(),
            registry: Registry::default(),
            tasks: vec![],
            operator: vec![],
            timing,
            runner_version: Arc::new(Mutex::new(
                imp_testkit::github::releases::DEFAULT_LATEST.to_string(),
            )),
            runner_exit_delay: Arc::new(Mutex::new(Duration::ZERO)),
            nodes: vec![],
            class: None,
        };
        h.start_operator().await;
        h.create_secret(APP_SECRET, h.sim.secret_data(KeyFormat::Pkcs1))
            .await;
        h.create_secret(
            "webhook",
            BTreeMap::from([("webhook-secret".to_string(), WEBHOOK_SECRET.to_string())]),
        )
        .await;
        h
    }

    /// Starts the operator side with fresh in-memory state: metrics, demand, webhook server, controller.
    async fn start_operator(&mut self) {
        let gh_metrics = GithubMetrics::default();
        let metrics = PoolMetrics::default();
        let mut registry = Registry::default();
        gh_metrics.register(&mut registry);
        metrics.register(&mut registry);
        let apps = Arc::new(GithubApps::new(github_config(&self.sim), gh_metrics));
        let shared = PoolShared::new(apps, metrics);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let webhook_url = format!("http://{}/webhooks/github", listener.local_addr().unwrap());
        let router = webhook_router(shared.clone());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        self.sim.set_webhook(&webhook_url, WEBHOOK_SECRET);
        let mut config = PoolControllerConfig::new();
        config.namespace = Some(self.ns.clone());
        config.timing = self.timing.clone();
        let index = Index::start(self.client.clone(), IndexConfig::namespace(&self.ns));
        let controller = tokio::spawn(run_runnerpool_controller(
            self.client.clone(),
            index,
            config,
            shared.clone(),
        ));
        // Deliveries are answered 503 until the controller has read the pools' secrets.
        let loading = Instant::now();
        while !shared.routes_loaded() {
            assert!(
                loading.elapsed() < Duration::from_secs(30),
                "the pool controller never read the pools' webhook secrets"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.shared = shared;
        self.webhook_url = webhook_url;
        self.registry = registry;
        self.operator = vec![server, controller];
    }

    /// Stops the operator and starts a new one: all in-memory state (demand, deliveries, backoff,
    /// metrics) is lost, as in a restart of the operator process.
    pub async fn restart_operator(&mut self) {
        self.stop_operator().await;
        self.start_operator().await;
    }

    /// Stops the harness's own operator (a test that runs operators of its own).
    pub async fn stop_operator(&mut self) {
        for t in self.operator.drain(..) {
            t.abort();
            let _ = t.await;
        }
    }

    pub fn pools(&self) -> Api<ImpVMRunnerPool> {
        self.env.api()
    }
    pub fn vms(&self) -> Api<ImpVM> {
        self.env.api()
    }
    pub fn secrets(&self) -> Api<Secret> {
        self.env.api()
    }

    pub fn metrics_text(&self) -> String {
        encode(&self.registry).unwrap()
    }

    /// The value of one sample line (`name{labels}`), 0 if absent.
    pub fn metric(&self, sample: &str) -> f64 {
        self.metrics_text()
            .lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    }

    pub async fn create_secret(&self, name: &str, data: BTreeMap<String, String>) {
        let mut s = Secret::default();
        s.metadata.name = Some(name.to_owned());
        s.string_data = Some(data);
        self.secrets()
            .create(&PostParams::default(), &s)
            .await
            .unwrap();
    }

    /// `n` Ready Imp nodes of this test (labelled [`NODE_LABEL`]`=<namespace>`, the operator
    /// binary's `IMP_NODE_SELECTOR`), 64 vCPU / 256 GiB each, whose heartbeat Leases are renewed
    /// here as their agents would, and a VM class (`<namespace>-runner`, 1 vCPU, 2 GiB) for the
    /// pools: what the binary's ImpVM controller needs to bind runner VMs. Answers the class.
    pub async fn add_nodes(&mut self, n: usize) -> String {
        self.add_nodes_with(n, true).await
    }

    /// [`Self::add_nodes`] for real agents (testkit's `SimNode`): no heartbeat Leases, each
    /// node's agent creates and renews its own, and publishes the node's capacity for VMs.
    pub async fn add_agent_nodes(&mut self, n: usize) -> String {
        self.add_nodes_with(n, false).await
    }

    async fn add_nodes_with(&mut self, n: usize, heartbeat: bool) -> String {
        use imp_api::ImpVMClass;
        use imp_testkit::fake_node::{heartbeat_lease, ready_node, renew_leases};
        use k8s_openapi::api::coordination::v1::Lease;
        use k8s_openapi::api::core::v1::Node;
        let nodes: Api<Node> = Api::all(self.client.clone());
        let leases: Api<Lease> = self.env.api();
        let mut names = Vec::new();
        for i in 0..n {
            let name = format!("{}-n{i}", self.ns);
            // Recorded first: the harness deletes its nodes however far this got.
            self.nodes.push(name.clone());
            ready_node(&nodes, &name, (NODE_LABEL, &self.ns))
                .await
                .unwrap();
            if heartbeat {
                heartbeat_lease(&leases, &name).await.unwrap();
            }
            names.push(name);
        }
        if heartbeat {
            self.tasks.push(tokio::spawn(renew_leases(leases, names)));
        }
        let class = format!("{}-runner", self.ns);
        let c = fixtures::class(&class).vcpu(1).memory_mib(2048).build();
        Api::<ImpVMClass>::all(self.client.clone())
            .create(&PostParams::default(), &c)
            .await
            .unwrap();
        self.class = Some(class.clone());
        class
    }

    /// Starts the imp-operator binary against this harness (API server, namespace, simulator)
    /// as `identity` (its leader-election identity and its scale-set sessions' owner), logging
    /// to `log`; `extra_env` comes last. The simulator's webhooks go to it from now on. Stop the
    /// harness's own operator first.
    pub fn spawn_operator(
        &self,
        identity: &str,
        log: &std::path::Path,
        extra_env: &[(&str, &str)],
    ) -> OperatorProcess {
        let addr = format!(
            "127.0.0.1:{}",
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        );
        let (out, err) = imp_testkit::binlog::log_file(log);
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_imp-operator"))
            .env("KUBECONFIG", self.env.kubeconfig_path())
            .env("IMP_HTTP_ADDR", &addr)
            .env("IMP_NAMESPACE", &self.ns)
            .env("IMP_WATCH_NAMESPACE", &self.ns)
            .env("IMP_NODE_SELECTOR", format!("{NODE_LABEL}={}", self.ns))
            .env("IMP_GITHUB_API_URL", self.sim.base_url())
            .env("IMP_POD_NAME", identity)
            .env("POD_NAME", identity)
            .env("IMP_LOG", "info")
            .envs(extra_env.iter().copied())
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        self.sim
            .set_webhook(&format!("http://{addr}/webhooks/github"), WEBHOOK_SECRET);
        OperatorProcess {
            child,
            addr,
            log: log.to_path_buf(),
            identity: identity.to_string(),
        }
    }

    /// A pool with the test labels, org scope, the test webhook secret, and `scaling`.
    pub async fn create_pool(&self, name: &str, scaling: Value) -> ImpVMRunnerPool {
        self.create_pool_labelled(name, &LABELS, scaling).await
    }

    /// [`Self::create_pool`] with `labels` as `spec.github.labels`.
    pub async fn create_pool_labelled(
        &self,
        name: &str,
        labels: &[&str],
        scaling: Value,
    ) -> ImpVMRunnerPool {
        let scaling = serde_json::from_value(scaling).expect("the test's scaling block");
        let pool = fixtures::pool(name)
            .org(self.sim.org())
            .app_secret(APP_SECRET)
            .labels(labels)
            .class("runner")
            .image("ghcr.io/imp/runner:1")
            .scaling(scaling)
            .webhook_secret("webhook")
            .build();
        self.pools()
            .create(&PostParams::default(), &pool)
            .await
            .unwrap()
    }

    pub async fn patch_scaling(&self, pool: &str, scaling: Value) {
        let patch = json!({"spec": {"scaling": scaling}});
        self.pools()
            .patch(pool, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// The pool's runner VMs not being deleted.
    pub async fn runner_vms(&self, pool: &str) -> Vec<ImpVM> {
        self.vms()
            .list(&ListParams::default().labels(&format!("{LABEL_RUNNER_POOL}={pool}")))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|v| v.metadata.deletion_timestamp.is_none())
            .collect()
    }

    /// Polls `f` every 100 ms until it returns Some; panics with `what` after `within`.
    pub async fn wait<T, F, Fut>(&self, what: &str, within: Duration, mut f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let start = Instant::now();
        loop {
            if let Some(v) = f().await {
                return v;
            }
            assert!(
                start.elapsed() < within,
                "timed out after {within:?} waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the pool has exactly `n` runner VMs, all minted.
    pub async fn wait_minted(&self, pool: &str, n: usize, within: Duration) -> Vec<ImpVM> {
        self.wait(
            &format!("{n} minted runner VMs of {pool}"),
            within,
            || async {
                let vms = self.runner_vms(pool).await;
                (vms.len() == n && vms.iter().all(|v| v.spec.runner_config_secret.is_some()))
                    .then_some(vms)
            },
        )
        .await
    }

    pub async fn pool_status(&self, pool: &str) -> imp_api::ImpVMRunnerPoolStatus {
        self.pools()
            .get_status(pool)
            .await
            .unwrap()
            .status
            .unwrap_or_default()
    }

    /// Event (reason, note) pairs about `pool`.
    pub async fn events(&self, pool: &str) -> Vec<(String, String)> {
        let events: Api<k8s_openapi::api::events::v1::Event> = self.env.api();
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pool))
            .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect()
    }

    /// Writes VM status as the agent does after the handoff: Running, runner Started.
    pub async fn agent_started(&self, vm: &ImpVM) {
        let status = started_status(vm);
        self.vms()
            .patch_status(
                &vm.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
            .unwrap();
    }

    /// The runner exited: phase Succeeded, handoff Exited.
    pub async fn agent_exited(&self, vm: &str) {
        let patch = json!({"status": {"phase": "Succeeded",
            "runner": {"handoff": "Exited", "exitCode": 0, "exitedTime": Time(Timestamp::now())}}});
        let _ = self
            .vms()
            .patch_status(vm, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
    }

    /// Plays the node agents of the namespace: every minted VM gets its Secret read, status Started, the
    /// Secret deleted; with `run_jobs`, the simulator's fake runner runs with the config and takes one job
    /// (`job_time` long), after which the VM is marked Succeeded.
    pub fn start_agent(&mut self, run_jobs: bool, job_time: Duration) {
        self.start_agent_on(false, run_jobs, job_time);
    }

    /// [`Self::start_agent`] as the agents of the nodes of [`Self::add_nodes`] with the operator
    /// binary's ImpVM controller binding the VMs: only a VM bound to a node is handed off, and a
    /// deleted bound VM gets its teardown confirmed (TornDown), which its finalizer waits for.
    pub fn start_node_agent(&mut self, job_time: Duration) {
        self.start_agent_on(true, true, job_time);
    }

    fn start_agent_on(&mut self, bound_only: bool, run_jobs: bool, job_time: Duration) {
        let vms = self.vms();
        let secrets = self.secrets();
        let this = AgentCtx {
            vms: vms.clone(),
            secrets,
            runner_version: self.runner_version.clone(),
            exit_delay: self.runner_exit_delay.clone(),
        };
        let task = tokio::spawn(async move {
            let mut handled = std::collections::HashSet::new();
            let mut torn = std::collections::HashSet::new();
            loop {
                if let Ok(list) = vms.list(&ListParams::default()).await {
                    for vm in list.items {
                        let bound = vm.spec.node_name.is_some();
                        let uid = vm.uid().unwrap_or_default();
                        if bound_only && bound && vm.metadata.deletion_timestamp.is_some() {
                            if torn.insert(uid.clone()) {
                                tokio::spawn(torn_down(vms.clone(), vm.name_any()));
                            }
                            continue;
                        }
                        let Some(secret) = vm.spec.runner_config_secret.clone() else {
                            continue;
                        };
                        if vm.metadata.deletion_timestamp.is_some()
                            || (bound_only && !bound)
                            || !handled.insert(uid)
                        {
                            continue;
                        }
                        let this = this.clone();
                        tokio::spawn(async move {
                            this.handoff(vm, &secret, run_jobs, job_time).await;
                        });
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        self.tasks.push(task);
    }
}

/// imp-runtime released everything: the TornDown condition the ImpVM controller's finalizer waits
/// for (what the agent writes once the VM's resources are gone).
async fn torn_down(vms: Api<ImpVM>, name: String) {
    let now = Time(Timestamp::now());
    let patch = json!({"status": {"conditions": [{
        "type": imp_api::names::condition::TORN_DOWN, "status": "True",
        "reason": imp_api::names::reason::TEARDOWN_COMPLETE,
        "message": "test agent", "lastTransitionTime": now,
    }]}});
    for _ in 0..50 {
        match vms
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if e.code == 404 => return,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The status the scheduler and an agent have written after the handoff: scheduled, booted, Running,
/// runner Started with the id and name from the VM's annotations; a `startFrom: Template` VM (a
/// standby pool's) as a clone restored in 30 ms and reidentified in 5 ms.
fn started_status(vm: &ImpVM) -> ImpVMStatus {
    let ann = vm.annotations();
    let now = Time(Timestamp::now());
    ImpVMStatus {
        start: (vm.spec.start_from == Some(imp_api::StartFrom::Template)).then(|| {
            imp_api::StartStatus {
                from: imp_api::StartedFrom::Clone,
                template: Some("sha256:test-template".into()),
                fallback_reason: None,
                fallback_message: None,
                restore_seconds: Some(0.03),
                reidentify_seconds: Some(0.005),
            }
        }),
        phase: Some(VmPhase::Running),
        scheduled_time: Some(now.clone()),
        boot_complete_time: Some(now.clone()),
        runner: Some(RunnerStatus {
            handoff: Some(HandoffState::Started),
            runner_id: ann.get(ANNOTATION_RUNNER_ID).and_then(|v| v.parse().ok()),
            runner_name: ann.get(ANNOTATION_RUNNER_NAME).cloned(),
            started_time: Some(now),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[derive(Clone)]
struct AgentCtx {
    vms: Api<ImpVM>,
    secrets: Api<Secret>,
    runner_version: Arc<Mutex<String>>,
    exit_delay: Arc<Mutex<Duration>>,
}

impl AgentCtx {
    async fn handoff(&self, vm: ImpVM, secret: &str, run_jobs: bool, job_time: Duration) {
        let Ok(Some(s)) = self.secrets.get_opt(secret).await else {
            return;
        };
        let Some(config) = s
            .data
            .and_then(|mut d| d.remove(SECRET_KEY_JITCONFIG))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        else {
            return;
        };
        let status = started_status(&vm);
        let name = vm.name_any();
        if self
            .vms
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
            .is_err()
        {
            return;
        }
        let _ = self.secrets.delete(secret, &Default::default()).await;
        if !run_jobs {
            return;
        }
        let opts = FakeRunnerOptions {
            job_wait: Duration::from_secs(120),
            job_duration: job_time,
            version: self.runner_version.lock().unwrap().clone(),
            ..FakeRunnerOptions::default()
        };
        let result = run_fake_runner(&config, &opts).await;
        let delay = *self.exit_delay.lock().unwrap();
        tokio::time::sleep(delay).await;
        let patch = match result {
            Ok(_) => json!({"status": {"phase": "Succeeded",
                "runner": {"handoff": "Exited", "exitCode": 0, "exitedTime": Time(Timestamp::now())}}}),
            // GitHub refused the runner's version: exit code 7 (the runner layer runs the runner
            // with ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE=1), recorded as the agent does.
            Err(e) if e.downcast_ref::<VersionDeprecated>().is_some() => {
                json!({"status": {"phase": "Failed", "reason": imp_api::names::reason::RUNNER_EXITED_NON_ZERO,
                    "message": "runner exited with code 7",
                    "runner": {"handoff": "Exited", "exitCode": 7, "exitedTime": Time(Timestamp::now())}}})
            }
            Err(_) => return,
        };
        let _ = self
            .vms
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
    }
}

impl Drop for PoolHarness {
    fn drop(&mut self) {
        for t in self.tasks.iter().chain(&self.operator) {
            t.abort();
        }
        if self.nodes.is_empty() && self.class.is_none() {
            return;
        }
        let (nodes, class) = (std::mem::take(&mut self.nodes), self.class.take());
        imp_testkit::cluster::with_fresh_client(
            self.env.kubeconfig_path(),
            move |client| async move {
                use k8s_openapi::api::core::v1::Node;
                let api: Api<Node> = Api::all(client.clone());
                for n in &nodes {
                    let _ = api.delete(n, &Default::default()).await;
                }
                if let Some(class) = class {
                    let _ = Api::<imp_api::ImpVMClass>::all(client)
                        .delete(&class, &Default::default())
                        .await;
                }
            },
        );
    }
}

/// The label of the nodes of [`PoolHarness::add_nodes`] (value: the test's namespace).
pub const NODE_LABEL: &str = "imp.dev/pool-test-node";

/// An imp-operator binary of [`PoolHarness::spawn_operator`]; killed on drop.
pub struct OperatorProcess {
    pub child: tokio::process::Child,
    /// Its HTTP address (/healthz, /readyz, /metrics).
    pub addr: String,
    pub log: std::path::PathBuf,
    pub identity: String,
}

impl OperatorProcess {
    /// `kill -9`: no shutdown path runs (the sessions stay open at GitHub, the Lease held).
    pub async fn kill9(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its /metrics text ("" until it answers).
    pub async fn metrics(&self) -> String {
        imp_testkit::binlog::get(&self.addr, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// The value of one sample line (`name{labels}`) of its /metrics, if present.
    pub async fn metric(&self, sample: &str) -> Option<f64> {
        self.metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
    }

    /// SIGTERM; the exit status (within 15 s) and the log.
    pub async fn stop(mut self) -> (std::process::ExitStatus, String) {
        imp_testkit::binlog::send_signal(self.child.id().unwrap(), "TERM");
        let status = tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .expect("exit on SIGTERM")
            .unwrap();
        (status, self.log_text())
    }
}

pub fn labels() -> Vec<String> {
    LABELS.iter().map(|s| s.to_string()).collect()
}

/// A job with a subset of the pool's labels.
pub fn job() -> imp_testkit::github::JobSpec {
    imp_testkit::github::JobSpec {
        labels: vec!["self-hosted".into(), "imp".into()],
        ..Default::default()
    }
}
