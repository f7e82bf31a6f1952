//! Firecracker through its jailer: imp-runtime (the real binary) with `--jailer-path` set to
//! testkit's jailer double, which takes the jailer's command line and performs its steps for
//! real (chroot by pivot_root, uid/gid switch, cgroups, a PID namespace, exec), the
//! Firecracker simulator as the exec file. Lifecycle, reattach after `kill -9` and
//! suspend/resume run through it; each VMM is checked from /proc: uid/gid not 0 and its own,
//! no effective capability, its root the VM's jail, its own mount and PID namespaces, its own
//! cgroup with the class's memory, cpu and pids limits. Jails and cgroups go with DELETE.

mod common;

use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    Harness, alive, exec, is_root, jailed_simulator, jailer_double, simulator, wait_until,
};
use imp_guest::protocol::AGENT_VSOCK_PORT;
use imp_runtime::api::VmState;
use imp_runtime::cgroup::{Controller, cgroup_of};

async fn guest_answers(vsock: &Path) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut g = imp_guest::host::connect(vsock, AGENT_VSOCK_PORT, deadline)
        .await
        .expect("guest agent answers");
    let ran = g.exec(exec("true", &["true"])).await.unwrap();
    assert_eq!(g.wait_exited(&ran.id).await.unwrap().code, Some(0));
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .to_string()
}

/// Everything the issue asks of a jailed VMM, from /proc/<pid>; returns its uid.
fn assert_confined(j: &Jailed, uid: &str, pid: i32, memory_mib: u64) -> u32 {
    let c = creds(pid);
    let id = c.uids[0];
    assert!(id != 0, "{uid}: runs as root: {c:?}");
    assert!(c.uids.iter().all(|u| *u == id), "{uid}: {c:?}");
    assert!(
        c.gids.iter().all(|g| *g == id),
        "{uid}: gid is the uid: {c:?}"
    );
    assert_eq!(c.cap_eff, 0, "{uid}: effective capabilities left");
    assert_eq!(c.nspid.len(), 2, "{uid}: a PID namespace of its own: {c:?}");
    assert_eq!(c.nspid[1], 1, "{uid}: pid 1 of its namespace");
    assert!(own_namespace(pid, "mnt") && own_namespace(pid, "pid"));
    // Its root is the jail (a pivot_root'd root reads `/` in the link; compare inodes).
    let root = j.root(uid);
    let (seen, jail) = (
        std::fs::metadata(format!("/proc/{pid}/root")).unwrap(),
        std::fs::metadata(&root).unwrap(),
    );
    assert_eq!((seen.dev(), seen.ino()), (jail.dev(), jail.ino()), "{uid}");
    assert!(Path::new(&format!("/proc/{pid}/root/api.sock")).exists());
    assert!(
        !Path::new(&format!("/proc/{pid}/root/etc/shadow")).exists(),
        "{uid}: the host's /etc is visible"
    );
    assert!(
        !Path::new(&format!("/proc/{pid}/root{}", j.h.state_dir.display())).exists(),
        "{uid}: the state directory is visible"
    );
    // The jail: the copied exec file, hard-linked kernel and drives, owned device nodes.
    let kvm = std::fs::metadata(root.join("dev/kvm")).unwrap();
    assert!(kvm.file_type().is_char_device() && kvm.uid() == id);
    assert_eq!(
        std::fs::metadata(root.join("vmlinux")).unwrap().ino(),
        std::fs::metadata(&j.h.kernel).unwrap().ino(),
        "kernel hard-linked"
    );
    let w = std::fs::metadata(root.join("writable.img")).unwrap();
    assert_eq!((w.uid(), w.mode() & 0o777), (id, 0o600));
    // Its own cgroup in each controller, with the class's limits.
    for (c, got) in cgroups_of(pid) {
        assert_eq!(
            got.as_deref(),
            Some(j.cgroups.rel.join(uid).as_path()),
            "{uid}: {} cgroup",
            c.name()
        );
    }
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").is_file();
    let mem = j.cgroups.vm_dir(Controller::Memory, uid);
    let cpu = j.cgroups.vm_dir(Controller::Cpu, uid);
    let pids = j.cgroups.vm_dir(Controller::Pids, uid);
    let limit = ((memory_mib + 64) << 20).to_string();
    if v2 {
        assert_eq!(read(&mem.join("memory.max")), limit);
        assert_eq!(read(&cpu.join("cpu.max")), "100000 100000");
    } else {
        assert_eq!(read(&mem.join("memory.limit_in_bytes")), limit);
        assert_eq!(read(&cpu.join("cpu.cfs_quota_us")), "100000");
    }
    assert_eq!(read(&pids.join("pids.max")), "200");
    id
}

