//! The runtime's start: open the state directory, inventory, rootfs cache and cgroups; the
//! startup reconciliation after a restart (or crash) of the runtime (observe each row's
//! process, apply the pure `recover::row_action`, sweep orphans, stray directories and
//! cgroups); the serial-log cap task.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use imp_api::names::reason;

use super::net::rows_have_network;
use super::teardown::Stop;
use super::{Config, Runtime, RuntimeError, SERIAL_CHECK, recover, vm};
use crate::api::VmState;
use crate::cgroup::VmCgroups;
use crate::firecracker::jailer;
use crate::inventory::Inventory;
use crate::metrics::Metrics;
use crate::procfs;
use crate::rootfs::store::RootfsStore;
use crate::rootfs::writable::WritableDrives;
use crate::vmm::Proc;
use crate::vmm::serial;

impl Runtime {
    /// Open the inventory and reconcile it with the host (see `recover`).
    pub async fn start(cfg: Config) -> Result<Arc<Self>, RuntimeError> {
        let vms_dir = cfg.state_dir.join("vms");
        std::fs::create_dir_all(&vms_dir).map_err(|source| RuntimeError::StateDir {
            path: vms_dir.clone(),
            source,
        })?;
        if cfg.backend == crate::api::Backend::Firecracker && cfg.jail.is_some() {
            match &cfg.jailer {
                Some(j) => {
                    let version = jailer::preflight(j, &cfg.firecracker_bin)
                        .map_err(RuntimeError::JailerPreflight)?;
                    std::fs::create_dir_all(&j.chroot_base).map_err(|source| {
                        RuntimeError::StateDir {
                            path: j.chroot_base.clone(),
                            source,
                        }
                    })?;
                    tracing::info!(jailer = %j.bin.display(), version, chroot_base = %j.chroot_base.display(), "Firecracker runs through its jailer");
                }
                None => tracing::warn!(
                    "no --jailer-path: Firecracker runs unconfined (as the runtime, on the host's filesystem)"
                ),
            }
        }
        let mount_point = super::jail_mount_point(&cfg.state_dir);
        std::fs::create_dir_all(&mount_point).map_err(|source| RuntimeError::StateDir {
            path: mount_point.clone(),
            source,
        })?;
        let inventory = Inventory::open(&cfg.state_dir).await?;
        let metrics = Metrics::new();
        let rootfs = RootfsStore::open(
            cfg.rootfs.clone(),
            inventory.pool().clone(),
            metrics.rootfs.clone(),
        )
        .await
        .map_err(RuntimeError::RootfsStore)?;
        let writable = WritableDrives::new(&cfg.state_dir.join("writable-templates"))
            .map_err(RuntimeError::WritableTemplates)?;
        let cgroups = cfg
            .vm_cgroups
            .as_ref()
            .map(VmCgroups::open)
            .transpose()
            .map_err(RuntimeError::Cgroups)?;
        let vmm_facts = match cfg.backend {
            crate::api::Backend::Qemu => super::template::qemu_facts(&cfg.qemu),
            crate::api::Backend::Firecracker => {
                super::template::firecracker_facts(&cfg.firecracker_bin)
            }
        };
        let (templates, interrupted) = super::template::Templates::open(
            &cfg.state_dir.join("templates"),
            vmm_facts,
            cfg.template_budget_bytes,
        )
        .map_err(RuntimeError::Templates)?;
        let rt = Arc::new(Self {
            cfg,
            vms_dir,
            inventory,
            rootfs,
            writable,
            cgroups,
            metrics,
            locks: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            net_lock: tokio::sync::Mutex::new(()),
            jail_lock: Mutex::new(()),
            templates,
        });
        rt.forget_interrupted_builds(&interrupted);
        rt.recover().await?;
        rt.gc_templates().await;
        rt.refresh_template_gauges();
        tokio::spawn(Self::build_templates(Arc::downgrade(&rt)));
        rt.readiness();
        tokio::spawn(Self::cap_serial_logs(Arc::downgrade(&rt)));
        Ok(rt)
    }

    /// Keep every VM's console log under its cap (see `serial`), for as long as the runtime
    /// lives.
    pub(super) async fn cap_serial_logs(rt: std::sync::Weak<Self>) {
        let mut tick = tokio::time::interval(SERIAL_CHECK);
        loop {
            tick.tick().await;
            let Some(rt) = rt.upgrade() else { return };
            let Ok(rows) = rt.inventory.list().await else {
                continue;
            };
            let cap = rt.cfg.serial_log_cap_bytes;
            for r in rows {
                if let Err(e) = serial::enforce(&r.serial_log, cap) {
                    tracing::warn!(uid = %r.uid, error = %e, "capping the serial log failed");
                }
            }
        }
    }

