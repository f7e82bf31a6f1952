//! Firecracker driver: spawn a Firecracker process (own session, so it outlives the runtime),
//! configure it through its API (api.rs mirrors firecracker-api.yaml), start it and wait for
//! the guest agent's Hello over the hybrid vsock; stop, pause/resume and snapshots.

pub mod api;
pub mod client;
pub mod jailer;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use imp_guest::protocol::Hello;
use tokio::time::Instant;

use crate::vmm::process::{self, Proc};
use crate::vmm::{DriverError, VmPlan, serial};
use api::{ActionType, BootSource, Drive, MachineConfiguration, NetworkInterface, Vsock};
pub use client::{ApiClientError, FirecrackerClient};

/// How long a fresh Firecracker may take to answer on its API socket.
const API_READY_TIMEOUT: Duration = Duration::from_secs(5);
// Short: API readiness of a fresh process is on every VM start's critical path.
const POLL: Duration = Duration::from_millis(5);

/// Files of one Firecracker process.
#[derive(Debug, Clone)]
pub struct VmmFiles {
    pub api_sock: PathBuf,
    pub vsock: PathBuf,
    /// Firecracker writes the guest serial console to its stdout.
    pub serial_log: PathBuf,
    pub stderr_log: PathBuf,
    /// Firecracker's own log (`--log-path`): kept out of the console, so `serial_log` and the
    /// failure tails quote only what the guest printed.
    pub vmm_log: PathBuf,
    /// The jail root when Firecracker runs through its jailer: `api_sock`, `vsock` and
    /// `vmm_log` lie in it, and every path Firecracker is told is relative to it.
    pub jail: Option<PathBuf>,
}

impl VmmFiles {
    /// How Firecracker names host path `p`: as it is, or inside its jail.
    pub fn vmm_path(&self, p: &Path) -> String {
        match &self.jail {
            Some(root) => jailer::in_jail(root, p).unwrap_or_else(|| p.display().to_string()),
            None => p.display().to_string(),
        }
    }
}

/// Firecracker's log level: its API calls and warnings, a few lines per VM start.
const VMM_LOG_LEVEL: &str = "Info";

/// Everything Firecracker is told before InstanceStart.
#[derive(Debug, Clone)]
pub struct BootPlan {
    pub machine: MachineConfiguration,
    pub boot_source: BootSource,
    pub drives: Vec<Drive>,
    pub network: Vec<NetworkInterface>,
    pub vsock: Vsock,
}

impl From<&VmPlan> for BootPlan {
    fn from(p: &VmPlan) -> Self {
        BootPlan::new(p, |p| p.display().to_string())
    }
}

impl BootPlan {
    /// The plan with every host path named as Firecracker sees it (`path`: as it is, or
    /// inside its jail, see [`VmmFiles::vmm_path`]).
    pub fn new(p: &VmPlan, path: impl Fn(&Path) -> String) -> Self {
        BootPlan {
            machine: MachineConfiguration {
                vcpu_count: p.vcpu,
                mem_size_mib: p.memory_mib,
                smt: None,
                track_dirty_pages: None,
                huge_pages: None,
            },
            boot_source: BootSource {
                kernel_image_path: path(&p.kernel),
                initrd_path: p.initrd.as_deref().map(&path),
                boot_args: Some(p.boot_args.clone()),
            },
            drives: p
                .drives
                .iter()
                .map(|d| Drive {
                    drive_id: d.id.into(),
                    is_root_device: d.root,
                    partuuid: None,
                    cache_type: None,
                    is_read_only: Some(d.read_only),
                    path_on_host: Some(path(&d.path)),
                    io_engine: None,
                    socket: None,
                })
                .collect(),
            network: p
                .nics
                .iter()
                .map(|n| NetworkInterface {
                    iface_id: n.id.into(),
                    host_dev_name: n.tap.clone(),
                    guest_mac: Some(n.mac.clone()),
                    mtu: None,
                })
                .collect(),
            vsock: Vsock {
                guest_cid: p.guest_cid,
                uds_path: path(&p.vsock),
            },
        }
    }
}

/// One Firecracker process.
#[derive(Debug, Clone)]
pub struct Vmm {
    pub process: Proc,
    pub files: VmmFiles,
    pub client: FirecrackerClient,
}

