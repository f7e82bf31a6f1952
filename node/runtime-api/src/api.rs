//! The agent <-> runtime contract: the bodies of imp-runtime's socket API (docs/runtime.md).
//! server.rs serves these types and client.rs sends them; nothing else defines what crosses
//! that socket, as `firecracker/api.rs` is for Firecracker and `imp_guest::protocol` for the
//! guest.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::image::ImageSpec;

/// Largest `PUT /v1/vms/{uid}` body (a spec with pull credentials is a few KiB).
pub const MAX_BODY_BYTES: usize = 256 << 10;

/// The TAP's cumulative counters (`GET /v1/vms/{uid}/linkstats`), read from sysfs by imp-runtime
/// (tap.rs). Counters of the host side of a TAP: rx = bytes the guest sent, tx = bytes sent to
/// the guest (the host's view: the link's stats64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkStats {
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// Packets routed towards the VM's address while it is Suspended (an nft counter in the
    /// runtime's table, imp-runtime's network/nft.rs); 0 while it runs or without an address.
    #[serde(default)]
    pub wake_packets: u64,
}

/// Body of `PUT /v1/vms/{uid}`: the resolved spec (class, image, network already looked up by
/// the agent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    pub vcpu: u32,
    pub memory_mib: u64,
    /// Read-only root drive given as an existing file under one of the runtime's image
    /// directories; exactly one of this and `image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_disk: Option<PathBuf>,
    /// Read-only root drive built from OCI images by the rootfs cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    /// Size of the per-VM writable drive, a sparse file the runtime creates (none when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writable_disk_bytes: Option<u64>,
    /// Overrides the runtime's kernel / initrd (files under the runtime's image directories).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    /// Appended to the runtime's default kernel command line (e.g. `imp.hostname=`; the network's
    /// `imp.net=`/`imp.dns=` come from `network.attachment`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_boot_args: Option<String>,
    /// A TAP-backed virtio-net interface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,
    /// Start from this node's template for the spec when one is ready: a clone restored from
    /// the template's memory snapshot into a fresh VMM with its own writable drive, TAP and
    /// vsock path, reported Running only after the guest took an identity of its own
    /// (`Reidentify`: entropy, MAC, address, hostname, machine-id, clock; docs/snapshots.md).
    /// Without a ready template that matches, the VM boots cold and `VmStatus.start.fallback`
    /// says why. Not part of a spec conflict: the same VM asked for with and without it is
    /// the same VM.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub from_template: bool,
    /// Guest paths (absolute, no `..`) whose regular files a template of this spec reads into
    /// its page cache after its guest agent's Hello and before the snapshot (the guest's
    /// `Warm`), so that its clones' runners start without reading them from disk
    /// (docs/snapshots.md, "Warming"). Part of the template key; a cold boot ignores it, and,
    /// like `from_template`, it is no part of a spec conflict.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warm_paths: Vec<String>,
}

/// The VM's `eth0`: a TAP, and (with `attachment`) its place on an ImpNetwork's bridge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Default: derived from the VM uid (`network::vm_mac`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
    /// The data plane (docs/network.md): bridge, address, NAT, isolation, and `imp.net` /
    /// `imp.dns` on the kernel command line. Absent: a bare TAP with nothing behind it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment: Option<NetworkAttachment>,
}

/// What the node needs to put one VM on an ImpNetwork: the network's spec (as the agent read
/// it) and the address the operator's IPAM gave the VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkAttachment {
    /// The ImpNetwork's uid: names the bridge (two networks of one name in different namespaces
    /// never share one).
    pub network_id: String,
    /// `namespace/name` of the ImpNetwork, for messages.
    pub network_name: String,
    /// The VM's address with the subnet's prefix, e.g. `10.44.0.5/24` (the IPAM annotation).
    pub address: ipnet::Ipv4Net,
    pub gateway: std::net::Ipv4Addr,
    /// Resolvers for the guest's resolv.conf.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<std::net::Ipv4Addr>,
    /// Guest MTU (default: the guest's, 1500).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Masquerade traffic leaving through the egress interface.
    #[serde(default)]
    pub nat: bool,
    /// Default: the interface of the node's IPv4 default route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_interface: Option<String>,
    /// Destinations the guest may reach (empty: everything not denied).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress_allow: Vec<ipnet::Ipv4Net>,
    /// Destinations the guest may never reach; wins over `egress_allow`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress_deny: Vec<ipnet::Ipv4Net>,
    /// Connections into the guests the node admits (default: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<Ingress>,
}

/// One admitted kind of inbound connection (ImpNetwork `spec.ingress[]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ingress {
    /// Source addresses.
    pub from: ipnet::Ipv4Net,
    pub protocol: imp_api::IngressProtocol,
    /// Destination ports on the guests; empty: every port of the protocol.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
}

