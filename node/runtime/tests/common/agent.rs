//! The real imp-agent binary as a test's child process, and a world for it: a real API server
//! (testkit TestEnv), imp-runtime (the [`Harness`]), a registry with `ci/base:1`, a node name
//! and a VM class. The test plays the operator: it creates ImpVMs bound to the node and waits
//! on what the agent makes of them. Shared by node/runtime/tests/agent.rs and suspend_agent.rs.

use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use imp_api::{ImpVM, ImpVMClass, VmPhase};
use imp_testkit::oci::registry_with_base_image;
use imp_testkit::registry::Registry;
use imp_testkit::waits;
pub use imp_testkit::waits::phase_of;
use imp_testkit::{TestEnv, fixtures};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use super::{Backend, Harness, TestNetwork, agent_command};

/// An imp-agent process, killed on drop; its stdout and stderr go to its log file.
pub struct Agent {
    child: Option<Child>,
    log: PathBuf,
    /// `http://127.0.0.1:<port>`: /metrics and /healthz.
    pub http: String,
}

impl Agent {
    /// Agent number `n` (it names the log, `agent-<n>.log` in the runtime's dir) for `node`,
    /// polling every 500 ms and sweeping every second; `extra_env` comes last and overrides.
    pub fn start(
        env: &TestEnv,
        rt: &Harness,
        node: &str,
        n: u32,
        extra_env: &[(&str, &str)],
    ) -> Agent {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = rt.dir.path().join(format!("agent-{n}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let child = agent_command(env, rt, node)
            .env("IMP_POLL_INTERVAL", "500ms")
            .env("IMP_SWEEP_INTERVAL", "1s")
            .env("IMP_HTTP_ADDR", format!("127.0.0.1:{port}"))
            .env(
                "IMP_LOG",
                "debug,hyper=info,kube_client=info,kube_runtime=info,tower=info,h2=info,rustls=info",
            )
            .envs(extra_env.iter().copied())
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

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The agent's /metrics text.
    pub fn metrics(&self) -> String {
        let out = std::process::Command::new("curl")
            .args(["-sf", &format!("{}/metrics", self.http)])
            .output()
            .unwrap();
        assert!(out.status.success(), "GET /metrics failed");
        String::from_utf8(out.stdout).unwrap()
    }

    /// Resident set size of the agent process, bytes (/proc/<pid>/status VmRSS).
    pub fn rss(&self) -> u64 {
        let pid = self.child.as_ref().expect("agent running").id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/<pid>/status");
        kib * 1024
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub struct World {
    pub env: TestEnv,
    pub rt: Harness,
    pub registry: Registry,
    /// `ci/base:1` as the runtime reaches it.
    pub image: String,
    pub node: String,
    pub class: String,
    /// Scratch space of the test (runner scripts, what they record).
    pub dir: tempfile::TempDir,
}

/// A TCP forwarder from `127.0.0.1:<port>` in `net`'s node namespace to `target` in the test's
/// own: a socket belongs to the namespace of the thread that created it, so the listener is
/// made on a thread inside the node namespace and the outgoing connections here. Its threads
/// end with the test process. Returns the `127.0.0.1:<port>` to use inside the namespace.
pub fn forward_into(net: &TestNetwork, target: &str) -> String {
    super::forward(&net.node, "127.0.0.1:0", target).addr
}

impl World {
    /// On the Firecracker simulator.
    pub async fn new(prefix: &str) -> World {
        Self::new_with(prefix, None, super::simulator()).await
    }

    /// On the Firecracker simulator, in `net` (see [`World::new_with`]).
    pub async fn new_in(prefix: &str, net: Option<&TestNetwork>) -> World {
        Self::new_with(prefix, net, super::simulator()).await
    }

    /// With `net`, the runtime runs in its node namespace and pulls through a forwarder
    /// listening on `127.0.0.1` there (the registry stays in the test's namespace).
    pub async fn new_with(prefix: &str, net: Option<&TestNetwork>, backend: Backend) -> World {
        let registry = registry_with_base_image().await;
        let host = match net {
            None => registry.host(),
            Some(n) => forward_into(n, &registry.host()),
        };
        let mut rt = Harness::new(backend);
        rt.extra_env = vec![
            ("IMP_INSECURE_REGISTRIES".into(), host.clone()),
            ("IMP_NODE_LOCAL_REGISTRIES".into(), host.clone()),
        ];
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
        // The runner runs as uid 1001 (the pool default), also in the simulated guest, which is a
        // host process: its scripts here must be reachable and its records writable for it.
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        World {
            image: format!("{host}/ci/base:1"),
            registry,
            rt,
            env,
            node,
            class,
            dir,
        }
    }

    pub fn vms(&self) -> Api<ImpVM> {
        self.env.api()
    }

    pub async fn set_status(&self, name: &str, status: serde_json::Value) -> ImpVM {
        self.vms()
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
            .unwrap()
    }

    /// Polls ImpVM `name` until `pred` holds; after `within` panics with its status and the
    /// tails of the agent's and the runtime's logs.
    pub async fn wait_vm(
        &self,
        name: &str,
        what: &str,
        within: Duration,
        agent: &Agent,
        pred: impl Fn(&ImpVM) -> bool,
    ) -> ImpVM {
        waits::wait_vm(&self.vms(), name, what, within, pred, || {
            format!(
                "\nagent log tail:\n{}\nruntime log tail:\n{}",
                tail(&agent.log(), 60),
                tail(&self.rt.runtime_log(), 30)
            )
        })
        .await
    }

    pub async fn wait_phase(
        &self,
        name: &str,
        phase: VmPhase,
        within: Duration,
        agent: &Agent,
    ) -> ImpVM {
        self.wait_vm(name, &format!("{phase:?}"), within, agent, |vm| {
            phase_of(vm) == Some(phase)
        })
        .await
    }

    /// The Events on ImpVM `name` (events.k8s.io), as (type, reason, note).
    pub async fn events_of(&self, name: &str) -> Vec<(String, String, String)> {
        events_of(&self.env, name).await
    }

    /// Waits for an Event on `name` that `pred` accepts (given type, reason, note); returns
    /// every Event on `name`. 30 s: Events are published after the status write they report,
    /// and on a loaded 2-core machine 15 s was seen to be too short.
    pub async fn wait_event_where(
        &self,
        name: &str,
        what: &str,
        pred: impl Fn(&str, &str, &str) -> bool,
    ) -> Vec<(String, String, String)> {
        let started = Instant::now();
        loop {
            let events = self.events_of(name).await;
            if events.iter().any(|(t, r, n)| pred(t, r, n)) {
                return events;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{name}: no {what} Event: {events:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Deletes the class and drops every ImpVM's finalizer (the namespace goes with the env).
    pub async fn finish(self) {
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

/// The Events on object `name` in `env`'s namespace (events.k8s.io), as (type, reason, note).
pub async fn events_of(env: &TestEnv, name: &str) -> Vec<(String, String, String)> {
    let events: Api<k8s_openapi::api::events::v1::Event> = env.api();
    events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| {
            (
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default(),
            )
        })
        .collect()
}

/// (status, reason) of condition `type_` on `vm`.
pub fn cond(vm: &ImpVM, type_: &str) -> Option<(String, String)> {
    vm.status
        .as_ref()
        .and_then(|s| imp_api::conditions::find(&s.conditions, type_))
        .map(|c| (c.status.clone(), c.reason.clone()))
}

/// What [`cond`] returns for `status` and `reason`.
pub fn pair(status: &str, reason: &str) -> Option<(String, String)> {
    Some((status.to_owned(), reason.to_owned()))
}

/// The value of the first sample line starting with `series` in Prometheus text.
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// Checks the agent's ScaleToZero metrics `m` after idle suspends and traffic wakes: at least
/// one idle suspend, and every one ended with a wake (on a slow machine a late SYN
/// retransmission may wake a second suspension). Returns the mean wake time, seconds.
pub fn idle_suspends_all_woken(m: &str) -> f64 {
    let suspends = sample(m, "imp_agent_vm_suspends_total{trigger=\"idle\"}").unwrap_or(0.0);
    assert!(suspends >= 1.0, "{m}");
    assert_eq!(
        sample(m, "imp_agent_vm_resumes_total{trigger=\"traffic\"}"),
        Some(suspends),
        "{m}"
    );
    assert_eq!(
        sample(m, "imp_agent_vm_wake_seconds_count"),
        Some(suspends),
        "{m}"
    );
    sample(m, "imp_agent_vm_wake_seconds_sum").unwrap() / suspends
}

/// One exchange from namespace `ns` with a line server at `addr`: connect (the kernel's SYN
/// retries included, up to `within`), send `ping`, read the answer to EOF (at most 30 s). The
/// answer and how long the whole exchange took.
pub fn ping_from(
    ns: &str,
    addr: std::net::SocketAddr,
    within: Duration,
) -> Result<(String, Duration), String> {
    use std::io::{Read, Write};
    super::in_netns(ns, || {
        let started = Instant::now();
        let mut c = TcpStream::connect_timeout(&addr, within)
            .map_err(|e| format!("connect after {:?}: {e}", started.elapsed()))?;
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        c.write_all(b"ping\n").map_err(|e| format!("write: {e}"))?;
        let mut answer = String::new();
        c.read_to_string(&mut answer)
            .map_err(|e| format!("read: {e}"))?;
        Ok((answer, started.elapsed()))
    })
}

/// The last `n` lines of `s`.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
