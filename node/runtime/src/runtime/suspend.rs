//! Snapshot, suspend and resume of a running VM: one measured path for suspend and resume
//! (timing, the `*_seconds` histograms, failures counted by operation and reason, logs).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

use super::net::attachment_of;
use super::{ControlError, Runtime, RuntimeError, Vm, valid_uid, vm};
use crate::api::{Backend, ResumeInfo, SnapshotInfo, SuspendInfo, VmSpec, VmState, VmStatus};
use crate::firecracker;
use crate::inventory::VmRecord;
use crate::metrics::{BackendLabel, OperationReasonLabel};
use crate::qemu::{self, QemuFiles, QemuVm};
use crate::vmm;

/// The two transitions that share one measured path (`Runtime::measured`).
#[derive(Debug, Clone, Copy)]
enum Transition {
    Suspend,
    Resume,
}

impl Transition {
    /// The `operation` label of `imp_runtime_suspend_failures_total`.
    fn operation(self) -> &'static str {
        match self {
            Transition::Suspend => "suspend",
            Transition::Resume => "resume",
        }
    }

    fn done(self) -> &'static str {
        match self {
            Transition::Suspend => "suspended",
            Transition::Resume => "resumed",
        }
    }
}

impl Runtime {
    /// Pause, write a full snapshot into the VM directory, resume (unless `resume` is false).
    pub async fn snapshot(&self, uid: &str, resume: bool) -> Result<SnapshotInfo, RuntimeError> {
        let lock = self.lock(uid);
        let _guard = lock.lock().await;
        let r = self.running(uid, "snapshot").await?;
        let vmm = match vm::of_record(&r) {
            Some(Vm::Firecracker(v)) => v,
            Some(other) => {
                return Err(RuntimeError::SnapshotUnsupported {
                    uid: uid.into(),
                    backend: other.backend(),
                });
            }
            None => return Err(RuntimeError::NotFound(uid.into())),
        };
        let dir = vm::snapshot_dir(&r);
        let info = SnapshotInfo {
            snapshot_path: dir.join("snapshot.vmstate"),
            mem_file_path: dir.join("snapshot.mem"),
        };
        let err = |source: firecracker::ApiClientError| RuntimeError::Snapshot {
            uid: uid.into(),
            source: source.into(),
        };
        vmm.pause().await.map_err(err)?;
        let created = vmm
            .snapshot_create(&info.snapshot_path, &info.mem_file_path)
            .await;
        // Resume even when the snapshot failed: a paused runner is worse than no snapshot.
        if resume || created.is_err() {
            vmm.resume().await.map_err(err)?;
        }
        created.map_err(err)?;
        private(&[info.snapshot_path.clone(), info.mem_file_path.clone()]);
        Ok(info)
    }

    /// Pause, write a full snapshot into the VM directory, stop the VMM; disks, TAP and
    /// address stay (state Suspended). A failure leaves the VM Running.
    pub async fn suspend(&self, uid: &str) -> Result<SuspendInfo, RuntimeError> {
        let started = Instant::now();
        let lock = self.lock(uid);
        let _guard = lock.lock().await;
        let r = self.running(uid, "suspend").await?;
        let vm = vm::of_record(&r).ok_or_else(|| RuntimeError::NotFound(uid.into()))?;
        let (snapshot_bytes, took) = self
            .measured(Transition::Suspend, &r, started, self.suspend_vm(&r, &vm))
            .await?;
        Ok(SuspendInfo {
            snapshot_bytes,
            took_ms: took.as_millis() as u64,
        })
    }

    /// Load the snapshot of a Suspended VM into a fresh VMM, resume it, wait for the guest
    /// agent's Hello (state Running). A failure leaves it Suspended, its snapshot kept.
    pub async fn resume(&self, uid: &str) -> Result<ResumeInfo, RuntimeError> {
        if !valid_uid(uid) {
            return Err(RuntimeError::InvalidUid(uid.into()));
        }
        let started = Instant::now();
        let lock = self.lock(uid);
        let _guard = lock.lock().await;
        let mut r = self
            .observe(uid)
            .await?
            .ok_or_else(|| RuntimeError::NotFound(uid.into()))?;
        if r.state != VmState::Suspended {
            return Err(RuntimeError::NotSuspended {
                uid: uid.into(),
                state: r.state,
            });
        }
        let deadline = started + self.cfg.boot_timeout;
        // The row as read, for the accounting; `r` gets the new VMM's process.
        let row = r.clone();
        let ((), took) = self
            .measured(
                Transition::Resume,
                &row,
                started,
                self.resume_vm(&mut r, deadline),
            )
            .await?;
        let rec = self
            .inventory
            .get(uid)
            .await?
            .ok_or_else(|| RuntimeError::NotFound(uid.into()))?;
        Ok(ResumeInfo {
            status: VmStatus::from(&rec),
            took_ms: took.as_millis() as u64,
        })
    }

