//! Firecracker simulator (binary `imp-firecracker-sim`): Firecracker's command line and the API
//! subset Imp uses, checked against shared/reference/firecracker/firecracker-api.yaml; on
//! InstanceStart it runs imp-guest as a host process behind the hybrid vsock. See
//! docs/runtime.md for the knobs.

pub mod sim;
pub mod spec;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::SystemTime;

pub use sim::Knobs;

/// Paths of the binaries a runtime test needs.
#[derive(Debug, Clone)]
pub struct SimBinaries {
    pub simulator: PathBuf,
    pub guest: PathBuf,
}

/// Newest modification time of a file or anything below a directory.
fn newest_mtime(path: &Path) -> Option<SystemTime> {
    let meta = std::fs::metadata(path).ok()?;
    let own = meta.modified().ok();
    if !meta.is_dir() {
        return own;
    }
    std::fs::read_dir(path)
        .ok()?
        .flatten()
        .filter_map(|e| newest_mtime(&e.path()))
        .chain(own)
        .max()
}

/// Locate `imp-firecracker-sim` and `imp-guest` beside the running test (or bench) binary's
/// profile dir, building them (once per process) unless both are newer than their sources:
/// `cargo test --workspace` has built them already, so CI never re-invokes cargo.
/// `IMP_FIRECRACKER_SIM_BIN` and `IMP_GUEST_BIN` override.
pub fn binaries() -> &'static SimBinaries {
    static BINS: OnceLock<SimBinaries> = OnceLock::new();
    BINS.get_or_init(|| {
        let exe = std::env::current_exe().expect("current exe");
        // <target>/<profile>/deps/<test binary>
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test binaries live in <target>/<profile>/deps")
            .to_path_buf();
        let bins = SimBinaries {
            simulator: std::env::var_os("IMP_FIRECRACKER_SIM_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|| profile_dir.join("imp-firecracker-sim")),
            guest: std::env::var_os("IMP_GUEST_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|| profile_dir.join("imp-guest")),
        };
        let root = crate::paths::workspace_root();
        let newest_source = [
            "testkit/src",
            "testkit/Cargo.toml",
            "guest/src",
            "guest/Cargo.toml",
        ]
        .iter()
        .filter_map(|p| newest_mtime(&root.join(p)))
        .max();
        let fresh = |p: &Path| {
            std::fs::metadata(p)
                .and_then(|m| m.modified())
                .is_ok_and(|t| Some(t) >= newest_source)
        };
        if fresh(&bins.simulator) && fresh(&bins.guest) {
            return bins;
        }
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(&root)
            .args([
                "build",
                "-q",
                "-p",
                "imp-guest",
                "--bin",
                "imp-guest",
                "-p",
                "imp-testkit",
                "--bin",
                "imp-firecracker-sim",
            ])
            .env(
                "CARGO_TARGET_DIR",
                profile_dir
                    .parent()
                    .expect("target dir above the profile dir"),
            );
        if let Some(profile) = profile_dir.file_name().and_then(|n| n.to_str()) {
            // "debug" is the dev profile's directory.
            let profile = if profile == "debug" { "dev" } else { profile };
            cmd.args(["--profile", profile]);
        }
        let status = cmd
            .status()
            .expect("run cargo build for the simulator binaries");
        assert!(
            status.success(),
            "cargo build of imp-guest and imp-firecracker-sim failed"
        );
        bins
    })
}

#[cfg(test)]
mod sim_tests;
