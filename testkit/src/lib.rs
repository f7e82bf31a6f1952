//! Imp's test substrate (dev-only): a real Kubernetes control plane harness and simulators.

pub mod binlog;
pub mod bins;
pub mod certs;
pub mod chaos;
pub mod cluster;
pub mod controlplane;
pub mod ext4;
pub mod fake_node;
pub mod faultproxy;
pub mod firecracker;
pub mod fixtures;
pub mod github;
pub mod metrics;
pub mod node;
pub mod oci;
pub mod paths;
pub mod process;
pub mod proxy;
pub mod qemu;
pub mod registry;
pub mod runbook;
pub mod simnode;
pub mod skip;
pub mod tarball;
pub mod waits;

pub use cluster::TestEnv;
