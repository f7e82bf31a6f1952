//! One memory cgroup per VM, under a configurable parent outside the runtime's own, so a VM's
//! memory is neither charged to the runtime pod's limit nor killed with it, and each VM is held
//! to its class's memory plus the VMM's overhead. cgroup v2 (`memory.max`) and v1's memory
//! hierarchy (`memory.limit_in_bytes`, this kind of hybrid host) are both handled.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no memory cgroup controller under {0} (neither cgroup v2 nor a v1 memory hierarchy)")]
    NoMemoryController(PathBuf),
    #[error("cgroup parent {0:?} must be a relative path without '..'")]
    BadParent(String),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Which cgroup interface the host's memory controller speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupConfig {
    /// Where the cgroup filesystem is mounted (`/sys/fs/cgroup`; in a container, the host's,
    /// mounted somewhere of its own).
    pub root: PathBuf,
    /// Parent of the per-VM cgroups, relative to the memory hierarchy's root.
    pub parent: PathBuf,
    /// Added to the class memory: the VMM's own memory (device emulation, vsock helper).
    pub overhead_mib: u64,
}

/// The memory limit of a VM with `memory_mib` of guest memory.
pub fn limit_bytes(memory_mib: u64, overhead_mib: u64) -> u64 {
    memory_mib
        .saturating_add(overhead_mib)
        .saturating_mul(1 << 20)
}

/// The file that holds the limit, by version.
pub fn limit_file(v: Version) -> &'static str {
    match v {
        Version::V1 => "memory.limit_in_bytes",
        Version::V2 => "memory.max",
    }
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io { op, path, source }
}

/// The per-VM cgroups of one runtime.
#[derive(Debug, Clone)]
pub struct VmCgroups {
    version: Version,
    /// The parent cgroup's directory.
    parent: PathBuf,
    overhead_mib: u64,
}

impl VmCgroups {
    /// Find the memory controller under `cfg.root` and create the parent.
    pub fn open(cfg: &CgroupConfig) -> Result<Self, CgroupError> {
        if cfg.parent.as_os_str().is_empty()
            || cfg.parent.is_absolute()
            || cfg
                .parent
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(CgroupError::BadParent(cfg.parent.display().to_string()));
        }
        let (version, base) = if cfg.root.join("cgroup.controllers").is_file()
            && std::fs::read_to_string(cfg.root.join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
        {
            (Version::V2, cfg.root.clone())
        } else if cfg.root.join("memory/cgroup.procs").is_file() {
            (Version::V1, cfg.root.join("memory"))
        } else {
            return Err(CgroupError::NoMemoryController(cfg.root.clone()));
        };
        let parent = base.join(&cfg.parent);
        std::fs::create_dir_all(&parent).map_err(io("create", &parent))?;
        if version == Version::V2 {
            // Children of the parent get a memory controller (v2 enables them per level).
            let mut dir = base.clone();
            for c in cfg.parent.components() {
                let ctl = dir.join("cgroup.subtree_control");
                std::fs::write(&ctl, "+memory").map_err(io("enable memory in", &ctl))?;
                dir = dir.join(c);
            }
            let ctl = parent.join("cgroup.subtree_control");
            std::fs::write(&ctl, "+memory").map_err(io("enable memory in", &ctl))?;
        }
        Ok(Self {
            version,
            parent,
            overhead_mib: cfg.overhead_mib,
        })
    }

    pub fn version(&self) -> Version {
        self.version
    }

    pub fn dir(&self, uid: &str) -> PathBuf {
        self.parent.join(uid)
    }

    /// Create VM `uid`'s cgroup with its limit (idempotent).
    pub fn create(&self, uid: &str, memory_mib: u64) -> Result<PathBuf, CgroupError> {
        let dir = self.dir(uid);
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        let limit = dir.join(limit_file(self.version));
        std::fs::write(
            &limit,
            limit_bytes(memory_mib, self.overhead_mib).to_string(),
        )
        .map_err(io("write", &limit))?;
        Ok(dir)
    }