/// Jails, VM directories and VM cgroups are all gone, and no jailed process is left.
async fn assert_no_leaks(j: &Jailed) {
    wait_until("no VMM process left", Duration::from_secs(10), || {
        j.h.vmm_processes().is_empty()
    })
    .await;
    let left = |d: &Path| {
        std::fs::read_dir(d)
            .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    assert!(
        left(&j.jails()).is_empty(),
        "jails left: {:?}",
        left(&j.jails())
    );
    assert!(left(&j.h.vms_dir()).is_empty());
    assert!(
        j.cgroups.children().is_empty(),
        "{:?}",
        j.cgroups.children()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_through_the_jailer_confines_each_vm() {
    let Some(mut j) = jailed("life") else { return };
    j.h.start_runtime().await;
    assert!(
        j.h.runtime_log()
            .contains("Firecracker runs through its jailer"),
        "{}",
        j.h.runtime_log()
    );
    let spec = j.h.spec(is_root());
    let mut ids = Vec::new();
    for uid in ["jail-a", "jail-b"] {
        let (_, st) =
            j.h.client
                .ensure_running(uid, &spec)
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", j.h.runtime_log()));
        assert_eq!(st.state, VmState::Running);
        let pid = st.pid.unwrap();
        ids.push(assert_confined(&j, uid, pid, spec.memory_mib));
        assert_eq!(st.vsock_path, j.h.vms_dir().join(uid).join("vsock.sock"));
        guest_answers(&st.vsock_path).await;
        if let Some(tap) = &st.tap {
            // Opened by the jailed VMM itself (its uid owns the TAP).
            j.h.client.linkstats(uid).await.unwrap();
            assert!(imp_runtime::tap::exists(tap).unwrap());
        }
    }
    assert_ne!(ids[0], ids[1], "each VM has its own uid");

    // A snapshot is written inside the jail, readable by the VM's uid only.
    let snap = j.h.client.snapshot("jail-a").await.unwrap();
    assert!(snap.snapshot_path.starts_with(j.root("jail-a")));
    for f in [&snap.snapshot_path, &snap.mem_file_path] {
        let m = std::fs::metadata(f).unwrap();
        assert_eq!(
            (m.mode() & 0o777, m.uid()),
            (0o600, ids[0]),
            "{}",
            f.display()
        );
    }

    for uid in ["jail-a", "jail-b"] {
        j.h.client.delete(uid).await.unwrap();
    }
    assert_no_leaks(&j).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_restart_reattaches_jailed_vms_and_sweeps_stray_jails() {
    let Some(mut j) = jailed("reattach") else {
        return;
    };
    j.h.start_runtime().await;
    let spec = j.h.spec(false);
    let (_, st) = j.h.client.ensure_running("jail-r", &spec).await.unwrap();
    let pid = st.pid.unwrap();
    let start = imp_runtime::procfs::start_time(pid).unwrap();
    let id = assert_confined(&j, "jail-r", pid, spec.memory_mib);

    j.h.kill9_runtime();
    assert!(alive(pid, start), "the VM outlives the runtime");
    // A jail without a row (a start that crashed before its row was written).
    let stray = j.jails().join("stray").join("root");
    std::fs::create_dir_all(&stray).unwrap();
    j.h.start_runtime().await;
    let st = j.h.client.inspect("jail-r").await.unwrap();
    assert_eq!((st.state, st.pid), (VmState::Running, Some(pid)));
    assert!(alive(pid, start), "reattached, not killed as an orphan");
    assert!(j.h.runtime_log().contains("reattached to running VM"));
    assert!(!stray.exists(), "stray jail removed");
    guest_answers(&st.vsock_path).await;
    assert_eq!(creds(pid).uids[0], id);

    j.h.client.delete("jail-r").await.unwrap();
    assert!(!alive(pid, start));
    assert_no_leaks(&j).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspend_and_resume_keep_the_snapshot_in_the_jail() {
    let Some(mut j) = jailed("suspend") else {
        return;
    };
    j.h.start_runtime().await;
    let spec = j.h.spec(is_root());
    let uid = "jail-s";
    let (_, st) = j.h.client.ensure_running(uid, &spec).await.unwrap();
    let (pid, start) = (
        st.pid.unwrap(),
        imp_runtime::procfs::start_time(st.pid.unwrap()).unwrap(),
    );
    let id = assert_confined(&j, uid, pid, spec.memory_mib);

    j.h.client
        .suspend(uid)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", j.h.runtime_log()));
    let root = j.root(uid);
    for f in ["suspend.vmstate", "suspend.mem"] {
        let m = std::fs::metadata(root.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert_eq!((m.mode() & 0o777, m.uid()), (0o600, id), "{f}");
    }
    let st = j.h.client.inspect(uid).await.unwrap();
    assert_eq!((st.state, st.pid), (VmState::Suspended, None));
    assert!(!alive(pid, start));
    assert!(j.h.vmm_processes().is_empty());
    // The VM's cgroups stay while it is suspended (the next jailer run reuses them).

    // Across a runtime restart.
    j.h.kill9_runtime();
    j.h.start_runtime().await;
    assert_eq!(
        j.h.client.inspect(uid).await.unwrap().state,
        VmState::Suspended
    );
    let resumed = j.h.client.resume(uid).await.unwrap_or_else(|e| {
        panic!(
            "{e}\n{}\n{}",
            j.h.runtime_log(),
            std::fs::read_to_string(j.h.vms_dir().join(uid).join("firecracker.stderr"))
                .unwrap_or_default()
        )
    });
    assert_eq!(resumed.status.state, VmState::Running);
    let new_pid = resumed.status.pid.unwrap();
    assert_ne!(new_pid, pid);
    assert_eq!(
        assert_confined(&j, uid, new_pid, spec.memory_mib),
        id,
        "the same uid while its files exist"
    );
    assert!(!root.join("suspend.mem").exists(), "consumed by the resume");
    guest_answers(&resumed.status.vsock_path).await;

    j.h.client.delete(uid).await.unwrap();
    assert_no_leaks(&j).await;
}

/// The double is the jailer's command line: an unknown or misspelt flag fails it (clap's exit
/// code 2, nothing made), as it fails the jailer; a bad id too; its version is the simulator's.
#[test]
fn the_double_rejects_what_the_jailer_rejects() {
    let double = jailer_double();
    let sim = imp_testkit::firecracker::binaries().simulator.clone();
    let base = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(&double);
        cmd.args(["--exec-file"])
            .arg(&sim)
            .args(["--uid", "900999", "--gid", "900999", "--chroot-base-dir"])
            .arg(base.path())
            .args(extra);
        cmd.output().unwrap()
    };
    for bad in [
        &["--id", "x", "--cgroup-versoin", "2"][..],
        &["--id", "x", "--parent-cgroups", "p"],
        &["--id", "x", "--new-pidns"],
        &["--id", "x", "--daemonise"],
    ] {
        let out = run(bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {err}");
        assert!(err.contains("unexpected argument"), "{bad:?}: {err}");
    }
    let out = run(&["--id", "a/b"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Invalid instance ID"));
    let out = run(&["--id", "x", "--cgroup-version", "3"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        std::fs::read_dir(base.path()).unwrap().next().is_none(),
        "a refused run makes nothing"
    );
    let version = |b: &Path| {
        let o = std::process::Command::new(b)
            .arg("--version")
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let (jv, fv) = (version(&double), version(&sim));
    assert!(
        jv.starts_with("Jailer v") && fv.starts_with("Firecracker v"),
        "{jv} {fv}"
    );
    assert_eq!(jv.strip_prefix("Jailer "), fv.strip_prefix("Firecracker "));
}

/// Boot (spawn to guest agent Hello, as the runtime records it) and PUT latency through the
/// jailer double against the simulator started directly, in one run, interleaved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_latency_through_the_jailer_vs_direct() {
    let Some(mut j) = jailed("bench") else { return };
    j.h.start_runtime().await;
    let mut direct = Harness::new(simulator());
    direct.start_runtime().await;
    let (mut jb, mut db, mut jp, mut dp) = (vec![], vec![], vec![], vec![]);
    for i in 0..7 {
        for (h, boot, put) in [(&j.h, &mut jb, &mut jp), (&direct, &mut db, &mut dp)] {
            let uid = format!("bench-{i}");
            let spec = h.spec(false);
            let t = Instant::now();
            let (_, st) = h.client.ensure_running(&uid, &spec).await.unwrap();
            put.push(t.elapsed().as_secs_f64());
            boot.push(st.boot_seconds.unwrap());
            h.client.delete(&uid).await.unwrap();
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (jb, db, jp, dp) = (
        median(&mut jb),
        median(&mut db),
        median(&mut jp),
        median(&mut dp),
    );
    eprintln!(
        "jailer bench (7 runs, p50): boot jailed {:.1} ms direct {:.1} ms ratio {:.3}; \
         PUT jailed {:.1} ms direct {:.1} ms ratio {:.3}",
        jb * 1e3,
        db * 1e3,
        jb / db,
        jp * 1e3,
        dp * 1e3,
        jp / dp
    );
    // The guest's announcement reaches the runtime through the jail too (its socket is the VM
    // uid's). A Hello may still come first through a connect attempt (the simulator's agent
    // starts at InstanceStart, while the first attempts are 20 ms apart), so not every VM counts.
    for (what, log) in [
        ("jailed", j.h.runtime_log()),
        ("direct", direct.runtime_log()),
    ] {
        assert!(
            !log.contains("cannot listen for the guest's announcement"),
            "{what}:\n{log}"
        );
    }
    let log = j.h.runtime_log();
    assert!(
        log.contains("announced=true"),
        "no jailed VM's Hello followed its announcement\n{log}"
    );
    assert_no_leaks(&j).await;
}

// What the tests above share: the runtime through the jailer double, with per-VM cgroups under a
// parent of this test's own memory cgroup, and readers of what /proc says about a jailed process.

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
    let mut h = Harness::new(jailed_simulator());
    h.extra_env.extend([
        (
            "IMP_VM_CGROUP_PARENT".to_string(),
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
