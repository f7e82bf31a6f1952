//! One Imp node on the smoke's simulated guest path, as separate processes: imp-runtime driving
//! the Firecracker simulator (it runs imp-guest as a host process behind the hybrid vsock), and
//! imp-agent for a Node of the test, whose runner command is imp-fake-runner (it talks to the
//! GitHub simulator named in the JIT config). No VM network: the pool's template names none, so
//! the runtime makes no TAP, bridge or nft rule.
//!
//! By default the simulator runs without the jailer (`IMP_UNJAILED_FIRECRACKER=1`). With
//! [`SimNodeOptions::jailed`] (root only) it runs through testkit's jailer double as the smoke
//! runs it (`smoke/imp-smoke.sh`'s `backend_env`): chrooted under a short jail base of its own in
//! /tmp (Unix socket paths are short), the host's libraries, imp-guest, imp-fake-runner and
//! `/proc/meminfo`, `/proc/uptime` bound read-only into each jail, the simulator kept root in its
//! jail. Only a jailed Firecracker keeps templates (snapshot standby, docs/snapshots.md).
//!
//! Dropping a [`SimNode`] stops the agent and the runtime, then kills every process still naming
//! the node's state directory or jail base, or rooted in one of its jails (the simulated VMMs and
//! guests run in sessions of their own), and removes the node's directory (state, logs) and its
//! jail base.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::ManagedProcess;

/// The binaries of a node: imp-runtime, imp-agent, the simulator, imp-guest, imp-fake-runner.
#[derive(Debug, Clone)]
pub struct SimNodeBinaries {
    pub runtime: PathBuf,
    pub agent: PathBuf,
    pub simulator: PathBuf,
    pub guest: PathBuf,
    pub fake_runner: PathBuf,
}

impl SimNodeBinaries {
    /// Found beside the running test, built when older than their sources.
    pub fn locate() -> Result<Self, String> {
        let built = crate::bins::ensure_built(
            &[("imp-runtime", "imp-runtime"), ("imp-agent", "imp-agent")],
            &["node", "api/src", "common/src", "guest/src"],
        )?;
        let sim = crate::firecracker::binaries();
        let fake_runner = crate::github::fake_runner_binary().map_err(|e| e.to_string())?;
        Ok(Self {
            runtime: built[0].clone(),
            agent: built[1].clone(),
            simulator: sim.simulator.clone(),
            guest: sim.guest.clone(),
            fake_runner,
        })
    }
}

/// What a node offers and where it reports.
#[derive(Debug, Clone)]
pub struct SimNodeOptions {
    /// The Node object's name (it must exist: the agent publishes its capacity there).
    pub node_name: String,
    /// The namespace of the heartbeat Leases (the operator's).
    pub lease_namespace: String,
    pub kubeconfig: PathBuf,
    /// `host:port` of the plain-HTTP registry holding the VMs' images.
    pub registry: String,
    /// vCPUs and MiB offered to VMs (the agent publishes them; the scheduler binds by them).
    pub capacity_vcpu: u32,
    pub capacity_memory_mib: u64,
    /// Bytes of writable disks the runtime hands out (sparse files).
    pub writable_budget_bytes: u64,
    /// The simulator through testkit's jailer double (see the module docs; root only, see
    /// [`SimNode::can_jail`]); false: unjailed.
    pub jailed: bool,
}

/// A running node (see the module docs).
pub struct SimNode {
    pub name: String,
    dir: tempfile::TempDir,
    /// The jailer's chroot base of a jailed node (removed after its processes are killed).
    jails: Option<tempfile::TempDir>,
    agent: Option<ManagedProcess>,
    runtime: Option<ManagedProcess>,
}

impl SimNode {
    /// Whether this process may run a jailed node: the jailer double switches uids, makes device
    /// nodes and namespaces.
    pub fn can_jail() -> bool {
        nix::unistd::geteuid().is_root()
    }

