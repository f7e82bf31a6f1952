//! Setup shared by the operator benchmarks (pool_bench, pickup): the real API server (testenv) with
//! fake nodes (heartbeat Leases renewed here), the GitHub simulator, and the operator (ImpVM controller,
//! pool controller and webhook receiver, production timings) in a child process of the bench binary so
//! its peak RSS is its own. The bench process plays the node agents: [`start_agent`] marks every bound,
//! minted VM Running with handoff Started, optionally after a simulated boot (or, for a standby pool's
//! `startFrom: Template` VM on a node reporting the pool's template Ready, a simulated clone: restore
//! and reidentify, reported in `status.start` as the agent does) and running the simulator's fake
//! runner with the VM's JIT config, and confirms teardown of deleted VMs.

#![allow(dead_code)] // each bench uses a different subset

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use futures::TryStreamExt;
use imp_api::{
    HandoffState, ImpVM, ImpVMClass, ImpVMStatus, RunnerStatus, ServedJobStatus, StartFrom,
    StartStatus, StartedFrom, VmPhase,
    names::{
        ANNOTATION_RUNNER_ID, ANNOTATION_RUNNER_NAME, ANNOTATION_TEMPLATES_READY,
        SECRET_KEY_JITCONFIG, condition, reason,
    },
};
use imp_operator::{
    github::{GithubApps, GithubConfig, GithubMetrics},
    index::{Index, IndexConfig},
    metrics::VmMetrics,
    runnerpool::{PoolControllerConfig, PoolMetrics, PoolShared, run_runnerpool_controller},
    vm::{VmControllerConfig, run_vm_controller},
    webhook::webhook_router,
};
use imp_testkit::{
    TestEnv,
    cluster::with_fresh_client,
    controlplane::config_from_kubeconfig,
    fake_node, fixtures,
    github::{
        GithubSim, KeyFormat, SimConfig,
        runner_protocol::{FakeRunnerOptions, run_fake_runner},
    },
};
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::{Node, Secret},
    },
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::{WatchStreamExt, watcher},
};
use serde_json::json;

pub const NODES: usize = 10;
pub const NODE_LABEL: &str = "imp.dev/bench-node";
pub const WEBHOOK_SECRET: &str = "bench-secret";

/// The bench binary was started as the operator child (`--operator`).
pub fn is_operator_child() -> bool {
    std::env::args().any(|a| a == "--operator")
}

