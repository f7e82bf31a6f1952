//! The runtime: VM lifecycle by uid over the inventory, the Firecracker driver and the TAP, and
//! the startup reconciliation that reattaches live VMs after a restart. The pure halves live
//! beside it: `validate` (request checks), `plan` (what the VMM is told), `recover` (what a
//! restart does with each row).

mod plan;
mod recover;
pub(crate) mod serial;
mod validate;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use imp_api::names::reason;
use tokio::time::Instant;

use crate::api::{
    Backend, Failure, LinkStats, PrebuildRequest, PrebuildStatus, Readiness, ResumeInfo,
    SnapshotInfo, SuspendInfo, VmSpec, VmState, VmStatus,
};
use crate::cgroup::{CgroupConfig, CgroupError, VmCgroups};
use crate::firecracker::{self, BootPlan, DriverError, Vmm, VmmFiles};
use crate::inventory::{Inventory, InventoryError, VmRecord};
use crate::metrics::{BackendLabel, Metrics, ReasonLabel, StateLabel};
use crate::network::{self, NetworkError};
use crate::procfs;
use crate::qemu::{self, QemuConfig, QemuFiles, QemuVm};
use crate::rootfs::store::{ImageSpec, RootfsError, RootfsStore, StoreConfig};
use crate::rootfs::writable::{WritableDrives, WritableError};
use crate::tap::{self, TapError};
use crate::vmm::{self, Vm};
pub use plan::{
    DEFAULT_BOOT_ARGS, DrivePlan, GUEST_CID, HostFacts, NicPlan, QEMU_BOOT_ARGS, VmPlan,
    default_boot_args, vm_plan,
};
pub use validate::{Invalid, valid_uid};

#[derive(Debug, Clone)]
pub struct Config {
    pub state_dir: PathBuf,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    /// Directories a request's `kernel`, `initrd` and `base_disk` must lie under (after
    /// resolving symlinks); anything else is refused with 400.
    pub image_dirs: Vec<PathBuf>,
    /// Total bytes of writable drives this node hands out; a PUT past it is refused.
    pub writable_budget_bytes: u64,
    /// Per-VM memory cgroups (none: VMs stay in the runtime's cgroup, e.g. in tests).
    pub vm_cgroups: Option<CgroupConfig>,
    /// Bytes of guest console kept per VM (`serial.log` + `serial.log.1`).
    pub serial_log_cap_bytes: u64,
    /// The VMM this node runs (new VMs; a VM keeps the backend it was started with).
    pub backend: Backend,
    pub firecracker_bin: PathBuf,
    pub qemu: QemuConfig,
    pub boot_timeout: Duration,
    pub stop_timeout: Duration,
    /// The rootfs cache (images built from OCI references); its `dir` is usually
    /// `<state_dir>/rootfs`.
    pub rootfs: StoreConfig,
}

