//! Confinement of a real QEMU guest's processes (docs/security.md), through imp-runtime's socket
//! API: two VMs; for each one's qemu-system-x86_64 and vhost-device-vsock, from /proc/<pid>:
//! uid and gid not 0 and different between the VMs (the same for a VM's two processes), no
//! capability in any set, no_new_privs, seccomp filter mode, a mount namespace of its own whose
//! root holds its VM directory (the same inode as the host's) but neither /etc/shadow, the
//! runtime's socket, the state dir's inventory nor the other VM's directory. A VM keeps its uid
//! across a runtime kill -9 and a suspend/resume (the mapping is recovered from its directory).
//! DELETE leaves no file of either uid in the state dir.
//!
//! Runs when the QEMU path can (imp_testkit::qemu) and as root (a uid switch needs it):
//! otherwise it says what it skipped, or fails under IMP_REQUIRE_QEMU=1 / IMP_REQUIRE_ROOT=1.

mod common;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use common::Harness;

/// The fields of /proc/<pid>/status this test reads.
fn status(pid: i32) -> HashMap<String, String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

/// The real uid of a status's `Uid:`/`Gid:` line, after checking all four agree.
fn one_id(line: &str) -> u32 {
    let ids: Vec<u32> = line
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(
        ids.iter().all(|i| *i == ids[0]),
        "real, effective, saved, fs differ: {line}"
    );
    ids[0]
}

/// A VM's processes (QEMU and its vsock device), by their sockets in `dir`.
fn processes_of(h: &Harness, dir: &Path) -> Vec<(i32, PathBuf)> {
    h.vmm_processes()
        .into_iter()
        .filter(|(_, _, sock)| sock.starts_with(dir))
        .map(|(p, _, sock)| (p, sock))
        .collect()
}

/// Assert one process's confinement; its uid.
fn assert_confined(pid: i32, what: &str, own_dir: &Path, other_dir: &Path, h: &Harness) -> u32 {
    let st = status(pid);
    let uid = one_id(&st["Uid"]);
    let gid = one_id(&st["Gid"]);
    assert!(uid != 0 && gid != 0, "{what} {pid} runs as {uid}:{gid}");
    assert_eq!(uid, gid, "{what}: uid = gid");
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(st[set], "0000000000000000", "{what} {pid} {set}");
    }
    assert_eq!(st["NoNewPrivs"], "1", "{what} {pid} no_new_privs");
    assert_eq!(st["Seccomp"], "2", "{what} {pid} seccomp filter mode");
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap());
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap(),
        std::fs::read_link("/proc/self/ns/mnt").unwrap(),
        "{what}: a mount namespace of its own"
    );
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap(),
        std::fs::read_link("/proc/self/ns/net").unwrap(),
        "{what}: a network namespace of its own"
    );
    let mine = std::fs::metadata(own_dir).unwrap();
    let seen = std::fs::metadata(inside(own_dir)).expect("its VM directory in its root");
    assert_eq!(
        (seen.dev(), seen.ino()),
        (mine.dev(), mine.ino()),
        "{what}: the same directory"
    );
    assert_eq!(
        (mine.uid(), mine.gid(), mine.mode() & 0o7777),
        (uid, 0, 0o2710),
        "its directory is its own (group root may only pass through: imp-agent's way to its vsock)"
    );
    let vsock = std::fs::metadata(own_dir.join("vsock.sock")).expect("its vsock socket");
    assert_eq!(
        (vsock.uid(), vsock.gid(), vsock.mode() & 0o777),
        (uid, 0, 0o770),
        "its vsock socket: group root may connect (imp-agent, uid 0 without capabilities)"
    );
    // Its console and the VMMs' logs are the VM's, 0600: with imp-agent's credentials in the chart
    // (uid 0, gid 0, no capability; it mounts the VM directories) none is readable, while a
    // root-owned file would be, as its owner (the control).
    for name in ["serial.log", "qemu.log", "vhost-device-vsock.log"] {
        let p = own_dir.join(name);
        let m = std::fs::metadata(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((m.uid(), m.mode() & 0o777), (uid, 0o600), "{name}");
        assert!(!agent_reads(&p), "imp-agent's credentials read {name}");
    }
    let control = tempfile::NamedTempFile::new().unwrap();
    assert!(
        agent_reads(control.path()),
        "the control: a root-owned file"
    );
    for p in [
        Path::new("/etc/shadow"),
        other_dir,
        &h.socket,
        // The node key sealing pull credentials, beside the base images (bound one by one).
        &h.state_dir.join("rootfs/credentials.key"),
        &h.state_dir.join("inventory.db"),
    ] {
        assert!(
            std::fs::symlink_metadata(inside(p)).is_err(),
            "{what} {pid} sees {}",
            p.display()
        );
    }
    uid
}

