//! The API filesystems PID 1 mounts. Every function takes the root to mount under, so tests
//! can run them on a scratch directory inside a private mount namespace.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::mount::{MsFlags, mount};

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("create mount point {path}: {source}")]
    MountPoint {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mount {fstype} on {target}: {source}")]
    Mount {
        fstype: String,
        target: PathBuf,
        source: nix::Error,
    },
}

/// One filesystem to mount at `target` (relative to the root given to [`mount_all`]).
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub source: &'static str,
    pub target: &'static str,
    pub fstype: &'static str,
    pub flags: MsFlags,
    pub data: Option<&'static str>,
}

const NOSUID_NODEV: MsFlags = MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV);

/// Needed before anything else: /proc for the command line, /dev for the drives.
pub const EARLY: &[Spec] = &[
    Spec {
        source: "proc",
        target: "proc",
        fstype: "proc",
        flags: NOSUID_NODEV.union(MsFlags::MS_NOEXEC),
        data: None,
    },
    Spec {
        source: "sysfs",
        target: "sys",
        fstype: "sysfs",
        flags: NOSUID_NODEV.union(MsFlags::MS_NOEXEC),
        data: None,
    },
    Spec {
        source: "devtmpfs",
        target: "dev",
        fstype: "devtmpfs",
        flags: MsFlags::MS_NOSUID,
        data: Some("mode=0755"),
    },
    Spec {
        source: "tmpfs",
        target: "run",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=0755"),
    },
];

/// Mounted in the final root (after the overlay switch, /run is mounted afresh there).
pub const LATE: &[Spec] = &[
    Spec {
        source: "tmpfs",
        target: "run",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=0755"),
    },
    Spec {
        source: "tmpfs",
        target: "tmp",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=1777"),
    },
    Spec {
        source: "devpts",
        target: "dev/pts",
        fstype: "devpts",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NOEXEC),
        data: Some("newinstance,ptmxmode=0666,mode=0620"),
    },
    Spec {
        source: "tmpfs",
        target: "dev/shm",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=1777"),
    },
];

/// Mount each spec under `root`, skipping targets that already are mount points (the kernel
/// may have mounted devtmpfs itself). Returns the targets actually mounted.
pub fn mount_all(root: &Path, specs: &[Spec]) -> Result<Vec<PathBuf>, MountError> {
    let mut mounted = Vec::new();
    for spec in specs {
        let target = root.join(spec.target);
        if let Err(source) = std::fs::create_dir_all(&target) {
            // A read-only root without the directory cannot get the mount; say so precisely.
            return Err(MountError::MountPoint {
                path: target,
                source,
            });
        }
        if is_mountpoint(&target) {
            continue;
        }
        mount(
            Some(spec.source),
            &target,
            Some(spec.fstype),
            spec.flags,
            spec.data,
        )
        .map_err(|source| MountError::Mount {
            fstype: spec.fstype.to_owned(),
            target: target.clone(),
            source,
        })?;
        mounted.push(target);
    }
    Ok(mounted)
}

/// A directory is a mount point when it lives on another device than its parent (works before
/// /proc exists; bind mounts of the same filesystem are not a concern here).
pub fn is_mountpoint(path: &Path) -> bool {
    match (std::fs::metadata(path), std::fs::metadata(path.join(".."))) {
        (Ok(me), Ok(parent)) => me.dev() != parent.dev() || me.ino() == parent.ino(),
        _ => false,
    }
}
