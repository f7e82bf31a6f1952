//! Stopping imp-runtime on a node, through the real processes: the ImpVM controller (scheduling,
//! node health, finalizer) on a real API server, the real `imp-agent` and `imp-runtime` binaries
//! with the Firecracker simulator, and a local registry holding the VM image (issue 15,
//! acceptance "Stopping imp-runtime"). The agent holds its heartbeat while the runtime does not
//! answer, so the node stops receiving VMs within the heartbeat window; a VM deleted meanwhile is
//! finalized by the agent once the runtime returns, or by the operator's bounded finalizer
//! timeout if it does not.

mod vm_common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use imp_api::{
    ImpVM, VmPhase,
    names::{condition, lease_name, reason},
};
use imp_operator::vm::Timing;
use imp_testkit::{bins, fixtures, process::ManagedProcess, registry::Registry};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::DeleteParams;
use vm_common::*;

/// The operator's staleness threshold here (40 s in production).
const STALE_AFTER: Duration = Duration::from_secs(3);
/// The agent's renewal interval (10 s in production).
const HEARTBEAT: Duration = Duration::from_secs(1);

fn timing(finalizer_timeout: Duration) -> Timing {
    Timing {
        heartbeat_stale_after: STALE_AFTER,
        finalizer_timeout,
        // A Failed (NodeLost) VM on a node back from the dead is not what this test is about.
        node_not_ready_grace: Duration::from_secs(60),
        ..fast_timing()
    }
}

/// imp-runtime (simulator backend) and imp-agent for one node, as separate processes; every
/// process they leave (the simulated VMMs are in sessions of their own) is killed on drop.
struct Node {
    dir: tempfile::TempDir,
    runtime: Option<ManagedProcess>,
    runtime_starts: u32,
    agent: Option<ManagedProcess>,
    registry: String,
}

impl Node {
    fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("runtime.sock")
    }

    async fn start_runtime(&mut self) {
        assert!(self.runtime.is_none());
        let built = bins::ensure_built(
            &[("imp-runtime", "imp-runtime"), ("imp-agent", "imp-agent")],
            &["node", "api/src", "common/src", "guest/src"],
        )
        .expect("imp-runtime and imp-agent binaries");
        let sim = imp_testkit::firecracker::binaries();
        let kernel = self.dir.path().join("vmlinux");
        std::fs::write(&kernel, b"simulated kernel").unwrap();
        let behaviour = self.dir.path().join("behaviour.json");
        std::fs::write(&behaviour, b"{}").unwrap();
        self.runtime_starts += 1;
        let mut cmd = Command::new(&built[0]);
        cmd.env("IMP_RUNTIME_SOCKET", self.socket())
            .env("IMP_STATE_DIR", self.state_dir())
            .env("IMP_KERNEL", &kernel)
            .env("IMP_METRICS_ADDR", "127.0.0.1:0")
            .env("IMP_BOOT_TIMEOUT", "20s")
            .env("IMP_STOP_TIMEOUT", "2s")
            .env("IMP_SIM_BEHAVIOUR", &behaviour)
            .env("IMP_FIRECRACKER_BIN", &sim.simulator)
            // The simulator without the jailer: this test is about the runtime going away.
            .env("IMP_UNJAILED_FIRECRACKER", "1")
            .env("IMP_GUEST_BIN", &sim.guest)
            .env("IMP_INSECURE_REGISTRIES", &self.registry)
            .env("IMP_NODE_LOCAL_REGISTRIES", &self.registry)
            .env("IMP_WRITABLE_BUDGET_BYTES", (16u64 << 30).to_string())
            .env("IMP_LOG", "info");
        let log = self
            .dir
            .path()
            .join(format!("runtime-{}.log", self.runtime_starts));
        self.runtime = Some(ManagedProcess::spawn("imp-runtime", cmd, &log).unwrap());
        let started = Instant::now();
        while !self.runtime_answers() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "imp-runtime did not answer: {}",
                self.runtime.as_ref().unwrap().log_tail(20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the runtime's socket accepts a connection (what the agent's requests need).
    fn runtime_answers(&self) -> bool {
        std::os::unix::net::UnixStream::connect(self.socket()).is_ok()
    }

    /// SIGTERM, as Kubernetes stops the runtime's pod: the VMs keep running without it.
    fn stop_runtime(&mut self) {
        self.runtime
            .take()
            .expect("runtime running")
            .stop(Duration::from_secs(10));
    }

    fn start_agent(&mut self, h: &Harness, node: &str) {
        let agent = bins::ensure_built(&[("imp-agent", "imp-agent")], &[])
            .expect("imp-agent binary")
            .remove(0);
        let mut cmd = Command::new(agent);
        cmd.env("KUBECONFIG", h.env.kubeconfig_path())
            .env("IMP_NODE_NAME", node)
            .env("IMP_NAMESPACE", &h.ns)
            .env("IMP_RUNTIME_SOCKET", self.socket())
            .env(
                "IMP_HEARTBEAT_INTERVAL",
                format!("{}ms", HEARTBEAT.as_millis()),
            )
            .env("IMP_POLL_INTERVAL", "500ms")
            .env("IMP_SWEEP_INTERVAL", "1s")
            .env("IMP_HTTP_ADDR", "127.0.0.1:0")
            .env(
                "IMP_LOG",
                "info,imp_agent=debug,kube_client=info,hyper=info",
            );
        let log = self.dir.path().join("agent.log");
        self.agent = Some(ManagedProcess::spawn("imp-agent", cmd, &log).unwrap());
    }

    fn logs(&self) -> String {
        format!(
            "agent log tail:\n{}\nruntime log tail:\n{}",
            self.agent
                .as_ref()
                .map(|a| a.log_tail(30))
                .unwrap_or_default(),
            imp_testkit::process::log_tail(
                &self
                    .dir
                    .path()
                    .join(format!("runtime-{}.log", self.runtime_starts)),
                15
            )
        )
    }

    /// VM directories imp-runtime holds (one per VM it has not released).
    fn runtime_vms(&self) -> usize {
        std::fs::read_dir(self.state_dir().join("vms"))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        drop(self.agent.take());
        drop(self.runtime.take());
        kill_processes_mentioning(&self.state_dir());
    }
}