/// Whether `path` can be read with imp-agent's credentials in the chart: uid 0 and gid 0 with no
/// capability (setpriv clears the bounding set, so the exec keeps none).
fn agent_reads(path: &Path) -> bool {
    std::process::Command::new("setpriv")
        .args([
            "--bounding-set=-all",
            "--inh-caps=-all",
            "--no-new-privs",
            "--",
            "cat",
        ])
        .arg(path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("setpriv (util-linux)")
        .success()
}

/// Files under `dir` owned by one of `ids`.
fn owned_by(dir: &Path, ids: &[u32]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(m) = e.metadata() else { continue };
            if ids.contains(&m.uid()) || ids.contains(&m.gid()) {
                out.push(e.path());
            }
            if m.is_dir() {
                todo.push(e.path());
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_qemu_vmm_process_is_confined_to_its_own_vm() {
    let Some(g) = common::confine::guests("confine", true).await else {
        return;
    };
    let mut h = g.h;
    let uids = ["conf-a", "conf-b"];
    common::confine::start_all(&h, &g.spec, &uids).await;
    let dirs = uids.map(|u| h.vms_dir().join(u));
    let mut ids = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let procs = processes_of(&h, dir);
        assert_eq!(procs.len(), 2, "QEMU and its vsock device: {procs:?}");
        let mut vm_ids: Vec<u32> = procs
            .iter()
            .map(|(pid, sock)| {
                assert_confined(*pid, &sock.display().to_string(), dir, &dirs[1 - i], &h)
            })
            .collect();
        vm_ids.dedup();
        assert_eq!(vm_ids.len(), 1, "a VM's processes share its uid");
        let w = std::fs::metadata(dir.join("writable.img")).unwrap();
        assert_eq!(
            (w.uid(), w.mode() & 0o777),
            (vm_ids[0], 0o600),
            "its writable drive"
        );
        ids.push(vm_ids[0]);
    }
    assert_ne!(ids[0], ids[1], "each VM its own uid");

    // The mapping survives a runtime kill -9 and a suspend/resume (new processes).
    h.kill9_runtime();
    h.start_runtime().await;
    h.client
        .suspend(uids[0])
        .await
        .unwrap_or_else(|e| panic!("suspend: {e}\n{}", h.runtime_log()));
    assert!(processes_of(&h, &dirs[0]).is_empty());
    h.client
        .resume(uids[0])
        .await
        .unwrap_or_else(|e| panic!("resume: {e}\n{}", h.runtime_log()));
    let procs = processes_of(&h, &dirs[0]);
    assert_eq!(procs.len(), 2, "resumed: {procs:?}");
    for (pid, sock) in &procs {
        let id = assert_confined(*pid, &sock.display().to_string(), &dirs[0], &dirs[1], &h);
        assert_eq!(id, ids[0], "the same uid after a restart and a resume");
    }

    for uid in uids {
        h.client.delete(uid).await.unwrap();
    }
    assert!(h.vmm_processes().is_empty(), "no process left");
    let left = owned_by(&h.state_dir, &ids);
    assert!(left.is_empty(), "files of the VM uids left: {left:?}");
    let mount_point = imp_runtime::runtime::jail_mount_point(&h.state_dir);
    assert_eq!(
        std::fs::read_dir(&mount_point).unwrap().count(),
        0,
        "the jail mount point stays empty on the host"
    );
}
