//! A real Kubernetes node for tests: Debian's containerd and runc, the kubelet from testenv/, the CNI
//! bridge plugin from Debian's containernetworking-plugins, all inside a network namespace the test
//! creates (addresses from TEST-NET only, no route out). See docs/real-node.md for why each setting is
//! what it is (cgroup v1, no CAP_SYS_RESOURCE, no registry.k8s.io).
//!
//! Usage: [`NodeNetns::create`], then [`NodeNetns::enter`] on the test's own thread *before* the tokio
//! runtime, the control plane or any testkit process exists: threads and children inherit the namespace
//! of the thread that creates them, so everything the test starts (etcd, kube-apiserver, the registry,
//! containerd, the kubelet, helm) and every connection it makes lives in the namespace. Then
//! [`crate::controlplane::ControlPlane::start`] with [`node_control_plane`] options and [`RealNode::start`].
//!
//! Teardown (drop, also on failure): the kubelet stops, every process in the node's cgroup root is killed,
//! containerd and its shims stop, every mount under the node's directory (container rootfs, pod volumes,
//! pod network namespaces) is detached, the cgroups are removed, and last the network namespace with
//! every process still in it.

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use sha2::{Digest, Sha256};

use crate::{
    controlplane::{ControlPlane, ControlPlaneOptions, PodAccess},
    process::ManagedProcess,
};

/// The node's IP (a veth end inside the namespace; the kubelet refuses a loopback node IP).
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
/// Pods' addresses (CNI bridge + host-local).
pub const POD_CIDR: &str = "198.51.100.0/24";
/// Services' ClusterIPs; the first one is the `kubernetes` Service, an address of the namespace. The
/// upper half of TEST-NET-3 is left for tests' VM networks.
pub const SERVICE_CIDR: &str = "203.0.113.0/25";
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// Where Debian's containernetworking-plugins installs the plugins.
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// What can go wrong bringing up the node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{what} is missing: {hint}")]
    Missing { what: String, hint: String },
    #[error("`{command}` failed: {detail}")]
    Command { command: String, detail: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("{name} exited during start-up ({status}); last log lines:\n{log_tail}")]
    Exited {
        name: String,
        status: String,
        log_tail: String,
    },
    #[error("{what} not ready after {after:?}; last kubelet log lines:\n{log_tail}")]
    NotReady {
        what: String,
        after: Duration,
        log_tail: String,
    },
    #[error("kube API: {0}")]
    Kube(#[from] kube::Error),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
    let context = context.into();
    move |source| NodeError::Io { context, source }
}

