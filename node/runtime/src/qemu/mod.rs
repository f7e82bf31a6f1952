//! The QEMU backend: one `qemu-system-x86_64` (KVM when usable, TCG otherwise) and one
//! `vhost-device-vsock` per VM. The vsock device gives the host the same hybrid-vsock socket
//! Firecracker does (`CONNECT <port>` on `vsock.sock`), so the guest protocol client, the
//! Hello wait and everything above the seam are the same for both backends. Guest memory comes
//! from `memory-backend-memfd,share=on`: vhost-user needs memory the device process can map
//! (without `share=on` the device appears and moves no data). The console goes to the VM's
//! serial log, QEMU's own messages to `qemu.log`, and QMP (`api.sock`) serves status, stop,
//! pause and resume. Both processes are spawned in sessions of their own (so they outlive the
//! runtime) and recorded in the inventory.

pub mod qmp;

use std::os::fd::{AsRawFd as _, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use crate::jail::{self, Device, Jail, JailError, VmJail};
use crate::tap;
use crate::vmm::process::{self, Proc, SpawnError};
use crate::vmm::{VmPlan, kvm_usable, serial};
pub use qmp::{Qmp, QmpError};

/// How long vhost-device-vsock may take to listen, and QEMU to answer on QMP.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(10);

#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    #[error("{what} failed to start: {source}; its log: {log}")]
    Jail {
        what: &'static str,
        source: JailError,
        log: String,
    },
    #[error("{what} failed to start: {message}; its log: {log}")]
    StartFailed {
        what: &'static str,
        message: String,
        log: String,
    },
    #[error(transparent)]
    Qmp(#[from] QmpError),
}

/// How QEMU accelerates the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// KVM when `/dev/kvm` opens, TCG (software emulation) otherwise.
    Auto,
    Kvm,
    Tcg,
}

#[derive(Debug, Clone)]
pub struct QemuConfig {
    pub qemu_bin: PathBuf,
    pub vhost_vsock_bin: PathBuf,
    pub accel: Accel,
}

/// The files of one QEMU VM, all in its directory.
#[derive(Debug, Clone)]
pub struct QemuFiles {
    /// The VM's directory (a confined VM's processes see only it read-write).
    pub dir: PathBuf,
    /// QMP control socket.
    pub qmp_sock: PathBuf,
    /// vhost-user socket between QEMU and vhost-device-vsock.
    pub vhost_sock: PathBuf,
    /// Host side of the hybrid vsock.
    pub vsock: PathBuf,
    pub serial_log: PathBuf,
    /// QEMU's own stderr.
    pub qemu_log: PathBuf,
    pub vhost_log: PathBuf,
}

impl QemuFiles {
    pub fn in_dir(dir: &Path, qmp_sock: &Path, vsock: &Path, serial_log: &Path) -> Self {
        QemuFiles {
            dir: dir.to_path_buf(),
            qmp_sock: qmp_sock.to_path_buf(),
            vhost_sock: dir.join("vhost.sock"),
            vsock: vsock.to_path_buf(),
            serial_log: serial_log.to_path_buf(),
            qemu_log: dir.join("qemu.log"),
            vhost_log: dir.join("vhost-device-vsock.log"),
        }
    }
}

/// One QEMU VM: QEMU and its vsock device.
#[derive(Debug, Clone)]
pub struct QemuVm {
    pub qemu: Proc,
    /// None for a VM found without its helper recorded.
    pub vhost: Option<Proc>,
    pub qmp: Qmp,
}

/// The accelerator `accel` means on this host.
pub fn resolve_accel(accel: Accel, kvm: bool) -> &'static str {
    match accel {
        Accel::Kvm => "kvm",
        Accel::Tcg => "tcg",
        Accel::Auto if kvm => "kvm",
        Accel::Auto => "tcg",
    }
}

/// TCG's translation cache, MiB. QEMU's default (1 GiB, filled as the guest runs new code) is
/// charged to the VM's memory cgroup: a Debian guest running dockerd and `docker build` grew QEMU's
/// anonymous memory to 586 MiB and the cgroup (class memory + vmMemoryOverheadMib) killed it
/// mid-job. A full cache is flushed and refilled: slower, never killed.
pub const TCG_TB_MIB: u32 = 64;

/// `-accel`'s value: TCG with its cache bounded ([`TCG_TB_MIB`]); KVM translates nothing.
fn accel_arg(accel: &str) -> String {
    if accel == "tcg" {
        format!("tcg,tb-size={TCG_TB_MIB}")
    } else {
        accel.to_owned()
    }
}

