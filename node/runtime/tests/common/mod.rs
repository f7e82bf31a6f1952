//! Test harness: an imp-runtime process (the real binary) on a temp state dir, driving either
//! testkit's Firecracker simulator or, when IMP_FIRECRACKER_BIN, IMP_KERNEL and IMP_ROOTFS (or
//! IMP_GUEST_STATIC_BIN) are set, real Firecracker (testkit::firecracker::real_or_skip).
#![allow(dead_code)] // each test binary uses part of the harness

pub mod agent;
pub mod confine;
pub mod measure;
pub mod scale_to_zero;
pub mod template;
pub mod vmm;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use imp_runtime::api::{NetworkSpec, VmSpec};
use imp_runtime::client::RuntimeClient;
use imp_testkit::firecracker::{Knobs, Needs, real_or_skip};

#[derive(Debug, Clone)]
pub enum Backend {
    Simulator {
        simulator: PathBuf,
        guest: PathBuf,
    },
    /// The simulator through testkit's jailer double (`--jailer-path`): chrooted, as a uid of
    /// its own, in a PID namespace of its own.
    JailedSimulator {
        simulator: PathBuf,
        guest: PathBuf,
        jailer: PathBuf,
    },
    Real {
        firecracker: PathBuf,
        kernel: PathBuf,
        rootfs: PathBuf,
    },
    /// imp-runtime's QEMU backend booting a real kernel + Imp's initrd (root filesystems come
    /// from images, so there is no base disk).
    Qemu {
        qemu: PathBuf,
        vhost: PathBuf,
        kernel: PathBuf,
        initrd: PathBuf,
        guest: PathBuf,
    },
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Simulator { .. } => "simulator",
            Backend::JailedSimulator { .. } => "simulator through the jailer",
            Backend::Real { .. } => "real Firecracker",
            Backend::Qemu { .. } => "QEMU",
        }
    }

    pub fn is_simulator(&self) -> bool {
        matches!(
            self,
            Backend::Simulator { .. } | Backend::JailedSimulator { .. }
        )
    }
}

pub fn simulator() -> Backend {
    let b = imp_testkit::firecracker::binaries();
    Backend::Simulator {
        simulator: b.simulator.clone(),
        guest: b.guest.clone(),
    }
}

/// testkit's jailer double, built when its sources are newer.
pub fn jailer_double() -> PathBuf {
    imp_testkit::bins::ensure_built(
        &[("imp-testkit", "jailer-double")],
        &["testkit/src", "testkit/Cargo.toml"],
    )
    .expect("building jailer-double")
    .remove(0)
}

/// The simulator through the jailer double.
pub fn jailed_simulator() -> Backend {
    let b = imp_testkit::firecracker::binaries();
    Backend::JailedSimulator {
        simulator: b.simulator.clone(),
        guest: b.guest.clone(),
        jailer: jailer_double(),
    }
}

/// The simulator, the simulator through the jailer double (root only: it switches uids and
/// makes device nodes; else a printed skip notice, or a failure under IMP_REQUIRE_ROOT=1), plus
/// real Firecracker when configured (else a printed skip notice, or a failure under
/// IMP_REQUIRE_FIRECRACKER=1).
pub fn backends(test: &str) -> Vec<Backend> {
    let mut out = vec![simulator()];
    if is_root() {
        out.push(jailed_simulator());
    } else {
        imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            &format!("{test} through the jailer"),
            "not root (the jailer switches uids, makes device nodes and namespaces)",
        );
    }
    if let Some(fc) = real_or_skip(test, Needs::BaseDrive) {
        out.push(Backend::Real {
            rootfs: fc.base_drive(),
            firecracker: fc.firecracker,
            kernel: fc.kernel,
        });
    }
    out
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

pub struct Harness {
    pub backend: Backend,
    pub dir: tempfile::TempDir,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub kernel: PathBuf,
    pub base_disk: PathBuf,
    behaviour: HashMap<String, Knobs>,
    pub boot_timeout_secs: f64,
    /// More environment for imp-runtime (e.g. rootfs cache settings).
    pub extra_env: Vec<(String, String)>,
    /// More host paths the jailer double binds into a jailed simulator's jail (what its guest,
    /// a host process there, sees; e.g. a directory a template warms).
    pub jail_binds: Vec<PathBuf>,
    /// Run imp-runtime (and so its VMMs, TAPs and bridges) inside this network namespace
    /// (`ip netns exec`, which also mounts that namespace's /sys); the test creates and removes it.
    pub netns: Option<String>,
    runtime: Option<Child>,
    pub client: RuntimeClient,
    starts: u32,
}

