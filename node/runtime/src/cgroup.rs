//! One cgroup per VM, under a configurable parent outside the runtime's own, so a VM's memory
//! is neither charged to the runtime pod's limit nor killed with it, and each VM is held to its
//! class: memory (the class memory plus the VMM's overhead), CPU (a CFS quota of its vCPUs)
//! and a number of tasks (pids). cgroup v2 (`memory.max`, `cpu.max`, `pids.max` in one
//! directory) and v1's separate `memory`, `cpu` and `pids` hierarchies (this kind of hybrid
//! host: one directory per hierarchy, each the VMM enters before it execs) are both handled.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no memory cgroup controller under {0} (neither cgroup v2 nor a v1 memory hierarchy)")]
    NoMemoryController(PathBuf),
    #[error(
        "no {controller} cgroup controller under {root} (per-VM limits need memory, cpu, pids)"
    )]
    NoController {
        controller: &'static str,
        root: PathBuf,
    },
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

/// The controllers a VM's limits are set in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Controller {
    Memory,
    Cpu,
    Pids,
}

impl Controller {
    pub const ALL: [Controller; 3] = [Controller::Memory, Controller::Cpu, Controller::Pids];

    /// The name in `cgroup.controllers`, `/proc/<pid>/cgroup` and v1 mount points.
    pub fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Cpu => "cpu",
            Controller::Pids => "pids",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupConfig {
    /// Where the cgroup filesystem is mounted (`/sys/fs/cgroup`; in a container, the host's,
    /// mounted somewhere of its own).
    pub root: PathBuf,
    /// Parent of the per-VM cgroups, relative to each hierarchy's root.
    pub parent: PathBuf,
    /// Added to the class memory: the VMM's own memory (device emulation, vsock helper).
    pub overhead_mib: u64,
    /// Tasks (processes and threads) a VM's cgroup may hold: the VMM's vCPU and I/O threads
    /// and its helpers, never a fork bomb of an escaped guest.
    pub pids_max: u64,
}

/// The CFS period of a VM's CPU quota.
pub const CPU_PERIOD_US: u64 = 100_000;
/// Tasks of one VM unless configured: QEMU runs a thread per vCPU plus a few dozen of its own.
pub const DEFAULT_PIDS_MAX: u64 = 512;

/// The memory limit of a VM with `memory_mib` of guest memory.
pub fn limit_bytes(memory_mib: u64, overhead_mib: u64) -> u64 {
    memory_mib
        .saturating_add(overhead_mib)
        .saturating_mul(1 << 20)
}

/// What one VM is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    /// CPU time per [`CPU_PERIOD_US`]: one period per vCPU.
    pub cpu_quota_us: u64,
    pub pids_max: u64,
}

impl Limits {
    pub fn of(memory_mib: u64, vcpu: u32, overhead_mib: u64, pids_max: u64) -> Self {
        Limits {
            memory_bytes: limit_bytes(memory_mib, overhead_mib),
            cpu_quota_us: u64::from(vcpu.max(1)).saturating_mul(CPU_PERIOD_US),
            pids_max,
        }
    }
}

/// The files that hold `limits` and their contents, by controller, in the order they are
/// written (v1's period before its quota).
pub fn limit_files(v: Version, limits: &Limits) -> Vec<(Controller, &'static str, String)> {
    match v {
        Version::V1 => vec![
            (
                Controller::Memory,
                "memory.limit_in_bytes",
                limits.memory_bytes.to_string(),
            ),
            (
                Controller::Cpu,
                "cpu.cfs_period_us",
                CPU_PERIOD_US.to_string(),
            ),
            (
                Controller::Cpu,
                "cpu.cfs_quota_us",
                limits.cpu_quota_us.to_string(),
            ),
            (Controller::Pids, "pids.max", limits.pids_max.to_string()),
        ],
        Version::V2 => vec![
            (
                Controller::Memory,
                "memory.max",
                limits.memory_bytes.to_string(),
            ),
            (
                Controller::Cpu,
                "cpu.max",
                format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us),
            ),
            (Controller::Pids, "pids.max", limits.pids_max.to_string()),
        ],
    }
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io { op, path, source }
}

