//! What the Firecracker driver tests (driver.rs, clone.rs, clone_jailed.rs) share: the VMMs they
//! spawn killed when they end, and each VMM's files in a directory.

use std::path::Path;

use imp_runtime::firecracker::VmmFiles;

/// Kills the VMMs a test spawned when it ends, also when it panics: a VMM is spawned detached
/// (by design it outlives its runtime), so nothing else would stop it.
#[derive(Default)]
pub struct KillOnDrop(pub Vec<i32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for &pid in &self.0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// The files of VMM `name` (unjailed) in `dir`.
pub fn files(dir: &Path, name: &str) -> VmmFiles {
    VmmFiles {
        api_sock: dir.join(format!("{name}.api")),
        vsock: dir.join(format!("{name}.vsock")),
        serial_log: dir.join(format!("{name}.serial")),
        stderr_log: dir.join(format!("{name}.stderr")),
        vmm_log: dir.join(format!("{name}.fc.log")),
        jail: None,
    }
}