impl From<&VmRecord> for VmStatus {
    fn from(r: &VmRecord) -> Self {
        VmStatus {
            uid: r.uid.clone(),
            state: r.state,
            pid: r.pid,
            api_socket: r.api_socket.clone(),
            vsock_path: r.vsock_path.clone(),
            serial_log: r.serial_log.clone(),
            tap: r.tap.clone(),
            boot_seconds: r.boot_seconds,
            failure: r.failure_reason.as_ref().map(|reason| Failure {
                reason: reason.clone(),
                message: r.failure_message.clone().unwrap_or_default(),
            }),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("invalid VM uid {0:?}: 1-63 characters of a-z, 0-9 and '-', starting alphanumeric")]
    InvalidUid(String),
    #[error("invalid spec: {0}")]
    InvalidSpec(Invalid),
    #[error("no VM {0}")]
    NotFound(String),
    #[error("VM {0} exists with a different spec; delete it first")]
    SpecConflict(String),
    #[error("VM {uid} is {state:?}; {operation} needs a running VM")]
    NotRunning {
        uid: String,
        state: VmState,
        operation: &'static str,
    },
    #[error("VM {0} has no network interface")]
    NoNetwork(String),
    #[error("VM {uid} cannot get its writable drive: {source}")]
    DiskBudgetExceeded { uid: String, source: Invalid },
    #[error("VM {uid} failed to start: {source}")]
    Boot { uid: String, source: DriverError },
    /// A start that failed earlier, as recorded in the inventory (a repeated PUT).
    #[error("VM {uid} failed to start: {}: {}", failure.reason, failure.message)]
    Failed { uid: String, failure: Failure },
    /// The bring-up task ended without an outcome (a DELETE cancelled it, or it panicked).
    #[error("the start of VM {uid} was cancelled: {detail}")]
    StartCancelled { uid: String, detail: String },
    #[error("network setup for VM {uid}: {source}")]
    NetworkSetupFailed { uid: String, source: NetworkError },
    #[error("cgroup of VM {uid}: {source}")]
    CgroupSetupFailed { uid: String, source: CgroupError },
    #[error("per-VM cgroups: {0}")]
    Cgroups(CgroupError),
    #[error("disk setup for VM {uid}: {message}")]
    DiskSetupFailed { uid: String, message: String },
    #[error("writable drive for VM {uid}: {source}")]
    WritableDrive { uid: String, source: WritableError },
    #[error("root filesystem for VM {uid}: {source}")]
    Rootfs {
        uid: String,
        source: Box<RootfsError>,
    },
    /// A pre-build (`POST /v1/images`) failed.
    #[error("pre-build of image {image}: {source}")]
    Prebuild {
        image: String,
        source: Box<RootfsError>,
    },
    #[error("link stats of VM {uid}: {source}")]
    LinkStats { uid: String, source: TapError },
    #[error("snapshot of VM {uid}: {source}")]
    Snapshot {
        uid: String,
        source: vmm::ControlError,
    },
    #[error("VM {uid} runs on {backend:?}, which has no snapshots here")]
    SnapshotUnsupported { uid: String, backend: Backend },
    #[error("VM {uid} is {state:?}; resume needs a Suspended VM")]
    NotSuspended { uid: String, state: VmState },
    #[error("resume of VM {uid} (it stays Suspended): {message}")]
    Resume { uid: String, message: String },
    #[error("VM {uid} failed to start: {source}")]
    QemuStart {
        uid: String,
        source: qemu::QemuError,
    },
    #[error("state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("open the rootfs cache: {0}")]
    RootfsStore(RootfsError),
    #[error("writable-drive templates: {0}")]
    WritableTemplates(WritableError),
    #[error(transparent)]
    Inventory(#[from] InventoryError),
}

impl RuntimeError {
    /// Stable label for API bodies and metrics.
    pub fn reason(&self) -> &str {
        match self {
            RuntimeError::Failed { failure, .. } => &failure.reason,
            RuntimeError::InvalidUid(_) => reason::INVALID_UID,
            RuntimeError::InvalidSpec(_) => reason::INVALID_SPEC,
            RuntimeError::NotFound(_) => reason::NOT_FOUND,
            RuntimeError::SpecConflict(_) => reason::SPEC_CONFLICT,
            RuntimeError::NotRunning { .. } => reason::NOT_RUNNING,
            RuntimeError::NoNetwork(_) => reason::NO_NETWORK,
            RuntimeError::DiskBudgetExceeded { .. } => reason::DISK_BUDGET_EXCEEDED,
            RuntimeError::Boot { source, .. } => source.reason(),
            RuntimeError::StartCancelled { .. } => reason::START_CANCELLED,
            RuntimeError::NetworkSetupFailed { .. } => reason::NETWORK_SETUP_FAILED,
            RuntimeError::CgroupSetupFailed { .. } => reason::CGROUP_SETUP_FAILED,
            RuntimeError::DiskSetupFailed { .. } | RuntimeError::WritableDrive { .. } => {
                reason::DISK_SETUP_FAILED
            }
            RuntimeError::Rootfs { source, .. } | RuntimeError::Prebuild { source, .. } => {
                source.reason()
            }
            RuntimeError::LinkStats { .. } => reason::LINK_STATS_UNAVAILABLE,
            RuntimeError::Snapshot { .. } => reason::SNAPSHOT_FAILED,
            RuntimeError::SnapshotUnsupported { .. } => reason::SNAPSHOT_UNSUPPORTED,
            RuntimeError::NotSuspended { .. } => reason::NOT_SUSPENDED,
            RuntimeError::Resume { .. } => reason::RESUME_FAILED,
            RuntimeError::QemuStart { .. } => reason::QEMU_START_FAILED,
            RuntimeError::Inventory(_) => reason::INVENTORY_ERROR,
            RuntimeError::StateDir { .. }
            | RuntimeError::RootfsStore(_)
            | RuntimeError::WritableTemplates(_) => reason::STATE_DIR_UNUSABLE,
            RuntimeError::Cgroups(_) => reason::CGROUP_SETUP_FAILED,
        }
    }

    /// The request field at fault, for refusals of the request itself.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            RuntimeError::InvalidUid(_) => Some("uid"),
            RuntimeError::InvalidSpec(i) | RuntimeError::DiskBudgetExceeded { source: i, .. } => {
                Some(i.field)
            }
            _ => None,
        }
    }
}

/// What a PUT did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// This request started the VM and it came up.
    Created,
    /// The VM existed (running, or still being brought up by an earlier request).
    Existing,
}

/// A bring-up in progress: its task (owned by the runtime, not by the request that asked for
/// it, so a client that goes away cancels nothing) and the task's id, so a finished task only
/// ever removes its own entry.
struct InFlight {
    id: tokio::task::Id,
    abort: tokio::task::AbortHandle,
}

pub struct Runtime {
    cfg: Config,
    vms_dir: PathBuf,
    inventory: Inventory,
    rootfs: RootfsStore,
    writable: WritableDrives,
    cgroups: Option<VmCgroups>,
    pub metrics: Metrics,
    /// One lock per uid: operations on a VM are serialised (held briefly; a bring-up runs in
    /// its own task, see `inflight`), different VMs run concurrently.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Bring-ups in progress, by uid.
    inflight: Mutex<HashMap<String, InFlight>>,
    /// Serialises the node's network reconciles, each computed from the whole inventory (see
    /// `reconcile_network`).
    net_lock: tokio::sync::Mutex<()>,
}

/// How often the serial logs are held to their cap: a guest writing at disk speed adds at most
/// this long's worth past it.
const SERIAL_CHECK: Duration = Duration::from_secs(1);

/// How `remove_vm` ends a VM's process.
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// Ask the guest to reboot first (DELETE of a VM that may be running a job).
    Graceful,
    /// SIGKILL at once (a start interrupted by a restart: no guest worth waiting for).
    Kill,
}