/// A VM's cgroups as a jailer makes them (Firecracker's `--cgroup-version`, `--parent-cgroup`,
/// `--cgroup FILE=VALUE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupArgs {
    pub version: Version,
    /// Where the runtime sees the host's cgroup filesystem ([`CgroupConfig::root`]): the jailer
    /// finds hierarchies by their mounts, so it must see this tree, not the pod's own.
    pub root: PathBuf,
    /// The runtime's per-VM parent, relative to each hierarchy's root.
    pub parent: PathBuf,
    /// `FILE=VALUE`, in the order written (v1's period before its quota).
    pub limits: Vec<String>,
}

/// The per-VM cgroups of one runtime.
#[derive(Debug, Clone)]
pub struct VmCgroups {
    version: Version,
    root: PathBuf,
    /// The parent cgroup's directory per controller (v2: the same one for all).
    parents: Vec<(Controller, PathBuf)>,
    /// The parent relative to each hierarchy's root (the jailer's `--parent-cgroup`).
    parent: PathBuf,
    overhead_mib: u64,
    pids_max: u64,
}

impl VmCgroups {
    /// Find the controllers under `cfg.root` and create the parent in each hierarchy.
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
        let v2_controllers =
            std::fs::read_to_string(cfg.root.join("cgroup.controllers")).unwrap_or_default();
        let has_v2 = |c: Controller| v2_controllers.split_whitespace().any(|x| x == c.name());
        let (version, parents) = if has_v2(Controller::Memory) {
            for c in Controller::ALL {
                if !has_v2(c) {
                    return Err(CgroupError::NoController {
                        controller: c.name(),
                        root: cfg.root.clone(),
                    });
                }
            }
            let parent = cfg.root.join(&cfg.parent);
            std::fs::create_dir_all(&parent).map_err(io("create", &parent))?;
            // Children of the parent get the controllers (v2 enables them per level).
            let enable = "+memory +cpu +pids";
            let mut dir = cfg.root.clone();
            for c in cfg.parent.components() {
                let ctl = dir.join("cgroup.subtree_control");
                std::fs::write(&ctl, enable).map_err(io("enable controllers in", &ctl))?;
                dir = dir.join(c);
            }
            let ctl = parent.join("cgroup.subtree_control");
            std::fs::write(&ctl, enable).map_err(io("enable controllers in", &ctl))?;
            let parents = Controller::ALL.map(|c| (c, parent.clone())).to_vec();
            (Version::V2, parents)
        } else if cfg.root.join("memory/cgroup.procs").is_file() {
            let mut parents = Vec::new();
            for c in Controller::ALL {
                let base = cfg.root.join(c.name());
                if !base.join("cgroup.procs").is_file() {
                    return Err(CgroupError::NoController {
                        controller: c.name(),
                        root: cfg.root.clone(),
                    });
                }
                let parent = base.join(&cfg.parent);
                std::fs::create_dir_all(&parent).map_err(io("create", &parent))?;
                parents.push((c, parent));
            }
            (Version::V1, parents)
        } else {
            return Err(CgroupError::NoMemoryController(cfg.root.clone()));
        };
        Ok(Self {
            version,
            root: cfg.root.clone(),
            parents,
            parent: cfg.parent.clone(),
            overhead_mib: cfg.overhead_mib,
            pids_max: cfg.pids_max,
        })
    }

    pub fn version(&self) -> Version {
        self.version
    }

    fn parent(&self, c: Controller) -> &Path {
        &self
            .parents
            .iter()
            .find(|(x, _)| *x == c)
            .expect("every controller has a parent")
            .1
    }

    /// VM `uid`'s cgroup in the memory hierarchy (v2: its only one).
    pub fn dir(&self, uid: &str) -> PathBuf {
        self.parent(Controller::Memory).join(uid)
    }

    /// VM `uid`'s cgroup directories, one per hierarchy.
    fn dirs(&self, uid: &str) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = Vec::new();
        for (_, p) in &self.parents {
            let d = p.join(uid);
            if !out.contains(&d) {
                out.push(d);
            }
        }
        out
    }

    /// Create VM `uid`'s cgroups with its limits (idempotent); returns the `cgroup.procs`
    /// files its processes enter, one per hierarchy.
    pub fn create(
        &self,
        uid: &str,
        memory_mib: u64,
        vcpu: u32,
    ) -> Result<Vec<PathBuf>, CgroupError> {
        for d in self.dirs(uid) {
            std::fs::create_dir_all(&d).map_err(io("create", &d))?;
        }
        let limits = Limits::of(memory_mib, vcpu, self.overhead_mib, self.pids_max);
        for (c, file, value) in limit_files(self.version, &limits) {
            let path = self.parent(c).join(uid).join(file);
            std::fs::write(&path, value).map_err(io("write", &path))?;
        }
        Ok(self
            .dirs(uid)
            .into_iter()
            .map(|d| d.join("cgroup.procs"))
            .collect())
    }

    /// What Firecracker's jailer is told to make VM `uid`'s cgroups with (it creates
    /// `<hierarchy>/<parent>/<uid>`, the directories [`VmCgroups::create`] would, so removal,
    /// listing and the leak checks are the same for both).
    pub fn jailer_args(&self, memory_mib: u64, vcpu: u32) -> CgroupArgs {
        let limits = Limits::of(memory_mib, vcpu, self.overhead_mib, self.pids_max);
        CgroupArgs {
            version: self.version,
            root: self.root.clone(),
            parent: self.parent.clone(),
            limits: limit_files(self.version, &limits)
                .into_iter()
                .map(|(_, f, v)| format!("{f}={v}"))
                .collect(),
        }
    }

    /// Remove VM `uid`'s cgroups once its processes are gone (idempotent).
    pub fn remove(&self, uid: &str) -> Result<(), CgroupError> {
        for dir in self.dirs(uid) {
            match std::fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("remove", &dir)(e)),
            }
        }
        Ok(())
    }

    /// The per-VM cgroups that exist in any hierarchy (for the restart reconciliation).
    pub fn list(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for (_, parent) in &self.parents {
            let names = std::fs::read_dir(parent)
                .map(|d| {
                    d.flatten()
                        .filter(|e| e.path().is_dir())
                        .filter_map(|e| e.file_name().to_str().map(str::to_string))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default();
            for n in names {
                if !out.contains(&n) {
                    out.push(n);
                }
            }
        }
        out
    }
}

/// The memory cgroup `pid` is in, relative to the hierarchy root (`/proc/<pid>/cgroup`: the
/// v1 `memory` line, else the v2 `0::` line).
pub fn memory_cgroup_of(pid: i32) -> Option<PathBuf> {
    cgroup_of(pid, Controller::Memory)
}

/// The cgroup of `pid` for controller `c`, relative to its hierarchy's root.
pub fn cgroup_of(pid: i32, c: Controller) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    parse_line(&text, c.name())
}