impl Harness {
    pub fn new(backend: Backend) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("imprt")
            .tempdir()
            .expect("tempdir");
        let state_dir = dir.path().join("state");
        let socket = dir.path().join("runtime.sock");
        let (kernel, base_disk) = match &backend {
            Backend::Simulator { .. } | Backend::JailedSimulator { .. } => {
                let k = dir.path().join("vmlinux");
                let d = dir.path().join("rootfs.ext4");
                std::fs::write(&k, b"simulated kernel").unwrap();
                std::fs::File::create(&d)
                    .unwrap()
                    .set_len(64 << 20)
                    .unwrap();
                (k, d)
            }
            Backend::Real { kernel, rootfs, .. } => (kernel.clone(), rootfs.clone()),
            Backend::Qemu { kernel, .. } => (kernel.clone(), PathBuf::new()),
        };
        let h = Self {
            client: RuntimeClient::new(&socket),
            backend,
            state_dir,
            socket,
            kernel,
            base_disk,
            behaviour: HashMap::new(),
            boot_timeout_secs: 20.0,
            extra_env: Vec::new(),
            jail_binds: Vec::new(),
            netns: None,
            runtime: None,
            dir,
            starts: 0,
        };
        h.write_behaviour();
        h
    }

    /// Simulator knobs for VM `uid` (read by the simulator when the VM's process starts).
    pub fn knobs(&mut self, uid: &str, knobs: Knobs) {
        self.behaviour.insert(uid.to_string(), knobs);
        self.write_behaviour();
    }

    fn write_behaviour(&self) {
        let path = self.dir.path().join("behaviour.json");
        std::fs::write(&path, serde_json::to_vec(&self.behaviour).unwrap()).unwrap();
    }

    pub fn spec(&self, network: bool) -> VmSpec {
        VmSpec {
            vcpu: 1,
            memory_mib: 128,
            base_disk: Some(self.base_disk.clone()),
            image: None,
            writable_disk_bytes: Some(256 << 20),
            kernel: None,
            initrd: None,
            extra_boot_args: None,
            network: network.then_some(NetworkSpec {
                guest_mac: None,
                attachment: None,
            }),
            from_template: false,
            warm_paths: Vec::new(),
        }
    }

    /// Start imp-runtime and wait until its socket answers /healthz.
    pub async fn start_runtime(&mut self) {
        assert!(self.runtime.is_none(), "runtime already running");
        self.starts += 1;
        let log =
            std::fs::File::create(self.dir.path().join(format!("runtime-{}.log", self.starts)))
                .unwrap();
        let bin = env!("CARGO_BIN_EXE_imp-runtime");
        let mut cmd = match &self.netns {
            // `ip netns exec` execs the runtime: the child's pid is the runtime's.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, bin]);
                c
            }
            None => Command::new(bin),
        };
        cmd.env("IMP_RUNTIME_SOCKET", &self.socket)
            .env("IMP_STATE_DIR", &self.state_dir)
            .env("IMP_KERNEL", &self.kernel)
            .env("IMP_METRICS_ADDR", "127.0.0.1:0")
            .env("IMP_BOOT_TIMEOUT", format!("{}s", self.boot_timeout_secs))
            .env("IMP_STOP_TIMEOUT", "2s")
            .env("IMP_SIM_BEHAVIOUR", self.dir.path().join("behaviour.json"))
            .env("IMP_LOG", "info")
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        match &self.backend {
            // Unjailed on purpose (the jailed variant is JailedSimulator); the runtime refuses
            // Firecracker without a jailer unless told.
            Backend::Simulator { simulator, guest } => {
                cmd.env("IMP_FIRECRACKER_BIN", simulator)
                    .env("IMP_GUEST_BIN", guest)
                    .env("IMP_UNJAILED_FIRECRACKER", "1");
            }
            Backend::JailedSimulator {
                simulator,
                guest,
                jailer,
            } => {
                // The double's deviation for the simulator (testkit/src/bin/jailer-double.rs):
                // the host libraries, imp-guest and the knob file, read-only in the jail.
                let bind = ["/usr", "/bin", "/sbin", "/lib", "/lib64"]
                    .iter()
                    .map(PathBuf::from)
                    .filter(|p| p.exists())
                    .chain([guest.clone(), self.dir.path().join("behaviour.json")])
                    .chain(self.jail_binds.iter().cloned())
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(",");
                cmd.env("IMP_FIRECRACKER_BIN", simulator)
                    .env("IMP_GUEST_BIN", guest)
                    .env("IMP_JAILER_PATH", jailer)
                    .env("IMP_JAILER_DOUBLE_BIND", bind)
                    .env(
                        "IMP_JAILER_DOUBLE_KEEP_ENV",
                        "IMP_GUEST_BIN,IMP_SIM_BEHAVIOUR",
                    );
            }
            Backend::Real { firecracker, .. } => {
                cmd.env("IMP_FIRECRACKER_BIN", firecracker)
                    .env("IMP_UNJAILED_FIRECRACKER", "1");
            }
            Backend::Qemu {
                qemu,
                vhost,
                initrd,
                guest,
                ..
            } => {
                cmd.env("IMP_VMM_BACKEND", "qemu")
                    .env("IMP_QEMU_BIN", qemu)
                    .env("IMP_VHOST_VSOCK_BIN", vhost)
                    .env("IMP_INITRD", initrd)
                    .env("IMP_GUEST_BIN", guest);
            }
        }
        self.runtime = Some(cmd.spawn().expect("spawn imp-runtime"));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok((s, _)) = self
                .client
                .request(http::Method::GET, "/healthz", None)
                .await
                && s.is_success()
            {
                return;
            }
            if let Some(status) = self.runtime.as_mut().unwrap().try_wait().unwrap() {
                panic!("imp-runtime exited with {status}: {}", self.runtime_log());
            }
            assert!(
                Instant::now() < deadline,
                "imp-runtime did not become healthy: {}",
                self.runtime_log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// imp-runtime's QEMU backend (`IMP_QEMU_ACCEL`, default TCG: slow boots, so a long boot
    /// timeout) with images from the (insecure, local) registry at `registry`.
    pub fn qemu(s: &imp_testkit::qemu::Setup, initrd: &Path, registry: String) -> Self {
        let mut h = Harness::new(Backend::Qemu {
            qemu: s.qemu.clone(),
            vhost: s.vhost.clone(),
            kernel: s.kernel.clone(),
            initrd: initrd.to_owned(),
            guest: s.guest_bin.clone(),
        });
        h.boot_timeout_secs = 240.0;
        h.extra_env.extend([
            ("IMP_INSECURE_REGISTRIES".to_string(), registry.clone()),
            ("IMP_NODE_LOCAL_REGISTRIES".to_string(), registry),
            (
                "IMP_QEMU_ACCEL".to_string(),
                std::env::var("IMP_QEMU_ACCEL").unwrap_or_else(|_| "tcg".into()),
            ),
        ]);
        h
    }

    pub fn runtime_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("runtime-{}.log", self.starts)))
            .unwrap_or_default()
    }

    pub fn runtime_pid(&self) -> Option<u32> {
        self.runtime.as_ref().map(|c| c.id())
    }

    /// `kill -<signal>` the runtime ("TERM", "INT") and wait (up to 20 s) for it to exit.
    pub fn signal_runtime(&mut self, signal: &str) -> std::process::ExitStatus {
        let mut child = self.runtime.take().expect("runtime running");
        imp_testkit::binlog::send_signal(child.id(), signal);
        imp_testkit::binlog::wait_exit(&mut child, Duration::from_secs(20))
    }

    /// kill -9 the runtime (VMs must survive it).
    pub fn kill9_runtime(&mut self) {
        let mut child = self.runtime.take().expect("runtime running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    pub fn vms_dir(&self) -> PathBuf {
        self.state_dir.join("vms")
    }

    /// VMM processes (Firecracker, simulator, QEMU, vhost-device-vsock) of this harness's
    /// state dir.
    pub fn vmm_processes(&self) -> Vec<(i32, u64, PathBuf)> {
        let mut found = imp_runtime::procfs::firecrackers_under(&self.vms_dir());
        // Jailed Firecrackers (runtime default `<state>/jailer/<exec name>`).
        if let Ok(d) = std::fs::read_dir(self.state_dir.join("jailer")) {
            for e in d.flatten() {
                found.extend(imp_runtime::procfs::jailed_vmms(&e.path()));
            }
        }
        found
    }

    pub async fn metrics(&self) -> String {
        let (_, body) = self
            .client
            .request(http::Method::GET, "/metrics", None)
            .await
            .unwrap();
        String::from_utf8(body.to_vec()).unwrap()
    }

    pub fn tap_for(&self, uid: &str) -> String {
        imp_runtime::tap::tap_name(&self.state_dir, uid)
    }
}

