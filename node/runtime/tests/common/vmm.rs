//! What the Firecracker driver tests (driver.rs, clone.rs, clone_jailed.rs) share: the VMMs they
//! spawn killed when they end, and each VMM's files in a directory.

use std::path::Path;

use imp_runtime::firecracker::api::{BootSource, MachineConfiguration};
use imp_runtime::firecracker::{self, Vmm, VmmFiles};

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

impl KillOnDrop {
    /// VMM `id` of `bin` spawned (unjailed) with `files` and kept to be killed, once its API
    /// answers.
    pub async fn spawn(&mut self, bin: &Path, id: &str, files: &VmmFiles) -> Vmm {
        let vmm = firecracker::spawn(bin, id, files, &[]).unwrap();
        self.0.push(vmm.process.pid);
        vmm.wait_api_ready().await.unwrap();
        vmm
    }
}

/// A machine of `vcpu_count` vCPUs and `mem_size_mib` of memory, nothing else set.
pub fn machine(vcpu_count: u32, mem_size_mib: u64) -> MachineConfiguration {
    MachineConfiguration {
        vcpu_count,
        mem_size_mib,
        smt: None,
        track_dirty_pages: None,
        huge_pages: None,
    }
}

/// `kernel` booted with `console=ttyS0`, no initrd.
pub fn boot_source(kernel: &Path) -> BootSource {
    BootSource {
        kernel_image_path: kernel.display().to_string(),
        initrd_path: None,
        boot_args: Some("console=ttyS0".into()),
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
