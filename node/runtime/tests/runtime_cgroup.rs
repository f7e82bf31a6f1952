//! VMs in cgroups of their own outlive the runtime: imp-runtime (the real binary, the
//! Firecracker simulator as VMM) puts each VM's process in `<parent>/<uid>` of the memory, cpu
//! and pids controllers with the class memory plus overhead, a CPU quota of its vCPUs and a
//! task cap as its limits; a `kill -9` of the runtime leaves the VM running there, the
//! restarted runtime reattaches it, DELETE removes process and cgroups.
//!
//! The parent is created under this test's own memory cgroup (so nothing escapes whatever
//! runs the tests). Needs root and a writable memory cgroup; skips otherwise, and
//! IMP_REQUIRE_CGROUP=1 turns the skip into a failure.

mod common;

use std::path::{Path, PathBuf};

use common::{Harness, alive, is_root, simulator};
use http::StatusCode;
use imp_runtime::api::VmState;
use imp_runtime::cgroup::{Controller, cgroup_of};

/// The memory hierarchy's mount and this process's cgroup in it, if usable.
fn memory_hierarchy() -> Result<(PathBuf, PathBuf), String> {
    if !is_root() {
        return Err("not root".into());
    }
    let own = imp_runtime::cgroup::memory_cgroup_of(std::process::id() as i32)
        .ok_or("no memory cgroup in /proc/self/cgroup")?;
    let root = Path::new("/sys/fs/cgroup");
    let base = if root.join("memory/cgroup.procs").is_file() {
        root.join("memory")
    } else if root.join("cgroup.controllers").is_file() {
        root.to_path_buf()
    } else {
        return Err("no memory cgroup hierarchy under /sys/fs/cgroup".into());
    };
    let probe = base
        .join(&own)
        .join(format!("imp-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).map_err(|e| format!("create {}: {e}", probe.display()))?;
    let _ = std::fs::remove_dir(&probe);
    Ok((base, own))
}

/// Removes the test's parent cgroup (and any VM cgroup a failure left) on drop, in every
/// hierarchy, with the directories above it the runtime created (on v1 the runtime makes the
/// same relative parent in the cpu and pids hierarchies, where this process may sit elsewhere).
struct Parent(PathBuf, Vec<PathBuf>);

impl Parent {
    /// `rel` under each hierarchy in `bases`; records what does not exist yet.
    fn new(memory: PathBuf, bases: &[PathBuf], rel: &Path) -> Self {
        let mut made = Vec::new();
        for b in bases {
            let mut d = b.clone();
            for c in rel.components() {
                d = d.join(c);
                if !d.exists() && !made.contains(&d) {
                    made.push(d.clone());
                }
            }
        }
        Parent(memory, made)
    }
}

impl Drop for Parent {
    fn drop(&mut self) {
        for dir in self.1.iter().rev().chain([&self.0]) {
            if let Ok(d) = std::fs::read_dir(dir) {
                for e in d.flatten().filter(|e| e.path().is_dir()) {
                    let _ = std::fs::remove_dir(e.path());
                }
            }
            let _ = std::fs::remove_dir(dir);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vms_in_their_own_cgroup_survive_a_runtime_kill() {
    let (base, own) = match memory_hierarchy() {
        Ok(h) => h,
        Err(why) => {
            let what = "vms_in_their_own_cgroup_survive_a_runtime_kill";
            return imp_testkit::skip::skip_or_fail("IMP_REQUIRE_CGROUP", what, &why);
        }
    };
    let parent_rel = own.join(format!("imp-test-{}", std::process::id()));
    let v1 = base.ends_with("memory");
    let hierarchies: Vec<PathBuf> = if v1 {
        ["memory", "cpu", "pids"]
            .map(|h| Path::new("/sys/fs/cgroup").join(h))
            .to_vec()
    } else {
        vec![base.clone()]
    };
    let _parent = Parent::new(base.join(&parent_rel), &hierarchies, &parent_rel);
    let mut h = Harness::new(simulator());
    h.extra_env.extend([
        (
            "IMP_VM_CGROUP_PARENT".to_string(),
            parent_rel.display().to_string(),
        ),
        ("IMP_VM_MEMORY_OVERHEAD_MIB".to_string(), "64".to_string()),
        ("IMP_VM_PIDS_MAX".to_string(), "77".to_string()),
    ]);
    h.start_runtime().await;
    let spec = h.spec(false);
    let (code, st) = h.client.ensure_running("caged", &spec).await.unwrap();
    assert_eq!(code, StatusCode::CREATED);
    let pid = st.pid.unwrap();
    let start = imp_runtime::procfs::start_time(pid).unwrap();
    let vm_cg = parent_rel.join("caged");
    assert_eq!(
        imp_runtime::cgroup::memory_cgroup_of(pid),
        Some(vm_cg.clone()),
        "the VMM runs in the VM's own cgroup"
    );
    let runtime_pid = h.runtime_pid().unwrap() as i32;
    assert_ne!(
        imp_runtime::cgroup::memory_cgroup_of(runtime_pid),
        Some(vm_cg.clone()),
        "the runtime is not in the VM's cgroup"
    );
    for c in [Controller::Cpu, Controller::Pids] {
        assert_eq!(
            cgroup_of(pid, c),
            Some(vm_cg.clone()),
            "the VMM runs in the VM's own {} cgroup",
            c.name()
        );
    }
    let read = |h: &str, file: &str| {
        let dir = if v1 {
            Path::new("/sys/fs/cgroup").join(h)
        } else {
            base.clone()
        };
        let p = dir.join(&vm_cg).join(file);
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let memory = ((spec.memory_mib + 64) << 20).to_string();
    let quota = (u64::from(spec.vcpu) * 100_000).to_string();
    if v1 {
        assert_eq!(read("memory", "memory.limit_in_bytes").trim(), memory);
        assert_eq!(read("cpu", "cpu.cfs_quota_us").trim(), quota);
        assert_eq!(read("cpu", "cpu.cfs_period_us").trim(), "100000");
    } else {
        assert_eq!(read("", "memory.max").trim(), memory);
        assert_eq!(read("", "cpu.max").trim(), format!("{quota} 100000"));
    }
    assert_eq!(read("pids", "pids.max").trim(), "77");

    h.kill9_runtime();
    assert!(alive(pid, start), "the VM died with the runtime");
    h.start_runtime().await;
    let st = h.client.inspect("caged").await.unwrap();
    assert_eq!(
        (st.state, st.pid),
        (VmState::Running, Some(pid)),
        "reattached"
    );
    assert_eq!(
        imp_runtime::cgroup::memory_cgroup_of(pid),
        Some(vm_cg.clone())
    );

    h.client.delete("caged").await.unwrap();
    assert!(!alive(pid, start));
    for h in &hierarchies {
        let dir = h.join(&vm_cg);
        assert!(!dir.exists(), "DELETE removed {}", dir.display());
    }
}
