//! `smoke/imp-smoke.sh --cluster` against a local Imp: the test control plane (testenv's real API
//! server), the GitHub simulator (with smoke/workflow.yaml registered in `acme/app`), a local
//! registry with the pool's images, and imp-operator, imp-runtime (Firecracker simulator) and
//! imp-agent (imp-fake-runner) as processes. The smoke creates the pool from a manifest, dispatches
//! the workflow through the simulator's REST API and follows it to the pool's replacement runner.
//! Then the same with GitHub refusing every runner registration: it must fail, naming the phase.
//!
//! Skipped (with the reason) without python3 or docker-registry (a registry that is there and fails
//! to start is a failure); IMP_REQUIRE_CLUSTER_SMOKE=1 makes a skip a failure.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use imp_testkit::bins::ensure_built;
use imp_testkit::cluster::TestEnv;
use imp_testkit::github::{
    Fault, FaultRule, GithubSim, JobStatus, KeyFormat, SimConfig, fake_runner_binary,
};
use imp_testkit::oci::{LayerBlob, PushAuth, push_image};
use imp_testkit::paths;
use imp_testkit::process::ManagedProcess;
use imp_testkit::registry::{Registry, RegistryError, RegistryOptions};
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const WEBHOOK_SECRET: &str = "imp-sim-webhook-secret";

