//! Root assembly: overlay(read-only base drive, per-VM writable drive), then switch into it.
//!
//! The base image is shared by every VM from the host's cache and never written; each VM gets
//! a small blank writable drive, so host-side preparation is O(1) whatever the image size.
//!
//! Container engines keep their storage in [`PLAIN_DIRS`]: overlay2 (Docker's, containerd's
//! overlayfs snapshotter) cannot use a directory on an overlay as its upper layer, so each of
//! them is a directory on the writable drive's own filesystem (ext4), beside the overlay's
//! `upper/` and `work/`, bind-mounted into the new root. It shares the writable drive's space
//! (the class's disk) with the root's changes; it disappears with the VM like the rest.

use std::path::{Path, PathBuf};

use nix::mount::{MsFlags, mount};
use nix::unistd::{chdir, chroot};

use crate::pid1::cmdline::OverlayConfig;

#[derive(Debug, thiserror::Error)]
pub enum RootError {
    #[error("create {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mount {what} on {target}: {source}")]
    Mount {
        what: String,
        target: PathBuf,
        source: nix::Error,
    },
    #[error("switch root to {newroot}: {step}: {source}")]
    Switch {
        newroot: PathBuf,
        step: &'static str,
        source: nix::Error,
    },
}

/// Directories of the new root that live on the writable drive's plain filesystem instead of
/// the overlay (relative to the root; on the drive under `plain/<same path>`).
pub const PLAIN_DIRS: &[&str] = &["var/lib/docker", "var/lib/containerd"];

/// (directory on the writable drive, mount point in the new root) for each of [`PLAIN_DIRS`].
pub fn plain_binds(rw_dir: &Path, newroot: &Path) -> Vec<(PathBuf, PathBuf)> {
    PLAIN_DIRS
        .iter()
        .map(|d| (rw_dir.join("plain").join(d), newroot.join(d)))
        .collect()
}

/// Where the lower layer comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lower {
    /// Bind this directory read-only (the kernel-mounted root is `/`).
    Bind(PathBuf),
    /// Mount this device read-only.
    Device { path: PathBuf, fstype: String },
}

/// Where the writable layer comes from: `source` mounted with `fstype` (a device and ext4 in a
/// VM; "tmpfs" works too and is what tests use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upper {
    pub source: PathBuf,
    pub fstype: String,
}

impl Lower {
    pub fn from_config(cfg: &OverlayConfig) -> Self {
        match &cfg.lower {
            Some(dev) => Lower::Device {
                path: dev.clone(),
                fstype: cfg.lower_fstype.clone(),
            },
            None => Lower::Bind(PathBuf::from("/")),
        }
    }
}

fn mkdir(path: &Path) -> Result<(), RootError> {
    std::fs::create_dir_all(path).map_err(|source| RootError::Dir {
        path: path.to_owned(),
        source,
    })
}

fn mount_err(what: &str, target: &Path) -> impl FnOnce(nix::Error) -> RootError {
    let (what, target) = (what.to_owned(), target.to_owned());
    move |source| RootError::Mount {
        what,
        target,
        source,
    }
}

/// Mount the layers under `scratch` (a writable directory, /run/imp in the VM) and the overlay
/// at `scratch/root`, which is returned.
pub fn assemble(scratch: &Path, lower: &Lower, upper: &Upper) -> Result<PathBuf, RootError> {
    let lower_dir = scratch.join("lower");
    let rw_dir = scratch.join("rw");
    let newroot = scratch.join("root");
    for d in [&lower_dir, &rw_dir, &newroot] {
        mkdir(d)?;
    }
    match lower {
        Lower::Bind(src) => {
            mount(
                Some(src.as_path()),
                &lower_dir,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(mount_err("bind of the base root", &lower_dir))?;
            // A bind mount ignores MS_RDONLY at creation; it takes a remount.
            mount(
                None::<&str>,
                &lower_dir,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
                None::<&str>,
            )
            .map_err(mount_err("read-only remount of the base root", &lower_dir))?;
        }
        Lower::Device { path, fstype } => {
            mount(
                Some(path.as_path()),
                &lower_dir,
                Some(fstype.as_str()),
                MsFlags::MS_RDONLY,
                None::<&str>,
            )
            .map_err(mount_err(
                &format!("base drive {}", path.display()),
                &lower_dir,
            ))?;
        }
    }
    mount(
        Some(upper.source.as_path()),
        &rw_dir,
        Some(upper.fstype.as_str()),
        MsFlags::empty(),
        None::<&str>,
    )
    .map_err(mount_err(
        &format!("writable drive {}", upper.source.display()),
        &rw_dir,
    ))?;
    let upper_dir = rw_dir.join("upper");
    let work_dir = rw_dir.join("work");
    mkdir(&upper_dir)?;
    mkdir(&work_dir)?;
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower_dir.display(),
        upper_dir.display(),
        work_dir.display()
    );
    mount(
        Some("overlay"),
        &newroot,
        Some("overlay"),
        MsFlags::empty(),
        Some(opts.as_str()),
    )
    .map_err(mount_err("overlay", &newroot))?;
    for (src, dst) in plain_binds(&rw_dir, &newroot) {
        mkdir(&src)?;
        mkdir(&dst)?;
        mount(
            Some(src.as_path()),
            &dst,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(mount_err(
            &format!("bind of the writable drive's {}", src.display()),
            &dst,
        ))?;
    }
    Ok(newroot)
}

/// Move the given mounts (absolute paths, e.g. /proc) into `newroot`, make `newroot` the root
/// and chroot into it, like util-linux switch_root. MS_MOVE + chroot rather than pivot_root
/// because it also works when the old root is an initramfs.
pub fn switch_root(newroot: &Path, carry: &[&str]) -> Result<(), RootError> {
    for m in carry {
        let rel = m.trim_start_matches('/');
        let dest = newroot.join(rel);
        mkdir(&dest)?;
        mount(
            Some(*m),
            &dest,
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(mount_err(&format!("move of {m}"), &dest))?;
    }
    let err = |step| {
        move |source| RootError::Switch {
            newroot: newroot.to_owned(),
            step,
            source,
        }
    };
    chdir(newroot).map_err(err("chdir"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(err("move to /"))?;
    chroot(".").map_err(err("chroot"))?;
    chdir("/").map_err(err("chdir /"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_dirs_sit_beside_the_overlay_layers() {
        let binds = plain_binds(Path::new("/run/imp/rw"), Path::new("/run/imp/root"));
        assert_eq!(
            binds,
            [
                (
                    PathBuf::from("/run/imp/rw/plain/var/lib/docker"),
                    PathBuf::from("/run/imp/root/var/lib/docker")
                ),
                (
                    PathBuf::from("/run/imp/rw/plain/var/lib/containerd"),
                    PathBuf::from("/run/imp/root/var/lib/containerd")
                ),
            ]
        );
        // Never inside the overlay's upper or work directory.
        for (src, _) in &binds {
            assert!(!src.starts_with("/run/imp/rw/upper") && !src.starts_with("/run/imp/rw/work"));
        }
    }
}