/// Runs a command to completion; its stderr names the failure.
pub fn run(cmd: &mut Command) -> Result<String, NodeError> {
    let command = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| NodeError::Command {
        command: command.clone(),
        detail: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(NodeError::Command {
            command,
            detail: format!(
                "{}: {}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What the host lacks for a real node (empty: it can run one). Each entry names its Debian package.
pub fn missing_prerequisites(bin_dir: &Path) -> Vec<String> {
    let mut missing = Vec::new();
    for (tool, package) in [
        ("containerd", "containerd"),
        ("containerd-shim-runc-v2", "containerd"),
        ("ctr", "containerd"),
        ("runc", "runc"),
        ("ip", "iproute2"),
    ] {
        if !on_path(tool) {
            missing.push(format!("{tool} (Debian package {package})"));
        }
    }
    for plugin in ["bridge", "host-local", "loopback"] {
        if !Path::new(CNI_BIN_DIR).join(plugin).is_file() {
            missing.push(format!(
                "{CNI_BIN_DIR}/{plugin} (Debian package containernetworking-plugins)"
            ));
        }
    }
    for bin in ["kubelet", "kube-scheduler"] {
        if !bin_dir.join(bin).is_file() {
            missing.push(format!("{} (make testenv)", bin_dir.join(bin).display()));
        }
    }
    missing
}

fn on_path(tool: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .any(|dir| dir.join(tool).is_file())
}

/// The network namespace of one node: `lo`, and a veth pair whose end `imp-node0` carries [`NODE_IP`]
/// and the `kubernetes` Service address. No default route: nothing leaves it.
pub struct NodeNetns {
    name: String,
}

impl NodeNetns {
    pub fn create(name: &str) -> Result<Self, NodeError> {
        run(Command::new("ip").args(["netns", "add", name]))?;
        let ns = Self {
            name: name.to_owned(),
        };
        let ip = |args: &[&str]| run(Command::new("ip").args(["-n", name]).args(args));
        ip(&["link", "set", "lo", "up"])?;
        ip(&[
            "link",
            "add",
            "imp-node0",
            "type",
            "veth",
            "peer",
            "name",
            "imp-node1",
        ])?;
        ip(&["addr", "add", &format!("{NODE_IP}/24"), "dev", "imp-node0"])?;
        ip(&[
            "addr",
            "add",
            &format!("{KUBERNETES_SERVICE_IP}/32"),
            "dev",
            "imp-node0",
        ])?;
        ip(&["link", "set", "imp-node0", "up"])?;
        ip(&["link", "set", "imp-node1", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/var/run/netns/<name>`.
    pub fn path(&self) -> PathBuf {
        netns_path(&self.name)
    }

    /// Moves the calling thread into the namespace until the guard drops. (`nsenter --net`, not `ip netns
    /// exec`, is the shell equivalent: the latter remounts /sys and hides the cgroup mounts.)
    pub fn enter(&self) -> Result<EnteredNetns, NodeError> {
        enter(&self.path())
    }

    /// The namespace's inode, as `/proc/<pid>/ns/net` links name it (`net:[<inode>]`).
    fn link_name(&self) -> Option<String> {
        use std::os::unix::fs::MetadataExt as _;
        let ino = std::fs::metadata(self.path()).ok()?.ino();
        Some(format!("net:[{ino}]"))
    }
}

/// Where `ip netns` keeps namespace `name`.
fn netns_path(name: &str) -> PathBuf {
    Path::new("/var/run/netns").join(name)
}

fn enter(netns: &Path) -> Result<EnteredNetns, NodeError> {
    let original = std::fs::File::open("/proc/thread-self/ns/net")
        .map_err(io_err("open this thread's network namespace"))?;
    let target = std::fs::File::open(netns).map_err(io_err(format!("open {}", netns.display())))?;
    setns(&target)?;
    Ok(EnteredNetns { original })
}

fn setns(file: &std::fs::File) -> Result<(), NodeError> {
    // SAFETY: setns on a namespace fd we hold open; it only affects the calling thread.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(NodeError::Io {
            context: "setns(CLONE_NEWNET)".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// The calling thread's stay in a [`NodeNetns`]; dropping it returns the thread to where it was.
pub struct EnteredNetns {
    original: std::fs::File,
}

/// What lies beyond the node's uplink: a namespace holding the other end of the node's veth
/// (`imp-node1`, [`UPLINK_PEER_IP`]) with its default route back through the node. A server bound here
/// is reached from the node by its connected route and from a guest only through the node's NAT, as a
/// guest reaches anything off the node (a guest reaches no address of the node itself).
pub struct UplinkPeer {
    name: String,
}

/// The address of [`UplinkPeer`]'s end of the node's uplink.
pub const UPLINK_PEER_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

impl NodeNetns {
    /// Moves `imp-node1` into a new namespace `name` (see [`UplinkPeer`]).
    pub fn uplink_peer(&self, name: &str) -> Result<UplinkPeer, NodeError> {
        run(Command::new("ip").args(["netns", "add", name]))?;
        let peer = UplinkPeer {
            name: name.to_owned(),
        };
        run(Command::new("ip").args([
            "-n",
            &self.name,
            "link",
            "set",
            "imp-node1",
            "netns",
            name,
        ]))?;
        let ip = |args: &[&str]| run(Command::new("ip").args(["-n", name]).args(args));
        ip(&["link", "set", "lo", "up"])?;
        ip(&[
            "addr",
            "add",
            &format!("{UPLINK_PEER_IP}/24"),
            "dev",
            "imp-node1",
        ])?;
        ip(&["link", "set", "imp-node1", "up"])?;
        ip(&["route", "add", "default", "via", &NODE_IP.to_string()])?;
        Ok(peer)
    }
}

impl UplinkPeer {
    /// Moves the calling thread into the namespace until the guard drops: sockets created meanwhile
    /// (a listener) stay in it.
    pub fn enter(&self) -> Result<EnteredNetns, NodeError> {
        enter(&netns_path(&self.name))
    }
}

impl Drop for UplinkPeer {
    fn drop(&mut self) {
        // Deleting the namespace destroys the veth pair, the node's end too.
        let _ = run(Command::new("ip").args(["netns", "del", &self.name]));
    }
}

impl Drop for EnteredNetns {
    fn drop(&mut self) {
        let _ = setns(&self.original);
    }
}

impl Drop for NodeNetns {
    fn drop(&mut self) {
        // Whatever still runs in the namespace was started by this test (it created the namespace).
        if let Some(link) = self.link_name() {
            kill_where(|pid| {
                std::fs::read_link(format!("/proc/{pid}/ns/net"))
                    .is_ok_and(|l| l.to_string_lossy() == link)
            });
        }
        let _ = run(Command::new("ip").args(["netns", "del", &self.name]));
    }
}

/// SIGKILLs every process (never this one) for which `pick(pid)` holds, and waits until they are gone.
pub(crate) fn kill_where(pick: impl Fn(i32) -> bool) {
    let me = std::process::id() as i32;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pids: Vec<i32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .filter(|&pid| pid != me && pick(pid))
            .filter(|&pid| !is_zombie(pid))
            .collect();
        if pids.is_empty() || Instant::now() > deadline {
            return;
        }
        for pid in pids {
            // SAFETY: a pid the caller identified as started by this test.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// Control-plane options for a real node: the API server reachable by pods, kube-scheduler, and the
/// controllers the chart's workloads need (Deployments, DaemonSets, ServiceAccounts, the root CA
/// ConfigMap projected service-account tokens mount, and node lifecycle: it lifts the kubelet's
/// `node.kubernetes.io/not-ready` NoSchedule taint once the node is Ready, which DaemonSet pods do not
/// tolerate).
pub fn node_control_plane(dir: PathBuf) -> ControlPlaneOptions {
    ControlPlaneOptions {
        dir,
        scheduler: true,
        controllers: [
            "garbage-collector-controller",
            "namespace-controller",
            "deployment-controller",
            "replicaset-controller",
            "daemonset-controller",
            "node-lifecycle-controller",
            "serviceaccount-controller",
            "root-ca-certificate-publisher-controller",
        ]
        .map(str::to_owned)
        .to_vec(),
        pod_access: Some(PodAccess {
            advertise_address: NODE_IP,
            service_cidr: SERVICE_CIDR.to_owned(),
            service_ip: KUBERNETES_SERVICE_IP,
        }),
        ..ControlPlaneOptions::in_temp_dir()
    }
}

/// Options for [`RealNode::start`].
#[derive(Clone, Debug)]
pub struct RealNodeOptions {
    /// Work directory (containerd root and state, kubelet root, CNI config, logs). Created.
    pub dir: PathBuf,
    pub node_name: String,
    /// Labels the kubelet registers the node with.
    pub labels: Vec<(String, String)>,
    /// The pod sandbox ("pause") image, pullable from `plain_http_registries` (there is no
    /// registry.k8s.io here): see [`pause_image_layer`].
    pub sandbox_image: String,
    /// `host:port` of registries containerd pulls from over plain HTTP.
    pub plain_http_registries: Vec<String>,
    /// Where kubelet is (default: testenv/bin).
    pub bin_dir: PathBuf,
}

/// A running node. Dropping it stops everything it started and removes its state (module docs).
pub struct RealNode {
    dir: PathBuf,
    name: String,
    containerd_socket: PathBuf,
    /// `/<name>` under every cgroup hierarchy: the kubelet's cgroup root, so every pod is below it.
    cgroup_root: String,
    // Stopped in reverse start order by Drop (kubelet first).
    processes: Vec<ManagedProcess>,
    /// When the node started: Debian's containerd 1.6 puts its pods' network namespaces in
    /// /var/run/netns (`cni-<uuid>`) whatever `netns_mounts_under` says, and leaves those of pods
    /// still running when it is killed; Drop removes the ones made since.
    started: std::time::SystemTime,
}

const READY_TIMEOUT: Duration = Duration::from_secs(120);

impl RealNode {
    /// Starts containerd and the kubelet against `cp`; returns once the node is Ready.
    pub async fn start(cp: &ControlPlane, opts: RealNodeOptions) -> Result<Self, NodeError> {
        let dir = opts.dir.clone();
        std::fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
        let cgroup_root = format!("/{}", opts.node_name);
        let mut node = RealNode {
            dir: dir.clone(),
            name: opts.node_name.clone(),
            containerd_socket: dir.join("containerd/containerd.sock"),
            cgroup_root: cgroup_root.clone(),
            processes: Vec::new(),
            started: std::time::SystemTime::now(),
        };
        // The kubelet refuses a cgroup root that does not exist in every hierarchy.
        for hierarchy in cgroup_hierarchies() {
            let path = hierarchy.join(&opts.node_name);
            std::fs::create_dir_all(&path)
                .map_err(io_err(format!("create cgroup {}", path.display())))?;
        }

        let cni_dir = dir.join("cni/net.d");
        std::fs::create_dir_all(&cni_dir).map_err(io_err("create the CNI config dir"))?;
        write(
            &cni_dir.join("10-imp-node.conflist"),
            &cni_conflist(&dir.join("cni/ipam")),
        )?;
        std::fs::create_dir_all(dir.join("netns")).map_err(io_err("create the netns dir"))?;
        let containerd_config = write(
            &dir.join("containerd.toml"),
            &containerd_config(&dir, &opts.sandbox_image, &opts.plain_http_registries),
        )?;
        let mut containerd = Command::new("containerd");
        containerd.arg("--config").arg(&containerd_config);
        node.spawn("containerd", containerd)?;
        node.wait_for("containerd", |n| n.containerd_socket.exists())
            .await?;

        let [port, healthz_port] =
            crate::controlplane::free_ports::<2>().map_err(io_err("choose the kubelet's ports"))?;
        let kubelet_config = write(
            &dir.join("kubelet.yaml"),
            &kubelet_config(
                &dir,
                &node.containerd_socket,
                &cgroup_root,
                port,
                healthz_port,
            ),
        )?;
        let labels = opts
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut kubelet = Command::new(opts.bin_dir.join("kubelet"));
        kubelet
            .arg(format!("--config={}", kubelet_config.display()))
            .arg(format!("--kubeconfig={}", cp.kubeconfig_path().display()))
            .arg(format!("--root-dir={}", dir.join("kubelet").display()))
            .arg(format!("--cert-dir={}", dir.join("kubelet/pki").display()))
            .arg(format!("--hostname-override={}", opts.node_name))
            .arg(format!("--node-ip={NODE_IP}"))
            .arg(format!("--node-labels={labels}"))
            .arg("--v=1");
        node.spawn("kubelet", kubelet)?;

        let client = cp.client().await.map_err(|e| NodeError::Io {
            context: "client for the node's control plane".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let nodes: Api<Node> = Api::all(client);
        let start = Instant::now();
        loop {
            node.check_alive()?;
            if let Some(n) = nodes.get_opt(&opts.node_name).await?
                && node_ready(&n)
            {
                return Ok(node);
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(NodeError::NotReady {
                    what: format!("node {}", opts.node_name),
                    after: READY_TIMEOUT,
                    log_tail: node.log_tail("kubelet", 30),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `unix://...` of containerd's CRI socket.
    pub fn containerd_socket(&self) -> &Path {
        &self.containerd_socket
    }

    /// `ctr -n k8s.io <args>` against this node's containerd.
    pub fn ctr(&self, args: &[&str]) -> Result<String, NodeError> {
        run(Command::new("ctr")
            .arg("--address")
            .arg(&self.containerd_socket)
            .args(["-n", "k8s.io"])
            .args(args))
    }

    /// The last lines of a component's log (containerd, kubelet).
    pub fn log_tail(&self, name: &str, lines: usize) -> String {
        crate::process::log_tail(&self.dir.join(format!("{name}.log")), lines)
    }

    /// The processes in the node's cgroup root (pods' containers), from every hierarchy.
    pub fn pod_pids(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = cgroup_hierarchies()
            .into_iter()
            .flat_map(|h| cgroup_pids(&h.join(self.cgroup_root.trim_start_matches('/'))))
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    fn spawn(&mut self, name: &str, cmd: Command) -> Result<(), NodeError> {
        let log = self.dir.join(format!("{name}.log"));
        let process = ManagedProcess::spawn(name, cmd, &log).map_err(|source| NodeError::Io {
            context: format!("start {name}"),
            source,
        })?;
        self.processes.push(process);
        Ok(())
    }

    fn check_alive(&mut self) -> Result<(), NodeError> {
        for p in &mut self.processes {
            if let Ok(Some(status)) = p.try_exit_status() {
                return Err(NodeError::Exited {
                    name: p.name.clone(),
                    status: status.to_string(),
                    log_tail: p.log_tail(30),
                });
            }
        }
        Ok(())
    }

    async fn wait_for(&mut self, what: &str, ok: impl Fn(&Self) -> bool) -> Result<(), NodeError> {
        let start = Instant::now();
        while !ok(self) {
            self.check_alive()?;
            if start.elapsed() > READY_TIMEOUT {
                return Err(NodeError::NotReady {
                    what: what.to_owned(),
                    after: READY_TIMEOUT,
                    log_tail: self.log_tail(what, 30),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// containerd's shims for this node (by the `-address` they were started with).
    fn shim_pids(&self) -> Vec<(i32, Vec<String>)> {
        let address = self.containerd_socket.to_string_lossy().into_owned();
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter_map(|pid| {
                let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                let args: Vec<String> = raw
                    .split(|b| *b == 0)
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                let is_shim = args.first()?.ends_with("containerd-shim-runc-v2");
                let ours = args
                    .windows(2)
                    .any(|w| w[0] == "-address" && w[1] == address);
                (is_shim && ours).then_some((pid, args))
            })
            .collect()
    }
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

impl Drop for RealNode {
    fn drop(&mut self) {
        // The kubelet first: it would restart what is killed below.
        if let Some(pos) = self.processes.iter().position(|p| p.name == "kubelet") {
            self.processes.remove(pos).stop(Duration::from_secs(10));
        }
        let pods: Vec<i32> = self.pod_pids();
        kill_where(|pid| pods.contains(&pid));
        let shims = self.shim_pids();
        while let Some(mut p) = self.processes.pop() {
            p.stop(Duration::from_secs(10));
        }
        let shim_pids: Vec<i32> = shims.iter().map(|(pid, _)| *pid).collect();
        kill_where(|pid| shim_pids.contains(&pid));
        // A killed shim leaves its socket: /run/containerd/s/<sha256(address/namespace/id)>.
        for (_, args) in &shims {
            let arg = |name: &str| args.windows(2).find(|w| w[0] == name).map(|w| w[1].clone());
            if let (Some(ns), Some(id), Some(address)) =
                (arg("-namespace"), arg("-id"), arg("-address"))
            {
                let hash = Sha256::digest(format!("{address}/{ns}/{id}").as_bytes());
                let _ = std::fs::remove_file(format!("/run/containerd/s/{}", hex::encode(hash)));
            }
        }
        unmount_under(&self.dir);
        for e in std::fs::read_dir("/var/run/netns")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let made = e.metadata().and_then(|m| m.modified());
            if name.starts_with("cni-") && made.is_ok_and(|t| t >= self.started) {
                let _ = run(Command::new("ip").args(["netns", "del", &name]));
            }
        }
        remove_cgroup_everywhere(self.cgroup_root.trim_start_matches('/'));
        // The kubelet links each container's log into /var/log/containers (a fixed path).
        let pod_logs = self.dir.join("pod-logs");
        if let Ok(entries) = std::fs::read_dir("/var/log/containers") {
            for e in entries.flatten() {
                if std::fs::read_link(e.path()).is_ok_and(|t| t.starts_with(&pod_logs)) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Each cgroup hierarchy mounted under /sys/fs/cgroup (v1 controllers, the named systemd one, the
/// unified one in hybrid mode), symlinked aliases such as `cpu` -> `cpu,cpuacct` once.
pub fn cgroup_hierarchies() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs.dedup();
    if dirs.is_empty() || Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        // cgroup v2 only: one hierarchy at the top.
        return vec![PathBuf::from("/sys/fs/cgroup")];
    }
    dirs
}

fn cgroup_pids(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            pids.extend(cgroup_pids(&e.path()));
        }
    }
    pids
}

/// Kills every process in the cgroup `name` (relative to each hierarchy's root, e.g. the runtime's VM
/// cgroup parent, which only this test's pods created) and removes it from every hierarchy.
pub fn remove_cgroup_everywhere(name: &str) {
    let pids: Vec<i32> = cgroup_hierarchies()
        .into_iter()
        .flat_map(|h| cgroup_pids(&h.join(name)))
        .collect();
    if !pids.is_empty() {
        kill_where(|pid| pids.contains(&pid));
    }
    for h in cgroup_hierarchies() {
        remove_cgroup_tree(&h.join(name));
    }
}

/// Removes a cgroup directory and its children, deepest first (rmdir: a cgroup holds no files).
fn remove_cgroup_tree(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup_tree(&e.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Detaches every mount at or below `dir`, deepest first (from /proc/self/mountinfo).
fn unmount_under(dir: &Path) {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount_path)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    for p in points {
        if let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) {
            // SAFETY: umount2 on a NUL-terminated path.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// mountinfo escapes space, tab, newline and backslash as octal (`\040`).
fn unescape_mount_path(s: &str) -> PathBuf {
    let mut out = Vec::with_capacity(s.len());
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    PathBuf::from(String::from_utf8_lossy(&out).into_owned())
}

fn write(path: &Path, content: &str) -> Result<PathBuf, NodeError> {
    std::fs::write(path, content).map_err(io_err(format!("write {}", path.display())))?;
    Ok(path.to_path_buf())
}

/// containerd 1.6 (config version 2): its own root, state and socket under `dir`; the CRI plugin with
/// runc on cgroupfs, OOM score adjustments clamped (root here lacks CAP_SYS_RESOURCE), pod network
/// namespaces mounted under `dir/netns` (so teardown finds them), and plain-HTTP mirrors.
pub fn containerd_config(dir: &Path, sandbox_image: &str, plain_http: &[String]) -> String {
    let d = |p: &str| dir.join(p).display().to_string();
    let mut toml = format!(
        r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  netns_mounts_under = "{netns}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{runc_root}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni}"
"#,
        root = d("containerd/root"),
        state = d("containerd/state"),
        socket = d("containerd/containerd.sock"),
        opt = d("containerd/opt"),
        netns = d("netns"),
        runc_root = d("containerd/runc"),
        cni = d("cni/net.d"),
    );
    for host in plain_http {
        let _ = write!(
            toml,
            "  [plugins.\"io.containerd.grpc.v1.cri\".registry.mirrors.\"{host}\"]\n    endpoint = [\"http://{host}\"]\n"
        );
    }
    toml
}

/// The CNI network: a bridge with the gateway address, host-local addresses from [`POD_CIDR`] with its
/// state under `ipam_dir` (not /var/lib/cni), and loopback.
pub fn cni_conflist(ipam_dir: &Path) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "imp-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "imp-cni0",
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": ipam_dir,
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "routes": [{"dst": "0.0.0.0/0"}]
                }
            }
        ]
    })
    .to_string()
}

/// KubeletConfiguration: cgroup v1 allowed (`failCgroupV1: false`, kubelet >= 1.35 refuses it
/// otherwise), cgroupfs below `cgroup_root`, the API served on the node IP only, no eviction on a busy
/// disk, logs under `dir`.
pub fn kubelet_config(
    dir: &Path,
    containerd_socket: &Path,
    cgroup_root: &str,
    port: u16,
    healthz_port: u16,
) -> String {
    serde_json::json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": false,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "containerRuntimeEndpoint": format!("unix://{}", containerd_socket.display()),
        "address": NODE_IP.to_string(),
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": true}, "webhook": {"enabled": false}},
        "authorization": {"mode": "AlwaysAllow"},
        "failSwapOn": false,
        "podCIDR": POD_CIDR,
        "podLogsDir": dir.join("pod-logs"),
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%"
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": false,
        "maxPods": 30,
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
    })
    .to_string()
}

/// The one layer of a pod sandbox image: a static C `for (;;) pause();` at /pause, built with the host's
/// C compiler (Debian gcc + libc6-dev). Returns the layer tarball (uncompressed) for
/// [`crate::oci::push_image`]-style pushes; the image config's Entrypoint must be `["/pause"]`.
pub fn build_pause_binary(work: &Path) -> Result<Vec<u8>, NodeError> {
    let src = work.join("pause.c");
    let bin = work.join("pause");
    std::fs::write(
        &src,
        "#include <unistd.h>\n#include <signal.h>\nstatic void done(int s) { (void)s; _exit(0); }\nint main(void) { signal(SIGINT, done); signal(SIGTERM, done); for (;;) pause(); }\n",
    )
    .map_err(io_err("write pause.c"))?;
    run(Command::new("cc")
        .args(["-static", "-O2", "-s", "-o"])
        .arg(&bin)
        .arg(&src))
    .map_err(|e| NodeError::Missing {
        what: "a static C build of the pause binary".into(),
        hint: format!("{e} (Debian packages gcc, libc6-dev)"),
    })?;
    std::fs::read(&bin).map_err(io_err("read the pause binary"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containerd_config_names_each_plain_http_registry_and_its_own_paths() {
        let toml = containerd_config(
            Path::new("/t/n"),
            "127.0.0.1:5000/pause:1",
            &["127.0.0.1:5000".into(), "127.0.0.1:6000".into()],
        );
        assert!(toml.contains(r#"address = "/t/n/containerd/containerd.sock""#));
        assert!(toml.contains(r#"netns_mounts_under = "/t/n/netns""#));
        assert!(toml.contains(r#"sandbox_image = "127.0.0.1:5000/pause:1""#));
        assert!(toml.contains("restrict_oom_score_adj = true"));
        assert!(toml.contains("SystemdCgroup = false"));
        assert!(toml.contains(r#"Root = "/t/n/containerd/runc""#));
        for host in ["127.0.0.1:5000", "127.0.0.1:6000"] {
            assert!(toml.contains(&format!(
                "mirrors.\"{host}\"]\n    endpoint = [\"http://{host}\"]"
            )));
        }
    }

    #[test]
    fn kubelet_config_allows_cgroup_v1_and_serves_on_the_node_ip() {
        let cfg: serde_json::Value = serde_json::from_str(&kubelet_config(
            Path::new("/t/n"),
            Path::new("/t/n/c.sock"),
            "/imp-node-x",
            10250,
            10248,
        ))
        .unwrap();
        assert_eq!(cfg["failCgroupV1"], false);
        assert_eq!(cfg["cgroupDriver"], "cgroupfs");
        assert_eq!(cfg["cgroupRoot"], "/imp-node-x");
        assert_eq!(cfg["address"], "192.0.2.10");
        assert_eq!(cfg["containerRuntimeEndpoint"], "unix:///t/n/c.sock");
        assert_eq!(cfg["podLogsDir"], "/t/n/pod-logs");
    }

    #[test]
    fn cni_addresses_come_from_test_net_with_state_in_the_test_dir() {
        let c: serde_json::Value =
            serde_json::from_str(&cni_conflist(Path::new("/t/ipam"))).unwrap();
        let ipam = &c["plugins"][0]["ipam"];
        assert_eq!(ipam["ranges"][0][0]["subnet"], "198.51.100.0/24");
        assert_eq!(ipam["dataDir"], "/t/ipam");
    }

    #[test]
    fn mountinfo_octal_escapes_are_decoded() {
        assert_eq!(
            unescape_mount_path(r"/t/a\040b/c\134d"),
            PathBuf::from(r"/t/a b/c\d")
        );
        assert_eq!(unescape_mount_path("/plain"), PathBuf::from("/plain"));
    }
}