/// The imp-agent binary of this profile, built when its sources are newer. The agent is its own
/// crate (it never links imp-runtime), so these tests, which drive both processes, build it.
pub fn agent_bin() -> std::path::PathBuf {
    imp_testkit::bins::ensure_built(
        &[("imp-agent", "imp-agent")],
        &[
            "node/agent",
            "node/runtime-api",
            "api/src",
            "common/src",
            "guest/src",
        ],
    )
    .expect("building imp-agent")
    .remove(0)
}

/// imp-agent for `node` against `env`'s API server and `rt`'s runtime socket, 1 s heartbeats, stdin
/// closed; the caller adds its own settings and output, then spawns it.
pub fn agent_command(env: &imp_testkit::TestEnv, rt: &Harness, node: &str) -> Command {
    let mut cmd = Command::new(agent_bin());
    cmd.env("KUBECONFIG", env.kubeconfig_path())
        .env("IMP_NODE_NAME", node)
        .env("IMP_NAMESPACE", &env.namespace)
        .env("IMP_RUNTIME_SOCKET", &rt.socket)
        .env("IMP_HEARTBEAT_INTERVAL", "1s")
        .stdin(Stdio::null());
    cmd
}

/// Whether the process `pid` with start time `start` runs.
pub fn alive(pid: i32, start: u64) -> bool {
    imp_runtime::procfs::is_alive(pid, start)
}