/// SIGKILL to every process whose command line names `dir` (the simulated VMMs of this test).
fn kill_processes_mentioning(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

/// Controller, a Node for this test whose heartbeat and capacity the real agent provides, a
/// registry with `ci/base:1`, the runtime and the agent.
async fn start(
    prefix: &str,
    finalizer_timeout: Duration,
) -> (Harness, Node, String, String, Registry) {
    let registry = imp_testkit::oci::registry_with_base_image().await;
    let mut h = Harness::start_with(prefix, timing(finalizer_timeout)).await;
    let node_name = h.add_node("n", 4, 4096).await;
    // The harness created the Lease; from here on only the agent renews it.
    h.stop_heartbeat(&node_name);
    let mut node = Node {
        dir: tempfile::Builder::new()
            .prefix("imp-rtdown")
            .tempdir()
            .unwrap(),
        runtime: None,
        runtime_starts: 0,
        agent: None,
        registry: registry.host(),
    };
    node.start_runtime().await;
    node.start_agent(&h, &node_name);
    let image = format!("{}/ci/base:1", registry.host());
    (h, node, node_name, image, registry)
}

fn vm(name: &str, class: &str, image: &str) -> ImpVM {
    fixtures::vm(name).class(class).image(image).build()
}

fn node_of(vm: &ImpVM) -> Option<&str> {
    vm.spec.node_name.as_deref().filter(|n| !n.is_empty())
}

async fn wait_running(h: &Harness, node: &Node, name: &str) -> ImpVM {
    let started = Instant::now();
    loop {
        let vm = h.vms().get(name).await.unwrap();
        if phase_of(&vm) == Some(VmPhase::Running) {
            return vm;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{name} not Running: {:#?}\n{}",
            vm.status,
            node.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The Lease's last renewal, as the operator judges freshness by it.
async fn renewed(h: &Harness, node: &str) -> k8s_openapi::jiff::Timestamp {
    let lease: Lease = h.leases().get(&lease_name(node)).await.unwrap();
    lease.spec.unwrap().renew_time.unwrap().0
}

/// Stops the runtime and checks the node stops receiving VMs within the heartbeat window: the
/// Lease is renewed at most once more, and a VM created once the window has passed is refused
/// the node (`agent heartbeat stale`) for as long as the runtime is down. Returns that VM's name.
async fn stop_runtime_and_check_no_vm_lands(
    h: &Harness,
    node: &mut Node,
    node_name: &str,
    class: &str,
    image: &str,
) -> &'static str {
    node.stop_runtime();
    let stopped = k8s_openapi::jiff::Timestamp::now();
    let t0 = Instant::now();
    // A renewal already in flight may still land; after it, none.
    tokio::time::sleep(HEARTBEAT * 2).await;
    let last = renewed(h, node_name).await;
    let slack = k8s_openapi::jiff::SignedDuration::try_from(HEARTBEAT * 2).unwrap();
    assert!(
        last <= stopped + slack,
        "the Lease was renewed at {last}, after imp-runtime stopped at {stopped}\n{}",
        node.logs()
    );
    // The window: the last renewal plus the staleness threshold (and a scheduling pass).
    let window = STALE_AFTER + HEARTBEAT * 2 + Duration::from_millis(500);
    tokio::time::sleep(window.saturating_sub(t0.elapsed())).await;
    h.create_vm(vm("late", class, image)).await;
    let late = h
        .wait_vm("late", "refused the node", Duration::from_secs(10), |vm| {
            condition(vm, condition::SCHEDULED)
                .is_some_and(|c| c.status == "False" && c.message.contains("agent heartbeat stale"))
        })
        .await;
    assert_eq!(node_of(&late), None);
    eprintln!(
        "imp-runtime stopped -> a new VM refused the node after {:?} (heartbeat {HEARTBEAT:?}, stale after {STALE_AFTER:?})",
        t0.elapsed()
    );
    // And it stays refused while the runtime is down (the agent still runs and watches).
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(node_of(&h.vms().get("late").await.unwrap()), None);
    "late"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_runtime_takes_the_node_out_and_a_vm_deleted_meanwhile_is_torn_down_on_return() {
    let (mut h, mut node, node_name, image, _registry) =
        start("rtdown-return", Duration::from_secs(120)).await;
    let class = h.add_class("c", 1, 128, None).await;
    h.create_vm(vm("vm1", &class, &image)).await;
    let vm1 = wait_running(&h, &node, "vm1").await;
    assert_eq!(node_of(&vm1), Some(node_name.as_str()));
    assert_eq!(node.runtime_vms(), 1);

    let late = stop_runtime_and_check_no_vm_lands(&h, &mut node, &node_name, &class, &image).await;

    // Deleted while the runtime is down: Terminating, and the finalizer waits (the VM is still
    // running on the host; only the agent can release it, and the timeout is far).
    h.vms()
        .delete("vm1", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_phase("vm1", VmPhase::Terminating, Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(h.vms().get_opt("vm1").await.unwrap().is_some());
    assert_eq!(node.runtime_vms(), 1, "the VM is still on the host");

    // The runtime returns: the agent tears vm1 down (TornDown), the operator removes the
    // finalizer, and the node takes VMs again: the refused one lands and runs.
    let back = Instant::now();
    node.start_runtime().await;
    let gone = h.wait_gone("vm1", Duration::from_secs(30)).await;
    eprintln!("imp-runtime back -> the deleted VM finalized after {gone:?}");
    let events = h.events("vm1").await;
    assert!(
        events.iter().any(|(r, _)| r == reason::TORN_DOWN_ON_NODE),
        "the agent tore vm1 down: {events:?}"
    );
    assert!(
        !events.iter().any(|(r, _)| r == reason::FINALIZER_FORCED),
        "{events:?}"
    );
    let late = wait_running(&h, &node, late).await;
    assert_eq!(node_of(&late), Some(node_name.as_str()));
    eprintln!(
        "imp-runtime back -> the refused VM Running after {:?}",
        back.elapsed()
    );
    let started = Instant::now();
    while node.runtime_vms() != 1 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "vm1's instance was not released: {} VMs\n{}",
            node.runtime_vms(),
            node.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_deleted_while_the_runtime_stays_down_is_finalized_after_the_bounded_timeout() {
    let timeout = Duration::from_secs(4);
    let (mut h, mut node, node_name, image, _registry) = start("rtdown-timeout", timeout).await;
    let class = h.add_class("c", 1, 128, None).await;
    h.create_vm(vm("vm1", &class, &image)).await;
    wait_running(&h, &node, "vm1").await;

    let late = stop_runtime_and_check_no_vm_lands(&h, &mut node, &node_name, &class, &image).await;

    let deleted = Instant::now();
    h.vms()
        .delete("vm1", &DeleteParams::default())
        .await
        .unwrap();
    let gone = h.wait_gone("vm1", timeout + Duration::from_secs(15)).await;
    assert!(
        // deletionTimestamp has whole seconds: the deadline may fall up to 1 s early.
        deleted.elapsed() >= timeout - Duration::from_millis(1100),
        "finalized after {gone:?}, before the {timeout:?} timeout"
    );
    eprintln!("runtime down -> deleted VM finalized by the timeout after {gone:?}");
    let note = h
        .wait_event("vm1", reason::FINALIZER_FORCED, Duration::from_secs(5))
        .await;
    assert!(note.contains(reason::AGENT_HEARTBEAT_STALE), "{note}");

    // The VM was left on the host; once the runtime returns, the agent's sweep releases it (no
    // ImpVM is bound to it any more). The refused VM goes first, so that nothing lands there.
    assert_eq!(node.runtime_vms(), 1);
    h.vms()
        .delete(late, &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone(late, Duration::from_secs(10)).await;
    node.start_runtime().await;
    let started = Instant::now();
    while node.runtime_vms() != 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the finalized VM's instance was not released: {} VMs\n{}",
            node.runtime_vms(),
            node.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    h.finish().await;
}
