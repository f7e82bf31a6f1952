//! The runtime: VM lifecycle by uid over the inventory, the VMM backends (through the `vmm`
//! seam) and the TAP, and the startup reconciliation that reattaches live VMs after a restart.
//! One file per concern: `bring_up` (PUT: disks, network, process, Hello), `teardown` (DELETE
//! and what a VM holds on the host), `reattach` (the startup reconciliation's I/O), `net` (the
//! node's network reconcile, wake counters, link stats), `suspend` (snapshot, suspend, resume),
//! `vm` (a recorded VM's process(es)). The pure halves live beside them: `validate` (request
//! checks), `plan` (what the VMM is told), `recover` (what a restart does with each row).

mod bring_up;
mod net;
mod plan;
mod recover;
mod startup;
mod suspend;
mod teardown;
pub mod template;
mod validate;
mod vm;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use imp_api::names::reason;

use crate::api::{
    Backend, Failure, PrebuildRequest, PrebuildStatus, Readiness, VmSpec, VmState, VmStatus,
};
use crate::cgroup::{CgroupConfig, CgroupError, VmCgroups};
use crate::firecracker::jailer::{self, JailerConfig, JailerError};
use crate::inventory::{Inventory, InventoryError, VmRecord};
use crate::jail::{self, JailConfig, JailError, VmJail};
use crate::metrics::{BackendLabel, Metrics, StateLabel};
use crate::network::NetworkError;
use crate::qemu::{self, QemuConfig};
use crate::rootfs::store::{RootfsError, RootfsStore, StoreConfig};
use crate::rootfs::writable::{WritableDrives, WritableError};
use crate::tap::TapError;
use crate::vmm::{self, DriverError, VmPlan};
pub use plan::{DEFAULT_BOOT_ARGS, GUEST_CID, QEMU_BOOT_ARGS, default_boot_args};
use plan::{HostFacts, vm_plan};
pub use validate::{Invalid, valid_uid};
pub use vm::{ControlError, Vm};

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
    /// Per-VM uids of confined VMs (none: VMM processes run as the runtime, unconfined; for
    /// debugging only). QEMU is confined by jail.rs, Firecracker by its jailer (`jailer`).
    pub jail: Option<JailConfig>,
    /// Firecracker's jailer (none: Firecracker runs unconfined, with a warning at start).
    pub jailer: Option<JailerConfig>,
    /// Which ImpNetworks this node admits (network/admit.rs).
    pub network: crate::network::Admission,
    /// Bytes the node's VM templates may hold on disk together (memory snapshots and drives);
    /// past it the least recently used go (docs/snapshots.md).
    pub template_budget_bytes: u64,
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
            start: r
                .start_json
                .as_deref()
                .and_then(|j| serde_json::from_str(j).ok()),
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
    Snapshot { uid: String, source: ControlError },
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
    #[error("confinement of VM {uid}: {source}")]
    Jail { uid: String, source: JailError },
    #[error("jail of VM {uid}: {source}")]
    Jailer { uid: String, source: JailerError },
    #[error("Firecracker's jailer: {0}")]
    JailerPreflight(JailerError),
    #[error("invalid template key {0:?}: {len} lowercase hex digits", len = template::key::KEY_HEX)]
    InvalidTemplateKey(String),
    #[error("clone {uid} did not take its own identity (it gets no config): {message}")]
    ReidentifyFailed { uid: String, message: String },
    #[error("template directory: {0}")]
    Templates(std::io::Error),
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
            RuntimeError::Jail { .. }
            | RuntimeError::Jailer { .. }
            | RuntimeError::JailerPreflight(_) => reason::VMM_CONFINEMENT_FAILED,
            RuntimeError::Inventory(_) => reason::INVENTORY_ERROR,
            RuntimeError::StateDir { .. }
            | RuntimeError::RootfsStore(_)
            | RuntimeError::WritableTemplates(_) => reason::STATE_DIR_UNUSABLE,
            RuntimeError::Cgroups(_) => reason::CGROUP_SETUP_FAILED,
            RuntimeError::InvalidTemplateKey(_) => reason::INVALID_SPEC,
            RuntimeError::ReidentifyFailed { .. } => template::reason::REIDENTIFY_FAILED,
            RuntimeError::Templates(_) => reason::STATE_DIR_UNUSABLE,
        }
    }

    /// The request field at fault, for refusals of the request itself.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            RuntimeError::InvalidUid(_) => Some("uid"),
            RuntimeError::InvalidTemplateKey(_) => Some("key"),
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
    /// Serialises per-VM uid assignments (each picks the lowest one no VM directory holds).
    jail_lock: Mutex<()>,
    /// VM templates and their builds (docs/snapshots.md).
    templates: template::Templates,
}

/// How often the serial logs are held to their cap: a guest writing at disk speed adds at most
/// this long's worth past it.
const SERIAL_CHECK: Duration = Duration::from_secs(1);

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