fn parse_line(text: &str, controller: &str) -> Option<PathBuf> {
    let mut v2 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.split(',').any(|c| c == controller) {
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
        assert_eq!(
            parse_line(hybrid, "memory"),
            Some(PathBuf::from("imp-vms/a"))
        );
        let v2 = "0::/imp-vms/b\n";
        assert_eq!(parse_line(v2, "memory"), Some(PathBuf::from("imp-vms/b")));
        assert_eq!(parse_line("", "memory"), None);
        let cpu = "5:cpu,cpuacct:/imp-vms/c\n3:pids:/imp-vms/d\n";
        assert_eq!(parse_line(cpu, "cpu"), Some(PathBuf::from("imp-vms/c")));
        assert_eq!(parse_line(cpu, "pids"), Some(PathBuf::from("imp-vms/d")));
        assert_eq!(parse_line(cpu, "cpuacct"), Some(PathBuf::from("imp-vms/c")));
    }

    #[test]
    fn limits_hold_memory_plus_overhead_a_period_per_vcpu_and_the_task_cap() {
        let l = Limits::of(512, 2, 64, 300);
        assert_eq!(
            l,
            Limits {
                memory_bytes: 576 << 20,
                cpu_quota_us: 200_000,
                pids_max: 300
            }
        );
        assert_eq!(Limits::of(512, 0, 64, 300).cpu_quota_us, CPU_PERIOD_US);
    }

    #[test]
    fn v1_writes_each_limit_in_its_hierarchy_period_before_quota_and_v2_in_one_directory() {
        let l = Limits::of(256, 3, 0, 64);
        let v1 = limit_files(Version::V1, &l);
        let names: Vec<_> = v1
            .iter()
            .map(|(c, f, v)| (c.name(), *f, v.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                ("memory", "memory.limit_in_bytes", "268435456"),
                ("cpu", "cpu.cfs_period_us", "100000"),
                ("cpu", "cpu.cfs_quota_us", "300000"),
                ("pids", "pids.max", "64"),
            ]
        );
        let v2 = limit_files(Version::V2, &l);
        let names: Vec<_> = v2
            .iter()
            .map(|(c, f, v)| (c.name(), *f, v.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                ("memory", "memory.max", "268435456"),
                ("cpu", "cpu.max", "300000 100000"),
                ("pids", "pids.max", "64"),
            ]
        );
    }

    fn config(root: &Path, parent: &str) -> CgroupConfig {
        CgroupConfig {
            root: root.into(),
            parent: parent.into(),
            overhead_mib: 32,
            pids_max: 99,
        }
    }

    /// A temp dir shaped like a v1 host with `hierarchies` mounted.
    fn v1_tree(hierarchies: &[&str]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for h in hierarchies {
            std::fs::create_dir_all(root.path().join(h)).unwrap();
            std::fs::write(root.path().join(h).join("cgroup.procs"), "").unwrap();
        }
        root
    }

    fn read(p: PathBuf) -> String {
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    #[test]
    fn parent_must_stay_inside_the_hierarchy() {
        let root = tempfile::tempdir().unwrap();
        for bad in ["/abs", "../up", "a/../../b", ""] {
            let e = VmCgroups::open(&config(root.path(), bad)).unwrap_err();
            assert!(
                matches!(
                    e,
                    CgroupError::BadParent(_) | CgroupError::NoMemoryController(_)
                ),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_missing_controller_is_named() {
        let root = v1_tree(&["memory", "cpu"]);
        let e = VmCgroups::open(&config(root.path(), "imp")).unwrap_err();
        assert!(
            matches!(
                e,
                CgroupError::NoController {
                    controller: "pids",
                    ..
                }
            ),
            "{e}"
        );
        let v2 = tempfile::tempdir().unwrap();
        std::fs::write(v2.path().join("cgroup.controllers"), "memory pids io\n").unwrap();
        let e = VmCgroups::open(&config(v2.path(), "imp")).unwrap_err();
        assert!(
            matches!(
                e,
                CgroupError::NoController {
                    controller: "cpu",
                    ..
                }
            ),
            "{e}"
        );
    }

    /// Against a v1-shaped tree in a temp dir: the files the kernel would read.
    #[test]
    fn a_v1_vm_cgroup_gets_its_limits_in_each_hierarchy_and_is_removed() {
        let root = v1_tree(&["memory", "cpu", "pids"]);
        let cg = VmCgroups::open(&config(root.path(), "imp/vms")).unwrap();
        assert_eq!(cg.version(), Version::V1);
        let procs = cg.create("a", 128, 2).unwrap();
        let at = |h: &str| root.path().join(h).join("imp/vms/a");
        assert_eq!(
            procs,
            ["memory", "cpu", "pids"].map(|h| at(h).join("cgroup.procs"))
        );
        assert_eq!(cg.dir("a"), at("memory"));
        assert_eq!(
            read(at("memory").join("memory.limit_in_bytes")),
            (160u64 << 20).to_string()
        );
        assert_eq!(read(at("cpu").join("cpu.cfs_period_us")), "100000");
        assert_eq!(read(at("cpu").join("cpu.cfs_quota_us")), "200000");
        assert_eq!(read(at("pids").join("pids.max")), "99");
        assert_eq!(cg.list(), vec!["a".to_string()]);
        // A real cgroup directory holds only kernel files; rmdir works once it has no process.
        for h in ["memory", "cpu", "pids"] {
            for f in std::fs::read_dir(at(h)).unwrap().flatten() {
                std::fs::remove_file(f.path()).unwrap();
            }
        }
        cg.remove("a").unwrap();
        cg.remove("a").unwrap();
        assert!(cg.list().is_empty());
        assert!(!at("cpu").exists() && !at("pids").exists());
    }

    #[test]
    fn a_v2_vm_cgroup_holds_every_limit_in_one_directory() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        let cg = VmCgroups::open(&config(root.path(), "imp")).unwrap();
        assert_eq!(cg.version(), Version::V2);
        assert_eq!(
            read(root.path().join("cgroup.subtree_control")),
            "+memory +cpu +pids"
        );
        let dir = root.path().join("imp/b");
        assert_eq!(
            cg.create("b", 64, 1).unwrap(),
            vec![dir.join("cgroup.procs")]
        );
        assert_eq!(read(dir.join("memory.max")), (96u64 << 20).to_string());
        assert_eq!(read(dir.join("cpu.max")), "100000 100000");
        assert_eq!(read(dir.join("pids.max")), "99");
    }
}