/// Spawn `firecracker --api-sock <sock> --id <id> --log-path <vmm_log>` through the seam
/// (`process::spawn_detached`: a session of its own, in `cgroup` from before it execs).
pub fn spawn(
    bin: &Path,
    id: &str,
    files: &VmmFiles,
    cgroups: &[PathBuf],
) -> Result<Vmm, DriverError> {
    let start_failed = |message: String| DriverError::FirecrackerStartFailed {
        message,
        stderr: String::new(),
    };
    let open = |p: &Path| {
        process::append_log(p).map_err(|e| start_failed(format!("open {}: {e}", p.display())))
    };
    // Firecracker opens its log file but never creates it; without one it logs to stdout,
    // into the guest console.
    open(&files.vmm_log)?;
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("--api-sock")
        .arg(&files.api_sock)
        .arg("--id")
        .arg(id)
        .arg("--log-path")
        .arg(&files.vmm_log)
        .arg("--level")
        .arg(VMM_LOG_LEVEL)
        .stdin(Stdio::null())
        .stdout(open(&files.serial_log)?)
        .stderr(open(&files.stderr_log)?);
    let (pid, start_time) = process::spawn_detached(cmd, cgroups, &[], None)
        .map_err(|e| start_failed(e.to_string()))?;
    // A process that has already exited has no start time: that is a start failure too.
    let start_time = start_time.ok_or_else(|| DriverError::FirecrackerStartFailed {
        message: "exited immediately".into(),
        stderr: serial::tail(&files.stderr_log),
    })?;
    Ok(Vmm {
        process: Proc { pid, start_time },
        files: files.clone(),
        client: FirecrackerClient::new(&files.api_sock),
    })
}

/// Spawn Firecracker through its jailer (`jailer::command_line`), into the jail `files.jail`
/// already staged (`jailer::stage`); the jailer forks it into a new PID namespace, so its pid
/// is the one the jailer writes into the jail.
pub async fn spawn_jailed(
    cfg: &jailer::JailerConfig,
    run: &jailer::JailerRun<'_>,
    files: &VmmFiles,
) -> Result<Vmm, DriverError> {
    let start_failed =
        |message: String, stderr: String| DriverError::FirecrackerStartFailed { message, stderr };
    let root = files
        .jail
        .as_deref()
        .ok_or_else(|| start_failed("no jail root".into(), String::new()))?;
    let open = |p: &Path| {
        process::append_log(p)
            .map_err(|e| start_failed(format!("open {}: {e}", p.display()), String::new()))
    };
    let mut run = run.clone();
    run.firecracker_args = [
        "--api-sock",
        &files.vmm_path(&files.api_sock),
        "--log-path",
        &files.vmm_path(&files.vmm_log),
        "--level",
        VMM_LOG_LEVEL,
    ]
    .iter()
    .map(Into::into)
    .collect();
    let mut cmd = std::process::Command::new(&cfg.bin);
    cmd.args(jailer::command_line(cfg, &run))
        .stdin(Stdio::null())
        .stdout(open(&files.serial_log)?)
        .stderr(open(&files.stderr_log)?);
    if let Some(hidden) = jailer::hidden_cgroup_mount(run.cgroups) {
        let hidden = std::ffi::CString::new(hidden.as_os_str().as_encoded_bytes())
            .expect("a constant path has no NUL");
        use std::os::unix::process::CommandExt as _;
        // SAFETY: between fork and exec only unshare, mount and umount2 on a path prepared
        // before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Nothing done here may reach the pod's mounts.
                let root = c"/";
                if libc::mount(
                    std::ptr::null(),
                    root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // EINVAL: not a mount point here, nothing to hide.
                if libc::umount2(hidden.as_ptr(), libc::MNT_DETACH) != 0 {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EINVAL) {
                        return Err(e);
                    }
                }
                Ok(())
            });
        }
    }
    // The jailer puts itself (and so Firecracker) into the VM's cgroups: none here.
    let (jailer_pid, jailer_start) = process::spawn_detached(cmd, &[], &[], None)
        .map_err(|e| start_failed(e.to_string(), String::new()))?;
    let jailer_proc = jailer_start.map(|start_time| Proc {
        pid: jailer_pid,
        start_time,
    });
    let pid = jailer::wait_pid(root, run.exec_file, API_READY_TIMEOUT, || {
        jailer_proc.is_some_and(|p| p.is_alive())
    })
    .await
    .map_err(|e| start_failed(e.to_string(), serial::tail(&files.stderr_log)))?;
    let start_time = crate::procfs::start_time(pid).ok_or_else(|| {
        start_failed("exited immediately".into(), serial::tail(&files.stderr_log))
    })?;
    Ok(Vmm {
        process: Proc { pid, start_time },
        files: files.clone(),
        client: FirecrackerClient::new(&files.api_sock),
    })
}

impl Vmm {
    pub fn is_alive(&self) -> bool {
        self.process.is_alive()
    }

    fn start_failed(&self, message: String) -> DriverError {
        DriverError::FirecrackerStartFailed {
            message,
            stderr: serial::tail(&self.files.stderr_log),
        }
    }