/// The vhost-device-vsock command line (after the binary).
pub fn vhost_args(files: &QemuFiles, guest_cid: u32) -> Vec<String> {
    vec![
        "--guest-cid".into(),
        guest_cid.to_string(),
        "--socket".into(),
        files.vhost_sock.display().to_string(),
        "--uds-path".into(),
        files.vsock.display().to_string(),
    ]
}

/// What a confined QEMU is handed instead of opening it: one TAP descriptor per NIC, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handed {
    pub tap_fds: Vec<RawFd>,
}

/// QEMU's own seccomp sandbox for a confined VM: no obsolete calls, no privilege changes, no
/// processes, no scheduler or resource changes.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// The QEMU command line (after the binary) for `plan`. The kernel is told the root itself
/// (Firecracker adds `root=` on its own): with an initrd, imp-guest (its /init) mounts
/// `imp.lower`; without, the kernel mounts vda and runs imp-guest from it. `handed`: a confined
/// QEMU (its sandbox on, TAPs by descriptor).
pub fn qemu_args(
    plan: &VmPlan,
    files: &QemuFiles,
    accel: &str,
    handed: Option<&Handed>,
) -> Vec<String> {
    let mem = format!("{}M", plan.memory_mib);
    let mut a: Vec<String> = vec![
        "-name".into(),
        "imp-vm".into(),
        "-accel".into(),
        accel_arg(accel),
        "-machine".into(),
        "pc,memory-backend=mem0".into(),
        "-object".into(),
        format!("memory-backend-memfd,id=mem0,size={mem},share=on"),
        "-m".into(),
        mem,
        "-smp".into(),
        plan.vcpu.to_string(),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        // The guest halts by rebooting (imp.halt=reboot): QEMU exits, as Firecracker does.
        "-no-reboot".into(),
        "-kernel".into(),
        plan.kernel.display().to_string(),
    ];
    let mut cmdline = plan.boot_args.clone();
    match &plan.initrd {
        Some(initrd) => {
            a.extend(["-initrd".into(), initrd.display().to_string()]);
            cmdline.push_str(" imp.lower=/dev/vda");
        }
        None => cmdline.push_str(" root=/dev/vda ro"),
    }
    a.extend(["-append".into(), cmdline]);
    for (i, d) in plan.drives.iter().enumerate() {
        a.extend([
            "-drive".into(),
            format!(
                "id=drive{i},file={},format=raw,if=none{}",
                d.path.display(),
                if d.read_only { ",readonly=on" } else { "" }
            ),
            "-device".into(),
            format!("virtio-blk-pci,drive=drive{i}"),
        ]);
    }
    for (i, n) in plan.nics.iter().enumerate() {
        let attach = match handed.and_then(|h| h.tap_fds.get(i)) {
            Some(fd) => format!("fd={fd}"),
            None => format!("ifname={},script=no,downscript=no", n.tap),
        };
        a.extend([
            "-netdev".into(),
            format!("tap,id={},{attach}", n.id),
            "-device".into(),
            format!("virtio-net-pci,netdev={},mac={}", n.id, n.mac),
        ]);
    }
    // A VM generation ID: every `-incoming` (a resume, a clone of a template) gets a new one,
    // so the guest kernel reseeds its generator by itself on a restore (docs/snapshots.md).
    a.extend(["-device".into(), VMGENID_DEVICE.into()]);
    a.extend([
        "-chardev".into(),
        format!("socket,id=vsock0,path={}", files.vhost_sock.display()),
        "-device".into(),
        // The guest CID is the device process's (vhost_args), not a QEMU property. The id lets
        // a suspend unplug it (vhost-user-vsock is unmigratable) and a resume plug it back.
        format!("{VSOCK_DEVICE},chardev=vsock0,id={VSOCK_ID}"),
        "-chardev".into(),
        format!(
            "file,id=serial0,path={},append=on",
            files.serial_log.display()
        ),
        "-serial".into(),
        "chardev:serial0".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", files.qmp_sock.display()),
    ]);
    if handed.is_some() {
        a.extend(["-sandbox".into(), SANDBOX.into()]);
    }
    a
}