pub async fn wait_until<F: FnMut() -> bool>(what: &str, timeout: Duration, mut f: F) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Drop for Harness {
    /// Leave nothing behind even when a test fails: runtime, VMM processes (they are in their
    /// own sessions, so nothing else would stop them), TAPs.
    fn drop(&mut self) {
        if let Some(mut c) = self.runtime.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for (pid, _, _) in self.vmm_processes() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        if let Ok(entries) = std::fs::read_dir(self.vms_dir()) {
            for e in entries.flatten() {
                if let Some(uid) = e.file_name().to_str() {
                    let _ = imp_runtime::tap::delete(&self.tap_for(uid));
                }
            }
        }
    }
}

pub fn exists(p: &Path) -> bool {
    p.exists()
}

/// An Exec of `argv` with id `id`: no environment, no timeout, output not streamed.
pub fn exec(id: &str, argv: &[&str]) -> imp_guest::protocol::Exec {
    imp_guest::protocol::Exec {
        id: id.into(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: Default::default(),
        cwd: None,
        uid: None,
        gid: None,
        refuse_root: false,
        timeout_s: None,
        stream_output: false,
        poweroff_on_exit: false,
    }
}

/// `ip ARGS`, which must succeed.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A node namespace with an uplink to an "internet" namespace (node `up0` 192.0.2.2/24, default
/// route via `wan0` 192.0.2.1), both created by the test and deleted on drop: where a runtime
/// with networked VMs runs (`Harness::netns`). Drop it after the harness (declare it first).
pub struct TestNetwork {
    pub node: String,
    pub inet: String,
}

impl TestNetwork {
    pub fn new(prefix: &str) -> Self {
        let id = std::process::id();
        let net = TestNetwork {
            node: format!("{prefix}-node-{id}"),
            inet: format!("{prefix}-inet-{id}"),
        };
        for ns in [&net.node, &net.inet] {
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        let (node, inet) = (net.node.as_str(), net.inet.as_str());
        ip(&[
            "-n", node, "link", "add", "up0", "type", "veth", "peer", "name", "wan0", "netns", inet,
        ]);
        ip(&["-n", node, "addr", "add", "192.0.2.2/24", "dev", "up0"]);
        ip(&["-n", node, "link", "set", "up0", "up"]);
        ip(&["-n", node, "route", "add", "default", "via", "192.0.2.1"]);
        ip(&["-n", inet, "addr", "add", "192.0.2.1/24", "dev", "wan0"]);
        ip(&["-n", inet, "link", "set", "wan0", "up"]);
        net
    }

    /// Run `f` on a thread inside the node namespace (its sockets and child processes live
    /// there); `f` may drive async code on its own runtime.
    pub fn in_node<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_netns(&self.node, f)
    }
}

impl TestNetwork {
    /// A local registry started inside the node namespace (the runtime pulls from its loopback
    /// there) holding `layers` as `repo_tag`: the registry and the image's reference.
    pub fn registry_in_node(
        &self,
        repo_tag: &str,
        layers: Vec<Vec<u8>>,
    ) -> (imp_testkit::registry::Registry, String) {
        use imp_testkit::registry::{Registry, RegistryOptions};
        self.in_node(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let r = Registry::start(RegistryOptions::default()).await.unwrap();
                    let base = imp_testkit::oci::push_gzip_image(&r.host(), repo_tag, layers).await;
                    (r, base)
                })
        })
    }
}

