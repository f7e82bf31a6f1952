//! PUT: a VM from its spec to Running (or a recorded failure): the row first, then in a task
//! of the runtime the base image, writable drive, network, cgroup, the backend's process(es)
//! and the guest agent's Hello.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use imp_guest::host::Announcements;
use tokio::time::Instant;

use super::{Ensured, InFlight, Runtime, RuntimeError, Vm, valid_uid, validate, vm};
use crate::api::{Backend, Failure, StartKind, StartReport, VmSpec, VmState, VmStatus};
use crate::firecracker::jailer::{self, Place};
use crate::firecracker::{self, BootPlan, VmmFiles};
use crate::inventory::{InventoryError, VmRecord};
use crate::jail::{self, VmJail};
use crate::metrics::ReasonLabel;
use crate::qemu::{self, QemuFiles, QemuVm};
use crate::rootfs::store::ImageSpec;
use crate::tap;
use crate::vmm::{self, DriverError, Proc, VmPlan};

/// How long a clone whose restore failed waits for its TAP to be free before booting.
const TAP_FREE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a clone's restore (fresh VMM to Hello) may take before it boots instead (at most
/// the boot timeout): a TCG clone on a loaded host restores in about a second.
const RESTORE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
/// How long a restored clone may be silent before it is restored again (once): a restored
/// guest says Hello within a few hundred milliseconds even under TCG on a loaded host. A QEMU
/// clone whose re-plugged vsock device never came up (qemu/mod.rs `finish_incoming`: seen while
/// the device was plugged before the guest ran, not since) is idle and unreachable for good; a
/// fresh VMM and vsock helper do not share that fate.
const RESTORED_HELLO_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);
/// Restores of one clone before it boots instead.
const RESTORE_ATTEMPTS: u32 = 2;

impl Runtime {
    /// The request's host paths resolved under the image directories (400 naming the field
    /// otherwise); the runtime's own kernel and initrd are trusted configuration.
    pub(super) fn resolve_paths(&self, spec: &VmSpec) -> Result<VmSpec, RuntimeError> {
        let dirs = &self.cfg.image_dirs;
        let check = |field, p: &Option<PathBuf>| {
            p.as_ref()
                .map(|p| validate::allowed_file(field, p, dirs))
                .transpose()
                .map_err(RuntimeError::InvalidSpec)
        };
        Ok(VmSpec {
            base_disk: check("base_disk", &spec.base_disk)?,
            kernel: check("kernel", &spec.kernel)?,
            initrd: check("initrd", &spec.initrd)?,
            ..spec.clone()
        })
    }

    /// Ensure VM `uid` runs `spec`: idempotent; a second PUT with the same spec returns the
    /// recorded state (including a recorded failure, or Creating/Booting while a bring-up is
    /// in progress) and never starts a second process. The bring-up runs in a task of the
    /// runtime: whatever happens to this request, it ends Running or Failed (or is cancelled
    /// by a DELETE).
    pub async fn ensure_running(
        self: &Arc<Self>,
        uid: &str,
        spec: VmSpec,
    ) -> Result<(Ensured, VmStatus), RuntimeError> {
        if !valid_uid(uid) {
            return Err(RuntimeError::InvalidUid(uid.into()));
        }
        validate::spec(&spec).map_err(RuntimeError::InvalidSpec)?;
        let resolved = self.resolve_paths(&spec)?;
        // Stored and compared as asked and without pull credentials: they are used for this
        // request only. `from_template` and `warm_paths` are how, not what: the same VM either way.
        let stored = VmSpec {
            image: spec.image.as_ref().map(ImageSpec::without_credentials),
            from_template: false,
            warm_paths: Vec::new(),
            ..spec.clone()
        };
        let spec_json = serde_json::to_string(&stored).expect("spec serialises");
        let task = {
            let lock = self.lock(uid);
            let _guard = lock.lock().await;
            if let Some(r) = self.observe(uid).await? {
                if r.spec_json != spec_json {
                    return Err(RuntimeError::SpecConflict(uid.into()));
                }
                if let (VmState::Failed, Some(reason)) = (r.state, &r.failure_reason) {
                    return Err(RuntimeError::Failed {
                        uid: uid.into(),
                        failure: Failure {
                            reason: reason.clone(),
                            message: r.failure_message.clone().unwrap_or_default(),
                        },
                    });
                }
                return Ok((Ensured::Existing, VmStatus::from(&r)));
            }
            if let Some(asked) = spec.writable_disk_bytes {
                let (used, budget) = self.disk_usage().await?;
                validate::disk_budget(used, asked, budget).map_err(|source| {
                    RuntimeError::DiskBudgetExceeded {
                        uid: uid.into(),
                        source,
                    }
                })?;
            }
            let rec = self.new_record(uid, &spec, spec_json);
            // Row first: whatever happens next, a restarted runtime finds it and can undo it.
            self.inventory.insert(&rec).await?;
            self.refresh_state_gauge().await;
            self.spawn_bring_up(rec, resolved)
        };
        match task.await {
            Ok(Ok(rec)) => Ok((Ensured::Created, VmStatus::from(&rec))),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(RuntimeError::StartCancelled {
                uid: uid.into(),
                detail: e.to_string(),
            }),
        }
    }

