//! Every `kubectl imp` verb, run as the binary against the real API server (testenv) with fixture
//! objects: a pool, a runner VM that served job 4242 after a cold boot (40 s of boot, the slowest
//! phase), an idle runner, its node with a heartbeat Lease and a runtime pod, a Warning Event, and the
//! VM's JIT Secret. The runtime pod is only an object (no kubelet runs it): `console` resolves it and
//! its exec is refused, which must fail with a clear message, never print the JIT config.

use std::process::Output;

use imp_api::{ImpVM, ImpVMRunnerPool};
use imp_testkit::{TestEnv, fixtures};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Secret, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const JIT: &str = "eyJydW5uZXIiOiJzZWNyZXQtaml0LWNvbmZpZy1vZi10aGUtdGVzdCJ9QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWZnaGlqa2xtbm9wcXJzdHV2d3h5ejAxMjM0NTY3ODk";
const JOB: i64 = 4242;

struct Fixture {
    env: TestEnv,
    node: String,
}

/// A fixture time: `s` seconds after an hour ago (the VMs were created just now, before them).
fn at(s: i64) -> String {
    static BASE: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(|| k8s_openapi::jiff::Timestamp::now().as_second() - 3600);
    k8s_openapi::jiff::Timestamp::from_second(base + s)
        .unwrap()
        .to_string()
}

impl Fixture {
    async fn new(prefix: &str) -> Self {
        let env = TestEnv::new(prefix).await;
        let ns = env.namespace.clone();
        let node = format!("node-{ns}");
        let pp = PostParams::default();
        let pools: Api<ImpVMRunnerPool> = env.api();
        let pool = pools
            .create(
                &pp,
                &fixtures::pool("pool").namespace(&ns).min_idle(1).build(),
            )
            .await
            .unwrap();
        pools
            .patch_status(
                "pool",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"desired": 2, "idle": 1, "busy": 1, "total": 2}})),
            )
            .await
            .unwrap();
        let secrets: Api<Secret> = env.api();
        secrets
            .create(
                &pp,
                &fixtures::jit_secret("jit-cold", JIT, 7, "runner-cold"),
            )
            .await
            .unwrap();
        let vms: Api<ImpVM> = env.api();
        // The job was queued at 0; no runner was idle: the VM was created at 1, minted at 2,
        // scheduled at 3, booted at 43 (a cold boot), its runner online at 45, the job picked up at 47.
        let statuses = [
            (
                "cold",
                Some("jit-cold"),
                json!({"phase": "Running", "scheduledTime": at(3), "bootStartTime": at(4),
                       "bootCompleteTime": at(43),
                       "runner": {"handoff": "Started", "startedTime": at(45)},
                       "job": {"jobId": JOB, "repository": "acme/app", "queuedTime": at(0),
                               "vmCreatedTime": at(1), "mintedTime": at(2), "scheduledTime": at(3),
                               "bootedTime": at(43), "runnerStartedTime": at(45),
                               "pickedUpTime": at(47)}}),
            ),
            (
                "idle",
                Some("jit-idle"),
                json!({"phase": "Running", "scheduledTime": at(60), "bootCompleteTime": at(70),
                       "runner": {"handoff": "Started", "startedTime": at(71)}}),
            ),
        ];
        for (name, secret, status) in statuses {
            let mut vm = fixtures::vm(name).runner_of(&pool).bound(&node);
            if let Some(s) = secret {
                vm = vm.runner_config(s);
            }
            vms.create(&pp, &vm.build()).await.unwrap();
            vms.patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status })),
            )
            .await
            .unwrap();
        }
        let nodes: Api<Node> = Api::all(env.client.clone());
        nodes
            .create(
                &pp,
                &serde_json::from_value(json!({"metadata": {"name": node,
                    "labels": {"imp/enabled": "true"},
                    "annotations": {"imp.dev/capacity-vcpu": "8", "imp.dev/capacity-memory-mib": "16384"}}}))
                .unwrap(),
            )
            .await
            .unwrap();
        let leases: Api<Lease> = env.api();
        leases
            .create(
                &pp,
                &serde_json::from_value(
                    json!({"metadata": {"name": imp_api::names::lease_name(&node)},
                    "spec": {"holderIdentity": node,
                             "renewTime": k8s_openapi::jiff::Timestamp::now().to_string()}}),
                )
                .unwrap(),
            )
            .await
            .unwrap();
        // Pods need their ServiceAccount; no controller manager here makes `default`.
        let sas: Api<ServiceAccount> = env.api();
        sas.create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": "default"}})).unwrap(),
        )
        .await
        .unwrap();
        let pods: Api<Pod> = env.api();
        pods.create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": "imp-runtime-x", "labels": {"app.kubernetes.io/component": "runtime"}},
                "spec": {"nodeName": node, "automountServiceAccountToken": false,
                         "containers": [{"name": "runtime", "image": "imp-runtime:test",
                                         "env": [{"name": "IMP_STATE_DIR", "value": "/var/lib/imp"}]}]}}))
            .unwrap(),
        )
        .await
        .unwrap();
        let events: Api<Event> = env.api();
        events
            .create(
                &pp,
                &serde_json::from_value(json!({
                    "metadata": {"name": "pool.mint"},
                    "eventTime": "2026-01-01T00:00:00.000000Z",
                    "reportingController": "imp-operator", "reportingInstance": "imp-operator-0",
                    "action": "Mint", "type": "Warning",
                    "reason": imp_api::names::reason::MINT_FAILED, "note": "GitHub answered 502",
                    "regarding": {"kind": "ImpVMRunnerPool", "name": "pool", "namespace": ns,
                                  "apiVersion": "imp.dev/v1alpha1"}}))
                .unwrap(),
            )
            .await
            .unwrap();
        Self { env, node }
    }

    /// `kubectl-imp ARGS` against the test API server, in the test's namespace, with the test's
    /// namespace as Imp's (Leases, runtime pods).
    fn run(&self, args: &[&str]) -> Output {
        std::process::Command::new(env!("CARGO_BIN_EXE_kubectl-imp"))
            .arg("--kubeconfig")
            .arg(self.env.kubeconfig_path())
            .args([
                "-n",
                &self.env.namespace,
                "--imp-namespace",
                &self.env.namespace,
            ])
            .args(args)
            .output()
            .expect("run kubectl-imp")
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let node = self.node.clone();
        imp_testkit::cluster::with_fresh_client(self.env.kubeconfig_path(), move |c| async move {
            let _ = Api::<Node>::all(c)
                .delete(&node, &DeleteParams::default())
                .await;
        });
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn said(o: &Output) -> String {
    format!("{}{}", stdout(o), String::from_utf8_lossy(&o.stderr))
}

fn json_of(o: &Output) -> Value {
    assert_eq!(o.status.code(), Some(0), "{}", said(o));
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("-o json does not parse: {e}: {}", said(o)))
}

