//! imp-runtime, the host-level half of a node: VMM processes (Firecracker or QEMU), TAP devices,
//! the VM data plane, the rootfs cache, the SQLite inventory and the node-local socket API whose
//! types live in imp-runtime-api (re-exported here as [`api`] and [`client`]).
//! docs/runtime.md describes the API, the inventory and the reattach rules.

pub use imp_runtime_api::{api, client};

pub mod cgroup;
pub mod firecracker;
pub mod inventory;
pub mod jail;
pub mod metrics;
pub mod network;
pub mod procfs;
pub mod qemu;
pub mod rootfs;
pub mod runtime;
pub mod server;
pub mod tap;
pub mod vmm;
