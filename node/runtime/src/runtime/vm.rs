//! A recorded VM's process(es), whichever backend runs them: what the runtime asks of a VM
//! (alive, probe, stop, kill, pause, resume). It sits above the backends and the seam: the
//! backends know nothing of it.

use std::path::PathBuf;
use std::time::Duration;

use crate::api::Backend;
use crate::firecracker::{self, Vmm, VmmFiles, jailer};
use crate::inventory::VmRecord;
use crate::qemu::{self, QemuVm};
use crate::vmm::Proc;

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
            Vm::Firecracker(v) => (v.process.pid, v.process.start_time),
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

/// The VM a row records (none before its VMM was spawned).
pub(super) fn of_record(r: &VmRecord) -> Option<Vm> {
    let (pid, start_time) = (r.pid?, r.start_time?);
    Some(match r.backend {
        Backend::Firecracker => Vm::Firecracker(Vmm {
            process: Proc { pid, start_time },
            files: files_of(r),
            client: firecracker::FirecrackerClient::new(&r.api_socket),
        }),
        Backend::Qemu => Vm::Qemu(QemuVm {
            qemu: Proc { pid, start_time },
            vhost: r
                .helper_pid
                .zip(r.helper_start_time)
                .map(|(pid, start_time)| Proc { pid, start_time }),
            qmp: qemu::Qmp::new(&r.api_socket),
        }),
    })
}

/// The jail root of a row's jailed Firecracker: the inventory records it as the directory of
/// the VM's API socket (an unjailed VM's socket is in its own directory).
pub(super) fn jail_root_of(r: &VmRecord) -> Option<PathBuf> {
    if r.backend != Backend::Firecracker {
        return None;
    }
    let parent = r.api_socket.parent()?;
    (parent != r.dir).then(|| parent.to_path_buf())
}

/// Where a row's snapshots are written: its jail (the VMM writes them), or its directory.
pub(super) fn snapshot_dir(r: &VmRecord) -> PathBuf {
    jail_root_of(r).unwrap_or_else(|| r.dir.clone())
}

/// The files of a row's Firecracker process: in its directory, or (API socket, vsock socket,
/// Firecracker's log) in its jail; the console and stderr the runtime opens stay in the
/// directory.
pub(super) fn files_of(r: &VmRecord) -> VmmFiles {
    let jail = jail_root_of(r);
    VmmFiles {
        api_sock: r.api_socket.clone(),
        vsock: jail
            .as_ref()
            .map_or_else(|| r.vsock_path.clone(), |j| j.join(jailer::VSOCK)),
        serial_log: r.serial_log.clone(),
        stderr_log: r.dir.join("firecracker.stderr"),
        vmm_log: jail.as_ref().map_or_else(
            || r.dir.join("firecracker.log"),
            |j| j.join(jailer::VMM_LOG),
        ),
        jail,
    }
}
