//! Firecracker simulator (binary `imp-firecracker-sim`): Firecracker's command line and the API
//! subset Imp uses, checked against shared/reference/firecracker/firecracker-api.yaml; on
//! InstanceStart it runs imp-guest as a host process behind the hybrid vsock. See
//! docs/runtime.md for the knobs.

pub mod sim;
pub mod spec;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

pub use sim::Knobs;

/// Paths of the binaries a runtime test needs.
#[derive(Debug, Clone)]
pub struct SimBinaries {
    pub simulator: PathBuf,
    pub guest: PathBuf,
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::paths::workspace_root().join("target"))
}

/// Build (once per test process) and locate `imp-firecracker-sim` and `imp-guest` in the
/// workspace's debug target dir (honouring CARGO_TARGET_DIR). `cargo build` is a no-op when
/// they are fresh.
pub fn binaries() -> &'static SimBinaries {
    static BINS: OnceLock<SimBinaries> = OnceLock::new();
    BINS.get_or_init(|| {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(crate::paths::workspace_root())
            .args([
                "build",
                "-p",
                "imp-guest",
                "--bin",
                "imp-guest",
                "-p",
                "imp-testkit",
                "--bin",
                "imp-firecracker-sim",
            ])
            .status()
            .expect("run cargo build for the simulator binaries");
        assert!(
            status.success(),
            "cargo build of imp-guest and imp-firecracker-sim failed"
        );
        let dir = target_dir().join("debug");
        SimBinaries {
            simulator: dir.join("imp-firecracker-sim"),
            guest: dir.join("imp-guest"),
        }
    })
}

#[cfg(test)]
mod sim_tests;
