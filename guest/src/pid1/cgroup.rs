//! cgroup v2 for the job's container engine (dockerd, containerd, runc, podman).
//!
//! PID 1 mounts the unified hierarchy at /sys/fs/cgroup and enables every controller the kernel
//! offers in the root's `cgroup.subtree_control`, so an engine started by the job (as root in the
//! guest) can create child cgroups with memory, cpu, io and pids limits: the delegation a
//! container engine expects from systemd. The root cgroup is exempt from the "no internal
//! processes" rule, so the agent and the runner may stay in it while children get controllers.
//! The whole VM is the job's sandbox: nothing here is confined further (docs/workloads.md).

use std::path::{Path, PathBuf};

use nix::mount::MsFlags;

use crate::pid1::mounts::{self, Spec};

/// The cgroup2 mount, under the final root. `nsdelegate`: a cgroup namespace's root is a
/// delegation boundary (what systemd mounts with; containers get their own cgroup namespace).
pub const MOUNT: Spec = Spec {
    source: "cgroup2",
    target: "sys/fs/cgroup",
    fstype: "cgroup2",
    flags: MsFlags::MS_NOSUID
        .union(MsFlags::MS_NODEV)
        .union(MsFlags::MS_NOEXEC),
    data: Some("nsdelegate"),
};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error(transparent)]
    Mount(#[from] mounts::MountError),
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} offers no controllers (kernel without cgroup v2 controllers?)")]
    NoControllers { path: PathBuf },
    #[error("enable controller(s) {failed} in {path} (enabled: {enabled})")]
    Enable {
        path: PathBuf,
        failed: String,
        enabled: String,
    },
}

/// Controller names of a `cgroup.controllers` / `cgroup.subtree_control` file.
pub fn parse_controllers(text: &str) -> Vec<String> {
    text.split_whitespace().map(str::to_owned).collect()
}

/// The controllers to switch on: offered but not yet enabled, in the kernel's order (the order
/// `cgroup.controllers` lists them; a controller's dependencies come first there).
pub fn to_enable(available: &[String], enabled: &[String]) -> Vec<String> {
    available
        .iter()
        .filter(|c| !enabled.contains(c))
        .cloned()
        .collect()
}

/// What [`delegate`] left enabled in the root's subtree_control.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delegated {
    pub enabled: Vec<String>,
}

fn read(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Enable every offered controller in `dir/cgroup.subtree_control`, one write per controller
/// so a refusal names the controller (a write of several is all-or-nothing).
pub fn delegate(dir: &Path) -> Result<Delegated, CgroupError> {
    let controllers = dir.join("cgroup.controllers");
    let subtree = dir.join("cgroup.subtree_control");
    let available = parse_controllers(&read(&controllers)?);
    if available.is_empty() {
        return Err(CgroupError::NoControllers { path: controllers });
    }
    let mut failed = Vec::new();
    for c in to_enable(&available, &parse_controllers(&read(&subtree)?)) {
        if let Err(e) = std::fs::write(&subtree, format!("+{c}")) {
            failed.push(format!("{c} ({e})"));
        }
    }
    // The kernel's answer, not our writes': what the file lists now.
    let enabled = parse_controllers(&read(&subtree)?);
    for c in to_enable(&available, &enabled) {
        if !failed.iter().any(|f| f.starts_with(&format!("{c} "))) {
            failed.push(format!("{c} (not listed after the write)"));
        }
    }
    if !failed.is_empty() {
        return Err(CgroupError::Enable {
            path: subtree,
            failed: failed.join(", "),
            enabled: enabled.join(","),
        });
    }
    Ok(Delegated { enabled })
}

/// Mount cgroup2 under `root` (unless already mounted) and delegate its controllers.
pub fn setup(root: &Path) -> Result<Delegated, CgroupError> {
    mounts::mount_all(root, &[MOUNT])?;
    delegate(&root.join(MOUNT.target))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<String> {
        parse_controllers(s)
    }

    #[test]
    fn enables_what_is_offered_and_not_yet_on_in_kernel_order() {
        let available = v("cpuset cpu io memory hugetlb pids rdma misc\n");
        assert_eq!(
            to_enable(&available, &v("")),
            v("cpuset cpu io memory hugetlb pids rdma misc")
        );
        assert_eq!(
            to_enable(&available, &v("memory pids")),
            v("cpuset cpu io hugetlb rdma misc")
        );
        assert!(to_enable(&available, &available).is_empty());
        assert!(to_enable(&v(""), &v("")).is_empty());
    }

    /// On a plain directory the "files" take any write: delegate reads, writes one controller
    /// per write and reports what the file says afterwards.
    #[test]
    fn delegate_writes_each_controller_and_reports_the_result() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        std::fs::write(dir.path().join("cgroup.subtree_control"), "").unwrap();
        // A plain file keeps the last write only ("+pids"; the kernel's file accumulates and
        // lists names): the read-back check must catch controllers that did not stick.
        let err = delegate(dir.path()).unwrap_err();
        assert!(matches!(err, CgroupError::Enable { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("cpu (not listed") && msg.contains("enabled: +pids"),
            "{msg}"
        );
        // Already enabled: nothing is written, nothing fails.
        std::fs::write(
            dir.path().join("cgroup.subtree_control"),
            "cpu memory pids\n",
        )
        .unwrap();
        assert_eq!(delegate(dir.path()).unwrap().enabled, v("cpu memory pids"));
    }

    #[test]
    fn no_controllers_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cgroup.controllers"), "\n").unwrap();
        std::fs::write(dir.path().join("cgroup.subtree_control"), "").unwrap();
        assert!(matches!(
            delegate(dir.path()),
            Err(CgroupError::NoControllers { .. })
        ));
    }
}