/// Where a VM is in its life (also the inventory's `state` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmState {
    /// Row written; disks, TAP or process being set up (nothing started yet in the guest).
    Creating,
    /// The VMM configured and started, waiting for the guest agent's Hello.
    Booting,
    /// The guest agent said Hello.
    Running,
    /// Setup or boot failed; `failure_reason` says why. Host resources are released.
    Failed,
    /// The VMM process ended after the VM ran (guest powered off, or it died).
    Exited,
    /// `POST /v1/vms/{uid}/suspend` in progress: pausing, writing the snapshot, stopping the
    /// VMM.
    Suspending,
    /// No VMM process; the snapshot, disks, TAP and address are kept (`POST .../resume`).
    Suspended,
    /// `POST /v1/vms/{uid}/resume` in progress: a fresh VMM loads the snapshot, then the
    /// guest agent's Hello.
    Resuming,
}

impl VmState {
    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Creating => "Creating",
            VmState::Booting => "Booting",
            VmState::Running => "Running",
            VmState::Failed => "Failed",
            VmState::Exited => "Exited",
            VmState::Suspending => "Suspending",
            VmState::Suspended => "Suspended",
            VmState::Resuming => "Resuming",
        }
    }

    pub const ALL: [VmState; 8] = [
        VmState::Creating,
        VmState::Booting,
        VmState::Running,
        VmState::Failed,
        VmState::Exited,
        VmState::Suspending,
        VmState::Suspended,
        VmState::Resuming,
    ];
}

impl std::str::FromStr for VmState {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        VmState::ALL.into_iter().find(|v| v.as_str() == s).ok_or(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub reason: String,
    pub message: String,
}

/// Body of `GET /v1/vms/{uid}` (and of a PUT: Running once the guest said Hello, Creating or
/// Booting while a bring-up started by an earlier PUT is still in progress).
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
    /// How the VM was started (absent from runtimes that predate templates, and while
    /// Creating).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartReport>,
}

/// How a VM was started: booted, or cloned from a template (docs/snapshots.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartReport {
    pub from: StartKind,
    /// The template's key, for a clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Asked `from_template` but booted: why (`TemplateMissing`, `TemplateBuilding`,
    /// `TemplateStale`, `TemplateVmmMismatch`, `TemplateFailed`, `RestoreFailed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<Failure>,
    /// A clone: from the fresh VMM's start to the restored guest agent's Hello.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_seconds: Option<f64>,
    /// A clone: the `Reidentify` round trip, its evidence checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reidentify_seconds: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StartKind {
    /// A cold boot of kernel and initrd.
    Boot,
    /// Restored from a template's memory snapshot, then reidentified.
    Clone,
}

/// Body of `POST /v1/templates`: keep a template for VMs of `spec` on this node (idempotent;
/// answered at once, the build runs in the background). Its network part only says that the
/// template has a NIC; no address, MAC or hostname goes into a template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateRequest {
    pub spec: VmSpec,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TemplateState {
    /// A VM is being booted, warmed and snapshotted for it.
    Building,
    /// Its snapshot is complete: clones restore from it.
    Ready,
    /// The last build failed (`failure`); retried by the next request after a backoff.
    Failed,
}

/// One template (`GET /v1/templates`, answer of `POST /v1/templates`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateStatus {
    /// Content key: a digest of everything that changes the guest (docs/snapshots.md).
    pub key: String,
    pub state: TemplateState,
    /// Allocated bytes of its files (memory snapshot, writable drive at snapshot time).
    pub bytes: u64,
    /// The VMM and its version the snapshot was taken with (a restore needs the same).
    pub vmm: String,
    /// From the build's start to its snapshot complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_seconds: Option<f64>,
    /// Clones restored from it so far.
    #[serde(default)]
    pub clones: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    /// What its build read into the guest's page cache before the snapshot (a spec with
    /// `warm_paths`); absent for a template built without.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<WarmReport>,
}

/// The page-cache warming of a template's build (docs/snapshots.md, "Warming").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmReport {
    pub files: u64,
    pub bytes: u64,
    pub millis: u64,
    /// A bound (bytes, files) stopped the guest before every file was read.
    #[serde(default)]
    pub truncated: bool,
    /// Entries the guest skipped: symlinks, special files, directories of other filesystems,
    /// unreadable or missing ones.
    #[serde(default)]
    pub skipped: u64,
    /// Why nothing was warmed although asked (a guest too old to know `warm`, no answer in
    /// time): the template was built anyway, cold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Body of `GET /v1/templates`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateList {
    pub templates: Vec<TemplateStatus>,
}

/// Body of `GET /v1/vms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmList {
    pub vms: Vec<VmStatus>,
}

/// Body of `GET /v1/vms/{uid}/vsock`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VsockInfo {
    pub path: PathBuf,
    pub guest_agent_port: u32,
}

/// Body of `GET /v1/capacity`: the node's writable-drive budget and what VMs hold of it, and
/// what templates take (their disk budget, and the VMs their builds run), for the agent to
/// publish as node capacity. The template fields are absent from runtimes that predate them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub writable_budget_bytes: u64,
    /// Writable-drive bytes of every VM but failed ones.
    pub writable_used_bytes: u64,
    /// Bytes the Ready templates may hold together (`--template-budget-bytes`).
    #[serde(default)]
    pub template_budget_bytes: u64,
    /// Allocated bytes of the Ready templates.
    #[serde(default)]
    pub template_used_bytes: u64,
    /// Template builds queued or running: each runs a VM of its size while it builds (one at a
    /// time), which nothing else on the node accounts for.
    #[serde(default)]
    pub template_builds: Vec<TemplateBuild>,
}

