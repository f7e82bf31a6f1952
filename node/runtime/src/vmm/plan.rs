//! What a backend is told to boot: the plan types. `runtime::plan` computes them from a VM's
//! spec and host facts; each backend translates a [`VmPlan`] into its own configuration calls
//! (Firecracker) or command line (QEMU).

use std::path::PathBuf;

/// One virtio block device, in guest order (`vda`, `vdb`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrivePlan {
    pub id: &'static str,
    pub path: PathBuf,
    pub read_only: bool,
    pub root: bool,
}

/// One virtio-net device backed by a host TAP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicPlan {
    pub id: &'static str,
    pub tap: String,
    pub mac: String,
}

/// Everything a backend needs to boot one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmPlan {
    pub vcpu: u32,
    pub memory_mib: u64,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub boot_args: String,
    pub drives: Vec<DrivePlan>,
    pub nics: Vec<NicPlan>,
    pub guest_cid: u32,
    /// Host side of the hybrid vsock (Firecracker's `uds_path`).
    pub vsock: PathBuf,
}
