//! Firecracker simulator (binary `imp-firecracker-sim`): Firecracker's command line and the API
//! subset Imp uses, checked against reference/firecracker/firecracker-api.yaml; on
//! InstanceStart it runs imp-guest as a host process behind the hybrid vsock. See
//! docs/runtime.md for the knobs. [`real`] decides whether a test's real-Firecracker path runs.

pub mod real;
pub mod sim;
pub mod spec;

use std::path::PathBuf;
use std::sync::OnceLock;

pub use real::{Needs, RealFirecracker, real_or_skip};
pub use sim::{Knobs, ReidentifyKnob};

/// Paths of the binaries a runtime test needs.
#[derive(Debug, Clone)]
pub struct SimBinaries {
    pub simulator: PathBuf,
    pub guest: PathBuf,
}

/// Locate `imp-firecracker-sim` and `imp-guest` beside the running test (or bench) binary,
/// building them (once per process) unless both are newer than their sources.
/// `IMP_FIRECRACKER_SIM_BIN` and `IMP_GUEST_BIN` override.
pub fn binaries() -> &'static SimBinaries {
    static BINS: OnceLock<SimBinaries> = OnceLock::new();
    BINS.get_or_init(|| {
        let sim_override = std::env::var_os("IMP_FIRECRACKER_SIM_BIN").map(PathBuf::from);
        let guest_override = std::env::var_os("IMP_GUEST_BIN").map(PathBuf::from);
        if let (Some(simulator), Some(guest)) = (sim_override.clone(), guest_override.clone()) {
            return SimBinaries { simulator, guest };
        }
        let built = crate::bins::ensure_built(
            &[
                ("imp-testkit", "imp-firecracker-sim"),
                ("imp-guest", "imp-guest"),
            ],
            &[
                "testkit/src",
                "testkit/Cargo.toml",
                "guest/src",
                "guest/Cargo.toml",
            ],
        )
        .unwrap_or_else(|e| panic!("simulator binaries: {e}"));
        SimBinaries {
            simulator: sim_override.unwrap_or_else(|| built[0].clone()),
            guest: guest_override.unwrap_or_else(|| built[1].clone()),
        }
    })
}

/// A `Reidentify` for a clone: 32 fresh random bytes of entropy, `hostname`, the host's clock,
/// no machine-id (the guest makes one) and no network.
pub fn reidentify_request(hostname: &str) -> imp_guest::protocol::Reidentify {
    use base64::Engine as _;
    let mut entropy = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut entropy))
        .unwrap();
    imp_guest::protocol::Reidentify {
        entropy_b64: base64::engine::general_purpose::STANDARD.encode(entropy),
        hostname: hostname.into(),
        machine_id: None,
        wall_clock_unix_ns: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
        network: None,
    }
}

#[cfg(test)]
mod clone_tests;
#[cfg(test)]
mod sim_tests;