    /// Start the bring-up task and register it (under the in-flight table's lock, so the task
    /// cannot finish and deregister before it is registered).
    pub(super) fn spawn_bring_up(
        self: &Arc<Self>,
        rec: VmRecord,
        spec: VmSpec,
    ) -> tokio::task::JoinHandle<Result<VmRecord, RuntimeError>> {
        let rt = self.clone();
        let uid = rec.uid.clone();
        let mut inflight = self.inflight.lock().expect("in-flight table");
        let task = tokio::spawn(async move {
            let uid = rec.uid.clone();
            let out = rt.create(rec, &spec).await;
            let mut inflight = rt.inflight.lock().expect("in-flight table");
            if inflight
                .get(&uid)
                .is_some_and(|f| f.id == tokio::task::id())
            {
                inflight.remove(&uid);
            }
            out
        });
        inflight.insert(
            uid,
            InFlight {
                id: task.id(),
                abort: task.abort_handle(),
            },
        );
        task
    }

    pub(super) fn new_record(&self, uid: &str, spec: &VmSpec, spec_json: String) -> VmRecord {
        let dir = self.vms_dir.join(uid);
        // A jailed Firecracker's API socket is in its jail: that records the jail.
        let api_socket = self
            .jailer(self.cfg.backend)
            .and_then(|j| jailer::chroot_root(j, &self.cfg.firecracker_bin, uid).ok())
            .map_or_else(|| dir.join("api.sock"), |root| root.join(jailer::API_SOCK));
        VmRecord {
            uid: uid.into(),
            state: VmState::Creating,
            spec_json,
            pid: None,
            start_time: None,
            api_socket,
            vsock_path: dir.join("vsock.sock"),
            serial_log: dir.join("serial.log"),
            tap: spec
                .network
                .as_ref()
                .map(|_| tap::tap_name(&self.cfg.state_dir, uid)),
            // Known once the rootfs cache hands out the image (bring_up records it).
            base_disk: spec.base_disk.clone().unwrap_or_default(),
            writable_disk: spec.writable_disk_bytes.map(|_| dir.join("writable.img")),
            failure_reason: None,
            failure_message: None,
            boot_seconds: None,
            backend: self.cfg.backend,
            helper_pid: None,
            helper_start_time: None,
            start_json: None,
            dir,
        }
    }

    /// The bring-up of a recorded VM, to Running or to a recorded failure.
    pub(super) async fn create(
        &self,
        mut rec: VmRecord,
        spec: &VmSpec,
    ) -> Result<VmRecord, RuntimeError> {
        let uid = rec.uid.clone();
        match self.bring_up(&mut rec, spec).await {
            Ok(()) => {
                rec.state = VmState::Running;
                self.refresh_state_gauge().await;
                Ok(rec)
            }
            Err((e, vmm)) => {
                tracing::warn!(uid, reason = e.reason(), error = %e, "VM start failed");
                if let Some(vmm) = vmm {
                    vmm.kill().await;
                }
                let net = self.net_lock.lock().await;
                self.release_host_resources(&rec).await;
                self.metrics
                    .start_failures
                    .get_or_create(&ReasonLabel {
                        reason: e.reason().into(),
                    })
                    .inc();
                self.inventory
                    .set_failed(&uid, e.reason(), &e.to_string())
                    .await?;
                if let Some(start) = &rec.start_json {
                    self.inventory.set_start(&uid, start).await?;
                }
                if spec
                    .network
                    .as_ref()
                    .is_some_and(|n| n.attachment.is_some())
                {
                    self.reconcile_network_after_release(&net, &uid).await;
                }
                drop(net);
                self.refresh_state_gauge().await;
                Err(e)
            }
        }
    }

