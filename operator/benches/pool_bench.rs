//! Pool scale-up benchmark: one pool goes from 0 to N runner VMs (default 500) over 10 fake nodes on the
//! real API server (testenv), with the GitHub simulator. The operator (ImpVM controller, pool controller
//! and webhook receiver) runs in a child process so its peak RSS is its own; this process plays the node
//! agents (heartbeat Leases; every bound, minted VM is marked Running with handoff Started).
//!
//! `cargo bench -p imp-operator --bench pool_bench [--profile dev] -- [N]`
//! Prints the wall time until all N runners are idle (registered and waiting) and the operator's VmHWM.

use std::{
    collections::{BTreeMap, HashSet},
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use imp_api::{
    HandoffState, ImpVM, ImpVMClass, ImpVMRunnerPool, ImpVMStatus, RunnerStatus, VmPhase,
    names::{ANNOTATION_RUNNER_ID, ANNOTATION_RUNNER_NAME, LABEL_NODE_ENABLED, lease_name},
};
use imp_operator::{
    github::{GithubApps, GithubConfig, GithubMetrics},
    metrics::VmMetrics,
    runnerpool::{PoolControllerConfig, PoolMetrics, PoolShared, run_runnerpool_controller},
    vm::{VmControllerConfig, run_vm_controller},
    webhook::webhook_router,
};
use imp_testkit::{
    TestEnv,
    controlplane::config_from_kubeconfig,
    fixtures,
    github::{GithubSim, KeyFormat, SimConfig},
};
use k8s_openapi::{
    api::{
        coordination::v1::{Lease, LeaseSpec},
        core::v1::{Node, Secret},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::{WatchStreamExt, watcher},
};
use serde_json::json;

const NODES: usize = 10;
const NODE_LABEL: &str = "imp.dev/bench-node";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if args.iter().any(|a| a == "--operator") {
        return rt.block_on(operator());
    }
    let n: u32 = args
        .iter()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(500);
    rt.block_on(bench(n))
}

/// The operator side, in its own process.
async fn operator() -> anyhow::Result<()> {
    let env = |k: &str| std::env::var(k).map_err(|_| anyhow::anyhow!("{k} not set"));
    let kubeconfig = PathBuf::from(env("KUBECONFIG")?);
    let ns = env("BENCH_NS")?;
    let sim_url = env("BENCH_SIM_URL")?;
    let client = Client::try_from(config_from_kubeconfig(&kubeconfig).await?)?;

    let mut vm_config = VmControllerConfig::new(ns.clone());
    vm_config.vm_namespace = Some(ns.clone());
    vm_config.node_selector = Some(format!("{NODE_LABEL}={ns}"));
    let ready = Arc::new(AtomicBool::new(false));
    let vm = tokio::spawn(run_vm_controller(
        client.clone(),
        vm_config,
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
    let pool = tokio::spawn(run_runnerpool_controller(client, config, shared));
    while !ready.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("READY http://{addr}/webhooks/github");
    tokio::select! {
        _ = vm => anyhow::bail!("ImpVM controller stopped"),
        _ = pool => anyhow::bail!("pool controller stopped"),
    }
}

fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

async fn bench(n: u32) -> anyhow::Result<()> {
    let env = TestEnv::new("bench").await;
    let client = env.client.clone();
    let ns = env.namespace.clone();
    let sim = GithubSim::start(SimConfig::default()).await?;

    // Nodes, each with a heartbeat Lease the "agent" renews.
    let nodes: Api<Node> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let mut node_names = Vec::new();
    for i in 0..NODES {
        let name = format!("{ns}-n{i}");
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {LABEL_NODE_ENABLED: "true", NODE_LABEL: ns}},
        }))?;
        nodes.create(&PostParams::default(), &node).await?;
        nodes
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"taints": []}})),
            )
            .await?;
        let now = Timestamp::now().to_string();
        let cond = |t: &str, s: &str| {
            json!({"type": t, "status": s, "reason": "Bench", "message": "bench",
            "lastHeartbeatTime": now, "lastTransitionTime": now})
        };
        nodes
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "allocatable": {"cpu": "64", "memory": "256Gi"},
                    "capacity": {"cpu": "64", "memory": "256Gi"},
                    "conditions": [cond("Ready", "True"), cond("MemoryPressure", "False"),
                                   cond("DiskPressure", "False"), cond("PIDPressure", "False")],
                }})),
            )
            .await?;
        let lease = Lease {
            metadata: kube::api::ObjectMeta {
                name: Some(lease_name(&name)),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(name.clone()),
                lease_duration_seconds: Some(40),
                renew_time: Some(MicroTime(Timestamp::now())),
                ..Default::default()
            }),
        };
        leases.create(&PostParams::default(), &lease).await?;
        node_names.push(name);
    }
    {
        let leases = leases.clone();
        let names = node_names.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                for n in &names {
                    let patch = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
                    let _ = leases
                        .patch(
                            &lease_name(n),
                            &PatchParams::default(),
                            &Patch::Merge(&patch),
                        )
                        .await;
                }
            }
        });
    }
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
        "bench-secret".to_string(),
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
    let url = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(stdout).lines();
        lines.find_map(|l| {
            l.ok()
                .and_then(|l| l.strip_prefix("READY ").map(str::to_owned))
        })
    })
    .await?
    .ok_or_else(|| anyhow::anyhow!("operator child exited before READY"))?;
    sim.set_webhook(&url, "bench-secret");
    let rss_idle = vm_hwm_kib(pid).unwrap_or_default();

    // The agents: every bound, minted VM gets Running + handoff Started.
    let vms: Api<ImpVM> = Api::namespaced(client.clone(), &ns);
    let started_count = Arc::new(std::sync::atomic::AtomicU32::new(0));
    {
        let vms = vms.clone();
        let started_count = started_count.clone();
        tokio::spawn(async move {
            let mut done: HashSet<String> = HashSet::new();
            let stream = watcher(vms.clone(), watcher::Config::default())
                .default_backoff()
                .applied_objects();
            let mut stream = std::pin::pin!(stream);
            while let Ok(Some(vm)) = stream.try_next().await {
                let bound = vm.spec.node_name.is_some();
                let minted = vm.annotations().contains_key(ANNOTATION_RUNNER_ID);
                if !bound || !minted || vm.metadata.deletion_timestamp.is_some() {
                    continue;
                }
                let uid = vm.uid().unwrap_or_default();
                if !done.insert(uid) {
                    continue;
                }
                let vms = vms.clone();
                let started_count = started_count.clone();
                tokio::spawn(async move {
                    let ann = vm.annotations();
                    let now = Time(Timestamp::now());
                    let status = ImpVMStatus {
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
                    for _ in 0..20 {
                        let patch = json!({"status": status});
                        if vms
                            .patch_status(
                                &vm.name_any(),
                                &PatchParams::default(),
                                &Patch::Merge(&patch),
                            )
                            .await
                            .is_ok()
                        {
                            started_count.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                });
            }
        });
    }

    let pools: Api<ImpVMRunnerPool> = Api::namespaced(client.clone(), &ns);
    let pool = fixtures::pool("bench")
        .org(sim.org())
        .app_secret("github-app")
        .labels(&["self-hosted", "imp"])
        .class(&class)
        .image("ghcr.io/imp/runner:1")
        .min_idle(n)
        .max_runners(n)
        .scale_up_step(100)
        .webhook_secret("webhook")
        .build();
    let t0 = Instant::now();
    pools.create(&PostParams::default(), &pool).await?;
    let mut peak = 0u64;
    let mut all_minted = None;
    let deadline = Duration::from_secs(900);
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        peak = peak.max(vm_hwm_kib(pid).unwrap_or_default());
        if let Ok(Some(status)) = child.try_wait() {
            anyhow::bail!("operator exited: {status}");
        }
        let s = pools.get_status("bench").await?.status.unwrap_or_default();
        if all_minted.is_none() && sim.runners().len() as u32 >= n {
            all_minted = Some(t0.elapsed());
        }
        if s.idle >= n {
            break;
        }
        anyhow::ensure!(
            t0.elapsed() < deadline,
            "not done after {deadline:?}: {s:?}"
        );
    }
    let took = t0.elapsed();
    let vm_list = vms.list(&Default::default()).await?.items;
    let per_node = {
        let mut m: BTreeMap<String, u32> = BTreeMap::new();
        for v in &vm_list {
            *m.entry(v.spec.node_name.clone().unwrap_or_default())
                .or_default() += 1;
        }
        m.values().cloned().collect::<Vec<_>>()
    };
    peak = peak.max(vm_hwm_kib(pid).unwrap_or_default());
    println!("pool 0 -> {n} runner VMs over {NODES} nodes on the real API server");
    println!(
        "  all {n} JIT configs minted after {:.1?}",
        all_minted.unwrap_or(took)
    );
    println!("  all {n} runners idle (status.idle == {n}) after {took:.1?}");
    println!(
        "  VMs: {} (per node: {per_node:?}), agent Started writes: {}",
        vm_list.len(),
        started_count.load(Ordering::SeqCst)
    );
    let calls = sim.stats().api_requests;
    println!(
        "  GitHub API calls: {calls} ({:.2} per runner)",
        calls as f64 / f64::from(n.max(1))
    );
    println!(
        "  operator peak RSS (VmHWM): {:.1} MiB (at start: {:.1} MiB)",
        peak as f64 / 1024.0,
        rss_idle as f64 / 1024.0
    );
    let _ = child.kill();
    let _ = child.wait();
    let _ = Api::<ImpVMClass>::all(client.clone())
        .delete(&class, &Default::default())
        .await;
    for n in &node_names {
        let _ = nodes.delete(n, &Default::default()).await;
    }
    Ok(())
}
