//! The VMM seam: what every backend shares and nothing above it: the plan a backend is told
//! to boot ([`plan`]), process spawning and identity ([`process`], the one place VMM and helper
//! processes are started), the serial console's tail and cap ([`serial`]), the Hello wait
//! ([`hello`]), why a boot failed ([`DriverError`]) and what a host needs for a backend
//! ([`readiness`]). The backends (`firecracker`, `qemu`) import only this; the runtime imports
//! the backends and this. Inventory, reattach, disks, TAP and metrics stay in the runtime.

mod error;
pub mod hello;
pub mod plan;
pub mod process;
pub mod serial;

use crate::api::{Backend, Readiness};
pub use error::DriverError;
pub use hello::{Detect, listen_for_announcements, wait_for_hello};
pub use plan::{DrivePlan, NicPlan, VmPlan};
pub use process::{Proc, SpawnError, spawn_detached};

/// `/dev/kvm` opens read-write.
pub fn kvm_usable() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

/// What the host has for a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    pub kvm: bool,
    /// Each binary the backend runs, and whether it is there.
    pub bins: Vec<(String, bool)>,
    pub kernel: (String, bool),
}

/// Whether a node with `backend` and these facts can run VMs, and why not: Firecracker needs
/// KVM; QEMU runs without it (TCG), only slower.
pub fn readiness(backend: Backend, facts: &HostFacts) -> Readiness {
    let mut not_ready = Vec::new();
    if backend == Backend::Firecracker && !facts.kvm {
        not_ready.push("/dev/kvm cannot be opened read-write (Firecracker needs KVM)".to_string());
    }
    for (bin, present) in &facts.bins {
        if !present {
            not_ready.push(format!("{bin} is not a file"));
        }
    }
    if !facts.kernel.1 {
        not_ready.push(format!("kernel {} is not a file", facts.kernel.0));
    }
    Readiness {
        backend,
        kvm: facts.kvm,
        vmm_bin: facts.bins.iter().all(|(_, p)| *p),
        kernel: facts.kernel.1,
        not_ready,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(kvm: bool, bins: bool, kernel: bool) -> HostFacts {
        HostFacts {
            kvm,
            bins: vec![("/usr/bin/qemu-system-x86_64".into(), bins)],
            kernel: ("/var/lib/imp/vmlinux".into(), kernel),
        }
    }

    #[test]
    fn firecracker_needs_kvm_qemu_does_not() {
        let fc = readiness(Backend::Firecracker, &facts(false, true, true));
        assert!(!fc.ready());
        assert!(fc.not_ready[0].contains("/dev/kvm"), "{:?}", fc.not_ready);
        let q = readiness(Backend::Qemu, &facts(false, true, true));
        assert!(q.ready(), "{:?}", q.not_ready);
        assert_eq!((q.backend, q.kvm), (Backend::Qemu, false));
    }

    #[test]
    fn every_missing_piece_is_named() {
        let r = readiness(Backend::Qemu, &facts(true, false, false));
        assert_eq!(r.not_ready.len(), 2, "{:?}", r.not_ready);
        assert!(r.not_ready[0].contains("qemu-system-x86_64"));
        assert!(r.not_ready[1].contains("/var/lib/imp/vmlinux"));
        assert!(!r.vmm_bin && !r.kernel);
        assert!(readiness(Backend::Firecracker, &facts(true, true, true)).ready());
    }
}
