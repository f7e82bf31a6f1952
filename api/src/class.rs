//! ImpVMClass: the size and behaviour of a VM (cluster-scoped).

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::RestartPolicy;

/// Size and behaviour shared by the VMs that name this class.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpVMClass",
    plural = "impvmclasses",
    shortname = "impcls",
    category = "imp",
    doc = "Size and behaviour of an Imp microVM.",
    printcolumn(name = "VCPU", type_ = "integer", json_path = ".spec.vcpu"),
    printcolumn(
        name = "Memory",
        type_ = "integer",
        json_path = ".spec.memoryMiB",
        description = "memory in MiB"
    ),
    printcolumn(
        name = "Disk",
        type_ = "integer",
        json_path = ".spec.diskGiB",
        description = "writable disk in GiB",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ImpVMClassSpec {
    /// Virtual CPUs.
    #[schemars(range(min = 1, max = 32))]
    pub vcpu: u32,
    /// Guest memory in MiB.
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = 128))]
    pub memory_mib: u32,
    /// Size of the per-VM writable disk in GiB (default 4).
    #[serde(rename = "diskGiB", default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub disk_gib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probes: Option<Probes>,
    /// Inherited by persistent VMs of this class that set no restartPolicy themselves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<RestartPolicy>,
}

/// Default writable disk size when the class sets none.
pub const DEFAULT_DISK_GIB: u32 = 4;

impl ImpVMClassSpec {
    pub fn disk_gib(&self) -> u32 {
        self.disk_gib.unwrap_or(DEFAULT_DISK_GIB)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Probes {
    /// Checked by the node agent inside the guest; drives the VM's Ready condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness_probe: Option<Probe>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Probe {
    pub http: HttpGetProbe,
    /// Seconds between probes (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub period_seconds: Option<u32>,
    /// Consecutive failures before Ready turns False (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub failure_threshold: Option<u32>,
    /// Seconds one probe may take (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub timeout_seconds: Option<u32>,
}

impl Probe {
    pub fn period_seconds(&self) -> u32 {
        self.period_seconds.unwrap_or(10)
    }
    pub fn failure_threshold(&self) -> u32 {
        self.failure_threshold.unwrap_or(3)
    }
    pub fn timeout_seconds(&self) -> u32 {
        self.timeout_seconds.unwrap_or(1)
    }
}

/// HTTP GET against 127.0.0.1 inside the guest; 2xx and 3xx pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpGetProbe {
    #[x_kube(validation = kube::core::Rule::new("self.startsWith('/')").message("path must start with /"))]
    #[schemars(length(max = 1024))]
    pub path: String,
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
}
