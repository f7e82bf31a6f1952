//! The VMM seam: what the runtime does with a VM's process(es), whichever backend runs them
//! (Firecracker, or QEMU with its vsock device). Inventory, reattach, disks, TAP, the vsock
//! client and metrics stay above it; each backend's module owns its own protocol.

use std::path::{Path, PathBuf};
use std::time::Duration;

use imp_guest::protocol::{AGENT_VSOCK_PORT, Hello};
use tokio::time::Instant;

use crate::api::{Backend, Readiness};
use crate::firecracker::{self, DriverError};
use crate::qemu::{self, QemuVm};
use crate::runtime::serial;

/// How often the boot wait looks at the process and the serial console.
const WATCH: Duration = Duration::from_millis(100);
/// Bytes of the guest console quoted in failure reasons.
pub const TAIL_BYTES: u64 = 2048;
const PANIC_MARKER: &str = "Kernel panic";

/// A VM's running process(es).
#[derive(Debug, Clone)]
pub enum Vm {
    Firecracker(firecracker::Vmm),
    Qemu(QemuVm),
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Firecracker(#[from] firecracker::ApiClientError),
    #[error(transparent)]
    Qmp(#[from] qemu::QmpError),
}

impl Vm {
    pub fn backend(&self) -> Backend {
        match self {
            Vm::Firecracker(_) => Backend::Firecracker,
            Vm::Qemu(_) => Backend::Qemu,
        }
    }

    /// The VMM process (pid, start time).
    pub fn process(&self) -> (i32, u64) {
        match self {
            Vm::Firecracker(v) => (v.pid, v.start_time),
            Vm::Qemu(v) => (v.qemu.pid, v.qemu.start_time),
        }
    }

    /// Every process of the VM (the VMM and its helpers), for the orphan sweep.
    pub fn processes(&self) -> Vec<(i32, u64)> {
        let mut out = vec![self.process()];
        if let Vm::Qemu(QemuVm { vhost: Some(v), .. }) = self {
            out.push((v.pid, v.start_time));
        }
        out
    }

    pub fn is_alive(&self) -> bool {
        match self {
            Vm::Firecracker(v) => v.is_alive(),
            Vm::Qemu(v) => v.is_alive(),
        }
    }

    /// The VMM answers on its control socket (and a QEMU VM's vsock device lives).
    pub async fn probe(&self) -> bool {
        match self {
            Vm::Firecracker(v) => v.client.describe_instance().await.is_ok(),
            Vm::Qemu(v) => v.probe().await,
        }
    }

    /// Ask the guest to stop, SIGKILL after `timeout`; returns once every process is gone.
    pub async fn stop(&self, timeout: Duration) {
        match self {
            Vm::Firecracker(v) => v.stop(timeout).await,
            Vm::Qemu(v) => v.stop(timeout).await,
        }
    }

    pub async fn kill(&self) {
        match self {
            Vm::Firecracker(v) => v.kill().await,
            Vm::Qemu(v) => v.kill().await,
        }
    }

    pub async fn pause(&self) -> Result<(), ControlError> {
        match self {
            Vm::Firecracker(v) => Ok(v.pause().await?),
            Vm::Qemu(v) => Ok(v.pause().await?),
        }
    }

    pub async fn resume(&self) -> Result<(), ControlError> {
        match self {
            Vm::Firecracker(v) => Ok(v.resume().await?),
            Vm::Qemu(v) => Ok(v.resume().await?),
        }
    }
}

/// Wait for the guest agent's Hello through the hybrid vsock until `deadline`, watching the
/// VM and its serial console so a dead or panicked guest fails at once. The answer after `OK`
/// is opaque (Firecracker names a host port, vhost-device-vsock the guest's).
pub async fn wait_for_hello(
    vsock: &Path,
    serial_log: &Path,
    alive: impl Fn() -> bool,
    deadline: Instant,
) -> Result<Hello, DriverError> {
    let connect = imp_guest::host::connect(vsock, AGENT_VSOCK_PORT, deadline);
    let watch = async {
        loop {
            tokio::time::sleep(WATCH).await;
            let console = serial::tail(serial_log, TAIL_BYTES);
            if console.contains(PANIC_MARKER) {
                return DriverError::GuestPanicked {
                    serial_tail: console,
                };
            }
            if !alive() {
                return DriverError::GuestExited {
                    serial_tail: console,
                };
            }
        }
    };
    tokio::select! {
        r = connect => match r {
            Ok(client) => Ok(client.hello().clone()),
            Err(imp_guest::host::HostError::Timeout { last, .. }) => Err(DriverError::GuestAgentTimeout {
                detail: last,
                serial_tail: serial::tail(serial_log, TAIL_BYTES),
            }),
            Err(e) => Err(DriverError::GuestProtocol(e.to_string())),
        },
        e = watch => Err(e),
    }
}

/// `/dev/kvm` opens read-write.
pub fn kvm_usable() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("cgroup path {0} holds a NUL byte")]
    NulInCgroup(PathBuf),
    #[error("spawn {bin}: {source}")]
    Spawn { bin: String, source: std::io::Error },
}