    /// Disk, TAP, process, configuration, InstanceStart, Hello. On error, also returns the
    /// process to kill (if one was spawned).
    pub(super) async fn bring_up(
        &self,
        rec: &mut VmRecord,
        spec: &VmSpec,
    ) -> Result<(), (RuntimeError, Option<Vm>)> {
        let uid = rec.uid.clone();
        let boot = |source| {
            (
                RuntimeError::Boot {
                    uid: uid.clone(),
                    source,
                },
                None,
            )
        };
        let (kernel, _initrd) = self.boot_files(spec);
        if !kernel.is_file() {
            return Err(boot(DriverError::KernelMissing(kernel)));
        }
        let disk_err = |message: String| {
            (
                RuntimeError::DiskSetupFailed {
                    uid: uid.clone(),
                    message,
                },
                None,
            )
        };
        std::fs::create_dir_all(&rec.dir)
            .map_err(|e| disk_err(format!("create {}: {e}", rec.dir.display())))?;
        if let Some(image) = &spec.image {
            let acquired = self.rootfs.acquire(&uid, image).await.map_err(|source| {
                (
                    RuntimeError::Rootfs {
                        uid: uid.clone(),
                        source: Box::new(source),
                    },
                    None,
                )
            })?;
            tracing::info!(uid, key = %acquired.key, hit = acquired.hit, offline = acquired.offline, "base image ready");
            rec.base_disk = acquired.path;
            self.inventory
                .set_base_disk(&uid, &rec.base_disk)
                .await
                .map_err(|e| (e.into(), None))?;
        } else if let Some(disk) = &spec.base_disk {
            // The resolved path (the request's may be a symlink).
            rec.base_disk = disk.clone();
        }
        // A `from_template` VM: the template to restore, or why it boots (docs/snapshots.md).
        let mut start = StartReport {
            from: StartKind::Boot,
            template: None,
            fallback: None,
            restore_seconds: None,
            reidentify_seconds: None,
        };
        let mut source = None;
        if spec.from_template {
            let (src, fallback) = self.template_for(rec, spec);
            start.fallback = fallback;
            source = src;
        }
        if let (Some(src), Some(path)) = (&source, &rec.writable_disk) {
            // The template's drive at snapshot time: the restored guest has it mounted.
            if let Err(message) = Self::clone_writable(src, path) {
                tracing::warn!(uid, key = %src.key, message, "cloning the template's drive failed; booting");
                start.fallback = Some(self.restore_failed(&src.key, message));
                source = None;
            }
        }
        if source.is_none() {
            self.empty_writable(rec, spec).map_err(|e| (e, None))?;
        }
        rec.start_json = Some(serde_json::to_string(&start).expect("start serialises"));
        if let Some(t) = &rec.tap {
            let net_err = |source| {
                (
                    RuntimeError::NetworkSetupFailed {
                        uid: uid.clone(),
                        source,
                    },
                    None,
                )
            };
            if spec
                .network
                .as_ref()
                .is_some_and(|n| n.attachment.is_some())
            {
                // This VM's row is in the inventory (Creating): the reconcile adds its TAP to
                // the bridge before the VMM opens it.
                let net = self.net_lock.lock().await;
                self.reconcile_network(&net, &uid)
                    .await
                    .map_err(|e| (e, None))?;
            } else {
                tap::create(t).map_err(|e| net_err(e.into()))?;
            }
        }
        let files = vm::files_of(rec);
        let plan = self.plan_of(rec, spec);
        // A jailed Firecracker's jailer makes its cgroups itself.
        let jailed = files.jail.is_some();
        let procs = if jailed {
            Ok(Vec::new())
        } else {
            self.vm_cgroup(&uid, spec)
        };
        let procs = procs.map_err(|source| {
            (
                RuntimeError::CgroupSetupFailed {
                    uid: uid.clone(),
                    source,
                },
                None,
            )
        })?;
        let jail = self.vm_jail(rec).map_err(|e| (e, None))?;
        let fail = |source, vm: &Vm| {
            (
                RuntimeError::Boot {
                    uid: uid.clone(),
                    source,
                },
                Some(vm.clone()),
            )
        };
        let mut restores = 0;
        // A clone restored again reports its whole wait.
        let restore_began = Instant::now();
        let (vm, spawned_at, deadline, mut announcements) = loop {
            let spawned_at = Instant::now();
            let deadline = spawned_at + self.cfg.boot_timeout;
            if let Some(src) = &source {
                // The template's kernel command line: the clone's own identity comes later.
                let plan = VmPlan {
                    boot_args: src.boot_args.clone(),
                    ..plan.clone()
                };
                // A restore that hangs falls back sooner than a boot would time out.
                let restore_deadline = spawned_at + self.cfg.boot_timeout.min(RESTORE_TIMEOUT);
                let restored = match self
                    .restore_clone(
                        rec,
                        spec,
                        &plan,
                        &procs,
                        jail.as_ref(),
                        src,
                        restore_deadline,
                    )
                    .await
                {
                    Ok((vm, mut heard)) => {
                        // The guest runs from here: how soon its Hello is seen (docs/snapshots.md).
                        let resumed = Instant::now();
                        restores += 1;
                        let window = if restores < RESTORE_ATTEMPTS {
                            restore_deadline.min(resumed + RESTORED_HELLO_WINDOW)
                        } else {
                            restore_deadline
                        };
                        let hello = vmm::wait_for_hello(
                            &files.vsock,
                            &files.serial_log,
                            || vm.is_alive(),
                            window,
                            heard
                                .as_mut()
                                .map_or(vmm::Detect::Resumed, vmm::Detect::Announced),
                        )
                        .await;
                        let hello_after_resume_ms = resumed.elapsed().as_secs_f64() * 1000.0;
                        tracing::info!(uid, key = %src.key, hello_after_resume_ms, ok = hello.is_ok(), "clone resumed");
                        match hello {
                            Ok(_) => Ok((vm.clone(), heard)),
                            Err(e) if restores < RESTORE_ATTEMPTS => {
                                // Nothing of the clone's own is in it yet (no identity, no
                                // config): start over from the template's files.
                                tracing::warn!(uid, key = %src.key, error = %e, "the restored clone did not say Hello; restoring it again");
                                vm.kill().await;
                                let _ = std::fs::remove_file(&rec.api_socket);
                                let _ = std::fs::remove_file(&rec.vsock_path);
                                let copied = match &rec.writable_disk {
                                    Some(path) => Self::clone_writable(src, path)
                                        .and_then(|_| self.own_writable(rec, path)),
                                    None => Ok(()),
                                };
                                match copied {
                                    Ok(()) => continue,
                                    Err(message) => Err((message, None)),
                                }
                            }
                            Err(e) => Err((format!("no guest agent Hello: {e}"), Some(vm))),
                        }
                    }
                    Err(e) => Err(e),
                };
                match restored {
                    Ok((vm, heard)) => {
                        let secs = restore_began.elapsed().as_secs_f64();
                        self.metrics.restore_seconds.observe(secs);
                        start.from = StartKind::Clone;
                        start.template = Some(src.key.clone());
                        start.restore_seconds = Some(secs);
                        break (vm, spawned_at, deadline, heard);
                    }
                    Err((message, vm)) => {
                        tracing::warn!(uid, key = %src.key, message, "restoring the template failed; booting");
                        if let Some(vm) = vm {
                            vm.kill().await;
                        }
                        start.fallback = Some(self.restore_failed(&src.key, message));
                        rec.start_json =
                            Some(serde_json::to_string(&start).expect("start serialises"));
                        source = None;
                        let _ = std::fs::remove_file(&rec.api_socket);
                        let _ = std::fs::remove_file(&rec.vsock_path);
                        self.empty_writable(rec, spec).map_err(|e| (e, None))?;
                        if let Some(t) = &rec.tap
                            && let Err(holders) = qemu::wait_tap_free(t, TAP_FREE_TIMEOUT).await
                        {
                            return Err((
                                RuntimeError::QemuStart {
                                    uid: uid.clone(),
                                    source: qemu::QemuError::StartFailed {
                                        what: "QEMU",
                                        message: format!("TAP {t} is still held by {holders:?}"),
                                        log: String::new(),
                                    },
                                },
                                None,
                            ));
                        }
                        continue;
                    }
                }
            }
            let (vm, announcements) = match rec.backend {
                Backend::Firecracker => {
                    self.start_firecracker(rec, spec, &files, &plan, &procs, jail.as_ref())
                        .await?
                }
                Backend::Qemu => self.start_qemu(rec, &plan, &procs, jail.as_ref()).await?,
            };
            break (vm, spawned_at, deadline, announcements);
        };
        if source.is_none() {
            vmm::wait_for_hello(
                &files.vsock,
                &files.serial_log,
                || vm.is_alive(),
                deadline,
                announcements
                    .as_mut()
                    .map_or(vmm::Detect::Backoff, vmm::Detect::Announced),
            )
            .await
            .map_err(|e| fail(e, &vm))?;
        }
        if let Some(src) = &source {
            // Only a clone with an identity of its own is Running: the agent hands the JIT
            // config only to Running VMs.
            let t = Instant::now();
            let identified = self.reidentify_clone(rec, spec, &src.key, deadline).await;
            rec.start_json = Some(serde_json::to_string(&start).expect("start serialises"));
            identified.map_err(|message| {
                (
                    RuntimeError::ReidentifyFailed {
                        uid: uid.clone(),
                        message,
                    },
                    Some(vm.clone()),
                )
            })?;
            start.reidentify_seconds = Some(t.elapsed().as_secs_f64());
            self.metrics
                .restores
                .get_or_create(&crate::metrics::OutcomeLabel {
                    outcome: "cloned".into(),
                })
                .inc();
        }
        let start_json = serde_json::to_string(&start).expect("start serialises");
        self.inventory
            .set_start(&uid, &start_json)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        rec.start_json = Some(start_json);
        // How long after the guest announced itself its Hello was in: the detection's own delay.
        let hello_after_announce_ms = announcements
            .as_ref()
            .and_then(|a| a.last_heard())
            .map(|at| at.elapsed().as_secs_f64() * 1e3);
        let announced = hello_after_announce_ms.is_some();
        drop(announcements);
        // To Running: for a clone, restore and reidentify (imp_vm_boot_latency_seconds counts
        // boots only; a clone's restore is in imp_runtime_restore_seconds).
        let secs = spawned_at.elapsed().as_secs_f64();
        if start.from == StartKind::Boot {
            self.metrics.boot_latency.observe(secs);
        }
        rec.boot_seconds = Some(secs);
        self.inventory
            .set_running(&uid, secs)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        tracing::info!(
            uid,
            pid = vm.process().0,
            backend = rec.backend.as_str(),
            boot_seconds = secs,
            from = ?start.from,
            template = start.template,
            fallback = start.fallback.as_ref().map(|f| f.reason.as_str()),
            announced,
            hello_after_announce_ms,
            "VM running"
        );
        Ok(())
    }