/// Background processes in network namespaces (a test's "internet" servers), killed on drop.
#[derive(Default)]
pub struct Children(pub Vec<Child>);

impl Children {
    /// `argv` inside namespace `ns`.
    pub fn spawn(&mut self, ns: &str, argv: &[&str]) {
        let child = Command::new("ip")
            .args(["netns", "exec", ns])
            .args(argv)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.0.push(child);
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `cgi-bin/peer` under the web root `www` for busybox httpd: answers `peer=<the client address
/// it sees>`.
pub fn peer_cgi(www: &Path) {
    std::fs::create_dir_all(www.join("cgi-bin")).unwrap();
    let peer = www.join("cgi-bin/peer");
    std::fs::write(
        &peer,
        "#!/bin/sh\nprintf 'Content-Type: text/plain\\r\\n\\r\\npeer=%s' \"$REMOTE_ADDR\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&peer, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// `sh -c script` in the guest to completion with `env`: exit code and output.
pub async fn sh(
    c: &mut imp_guest::host::HostClient,
    id: &str,
    script: &str,
    env: &[(&str, &str)],
) -> (Option<i32>, String) {
    let mut vars = std::collections::BTreeMap::from([(
        "PATH".to_owned(),
        imp_common::SecretString::from("/bin"),
    )]);
    for (k, v) in env {
        vars.insert((*k).to_owned(), imp_common::SecretString::from(*v));
    }
    c.exec(imp_guest::protocol::Exec {
        id: id.into(),
        argv: ["/bin/sh", "-c", script].map(String::from).to_vec(),
        env: vars,
        cwd: None,
        uid: None,
        gid: None,
        refuse_root: false,
        timeout_s: Some(120),
        stream_output: true,
        poweroff_on_exit: false,
    })
    .await
    .unwrap();
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(180), c.recv())
            .await
            .unwrap_or_else(|_| panic!("{script}: no Exited"))
            .unwrap();
        match msg {
            imp_guest::protocol::GuestToHost::Output(o) if o.id == id => {
                use base64::Engine as _;
                let data = base64::engine::general_purpose::STANDARD
                    .decode(&o.data_b64)
                    .unwrap();
                if matches!(
                    o.stream,
                    imp_guest::protocol::OutputStream::Stdout
                        | imp_guest::protocol::OutputStream::Stderr
                ) {
                    out.extend(data);
                }
            }
            imp_guest::protocol::GuestToHost::Exited(e) if e.id == id => {
                return (e.code, String::from_utf8_lossy(&out).into_owned());
            }
            _ => {}
        }
    }
}

/// A one-vCPU VM of the image `base` (no base disk), `memory_mib` of memory and a writable disk of
/// `disk_bytes`, with a NIC (no attachment) when `network`; guests report for up to 60 s.
pub fn image_vm(base: String, memory_mib: u64, disk_bytes: u64, network: bool) -> VmSpec {
    VmSpec {
        vcpu: 1,
        memory_mib,
        base_disk: None,
        image: Some(imp_runtime::rootfs::store::ImageSpec {
            base,
            runner: None,
            credentials: None,
            pull_policy: None,
        }),
        writable_disk_bytes: Some(disk_bytes),
        kernel: None,
        initrd: None,
        extra_boot_args: Some("imp.report_grace_s=60".into()),
        network: network.then_some(NetworkSpec {
            guest_mac: None,
            attachment: None,
        }),
        from_template: false,
        warm_paths: Vec::new(),
    }
}

/// An attachment to the ImpNetwork "ci/runners" (`network_id`) at `address` (CIDR) behind
/// `gateway`, with NAT and the "internet"'s DNS server 192.0.2.1.
pub fn nat_attachment(
    network_id: &str,
    address: &str,
    gateway: &str,
) -> imp_runtime::api::NetworkAttachment {
    imp_runtime::api::NetworkAttachment {
        network_id: network_id.into(),
        network_name: "ci/runners".into(),
        address: address.parse().unwrap(),
        gateway: gateway.parse().unwrap(),
        dns: vec!["192.0.2.1".parse().unwrap()],
        mtu: None,
        nat: true,
        egress_interface: None,
        egress_allow: vec![],
        egress_deny: vec![],
        ingress: vec![],
    }
}

/// A TCP forwarder listening inside a network namespace, to a target in the test's own.
pub struct Forwarder {
    /// `host:port` it listens on, inside its namespace.
    pub addr: String,
    /// Connections it accepted so far.
    pub connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// A forwarder listening on `bind` (`addr:0` for a free port) inside `ns` to `target` in the
/// test's own namespace: the listener is made on a thread inside `ns`, the outgoing connections
/// here. Its threads end with the test process.
pub fn forward(ns: &str, bind: &str, target: &str) -> Forwarder {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = in_netns(ns, || std::net::TcpListener::bind(bind).unwrap());
    let addr = listener.local_addr().unwrap().to_string();
    let connections = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    let target = target.to_owned();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(inside) = conn else { return };
            counted.fetch_add(1, Ordering::SeqCst);
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
    Forwarder { addr, connections }
}

/// Runs `f` on a thread inside network namespace `ns` (sockets made there belong to it).
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let fd = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
            nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            f()
        })
        .join()
        .unwrap()
    })
}