    /// Run `work`, the suspend or resume of row `r` asked for at `started`, and account for it
    /// the same way for both: its duration in `imp_runtime_{suspend,resume}_seconds` by
    /// backend and a log line; a failure logged and counted by operation and reason.
    async fn measured<T>(
        &self,
        transition: Transition,
        r: &VmRecord,
        started: Instant,
        work: impl Future<Output = Result<T, RuntimeError>>,
    ) -> Result<(T, Duration), RuntimeError> {
        let backend = r.backend.as_str();
        let operation = transition.operation();
        match work.await {
            Ok(out) => {
                let took = started.elapsed();
                let seconds = match transition {
                    Transition::Suspend => &self.metrics.suspend_seconds,
                    Transition::Resume => &self.metrics.resume_seconds,
                };
                seconds
                    .get_or_create(&BackendLabel {
                        backend: backend.into(),
                    })
                    .observe(took.as_secs_f64());
                tracing::info!(uid = %r.uid, backend, seconds = took.as_secs_f64(), "VM {}", transition.done());
                Ok((out, took))
            }
            Err(e) => {
                tracing::warn!(uid = %r.uid, backend, error = %e, "VM {operation} failed");
                self.metrics
                    .suspend_failures
                    .get_or_create(&OperationReasonLabel {
                        operation: operation.into(),
                        reason: e.reason().into(),
                    })
                    .inc();
                Err(e)
            }
        }
    }

    async fn suspend_vm(&self, r: &VmRecord, vm: &Vm) -> Result<u64, RuntimeError> {
        let uid = r.uid.as_str();
        self.inventory.set_state(uid, VmState::Suspending).await?;
        self.refresh_state_gauge().await;
        let [state, mem] = snapshot_files(&vm::snapshot_dir(r));
        let written: Result<(), ControlError> = match vm {
            Vm::Firecracker(v) => async {
                v.pause().await?;
                v.snapshot_create(&state, &mem).await
            }
            .await
            .map_err(Into::into),
            Vm::Qemu(q) => q.migrate_to_file(&mem).await.map_err(Into::into),
        };
        if let Err(source) = written {
            tracing::warn!(uid, error = %source, "snapshot failed; resuming the VM");
            if let Err(e) = vm.resume().await {
                tracing::warn!(uid, error = %e, "resume after a failed suspend failed");
            }
            self.remove_snapshot(r);
            self.inventory.set_state(uid, VmState::Running).await?;
            self.refresh_state_gauge().await;
            return Err(RuntimeError::Snapshot {
                uid: uid.into(),
                source,
            });
        }
        private(&[state.clone(), mem.clone()]);
        // Recorded before the VMM goes: a restart in between finds a Suspended row with a
        // leftover VMM, kills it and keeps the snapshot (recover::row_action).
        self.inventory.set_suspended(uid).await?;
        vm.kill().await;
        if matches!(vm, Vm::Qemu(_)) && !qemu::wait_file_closed(&mem, SNAPSHOT_WRITER_TIMEOUT).await
        {
            tracing::warn!(
                uid,
                "the migration's writer still holds the snapshot; a resume may find it incomplete"
            );
        }
        let _ = std::fs::remove_file(&r.api_socket);
        // The wake counter for the VM's address (docs/suspend.md).
        if attachment_of(r).is_some() {
            self.sync_wake_counters().await;
        }
        self.refresh_state_gauge().await;
        self.refresh_snapshot_gauge().await;
        Ok(snapshot_bytes(&vm::snapshot_dir(r)))
    }