/// The operator side, in its own process: ImpVM controller scoped to the bench's nodes, pool
/// controller and webhook receiver; prints `READY <webhook url>` once the ImpVM controller is ready.
pub async fn operator_child() -> anyhow::Result<()> {
    let env = |k: &str| std::env::var(k).map_err(|_| anyhow::anyhow!("{k} not set"));
    let kubeconfig = PathBuf::from(env("KUBECONFIG")?);
    let ns = env("BENCH_NS")?;
    let sim_url = env("BENCH_SIM_URL")?;
    let client = Client::try_from(config_from_kubeconfig(&kubeconfig).await?)?;

    let index = Index::start(
        client.clone(),
        IndexConfig {
            node_selector: Some(format!("{NODE_LABEL}={ns}")),
            ..IndexConfig::namespace(&ns)
        },
    );
    let ready = Arc::new(AtomicBool::new(false));
    let vm = tokio::spawn(run_vm_controller(
        client.clone(),
        index.clone(),
        VmControllerConfig::new(),
        VmMetrics::default(),
        ready.clone(),
    ));

    let github = GithubConfig {
        api_base_url: sim_url,
        // The simulator's answer is instant; the production governor (150/min) would pace 500 mints
        // over ~3 minutes on its own, which is GitHub's limit, not the operator's.
        jit_mints_per_minute: 1_000_000,
        jit_mint_burst: 100_000,
        ..GithubConfig::default()
    };
    let apps = Arc::new(GithubApps::new(github, GithubMetrics::default()));
    let shared = PoolShared::new(apps, PoolMetrics::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = webhook_router(shared.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let mut config = PoolControllerConfig::new();
    config.namespace = Some(ns);
    config.create_concurrency = 16;
    let pool = tokio::spawn(run_runnerpool_controller(client, index, config, shared));
    while !ready.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("READY http://{addr}/webhooks/github");
    tokio::select! {
        _ = vm => anyhow::bail!("ImpVM controller stopped"),
        _ = pool => anyhow::bail!("pool controller stopped"),
    }
}

/// Peak RSS (VmHWM) of `pid` in KiB.
pub fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// A running bench setup. Dropping it kills the operator child and deletes the cluster-scoped
/// objects (nodes, class); the namespace goes with the TestEnv.
pub struct Bench {
    pub env: TestEnv,
    pub client: Client,
    pub ns: String,
    pub sim: GithubSim,
    pub class: String,
    pub node_names: Vec<String>,
    /// The operator child's pid (for its RSS).
    pub pid: u32,
    child: Child,
    heartbeat: tokio::task::JoinHandle<()>,
}

impl Bench {
    pub async fn start(prefix: &str) -> anyhow::Result<Bench> {
        let env = TestEnv::new(prefix).await;
        let client = env.client.clone();
        let ns = env.namespace.clone();
        let sim = GithubSim::start(SimConfig::default()).await?;

        // Nodes, each with a heartbeat Lease the "agent" renews.
        let nodes: Api<Node> = Api::all(client.clone());
        let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
        let mut node_names = Vec::new();
        for i in 0..NODES {
            let name = format!("{ns}-n{i}");
            fake_node::ready_node(&nodes, &name, (NODE_LABEL, &ns)).await?;
            fake_node::heartbeat_lease(&leases, &name).await?;
            node_names.push(name);
        }
        let heartbeat = tokio::spawn(fake_node::renew_leases(leases, node_names.clone()));
        let class = format!("{ns}-runner");
        let c = fixtures::class(&class).vcpu(1).memory_mib(2048).build();
        Api::<ImpVMClass>::all(client.clone())
            .create(&PostParams::default(), &c)
            .await?;
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
        let mut app = Secret::default();
        app.metadata.name = Some("github-app".into());
        app.string_data = Some(sim.secret_data(KeyFormat::Pkcs1));
        secrets.create(&PostParams::default(), &app).await?;
        let mut wh = Secret::default();
        wh.metadata.name = Some("webhook".into());
        wh.string_data = Some(BTreeMap::from([(
            "webhook-secret".to_string(),
            WEBHOOK_SECRET.to_string(),
        )]));
        secrets.create(&PostParams::default(), &wh).await?;

        // The operator in a child process.
        let mut child = Command::new(std::env::current_exe()?)
            .arg("--operator")
            .env("KUBECONFIG", env.kubeconfig_path())
            .env("BENCH_NS", &ns)
            .env("BENCH_SIM_URL", sim.base_url())
            .env("IMP_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()?;
        let pid = child.id();
        let stdout = child.stdout.take().expect("piped");
        let bench = Bench {
            env,
            client,
            ns,
            sim,
            class,
            node_names,
            pid,
            child,
            heartbeat,
        };
        let url = tokio::task::spawn_blocking(move || {
            let mut lines = BufReader::new(stdout).lines();
            lines.find_map(|l| {
                l.ok()
                    .and_then(|l| l.strip_prefix("READY ").map(str::to_owned))
            })
        })
        .await?
        .ok_or_else(|| anyhow::anyhow!("operator child exited before READY"))?;
        bench.sim.set_webhook(&url, WEBHOOK_SECRET);
        Ok(bench)
    }

    pub fn vms(&self) -> Api<ImpVM> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Fails if the operator child has exited.
    pub fn check_operator(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            anyhow::bail!("operator exited: {status}");
        }
        Ok(())
    }

    /// The operator child's peak RSS so far, KiB.
    pub fn operator_hwm_kib(&self) -> u64 {
        vm_hwm_kib(self.pid).unwrap_or_default()
    }

    /// A pool of this bench's class, org scope and webhook secret.
    pub fn pool(&self, name: &str, labels: &[&str]) -> fixtures::PoolBuilder {
        fixtures::pool(name)
            .org(self.sim.org())
            .app_secret("github-app")
            .labels(labels)
            .class(&self.class)
            .image("ghcr.io/imp/runner:1")
            .webhook_secret("webhook")
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.heartbeat.abort();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let class = self.class.clone();
        let nodes = self.node_names.clone();
        with_fresh_client(self.env.kubeconfig_path(), move |client| async move {
            let _ = Api::<ImpVMClass>::all(client.clone())
                .delete(&class, &Default::default())
                .await;
            let api: Api<Node> = Api::all(client);
            for n in &nodes {
                let _ = api.delete(n, &Default::default()).await;
            }
        });
    }
}

/// How the simulated node agents behave.
#[derive(Debug, Clone, Default)]
pub struct AgentOptions {
    /// Read the VM's JIT config, wait `boot`, mark it Started, run the fake runner (which takes one
    /// job), then mark the VM Succeeded; confirm teardown of deleted VMs. Without it a bound, minted VM
    /// is marked Started at once and nothing else happens (the scale-up bench).
    pub run_jobs: bool,
    /// The simulated boot (VM bound -> guest Hello).
    pub boot: Duration,
    /// A simulated clone (a `startFrom: Template` VM on a node reporting its pool's template
    /// Ready): the restore, then the reidentify, instead of `boot`.
    pub restore: Duration,
    pub reidentify: Duration,
    /// How long the fake runner's job runs.
    pub job: Duration,
}

/// When the node side saw each step of one VM (its own clock, sub-millisecond; the API's
/// creationTimestamp and status Times are to the second).
#[derive(Debug, Clone, Default)]
pub struct VmSeen {
    pub runner_name: Option<String>,
    pub created: Option<Timestamp>,
    pub minted: Option<Timestamp>,
    pub scheduled: Option<Timestamp>,
    pub booted: Option<Timestamp>,
    pub started: Option<Timestamp>,
    /// Started as a clone: (restore, reidentify) as simulated.
    pub clone: Option<(Duration, Duration)>,
    /// The operator's SLO record of the VM's job (`status.job`), as last seen.
    pub job: Option<ServedJobStatus>,
}

/// What the simulated agents observed and did.
#[derive(Clone, Default)]
pub struct Agent {
    /// Started writes done.
    pub started: Arc<AtomicU32>,
    /// Per VM name.
    pub seen: Arc<Mutex<HashMap<String, VmSeen>>>,
    /// (node, pool uid) of the snapshot templates the nodes hold Ready.
    pub templates: Arc<Mutex<HashSet<(String, String)>>>,
}

impl Agent {
    /// The VM whose runner is `runner_name`.
    pub fn by_runner(&self, runner_name: &str) -> Option<VmSeen> {
        self.seen
            .lock()
            .unwrap()
            .values()
            .find(|v| v.runner_name.as_deref() == Some(runner_name))
            .cloned()
    }
}

/// Plays the node agents of the namespace (see [`AgentOptions`]).
pub fn start_agent(bench: &Bench, opts: AgentOptions) -> Agent {
    let agent = Agent::default();
    let vms = bench.vms();
    let secrets: Api<Secret> = Api::namespaced(bench.client.clone(), &bench.ns);
    let a = agent.clone();
    tokio::spawn(async move {
        let mut handled: HashSet<String> = HashSet::new();
        let mut torn: HashSet<String> = HashSet::new();
        let stream = watcher(vms.clone(), watcher::Config::default())
            .default_backoff()
            .applied_objects();
        let mut stream = std::pin::pin!(stream);
        while let Ok(Some(vm)) = stream.try_next().await {
            let now = Timestamp::now();
            let name = vm.name_any();
            let bound = vm.spec.node_name.is_some();
            let minted = vm.annotations().contains_key(ANNOTATION_RUNNER_ID);
            if opts.run_jobs {
                let mut seen = a.seen.lock().unwrap();
                let s = seen.entry(name.clone()).or_default();
                s.created.get_or_insert(now);
                if minted {
                    s.minted.get_or_insert(now);
                    s.runner_name = vm.annotations().get(ANNOTATION_RUNNER_NAME).cloned();
                }
                if bound {
                    s.scheduled.get_or_insert(now);
                }
                if let Some(job) = vm.status.as_ref().and_then(|s| s.job.clone()) {
                    s.job = Some(job);
                }
            }
            let uid = vm.uid().unwrap_or_default();
            if vm.metadata.deletion_timestamp.is_some() {
                if opts.run_jobs && bound && torn.insert(uid) {
                    tokio::spawn(torn_down(vms.clone(), name));
                }
                continue;
            }
            if !bound || !minted || !handled.insert(uid) {
                continue;
            }
            let vms = vms.clone();
            let secrets = secrets.clone();
            let a = a.clone();
            let opts = opts.clone();
            tokio::spawn(async move {
                if opts.run_jobs {
                    handoff(vm, vms, secrets, a, &opts).await;
                } else if write_started(&vms, &vm).await {
                    a.started.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    agent
}

/// Running, booted and handoff Started with the runner's id and name, as the agent writes them
/// (with `status.start` when `start` says how it started).
async fn write_started(vms: &Api<ImpVM>, vm: &ImpVM) -> bool {
    write_started_as(vms, vm, None).await
}

async fn write_started_as(vms: &Api<ImpVM>, vm: &ImpVM, start: Option<StartStatus>) -> bool {
    let ann = vm.annotations();
    let now = Time(Timestamp::now());
    let status = ImpVMStatus {
        start,
        phase: Some(VmPhase::Running),
        first_running_time: Some(now.clone()),
        boot_complete_time: Some(now.clone()),
        runner: Some(RunnerStatus {
            handoff: Some(HandoffState::Started),
            runner_id: ann.get(ANNOTATION_RUNNER_ID).and_then(|v| v.parse().ok()),
            runner_name: ann.get(ANNOTATION_RUNNER_NAME).cloned(),
            started_time: Some(now),
            ..Default::default()
        }),
        ..Default::default()
    };
    let patch = json!({"status": status});
    for _ in 0..20 {
        if vms
            .patch_status(
                &vm.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .is_ok()
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// The node side of one runner VM: JIT config from its Secret, the simulated boot, Started, the
/// Secret deleted, the fake runner takes one job, the VM Succeeded.
async fn handoff(vm: ImpVM, vms: Api<ImpVM>, secrets: Api<Secret>, a: Agent, o: &AgentOptions) {
    let name = vm.name_any();
    let Some(secret) = vm.spec.runner_config_secret.clone() else {
        return;
    };
    let Ok(Some(s)) = secrets.get_opt(&secret).await else {
        return;
    };
    let Some(config) = s
        .data
        .and_then(|mut d| d.remove(SECRET_KEY_JITCONFIG))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
    else {
        return;
    };
    let clone = vm.spec.start_from == Some(StartFrom::Template) && template_ready_here(&a, &vm);
    let start = if clone {
        tokio::time::sleep(o.restore + o.reidentify).await;
        Some(StartStatus {
            from: StartedFrom::Clone,
            template: Some("sha256:bench-template".into()),
            fallback_reason: None,
            fallback_message: None,
            restore_seconds: Some(o.restore.as_secs_f64()),
            reidentify_seconds: Some(o.reidentify.as_secs_f64()),
        })
    } else {
        tokio::time::sleep(o.boot).await;
        Some(StartStatus {
            from: StartedFrom::Boot,
            template: None,
            fallback_reason: (vm.spec.start_from == Some(StartFrom::Template))
                .then(|| reason::TEMPLATE_MISSING.to_owned()),
            fallback_message: None,
            restore_seconds: None,
            reidentify_seconds: None,
        })
    };
    let booted = Timestamp::now();
    if !write_started_as(&vms, &vm, start).await {
        return;
    }
    let started = Timestamp::now();
    a.started.fetch_add(1, Ordering::SeqCst);
    if let Some(s) = a.seen.lock().unwrap().get_mut(&name) {
        s.booted = Some(booted);
        s.started = Some(started);
        s.clone = clone.then_some((o.restore, o.reidentify));
    }
    let _ = secrets.delete(&secret, &Default::default()).await;
    let opts = FakeRunnerOptions {
        job_wait: Duration::from_secs(600),
        job_duration: o.job,
        ..FakeRunnerOptions::default()
    };
    if run_fake_runner(&config, &opts).await.is_ok() {
        let patch = json!({"status": {"phase": "Succeeded",
            "runner": {"handoff": "Exited", "exitCode": 0, "exitedTime": Time(Timestamp::now())}}});
        let _ = vms
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
    }
}

/// Whether the VM's node holds its pool's template Ready (what imp-runtime decides locally, from
/// what [`templates_ready`] recorded).
fn template_ready_here(a: &Agent, vm: &ImpVM) -> bool {
    let (Some(node), Some(pool)) = (
        vm.spec.node_name.as_deref(),
        vm.metadata
            .owner_references
            .as_ref()
            .and_then(|o| o.iter().find(|o| o.controller == Some(true)))
            .map(|o| o.uid.as_str()),
    ) else {
        return false;
    };
    a.templates
        .lock()
        .unwrap()
        .contains(&(node.to_owned(), pool.to_owned()))
}

/// Every node holds `pool_uid`'s template Ready and says so on its Node (as agents do once
/// their template is built): the scheduler's preference and the simulated clones follow.
pub async fn templates_ready(b: &Bench, a: &Agent, pool_uid: &str) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(b.client.clone());
    for n in &b.node_names {
        let patch = json!({"metadata": {"annotations": {ANNOTATION_TEMPLATES_READY: pool_uid}}});
        nodes
            .patch(n, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        a.templates
            .lock()
            .unwrap()
            .insert((n.clone(), pool_uid.to_owned()));
    }
    Ok(())
}

/// imp-runtime released everything: the TornDown condition the ImpVM controller waits for.
async fn torn_down(vms: Api<ImpVM>, name: String) {
    let now = Time(Timestamp::now());
    let patch = json!({"status": {"conditions": [{
        "type": condition::TORN_DOWN, "status": "True", "reason": reason::TEARDOWN_COMPLETE,
        "message": "bench", "lastTransitionTime": now,
    }]}});
    for _ in 0..20 {
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