#[tokio::test]
async fn status_shows_pools_nodes_and_the_last_failures() {
    let f = Fixture::new("kimp-status").await;
    let s = json_of(&f.run(&["status", "-o", "json"]));
    let pool = &s["pools"][0];
    assert_eq!(
        (pool["name"].as_str(), pool["desired"].as_u64()),
        (Some("pool"), Some(2))
    );
    assert_eq!(
        (pool["idle"].as_u64(), pool["busy"].as_u64()),
        (Some(1), Some(1))
    );
    let node = s["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == f.node.as_str())
        .unwrap();
    assert_eq!(node["vms"], 2);
    assert_eq!(node["vcpu"], "8");
    assert!(
        node["heartbeat_age_s"].as_f64().is_some_and(|a| a < 600.0),
        "{node}"
    );
    // The pod exists but no kubelet runs it.
    assert_eq!(node["runtime_ready"], false);
    assert_eq!(
        s["failures"][0]["reason"],
        imp_api::names::reason::MINT_FAILED
    );
    let table = stdout(&f.run(&["status"]));
    assert!(
        table.contains("POOL") && table.contains("GitHub answered 502"),
        "{table}"
    );
    let yaml = f.run(&["status", "-o", "yaml"]);
    assert!(
        serde_yaml::from_slice::<Value>(&yaml.stdout).is_ok(),
        "{}",
        said(&yaml)
    );
}

#[tokio::test]
async fn why_names_the_cold_boot_as_the_slowest_phase() {
    let f = Fixture::new("kimp-why").await;
    for target in [JOB.to_string(), "cold".to_owned()] {
        let w = json_of(&f.run(&["why", &target, "-o", "json"]));
        assert_eq!(w["slowest"], "boot", "{w}");
        assert_eq!(w["vm"], "cold");
        assert_eq!(w["waited_s"], 47.0);
    }
    let table = stdout(&f.run(&["why", &JOB.to_string()]));
    assert!(
        table.contains("slowest phase: boot") && table.contains("slow boot"),
        "{table}"
    );
    let idle = stdout(&f.run(&["why", "idle"]));
    assert!(idle.contains("idle runner"), "{idle}");
}

#[tokio::test]
async fn unknown_names_exit_3_with_a_clear_message() {
    let f = Fixture::new("kimp-unknown").await;
    let ns = &f.env.namespace;
    for args in [
        &["why", "nope"][..],
        &["why", "999"],
        &["timeline", "nope"],
        &["console", "nope"],
        &["drain", "no-such-node"],
    ] {
        let o = f.run(args);
        assert_eq!(o.status.code(), Some(3), "{args:?}: {}", said(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        let clear = err.contains(&format!("ImpVM nope not found in namespace {ns}"))
            || err.contains(&format!("no ImpVM in namespace {ns} served job 999"))
            || err.contains("Node no-such-node not found");
        assert!(clear, "{args:?}: {err}");
    }
    // A usage error is 2 (clap).
    assert_eq!(f.run(&["why"]).status.code(), Some(2));
}

#[tokio::test]
async fn timeline_lists_every_phase_with_its_source() {
    let f = Fixture::new("kimp-timeline").await;
    let t = json_of(&f.run(&["timeline", "cold", "-o", "json"]));
    let phase = |k: &str| {
        t["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["phase"] == k)
            .unwrap()
            .clone()
    };
    assert_eq!(phase("guest_hello")["api"], at(43));
    assert_eq!(
        phase("guest_hello")["source"],
        "ImpVM status.bootCompleteTime"
    );
    assert_eq!(
        phase("job_picked_up")["source"],
        "ImpVM status.job.pickedUpTime"
    );
    assert_eq!(t["pickup_latency_s"], 47.0);
    let table = stdout(&f.run(&["timeline", "cold"]));
    assert!(
        table.contains("guest Hello") && table.contains("not yet: "),
        "{table}"
    );
}

#[tokio::test]
async fn console_goes_through_the_runtime_pod_and_never_shows_the_jit_config() {
    let f = Fixture::new("kimp-console").await;
    // No kubelet runs the pod: the API server cannot exec; the failure names the pod.
    let o = f.run(&["console", "cold"]);
    assert_eq!(o.status.code(), Some(1), "{}", said(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!(
            "reading the console through {}/imp-runtime-x",
            f.env.namespace
        )),
        "{err}"
    );
    assert!(!said(&o).contains(JIT));
    // A VM on a node without a runtime pod, and one not scheduled at all.
    let pods: Api<Pod> = f.env.api();
    pods.delete(
        "imp-runtime-x",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let gone = f.run(&["console", "cold"]);
    assert!(
        String::from_utf8_lossy(&gone.stderr)
            .contains(&format!("no imp-runtime pod on node {}", f.node)),
        "{}",
        said(&gone)
    );
    let vms: Api<ImpVM> = f.env.api();
    vms.create(
        &PostParams::default(),
        &fixtures::vm("unbound").namespace(&f.env.namespace).build(),
    )
    .await
    .unwrap();
    let unbound = f.run(&["console", "unbound"]);
    assert!(
        String::from_utf8_lossy(&unbound.stderr).contains("unbound is on no node yet"),
        "{}",
        said(&unbound)
    );
    // Whatever a guest prints, the JIT config of its Secret does not pass.
    let mut r = kubectl_imp::console::Redactor::default();
    assert_eq!(r.line(&format!("jit: {JIT}")), "jit: [redacted]");
    assert!(!r.line(&format!("runner config {JIT} read")).contains(JIT));
}

#[tokio::test]
async fn drain_moves_idle_runners_and_waits_for_running_jobs() {
    let f = Fixture::new("kimp-drain").await;
    // The cold VM runs job 4242: a short timeout ends with exit 4, the node cordoned, the idle gone.
    let o = f.run(&["drain", &f.node, "--timeout", "1s", "--poll", "1s"]);
    assert_eq!(o.status.code(), Some(4), "{}", said(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("still runs 1 job(s)"),
        "{}",
        said(&o)
    );
    let nodes: Api<Node> = Api::all(f.env.client.clone());
    let node = nodes.get(&f.node).await.unwrap();
    assert_eq!(node.spec.unwrap().unschedulable, Some(true));
    let vms: Api<ImpVM> = f.env.api();
    assert!(
        vms.get_opt("idle").await.unwrap().is_none(),
        "the idle runner was not deleted"
    );
    // The job ends and the pool deletes its VM: the drain completes and says what comes next.
    vms.delete("cold", &DeleteParams::default()).await.unwrap();
    let d = json_of(&f.run(&["drain", &f.node, "-o", "json"]));
    let next: Vec<&str> = d["next"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        next.iter().any(|n| n.contains(&format!(
            "kubectl -n {} delete pod imp-runtime-x",
            f.env.namespace
        ))),
        "{d}"
    );
    assert!(
        next.iter()
            .any(|n| n.contains(&format!("kubectl uncordon {}", f.node))),
        "{d}"
    );
}

#[test]
fn completion_for_bash_and_zsh() {
    for (shell, marker) in [
        (
            "bash",
            "complete -F _kubectl__imp -o bashdefault -o default kubectl-imp",
        ),
        ("zsh", "#compdef kubectl-imp"),
    ] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_kubectl-imp"))
            .args(["completion", shell])
            .output()
            .unwrap();
        assert!(
            o.status.success() && stdout(&o).contains(marker),
            "{shell}: {}",
            said(&o)
        );
        assert!(stdout(&o).contains("timeline"), "{shell}");
    }
}