    /// Move process `pid` into VM `uid`'s cgroup.
    pub fn add(&self, uid: &str, pid: i32) -> Result<(), CgroupError> {
        let procs = self.dir(uid).join("cgroup.procs");
        std::fs::write(&procs, pid.to_string()).map_err(io("write", &procs))
    }

    /// Remove VM `uid`'s cgroup once its processes are gone (idempotent).
    pub fn remove(&self, uid: &str) -> Result<(), CgroupError> {
        let dir = self.dir(uid);
        match std::fs::remove_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("remove", &dir)(e)),
        }
    }

    /// The per-VM cgroups that exist (for the restart reconciliation).
    pub fn list(&self) -> Vec<String> {
        std::fs::read_dir(&self.parent)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.path().is_dir())
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The memory cgroup `pid` is in, relative to the hierarchy root (`/proc/<pid>/cgroup`: the
/// v1 `memory` line, else the v2 `0::` line).
pub fn memory_cgroup_of(pid: i32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    parse_memory_line(&text)
}

fn parse_memory_line(text: &str) -> Option<PathBuf> {
    let mut v2 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.split(',').any(|c| c == "memory") {
            return Some(PathBuf::from(path.trim_start_matches('/')));
        }
        if controllers.is_empty() {
            v2 = Some(PathBuf::from(path.trim_start_matches('/')));
        }
    }
    v2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_is_class_memory_plus_overhead_in_bytes() {
        assert_eq!(limit_bytes(512, 64), 576 << 20);
        assert_eq!(limit_bytes(u64::MAX, 1), u64::MAX);
    }

    #[test]
    fn memory_line_of_v1_wins_over_the_unified_line() {
        let hybrid = "9:name=systemd:/\n4:memory:/imp-vms/a\n0::/user.slice\n";
        assert_eq!(parse_memory_line(hybrid), Some(PathBuf::from("imp-vms/a")));
        let v2 = "0::/imp-vms/b\n";
        assert_eq!(parse_memory_line(v2), Some(PathBuf::from("imp-vms/b")));
        assert_eq!(parse_memory_line(""), None);
    }

    #[test]
    fn parent_must_stay_inside_the_hierarchy() {
        let root = tempfile::tempdir().unwrap();
        for bad in ["/abs", "../up", "a/../../b", ""] {
            let e = VmCgroups::open(&CgroupConfig {
                root: root.path().into(),
                parent: bad.into(),
                overhead_mib: 0,
            })
            .unwrap_err();
            assert!(
                matches!(
                    e,
                    CgroupError::BadParent(_) | CgroupError::NoMemoryController(_)
                ),
                "{bad}: {e}"
            );
        }
    }

    /// Against a v1-shaped tree in a temp dir: the files the kernel would read.
    #[test]
    fn a_vm_cgroup_gets_its_limit_and_is_removed() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("memory")).unwrap();
        std::fs::write(root.path().join("memory/cgroup.procs"), "").unwrap();
        let cg = VmCgroups::open(&CgroupConfig {
            root: root.path().into(),
            parent: "imp/vms".into(),
            overhead_mib: 32,
        })
        .unwrap();
        assert_eq!(cg.version(), Version::V1);
        let dir = cg.create("a", 128).unwrap();
        assert_eq!(dir, root.path().join("memory/imp/vms/a"));
        assert_eq!(
            std::fs::read_to_string(dir.join("memory.limit_in_bytes")).unwrap(),
            (160u64 << 20).to_string()
        );
        cg.add("a", 4242).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("cgroup.procs")).unwrap(),
            "4242"
        );
        assert_eq!(cg.list(), vec!["a".to_string()]);
        // A real cgroup directory holds only kernel files; rmdir works once it has no process.
        std::fs::remove_file(dir.join("memory.limit_in_bytes")).unwrap();
        std::fs::remove_file(dir.join("cgroup.procs")).unwrap();
        cg.remove("a").unwrap();
        cg.remove("a").unwrap();
        assert!(cg.list().is_empty());
    }
}