/// A template build in flight and the size of its build VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateBuild {
    pub key: String,
    pub vcpu: u32,
    pub memory_mib: u64,
}

/// Answer of `POST /v1/templates/dry-run` (body [`TemplateRequest`]): what a `POST
/// /v1/templates` of the spec would find and whether it would start a build, with nothing
/// started; the agent asks before it lets a build take a VM's room.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateDryRun {
    pub key: String,
    /// The template as it is; absent when the runtime knows none for the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<TemplateStatus>,
    /// The request would start a build (none known, a failed one due for retry, one built by
    /// another VMM).
    pub would_build: bool,
}

/// Body of `POST /v1/images`: build the base image of `image` ahead of its first VM (the agent
/// asks for the pools the node can serve). The answer comes once the image is built, or found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrebuildRequest {
    pub image: ImageSpec,
}

/// Answer of `POST /v1/images`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrebuildStatus {
    /// The image's content key (`docs/rootfs.md`).
    pub key: String,
    /// It was already built (nothing was pulled).
    pub hit: bool,
    /// The references were resolved at the registry (false: `IfNotPresent` found the image,
    /// or the registry was unreachable and an image built from the same references stands in).
    pub resolved: bool,
    /// Still in the cache after garbage collection; false when the image alone does not fit
    /// the cache budget (the first VM builds it again).
    pub cached: bool,
}

/// Body of `POST /v1/vms/{uid}/snapshot` (optional).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// Resume the VM after the snapshot (default true).
    #[serde(default)]
    pub resume: Option<bool>,
}

/// Answer of `POST /v1/vms/{uid}/snapshot`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub snapshot_path: PathBuf,
    pub mem_file_path: PathBuf,
}

/// Answer of `POST /v1/vms/{uid}/suspend`: the VM is Suspended (no VMM process; snapshot,
/// disks, TAP and address kept).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SuspendInfo {
    /// Bytes of the snapshot files on disk (allocated, so a sparse memory file counts what it
    /// holds).
    pub snapshot_bytes: u64,
    /// From the request to the VMM process gone.
    pub took_ms: u64,
}

/// Answer of `POST /v1/vms/{uid}/resume`: the VM is Running again (its guest agent said Hello).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumeInfo {
    pub status: VmStatus,
    /// From the request to the guest agent's Hello on the new VMM.
    pub took_ms: u64,
}

/// The VMM a node's runtime drives (chosen per node: `--backend`, chart value `runtime.backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Firecracker,
    /// QEMU (KVM when usable, TCG otherwise) with one vhost-device-vsock per VM.
    Qemu,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Firecracker => "firecracker",
            Backend::Qemu => "qemu",
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "firecracker" => Ok(Backend::Firecracker),
            "qemu" => Ok(Backend::Qemu),
            other => Err(format!(
                "unknown VMM backend {other:?} (firecracker | qemu)"
            )),
        }
    }
}

/// Body of `GET /readyz`: whether this host can run VMs with its backend, and why not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    pub backend: Backend,
    /// `/dev/kvm` opens read-write (required by Firecracker; QEMU falls back to TCG).
    pub kvm: bool,
    /// Every binary the backend runs is there.
    pub vmm_bin: bool,
    pub kernel: bool,
    /// Why the node is not ready, one sentence each (empty when ready).
    pub not_ready: Vec<String>,
}

impl Readiness {
    pub fn ready(&self) -> bool {
        self.not_ready.is_empty()
    }
}

/// Body of every error answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Stable reason, e.g. `InvalidSpec`, `SpecConflict`, `KernelMissing`, `GuestAgentTimeout`.
    pub error: String,
    pub message: String,
    /// The request field at fault (`kernel`, `base_disk`, `uid`, `body`, ...), for 4xx answers
    /// about the request itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_state_round_trips_through_its_column_text() {
        for s in VmState::ALL {
            assert_eq!(s.as_str().parse::<VmState>(), Ok(s));
        }
        assert_eq!("Paused".parse::<VmState>(), Err(()));
    }

    #[test]
    fn spec_rejects_unknown_fields() {
        let e =
            serde_json::from_str::<VmSpec>(r#"{"vcpu":1,"memory_mib":128,"cpu":2}"#).unwrap_err();
        assert!(e.to_string().contains("cpu"), "{e}");
    }

    #[test]
    fn error_body_without_field_reads_as_none() {
        let b: ErrorBody =
            serde_json::from_str(r#"{"error":"NotFound","message":"no VM x"}"#).unwrap();
        assert_eq!(b.field, None);
        let with = serde_json::to_string(&ErrorBody {
            field: Some("kernel".into()),
            ..b
        })
        .unwrap();
        assert!(with.contains(r#""field":"kernel""#), "{with}");
    }
}