    /// Starts imp-runtime, waits until its socket answers, then starts imp-agent.
    pub async fn start(bins: &SimNodeBinaries, opts: &SimNodeOptions) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("imp-simnode-")
            .tempdir()
            .expect("the node's directory");
        let mut node = SimNode {
            name: opts.node_name.clone(),
            dir,
            jails: None,
            agent: None,
            runtime: None,
        };
        let kernel = node.dir.path().join("vmlinux");
        std::fs::write(&kernel, b"simulated kernel").unwrap();
        let (socket, state) = (node.socket(), node.state_dir());
        let budget = opts.writable_budget_bytes.to_string();
        let mut runtime_env: Vec<(&str, std::ffi::OsString)> = vec![
            ("IMP_RUNTIME_SOCKET", socket.clone().into()),
            ("IMP_STATE_DIR", state.clone().into()),
            ("IMP_KERNEL", kernel.into()),
            ("IMP_FIRECRACKER_BIN", bins.simulator.clone().into()),
            ("IMP_GUEST_BIN", bins.guest.clone().into()),
            ("IMP_METRICS_ADDR", "127.0.0.1:0".into()),
            ("IMP_BOOT_TIMEOUT", "60s".into()),
            ("IMP_STOP_TIMEOUT", "2s".into()),
            ("IMP_INSECURE_REGISTRIES", opts.registry.clone().into()),
            ("IMP_NODE_LOCAL_REGISTRIES", opts.registry.clone().into()),
            ("IMP_WRITABLE_BUDGET_BYTES", budget.into()),
            ("IMP_LOG", "info".into()),
        ];
        if opts.jailed {
            assert!(Self::can_jail(), "a jailed SimNode needs root");
            let jailer = crate::bins::ensure_built(
                &[("imp-testkit", "jailer-double")],
                &["testkit/src", "testkit/Cargo.toml"],
            )
            .expect("building jailer-double")
            .remove(0);
            // Short: the VMs' API and vsock sockets live under it.
            let jails = tempfile::Builder::new()
                .prefix("impj.")
                .tempdir_in("/tmp")
                .expect("the jail base");
            // The double's deviations for the simulator (testkit/src/bin/jailer-double.rs), as
            // the smoke uses them.
            let bind = ["/usr", "/bin", "/sbin", "/lib", "/lib64"]
                .iter()
                .map(PathBuf::from)
                .filter(|p| p.exists())
                .chain([
                    bins.guest.clone(),
                    bins.fake_runner.clone(),
                    "/proc/meminfo".into(),
                    "/proc/uptime".into(),
                ])
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(",");
            runtime_env.extend([
                ("IMP_JAILER_PATH", jailer.into()),
                ("IMP_JAILER_CHROOT_BASE_DIR", jails.path().into()),
                ("IMP_JAILER_DOUBLE_BIND", bind.into()),
                (
                    "IMP_JAILER_DOUBLE_KEEP_ENV",
                    "IMP_GUEST_BIN,IMP_SIM_BEHAVIOUR".into(),
                ),
                ("IMP_JAILER_DOUBLE_KEEP_ROOT", "1".into()),
            ]);
            node.jails = Some(jails);
        } else {
            // The simulator without the jailer, as most node tests run it
            // (node/runtime/tests/jailer.rs covers the jailed path).
            runtime_env.push(("IMP_UNJAILED_FIRECRACKER", "1".into()));
        }
        let mut cmd = Command::new(&bins.runtime);
        cmd.envs(runtime_env);
        let log = node.dir.path().join("runtime.log");
        let runtime = ManagedProcess::spawn("imp-runtime", cmd, &log).expect("imp-runtime starts");
        node.runtime = Some(runtime);
        let started = Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "imp-runtime of {} did not answer: {}",
                node.name,
                node.logs(20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        let vcpu = opts.capacity_vcpu.to_string();
        let memory = opts.capacity_memory_mib.to_string();
        let agent_env: [(&str, &std::ffi::OsStr); 12] = [
            ("KUBECONFIG", opts.kubeconfig.as_os_str()),
            ("IMP_NODE_NAME", opts.node_name.as_ref()),
            ("IMP_NAMESPACE", opts.lease_namespace.as_ref()),
            ("IMP_RUNTIME_SOCKET", socket.as_os_str()),
            ("IMP_HEARTBEAT_INTERVAL", "2s".as_ref()),
            ("IMP_POLL_INTERVAL", "1s".as_ref()),
            ("IMP_SWEEP_INTERVAL", "2s".as_ref()),
            ("IMP_HTTP_ADDR", "127.0.0.1:0".as_ref()),
            ("IMP_RUNNER_COMMAND", bins.fake_runner.as_os_str()),
            ("IMP_CAPACITY_VCPU", vcpu.as_ref()),
            ("IMP_CAPACITY_MEMORY_MIB", memory.as_ref()),
            ("IMP_LOG", "info".as_ref()),
        ];
        let mut cmd = Command::new(&bins.agent);
        cmd.envs(agent_env);
        let log = node.dir.path().join("agent.log");
        node.agent = Some(ManagedProcess::spawn("imp-agent", cmd, &log).expect("imp-agent starts"));
        node
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("runtime.sock")
    }

