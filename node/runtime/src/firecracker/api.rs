//! Firecracker API request and response bodies, field for field as in
//! reference/firecracker/firecracker-api.yaml (definitions of the same name). Optional
//! fields are skipped when absent so Firecracker applies its documented defaults.

use serde::{Deserialize, Serialize};

/// `#/definitions/MachineConfiguration` (PUT /machine-config). `cpu_template` is deprecated
/// upstream and not used by Imp.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineConfiguration {
    pub vcpu_count: u32,
    pub mem_size_mib: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smt: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub track_dirty_pages: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub huge_pages: Option<HugePages>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HugePages {
    None,
    Transparent,
    #[serde(rename = "2M")]
    TwoMiB,
}

/// `#/definitions/BootSource` (PUT /boot-source).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BootSource {
    pub kernel_image_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_args: Option<String>,
}

/// `#/definitions/Drive` (PUT /drives/{drive_id}), virtio-block variant (vhost-user `socket` unused).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Drive {
    pub drive_id: String,
    pub is_root_device: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partuuid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_type: Option<CacheType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_read_only: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_on_host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_engine: Option<IoEngine>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CacheType {
    Unsafe,
    Writeback,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum IoEngine {
    Sync,
    Async,
}

/// `#/definitions/NetworkInterface` (PUT /network-interfaces/{iface_id}); rate limiters unused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NetworkInterface {
    pub iface_id: String,
    pub host_dev_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
}

/// `#/definitions/Vsock` (PUT /vsock). `vsock_id` is deprecated upstream and not sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Vsock {
    pub guest_cid: u32,
    pub uds_path: String,
}

/// `#/definitions/InstanceActionInfo` (PUT /actions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceActionInfo {
    pub action_type: ActionType,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActionType {
    FlushMetrics,
    InstanceStart,
    SendCtrlAltDel,
}

/// `#/definitions/Vm` (PATCH /vm).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Vm {
    pub state: VmState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmState {
    Paused,
    Resumed,
}

/// `#/definitions/SnapshotCreateParams` (PUT /snapshot/create).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotCreateParams {
    pub mem_file_path: String,
    pub snapshot_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_type: Option<SnapshotType>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SnapshotType {
    Full,
    Diff,
}

/// `#/definitions/SnapshotLoadParams` (PUT /snapshot/load). Exactly one of `mem_backend` and the
/// deprecated `mem_file_path`; Imp sends `mem_backend` with the `File` backend (the memory file
/// is mapped `MAP_PRIVATE` and faulted in lazily, so it must outlive the VM). Firecracker refuses
/// fields it does not know, so the newer ones (`clock_realtime`: 1.16) are only sent when set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotLoadParams {
    pub snapshot_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_file_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_backend: Option<MemoryBackend>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub track_dirty_pages: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_vm: Option<bool>,
    /// Since 1.12: another TAP for an interface of the snapshot (the guest keeps its MAC).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network_overrides: Vec<NetworkOverride>,
    /// Since 1.16: another vsock socket; the file must not exist at load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_override: Option<VsockOverride>,
    /// Since 1.16, x86 only: advance kvmclock by the wall-clock time since the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_realtime: Option<bool>,
}

/// `#/definitions/MemoryBackend`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryBackend {
    pub backend_type: MemoryBackendType,
    pub backend_path: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemoryBackendType {
    File,
    Uffd,
}

/// `#/definitions/NetworkOverride`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkOverride {
    pub iface_id: String,
    pub host_dev_name: String,
}

/// `#/definitions/VsockOverride`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VsockOverride {
    pub uds_path: String,
}

/// `#/definitions/InstanceInfo` (GET /).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceInfo {
    pub app_name: String,
    pub id: String,
    pub state: InstanceState,
    pub vmm_version: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InstanceState {
    #[serde(rename = "Not started")]
    NotStarted,
    Running,
    Paused,
}

/// `#/definitions/Error`: every 4xx/5xx body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiError {
    #[serde(default)]
    pub fault_message: String,
}