impl Runtime {
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub(super) fn lock(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .expect("lock table")
            .entry(uid.to_string())
            .or_default()
            .clone()
    }

    pub fn readiness(&self) -> Readiness {
        let bins: Vec<&Path> = match self.cfg.backend {
            Backend::Firecracker => match self.jailer(Backend::Firecracker) {
                Some(j) => vec![&self.cfg.firecracker_bin, &j.bin],
                None => vec![&self.cfg.firecracker_bin],
            },
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

    pub(super) async fn refresh_state_gauge(&self) {
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

    /// Current record, noticing a process that ended since (Running -> Exited).
    pub(super) async fn observe(&self, uid: &str) -> Result<Option<VmRecord>, RuntimeError> {
        let Some(mut r) = self.inventory.get(uid).await? else {
            return Ok(None);
        };
        if r.state == VmState::Running && !vm::of_record(&r).is_some_and(|v| v.is_alive()) {
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

    /// The `cgroup.procs` files of VM `uid`'s own cgroups, made with the limits of `spec`
    /// (none when per-VM cgroups are off).
    fn vm_cgroup(&self, uid: &str, spec: &VmSpec) -> Result<Vec<PathBuf>, CgroupError> {
        match &self.cgroups {
            Some(cg) => cg.create(uid, spec.memory_mib, spec.vcpu),
            None => Ok(Vec::new()),
        }
    }

    /// Firecracker's jailer, when VMs of `backend` run through it (confinement on).
    pub(super) fn jailer(&self, backend: Backend) -> Option<&JailerConfig> {
        self.cfg.jail.as_ref()?;
        (backend == Backend::Firecracker)
            .then_some(self.cfg.jailer.as_ref())
            .flatten()
    }

    /// `<chroot_base>/<Firecracker's file name>`: every jail of this runtime's Firecracker.
    pub(super) fn jails_dir(&self) -> Option<PathBuf> {
        let j = self.jailer(Backend::Firecracker)?;
        jailer::jails_dir(j, &self.cfg.firecracker_bin).ok()
    }

    /// The confinement of row `r`'s processes (none when off, or for an unjailed
    /// Firecracker): its directory's uid, assigned now if it has none (the same range and
    /// allocator for QEMU and jailed Firecracker VMs); its writable drive made its own (0600).
    fn vm_jail(&self, r: &VmRecord) -> Result<Option<VmJail>, RuntimeError> {
        let Some(cfg) = &self.cfg.jail else {
            return Ok(None);
        };
        if r.backend == Backend::Firecracker && self.jailer(r.backend).is_none() {
            return Ok(None);
        }
        let err = |source| RuntimeError::Jail {
            uid: r.uid.clone(),
            source,
        };
        let id = {
            let _held = self.jail_lock.lock().expect("jail lock");
            jail::assign(cfg, &self.vms_dir, &r.dir).map_err(err)?
        };
        if let Some(w) = r.writable_disk.as_ref().filter(|w| w.exists()) {
            jail::own(w, id, 0o600).map_err(|source| {
                err(JailError::VmDir {
                    path: w.clone(),
                    source,
                })
            })?;
        }
        Ok(Some(VmJail {
            id,
            mount_point: jail_mount_point(&self.cfg.state_dir),
        }))
    }

    /// The kernel and initrd a spec boots: its own, or the runtime's.
    fn boot_files(&self, spec: &VmSpec) -> (PathBuf, Option<PathBuf>) {
        let kernel = spec.kernel.clone();
        let initrd = spec.initrd.clone().or_else(|| self.cfg.initrd.clone());
        (kernel.unwrap_or_else(|| self.cfg.kernel.clone()), initrd)
    }

    /// The VMM plan of a recorded VM (its resolved base disk, writable drive and TAP).
    fn plan_of(&self, r: &VmRecord, spec: &VmSpec) -> VmPlan {
        let (kernel, initrd) = self.boot_files(spec);
        let host = HostFacts {
            kernel,
            initrd,
            base_disk: r.base_disk.clone(),
            writable_disk: r.writable_disk.clone(),
            tap: r.tap.clone(),
            vsock: r.vsock_path.clone(),
        };
        vm_plan(&r.uid, spec, &host, r.backend)
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

    pub(super) async fn running(
        &self,
        uid: &str,
        operation: &'static str,
    ) -> Result<VmRecord, RuntimeError> {
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

    pub async fn vsock_path(&self, uid: &str) -> Result<PathBuf, RuntimeError> {
        Ok(self.running(uid, "vsock").await?.vsock_path)
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
}

/// The empty directory every confined process mounts its own root on (in its own namespace).
pub fn jail_mount_point(state_dir: &Path) -> PathBuf {
    state_dir.join("jail")
}

/// The path a VM's files live under (for tests and tools).
pub fn vm_dir(state_dir: &Path, uid: &str) -> PathBuf {
    state_dir.join("vms").join(uid)
}
