//! Imp's node half. This library is imp-runtime (the host-level half: VMM processes (Firecracker or QEMU),
//! TAP devices, SQLite inventory, the node-local socket API) and imp-agent (`agent`: the
//! Kubernetes-facing half, docs/agent.md).
//! docs/runtime.md describes the API, the inventory and the reattach rules.

pub mod agent;
pub mod api;
pub mod cgroup;
pub mod client;
pub mod firecracker;
pub mod inventory;
pub mod metrics;
pub mod network;
pub mod procfs;
pub mod qemu;
pub mod rootfs;
pub mod runtime;
pub mod server;
pub mod tap;
pub mod vmm;
