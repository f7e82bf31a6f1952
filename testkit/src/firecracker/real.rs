//! Real Firecracker for tests: one decision, from the environment, whether a real-Firecracker test
//! path runs, skips saying what is missing, or (under `IMP_REQUIRE_FIRECRACKER=1`) fails, as
//! [`crate::qemu::setup_or_skip`] does for QEMU with `IMP_REQUIRE_QEMU`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The firecracker binary.
pub const FIRECRACKER_BIN_ENV: &str = "IMP_FIRECRACKER_BIN";
/// An uncompressed guest kernel with virtio-blk, vsock, ext4 and overlayfs built in.
pub const KERNEL_ENV: &str = "IMP_KERNEL";
/// A ready base drive (ext4 with imp-guest at /sbin/imp-guest).
pub const ROOTFS_ENV: &str = "IMP_ROOTFS";
/// The static imp-guest built by guest/check-static.sh.
pub const GUEST_STATIC_BIN_ENV: &str = "IMP_GUEST_STATIC_BIN";
/// `1`: a real-Firecracker path that cannot run fails instead of skipping.
pub const REQUIRE_ENV: &str = "IMP_REQUIRE_FIRECRACKER";

/// What a real-Firecracker test needs besides firecracker and a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// A base drive: `IMP_ROOTFS`, or one built around `IMP_GUEST_STATIC_BIN`.
    BaseDrive,
    /// This build's static imp-guest (`IMP_GUEST_STATIC_BIN`), whatever `IMP_ROOTFS` says.
    GuestBinary,
}

/// Where the base drive comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseDrive {
    /// A ready image (`IMP_ROOTFS`).
    Rootfs(PathBuf),
    /// An ext4 image built around this static imp-guest.
    GuestBinary(PathBuf),
}

/// Everything a real-Firecracker test path needs, all present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RealFirecracker {
    pub firecracker: PathBuf,
    pub kernel: PathBuf,
    pub base: BaseDrive,
}

/// The decision for one test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Run(RealFirecracker),
    /// Not configured; the text names what is missing.
    Skip(String),
    /// Not configured but `IMP_REQUIRE_FIRECRACKER=1`.
    Fail(String),
}

/// The pure decision: `var` reads the environment, `exists` the file system.
pub fn decide(
    var: impl Fn(&str) -> Option<OsString>,
    exists: impl Fn(&Path) -> bool,
    needs: Needs,
) -> Outcome {
    let mut missing = Vec::new();
    let mut file = |name: &str| -> Option<PathBuf> {
        match var(name).filter(|v| !v.is_empty()) {
            None => {
                missing.push(format!("{name} is not set"));
                None
            }
            Some(v) => {
                let p = PathBuf::from(v);
                if exists(&p) {
                    Some(p)
                } else {
                    missing.push(format!("{name}={} does not exist", p.display()));
                    None
                }
            }
        }
    };
    let firecracker = file(FIRECRACKER_BIN_ENV);
    let kernel = file(KERNEL_ENV);
    let rootfs_set = var(ROOTFS_ENV).is_some_and(|v| !v.is_empty());
    let base = match needs {
        Needs::BaseDrive if rootfs_set => file(ROOTFS_ENV).map(BaseDrive::Rootfs),
        Needs::BaseDrive => file(GUEST_STATIC_BIN_ENV)
            .map(BaseDrive::GuestBinary)
            .or_else(|| {
                if let Some(last) = missing.last_mut() {
                    last.push_str(&format!(" (and {ROOTFS_ENV} is not set)"));
                }
                None
            }),
        Needs::GuestBinary => file(GUEST_STATIC_BIN_ENV).map(BaseDrive::GuestBinary),
    };
    match (firecracker, kernel, base) {
        (Some(firecracker), Some(kernel), Some(base)) => Outcome::Run(RealFirecracker {
            firecracker,
            kernel,
            base,
        }),
        _ if var(REQUIRE_ENV).is_some_and(|v| v == "1") => Outcome::Fail(missing.join(", ")),
        _ => Outcome::Skip(missing.join(", ")),
    }
}

/// The real-Firecracker setup for `test`, or `None` after printing a SKIP line naming what is
/// missing; under `IMP_REQUIRE_FIRECRACKER=1` it panics instead.
pub fn real_or_skip(test: &str, needs: Needs) -> Option<RealFirecracker> {
    match decide(|name| std::env::var_os(name), Path::exists, needs) {
        Outcome::Run(fc) => Some(fc),
        Outcome::Fail(why) => {
            panic!("{test}: {REQUIRE_ENV}=1 but the real-Firecracker path cannot run: {why}")
        }
        Outcome::Skip(why) => {
            crate::skip::skip_or_fail(
                REQUIRE_ENV,
                &format!("{test}: the real-Firecracker path"),
                &why,
            );
            None
        }
    }
}