    /// A fresh writable drive for row `rec` (when its spec has one): a clone of an empty ext4
    /// template, O(1) whatever the image size. The guest mounts it as the overlay upper layer
    /// (imp.overlay), it does not format it.
    fn empty_writable(&self, rec: &VmRecord, spec: &VmSpec) -> Result<(), RuntimeError> {
        if let (Some(path), Some(bytes)) = (&rec.writable_disk, spec.writable_disk_bytes) {
            let _ = crate::rootfs::writable::WritableDrives::remove(path);
            self.writable
                .create(path, bytes)
                .map_err(|source| RuntimeError::WritableDrive {
                    uid: rec.uid.clone(),
                    source,
                })?;
            // As before: a drive the VM cannot open fails its start, which says why.
            let _ = self.own_writable(rec, path);
        }
        Ok(())
    }

    /// Writable drive `path` of row `rec` made its VM's (its directory's uid, 0600): the confined
    /// VMM opens it as that uid. Nothing to do without confinement.
    fn own_writable(&self, rec: &VmRecord, path: &Path) -> Result<(), String> {
        if let Some(cfg) = &self.cfg.jail
            && let Some(id) = jail::id_of(cfg, &rec.dir)
        {
            jail::own(path, id, 0o600).map_err(|e| format!("own {}: {e}", path.display()))?;
        }
        Ok(())
    }

