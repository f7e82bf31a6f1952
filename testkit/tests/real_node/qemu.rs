//! The runtime pod on `runtime.backend: qemu`: the release's runtime image carries QEMU and
//! vhost-device-vsock, the node only the guest kernel (the host's, as testkit's QEMU tests find it)
//! and Imp's initrd. The pool's images are the smoke's real-guest ones: a static busybox base
//! (images/busybox-base) and the runner image images/runner/build.sh makes around the static
//! imp-fake-runner, which reaches the GitHub simulator only through its network's NAT.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use imp_testkit::{node, paths, qemu::Setup};

/// What a real guest on the node needs, built and pushed.
pub struct GuestParts {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub base_image: String,
    pub runner_image: String,
}

/// Builds the static imp-fake-runner (as the smoke does) and Imp's initrd for the host's kernel
/// (testkit's, as every real-guest test), and pushes the two images to `registry`.
pub fn build(work: &Path, registry: &str, target_dir: &Path, setup: &Setup) -> GuestParts {
    let root = paths::workspace_root();
    node::run(
        Command::new("cargo")
            .args(["build", "-q", "--release", "--locked"])
            .args([
                "--target",
                "x86_64-unknown-linux-gnu",
                "-p",
                "imp-fake-runner",
            ])
            .current_dir(&root)
            .env("CARGO_TARGET_DIR", target_dir)
            .env("RUSTFLAGS", "-C target-feature=+crt-static")
            .env("CARGO_PROFILE_RELEASE_STRIP", "symbols"),
    )
    .expect("the static imp-fake-runner");
    let fake_runner = target_dir.join("x86_64-unknown-linux-gnu/release/imp-fake-runner");
    let initrd = work.join("initrd.gz");
    imp_testkit::qemu::scripted_initrd(setup, &initrd);
    let base_image = format!("{registry}/imp-dev/runner-base:real-node-qemu");
    node::run(
        Command::new(root.join("images/busybox-base/build.sh"))
            .arg("--out")
            .arg(work.join("base-oci"))
            .args(["--tag", "real-node-qemu", "--push", &base_image]),
    )
    .expect("images/busybox-base/build.sh");
    let runner_image = format!("{registry}/imp-dev/actions-runner:real-node-qemu");
    node::run(
        Command::new(root.join("images/runner/build.sh"))
            .arg("--fake-runner")
            .arg(&fake_runner)
            .arg("--out")
            .arg(work.join("runner-oci"))
            .args(["--tag", "real-node-qemu", "--push", &runner_image]),
    )
    .expect("images/runner/build.sh");
    GuestParts {
        kernel: setup.kernel.clone(),
        initrd,
        base_image,
        runner_image,
    }
}

/// Chart values that move the node to QEMU (TCG: a nested /dev/kvm may open and still boot nothing):
/// the runner command back to the runner image's wrapper inside the guest (the Firecracker phase ran
/// a host binary), a boot timeout for a TCG guest on a busy host. The kernel and initrd paths are
/// the caller's `--set`s.
pub const VALUES: &str = "agent:\n  extraEnv:\n\
     \x20   - {name: IMP_POLL_INTERVAL, value: 1s}\n\
     \x20   - {name: IMP_SWEEP_INTERVAL, value: 2s}\n\
     runtime:\n  backend: qemu\n  qemuAccel: tcg\n  extraEnv:\n\
     \x20   - {name: IMP_GUEST_BIN, value: /usr/local/lib/imp/imp-guest}\n\
     \x20   - {name: IMP_BOOT_TIMEOUT, value: 240s}\n";