/// Spawn `cmd` in a session of its own (no controlling terminal, no parent-death signal: the
/// runtime dying never takes a VM with it) and, with `cgroup` (a `cgroup.procs` file), inside
/// that cgroup from before it execs, so none of its memory is ever charged to the runtime's.
/// A task reaps it if it exits while this runtime is its parent. Returns its pid and start
/// time (none when it has already exited).
pub fn spawn_detached(
    mut cmd: std::process::Command,
    cgroup: Option<&Path>,
) -> Result<(i32, Option<u64>), SpawnError> {
    use std::os::unix::process::CommandExt as _;
    let procs = cgroup
        .map(|p| {
            std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
                .map_err(|_| SpawnError::NulInCgroup(p.to_path_buf()))
        })
        .transpose()?;
    // SAFETY: between fork and exec only async-signal-safe calls, no allocation: setsid,
    // getpid, open/write/close of a path prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            if let Some(procs) = &procs {
                enter_cgroup(procs)?;
            }
            Ok(())
        });
    }
    let bin = cmd.get_program().to_string_lossy().into_owned();
    let mut child = tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn()
        .map_err(|source| SpawnError::Spawn { bin, source })?;
    let pid = child.id().expect("a just-spawned child has a pid") as i32;
    tokio::spawn(async move {
        let _ = child.wait().await;
    });
    Ok((pid, crate::procfs::start_time(pid)))
}

/// Write this process's pid into `procs` (a `cgroup.procs` file). Runs in a forked child:
/// formats on the stack, calls only async-signal-safe functions.
fn enter_cgroup(procs: &std::ffi::CStr) -> std::io::Result<()> {
    let mut buf = [0u8; 20];
    let mut n = unsafe { libc::getpid() } as u64;
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // SAFETY: a valid C string and a stack buffer; the fd is closed on every path.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let written = libc::write(fd, buf[i..].as_ptr().cast(), buf.len() - i);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if written < 0 {
            return Err(err);
        }
    }
    Ok(())
}

/// What the host has for a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    pub kvm: bool,
    /// Each binary the backend runs, and whether it is there.
    pub bins: Vec<(String, bool)>,
    pub kernel: (String, bool),
}

/// Whether a node with `backend` and these facts can run VMs, and why not: Firecracker needs
/// KVM; QEMU runs without it (TCG), only slower.
pub fn readiness(backend: Backend, facts: &HostFacts) -> Readiness {
    let mut not_ready = Vec::new();
    if backend == Backend::Firecracker && !facts.kvm {
        not_ready.push("/dev/kvm cannot be opened read-write (Firecracker needs KVM)".to_string());
    }
    for (bin, present) in &facts.bins {
        if !present {
            not_ready.push(format!("{bin} is not a file"));
        }
    }
    if !facts.kernel.1 {
        not_ready.push(format!("kernel {} is not a file", facts.kernel.0));
    }
    Readiness {
        backend,
        kvm: facts.kvm,
        vmm_bin: facts.bins.iter().all(|(_, p)| *p),
        kernel: facts.kernel.1,
        not_ready,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(kvm: bool, bins: bool, kernel: bool) -> HostFacts {
        HostFacts {
            kvm,
            bins: vec![("/usr/bin/qemu-system-x86_64".into(), bins)],
            kernel: ("/var/lib/imp/vmlinux".into(), kernel),
        }
    }

    #[test]
    fn firecracker_needs_kvm_qemu_does_not() {
        let fc = readiness(Backend::Firecracker, &facts(false, true, true));
        assert!(!fc.ready());
        assert!(fc.not_ready[0].contains("/dev/kvm"), "{:?}", fc.not_ready);
        let q = readiness(Backend::Qemu, &facts(false, true, true));
        assert!(q.ready(), "{:?}", q.not_ready);
        assert_eq!((q.backend, q.kvm), (Backend::Qemu, false));
    }

    #[test]
    fn every_missing_piece_is_named() {
        let r = readiness(Backend::Qemu, &facts(true, false, false));
        assert_eq!(r.not_ready.len(), 2, "{:?}", r.not_ready);
        assert!(r.not_ready[0].contains("qemu-system-x86_64"));
        assert!(r.not_ready[1].contains("/var/lib/imp/vmlinux"));
        assert!(!r.vmm_bin && !r.kernel);
        assert!(readiness(Backend::Firecracker, &facts(true, true, true)).ready());
    }
}
