//! The runtime: VM lifecycle by uid over the inventory, the Firecracker driver and the TAP, and
//! the startup reconciliation that reattaches live VMs after a restart.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use imp_api::names::reason;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::firecracker::{self, BootPlan, DriverError, Vmm, VmmFiles, api};
use crate::inventory::{Inventory, InventoryError, VmRecord, VmState};
use crate::metrics::{Metrics, ReasonLabel, StateLabel};
use crate::procfs;
use crate::rootfs::store::{ImageSpec, RootfsError, RootfsStore, StoreConfig};
use crate::rootfs::writable::{WritableDrives, WritableError};
use crate::tap::{self, LinkStats, TapError};

/// Guest CID of every VM: each Firecracker has its own vsock device, so CIDs need not differ.
const GUEST_CID: u32 = 3;
/// Firecracker itself appends `root=/dev/vda ro` for the read-only root drive.
const DEFAULT_BOOT_ARGS: &str =
    "console=ttyS0 reboot=k panic=1 pci=off init=/sbin/imp-guest imp.halt=reboot";
const MAX_UID_LEN: usize = 63;

#[derive(Debug, Clone)]
pub struct Config {
    pub state_dir: PathBuf,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub firecracker_bin: PathBuf,
    pub boot_timeout: Duration,
    pub stop_timeout: Duration,
    /// The rootfs cache (images built from OCI references); its `dir` is usually
    /// `<state_dir>/rootfs`.
    pub rootfs: StoreConfig,
}

/// Body of `PUT /v1/vms/{uid}`: the resolved spec (class, image, network already looked up by
/// the agent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    pub vcpu: u32,
    pub memory_mib: u64,
    /// Read-only root drive given as an existing file; exactly one of this and `image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_disk: Option<PathBuf>,
    /// Read-only root drive built from OCI images by the rootfs cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    /// Size of the per-VM writable drive, a sparse file the runtime creates (none when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writable_disk_bytes: Option<u64>,
    /// Overrides the runtime's kernel / initrd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    /// Appended to the runtime's default kernel command line (e.g. `ip=`, `imp.dns=`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_boot_args: Option<String>,
    /// A TAP-backed virtio-net interface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub reason: String,
    pub message: String,
}

/// Body of `GET /v1/vms/{uid}` (and of a successful PUT).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmStatus {
    pub uid: String,
    pub state: VmState,
    pub pid: Option<i32>,
    pub api_socket: PathBuf,
    pub vsock_path: PathBuf,
    pub serial_log: PathBuf,
    pub tap: Option<String>,
    pub boot_seconds: Option<f64>,
    pub failure: Option<Failure>,
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub snapshot_path: PathBuf,
    pub mem_file_path: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("invalid VM uid {0:?}: 1-63 characters of a-z, 0-9 and '-', starting alphanumeric")]
    InvalidUid(String),
    #[error("invalid spec: {0}")]
    InvalidSpec(String),
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
    #[error("VM {uid} failed to start: {source}")]
    Boot { uid: String, source: DriverError },
    /// A start that failed earlier, as recorded in the inventory (a repeated PUT).
    #[error("VM {uid} failed to start: {}: {}", failure.reason, failure.message)]
    Failed { uid: String, failure: Failure },
    #[error("network setup for VM {uid}: {source}")]
    NetworkSetupFailed { uid: String, source: TapError },
    #[error("disk setup for VM {uid}: {message}")]
    DiskSetupFailed { uid: String, message: String },
    #[error("writable drive for VM {uid}: {source}")]
    WritableDrive { uid: String, source: WritableError },
    #[error("root filesystem for VM {uid}: {source}")]
    Rootfs {
        uid: String,
        source: Box<RootfsError>,
    },
    #[error("link stats of VM {uid}: {source}")]
    LinkStats { uid: String, source: TapError },
    #[error("snapshot of VM {uid}: {source}")]
    Snapshot {
        uid: String,
        source: firecracker::ApiClientError,
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
            RuntimeError::Boot { source, .. } => source.reason(),
            RuntimeError::NetworkSetupFailed { .. } => reason::NETWORK_SETUP_FAILED,
            RuntimeError::DiskSetupFailed { .. } | RuntimeError::WritableDrive { .. } => {
                reason::DISK_SETUP_FAILED
            }
            RuntimeError::Rootfs { source, .. } => source.reason(),
            RuntimeError::LinkStats { .. } => reason::LINK_STATS_UNAVAILABLE,
            RuntimeError::Snapshot { .. } => reason::SNAPSHOT_FAILED,
            RuntimeError::Inventory(_) => reason::INVENTORY_ERROR,
            RuntimeError::StateDir { .. }
            | RuntimeError::RootfsStore(_)
            | RuntimeError::WritableTemplates(_) => reason::STATE_DIR_UNUSABLE,
        }
    }
}

