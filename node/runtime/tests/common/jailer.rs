//! What the jailer tests (jailer.rs) share: a runtime whose Firecracker (the simulator) runs
//! through testkit's jailer double, with per-VM cgroups under a parent of this test's own
//! memory cgroup, and readers of what /proc says about a jailed process.

use std::path::{Path, PathBuf};

use imp_runtime::cgroup::{Controller, cgroup_of};

use super::{Harness, is_root, simulator};

/// testkit's jailer double, built when its sources are newer.
pub fn jailer_double() -> PathBuf {
    imp_testkit::bins::ensure_built(
        &[("imp-testkit", "jailer-double")],
        &["testkit/src", "testkit/Cargo.toml"],
    )
    .expect("building jailer-double")
    .remove(0)
}

/// `/sys/fs/cgroup` shaped as v1 (one hierarchy per controller) or v2.
pub fn hierarchies() -> Vec<(Controller, PathBuf)> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").is_file() {
        Controller::ALL.map(|c| (c, root.to_path_buf())).to_vec()
    } else {
        Controller::ALL.map(|c| (c, root.join(c.name()))).to_vec()
    }
}

/// The per-VM cgroups' parent of one test: under this process's memory cgroup, removed (with
/// any VM cgroup a failure left, in every hierarchy) on drop.
pub struct CgroupParent {
    pub rel: PathBuf,
    made: Vec<PathBuf>,
}

impl CgroupParent {
    fn new(tag: &str) -> Result<Self, String> {
        let own = imp_runtime::cgroup::memory_cgroup_of(std::process::id() as i32)
            .ok_or("no memory cgroup in /proc/self/cgroup")?;
        let rel = own.join(format!("imp-jailer-{tag}-{}", std::process::id()));
        let mut made = Vec::new();
        for (_, base) in hierarchies() {
            if !base.join("cgroup.procs").is_file() {
                return Err(format!("no cgroup hierarchy at {}", base.display()));
            }
            let mut d = base.clone();
            for c in rel.components() {
                d = d.join(c);
                if !d.exists() && !made.contains(&d) {
                    made.push(d.clone());
                }
            }
        }
        Ok(CgroupParent { rel, made })
    }

    /// VM `uid`'s cgroup directory in controller `c`'s hierarchy.
    pub fn vm_dir(&self, c: Controller, uid: &str) -> PathBuf {
        let base = hierarchies()
            .into_iter()
            .find(|(x, _)| *x == c)
            .expect("every controller")
            .1;
        base.join(&self.rel).join(uid)
    }

    /// The VM cgroups under the parent, in any hierarchy.
    pub fn children(&self) -> Vec<PathBuf> {
        hierarchies()
            .into_iter()
            .flat_map(|(_, b)| {
                std::fs::read_dir(b.join(&self.rel))
                    .map(|d| {
                        d.flatten()
                            .map(|e| e.path())
                            .filter(|p| p.is_dir())
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default()
            })
            .collect()
    }
}

impl Drop for CgroupParent {
    fn drop(&mut self) {
        for dir in self.made.iter().rev() {
            if let Ok(d) = std::fs::read_dir(dir) {
                for e in d.flatten().filter(|e| e.path().is_dir()) {
                    let _ = std::fs::remove_dir(e.path());
                }
            }
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// The runtime, through the jailer double, and the cgroup parent it uses.
pub struct Jailed {
    pub h: Harness,
    pub cgroups: CgroupParent,
}

impl Jailed {
    /// The jail root of VM `uid` (the double's exec file is the simulator).
    pub fn root(&self, uid: &str) -> PathBuf {
        self.jails().join(uid).join("root")
    }

    /// `<chroot base>/<exec file name>`.
    pub fn jails(&self) -> PathBuf {
        let sim = imp_testkit::firecracker::binaries().simulator.clone();
        self.h
            .state_dir
            .join("jailer")
            .join(sim.file_name().unwrap())
    }
}

/// A harness on the simulator whose runtime runs Firecracker through the jailer double (not
/// started). None (having said why) when this is not root: the double switches uids, makes
/// device nodes and namespaces; IMP_REQUIRE_ROOT=1 turns the skip into a failure.
pub fn jailed(tag: &str) -> Option<Jailed> {
    if !is_root() {
        imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "the jailer tests",
            "not root (the jailer switches uids, makes device nodes and namespaces)",
        );
        return None;
    }
    let cgroups = match CgroupParent::new(tag) {
        Ok(c) => c,
        Err(e) => {
            imp_testkit::skip::skip_or_fail(
                "IMP_REQUIRE_CGROUP",
                "the jailer tests",
                &format!("no usable cgroup hierarchy: {e}"),
            );
            return None;
        }
    };
    let mut h = Harness::new(simulator());
    let bins = imp_testkit::firecracker::binaries();
    let behaviour = h.dir.path().join("behaviour.json");
    // The double's deviation for the simulator (testkit/src/bin/jailer-double.rs): the host
    // libraries, imp-guest and the simulator's knob file, read-only in the jail.
    let bind = ["/usr", "/bin", "/sbin", "/lib", "/lib64"]
        .iter()
        .map(PathBuf::from)
        .filter(|p| p.exists())
        .chain([bins.guest.clone(), behaviour])
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(",");
    h.extra_env.extend([
        (
            "IMP_JAILER_PATH".to_string(),
            jailer_double().display().to_string(),
        ),
        ("IMP_JAILER_DOUBLE_BIND".into(), bind),
        (
            "IMP_JAILER_DOUBLE_KEEP_ENV".into(),
            "IMP_GUEST_BIN,IMP_SIM_BEHAVIOUR".into(),
        ),
        (
            "IMP_VM_CGROUP_PARENT".into(),
            cgroups.rel.display().to_string(),
        ),
        ("IMP_VM_MEMORY_OVERHEAD_MIB".into(), "64".into()),
        ("IMP_VM_PIDS_MAX".into(), "200".into()),
    ]);
    Some(Jailed { h, cgroups })
}

/// What `/proc/<pid>/status` says of a process's credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creds {
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
    pub cap_eff: u64,
    /// Its pid in each PID namespace, outermost first.
    pub nspid: Vec<i32>,
}

pub fn creds(pid: i32) -> Creds {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    let field = |name: &str| -> Vec<String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    Creds {
        uids: field("Uid").iter().map(|s| s.parse().unwrap()).collect(),
        gids: field("Gid").iter().map(|s| s.parse().unwrap()).collect(),
        cap_eff: u64::from_str_radix(&field("CapEff")[0], 16).unwrap(),
        nspid: field("NSpid").iter().map(|s| s.parse().unwrap()).collect(),
    }
}

/// Process `pid`'s cgroup of each controller, relative to its hierarchy.
pub fn cgroups_of(pid: i32) -> Vec<(Controller, Option<PathBuf>)> {
    Controller::ALL
        .iter()
        .map(|c| (*c, cgroup_of(pid, *c)))
        .collect()
}

/// `/proc/<pid>/ns/<ns>` of `pid` differs from this process's.
pub fn own_namespace(pid: i32, ns: &str) -> bool {
    let of = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/{ns}")).unwrap();
    of(&pid.to_string()) != of("self")
}