    /// A restore of template `key` that failed: counted, the VM boots instead.
    fn restore_failed(&self, key: &str, message: String) -> Failure {
        self.metrics
            .restores
            .get_or_create(&crate::metrics::OutcomeLabel {
                outcome: super::template::reason::RESTORE_FAILED.into(),
            })
            .inc();
        Failure {
            reason: super::template::reason::RESTORE_FAILED.into(),
            message: format!("restore of template {key}: {message}"),
        }
    }

    /// Spawn (recorded at once), configure and start a Firecracker VM: through its jailer
    /// when `files` has a jail (then `jail` is the VM's uid), else directly in `cgroups`.
    pub(super) async fn start_firecracker(
        &self,
        rec: &mut VmRecord,
        spec: &VmSpec,
        files: &VmmFiles,
        plan: &VmPlan,
        cgroups: &[PathBuf],
        jail: Option<&VmJail>,
    ) -> Result<(Vm, Option<Announcements>), (RuntimeError, Option<Vm>)> {
        let uid = rec.uid.clone();
        let boot = |source| RuntimeError::Boot {
            uid: uid.clone(),
            source,
        };
        let (vmm, plan) = match jail.filter(|_| files.jail.is_some()) {
            Some(j) => self
                .spawn_jailed(rec, spec, files, plan, j.id, &[])
                .await
                .map_err(|e| (e, None))?,
            None => (
                firecracker::spawn(&self.cfg.firecracker_bin, &uid, files, cgroups)
                    .map_err(|e| (boot(e), None))?,
                plan.clone(),
            ),
        };
        let plan = &plan;
        let vm = Vm::Firecracker(vmm.clone());
        let fail = |e| (boot(e), Some(vm.clone()));
        self.record_vmm(rec, vmm.process)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        vmm.wait_api_ready().await.map_err(fail)?;
        vmm.configure(&BootPlan::new(plan, |p| files.vmm_path(p)))
            .await
            .map_err(fail)?;
        if let Some(j) = jail.filter(|_| files.jail.is_some()) {
            jailer::expose_vsock(&files.vsock, &rec.vsock_path, j.id).map_err(|source| {
                (
                    RuntimeError::Jailer {
                        uid: uid.clone(),
                        source,
                    },
                    Some(vm.clone()),
                )
            })?;
        }
        self.inventory
            .set_state(&uid, VmState::Booting)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        // Before InstanceStart: the guest cannot announce itself earlier.
        let announcements = vmm::listen_for_announcements(
            &files.vsock,
            jail.filter(|_| files.jail.is_some()).map(|j| j.id),
        );
        vmm.instance_start().await.map_err(fail)?;
        Ok((vm, announcements))
    }