/// What a PUT did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    Created,
    Existing,
}

/// Readiness of the host for VMs (`GET /readyz`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    pub kvm: bool,
    pub firecracker_bin: bool,
    pub kernel: bool,
}

impl Readiness {
    pub fn ready(&self) -> bool {
        self.kvm && self.firecracker_bin && self.kernel
    }
}

pub struct Runtime {
    cfg: Config,
    vms_dir: PathBuf,
    inventory: Inventory,
    rootfs: RootfsStore,
    writable: WritableDrives,
    pub metrics: Metrics,
    /// One lock per uid: operations on a VM are serialised, different VMs run concurrently.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

fn valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= MAX_UID_LEN
        && uid.as_bytes()[0].is_ascii_alphanumeric()
        && uid
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn validate(spec: &VmSpec) -> Result<(), RuntimeError> {
    let bad = |m: String| Err(RuntimeError::InvalidSpec(m));
    // Firecracker: 1 or an even number, at most 32.
    if spec.vcpu == 0 || spec.vcpu > 32 || (spec.vcpu > 1 && spec.vcpu % 2 == 1) {
        return bad(format!(
            "vcpu {} must be 1 or an even number up to 32",
            spec.vcpu
        ));
    }
    if spec.memory_mib < 16 {
        return bad(format!("memory_mib {} is below 16", spec.memory_mib));
    }
    match (&spec.base_disk, &spec.image) {
        (Some(disk), None) => {
            if !disk.is_absolute() || !disk.is_file() {
                return bad(format!(
                    "base_disk {} is not an existing file (absolute path)",
                    disk.display()
                ));
            }
        }
        (None, Some(image)) => {
            for (field, reference) in [
                ("image.base", Some(&image.base)),
                ("image.runner", image.runner.as_ref()),
            ] {
                if let Some(r) = reference
                    && let Err(e) = r.parse::<oci_client::Reference>()
                {
                    return bad(format!("{field} {r:?} is not an image reference: {e}"));
                }
            }
        }
        _ => return bad("exactly one of base_disk and image is required".into()),
    }
    if spec.writable_disk_bytes == Some(0) {
        return bad("writable_disk_bytes must be positive".into());
    }
    if let Some(mac) = spec.network.as_ref().and_then(|n| n.guest_mac.as_ref()) {
        let parts: Vec<&str> = mac.split(':').collect();
        if parts.len() != 6
            || !parts
                .iter()
                .all(|p| p.len() == 2 && u8::from_str_radix(p, 16).is_ok())
        {
            return bad(format!("guest_mac {mac:?} is not a MAC address"));
        }
    }
    Ok(())
}

/// A locally administered unicast MAC derived from the TAP name.
fn default_mac(tap: &str) -> String {
    let h = u32::from_str_radix(&tap[tap.len() - 8..], 16).unwrap_or(0);
    let b = h.to_be_bytes();
    format!("06:00:{:02x}:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2], b[3])
}

fn kvm_usable() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
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
        let rt = Arc::new(Self {
            cfg,
            vms_dir,
            inventory,
            rootfs,
            writable,
            metrics,
            locks: Mutex::new(HashMap::new()),
        });
        rt.recover().await?;
        rt.readiness();
        Ok(rt)
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
        let r = Readiness {
            kvm: kvm_usable(),
            firecracker_bin: self.cfg.firecracker_bin.is_file(),
            kernel: self.cfg.kernel.is_file(),
        };
        self.metrics.ready.set(i64::from(r.ready()));
        r
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

    fn vmm_of(r: &VmRecord) -> Option<Vmm> {
        Some(Vmm {
            pid: r.pid?,
            start_time: r.start_time?,
            files: files_of(r),
            client: firecracker::FirecrackerClient::new(&r.api_socket),
        })
    }

    /// Startup reconciliation after a restart (or crash) of the runtime:
    /// - Running rows whose process (pid + start time) lives and whose API answers: reattached;
    ///   whose process is gone: marked Exited; alive but unresponsive: killed, marked Failed.
    /// - Creating/Booting rows (a start interrupted by the crash): process killed, TAP, files and
    ///   row removed, so the agent's next PUT starts afresh.
    /// - Firecracker processes under this state dir with no live row (spawned just before a
    ///   crash recorded them): killed. VM directories with no row: removed.
    async fn recover(&self) -> Result<(), RuntimeError> {
        let mut keep: Vec<(i32, u64)> = Vec::new();
        for r in self.inventory.list().await? {
            match r.state {
                VmState::Running => {
                    let Some(vmm) = Self::vmm_of(&r) else {
                        self.inventory.set_state(&r.uid, VmState::Exited).await?;
                        continue;
                    };
                    if !vmm.is_alive() {
                        tracing::warn!(uid = %r.uid, pid = vmm.pid, "VM process died while the runtime was down");
                        self.inventory.set_state(&r.uid, VmState::Exited).await?;
                        self.metrics.recovered("exited");
                    } else if vmm.client.describe_instance().await.is_ok() {
                        tracing::info!(uid = %r.uid, pid = vmm.pid, "reattached to running VM");
                        keep.push((vmm.pid, vmm.start_time));
                        self.metrics.recovered("reattached");
                    } else {
                        tracing::warn!(uid = %r.uid, pid = vmm.pid, "VM process does not answer its API; killing");
                        vmm.kill().await;
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
                }
                VmState::Creating | VmState::Booting => {
                    tracing::info!(uid = %r.uid, state = r.state.as_str(), "cleaning up a VM start interrupted by a restart");
                    if let Some(vmm) = Self::vmm_of(&r) {
                        vmm.kill().await;
                    }
                    self.release_host_resources(&r).await;
                    let _ = std::fs::remove_dir_all(&r.dir);
                    self.inventory.delete(&r.uid).await?;
                    self.metrics.recovered("cleaned");
                }
                VmState::Failed | VmState::Exited => {}
            }
        }
        for (pid, start, sock) in procfs::firecrackers_under(&self.vms_dir) {
            if keep.contains(&(pid, start)) {
                continue;
            }
            tracing::warn!(pid, api_sock = %sock.display(), "killing orphan Firecracker of this runtime");
            let vmm = Vmm {
                pid,
                start_time: start,
                files: VmmFiles {
                    api_sock: sock.clone(),
                    vsock: PathBuf::new(),
                    serial_log: PathBuf::new(),
                    stderr_log: PathBuf::new(),
                },
                client: firecracker::FirecrackerClient::new(&sock),
            };
            vmm.kill().await;
            self.metrics.recovered("orphan_killed");
        }
        let known: Vec<PathBuf> = self
            .inventory
            .list()
            .await?
            .into_iter()
            .map(|r| r.dir)
            .collect();
        if let Ok(entries) = std::fs::read_dir(&self.vms_dir) {
            for e in entries.flatten() {
                if !known.contains(&e.path()) {
                    tracing::info!(dir = %e.path().display(), "removing VM directory without an inventory row");
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        // Image references of VMs that were cleaned up above, or whose start crashed between
        // taking the reference and writing anything else.
        let holders: Vec<String> = self
            .inventory
            .list()
            .await?
            .into_iter()
            .filter(|r| r.state != VmState::Failed)
            .map(|r| r.uid)
            .collect();
        self.rootfs
            .retain_vms(&holders)
            .await
            .map_err(RuntimeError::RootfsStore)?;
        self.refresh_state_gauge().await;
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

    pub async fn list(&self) -> Result<Vec<VmStatus>, RuntimeError> {
        Ok(self
            .inventory
            .list()
            .await?
            .iter()
            .map(VmStatus::from)
            .collect())
    }

    /// Ensure VM `uid` runs `spec`: idempotent; a second PUT with the same spec returns the
    /// recorded state (including a recorded failure) and never starts a second process.
    pub async fn ensure_running(
        &self,
        uid: &str,
        spec: VmSpec,
    ) -> Result<(Ensured, VmStatus), RuntimeError> {
        if !valid_uid(uid) {
            return Err(RuntimeError::InvalidUid(uid.into()));
        }
        validate(&spec)?;
        // Stored and compared without pull credentials: they are used for this request only.
        let stored = VmSpec {
            image: spec.image.as_ref().map(ImageSpec::without_credentials),
            ..spec.clone()
        };
        let spec_json = serde_json::to_string(&stored).expect("spec serialises");
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
        let r = self.create(uid, &spec, spec_json).await?;
        Ok((Ensured::Created, VmStatus::from(&r)))
    }

    async fn create(
        &self,
        uid: &str,
        spec: &VmSpec,
        spec_json: String,
    ) -> Result<VmRecord, RuntimeError> {
        let dir = self.vms_dir.join(uid);
        let tap = spec
            .network
            .as_ref()
            .map(|_| tap::tap_name(&self.cfg.state_dir, uid));
        let mut rec = VmRecord {
            uid: uid.into(),
            state: VmState::Creating,
            spec_json,
            pid: None,
            start_time: None,
            api_socket: dir.join("api.sock"),
            vsock_path: dir.join("vsock.sock"),
            serial_log: dir.join("serial.log"),
            tap: tap.clone(),
            // Known once the rootfs cache hands out the image (bring_up records it).
            base_disk: spec.base_disk.clone().unwrap_or_default(),
            writable_disk: spec.writable_disk_bytes.map(|_| dir.join("writable.img")),
            failure_reason: None,
            failure_message: None,
            boot_seconds: None,
            dir,
        };
        // Row first: whatever happens next, a restarted runtime finds it and can undo it.
        self.inventory.insert(&rec).await?;
        self.refresh_state_gauge().await;
        let result = self.bring_up(&mut rec, spec).await;
        match result {
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
                self.release_host_resources(&rec).await;
                self.metrics
                    .start_failures
                    .get_or_create(&ReasonLabel {
                        reason: e.reason().into(),
                    })
                    .inc();
                self.inventory
                    .set_failed(uid, e.reason(), &e.to_string())
                    .await?;
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
    ) -> Result<(), (RuntimeError, Option<Vmm>)> {
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
            tap::create(t).map_err(|source| {
                (
                    RuntimeError::NetworkSetupFailed {
                        uid: uid.clone(),
                        source,
                    },
                    None,
                )
            })?;
        }
        let files = files_of(rec);
        let spawned_at = Instant::now();
        let vmm = firecracker::spawn(&self.cfg.firecracker_bin, &uid, &files).map_err(boot)?;
        let fail = |source, vmm: &Vmm| {
            (
                RuntimeError::Boot {
                    uid: uid.clone(),
                    source,
                },
                Some(vmm.clone()),
            )
        };
        self.inventory
            .set_process(&uid, vmm.pid, vmm.start_time)
            .await
            .map_err(|e| (e.into(), Some(vmm.clone())))?;
        rec.pid = Some(vmm.pid);
        rec.start_time = Some(vmm.start_time);
        vmm.wait_api_ready().await.map_err(|e| fail(e, &vmm))?;

        let mut boot_args = DEFAULT_BOOT_ARGS.to_string();
        if rec.writable_disk.is_some() {
            boot_args.push_str(" imp.overlay=/dev/vdb");
        }
        if let Some(extra) = &spec.extra_boot_args {
            boot_args.push(' ');
            boot_args.push_str(extra);
        }
        let mut drives = vec![api::Drive {
            drive_id: "rootfs".into(),
            is_root_device: true,
            partuuid: None,
            cache_type: None,
            is_read_only: Some(true),
            path_on_host: Some(rec.base_disk.display().to_string()),
            io_engine: None,
            socket: None,
        }];
        if let Some(w) = &rec.writable_disk {
            drives.push(api::Drive {
                drive_id: "writable".into(),
                is_root_device: false,
                partuuid: None,
                cache_type: None,
                is_read_only: Some(false),
                path_on_host: Some(w.display().to_string()),
                io_engine: None,
                socket: None,
            });
        }
        let plan = BootPlan {
            machine: api::MachineConfiguration {
                vcpu_count: spec.vcpu,
                mem_size_mib: spec.memory_mib,
                smt: None,
                track_dirty_pages: None,
                huge_pages: None,
            },
            boot_source: api::BootSource {
                kernel_image_path: kernel.display().to_string(),
                initrd_path: initrd.map(|p| p.display().to_string()),
                boot_args: Some(boot_args),
            },
            drives,
            network: rec
                .tap
                .iter()
                .map(|t| api::NetworkInterface {
                    iface_id: "eth0".into(),
                    host_dev_name: t.clone(),
                    guest_mac: Some(
                        spec.network
                            .as_ref()
                            .and_then(|n| n.guest_mac.clone())
                            .unwrap_or_else(|| default_mac(t)),
                    ),
                    mtu: None,
                })
                .collect(),
            vsock: api::Vsock {
                guest_cid: GUEST_CID,
                uds_path: files.vsock.display().to_string(),
            },
        };
        vmm.configure(&plan).await.map_err(|e| fail(e, &vmm))?;
        self.inventory
            .set_state(&uid, VmState::Booting)
            .await
            .map_err(|e| (e.into(), Some(vmm.clone())))?;
        vmm.instance_start().await.map_err(|e| fail(e, &vmm))?;
        let deadline = spawned_at + self.cfg.boot_timeout;
        vmm.wait_for_hello(deadline)
            .await
            .map_err(|e| fail(e, &vmm))?;
        let secs = spawned_at.elapsed().as_secs_f64();
        self.metrics.boot_latency.observe(secs);
        rec.boot_seconds = Some(secs);
        self.inventory
            .set_running(&uid, secs)
            .await
            .map_err(|e| (e.into(), Some(vmm.clone())))?;
        tracing::info!(uid, pid = vmm.pid, boot_seconds = secs, "VM running");
        Ok(())
    }

    /// Stop and remove VM `uid`: process (SendCtrlAltDel, then SIGKILL), TAP, disks, files, row.
    /// Idempotent: an unknown uid is already deleted.
    pub async fn delete(&self, uid: &str) -> Result<(), RuntimeError> {
        if !valid_uid(uid) {
            return Err(RuntimeError::InvalidUid(uid.into()));
        }
        let lock = self.lock(uid);
        let _guard = lock.lock().await;
        let Some(r) = self.inventory.get(uid).await? else {
            return Ok(());
        };
        if let Some(vmm) = Self::vmm_of(&r) {
            vmm.stop(self.cfg.stop_timeout).await;
        }
        self.release_host_resources(&r).await;
        let _ = std::fs::remove_dir_all(&r.dir);
        self.inventory.delete(uid).await?;
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

    pub async fn linkstats(&self, uid: &str) -> Result<LinkStats, RuntimeError> {
        let r = self.running(uid, "linkstats").await?;
        let t = r.tap.ok_or_else(|| RuntimeError::NoNetwork(uid.into()))?;
        tap::stats(&t).map_err(|source| RuntimeError::LinkStats {
            uid: uid.into(),
            source,
        })
    }

    pub async fn vsock_path(&self, uid: &str) -> Result<PathBuf, RuntimeError> {
        Ok(self.running(uid, "vsock").await?.vsock_path)
    }

    /// Pause, write a full snapshot into the VM directory, resume (unless `resume` is false).
    pub async fn snapshot(&self, uid: &str, resume: bool) -> Result<SnapshotInfo, RuntimeError> {
        let lock = self.lock(uid);
        let _guard = lock.lock().await;
        let r = self.running(uid, "snapshot").await?;
        let vmm = Self::vmm_of(&r).ok_or_else(|| RuntimeError::NotFound(uid.into()))?;
        let info = SnapshotInfo {
            snapshot_path: r.dir.join("snapshot.vmstate"),
            mem_file_path: r.dir.join("snapshot.mem"),
        };
        let err = |source| RuntimeError::Snapshot {
            uid: uid.into(),
            source,
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

fn files_of(r: &VmRecord) -> VmmFiles {
    VmmFiles {
        api_sock: r.api_socket.clone(),
        vsock: r.vsock_path.clone(),
        serial_log: r.serial_log.clone(),
        stderr_log: r.dir.join("firecracker.stderr"),
    }
}

/// The path a VM's files live under (for tests and tools).
pub fn vm_dir(state_dir: &Path, uid: &str) -> PathBuf {
    state_dir.join("vms").join(uid)
}