    /// Wait until the API socket answers GET /, or fail with Firecracker's stderr.
    pub async fn wait_api_ready(&self) -> Result<(), DriverError> {
        let deadline = Instant::now() + API_READY_TIMEOUT;
        loop {
            if !self.is_alive() {
                return Err(self.start_failed("exited before its API socket answered".into()));
            }
            if self.files.api_sock.exists() && self.client.describe_instance().await.is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.start_failed(format!(
                    "API socket {} did not answer within {API_READY_TIMEOUT:?}",
                    self.files.api_sock.display()
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Configure every pre-boot resource.
    pub async fn configure(&self, plan: &BootPlan) -> Result<(), DriverError> {
        let r = async {
            self.client.put_machine_config(&plan.machine).await?;
            self.client.put_boot_source(&plan.boot_source).await?;
            for d in &plan.drives {
                self.client.put_drive(d).await?;
            }
            for n in &plan.network {
                self.client.put_network_interface(n).await?;
            }
            self.client.put_vsock(&plan.vsock).await
        }
        .await;
        r.map_err(|e| self.start_failed(e.to_string()))
    }

    pub async fn instance_start(&self) -> Result<(), DriverError> {
        self.client
            .action(ActionType::InstanceStart)
            .await
            .map_err(|e| self.start_failed(e.to_string()))
    }

    /// Wait for the guest agent's Hello (see `vmm::wait_for_hello`).
    pub async fn wait_for_hello(&self, deadline: Instant) -> Result<Hello, DriverError> {
        crate::vmm::wait_for_hello(
            &self.files.vsock,
            &self.files.serial_log,
            || self.is_alive(),
            deadline,
            crate::vmm::Detect::Backoff,
        )
        .await
    }

    /// Ask the guest to reboot (SendCtrlAltDel: Firecracker exits when the guest resets), then
    /// SIGKILL after `timeout`. Returns once the process is gone.
    pub async fn stop(&self, timeout: Duration) {
        if !self.is_alive() {
            return;
        }
        if let Err(e) = self.client.action(ActionType::SendCtrlAltDel).await {
            tracing::debug!(pid = self.process.pid, error = %e, "SendCtrlAltDel failed; killing");
        } else if self.process.wait_gone(timeout).await {
            return;
        }
        self.kill().await;
    }

    /// SIGKILL, only if pid and start time still name our process; returns once it is gone.
    pub async fn kill(&self) {
        self.process.kill().await
    }

    pub async fn pause(&self) -> Result<(), ApiClientError> {
        self.client.set_vm_state(api::VmState::Paused).await
    }

    pub async fn resume(&self) -> Result<(), ApiClientError> {
        self.client.set_vm_state(api::VmState::Resumed).await
    }

    /// Full snapshot of a paused VM.
    pub async fn snapshot_create(
        &self,
        snapshot_path: &Path,
        mem_file_path: &Path,
    ) -> Result<(), ApiClientError> {
        self.client
            .create_snapshot(&api::SnapshotCreateParams {
                snapshot_path: self.files.vmm_path(snapshot_path),
                mem_file_path: self.files.vmm_path(mem_file_path),
                snapshot_type: Some(api::SnapshotType::Full),
            })
            .await
    }

    /// Load a snapshot into a fresh (unconfigured) Firecracker, optionally resuming it: the
    /// same VM again (suspend/resume), at this VMM's vsock path.
    pub async fn snapshot_load(
        &self,
        snapshot_path: &Path,
        mem_file_path: &Path,
        resume: bool,
    ) -> Result<(), ApiClientError> {
        self.client
            .load_snapshot(&self.load_params(
                snapshot_path,
                mem_file_path,
                resume,
                &CloneOverrides::default(),
            ))
            .await
    }

    /// Restore a *clone* of a template: load the template's snapshot into this fresh,
    /// unconfigured Firecracker (spawned with its own files: `files.vsock` must not exist, the
    /// load binds it) with the overrides, and resume it. Then wait for Hello
    /// ([`Vmm::wait_for_hello`]) and give the guest its own identity (`Reidentify`) before
    /// anything secret reaches it.
    ///
    /// The memory file is mapped `MAP_PRIVATE` and faulted in lazily, for the clone's whole
    /// life: its content must never change while any clone of it runs (no rewrite or truncation
    /// in place: a clone would read the new bytes, or SIGBUS, on its next fault). Unlinking it
    /// once the load returned is safe (the mapping holds the inode); a new template goes to a
    /// new file. Jailed: hard-link it into the jail with [`jailer::stage`] and
    /// [`jailer::Place::Template`] (root-owned, 0444: no clone can write it).
    /// A failed load ends the Firecracker process (it is "too dirty to recover"): the error
    /// carries its stderr; spawn a fresh one to try again.
    pub async fn restore_clone(
        &self,
        snapshot_path: &Path,
        mem_file_path: &Path,
        overrides: &CloneOverrides,
    ) -> Result<(), DriverError> {
        let params = self.load_params(snapshot_path, mem_file_path, true, overrides);
        self.client
            .load_snapshot(&params)
            .await
            .map_err(|e| self.start_failed(format!("snapshot load: {e}")))
    }

    /// The body of a load at this VMM's own vsock path (host paths named as Firecracker sees
    /// them).
    pub fn load_params(
        &self,
        snapshot_path: &Path,
        mem_file_path: &Path,
        resume: bool,
        overrides: &CloneOverrides,
    ) -> api::SnapshotLoadParams {
        api::SnapshotLoadParams {
            snapshot_path: self.files.vmm_path(snapshot_path),
            mem_file_path: None,
            mem_backend: Some(api::MemoryBackend {
                backend_type: api::MemoryBackendType::File,
                backend_path: self.files.vmm_path(mem_file_path),
            }),
            track_dirty_pages: None,
            resume_vm: Some(resume),
            network_overrides: overrides.network.clone(),
            vsock_override: Some(api::VsockOverride {
                uds_path: self.files.vmm_path(&self.files.vsock),
            }),
            clock_realtime: overrides.clock_realtime.then_some(true),
        }
    }
}

/// What a clone changes in the template's devices, besides its vsock socket (always its own:
/// `VmmFiles::vsock`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CloneOverrides {
    /// The clone's TAP for each interface of the template (`iface_id` as the template was
    /// configured, e.g. `eth0`). The TAP must exist (a jailed Firecracker cannot create one);
    /// the guest keeps the template's MAC and address until `Reidentify` changes them.
    pub network: Vec<api::NetworkOverride>,
    /// Send `clock_realtime` (Firecracker >= 1.16, x86 only; older releases refuse the field).
    /// Without it the guest's clock resumes at the snapshot's time until `Reidentify` sets it.
    pub clock_realtime: bool,
}

/// The Firecracker release `bin --version` prints (`1.17.0` of `Firecracker v1.17.0`): part of
/// a template's key, since a snapshot loads only into the release that took it. Runs a process:
/// call it once at startup (or from a blocking task).
pub fn version(bin: &Path) -> Result<String, jailer::JailerError> {
    jailer::version_of(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmm(jail: Option<&str>) -> Vmm {
        let root = jail.map(PathBuf::from);
        let dir = root
            .clone()
            .unwrap_or_else(|| PathBuf::from("/var/lib/imp/vms/c1"));
        let files = VmmFiles {
            api_sock: dir.join("api.sock"),
            vsock: dir.join("vsock.sock"),
            serial_log: dir.join("serial.log"),
            stderr_log: dir.join("stderr.log"),
            vmm_log: dir.join("firecracker.log"),
            jail: root,
        };
        Vmm {
            process: Proc {
                pid: 1,
                start_time: 1,
            },
            client: FirecrackerClient::new(&files.api_sock),
            files,
        }
    }

    /// The body a clone load sends, field for field as firecracker-api.yaml names them: the
    /// file backend (not the deprecated `mem_file_path`), the clone's own vsock socket and TAP,
    /// resumed; `clock_realtime` only when asked for.
    #[test]
    fn a_clone_load_names_the_file_backend_its_own_socket_and_its_taps() {
        let overrides = CloneOverrides {
            network: vec![api::NetworkOverride {
                iface_id: "eth0".into(),
                host_dev_name: "imp-c1".into(),
            }],
            clock_realtime: false,
        };
        let p = vmm(None).load_params(
            Path::new("/var/lib/imp/templates/t/vm.snap"),
            Path::new("/var/lib/imp/templates/t/vm.mem"),
            true,
            &overrides,
        );
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            serde_json::json!({
                "snapshot_path": "/var/lib/imp/templates/t/vm.snap",
                "mem_backend": {"backend_type": "File", "backend_path": "/var/lib/imp/templates/t/vm.mem"},
                "resume_vm": true,
                "network_overrides": [{"iface_id": "eth0", "host_dev_name": "imp-c1"}],
                "vsock_override": {"uds_path": "/var/lib/imp/vms/c1/vsock.sock"},
            })
        );
        // Jailed: every path as Firecracker sees it in its chroot.
        let jailed = vmm(Some("/var/lib/imp/jailer/firecracker/c1/root"));
        let root = jailed.files.jail.clone().unwrap();
        let p = jailed.load_params(
            &root.join("template.snap"),
            &root.join("template.mem"),
            true,
            &CloneOverrides {
                clock_realtime: true,
                ..CloneOverrides::default()
            },
        );
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["snapshot_path"], "/template.snap");
        assert_eq!(v["mem_backend"]["backend_path"], "/template.mem");
        assert_eq!(v["vsock_override"]["uds_path"], "/vsock.sock");
        assert_eq!(v["clock_realtime"], true);
        assert!(v.get("network_overrides").is_none());
    }
}