fn skip_or_fail(why: &str) -> bool {
    imp_testkit::skip::skip_or_fail("IMP_REQUIRE_CLUSTER_SMOKE", "smoke_cluster", why);
    true
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn wait_http(url: &str, what: &str, proc_: &ManagedProcess) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = Command::new("curl")
            .args(["-sf", "-o", "/dev/null", url])
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} not ready at {url}: {}",
            proc_.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_socket(sock: &Path, proc_: &ManagedProcess) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sock.exists() {
        assert!(
            Instant::now() < deadline,
            "imp-runtime socket {} missing: {}",
            sock.display(),
            proc_.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The stack the smoke runs against; its processes stop when it is dropped.
struct Stack {
    env: TestEnv,
    sim: GithubSim,
    dir: tempfile::TempDir,
    manifest: PathBuf,
    token_file: PathBuf,
    token: String,
    kubectl_imp: PathBuf,
    // Field order: the processes stop before the registry.
    _agent: ManagedProcess,
    _operator: ManagedProcess,
    _runtime: ManagedProcess,
    _registry: Registry,
}

impl Stack {
    async fn start() -> Option<Stack> {
        if Command::new("python3").arg("--version").output().is_err() {
            skip_or_fail("python3 is not installed (the smoke is a Python script)");
            return None;
        }
        let registry = match Registry::start(RegistryOptions::default()).await {
            Ok(r) => r,
            // Only an absent docker-registry is a reason to skip: a registry that is installed and
            // does not start is a failure like any other.
            Err(e @ RegistryError::BinaryMissing) => {
                skip_or_fail(&format!("no local registry ({e})"));
                return None;
            }
            Err(e) => panic!("the local registry did not start: {e}"),
        };
        let bins = ensure_built(
            &[
                ("imp-operator", "imp-operator"),
                ("imp-runtime", "imp-runtime"),
                ("imp-agent", "imp-agent"),
                ("kubectl-imp", "kubectl-imp"),
            ],
            &[
                "operator/src",
                "operator/Cargo.toml",
                "node",
                "api/src",
                "common/src",
                "kubectl-imp/src",
            ],
        )
        .expect("building imp-operator, imp-runtime, imp-agent and kubectl-imp");
        let sim_bins = imp_testkit::firecracker::binaries();
        let fake_runner = fake_runner_binary().expect("imp-fake-runner");

        let env = TestEnv::new("clsmoke").await;
        let ns = env.namespace.clone();
        let dir = tempfile::Builder::new()
            .prefix("imp-clsmoke-")
            .tempdir()
            .unwrap();

        let host = registry.host();
        let base = LayerBlob::tar_gzip(&[("etc/imp-smoke", b"base")]);
        push_image(
            &host,
            "imp-dev/runner-base:smoke",
            &[base],
            &PushAuth::Anonymous,
        )
        .await
        .unwrap();
        let runner = LayerBlob::tar_gzip(&[("opt/runner/VERSION", b"smoke")]);
        push_image(
            &host,
            "imp-dev/actions-runner:smoke",
            &[runner],
            &PushAuth::Anonymous,
        )
        .await
        .unwrap();

        let op_port = free_port();
        let sim = GithubSim::start(SimConfig {
            org: "acme".into(),
            repos: vec!["acme/app".into()],
            webhook_url: Some(format!("http://127.0.0.1:{op_port}/webhooks/github")),
            webhook_secret: WEBHOOK_SECRET.into(),
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let workflow =
            std::fs::read_to_string(paths::workspace_root().join("smoke/workflow.yaml")).unwrap();
        sim.add_workflow(None, ".github/workflows/imp-smoke.yaml", &workflow)
            .unwrap();
        let token = sim.user_token();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, &token).unwrap();

        let secrets: Api<Secret> = env.api();
        let app: Secret = serde_json::from_value(json!({
            "metadata": {"name": "imp-github-app"},
            "stringData": sim.secret_data(KeyFormat::Pkcs1),
        }))
        .unwrap();
        secrets.create(&PostParams::default(), &app).await.unwrap();
        let hook: Secret = serde_json::from_value(json!({
            "metadata": {"name": "imp-webhook"},
            "stringData": {"webhook-secret": WEBHOOK_SECRET},
        }))
        .unwrap();
        secrets.create(&PostParams::default(), &hook).await.unwrap();

        // A node as the scheduler sees it: labelled, Ready, untainted.
        let node_name = format!("{ns}-node");
        let nodes: Api<Node> = Api::all(env.client.clone());
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": node_name, "labels": {"imp/enabled": "true"}},
        }))
        .unwrap();
        nodes.create(&PostParams::default(), &node).await.unwrap();
        let pp = PatchParams::default();
        nodes
            .patch(
                &node_name,
                &pp,
                &Patch::Merge(json!({"spec": {"taints": []}})),
            )
            .await
            .unwrap();
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let status = json!({"status": {
            "allocatable": {"cpu": "8", "memory": "16Gi"},
            "capacity": {"cpu": "8", "memory": "16Gi"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "clsmoke",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}],
        }});
        nodes
            .patch_status(&node_name, &pp, &Patch::Merge(status))
            .await
            .unwrap();

        let kubeconfig = env.kubeconfig_path().to_path_buf();
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, b"simulated kernel").unwrap();
        let sock = dir.path().join("runtime.sock");
        let mut cmd = Command::new(&bins[1]);
        cmd.env("IMP_RUNTIME_SOCKET", &sock)
            .env("IMP_STATE_DIR", dir.path().join("node-state"))
            .env("IMP_KERNEL", &kernel)
            .env("IMP_FIRECRACKER_BIN", &sim_bins.simulator)
            // The simulator without the jailer (node/runtime/tests/jailer.rs covers the jailed path).
            .env("IMP_UNJAILED_FIRECRACKER", "1")
            .env("IMP_GUEST_BIN", &sim_bins.guest)
            .env("IMP_METRICS_ADDR", "127.0.0.1:0")
            .env("IMP_INSECURE_REGISTRIES", &host)
            .env("IMP_NODE_LOCAL_REGISTRIES", &host);
        let runtime =
            ManagedProcess::spawn("imp-runtime", cmd, &dir.path().join("runtime.log")).unwrap();
        wait_socket(&sock, &runtime).await;

        let agent_port = free_port();
        let mut cmd = Command::new(&bins[2]);
        cmd.env("KUBECONFIG", &kubeconfig)
            .env("IMP_NODE_NAME", &node_name)
            .env("IMP_NAMESPACE", &ns)
            .env("IMP_RUNTIME_SOCKET", &sock)
            .env("IMP_HEARTBEAT_INTERVAL", "2s")
            .env("IMP_POLL_INTERVAL", "1s")
            .env("IMP_SWEEP_INTERVAL", "2s")
            .env("IMP_HTTP_ADDR", format!("127.0.0.1:{agent_port}"))
            .env("IMP_RUNNER_COMMAND", &fake_runner);
        let agent = ManagedProcess::spawn("imp-agent", cmd, &dir.path().join("agent.log")).unwrap();
        wait_http(
            &format!("http://127.0.0.1:{agent_port}/healthz"),
            "imp-agent",
            &agent,
        )
        .await;

        let mut cmd = Command::new(&bins[0]);
        cmd.env("KUBECONFIG", &kubeconfig)
            .env("IMP_HTTP_ADDR", format!("127.0.0.1:{op_port}"))
            .env("IMP_NAMESPACE", &ns)
            .env("IMP_WEBHOOK_SECRET_NAME", "imp-webhook")
            .env("IMP_GITHUB_API_URL", sim.base_url());
        let operator =
            ManagedProcess::spawn("imp-operator", cmd, &dir.path().join("operator.log")).unwrap();
        wait_http(
            &format!("http://127.0.0.1:{op_port}/readyz"),
            "imp-operator",
            &operator,
        )
        .await;

        // What an operator would apply: a class and a pool serving `runs-on: [self-hosted, imp]`.
        let class = format!("{ns}-small");
        let manifest = dir.path().join("pool.yaml");
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: imp.dev/v1alpha1\nkind: ImpVMClass\nmetadata: {{name: {class}}}\n\
                 spec: {{vcpu: 1, memoryMiB: 128, diskGiB: 1}}\n---\n\
                 apiVersion: imp.dev/v1alpha1\nkind: ImpVMRunnerPool\nmetadata: {{name: imp}}\nspec:\n  \
                 github: {{scope: {{org: acme}}, appSecretRef: {{name: imp-github-app}}, labels: [self-hosted, imp]}}\n  \
                 template: {{spec: {{classRef: {{name: {class}}}, image: {host}/imp-dev/runner-base:smoke, \
                 runnerImage: {host}/imp-dev/actions-runner:smoke, expireAfter: 2h}}}}\n  \
                 scaling: {{minIdle: 1, maxRunners: 3, scaleUpStep: 1}}\n"
            ),
        )
        .unwrap();
        Some(Stack {
            env,
            sim,
            dir,
            manifest,
            token_file,
            kubectl_imp: bins[3].clone(),
            token,
            _agent: agent,
            _operator: operator,
            _runtime: runtime,
            _registry: registry,
        })
    }

    /// `smoke/imp-smoke.sh --cluster` against this stack, with `timeout` seconds per phase.
    async fn smoke(&self, timeout: u32, report: &Path) -> Output {
        let root = paths::workspace_root();
        let mut cmd = Command::new(root.join("smoke/imp-smoke.sh"));
        cmd.arg("--cluster")
            .args(["--repo", "acme/app", "--github-api", self.sim.base_url()])
            .arg("--token-file")
            .arg(&self.token_file)
            .args(["--pool-namespace", &self.env.namespace, "--pool", "imp"])
            .arg("--pool-manifest")
            .arg(&self.manifest)
            .args(["--timeout", &timeout.to_string()])
            .arg("--report")
            .arg(report)
            .arg("--work-dir")
            .arg(report.with_extension("records"))
            .arg("--kubectl")
            .arg(paths::testenv_bin("kubectl"))
            .arg("--kubectl-imp")
            .arg(&self.kubectl_imp)
            .env("KUBECONFIG", self.env.kubeconfig_path())
            .env_remove("IMP_SMOKE_GITHUB_TOKEN")
            .env_remove("GITHUB_TOKEN");
        // Off the runtime's threads: the simulator serves the smoke from this process meanwhile.
        tokio::task::spawn_blocking(move || cmd.output())
            .await
            .unwrap()
            .expect("running smoke/imp-smoke.sh")
    }

    fn logs(&self) -> String {
        ["operator", "agent", "runtime"]
            .iter()
            .map(|n| {
                format!(
                    "--- {n}.log\n{}",
                    imp_testkit::process::log_tail(&self.dir.path().join(format!("{n}.log")), 15)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

async fn pool_vms(stack: &Stack) -> Vec<Value> {
    let out = stack
        .env
        .kubectl()
        .args(["get", "impvm", "-o", "json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["items"].as_array().cloned().unwrap_or_default()
}

fn pool_exists(stack: &Stack) -> bool {
    stack
        .env
        .kubectl()
        .args(["get", "imprp", "imp"])
        .output()
        .unwrap()
        .status
        .success()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_smoke_runs_a_dispatched_job_and_names_the_phase_that_fails() {
    let Some(stack) = Stack::start().await else {
        return;
    };

    // GitHub refuses every runner registration: no runner ever starts, so the smoke stops at
    // "pool ready", says so, and removes the pool it created.
    stack.sim.inject(
        FaultRule::next(100_000, Fault::ServerError { status: 503 }).on_path("generate-jitconfig"),
    );
    let report = stack.dir.path().join("failed.json");
    let out = stack.smoke(10, &report).await;
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}\n{}", stack.logs());
    eprintln!("{t}");
    assert!(t.contains("FAILED in phase 'pool ready'"), "{t}");
    assert!(
        t.contains("pool imp"),
        "the failure says what the pool looked like: {t}"
    );
    assert!(
        stack.sim.dispatched_runs().is_empty(),
        "nothing is dispatched before the pool is ready"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pool_vms(&stack).await.is_empty() || pool_exists(&stack) {
        assert!(
            Instant::now() < deadline,
            "the failed smoke left its pool or the pool's VMs"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stack.sim.clear_faults();

    // The whole lifecycle: dispatch, pickup by the pool's runner, done, torn down, replaced.
    let report = stack.dir.path().join("report.json");
    let out = stack.smoke(90, &report).await;
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}\n{}", stack.logs());
    // The smoke's phases and timeline, in the test's log.
    eprintln!("{t}");
    for phase in [
        "preflight",
        "pool ready",
        "dispatch",
        "job queued",
        "job picked up",
        "job done",
        "torn down",
        "replaced",
        "timeline",
    ] {
        assert!(
            t.contains(&format!("PASS  {phase}")),
            "no PASS for {phase}: {t}"
        );
    }
    assert!(
        !t.contains(&stack.token),
        "the token reached the smoke's output"
    );

    // The job the simulator ran is the dispatched run's, done by a runner of the pool.
    let runs = stack.sim.dispatched_runs();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let jobs: Vec<_> = stack
        .sim
        .jobs()
        .into_iter()
        .filter(|j| j.run_id == runs[0].id)
        .collect();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].status, JobStatus::Completed);
    assert_eq!(jobs[0].conclusion.as_deref(), Some("success"));

    // The report: the timeline's phases with times, for the VM that ran that job.
    let rep: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(rep["job"], jobs[0].id.to_string());
    let seen: Vec<&str> = rep["phases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["at"].is_number())
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    for phase in [
        "vm_created",
        "jit_minted",
        "scheduled",
        "guest_hello",
        "runner_started",
        "job_queued",
        "job_picked_up",
        "job_done",
        "torn_down",
        "vm_deleted",
        "replaced",
    ] {
        assert!(seen.contains(&phase), "{phase} missing from {seen:?}");
    }
    assert!(rep["pickup_latency_s"].is_number(), "{rep}");
    assert!(
        !std::fs::read_to_string(&report)
            .unwrap()
            .contains(&stack.token)
    );

    // The smoke deleted the pool it created: no VM and no runner registration is left.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(pool_vms(&stack).await.is_empty() && stack.sim.runners().is_empty())
        || pool_exists(&stack)
    {
        assert!(
            Instant::now() < deadline,
            "left after the smoke: VMs {:?}, runners {:?}",
            pool_vms(&stack).await.len(),
            stack.sim.runners()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