impl RealFirecracker {
    /// The base drive's path: `IMP_ROOTFS` as given, or (built once per process, removed at exit)
    /// a 64 MiB ext4 image holding only the static imp-guest at /sbin/imp-guest and its mount points.
    pub fn base_drive(&self) -> PathBuf {
        let guest = match &self.base {
            BaseDrive::Rootfs(p) => return p.clone(),
            BaseDrive::GuestBinary(g) => g,
        };
        static BUILT: OnceLock<PathBuf> = OnceLock::new();
        BUILT
            .get_or_init(|| {
                let dir = tempfile::tempdir()
                    .expect("tempdir for the base drive")
                    .keep();
                crate::process::remove_at_exit(&dir);
                let tree = dir.join("tree");
                for d in ["sbin", "proc", "sys", "dev", "run", "tmp", "etc"] {
                    std::fs::create_dir_all(tree.join(d)).expect("base drive tree");
                }
                std::fs::copy(guest, tree.join("sbin/imp-guest"))
                    .unwrap_or_else(|e| panic!("copy {}: {e}", guest.display()));
                let image = dir.join("base.ext4");
                std::fs::File::create(&image)
                    .and_then(|f| f.set_len(64 << 20))
                    .expect("base drive image");
                let ok = Command::new("mkfs.ext4")
                    .args(["-q", "-F", "-d"])
                    .arg(&tree)
                    .arg(&image)
                    .status()
                    .expect("run mkfs.ext4")
                    .success();
                assert!(ok, "mkfs.ext4 of the real-Firecracker base drive failed");
                image
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(env: &[(&str, &str)], present: &[&str], needs: Needs) -> Outcome {
        decide(
            |name| {
                env.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            },
            |p| present.iter().any(|x| Path::new(x) == p),
            needs,
        )
    }

    const ALL: &[&str] = &["/fc", "/vmlinux", "/guest", "/rootfs"];

    #[test]
    fn nothing_set_skips_naming_firecracker_and_the_kernel() {
        let Outcome::Skip(why) = run(&[], ALL, Needs::GuestBinary) else {
            panic!("expected a skip")
        };
        assert_eq!(
            why,
            "IMP_FIRECRACKER_BIN is not set, IMP_KERNEL is not set, IMP_GUEST_STATIC_BIN is not set"
        );
    }

    #[test]
    fn required_turns_the_skip_into_a_failure_with_the_same_reason() {
        let env = [
            ("IMP_REQUIRE_FIRECRACKER", "1"),
            ("IMP_FIRECRACKER_BIN", "/fc"),
        ];
        assert_eq!(
            run(&env, ALL, Needs::GuestBinary),
            Outcome::Fail("IMP_KERNEL is not set, IMP_GUEST_STATIC_BIN is not set".into())
        );
    }

    #[test]
    fn only_the_value_1_requires() {
        for v in ["0", "", "yes"] {
            let env = [("IMP_REQUIRE_FIRECRACKER", v)];
            assert!(
                matches!(run(&env, ALL, Needs::BaseDrive), Outcome::Skip(_)),
                "IMP_REQUIRE_FIRECRACKER={v:?}"
            );
        }
    }

    #[test]
    fn a_path_that_does_not_exist_is_named_with_its_value() {
        let env = [
            ("IMP_FIRECRACKER_BIN", "/fc"),
            ("IMP_KERNEL", "/no-such-kernel"),
            ("IMP_GUEST_STATIC_BIN", "/guest"),
        ];
        assert_eq!(
            run(&env, ALL, Needs::GuestBinary),
            Outcome::Skip("IMP_KERNEL=/no-such-kernel does not exist".into())
        );
    }

    #[test]
    fn an_empty_value_counts_as_unset() {
        let env = [
            ("IMP_FIRECRACKER_BIN", ""),
            ("IMP_KERNEL", "/vmlinux"),
            ("IMP_GUEST_STATIC_BIN", "/guest"),
        ];
        assert_eq!(
            run(&env, ALL, Needs::GuestBinary),
            Outcome::Skip("IMP_FIRECRACKER_BIN is not set".into())
        );
    }

    #[test]
    fn a_base_drive_prefers_imp_rootfs_and_falls_back_to_the_guest_binary() {
        let base = [
            ("IMP_FIRECRACKER_BIN", "/fc"),
            ("IMP_KERNEL", "/vmlinux"),
            ("IMP_GUEST_STATIC_BIN", "/guest"),
        ];
        let with_rootfs = [base.as_slice(), &[("IMP_ROOTFS", "/rootfs")]].concat();
        let expect = |b: BaseDrive| {
            Outcome::Run(RealFirecracker {
                firecracker: "/fc".into(),
                kernel: "/vmlinux".into(),
                base: b,
            })
        };
        assert_eq!(
            run(&with_rootfs, ALL, Needs::BaseDrive),
            expect(BaseDrive::Rootfs("/rootfs".into()))
        );
        assert_eq!(
            run(&base, ALL, Needs::BaseDrive),
            expect(BaseDrive::GuestBinary("/guest".into()))
        );
        // The guest test boots this build's imp-guest even when IMP_ROOTFS is set.
        assert_eq!(
            run(&with_rootfs, ALL, Needs::GuestBinary),
            expect(BaseDrive::GuestBinary("/guest".into()))
        );
    }

    #[test]
    fn a_base_drive_with_neither_source_names_both() {
        let env = [("IMP_FIRECRACKER_BIN", "/fc"), ("IMP_KERNEL", "/vmlinux")];
        assert_eq!(
            run(&env, ALL, Needs::BaseDrive),
            Outcome::Skip("IMP_GUEST_STATIC_BIN is not set (and IMP_ROOTFS is not set)".into())
        );
        // A set IMP_ROOTFS that does not exist is named, not silently replaced by the guest binary.
        let env = [
            ("IMP_FIRECRACKER_BIN", "/fc"),
            ("IMP_KERNEL", "/vmlinux"),
            ("IMP_ROOTFS", "/gone"),
            ("IMP_GUEST_STATIC_BIN", "/guest"),
        ];
        assert_eq!(
            run(&env, ALL, Needs::BaseDrive),
            Outcome::Skip("IMP_ROOTFS=/gone does not exist".into())
        );
    }
}