const VSOCK_DEVICE: &str = "vhost-user-vsock-pci";
/// `guid=auto`: a new generation ID at each start, including each incoming migration.
pub const VMGENID_DEVICE: &str = "vmgenid,guid=auto";
/// The name a suspend's migration descriptor gets in QEMU (`getfd`).
const MIGRATION_FD: &str = "impsuspend";
const VSOCK_ID: &str = "vsock0dev";
/// Hot-unplug needs the guest's ACPI eject; a TCG guest on a loaded host takes seconds.
const UNPLUG_TIMEOUT: Duration = Duration::from_secs(60);
/// Migration to a file of a few hundred MiB: seconds, far longer under TCG and load.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(300);

/// The command line of a QEMU that loads a suspend's migration stream from descriptor
/// `state_fd`: the same devices as the source had when it migrated (no vsock device:
/// `finish_incoming` plugs it). A descriptor, not `exec:cat` (QEMU 7.2 has no `file:`): a
/// sandboxed QEMU may not spawn, and a confined one may not open the runtime's file.
pub fn incoming_args(
    plan: &VmPlan,
    files: &QemuFiles,
    accel: &str,
    handed: Option<&Handed>,
    state_fd: RawFd,
) -> Vec<String> {
    let mut a = qemu_args(plan, files, accel, handed);
    if let Some(i) = a.iter().position(|x| x.starts_with(VSOCK_DEVICE)) {
        a.drain(i - 1..=i);
    }
    a.extend(["-incoming".into(), format!("fd:{state_fd}")]);
    a
}

/// Start QEMU loading a suspend's migration stream from `state` (its vsock device already
/// listening).
pub async fn spawn_qemu_incoming(
    cfg: &QemuConfig,
    files: &QemuFiles,
    plan: &VmPlan,
    cgroups: &[PathBuf],
    jail: Option<&VmJail>,
    state: &Path,
) -> Result<Proc, QemuError> {
    let accel = resolve_accel(cfg.accel, kvm_usable());
    let stream = std::fs::File::open(state).map_err(|e| QemuError::StartFailed {
        what: "QEMU",
        message: format!("open {}: {e}", state.display()),
        log: String::new(),
    })?;
    let fd = stream.as_raw_fd();
    spawn_qemu_args(cfg, files, plan, accel, cgroups, jail, Some(fd), |h| {
        incoming_args(plan, files, accel, h, fd)
    })
    .await
}