    /// Resuming, a fresh VMM from the snapshot, the guest agent's Hello, Running. A failure
    /// kills what was started and records the VM Suspended again.
    async fn resume_vm(&self, r: &mut VmRecord, deadline: Instant) -> Result<(), RuntimeError> {
        let uid = &r.uid.clone();
        self.inventory.set_state(uid, VmState::Resuming).await?;
        self.refresh_state_gauge().await;
        let resumed = match self.load_snapshot(r, deadline).await {
            Ok(vm) => {
                let hello = vmm::wait_for_hello(
                    &r.vsock_path,
                    &r.serial_log,
                    || vm.is_alive(),
                    deadline,
                    vmm::Detect::Resumed,
                )
                .await;
                match hello {
                    Ok(_) => Ok(vm),
                    Err(e) => Err((format!("no guest agent Hello: {e}"), Some(vm))),
                }
            }
            Err(e) => Err(e),
        };
        if let Err((message, vm)) = resumed {
            if let Some(vm) = vm {
                vm.kill().await;
            }
            self.inventory.set_suspended(uid).await?;
            self.refresh_state_gauge().await;
            return Err(RuntimeError::Resume {
                uid: uid.into(),
                message,
            });
        }
        self.inventory.set_state(uid, VmState::Running).await?;
        // The snapshot is consumed: the guest ran past it (a later suspend writes a new one).
        self.remove_snapshot(r);
        if attachment_of(r).is_some() {
            self.sync_wake_counters().await;
        }
        self.refresh_state_gauge().await;
        self.refresh_snapshot_gauge().await;
        Ok(())
    }

    /// A fresh VMM for the row (recorded as soon as it exists), its snapshot loaded and the
    /// guest running. On error, the message and the process to kill.
    async fn load_snapshot(
        &self,
        r: &mut VmRecord,
        deadline: Instant,
    ) -> Result<Vm, (String, Option<Vm>)> {
        let uid = &r.uid.clone();
        let spec: VmSpec = serde_json::from_str(&r.spec_json)
            .map_err(|e| (format!("recorded spec: {e}"), None))?;
        let [state, mem] = snapshot_files(&vm::snapshot_dir(r));
        if !mem.is_file() {
            return Err((format!("snapshot {} is missing", mem.display()), None));
        }
        let files = vm::files_of(r);
        // A jailed Firecracker's jailer makes its cgroups itself.
        let procs = if files.jail.is_some() {
            Vec::new()
        } else {
            self.vm_cgroup(uid, &spec)
                .map_err(|e| (format!("cgroup: {e}"), None))?
        };
        // The dead VMM's sockets: the new one binds the same paths.
        let _ = std::fs::remove_file(&r.api_socket);
        let _ = std::fs::remove_file(&r.vsock_path);
        match r.backend {
            Backend::Firecracker => {
                let jail = match files.jail {
                    Some(_) => self.vm_jail(r).map_err(|e| (e.to_string(), None))?,
                    None => None,
                };
                let vmm = match &jail {
                    Some(j) => {
                        let plan = self.plan_of(r, &spec);
                        self.spawn_jailed(r, &spec, &files, &plan, j.id, &[])
                            .await
                            .map_err(|e| (e.to_string(), None))?
                            .0
                    }
                    None => firecracker::spawn(&self.cfg.firecracker_bin, uid, &files, &procs)
                        .map_err(|e| (e.to_string(), None))?,
                };
                let vm = Vm::Firecracker(vmm.clone());
                let fail = |m: String| (m, Some(vm.clone()));
                self.record_vmm(r, vmm.process)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                vmm.wait_api_ready()
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                vmm.snapshot_load(&state, &mem, true)
                    .await
                    .map_err(|e| fail(format!("snapshot load: {e}")))?;
                if let Some(j) = &jail {
                    firecracker::jailer::expose_vsock(&files.vsock, &r.vsock_path, j.id)
                        .map_err(|e| fail(e.to_string()))?;
                }
                Ok(vm)
            }
            Backend::Qemu => {
                let files = QemuFiles::in_dir(&r.dir, &r.api_socket, &r.vsock_path, &r.serial_log);
                let plan = self.plan_of(r, &spec);
                let jail = self.vm_jail(r).map_err(|e| (e.to_string(), None))?;
                let jail = jail.as_ref();
                if let Some(tap) = &r.tap
                    && let Err(holders) = qemu::wait_tap_free(tap, SNAPSHOT_WRITER_TIMEOUT).await
                {
                    return Err((format!("TAP {tap} is still held by {holders:?}"), None));
                }
                let (vhost, helper_only) = self
                    .spawn_restore_helper(r, &files, plan.guest_cid, &procs, jail)
                    .await?;
                // The TAP may stay busy a moment after the old QEMU went: spawn waits for it.
                let proc =
                    qemu::spawn_qemu_incoming(&self.cfg.qemu, &files, &plan, &procs, jail, &mem)
                        .await
                        .map_err(|e| (e.to_string(), Some(helper_only.clone())))?;
                let q = self.record_restored_qemu(r, &files, proc, vhost).await?;
                let vm = Vm::Qemu(q.clone());
                let fail = |m: String| (m, Some(vm.clone()));
                q.finish_incoming(deadline)
                    .await
                    .map_err(|e| fail(format!("incoming migration: {e}")))?;
                Ok(vm)
            }
        }
    }