    /// Stage VM `r`'s jail (its kernel, initrd and drives hard-linked in, see `jailer::stage`,
    /// and `extra`: a clone's template snapshot) and start Firecracker in it through the jailer
    /// as uid `id`, in cgroups with the limits of `spec`. Returns the process and the plan with
    /// its files' paths in the jail.
    pub(super) async fn spawn_jailed(
        &self,
        r: &VmRecord,
        spec: &VmSpec,
        files: &VmmFiles,
        plan: &VmPlan,
        id: u32,
        extra: &[(&Path, &str, Place)],
    ) -> Result<(firecracker::Vmm, VmPlan), RuntimeError> {
        let jailer_err = |source| RuntimeError::Jailer {
            uid: r.uid.clone(),
            source,
        };
        let (Some(cfg), Some(root)) = (self.jailer(r.backend), files.jail.as_deref()) else {
            return Err(RuntimeError::Boot {
                uid: r.uid.clone(),
                source: DriverError::FirecrackerStartFailed {
                    message: "no jailer configured for a jailed VM".into(),
                    stderr: String::new(),
                },
            });
        };
        let mut staged = plan.clone();
        let mut links: Vec<(PathBuf, String, Place)> =
            vec![(plan.kernel.clone(), "vmlinux".into(), Place::Shared)];
        staged.kernel = root.join("vmlinux");
        if let Some(i) = &plan.initrd {
            links.push((i.clone(), "initrd".into(), Place::Shared));
            staged.initrd = Some(root.join("initrd"));
        }
        for d in staged.drives.iter_mut() {
            let name = format!("{}.img", d.id);
            let place = if d.read_only {
                Place::Shared
            } else {
                Place::Own
            };
            links.push((d.path.clone(), name.clone(), place));
            d.path = root.join(name);
        }
        staged.vsock = files.vsock.clone();
        let links: Vec<(&Path, &str, Place)> = links
            .iter()
            .map(|(p, n, k)| (p.as_path(), n.as_str(), *k))
            .chain(extra.iter().copied())
            .collect();
        jailer::stage(root, &self.cfg.firecracker_bin, id, &links).map_err(jailer_err)?;
        // The console and stderr the runtime writes for it: the VM's, 0600, so imp-agent (uid 0
        // without capabilities, mounting the VM directories) cannot read them.
        for log in [&files.serial_log, &files.stderr_log] {
            crate::vmm::process::append_log(log)
                .and_then(|_| jail::own(log, id, 0o600))
                .map_err(|source| {
                    jailer_err(jailer::JailerError::Stage {
                        path: log.clone(),
                        source,
                    })
                })?;
        }
        for n in &plan.nics {
            tap::set_owner(&n.tap, id).map_err(|e| RuntimeError::NetworkSetupFailed {
                uid: r.uid.clone(),
                source: e.into(),
            })?;
        }
        let cgroups = self
            .cgroups
            .as_ref()
            .map(|cg| cg.jailer_args(spec.memory_mib, spec.vcpu));
        let run = jailer::JailerRun {
            id: &r.uid,
            exec_file: &self.cfg.firecracker_bin,
            uid: id,
            cgroups: cgroups.as_ref(),
            firecracker_args: Vec::new(),
        };
        let vmm = firecracker::spawn_jailed(cfg, &run, files)
            .await
            .map_err(|source| RuntimeError::Boot {
                uid: r.uid.clone(),
                source,
            })?;
        Ok((vmm, staged))
    }