impl TestNetwork {
    /// `network::reconcile(desired)` run inside the node namespace.
    pub fn reconcile(
        &self,
        desired: &[imp_runtime::network::Attachment],
    ) -> imp_runtime::network::Reconciled {
        self.reconcile_admitting(desired, &Default::default())
    }

    /// As a runtime started with the platform's network flags (`admission`) reconciles.
    pub fn reconcile_admitting(
        &self,
        desired: &[imp_runtime::network::Attachment],
        admission: &imp_runtime::network::Admission,
    ) -> imp_runtime::network::Reconciled {
        self.in_node(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(imp_runtime::network::reconcile(desired, admission))
                .unwrap()
        })
    }
}

impl Drop for TestNetwork {
    fn drop(&mut self) {
        for ns in [&self.inet, &self.node] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Whether root-only network tests can run here; without root or `nft` they print why and
/// return false, or fail under IMP_REQUIRE_ROOT=1.
pub fn network_tests_can_run() -> bool {
    let nft = Command::new("sh")
        .args(["-c", "command -v nft"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if is_root() && nft {
        return true;
    }
    let why = "needs root and nft (nftables)";
    imp_testkit::skip::skip_or_fail("IMP_REQUIRE_ROOT", "this test's network part", why);
    false
}

/// `cmd args`, which must succeed: its stdout.
pub fn output(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// dnsmasq as the "internet"'s DNS server: in the foreground, on `listen` only, answering
/// nothing but `name` -> `address` (no upstream, no hosts file, no config).
pub fn dnsmasq_argv(listen: &str, name: &str, address: &str) -> Vec<String> {
    [
        "dnsmasq",
        "--keep-in-foreground",
        "--no-resolv",
        "--no-hosts",
        "--conf-file=/dev/null",
        "--pid-file",
        "--bind-interfaces",
        &format!("--listen-address={listen}"),
        &format!("--address=/{name}/{address}"),
        "--user=root",
    ]
    .map(String::from)
    .to_vec()
}

/// An image layer with Debian's static busybox as /bin/sh and a root user; callers add theirs.
pub fn busybox_layer() -> imp_testkit::tarball::TarBuilder {
    let busybox = std::fs::read("/bin/busybox").unwrap();
    imp_testkit::tarball::TarBuilder::new()
        .dir("bin", 0o755)
        .file("bin/busybox", &busybox, 0o755)
        .symlink("bin/sh", "busybox")
        .dir("etc", 0o755)
        .file("etc/passwd", b"root:x:0:0::/:/bin/sh\n", 0o644)
}
