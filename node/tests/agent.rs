//! imp-agent end to end: the real `imp-agent` binary against a real kube-apiserver (testkit
//! TestEnv, one namespace per test), the real `imp-runtime` binary with the Firecracker simulator
//! (imp-guest runs as a host process, so the runner command is a host script), and a real OCI
//! registry holding the VM image. The test plays the operator (binding, Terminating, finalizer).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{Harness, simulator};
use imp_api::names::{self, condition, reason};
use imp_api::{HandoffState, ImpVM, ImpVMClass, VmPhase, conditions};
use imp_testkit::oci::{LayerBlob, PushAuth, push_image};
use imp_testkit::registry::{Registry, RegistryOptions};
use imp_testkit::tarball::TarBuilder;
use imp_testkit::{TestEnv, fixtures};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

const JIT: &str = "eyJqaXQiOiJzM2NyM3QtY29uZmlnLWZvci10ZXN0In0=-JITSECRET-7f3a9c";

struct Agent {
    child: Option<Child>,
    log: PathBuf,
    http: String,
}

impl Agent {
    fn start(env: &TestEnv, rt: &Harness, node: &str, runner_command: &Path, n: u32) -> Agent {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = rt.dir.path().join(format!("agent-{n}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let child = common::agent_command(env, rt, node)
            .env("IMP_POLL_INTERVAL", "500ms")
            .env("IMP_SWEEP_INTERVAL", "1s")
            .env("IMP_HTTP_ADDR", format!("127.0.0.1:{port}"))
            .env("IMP_RUNNER_COMMAND", runner_command)
            .env(
                "IMP_LOG",
                "debug,hyper=info,kube_client=info,tower=info,h2=info,rustls=info",
            )
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        Agent {
            child: Some(child),
            log,
            http: format!("http://127.0.0.1:{port}"),
        }
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

struct World {
    env: TestEnv,
    rt: Harness,
    _registry: Registry,
    image: String,
    node: String,
    class: String,
    dir: tempfile::TempDir,
}

/// A TCP forwarder from `127.0.0.1:<port>` in `net`'s node namespace to `target` in the test's
/// own: a socket belongs to the namespace of the thread that created it, so the listener is
/// made on a thread inside the node namespace and the outgoing connections here. Its threads
/// end with the test process. Returns the `127.0.0.1:<port>` to use inside the namespace.
fn forward_into(net: &common::TestNetwork, target: &str) -> String {
    let listener = net.in_node(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    let port = listener.local_addr().unwrap().port();
    let target = target.to_owned();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(inside) = conn else { return };
            let Ok(outside) = std::net::TcpStream::connect(&target) else {
                continue;
            };
            for (mut from, mut to) in [
                (inside.try_clone().unwrap(), outside.try_clone().unwrap()),
                (outside, inside),
            ] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    format!("127.0.0.1:{port}")
}

/// A registry holding `ci/base:1`.
async fn registry_with_base_image() -> Registry {
    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let layer = LayerBlob::gzipped(
        TarBuilder::new()
            .dir("etc", 0o755)
            .file("etc/os-release", b"ID=imp-test\n", 0o644)
            .into_gzip(),
    );
    push_image(
        &registry.host(),
        "ci/base:1",
        &[layer],
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    registry
}

impl World {
    async fn new(prefix: &str) -> World {
        Self::new_in(prefix, None).await
    }

    /// With `net`, the runtime runs in its node namespace and pulls through a forwarder
    /// listening on `127.0.0.1` there (the registry stays in the test's namespace).
    async fn new_in(prefix: &str, net: Option<&common::TestNetwork>) -> World {
        let registry = registry_with_base_image().await;
        let host = match net {
            None => registry.host(),
            Some(n) => forward_into(n, &registry.host()),
        };
        let mut rt = Harness::new(simulator());
        rt.extra_env = vec![("IMP_INSECURE_REGISTRIES".into(), host.clone())];
        rt.netns = net.map(|n| n.node.clone());
        rt.start_runtime().await;
        let env = TestEnv::new(prefix).await;
        let node = format!("{}-node", env.namespace);
        let class = format!("{}-small", env.namespace);
        let c = fixtures::class(&class).vcpu(1).memory_mib(128).disk_gib(1);
        Api::<ImpVMClass>::all(env.client.clone())
            .create(&PostParams::default(), &c.build())
            .await
            .unwrap();
        World {
            image: format!("{host}/ci/base:1"),
            _registry: registry,
            rt,
            env,
            node,
            class,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn vms(&self) -> Api<ImpVM> {
        self.env.api()
    }

    /// A runner command that records its environment and argv, then exits with `code`.
    fn runner_script(&self, code: i32) -> PathBuf {
        let d = self.dir.path();
        let path = d.join(format!("runner-{code}.sh"));
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\nprintf '%s' \"$ACTIONS_RUNNER_INPUT_JITCONFIG\" > {d}/got-config\necho \"$0 $*\" > {d}/argv\nexit {code}\n",
                d = d.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn got_config(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.path().join("got-config")).ok()
    }

    fn agent(&self, runner: &Path, n: u32) -> Agent {
        Agent::start(&self.env, &self.rt, &self.node, runner, n)
    }

    /// Creates a VM bound to the test node in phase Scheduled (as the operator leaves it), with
    /// the operator's finalizer.
    async fn bound_vm(&self, name: &str, image: &str, runner_secret: Option<&str>) -> ImpVM {
        let mut vm = fixtures::vm(name)
            .class(&self.class)
            .image(image)
            .bound(&self.node)
            .finalizer(imp_api::names::FINALIZER_VM_CLEANUP);
        if let Some(s) = runner_secret {
            vm = vm.runner_config(s);
        }
        self.vms()
            .create(&PostParams::default(), &vm.build())
            .await
            .unwrap();
        self.set_status(name, json!({"phase": VmPhase::Scheduled}))
            .await
    }

    async fn set_status(&self, name: &str, status: serde_json::Value) -> ImpVM {
        self.vms()
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
            .unwrap()
    }

    async fn jit_secret(&self, name: &str) {
        let s = fixtures::jit_secret(name, JIT, 42, "imp-test-runner");
        self.env
            .api::<Secret>()
            .create(&PostParams::default(), &s)
            .await
            .unwrap();
    }

    async fn secret_exists(&self, name: &str) -> bool {
        self.env
            .api::<Secret>()
            .get_opt(name)
            .await
            .unwrap()
            .is_some()
    }

    async fn wait_vm(
        &self,
        name: &str,
        what: &str,
        within: Duration,
        agent: &Agent,
        pred: impl Fn(&ImpVM) -> bool,
    ) -> ImpVM {
        let started = Instant::now();
        loop {
            let vm = self.vms().get(name).await.unwrap();
            if pred(&vm) {
                return vm;
            }
            if started.elapsed() > within {
                panic!(
                    "{name}: not {what} after {within:?}; status: {:#?}\nagent log tail:\n{}\nruntime log tail:\n{}",
                    vm.status,
                    tail(&agent.log(), 40),
                    tail(&self.rt.runtime_log(), 20)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_phase(&self, name: &str, phase: VmPhase, agent: &Agent) -> ImpVM {
        self.wait_vm(
            name,
            &format!("{phase:?}"),
            Duration::from_secs(60),
            agent,
            |vm| phase_of(vm) == Some(phase),
        )
        .await
    }

    /// Plays the operator's deletion: delete, Terminating, wait for TornDown, drop the finalizer.
    async fn delete_and_wait_torn_down(&self, name: &str, agent: &Agent) {
        self.vms()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
        self.set_status(name, json!({"phase": VmPhase::Terminating}))
            .await;
        self.wait_vm(
            name,
            condition::TORN_DOWN,
            Duration::from_secs(30),
            agent,
            |vm| cond(vm, condition::TORN_DOWN) == Some("True".into()),
        )
        .await;
        self.vms()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
            )
            .await
            .unwrap();
    }

    async fn finish(self) {
        let _ = Api::<ImpVMClass>::all(self.env.client.clone())
            .delete(&self.class, &DeleteParams::default())
            .await;
        if let Ok(list) = self.vms().list(&Default::default()).await {
            for vm in list {
                let _ = self
                    .vms()
                    .patch(
                        &vm.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
                    )
                    .await;
            }
        }
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn phase_of(vm: &ImpVM) -> Option<VmPhase> {
    vm.status.as_ref().and_then(|s| s.phase)
}

fn cond(vm: &ImpVM, type_: &str) -> Option<String> {
    vm.status
        .as_ref()
        .and_then(|s| conditions::find(&s.conditions, type_))
        .map(|c| c.status.clone())
}

fn uid(vm: &ImpVM) -> String {
    vm.uid().unwrap()
}

async fn runtime_has(rt: &Harness, uid: &str) -> bool {
    rt.client.inspect(uid).await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bound_vm_starts_runs_and_is_torn_down_and_the_lease_is_renewed() {
    let w = World::new("agent-run").await;
    let agent = w.agent(&w.runner_script(0), 1);
    w.bound_vm("plain", &w.image, None).await;
    let vm = w.wait_phase("plain", VmPhase::Running, &agent).await;
    let s = vm.status.as_ref().unwrap();
    assert!(s.boot_start_time.is_some() && s.boot_complete_time.is_some());
    assert!(s.first_running_time.is_some());
    assert_eq!(cond(&vm, condition::READY).as_deref(), Some("True"));
    assert_eq!(
        w.rt.client.inspect(&uid(&vm)).await.unwrap().state,
        imp_node::api::VmState::Running
    );

    // Heartbeat Lease in the operator namespace, renewed.
    let leases: Api<Lease> = w.env.api();
    let lease_name = names::lease_name(&w.node);
    let first = leases.get(&lease_name).await.unwrap().spec.unwrap();
    assert_eq!(first.holder_identity.as_deref(), Some(w.node.as_str()));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let later = leases.get(&lease_name).await.unwrap().spec.unwrap();
    assert!(
        later.renew_time.unwrap().0 > first.renew_time.unwrap().0,
        "Lease not renewed"
    );

    // /metrics and /healthz
    let metrics = reqwest_get(&format!("{}/metrics", agent.http)).await;
    assert!(
        metrics.contains("imp_agent_heartbeat_timestamp_seconds"),
        "{metrics}"
    );
    assert!(
        metrics.contains("imp_agent_vm_boot_seconds_count 1"),
        "{metrics}"
    );
    assert_eq!(reqwest_get(&format!("{}/healthz", agent.http)).await, "ok");

    w.delete_and_wait_torn_down("plain", &agent).await;
    assert!(
        !runtime_has(&w.rt, &uid(&vm)).await,
        "runtime still has the VM"
    );
    drop(agent);
    w.finish().await;
}

async fn reqwest_get(url: &str) -> String {
    let out = Command::new("curl").args(["-sf", url]).output().unwrap();
    assert!(out.status.success(), "GET {url} failed");
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_handoff_delivers_the_config_deletes_the_secret_and_exit_zero_succeeds() {
    let w = World::new("agent-handoff").await;
    let agent = w.agent(&w.runner_script(0), 1);
    w.jit_secret("jit-a").await;
    w.bound_vm("runner-a", &w.image, Some("jit-a")).await;
    let vm = w.wait_phase("runner-a", VmPhase::Succeeded, &agent).await;
    let r = vm.status.as_ref().unwrap().runner.clone().unwrap();
    assert_eq!(r.handoff, Some(HandoffState::Exited));
    assert_eq!(r.exit_code, Some(0));
    assert!(r.pid.is_some() && r.sent_time.is_some() && r.started_time.is_some());
    assert_eq!(r.exec_id, Some(format!("impvm-{}-runner", uid(&vm))));
    assert_eq!(r.runner_id, Some(42));
    assert_eq!(
        w.got_config().as_deref(),
        Some(JIT),
        "runner did not get the config"
    );
    let argv = std::fs::read_to_string(w.dir.path().join("argv")).unwrap();
    assert!(!argv.contains(JIT), "config in argv: {argv}");
    assert!(!w.secret_exists("jit-a").await, "JIT Secret not deleted");
    // The config never reaches the agent's logs (debug level) or the status.
    let log = agent.log();
    assert!(log.contains("handoff Sent recorded"), "{log}");
    assert!(
        !log.contains(JIT) && !log.contains("JITSECRET"),
        "JIT config in the agent log"
    );
    assert!(!serde_json::to_string(&vm).unwrap().contains("JITSECRET"));
    // Terminal: the instance is released; deletion records TornDown.
    w.delete_and_wait_torn_down("runner-a", &agent).await;
    assert!(!runtime_has(&w.rt, &uid(&vm)).await);
    drop(agent);
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_exit_non_zero_fails_the_vm() {
    let w = World::new("agent-exit").await;
    let agent = w.agent(&w.runner_script(3), 1);
    w.jit_secret("jit-b").await;
    w.bound_vm("runner-b", &w.image, Some("jit-b")).await;
    let vm = w.wait_phase("runner-b", VmPhase::Failed, &agent).await;
    let s = vm.status.as_ref().unwrap();
    assert_eq!(
        s.reason.as_deref(),
        Some(reason::RUNNER_EXITED_NON_ZERO),
        "{s:#?}"
    );
    assert_eq!(s.runner.as_ref().unwrap().exit_code, Some(3));
    assert!(!w.secret_exists("jit-b").await);
    drop(agent);
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_without_started_at_startup_is_ambiguous_and_never_replayed() {
    let w = World::new("agent-ambig").await;
    w.jit_secret("jit-c").await;
    let vm = w.bound_vm("runner-c", &w.image, Some("jit-c")).await;
    // A previous agent booted the VM, recorded Sent, and died before Started.
    let spec = w.rt.spec(false);
    w.rt.client.ensure_running(&uid(&vm), &spec).await.unwrap();
    w.set_status(
        "runner-c",
        json!({"phase": "Running", "runner": {"handoff": "Sent", "execId": format!("impvm-{}-runner", uid(&vm))}}),
    )
    .await;
    let agent = w.agent(&w.runner_script(0), 2);
    let vm = w.wait_phase("runner-c", VmPhase::Failed, &agent).await;
    let s = vm.status.as_ref().unwrap();
    assert_eq!(s.reason.as_deref(), Some(reason::HANDOFF_AMBIGUOUS));
    assert_eq!(
        s.runner.as_ref().unwrap().handoff,
        Some(HandoffState::Ambiguous)
    );
    let started = Instant::now();
    while w.secret_exists("jit-c").await {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "Secret not deleted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Failed is terminal: the instance (and any runner the config may have reached) is released.
    let started = Instant::now();
    while runtime_has(&w.rt, &uid(&vm)).await {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "instance not released"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(w.got_config(), None, "the config was replayed to a runner");
    assert!(!agent.log().contains("JITSECRET"));
    drop(agent);
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_start_failure_is_reported_with_its_reason() {
    let w = World::new("agent-fail").await;
    let agent = w.agent(&w.runner_script(0), 1);
    let missing = w.image.replace("ci/base:1", "ci/missing:1");
    w.bound_vm("broken", &missing, None).await;
    let vm = w.wait_phase("broken", VmPhase::Failed, &agent).await;
    assert_eq!(
        vm.status.as_ref().unwrap().reason.as_deref(),
        Some(reason::ROOTFS_PULL_FAILED),
        "{:#?}",
        vm.status
    );
    drop(agent);
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_rebound_elsewhere_is_released_locally() {
    let w = World::new("agent-rebind").await;
    let agent = w.agent(&w.runner_script(0), 1);
    let vm = w.bound_vm("moving", &w.image, None).await;
    w.wait_phase("moving", VmPhase::Running, &agent).await;
    // The operator reschedules: clears nodeName, phase Pending.
    w.vms()
        .patch(
            "moving",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"nodeName": null}})),
        )
        .await
        .unwrap();
    w.set_status("moving", json!({"phase": "Pending"})).await;
    let started = Instant::now();
    while runtime_has(&w.rt, &uid(&vm)).await {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "rebound VM still in the runtime; agent log:\n{}",
            tail(&agent.log(), 30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(agent);
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn networked_vm_waits_for_its_address_then_runs_with_status_ip() {
    if !common::network_tests_can_run() {
        return;
    }
    // Declared first: dropped after the world (runtime, VMMs and registry stop first).
    let tn = common::TestNetwork::new("impag");
    let w = World::new_in("agent-net", Some(&tn)).await;
    let net: imp_api::ImpNetwork = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork", "metadata": {"name": "runners"},
        "spec": {"subnet": "198.51.100.0/24", "gateway": "198.51.100.1", "dns": ["192.0.2.1"],
            "nat": {"enabled": true}}}))
    .unwrap();
    let net = w
        .env
        .api::<imp_api::ImpNetwork>()
        .create(&PostParams::default(), &net)
        .await
        .unwrap();
    let agent = w.agent(&w.runner_script(0), 1);
    let mut spec = json!({"classRef": {"name": w.class}, "image": w.image,
        "lifecycle": "ephemeral", "nodeName": w.node, "networkRef": {"name": "runners"}});
    let vm: ImpVM = serde_json::from_value(json!({"apiVersion": "imp.dev/v1alpha1",
        "kind": "ImpVM", "metadata": {"name": "netvm",
            "finalizers": [names::FINALIZER_VM_CLEANUP]}, "spec": spec.take()}))
    .unwrap();
    let vm = w.vms().create(&PostParams::default(), &vm).await.unwrap();
    w.set_status("netvm", json!({"phase": VmPhase::Scheduled}))
        .await;

    // No allocation yet: the agent leaves it Scheduled and asks the runtime for nothing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let now = w.vms().get("netvm").await.unwrap();
    assert_eq!(
        phase_of(&now),
        Some(VmPhase::Scheduled),
        "{:#?}",
        now.status
    );
    assert!(
        !runtime_has(&w.rt, &uid(&vm)).await,
        "PUT without an address"
    );
    assert!(
        agent.log().contains("waiting for the VM's address"),
        "{}",
        tail(&agent.log(), 20)
    );

    // The operator's IPAM records the address: the VM starts on the network.
    w.vms()
        .patch(
            "netvm",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {
                names::ANNOTATION_IP_ALLOCATION: "198.51.100.7/24"}}})),
        )
        .await
        .unwrap();
    let running = w.wait_phase("netvm", VmPhase::Running, &agent).await;
    assert_eq!(
        running.status.as_ref().unwrap().ip.as_deref(),
        Some("198.51.100.7")
    );
    let st = w.rt.client.inspect(&uid(&vm)).await.unwrap();
    let serial = std::fs::read_to_string(&st.serial_log).unwrap();
    assert!(
        serial.contains("imp.net=198.51.100.7/24,198.51.100.1 imp.dns=192.0.2.1"),
        "{serial}"
    );
    let bridge = imp_node::network::bridge_name(&net.uid().unwrap());
    let links = Command::new("ip")
        .args(["-n", &tn.node, "-o", "link", "show", "dev", &bridge])
        .output()
        .unwrap();
    assert!(
        links.status.success(),
        "no bridge {bridge} in the node namespace"
    );

    w.delete_and_wait_torn_down("netvm", &agent).await;
    let links = Command::new("ip")
        .args(["-n", &tn.node, "-o", "link", "show", "dev", &bridge])
        .output()
        .unwrap();
    assert!(
        !links.status.success(),
        "bridge {bridge} left after teardown"
    );
    drop(agent);
    let _ = w
        .env
        .api::<imp_api::ImpNetwork>()
        .delete("runners", &DeleteParams::default())
        .await;
    w.finish().await;
}

/// The agent pre-builds the image of each pool its node can serve, before any VM asks for it:
/// at start, and again when the pool's image changes (docs/rootfs.md, Pre-build). The pool
/// selects this test's Node by a label of its own, so agents of other tests never build it.
#[tokio::test]
async fn the_agent_prebuilds_the_images_of_pools_its_node_serves() {
    use imp_api::ImpVMRunnerPool;
    use k8s_openapi::api::core::v1::Node;
    let w = World::new("prebuild").await;
    let select = ("imp-test/prebuild".to_string(), w.env.namespace.clone());
    let nodes: Api<Node> = Api::all(w.env.client.clone());
    let mut node = Node::default();
    node.metadata.name = Some(w.node.clone());
    node.metadata.labels = Some(
        [
            (names::LABEL_NODE_ENABLED.to_string(), "true".to_string()),
            select.clone(),
        ]
        .into(),
    );
    nodes.create(&PostParams::default(), &node).await.unwrap();
    let mut pool = fixtures::pool("pre")
        .namespace(&w.env.namespace)
        .image(&w.image)
        .build();
    pool.spec.template.spec.node_selector = Some([select].into());
    // No kubelet reports this Node Ready, so the node lifecycle controller taints it not-ready
    // (NoSchedule); the pool tolerates every taint, as the scheduler's rules require here.
    pool.spec.template.spec.tolerations = Some(vec![k8s_openapi::api::core::v1::Toleration {
        operator: Some("Exists".into()),
        ..Default::default()
    }]);
    let pools: Api<ImpVMRunnerPool> = w.env.api();
    pools.create(&PostParams::default(), &pool).await.unwrap();

    let agent = w.agent(&w.runner_script(0), 0);
    let built = |n: u32| format!("imp_rootfs_prebuilds_total{{outcome=\"built\"}} {n}");
    let wait_built = |n: u32| {
        let want = built(n);
        let (rt, agent) = (&w.rt, &agent);
        async move {
            let started = Instant::now();
            loop {
                let m = rt.metrics().await;
                if m.contains(&want) {
                    return;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(90),
                    "{want} not reached:\n{m}\nagent log (pre-build lines):\n{}\nruntime log tail:\n{}",
                    agent
                        .log()
                        .lines()
                        .filter(|l| !l.contains("heartbeat renewed"))
                        .collect::<Vec<_>>()
                        .join("\n"),
                    tail(&rt.runtime_log(), 20)
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    wait_built(1).await;
    assert_eq!(runtime_images(&w.rt), 1, "the pre-built image is cached");

    // The pool rolls to a new image: built again, without any VM.
    let layer = LayerBlob::gzipped(
        TarBuilder::new()
            .file("etc-rolled", b"v2", 0o644)
            .into_gzip(),
    );
    push_image(
        &w._registry.host(),
        "ci/base:2",
        &[layer],
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    let rolled = w.image.replace("ci/base:1", "ci/base:2");
    pools
        .patch(
            "pre",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"template": {"spec": {"image": rolled}}}})),
        )
        .await
        .unwrap();
    wait_built(2).await;
    assert_eq!(runtime_images(&w.rt), 2);
    let m = w.rt.metrics().await;
    assert!(
        m.contains("imp_rootfs_cache_misses_total 0"),
        "no VM built anything: {m}"
    );

    drop(agent);
    let _ = pools.delete("pre", &DeleteParams::default()).await;
    let _ = nodes.delete(&w.node, &DeleteParams::default()).await;
    w.finish().await;
}

fn runtime_images(rt: &Harness) -> usize {
    std::fs::read_dir(rt.state_dir.join("rootfs/images"))
        .map(|d| d.count())
        .unwrap_or(0)
}