/// The writable-drive bytes a row holds: every row but a Failed one (whose drive was released)
/// keeps its drive until DELETE.
fn writable_bytes(r: &VmRecord) -> u64 {
    if r.state == VmState::Failed {
        return 0;
    }
    serde_json::from_str::<VmSpec>(&r.spec_json)
        .ok()
        .and_then(|s| s.writable_disk_bytes)
        .unwrap_or(0)
}

/// The row's ImpNetwork attachment, if its spec has one.
fn attachment_of(r: &VmRecord) -> Option<crate::api::NetworkAttachment> {
    serde_json::from_str::<VmSpec>(&r.spec_json)
        .ok()
        .and_then(|s| s.network)
        .and_then(|n| n.attachment)
}

/// The rows whose VM is on a network bridge: every one being brought up or running. Failed rows
/// released theirs; an Exited VM has nothing on its TAP any more (its row stays until DELETE,
/// the TAP is detached meanwhile).
fn network_ports(rows: &[VmRecord]) -> Vec<(String, [u8; 6], crate::api::NetworkAttachment)> {
    rows.iter()
        .filter(|r| {
            // A suspended VM keeps its port and address (the network identity a resume and
            // the wake counter need).
            matches!(
                r.state,
                VmState::Creating
                    | VmState::Booting
                    | VmState::Running
                    | VmState::Suspending
                    | VmState::Suspended
                    | VmState::Resuming
            )
        })
        .filter_map(|r| {
            let spec: VmSpec = serde_json::from_str(&r.spec_json).ok()?;
            let a = spec.network.as_ref()?.attachment.clone()?;
            Some((r.tap.clone()?, plan::guest_mac(&r.uid, &spec), a))
        })
        .collect()
}

impl Runtime {
    /// Open the inventory and reconcile it with the host (see `recover`).
    pub async fn start(cfg: Config) -> Result<Arc<Self>, RuntimeError> {
        let vms_dir = cfg.state_dir.join("vms");
        std::fs::create_dir_all(&vms_dir).map_err(|source| RuntimeError::StateDir {
            path: vms_dir.clone(),
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
        });
        rt.recover().await?;
        rt.readiness();
        tokio::spawn(Self::cap_serial_logs(Arc::downgrade(&rt)));
        Ok(rt)
    }