    /// The directory holding `runtime.log` and `agent.log`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// VM directories the runtime holds (one per VM it has not released).
    pub fn vm_dirs(&self) -> usize {
        std::fs::read_dir(self.state_dir().join("vms"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// Processes (other than this one) whose command line names the node's state directory or
    /// jail base, or whose root is one of the node's jails: the simulated VMMs and guests, and
    /// what those run.
    pub fn vm_processes(&self) -> Vec<i32> {
        let me = std::process::id() as i32;
        let pick = self.picker();
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| pid != me && pick(pid))
            .collect()
    }

    /// Jails (`<base>/<exec name>/<id>/root`) the runtime has not removed.
    pub fn jail_dirs(&self) -> usize {
        self.jail_roots().len()
    }

    /// (device, inode) of each jail's root.
    fn jail_roots(&self) -> Vec<(u64, u64)> {
        use std::os::unix::fs::MetadataExt as _;
        let Some(base) = &self.jails else {
            return Vec::new();
        };
        let entries = |p: &Path| {
            std::fs::read_dir(p)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .collect::<Vec<_>>()
        };
        entries(base.path())
            .iter()
            .flat_map(|exec| entries(exec))
            .filter_map(|jail| std::fs::metadata(jail.join("root")).ok())
            .map(|m| (m.dev(), m.ino()))
            .collect()
    }

    /// Whether a pid is one of this node's VM processes (see [`Self::vm_processes`]).
    fn picker(&self) -> impl Fn(i32) -> bool + use<> {
        use std::os::unix::fs::MetadataExt as _;
        let mut needles = vec![self.state_dir().to_string_lossy().into_owned()];
        if let Some(j) = &self.jails {
            needles.push(j.path().to_string_lossy().into_owned());
        }
        let roots = self.jail_roots();
        move |pid| {
            needles.iter().any(|n| names(pid, n))
                || (!roots.is_empty()
                    && std::fs::metadata(format!("/proc/{pid}/root"))
                        .is_ok_and(|m| roots.contains(&(m.dev(), m.ino()))))
        }
    }

    /// The last `lines` lines of the agent's and the runtime's logs, for failure messages.
    pub fn logs(&self, lines: usize) -> String {
        ["agent", "runtime"]
            .iter()
            .map(|n| {
                let path = self.dir.path().join(format!("{n}.log"));
                format!(
                    "--- {} {n}.log\n{}",
                    self.name,
                    crate::process::log_tail(&path, lines)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Whether `pid`'s command line contains `needle`.
fn names(pid: i32, needle: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|raw| String::from_utf8_lossy(&raw).contains(needle))
}

impl Drop for SimNode {
    fn drop(&mut self) {
        drop(self.agent.take());
        drop(self.runtime.take());
        let pick = self.picker();
        let me = std::process::id() as i32;
        crate::node::kill_where(|pid| pid != me && pick(pid));
        // The jails' files (the VMs' hard-linked drives, device nodes) go with the base; no
        // mount of a jail outlives its processes (each is in a mount namespace of its own).
        if let Some(jails) = self.jails.take()
            && let Err(e) = std::fs::remove_dir_all(jails.path())
        {
            eprintln!("removing the jail base {}: {e}", jails.path().display());
        }
    }
}