/// Wait until no process has `path` open (a migration's writer may hold the stream a moment
/// after QEMU reports it complete). False on timeout.
pub async fn wait_file_closed(path: &Path, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if !open_anywhere(path) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Processes (pid, command) holding TAP `tap` open (`iff:` in a tun fd's fdinfo).
pub fn tap_holders(tap: &str) -> Vec<(i32, String)> {
    let want = format!("iff:\t{tap}");
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|p| {
            let pid: i32 = p.file_name().to_str()?.parse().ok()?;
            let holds = std::fs::read_dir(p.path().join("fdinfo"))
                .into_iter()
                .flatten()
                .flatten()
                .any(|fd| {
                    std::fs::read_to_string(fd.path())
                        .is_ok_and(|t| t.lines().any(|l| l.trim_end() == want))
                });
            holds.then(|| {
                let comm = std::fs::read_to_string(p.path().join("cmdline"))
                    .unwrap_or_default()
                    .replace('\0', " ");
                (pid, comm.trim().to_string())
            })
        })
        .collect()
}

/// Wait until no process holds TAP `tap` (QEMU opens it exclusively); the holders on timeout.
pub async fn wait_tap_free(tap: &str, timeout: Duration) -> Result<(), Vec<(i32, String)>> {
    let deadline = Instant::now() + timeout;
    loop {
        let h = tap_holders(tap);
        if h.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(h);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn open_anywhere(path: &Path) -> bool {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return false;
    };
    procs.flatten().any(|p| {
        std::fs::read_dir(p.path().join("fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l == path))
    })
}

/// Spawn `bin args` through the seam (`process::spawn_detached`), stdout/stderr to `log`,
/// inheriting `keep`, confined to `jail` (with an empty environment) when given.
fn spawn_logged(
    what: &'static str,
    bin: &Path,
    args: &[String],
    log: &Path,
    cgroups: &[PathBuf],
    keep: &[RawFd],
    jail: Option<Jail>,
) -> Result<Proc, QemuError> {
    let failed = |message: String| QemuError::StartFailed {
        what,
        message,
        log: serial::tail(log),
    };
    let jailed = |source| QemuError::Jail {
        what,
        source,
        log: serial::tail(log),
    };
    let out =
        process::append_log(log).map_err(|e| failed(format!("open {}: {e}", log.display())))?;
    // A confined process's log is its VM's, 0600: imp-agent (uid 0 without capabilities, which
    // mounts the VM directories) would read a root-owned one as its owner.
    if let Some(j) = &jail {
        jail::own(log, j.vm.id, 0o600)
            .map_err(|e| failed(format!("own {}: {e}", log.display())))?;
    }
    let err = out
        .try_clone()
        .map_err(|e| failed(format!("dup {}: {e}", log.display())))?;
    let mut cmd = std::process::Command::new(bin);
    cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
    let prepared = match jail {
        Some(j) => {
            // Nothing of the runtime's environment reaches a confined process.
            cmd.env_clear();
            Some(j.prepare().map_err(jailed)?)
        }
        None => None,
    };
    let (pid, start_time) =
        process::spawn_detached(cmd, cgroups, keep, prepared).map_err(|e| match e {
            SpawnError::Jail { source, .. } => jailed(source),
            e => failed(e.to_string()),
        })?;
    let start_time = start_time.ok_or_else(|| failed("exited immediately".into()))?;
    Ok(Proc { pid, start_time })
}

/// Start vhost-device-vsock and wait until it listens (QEMU connects to it at startup).
/// `record` is called with the process as soon as it exists.
pub async fn spawn_vhost(
    cfg: &QemuConfig,
    files: &QemuFiles,
    guest_cid: u32,
    cgroups: &[PathBuf],
    jail: Option<&VmJail>,
) -> Result<Proc, QemuError> {
    let _ = std::fs::remove_file(&files.vhost_sock);
    let jail = match jail {
        Some(vm) => Some(Jail {
            vm: vm.clone(),
            rw_dirs: vec![files.dir.clone()],
            ro_files: vec![cfg.vhost_vsock_bin.clone()],
            devices: Vec::new(),
            seccomp: Some(jail::vhost_filter().map_err(|source| QemuError::Jail {
                what: "vhost-device-vsock",
                source,
                log: String::new(),
            })?),
        }),
        None => None,
    };
    let p = spawn_logged(
        "vhost-device-vsock",
        &cfg.vhost_vsock_bin,
        &vhost_args(files, guest_cid),
        &files.vhost_log,
        cgroups,
        &[],
        jail,
    )?;
    let deadline = Instant::now() + READY_TIMEOUT;
    while !files.vhost_sock.exists() {
        let failed = |message: String| QemuError::StartFailed {
            what: "vhost-device-vsock",
            message,
            log: serial::tail(&files.vhost_log),
        };
        if !p.is_alive() {
            return Err(failed("exited before it listened".into()));
        }
        if Instant::now() >= deadline {
            p.kill().await;
            return Err(failed(format!(
                "{} did not appear within {READY_TIMEOUT:?}",
                files.vhost_sock.display()
            )));
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(p)
}

/// Start QEMU for `plan` (its vsock device already listening) and wait until QMP answers.
pub async fn spawn_qemu(
    cfg: &QemuConfig,
    files: &QemuFiles,
    plan: &VmPlan,
    cgroups: &[PathBuf],
    jail: Option<&VmJail>,
) -> Result<Proc, QemuError> {
    let accel = resolve_accel(cfg.accel, kvm_usable());
    spawn_qemu_args(cfg, files, plan, accel, cgroups, jail, None, |h| {
        qemu_args(plan, files, accel, h)
    })
    .await
}

/// What a confined QEMU of `plan` sees: its directory read-write; its kernel, initrd, drives
/// outside that directory and its binary read-only; `/dev/kvm` when it uses KVM.
pub fn qemu_jail(
    cfg: &QemuConfig,
    files: &QemuFiles,
    plan: &VmPlan,
    accel: &str,
    vm: &VmJail,
) -> Jail {
    let mut ro_files = vec![cfg.qemu_bin.clone(), plan.kernel.clone()];
    ro_files.extend(plan.initrd.iter().cloned());
    ro_files.extend(
        plan.drives
            .iter()
            .filter(|d| !d.path.starts_with(&files.dir))
            .map(|d| d.path.clone()),
    );
    Jail {
        vm: vm.clone(),
        rw_dirs: vec![files.dir.clone()],
        ro_files,
        devices: if accel == "kvm" {
            vec![Device::Kvm]
        } else {
            Vec::new()
        },
        seccomp: None,
    }
}

/// How long a TAP may stay busy after the QEMU that held it was killed.
const TAP_BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// Attach to `name`, waiting while it is busy: a killed QEMU's leader is reaped before its last
/// thread has closed the TAP, and TUNSETIFF fails with EBUSY for that moment (a boot after a
/// failed restore, a restore again, a resume all reuse the VM's TAP).
async fn open_tap(name: &str) -> Result<OwnedFd, tap::TapError> {
    let deadline = Instant::now() + TAP_BUSY_TIMEOUT;
    loop {
        match tap::open(name) {
            Err(tap::TapError::Open { source, .. })
                if source.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            r => return r,
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn spawn_qemu_args(
    cfg: &QemuConfig,
    files: &QemuFiles,
    plan: &VmPlan,
    accel: &str,
    cgroups: &[PathBuf],
    jail: Option<&VmJail>,
    stream: Option<RawFd>,
    args: impl FnOnce(Option<&Handed>) -> Vec<String>,
) -> Result<Proc, QemuError> {
    let failed = |message: String| QemuError::StartFailed {
        what: "QEMU",
        message,
        log: serial::tail(&files.qemu_log),
    };
    // A confined QEMU cannot attach to its TAPs itself: the runtime does, and hands them over.
    let mut taps: Vec<OwnedFd> = Vec::new();
    if jail.is_some() {
        for n in &plan.nics {
            taps.push(open_tap(&n.tap).await.map_err(|e| failed(e.to_string()))?);
        }
    }
    let handed = jail.map(|_| Handed {
        tap_fds: taps.iter().map(|t| t.as_raw_fd()).collect(),
    });
    let mut keep: Vec<RawFd> = taps.iter().map(|t| t.as_raw_fd()).collect();
    keep.extend(stream);
    let confined = jail.map(|vm| qemu_jail(cfg, files, plan, accel, vm));
    // The console QEMU appends to: made here, the VM's and 0600, for the same reason as its log
    // (a job may print anything to it).
    if let Some(vm) = jail {
        process::append_log(&files.serial_log)
            .and_then(|_| jail::own(&files.serial_log, vm.id, 0o600))
            .map_err(|e| failed(format!("own {}: {e}", files.serial_log.display())))?;
    }
    let args = args(handed.as_ref());
    let p = spawn_logged(
        "QEMU",
        &cfg.qemu_bin,
        &args,
        &files.qemu_log,
        cgroups,
        &keep,
        confined,
    )?;
    // QEMU holds its own copies now.
    drop(taps);
    let qmp = Qmp::new(&files.qmp_sock);
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let failed = |message: String| QemuError::StartFailed {
            what: "QEMU",
            message,
            log: serial::tail(&files.qemu_log),
        };
        if !p.is_alive() {
            return Err(failed("exited during startup".into()));
        }
        if files.qmp_sock.exists() && qmp.execute("query-status", None).await.is_ok() {
            return Ok(p);
        }
        if Instant::now() >= deadline {
            return Err(failed(format!(
                "QMP socket {} did not answer within {READY_TIMEOUT:?}",
                files.qmp_sock.display()
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}

impl QemuVm {
    /// The VM runs while QEMU does (its vsock device is supervised with it: see `kill`).
    pub fn is_alive(&self) -> bool {
        self.qemu.is_alive()
    }

    /// QEMU answers on QMP and its vsock device lives (a VM without it cannot be talked to).
    pub async fn probe(&self) -> bool {
        self.vhost.is_none_or(|v| v.is_alive())
            && self.qmp.execute("query-status", None).await.is_ok()
    }

    /// Ctrl-Alt-Del to the guest (imp-guest, PID 1, halts: QEMU exits with -no-reboot), then
    /// SIGKILL after `timeout`; the vsock device goes with it.
    pub async fn stop(&self, timeout: Duration) {
        if self.qemu.is_alive() {
            let keys = json!({"keys": [
                {"type": "qcode", "data": "ctrl"},
                {"type": "qcode", "data": "alt"},
                {"type": "qcode", "data": "delete"}
            ]});
            match self.qmp.execute("send-key", Some(keys)).await {
                Ok(_) if self.qemu.wait_gone(timeout).await => {}
                Ok(_) => {
                    tracing::debug!(pid = self.qemu.pid, "guest did not stop in time; killing")
                }
                Err(e) => {
                    tracing::debug!(pid = self.qemu.pid, error = %e, "send-key failed; killing")
                }
            }
        }
        self.kill().await;
    }

    /// SIGKILL QEMU, then its vsock device; returns once both are gone.
    pub async fn kill(&self) {
        self.qemu.kill().await;
        if let Some(v) = &self.vhost {
            v.kill().await;
        }
    }

    pub async fn pause(&self) -> Result<(), QmpError> {
        self.qmp.execute("stop", None).await.map(|_| ())
    }

    pub async fn resume(&self) -> Result<(), QmpError> {
        self.qmp.execute("cont", None).await.map(|_| ())
    }

    /// Suspend's snapshot: unplug the vsock device (unmigratable) while the guest runs, stop,
    /// migrate the whole VM into `state`, wait until the stream is complete. On error the
    /// device is plugged back (the caller resumes the VM).
    pub async fn migrate_to_file(&self, state: &Path) -> Result<(), QmpError> {
        let refused = |desc: String| QmpError::Refused {
            command: "migrate".into(),
            desc,
        };
        self.qmp
            .execute("device_del", Some(json!({"id": VSOCK_ID})))
            .await?;
        let deadline = Instant::now() + UNPLUG_TIMEOUT;
        while self.has_vsock().await? {
            if Instant::now() >= deadline {
                return Err(refused(format!(
                    "the guest did not release the vsock device within {UNPLUG_TIMEOUT:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let r = async {
            self.qmp.execute("stop", None).await?;
            // The stream goes to a descriptor the runtime opened (see `incoming_args`).
            use std::os::fd::AsFd as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(state)
                .map_err(|e| refused(format!("open {}: {e}", state.display())))?;
            self.qmp
                .execute_with_fd(
                    file.as_fd(),
                    MIGRATION_FD,
                    "migrate",
                    Some(json!({"uri": format!("fd:{MIGRATION_FD}")})),
                )
                .await?;
            let deadline = Instant::now() + MIGRATE_TIMEOUT;
            loop {
                let m = self.qmp.execute("query-migrate", None).await?;
                match m.get("status").and_then(|s| s.as_str()).unwrap_or("") {
                    "completed" => return Ok(()),
                    "failed" | "cancelled" => {
                        return Err(refused(format!(
                            "migration {}",
                            m.get("error-desc")
                                .and_then(|s| s.as_str())
                                .unwrap_or("failed")
                        )));
                    }
                    _ if Instant::now() >= deadline => {
                        let _ = self.qmp.execute("migrate_cancel", None).await;
                        return Err(refused(format!("not complete within {MIGRATE_TIMEOUT:?}")));
                    }
                    _ => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        }
        .await;
        if r.is_err() {
            let _ = self.plug_vsock().await;
        }
        r
    }

    async fn has_vsock(&self) -> Result<bool, QmpError> {
        let list = self
            .qmp
            .execute("qom-list", Some(json!({"path": "/machine/peripheral"})))
            .await?;
        Ok(list
            .as_array()
            .is_some_and(|a| a.iter().any(|p| p["name"] == VSOCK_ID)))
    }

    async fn plug_vsock(&self) -> Result<(), QmpError> {
        self.qmp
            .execute(
                "device_add",
                Some(json!({"driver": VSOCK_DEVICE, "chardev": "vsock0", "id": VSOCK_ID})),
            )
            .await
            .map(|_| ())
    }

    /// A resume's second half: wait until the incoming migration has loaded (QEMU paused), run
    /// the guest, plug the vsock device back into the running guest and wait for its driver.
    /// Plugged while the restored guest was still paused, the device now and then never came up
    /// on a loaded host (the guest's hotplug stalled before or right after the driver's probe,
    /// every connect was reset: about one QEMU restore in six with two busy loops beside it);
    /// plugged into the running guest, as any hotplug, and connected to only once the driver
    /// took it, 15 restores and 3 resumes under the same load all answered.
    pub async fn finish_incoming(&self, deadline: Instant) -> Result<(), QmpError> {
        loop {
            let st = self.qmp.execute("query-status", None).await?;
            match st.get("status").and_then(|s| s.as_str()).unwrap_or("") {
                "inmigrate" if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                "paused" | "postmigrate" | "prelaunch" | "running" => break,
                other => {
                    return Err(QmpError::Refused {
                        command: "-incoming".into(),
                        desc: format!("QEMU is {other:?} instead of paused after the migration"),
                    });
                }
            }
        }
        self.resume().await?;
        self.plug_vsock().await?;
        self.wait_vsock_driver(deadline).await;
        Ok(())
    }

    /// Wait until the guest's driver has taken the re-plugged vsock device (DRIVER_OK in
    /// `x-query-virtio-status`, QEMU 7.2 on) before the first connect: a connection the
    /// vhost-user backend takes while the guest still probes the device can be lost (as
    /// connections arriving before a device reset completed were in Firecracker, its PR 5882).
    /// Best effort, at most 10 s: a QEMU without the command, or a guest that never gets there,
    /// is left to the Hello wait (and a clone to its restore again).
    async fn wait_vsock_driver(&self, deadline: Instant) {
        let path = format!("/machine/peripheral/{VSOCK_ID}/virtio-backend");
        let until = deadline.min(Instant::now() + Duration::from_secs(10));
        while Instant::now() < until {
            let Ok(st) = self
                .qmp
                .execute("x-query-virtio-status", Some(json!({"path": path})))
                .await
            else {
                return;
            };
            let ready = st["status"]["statuses"].as_array().is_some_and(|a| {
                a.iter().any(|s| {
                    s.as_str()
                        .is_some_and(|s| s.starts_with("VIRTIO_CONFIG_S_DRIVER_OK"))
                })
            });
            if ready {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm::{DrivePlan, NicPlan};

    fn plan() -> VmPlan {
        VmPlan {
            vcpu: 2,
            memory_mib: 512,
            kernel: "/images/vmlinuz".into(),
            initrd: Some("/images/initrd.img".into()),
            boot_args: "console=ttyS0 reboot=k panic=1".into(),
            drives: vec![
                DrivePlan {
                    id: "rootfs",
                    path: "/cache/base.ext4".into(),
                    read_only: true,
                    root: true,
                },
                DrivePlan {
                    id: "writable",
                    path: "/vms/a/writable.img".into(),
                    read_only: false,
                    root: false,
                },
            ],
            nics: vec![NicPlan {
                id: "eth0",
                tap: "imp0123abcd".into(),
                mac: "06:00:01:23:ab:cd".into(),
            }],
            guest_cid: 3,
            vsock: "/vms/a/vsock.sock".into(),
        }
    }

    fn files() -> QemuFiles {
        QemuFiles::in_dir(
            Path::new("/vms/a"),
            Path::new("/vms/a/api.sock"),
            Path::new("/vms/a/vsock.sock"),
            Path::new("/vms/a/serial.log"),
        )
    }

    fn after<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
        args.windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].as_str())
            .collect()
    }

    #[test]
    fn memory_is_a_shared_memfd_the_vsock_device_can_map() {
        let a = qemu_args(&plan(), &files(), "tcg", None);
        assert_eq!(
            after(&a, "-object"),
            ["memory-backend-memfd,id=mem0,size=512M,share=on"]
        );
        assert_eq!(after(&a, "-machine"), ["pc,memory-backend=mem0"]);
        assert_eq!(after(&a, "-m"), ["512M"]);
        assert_eq!(after(&a, "-smp"), ["2"]);
        assert_eq!(after(&a, "-accel"), ["tcg,tb-size=64"]);
        let k = qemu_args(&plan(), &files(), "kvm", None);
        assert_eq!(after(&k, "-accel"), ["kvm"]);
    }

    #[test]
    fn drives_keep_their_order_and_the_base_is_read_only() {
        let a = qemu_args(&plan(), &files(), "kvm", None);
        assert_eq!(
            after(&a, "-drive"),
            [
                "id=drive0,file=/cache/base.ext4,format=raw,if=none,readonly=on",
                "id=drive1,file=/vms/a/writable.img,format=raw,if=none",
            ]
        );
        let devices = after(&a, "-device");
        assert_eq!(devices[0], "virtio-blk-pci,drive=drive0");
        assert_eq!(devices[1], "virtio-blk-pci,drive=drive1");
    }

    #[test]
    fn network_console_vsock_and_qmp_are_wired_to_the_vm_files() {
        let a = qemu_args(&plan(), &files(), "kvm", None);
        assert_eq!(
            after(&a, "-netdev"),
            ["tap,id=eth0,ifname=imp0123abcd,script=no,downscript=no"]
        );
        assert!(after(&a, "-device").contains(&"virtio-net-pci,netdev=eth0,mac=06:00:01:23:ab:cd"));
        assert_eq!(
            after(&a, "-chardev"),
            [
                "socket,id=vsock0,path=/vms/a/vhost.sock",
                "file,id=serial0,path=/vms/a/serial.log,append=on",
            ]
        );
        assert!(after(&a, "-device").contains(&"vhost-user-vsock-pci,chardev=vsock0,id=vsock0dev"));
        assert!(after(&a, "-device").contains(&"vmgenid,guid=auto"));
        let inc = incoming_args(&plan(), &files(), "kvm", None, 9);
        assert!(
            after(&inc, "-device").contains(&"vmgenid,guid=auto"),
            "a restore gets a new generation id"
        );
        assert_eq!(
            after(&a, "-qmp"),
            ["unix:/vms/a/api.sock,server=on,wait=off"]
        );
        assert!(a.contains(&"-no-reboot".to_string()));
    }

    #[test]
    fn the_root_comes_from_the_initrd_or_the_kernel() {
        let a = qemu_args(&plan(), &files(), "tcg", None);
        assert_eq!(after(&a, "-initrd"), ["/images/initrd.img"]);
        assert_eq!(
            after(&a, "-append"),
            ["console=ttyS0 reboot=k panic=1 imp.lower=/dev/vda"]
        );
        let bare = VmPlan {
            initrd: None,
            ..plan()
        };
        let a = qemu_args(&bare, &files(), "tcg", None);
        assert!(after(&a, "-initrd").is_empty());
        assert_eq!(
            after(&a, "-append"),
            ["console=ttyS0 reboot=k panic=1 root=/dev/vda ro"]
        );
    }

    #[test]
    fn a_confined_qemu_gets_its_taps_by_descriptor_and_its_sandbox() {
        let handed = Handed { tap_fds: vec![7] };
        let a = qemu_args(&plan(), &files(), "kvm", Some(&handed));
        assert_eq!(after(&a, "-netdev"), ["tap,id=eth0,fd=7"]);
        assert_eq!(
            after(&a, "-sandbox"),
            ["on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
        );
        assert!(after(&qemu_args(&plan(), &files(), "kvm", None), "-sandbox").is_empty());
        let inc = incoming_args(&plan(), &files(), "kvm", Some(&handed), 9);
        assert_eq!(after(&inc, "-incoming"), ["fd:9"]);
        assert!(
            !inc.iter().any(|x| x.starts_with(VSOCK_DEVICE)),
            "the vsock device is plugged after the migration"
        );
    }

    #[test]
    fn a_confined_qemu_sees_its_boot_files_and_kvm_only_when_it_uses_it() {
        let cfg = QemuConfig {
            qemu_bin: "/usr/bin/qemu-system-x86_64".into(),
            vhost_vsock_bin: "/usr/local/bin/vhost-device-vsock".into(),
            accel: Accel::Auto,
        };
        let vm = VmJail {
            id: 900_001,
            mount_point: "/s/jail".into(),
        };
        let j = qemu_jail(&cfg, &files(), &plan(), "kvm", &vm);
        assert_eq!(j.rw_dirs, [PathBuf::from("/vms/a")]);
        // The writable drive is in the VM directory: not bound on its own.
        let ro: Vec<_> = j.ro_files.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(
            ro,
            [
                "/usr/bin/qemu-system-x86_64",
                "/images/vmlinuz",
                "/images/initrd.img",
                "/cache/base.ext4"
            ]
        );
        assert_eq!(j.devices, [Device::Kvm]);
        assert!(
            qemu_jail(&cfg, &files(), &plan(), "tcg", &vm)
                .devices
                .is_empty()
        );
        assert!(j.seccomp.is_none(), "QEMU's own sandbox");
    }

    #[test]
    fn vhost_device_serves_the_hybrid_socket_for_the_guest_cid() {
        assert_eq!(
            vhost_args(&files(), 3),
            [
                "--guest-cid",
                "3",
                "--socket",
                "/vms/a/vhost.sock",
                "--uds-path",
                "/vms/a/vsock.sock"
            ]
        );
    }

    #[test]
    fn auto_accel_is_kvm_only_when_kvm_opens() {
        assert_eq!(resolve_accel(Accel::Auto, true), "kvm");
        assert_eq!(resolve_accel(Accel::Auto, false), "tcg");
        assert_eq!(resolve_accel(Accel::Tcg, true), "tcg");
        assert_eq!(resolve_accel(Accel::Kvm, false), "kvm");
    }
}