    /// Keep every VM's console log under its cap (see `serial`), for as long as the runtime
    /// lives.
    async fn cap_serial_logs(rt: std::sync::Weak<Self>) {
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

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn lock(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .expect("lock table")
            .entry(uid.to_string())
            .or_default()
            .clone()
    }

    pub fn readiness(&self) -> Readiness {
        let bins: Vec<&Path> = match self.cfg.backend {
            Backend::Firecracker => vec![&self.cfg.firecracker_bin],
            Backend::Qemu => vec![&self.cfg.qemu.qemu_bin, &self.cfg.qemu.vhost_vsock_bin],
        };
        let facts = vmm::HostFacts {
            kvm: vmm::kvm_usable(),
            bins: bins
                .into_iter()
                .map(|b| (b.display().to_string(), b.is_file()))
                .collect(),
            kernel: (
                self.cfg.kernel.display().to_string(),
                self.cfg.kernel.is_file(),
            ),
        };
        let r = vmm::readiness(self.cfg.backend, &facts);
        self.metrics
            .ready
            .get_or_create(&BackendLabel {
                backend: r.backend.as_str().into(),
            })
            .set(i64::from(r.ready()));
        r
    }

    /// Writable-drive bytes handed out (every VM but failed ones) and the node's budget: what
    /// the agent publishes as the node's disk capacity.
    pub async fn disk_usage(&self) -> Result<(u64, u64), RuntimeError> {
        let used = self
            .inventory
            .list()
            .await?
            .iter()
            .map(writable_bytes)
            .sum();
        Ok((used, self.cfg.writable_budget_bytes))
    }

    async fn refresh_state_gauge(&self) {
        let Ok(all) = self.inventory.list().await else {
            return;
        };
        for s in VmState::ALL {
            let n = all.iter().filter(|r| r.state == s).count();
            self.metrics
                .vms
                .get_or_create(&StateLabel {
                    state: s.as_str().into(),
                })
                .set(n as i64);
        }
    }

    fn vmm_of(r: &VmRecord) -> Option<Vm> {
        let (pid, start_time) = (r.pid?, r.start_time?);
        Some(match r.backend {
            Backend::Firecracker => Vm::Firecracker(Vmm {
                pid,
                start_time,
                files: files_of(r),
                client: firecracker::FirecrackerClient::new(&r.api_socket),
            }),
            Backend::Qemu => Vm::Qemu(QemuVm {
                qemu: qemu::Proc { pid, start_time },
                vhost: r
                    .helper_pid
                    .zip(r.helper_start_time)
                    .map(|(pid, start_time)| qemu::Proc { pid, start_time }),
                qmp: qemu::Qmp::new(&r.api_socket),
            }),
        })
    }

    /// Startup reconciliation after a restart (or crash) of the runtime; `recover::row_action`
    /// decides per row, then VMM processes under the state dir that no kept row owns are
    /// killed and VM directories without a row removed.
    async fn recover(&self) -> Result<(), RuntimeError> {
        use recover::{Process, RowAction};
        let mut keep: Vec<(i32, u64)> = Vec::new();
        for r in self.inventory.list().await? {
            let vmm = Self::vmm_of(&r);
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
        let found = procfs::firecrackers_under(&self.vms_dir);
        for (pid, start, sock) in recover::orphans(&found, &keep) {
            tracing::warn!(pid, sock = %sock.display(), "killing orphan VMM process of this runtime");
            qemu::Proc {
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
        let holders: Vec<String> = rows
            .into_iter()
            .filter(|r| r.state != VmState::Failed)
            .map(|r| r.uid)
            .collect();
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

    /// Kill every VMM process of the row (the recorded one, and any other whose sockets lie in
    /// its directory: one spawned by a bring-up cancelled before it recorded the pid), release
    /// its host resources, remove its directory and row.
    async fn remove_vm(&self, r: &VmRecord, how: Stop) -> Result<(), RuntimeError> {
        self.remove_snapshot(r);
        if let Some(vmm) = Self::vmm_of(r) {
            match how {
                Stop::Graceful => vmm.stop(self.cfg.stop_timeout).await,
                Stop::Kill => vmm.kill().await,
            }
        }
        for (pid, start, _) in procfs::firecrackers_under(&r.dir) {
            tracing::warn!(uid = %r.uid, pid, "killing an unrecorded VMM process of this VM");
            qemu::Proc {
                pid,
                start_time: start,
            }
            .kill()
            .await;
        }
        let net = self.net_lock.lock().await;
        self.release_host_resources(r).await;
        let _ = std::fs::remove_dir_all(&r.dir);
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
    async fn release_host_resources(&self, r: &VmRecord) {
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

    /// Make the node's bridges, TAP ports and nft rules match every networked VM of the
    /// inventory (docs/network.md). The caller holds `net_lock` across this and the inventory
    /// change it follows, so no other reconcile sees a half-made change (e.g. re-creates the
    /// TAP of a VM whose removal deleted it a moment ago).
    /// `uid` is the VM the reconcile is for: it fails only for a node-wide failure or one of
    /// that VM's network or port; failures of other networks are logged (their own VMs' starts
    /// report them) and never block this one.
    async fn reconcile_network(
        &self,
        _held: &tokio::sync::MutexGuard<'_, ()>,
        uid: &str,
    ) -> Result<(), RuntimeError> {
        let rows = self.inventory.list().await?;
        let ports = network_ports(&rows);
        let desired = network::desired(ports.iter().map(|(t, m, a)| (t.clone(), *m, a)));
        let started = Instant::now();
        let fail = |e: network::NetworkError| {
            self.metrics
                .network_setup_failures
                .get_or_create(&ReasonLabel {
                    reason: e.kind().into(),
                })
                .inc();
            RuntimeError::NetworkSetupFailed {
                uid: uid.into(),
                source: e,
            }
        };
        let mut done = network::reconcile(&desired).await.map_err(fail)?;
        if !done.actions.is_empty() {
            tracing::info!(
                networks = desired.len(),
                vms = ports.len(),
                actions = done.actions.len(),
                seconds = started.elapsed().as_secs_f64(),
                "network reconciled"
            );
        }
        let mine = rows
            .iter()
            .find(|r| r.uid == uid)
            .and_then(|r| Some((r.tap.clone()?, attachment_of(r)?.network_id)))
            .and_then(|(tap, network)| done.take_failure(&network, &tap));
        for f in &done.failed {
            tracing::warn!(network = %f.network, tap = ?f.tap, error = %f.error, "network not set up; other networks were");
        }
        mine.map_or(Ok(()), |f| Err(fail(f.error)))
    }

    /// A reconcile after a VM left (DELETE, failed start, restart clean-up): failures are
    /// logged, not returned, since the VM is gone either way and the next reconcile retries.
    async fn reconcile_network_after_release(
        &self,
        held: &tokio::sync::MutexGuard<'_, ()>,
        uid: &str,
    ) {
        if let Err(e) = self.reconcile_network(held, uid).await {
            tracing::warn!(uid, error = %e, "network reconcile after a VM left failed; the next one retries");
        }
    }

    /// Current record, noticing a process that ended since (Running -> Exited).
    async fn observe(&self, uid: &str) -> Result<Option<VmRecord>, RuntimeError> {
        let Some(mut r) = self.inventory.get(uid).await? else {
            return Ok(None);
        };
        if r.state == VmState::Running && !Self::vmm_of(&r).is_some_and(|v| v.is_alive()) {
            self.inventory.set_state(uid, VmState::Exited).await?;
            r.state = VmState::Exited;
            self.refresh_state_gauge().await;
        }
        Ok(Some(r))
    }

    pub async fn inspect(&self, uid: &str) -> Result<VmStatus, RuntimeError> {
        if !valid_uid(uid) {
            return Err(RuntimeError::InvalidUid(uid.into()));
        }
        self.observe(uid)
            .await?
            .map(|r| VmStatus::from(&r))
            .ok_or_else(|| RuntimeError::NotFound(uid.into()))
    }

    /// `POST /v1/images`: the base image of `req.image` built (or found) ahead of its first
    /// VM, under the same cache, pull policy and credential rules as a VM's.
    pub async fn prebuild(&self, req: &PrebuildRequest) -> Result<PrebuildStatus, RuntimeError> {
        validate::image(&req.image).map_err(RuntimeError::InvalidSpec)?;
        let failed = |source| RuntimeError::Prebuild {
            image: req.image.base.clone(),
            source: Box::new(source),
        };
        let got = self.rootfs.prebuild(&req.image).await.map_err(failed)?;
        let cached = self.rootfs.is_cached(&got.key).await.map_err(failed)?;
        tracing::info!(key = %got.key, base = %req.image.base, runner = ?req.image.runner, hit = got.hit, resolved = got.resolved, cached, "pre-built base image");
        Ok(PrebuildStatus {
            key: got.key,
            hit: got.hit,
            resolved: got.resolved,
            cached,
        })
    }

    pub async fn list(&self) -> Result<Vec<VmStatus>, RuntimeError> {
        Ok(self
            .inventory
            .list()
            .await?
            .iter()
            .map(VmStatus::from)
            .collect())
    }

    /// The request's host paths resolved under the image directories (400 naming the field
    /// otherwise); the runtime's own kernel and initrd are trusted configuration.
    fn resolve_paths(&self, spec: &VmSpec) -> Result<VmSpec, RuntimeError> {
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
        // request only.
        let stored = VmSpec {
            image: spec.image.as_ref().map(ImageSpec::without_credentials),
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
    fn spawn_bring_up(
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

    fn new_record(&self, uid: &str, spec: &VmSpec, spec_json: String) -> VmRecord {
        let dir = self.vms_dir.join(uid);
        VmRecord {
            uid: uid.into(),
            state: VmState::Creating,
            spec_json,
            pid: None,
            start_time: None,
            api_socket: dir.join("api.sock"),
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
            dir,
        }
    }

    /// The bring-up of a recorded VM, to Running or to a recorded failure.
    async fn create(&self, mut rec: VmRecord, spec: &VmSpec) -> Result<VmRecord, RuntimeError> {
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
    async fn bring_up(
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
        let kernel = spec
            .kernel
            .clone()
            .unwrap_or_else(|| self.cfg.kernel.clone());
        if !kernel.is_file() {
            return Err(boot(DriverError::KernelMissing(kernel)));
        }
        let initrd = spec.initrd.clone().or_else(|| self.cfg.initrd.clone());
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
        if let (Some(path), Some(bytes)) = (&rec.writable_disk, spec.writable_disk_bytes) {
            // A clone of an empty ext4 template: O(1) whatever the image size. The guest mounts
            // it as the overlay upper layer (imp.overlay), it does not format it.
            self.writable.create(path, bytes).map_err(|source| {
                (
                    RuntimeError::WritableDrive {
                        uid: uid.clone(),
                        source,
                    },
                    None,
                )
            })?;
        }
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
        let files = files_of(rec);
        let plan = vm_plan(
            &uid,
            spec,
            &HostFacts {
                kernel,
                initrd,
                base_disk: rec.base_disk.clone(),
                writable_disk: rec.writable_disk.clone(),
                tap: rec.tap.clone(),
                vsock: files.vsock.clone(),
            },
            rec.backend,
        );
        let procs = match &self.cgroups {
            Some(cg) => Some(
                cg.create(&uid, spec.memory_mib)
                    .map_err(|source| {
                        (
                            RuntimeError::CgroupSetupFailed {
                                uid: uid.clone(),
                                source,
                            },
                            None,
                        )
                    })?
                    .join("cgroup.procs"),
            ),
            None => None,
        };
        let spawned_at = Instant::now();
        let vm = match rec.backend {
            Backend::Firecracker => {
                self.start_firecracker(rec, &files, &plan, procs.as_deref())
                    .await?
            }
            Backend::Qemu => self.start_qemu(rec, &plan, procs.as_deref()).await?,
        };
        let fail = |source, vm: &Vm| {
            (
                RuntimeError::Boot {
                    uid: uid.clone(),
                    source,
                },
                Some(vm.clone()),
            )
        };
        let deadline = spawned_at + self.cfg.boot_timeout;
        vmm::wait_for_hello(&files.vsock, &files.serial_log, || vm.is_alive(), deadline)
            .await
            .map_err(|e| fail(e, &vm))?;
        let secs = spawned_at.elapsed().as_secs_f64();
        self.metrics.boot_latency.observe(secs);
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
            "VM running"
        );
        Ok(())
    }

    /// Spawn (recorded at once), configure and start a Firecracker VM.
    async fn start_firecracker(
        &self,
        rec: &mut VmRecord,
        files: &VmmFiles,
        plan: &VmPlan,
        cgroup: Option<&Path>,
    ) -> Result<Vm, (RuntimeError, Option<Vm>)> {
        let uid = rec.uid.clone();
        let boot = |source| RuntimeError::Boot {
            uid: uid.clone(),
            source,
        };
        let vmm = firecracker::spawn(&self.cfg.firecracker_bin, &uid, files, cgroup)
            .map_err(|e| (boot(e), None))?;
        let vm = Vm::Firecracker(vmm.clone());
        let fail = |e| (boot(e), Some(vm.clone()));
        self.inventory
            .set_process(&uid, vmm.pid, vmm.start_time)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        rec.pid = Some(vmm.pid);
        rec.start_time = Some(vmm.start_time);
        vmm.wait_api_ready().await.map_err(fail)?;
        vmm.configure(&BootPlan::from(plan)).await.map_err(fail)?;
        self.inventory
            .set_state(&uid, VmState::Booting)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        vmm.instance_start().await.map_err(fail)?;
        Ok(vm)
    }

    /// Spawn the vsock device, then QEMU (each recorded as soon as it exists).
    async fn start_qemu(
        &self,
        rec: &mut VmRecord,
        plan: &VmPlan,
        cgroup: Option<&Path>,
    ) -> Result<Vm, (RuntimeError, Option<Vm>)> {
        let uid = rec.uid.clone();
        let files = QemuFiles::in_dir(&rec.dir, &rec.api_socket, &rec.vsock_path, &rec.serial_log);
        let start_err = |source| RuntimeError::QemuStart {
            uid: uid.clone(),
            source,
        };
        let vhost = qemu::spawn_vhost(&self.cfg.qemu, &files, plan.guest_cid, cgroup)
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
        let proc = qemu::spawn_qemu(&self.cfg.qemu, &files, plan, cgroup)
            .await
            .map_err(|e| (start_err(e), helper_only(vhost)))?;
        let vm = Vm::Qemu(QemuVm {
            qemu: proc,
            vhost: Some(vhost),
            qmp: qemu::Qmp::new(&files.qmp_sock),
        });
        self.inventory
            .set_process(&uid, proc.pid, proc.start_time)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        rec.pid = Some(proc.pid);
        rec.start_time = Some(proc.start_time);
        self.inventory
            .set_state(&uid, VmState::Booting)
            .await
            .map_err(|e| (e.into(), Some(vm.clone())))?;
        Ok(vm)
    }

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

    async fn running(&self, uid: &str, operation: &'static str) -> Result<VmRecord, RuntimeError> {
        if !valid_uid(uid) {
            return Err(RuntimeError::InvalidUid(uid.into()));
        }
        let r = self
            .observe(uid)
            .await?
            .ok_or_else(|| RuntimeError::NotFound(uid.into()))?;
        if r.state != VmState::Running {
            return Err(RuntimeError::NotRunning {
                uid: uid.into(),
                state: r.state,
                operation,
            });
        }
        Ok(r)
    }

    /// The TAP's counters, for a Running VM and a Suspended one (whose TAP stays; its
    /// `wake_packets` counts what was routed towards its address meanwhile).
    pub async fn linkstats(&self, uid: &str) -> Result<LinkStats, RuntimeError> {
        let r = match self.running(uid, "linkstats").await {
            Err(RuntimeError::NotRunning {
                state: VmState::Suspended,
                ..
            }) => self
                .inventory
                .get(uid)
                .await?
                .ok_or_else(|| RuntimeError::NotFound(uid.into()))?,
            other => other?,
        };
        let t = r
            .tap
            .clone()
            .ok_or_else(|| RuntimeError::NoNetwork(uid.into()))?;
        let mut stats = tap::stats(&t).map_err(|source| RuntimeError::LinkStats {
            uid: uid.into(),
            source,
        })?;
        if r.state == VmState::Suspended
            && let Some(a) = attachment_of(&r)
        {
            stats.wake_packets = network::wake_packets(a.address.addr()).await;
        }
        Ok(stats)
    }

    pub async fn vsock_path(&self, uid: &str) -> Result<PathBuf, RuntimeError> {
        Ok(self.running(uid, "vsock").await?.vsock_path)
    }

    /// Pause, write a full snapshot into the VM directory, resume (unless `resume` is false).
    pub async fn snapshot(&self, uid: &str, resume: bool) -> Result<SnapshotInfo, RuntimeError> {
        let lock = self.lock(uid);
        let _guard = lock.lock().await;
        let r = self.running(uid, "snapshot").await?;
        let vmm = match Self::vmm_of(&r) {
            Some(Vm::Firecracker(v)) => v,
            Some(other) => {
                return Err(RuntimeError::SnapshotUnsupported {
                    uid: uid.into(),
                    backend: other.backend(),
                });
            }
            None => return Err(RuntimeError::NotFound(uid.into())),
        };
        let info = SnapshotInfo {
            snapshot_path: r.dir.join("snapshot.vmstate"),
            mem_file_path: r.dir.join("snapshot.mem"),
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
        Ok(info)
    }
}

impl Runtime {
    /// Pause, write a full snapshot into the VM directory, stop the VMM; disks, TAP and
    /// address stay (state Suspended). A failure leaves the VM Running.
    pub async fn suspend(&self, uid: &str) -> Result<SuspendInfo, RuntimeError> {
        let started = Instant::now();
        let lock = self.lock(uid);
        let _guard = lock.lock().await;
        let r = self.running(uid, "suspend").await?;
        let vm = Self::vmm_of(&r).ok_or_else(|| RuntimeError::NotFound(uid.into()))?;
        match self.suspend_vm(&r, &vm).await {
            Ok(snapshot_bytes) => {
                let took = started.elapsed();
                self.metrics
                    .suspend_seconds
                    .get_or_create(&BackendLabel {
                        backend: r.backend.as_str().into(),
                    })
                    .observe(took.as_secs_f64());
                tracing::info!(
                    uid,
                    backend = r.backend.as_str(),
                    snapshot_bytes,
                    seconds = took.as_secs_f64(),
                    "VM suspended"
                );
                Ok(SuspendInfo {
                    snapshot_bytes,
                    took_ms: took.as_millis() as u64,
                })
            }
            Err(e) => {
                self.count_suspend_failure("suspend", &e);
                Err(e)
            }
        }
    }

    fn count_suspend_failure(&self, operation: &str, e: &RuntimeError) {
        self.metrics
            .suspend_failures
            .get_or_create(&crate::metrics::OperationReasonLabel {
                operation: operation.into(),
                reason: e.reason().into(),
            })
            .inc();
    }

    async fn suspend_vm(&self, r: &VmRecord, vm: &Vm) -> Result<u64, RuntimeError> {
        let uid = r.uid.as_str();
        self.inventory.set_state(uid, VmState::Suspending).await?;
        self.refresh_state_gauge().await;
        let [state, mem] = snapshot_files(&r.dir);
        let written: Result<(), vmm::ControlError> = match vm {
            Vm::Firecracker(v) => async {
                v.pause().await?;
                v.snapshot_create(&state, &mem).await
            }
            .await
            .map_err(Into::into),
            Vm::Qemu(q) => q.migrate_to_file(&mem).await.map_err(Into::into),
        };
        if let Err(source) = written {
            tracing::warn!(uid, error = %source, "suspend failed; resuming the VM");
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
        Ok(snapshot_bytes(&r.dir))
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
        let r = self
            .observe(uid)
            .await?
            .ok_or_else(|| RuntimeError::NotFound(uid.into()))?;
        if r.state != VmState::Suspended {
            return Err(RuntimeError::NotSuspended {
                uid: uid.into(),
                state: r.state,
            });
        }
        self.inventory.set_state(uid, VmState::Resuming).await?;
        self.refresh_state_gauge().await;
        let deadline = started + self.cfg.boot_timeout;
        let resumed = match self.load_snapshot(&r, deadline).await {
            Ok(vm) => {
                let hello =
                    vmm::wait_for_hello(&r.vsock_path, &r.serial_log, || vm.is_alive(), deadline)
                        .await;
                match hello {
                    Ok(_) => Ok(vm),
                    Err(e) => Err((format!("no guest agent Hello: {e}"), Some(vm))),
                }
            }
            Err(e) => Err(e),
        };
        let vm = match resumed {
            Ok(vm) => vm,
            Err((message, vm)) => {
                if let Some(vm) = vm {
                    vm.kill().await;
                }
                self.inventory.set_suspended(uid).await?;
                self.refresh_state_gauge().await;
                let e = RuntimeError::Resume {
                    uid: uid.into(),
                    message,
                };
                tracing::warn!(uid, error = %e, "resume failed");
                self.count_suspend_failure("resume", &e);
                return Err(e);
            }
        };
        self.inventory.set_state(uid, VmState::Running).await?;
        // The snapshot is consumed: the guest ran past it (a later suspend writes a new one).
        self.remove_snapshot(&r);
        if attachment_of(&r).is_some() {
            self.sync_wake_counters().await;
        }
        self.refresh_state_gauge().await;
        self.refresh_snapshot_gauge().await;
        let took = started.elapsed();
        self.metrics
            .resume_seconds
            .get_or_create(&BackendLabel {
                backend: r.backend.as_str().into(),
            })
            .observe(took.as_secs_f64());
        tracing::info!(
            uid,
            backend = r.backend.as_str(),
            pid = vm.process().0,
            seconds = took.as_secs_f64(),
            "VM resumed"
        );
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

    /// A fresh VMM for the row (recorded as soon as it exists), its snapshot loaded and the
    /// guest running. On error, the message and the process to kill.
    async fn load_snapshot(
        &self,
        r: &VmRecord,
        deadline: Instant,
    ) -> Result<Vm, (String, Option<Vm>)> {
        let uid = r.uid.as_str();
        let spec: VmSpec = serde_json::from_str(&r.spec_json)
            .map_err(|e| (format!("recorded spec: {e}"), None))?;
        let [state, mem] = snapshot_files(&r.dir);
        if !mem.is_file() {
            return Err((format!("snapshot {} is missing", mem.display()), None));
        }
        let procs = match &self.cgroups {
            Some(cg) => Some(
                cg.create(uid, spec.memory_mib)
                    .map_err(|e| (format!("cgroup: {e}"), None))?
                    .join("cgroup.procs"),
            ),
            None => None,
        };
        // The dead VMM's sockets: the new one binds the same paths.
        let _ = std::fs::remove_file(&r.api_socket);
        let _ = std::fs::remove_file(&r.vsock_path);
        match r.backend {
            Backend::Firecracker => {
                let files = files_of(r);
                let vmm =
                    firecracker::spawn(&self.cfg.firecracker_bin, uid, &files, procs.as_deref())
                        .map_err(|e| (e.to_string(), None))?;
                let vm = Vm::Firecracker(vmm.clone());
                let fail = |m: String| (m, Some(vm.clone()));
                self.inventory
                    .set_process(uid, vmm.pid, vmm.start_time)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                vmm.wait_api_ready()
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                vmm.snapshot_load(&state, &mem, true)
                    .await
                    .map_err(|e| fail(format!("snapshot load: {e}")))?;
                Ok(vm)
            }
            Backend::Qemu => {
                let files = QemuFiles::in_dir(&r.dir, &r.api_socket, &r.vsock_path, &r.serial_log);
                let plan = self.plan_of(r, &spec);
                if let Some(tap) = &r.tap
                    && let Err(holders) = qemu::wait_tap_free(tap, SNAPSHOT_WRITER_TIMEOUT).await
                {
                    return Err((format!("TAP {tap} is still held by {holders:?}"), None));
                }
                let vhost =
                    qemu::spawn_vhost(&self.cfg.qemu, &files, plan.guest_cid, procs.as_deref())
                        .await
                        .map_err(|e| (e.to_string(), None))?;
                let helper_only = Vm::Qemu(QemuVm {
                    qemu: vhost,
                    vhost: None,
                    qmp: qemu::Qmp::new(&files.qmp_sock),
                });
                self.inventory
                    .set_helper(uid, vhost.pid, vhost.start_time)
                    .await
                    .map_err(|e| (e.to_string(), Some(helper_only.clone())))?;
                // A killed QEMU's leader is a zombie before its last thread has closed the
                // TAP: the new QEMU's TUNSETIFF fails with EBUSY for a moment. Retry that.
                let mut tries = 0;
                let proc = loop {
                    match qemu::spawn_qemu_incoming(
                        &self.cfg.qemu,
                        &files,
                        &plan,
                        procs.as_deref(),
                        &mem,
                    )
                    .await
                    {
                        Ok(p) => break p,
                        Err(e)
                            if tries < TAP_BUSY_RETRIES
                                && e.to_string().contains("resource busy") =>
                        {
                            tries += 1;
                            tokio::time::sleep(Duration::from_millis(250)).await;
                        }
                        Err(e) => return Err((e.to_string(), Some(helper_only.clone()))),
                    }
                };
                let q = QemuVm {
                    qemu: proc,
                    vhost: Some(vhost),
                    qmp: qemu::Qmp::new(&files.qmp_sock),
                };
                let vm = Vm::Qemu(q.clone());
                let fail = |m: String| (m, Some(vm.clone()));
                self.inventory
                    .set_process(uid, proc.pid, proc.start_time)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                q.finish_incoming(deadline)
                    .await
                    .map_err(|e| fail(format!("incoming migration: {e}")))?;
                Ok(vm)
            }
        }
    }

    /// The VMM plan of a recorded VM (its resolved base disk, writable drive and TAP).
    fn plan_of(&self, r: &VmRecord, spec: &VmSpec) -> VmPlan {
        let kernel = spec
            .kernel
            .clone()
            .unwrap_or_else(|| self.cfg.kernel.clone());
        let initrd = spec.initrd.clone().or_else(|| self.cfg.initrd.clone());
        vm_plan(
            &r.uid,
            spec,
            &HostFacts {
                kernel,
                initrd,
                base_disk: r.base_disk.clone(),
                writable_disk: r.writable_disk.clone(),
                tap: r.tap.clone(),
                vsock: r.vsock_path.clone(),
            },
            r.backend,
        )
    }

    /// One wake counter per Suspended VM with an address, none for anything else. Failures
    /// are logged: the counter is a hint, and the next suspend, resume or delete retries.
    async fn sync_wake_counters(&self) {
        let Ok(rows) = self.inventory.list().await else {
            return;
        };
        let addrs: Vec<std::net::Ipv4Addr> = rows
            .iter()
            .filter(|r| r.state == VmState::Suspended)
            .filter_map(attachment_of)
            .map(|a| a.address.addr())
            .collect();
        if let Err(e) = network::wake_sync(&addrs).await {
            tracing::warn!(error = %e, "wake counters not updated");
        }
    }

    async fn refresh_snapshot_gauge(&self) {
        let Ok(rows) = self.inventory.list().await else {
            return;
        };
        let total: u64 = rows
            .iter()
            .filter(|r| r.state == VmState::Suspended)
            .map(|r| snapshot_bytes(&r.dir))
            .sum();
        self.metrics.snapshot_bytes.set(total as i64);
    }
}

fn rows_have_network(rows: &[VmRecord]) -> bool {
    rows.iter().any(|r| attachment_of(r).is_some())
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

impl Runtime {
    /// The snapshot files of a suspend (consumed by a resume, or the VM deleted).
    fn remove_snapshot(&self, r: &VmRecord) {
        for f in snapshot_files(&r.dir) {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// How long the writer of a QEMU migration stream may take to flush it after QEMU is gone.
const SNAPSHOT_WRITER_TIMEOUT: Duration = Duration::from_secs(120);

/// Starts of a resuming QEMU retried while its TAP is still busy (250 ms apart).
const TAP_BUSY_RETRIES: u32 = 120;

/// The files `suspend` writes into a VM's directory (names differ from `snapshot`'s, which
/// leaves the VM running).
fn snapshot_files(dir: &Path) -> [PathBuf; 2] {
    [dir.join("suspend.vmstate"), dir.join("suspend.mem")]
}

fn files_of(r: &VmRecord) -> VmmFiles {
    VmmFiles {
        api_sock: r.api_socket.clone(),
        vsock: r.vsock_path.clone(),
        serial_log: r.serial_log.clone(),
        stderr_log: r.dir.join("firecracker.stderr"),
        vmm_log: r.dir.join("firecracker.log"),
    }
}

/// The path a VM's files live under (for tests and tools).
pub fn vm_dir(state_dir: &Path, uid: &str) -> PathBuf {
    state_dir.join("vms").join(uid)
}
