//! DELETE, and what a VM holds on the host besides its process (TAP, writable drive, base
//! image reference, sockets, cgroup).

use std::time::Duration;

use tokio::time::Instant;

use super::net::attachment_of;
use super::{Runtime, RuntimeError, valid_uid, vm};
use crate::api::VmState;
use crate::inventory::VmRecord;
use crate::procfs;
use crate::rootfs::writable::WritableDrives;
use crate::tap;
use crate::vmm::Proc;

/// How `remove_vm` ends a VM's process.
#[derive(Debug, Clone, Copy)]
pub(super) enum Stop {
    /// Ask the guest to reboot first (DELETE of a VM that may be running a job).
    Graceful,
    /// SIGKILL at once (a start interrupted by a restart: no guest worth waiting for).
    Kill,
}

impl Runtime {
    /// Stop and remove VM `uid`: a bring-up in progress is cancelled, then the process
    /// (SendCtrlAltDel, then SIGKILL), TAP, disks, files and row go. Idempotent: an unknown uid
    /// is already deleted.
    pub async fn delete(&self, uid: &str) -> Result<(), RuntimeError> {
        if !valid_uid(uid) {
            return Err(RuntimeError::InvalidUid(uid.into()));
        }
        let lock = self.lock(uid);
        let _guard = lock.lock().await;
        let cancelled = self.inflight.lock().expect("in-flight table").remove(uid);
        if let Some(f) = cancelled {
            tracing::info!(uid, "cancelling the VM's bring-up");
            f.abort.abort();
            // The task stops at its next await; wait for that so nothing it does races the
            // removal below.
            while !f.abort.is_finished() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let Some(r) = self.inventory.get(uid).await? else {
            return Ok(());
        };
        self.remove_vm(&r, Stop::Graceful).await?;
        self.refresh_state_gauge().await;
        tracing::info!(uid, "VM deleted");
        Ok(())
    }

    /// Kill every VMM process of the row (the recorded one, and any other whose sockets lie in
    /// its directory: one spawned by a bring-up cancelled before it recorded the pid), release
    /// its host resources, remove its directory and row.
    pub(super) async fn remove_vm(&self, r: &VmRecord, how: Stop) -> Result<(), RuntimeError> {
        self.remove_snapshot(r);
        if let Some(vmm) = vm::of_record(r) {
            match how {
                Stop::Graceful => vmm.stop(self.cfg.stop_timeout).await,
                Stop::Kill => vmm.kill().await,
            }
        }
        let jail = vm::jail_root_of(r);
        let jailed = match (&jail, self.jails_dir()) {
            (Some(root), Some(jails)) => procfs::jailed_vmms(&jails)
                .into_iter()
                .filter(|(_, _, sock)| sock.starts_with(root))
                .collect(),
            _ => Vec::new(),
        };
        for (pid, start, _) in procfs::firecrackers_under(&r.dir).into_iter().chain(jailed) {
            tracing::warn!(uid = %r.uid, pid, "killing an unrecorded VMM process of this VM");
            Proc {
                pid,
                start_time: start,
            }
            .kill()
            .await;
        }
        let net = self.net_lock.lock().await;
        self.release_host_resources(r).await;
        let _ = std::fs::remove_dir_all(&r.dir);
        // The jail: `<base>/<exec name>/<uid>`, above its root.
        if let Some(dir) = jail
            .as_deref()
            .and_then(|root| root.parent())
            .filter(|d| d.file_name().is_some_and(|n| n == r.uid.as_str()))
            && let Err(e) = std::fs::remove_dir_all(dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(uid = %r.uid, dir = %dir.display(), error = %e, "jail removal failed");
        }
        self.inventory.delete(&r.uid).await?;
        if attachment_of(r).is_some() {
            self.reconcile_network_after_release(&net, &r.uid).await;
            if r.state == VmState::Suspended {
                self.sync_wake_counters().await;
            }
        }
        if r.state == VmState::Suspended {
            self.refresh_snapshot_gauge().await;
        }
        Ok(())
    }

    /// TAP, the per-VM writable disk and the base image reference: what a VM holds on the host
    /// besides its process.
    pub(super) async fn release_host_resources(&self, r: &VmRecord) {
        if let Some(t) = &r.tap
            && let Err(e) = tap::delete(t)
        {
            tracing::warn!(uid = %r.uid, tap = %t, error = %e, "TAP delete failed");
        }
        if let Some(d) = &r.writable_disk
            && let Err(e) = WritableDrives::remove(d)
        {
            tracing::warn!(uid = %r.uid, error = %e, "writable drive delete failed");
        }
        if let Err(e) = self.rootfs.release(&r.uid).await {
            tracing::warn!(uid = %r.uid, error = %e, "releasing the base image reference failed");
        }
        let _ = std::fs::remove_file(&r.api_socket);
        let _ = std::fs::remove_file(&r.vsock_path);
        // Only once its processes are gone (every caller has killed them by now; a helper of
        // the VMM, e.g. the simulator's guest keeper, may take a moment longer to exit).
        if let Some(cg) = &self.cgroups {
            let procs = cg.dir(&r.uid).join("cgroup.procs");
            let deadline = Instant::now() + Duration::from_secs(5);
            while std::fs::read_to_string(&procs).is_ok_and(|p| !p.trim().is_empty())
                && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        if let Some(cg) = &self.cgroups
            && let Err(e) = cg.remove(&r.uid)
        {
            tracing::warn!(uid = %r.uid, error = %e, "VM cgroup removal failed");
        }
    }
}