    /// A QEMU restore's vsock helper (vhost-device-vsock), recorded on row `r` as soon as it
    /// runs (a resume and a clone start it the same way). Also the helper alone as a [`Vm`], for
    /// the caller to kill when a later step fails; on error, the message and what to kill.
    pub(super) async fn spawn_restore_helper(
        &self,
        r: &mut VmRecord,
        files: &QemuFiles,
        guest_cid: u32,
        cgroups: &[PathBuf],
        jail: Option<&crate::jail::VmJail>,
    ) -> Result<(vmm::Proc, Vm), (String, Option<Vm>)> {
        let vhost = qemu::spawn_vhost(&self.cfg.qemu, files, guest_cid, cgroups, jail)
            .await
            .map_err(|e| (e.to_string(), None))?;
        let helper_only = Vm::Qemu(QemuVm {
            qemu: vhost,
            vhost: None,
            qmp: qemu::Qmp::new(&files.qmp_sock),
        });
        self.inventory
            .set_helper(&r.uid, vhost.pid, vhost.start_time)
            .await
            .map_err(|e| (e.to_string(), Some(helper_only.clone())))?;
        r.helper_pid = Some(vhost.pid);
        r.helper_start_time = Some(vhost.start_time);
        Ok((vhost, helper_only))
    }

    /// A QEMU restore's QEMU `proc` with its vsock helper `vhost`, recorded on row `r` at once
    /// (a resume and a clone record it the same way); on error, the message and what to kill.
    pub(super) async fn record_restored_qemu(
        &self,
        r: &mut VmRecord,
        files: &QemuFiles,
        proc: vmm::Proc,
        vhost: vmm::Proc,
    ) -> Result<QemuVm, (String, Option<Vm>)> {
        let q = QemuVm {
            qemu: proc,
            vhost: Some(vhost),
            qmp: qemu::Qmp::new(&files.qmp_sock),
        };
        self.record_vmm(r, proc)
            .await
            .map_err(|e| (e.to_string(), Some(Vm::Qemu(q.clone()))))?;
        Ok(q)
    }

    pub(super) async fn refresh_snapshot_gauge(&self) {
        let Ok(rows) = self.inventory.list().await else {
            return;
        };
        let total: u64 = rows
            .iter()
            .filter(|r| r.state == VmState::Suspended)
            .map(|r| snapshot_bytes(&vm::snapshot_dir(r)))
            .sum();
        self.metrics.snapshot_bytes.set(total as i64);
    }

    /// The snapshot files of a suspend (consumed by a resume, or the VM deleted).
    pub(super) fn remove_snapshot(&self, r: &VmRecord) {
        for f in snapshot_files(&vm::snapshot_dir(r)) {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// Allocated bytes of a VM's suspend snapshot (a sparse memory file counts what it holds).
fn snapshot_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    snapshot_files(dir)
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// Snapshot files readable and writable by their owner only (the VM's uid when confined):
/// guest memory is no one else's to read.
fn private(files: &[PathBuf]) {
    use std::os::unix::fs::PermissionsExt as _;
    for f in files {
        let _ = std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600));
    }
}

/// How long the writer of a QEMU migration stream may take to flush it after QEMU is gone.
const SNAPSHOT_WRITER_TIMEOUT: Duration = Duration::from_secs(120);

/// The files `suspend` writes into a VM's directory (names differ from `snapshot`'s, which
/// leaves the VM running).
fn snapshot_files(dir: &Path) -> [PathBuf; 2] {
    [dir.join("suspend.vmstate"), dir.join("suspend.mem")]
}