    /// Startup reconciliation after a restart (or crash) of the runtime; `recover::row_action`
    /// decides per row, then VMM processes under the state dir that no kept row owns are
    /// killed and VM directories without a row removed.
    pub(super) async fn recover(&self) -> Result<(), RuntimeError> {
        use recover::{Process, RowAction};
        let mut keep: Vec<(i32, u64)> = Vec::new();
        for r in self.inventory.list().await? {
            let vmm = vm::of_record(&r);
            let process = match &vmm {
                None => Process::NotRecorded,
                Some(v) if !v.is_alive() => Process::Gone,
                Some(_) if !recover::needs_probe(r.state) => Process::Silent,
                Some(v) if v.probe().await => Process::Answering,
                Some(_) => Process::Silent,
            };
            match recover::row_action(r.state, process) {
                RowAction::Keep => {}
                RowAction::Reattach => {
                    let v = vmm.expect("an answering process is recorded");
                    tracing::info!(uid = %r.uid, pid = v.process().0, backend = v.backend().as_str(), "reattached to running VM");
                    if r.state == VmState::Resuming {
                        self.inventory.set_state(&r.uid, VmState::Running).await?;
                        self.remove_snapshot(&r);
                    }
                    keep.extend(v.processes());
                    self.metrics.recovered("reattached");
                }
                RowAction::ResumeRunning => {
                    let v = vmm.expect("an answering process is recorded");
                    tracing::warn!(uid = %r.uid, pid = v.process().0, "suspend interrupted by a restart; resuming the VM");
                    if let Err(e) = v.resume().await {
                        tracing::warn!(uid = %r.uid, error = %e, "resume after an interrupted suspend failed");
                    }
                    self.inventory.set_state(&r.uid, VmState::Running).await?;
                    self.remove_snapshot(&r);
                    keep.extend(v.processes());
                    self.metrics.recovered("suspend_undone");
                }
                RowAction::KillKeepSuspended => {
                    let v = vmm.expect("a live process is recorded");
                    tracing::warn!(uid = %r.uid, pid = v.process().0, "killing the VMM a suspend left running");
                    v.kill().await;
                    self.inventory.set_suspended(&r.uid).await?;
                    self.metrics.recovered("suspended");
                }
                RowAction::BackToSuspended => {
                    tracing::info!(uid = %r.uid, "resume interrupted before its VMM started; VM stays Suspended");
                    self.inventory.set_suspended(&r.uid).await?;
                    self.metrics.recovered("suspended");
                }
                RowAction::MarkExited => {
                    tracing::warn!(uid = %r.uid, pid = ?r.pid, "VM process died while the runtime was down");
                    self.inventory.set_state(&r.uid, VmState::Exited).await?;
                    self.metrics.recovered("exited");
                }
                RowAction::KillAndFail => {
                    let v = vmm.expect("a silent process is recorded");
                    tracing::warn!(uid = %r.uid, pid = v.process().0, "VM process does not answer its API; killing");
                    v.kill().await;
                    self.release_host_resources(&r).await;
                    self.inventory
                        .set_failed(
                            &r.uid,
                            reason::FIRECRACKER_UNRESPONSIVE,
                            "API socket did not answer after a runtime restart",
                        )
                        .await?;
                    self.metrics.recovered("unresponsive_killed");
                }
                RowAction::CleanUp => {
                    tracing::info!(uid = %r.uid, state = r.state.as_str(), "cleaning up a VM start interrupted by a restart");
                    self.remove_vm(&r, Stop::Kill).await?;
                    self.metrics.recovered("cleaned");
                }
            }
        }
        let mut found = procfs::firecrackers_under(&self.vms_dir);
        let jails = self.jails_dir();
        if let Some(j) = &jails {
            found.extend(procfs::jailed_vmms(j));
        }
        for (pid, start, sock) in recover::orphans(&found, &keep) {
            tracing::warn!(pid, sock = %sock.display(), "killing orphan VMM process of this runtime");
            Proc {
                pid,
                start_time: start,
            }
            .kill()
            .await;
            self.metrics.recovered("orphan_killed");
        }
        let rows = self.inventory.list().await?;
        let known: Vec<&Path> = rows.iter().map(|r| r.dir.as_path()).collect();
        let entries: Vec<PathBuf> = std::fs::read_dir(&self.vms_dir)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        for dir in recover::stray_dirs(&entries, &known) {
            tracing::info!(dir = %dir.display(), "removing VM directory without an inventory row");
            let _ = std::fs::remove_dir_all(&dir);
        }
        // Jails without a row (their VM was cleaned up, or its start crashed early).
        let jail_dirs: Vec<PathBuf> = jails
            .as_ref()
            .and_then(|j| std::fs::read_dir(j).ok())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        let uids: Vec<&Path> = rows.iter().map(|r| Path::new(r.uid.as_str())).collect();
        for dir in jail_dirs {
            if dir
                .file_name()
                .is_some_and(|n| !uids.iter().any(|u| u.as_os_str() == n))
            {
                tracing::info!(dir = %dir.display(), "removing a jail without an inventory row");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        if let Some(cg) = &self.cgroups {
            for uid in cg.list() {
                if !rows.iter().any(|r| r.uid == uid) {
                    tracing::info!(uid, "removing VM cgroup without an inventory row");
                    let _ = cg.remove(&uid);
                }
            }
        }
        // Image references of VMs that were cleaned up above, or whose start crashed between
        // taking the reference and writing anything else.
        let mut holders: Vec<String> = rows
            .into_iter()
            .filter(|r| r.state != VmState::Failed)
            .map(|r| r.uid)
            .collect();
        // Templates hold their base image like a VM does.
        holders.extend(self.templates.holders());
        self.rootfs
            .retain_vms(&holders)
            .await
            .map_err(RuntimeError::RootfsStore)?;
        // Running VMs keep (or get back) their bridge port and rules; what cleaned-up rows
        // held goes. A failure leaves the runtime serving: the next PUT or DELETE retries.
        let net = self.net_lock.lock().await;
        if let Err(e) = self.reconcile_network(&net, "(startup)").await {
            tracing::warn!(error = %e, "network reconcile at startup failed");
        }
        drop(net);
        if rows_have_network(&self.inventory.list().await?) {
            self.sync_wake_counters().await;
        }
        self.refresh_state_gauge().await;
        self.refresh_snapshot_gauge().await;
        Ok(())
    }
}
