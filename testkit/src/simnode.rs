//! One Imp node on the smoke's simulated guest path, as separate processes: imp-runtime driving
//! the Firecracker simulator without the jailer (`IMP_UNJAILED_FIRECRACKER=1`; it runs imp-guest
//! as a host process behind the hybrid vsock), and imp-agent for a Node of the test, whose runner
//! command is imp-fake-runner (it talks to the GitHub simulator named in the JIT config). No VM
//! network: the pool's template names none, so the runtime makes no TAP, bridge or nft rule.
//!
//! Dropping a [`SimNode`] stops the agent and the runtime, then kills every process still naming
//! the node's state directory (the simulated VMMs and guests run in sessions of their own), and
//! removes the node's directory (state, logs).

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
}

/// A running node (see the module docs).
pub struct SimNode {
    pub name: String,
    dir: tempfile::TempDir,
    agent: Option<ManagedProcess>,
    runtime: Option<ManagedProcess>,
}

impl SimNode {
    /// Starts imp-runtime, waits until its socket answers, then starts imp-agent.
    pub async fn start(bins: &SimNodeBinaries, opts: &SimNodeOptions) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("imp-simnode-")
            .tempdir()
            .expect("the node's directory");
        let mut node = SimNode {
            name: opts.node_name.clone(),
            dir,
            agent: None,
            runtime: None,
        };
        let kernel = node.dir.path().join("vmlinux");
        std::fs::write(&kernel, b"simulated kernel").unwrap();
        let (socket, state) = (node.socket(), node.state_dir());
        let budget = opts.writable_budget_bytes.to_string();
        let runtime_env: [(&str, &std::ffi::OsStr); 13] = [
            ("IMP_RUNTIME_SOCKET", socket.as_os_str()),
            ("IMP_STATE_DIR", state.as_os_str()),
            ("IMP_KERNEL", kernel.as_os_str()),
            ("IMP_FIRECRACKER_BIN", bins.simulator.as_os_str()),
            // The simulator without the jailer, as the smoke runs it (node/runtime/tests/jailer.rs
            // covers the jailed path).
            ("IMP_UNJAILED_FIRECRACKER", "1".as_ref()),
            ("IMP_GUEST_BIN", bins.guest.as_os_str()),
            ("IMP_METRICS_ADDR", "127.0.0.1:0".as_ref()),
            ("IMP_BOOT_TIMEOUT", "60s".as_ref()),
            ("IMP_STOP_TIMEOUT", "2s".as_ref()),
            ("IMP_INSECURE_REGISTRIES", opts.registry.as_ref()),
            ("IMP_NODE_LOCAL_REGISTRIES", opts.registry.as_ref()),
            ("IMP_WRITABLE_BUDGET_BYTES", budget.as_ref()),
            ("IMP_LOG", "info".as_ref()),
        ];
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

    /// Processes (other than this one) whose command line names the node's state directory: the
    /// simulated VMMs and guests, and what those run.
    pub fn vm_processes(&self) -> Vec<i32> {
        let needle = self.state_dir().to_string_lossy().into_owned();
        let me = std::process::id() as i32;
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| pid != me && names(pid, &needle))
            .collect()
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
        let needle = self.state_dir().to_string_lossy().into_owned();
        let me = std::process::id() as i32;
        crate::node::kill_where(|pid| pid != me && names(pid, &needle));
    }
}