    /// Record `vmm` as row `r`'s VMM process: in the inventory first (a restart finds it there
    /// and kills or adopts it), then in `r`. Called as soon as the process exists, before any
    /// step that can fail.
    pub(super) async fn record_vmm(
        &self,
        r: &mut VmRecord,
        vmm: Proc,
    ) -> Result<(), InventoryError> {
        self.inventory
            .set_process(&r.uid, vmm.pid, vmm.start_time)
            .await?;
        r.pid = Some(vmm.pid);
        r.start_time = Some(vmm.start_time);
        Ok(())
    }

    /// Spawn the vsock device, then QEMU (each recorded as soon as it exists), confined to
    /// `jail` when given.
    pub(super) async fn start_qemu(
        &self,
        rec: &mut VmRecord,
        plan: &VmPlan,
        cgroups: &[PathBuf],
        jail: Option<&VmJail>,
    ) -> Result<(Vm, Option<Announcements>), (RuntimeError, Option<Vm>)> {
        let uid = rec.uid.clone();
        let files = QemuFiles::in_dir(&rec.dir, &rec.api_socket, &rec.vsock_path, &rec.serial_log);
        let start_err = |source| RuntimeError::QemuStart {
            uid: uid.clone(),
            source,
        };
        let vhost = qemu::spawn_vhost(&self.cfg.qemu, &files, plan.guest_cid, cgroups, jail)
            .await
            .map_err(|e| (start_err(e), None))?;
        let helper_only = |vhost| {
            Some(Vm::Qemu(QemuVm {
                qemu: vhost,
                vhost: None,
                qmp: qemu::Qmp::new(&files.qmp_sock),
            }))
        };
        self.inventory
            .set_helper(&uid, vhost.pid, vhost.start_time)
            .await
            .map_err(|e| (e.into(), helper_only(vhost)))?;
        rec.helper_pid = Some(vhost.pid);
        rec.helper_start_time = Some(vhost.start_time);
        // Before QEMU: the guest starts with it. vhost-device-vsock connects it for the guest.
        let announcements = vmm::listen_for_announcements(&files.vsock, jail.map(|j| j.id));
        let proc = qemu::spawn_qemu(&self.cfg.qemu, &files, plan, cgroups, jail)
            .await
            .map_err(|e| (start_err(e), helper_only(vhost)))?;
        let vm = Vm::Qemu(QemuVm {
            qemu: proc,
            vhost: Some(vhost),
            qmp: qemu::Qmp::new(&files.qmp_sock),
        });
        self.record_vmm(rec, proc)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        self.inventory
            .set_state(&uid, VmState::Booting)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        Ok((vm, announcements))
    }
}
