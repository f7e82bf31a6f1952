//! Escape drill on a real QEMU guest (docs/security.md): what a process that took over a VM's
//! VMM could reach. Two confined VMs run through imp-runtime's socket API; a drill process is put
//! into exactly VM A's vhost-device-vsock state: its mount and network namespaces (setns), its
//! uid/gid, no capability, no_new_privs and the same seccomp filter, through the runtime's own
//! code (`jail::Credentials`). It then tries to read VM B's writable drive and (VM B suspended)
//! its snapshot, the runtime's inventory and node key, /etc/shadow, a token in a stand-in of the
//! kubelet's directory, another process's root through /proc (the way to the agent's token), to
//! find the runtime's socket, and to connect to a TCP listener on the node's loopback. Every attempt must fail; the same attempts from an
//! unconfined process (the control) must succeed, so the drill can fail.
//!
//! Runs when the QEMU path can (imp_testkit::qemu) and as root: otherwise it says what it
//! skipped, or fails under IMP_REQUIRE_QEMU=1 / IMP_REQUIRE_ROOT=1.

mod common;

use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};

use imp_runtime::jail::{Credentials, vhost_filter};

/// VM A's vsock device: (pid, its namespaces' descriptors, its uid).
struct Vmm {
    mnt: OwnedFd,
    net: OwnedFd,
    uid: u32,
}

fn open_ns(pid: i32, ns: &str) -> OwnedFd {
    std::fs::File::open(format!("/proc/{pid}/ns/{ns}"))
        .unwrap()
        .into()
}

/// Run `argv` (a host tool under /usr, visible in the jail too) as the VMM (`as_vmm`) or as
/// this test (the control); whether it exited 0.
fn attempt(as_vmm: Option<&Vmm>, argv: &[&str]) -> bool {
    let mut cmd = Command::new(argv[0]);
    cmd.args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(v) = as_vmm {
        let (mnt, net) = (v.mnt.as_raw_fd(), v.net.as_raw_fd());
        let creds = Credentials::new(v.uid, Some(vhost_filter().unwrap()));
        // SAFETY: setns, chdir and the runtime's own async-signal-safe credential drop.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(mnt, libc::CLONE_NEWNS) < 0
                    || libc::setns(net, libc::CLONE_NEWNET) < 0
                    || libc::chdir(c"/".as_ptr()) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                creds.drop_privileges().map_err(std::io::Error::from)
            });
        }
    }
    cmd.status().is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_with_a_vmms_confinement_reaches_nothing_of_the_node() {
    let Some(g) = common::confine::guests("escape", false).await else {
        return;
    };
    let h = g.h;
    common::confine::start_all(&h, &g.spec, &["esc-a", "esc-b"]).await;
    let dir_a = h.vms_dir().join("esc-a");
    let (pid, _, _) = h
        .vmm_processes()
        .into_iter()
        .find(|(_, _, sock)| sock.starts_with(&dir_a) && sock.ends_with("vsock.sock"))
        .expect("VM A's vsock device");
    let vmm = Vmm {
        mnt: open_ns(pid, "mnt"),
        net: open_ns(pid, "net"),
        uid: std::fs::metadata(format!("/proc/{pid}")).unwrap().uid(),
    };
    assert_ne!(vmm.uid, 0, "the vsock device is confined");

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let tcp = format!("exec 3<>/dev/tcp/127.0.0.1/{port}");
    let p = |p: &Path| p.display().to_string();
    let b_drive = p(&h.vms_dir().join("esc-b/writable.img"));
    let inventory = p(&h.state_dir.join("inventory.db"));
    let node_key = p(&h.state_dir.join("rootfs/credentials.key"));
    let socket = p(&h.socket);
    // VM B suspended: its snapshot (the whole guest memory) lies in its directory.
    h.client
        .suspend("esc-b")
        .await
        .unwrap_or_else(|e| panic!("suspend esc-b: {e}\n{}", h.runtime_log()));
    let b_snapshot = p(&h.vms_dir().join("esc-b/suspend.mem"));
    assert!(
        Path::new(&b_snapshot).exists(),
        "VM B's snapshot was written"
    );
    // A stand-in of a kubelet's directory holding a pod's ServiceAccount token (root's, 0600), laid
    // out as the kubelet lays it out; the node's real one is outside what a test may touch.
    let kubelet = tempfile::tempdir().unwrap();
    let token_dir = kubelet
        .path()
        .join("pods/agent/volumes/kubernetes.io~projected/kube-api-access/");
    std::fs::create_dir_all(&token_dir).unwrap();
    let token = token_dir.join("token");
    std::fs::write(&token, "stand-in token").unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let token = p(&token);
    // A stand-in of the agent: a process of the node's, whose root leads to its token.
    let mut agent = Command::new("sh")
        .args(["-c", "read _"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let agent_root = format!("/proc/{}/root/etc", agent.id());
    let drills: Vec<(&str, Vec<&str>)> = vec![
        (
            "read another VM's writable drive",
            vec!["/usr/bin/cat", &b_drive],
        ),
        (
            "read the runtime's inventory",
            vec!["/usr/bin/cat", &inventory],
        ),
        (
            "read the node key of pull credentials",
            vec!["/usr/bin/cat", &node_key],
        ),
        ("read /etc/shadow", vec!["/usr/bin/cat", "/etc/shadow"]),
        (
            "read another VM's snapshot",
            vec!["/usr/bin/cat", &b_snapshot],
        ),
        (
            "read a token in the kubelet's directory",
            vec!["/usr/bin/cat", &token],
        ),
        // The way to the agent's ServiceAccount token from the host's PID namespace is
        // /proc/<agent pid>/root: a confined VMM has no /proc of the node's processes.
        (
            "reach another process's root through /proc",
            vec!["/usr/bin/stat", &agent_root],
        ),
        ("find the runtime's socket", vec!["/usr/bin/stat", &socket]),
        (
            "connect to the node's loopback",
            vec!["/usr/bin/bash", "-c", &tcp],
        ),
    ];
    // Its own files stay reachable: the drill really runs as the VMM.
    let own = p(&dir_a.join("writable.img"));
    assert!(
        attempt(Some(&vmm), &["/usr/bin/cat", &own]),
        "the drill reads VM A's own drive (it runs as VM A's VMM)"
    );
    for (what, argv) in &drills {
        assert!(
            attempt(None, argv),
            "control: an unconfined process can {what}"
        );
        assert!(
            !attempt(Some(&vmm), argv),
            "a process confined like VM A's VMM can {what}"
        );
    }
    println!(
        "escape drill: {} attempts refused, all open to the control",
        drills.len()
    );
    agent.kill().unwrap();
    agent.wait().unwrap();

    for uid in ["esc-a", "esc-b"] {
        h.client.delete(uid).await.unwrap();
    }
    assert!(h.vmm_processes().is_empty(), "no process left");
}
