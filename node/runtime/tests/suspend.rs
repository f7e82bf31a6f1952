//! Suspend and resume through the real imp-runtime binary and its HTTP API, on the Firecracker
//! simulator (its guest is a host process held by a guest keeper across the VMM swap): a
//! process started in the guest keeps running, files, TAP and vsock path survive, the guest
//! agent answers the new VMM, a suspended VM survives a runtime restart, and its snapshot,
//! keeper and guest go with its DELETE.

mod common;

use std::time::Duration;

use common::{Harness, alive, exec, is_root, simulator, wait_until};
use imp_api::names::reason;
use imp_guest::protocol::AGENT_VSOCK_PORT;
use imp_runtime::api::VmState;

async fn guest(vsock: &std::path::Path) -> imp_guest::host::HostClient {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    imp_guest::host::connect(vsock, AGENT_VSOCK_PORT, deadline)
        .await
        .expect("guest agent answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspend_resume_round_trip_on_the_simulator() {
    let mut h = Harness::new(simulator());
    h.start_runtime().await;
    // A TAP needs CAP_NET_ADMIN; without root the round trip runs without one.
    let network = is_root();
    if !network {
        imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "the TAP part of the suspend round trip",
            "not root",
        );
    }
    let uid = "sus";
    let (_, st) = h
        .client
        .ensure_running(uid, &h.spec(network))
        .await
        .unwrap();
    assert_eq!(st.state, VmState::Running);
    let (vmm_pid, vmm_start) = (
        st.pid.unwrap(),
        imp_runtime::procfs::start_time(st.pid.unwrap()).unwrap(),
    );

    // A long-running process and a file, made by the guest.
    let marker = h.dir.path().join("written-by-guest");
    let mut g = guest(&st.vsock_path).await;
    let sleeper = g.exec(exec("sleeper", &["sleep", "600"])).await.unwrap();
    let sleeper_pid = sleeper.pid as i32;
    let sleeper_start = imp_runtime::procfs::start_time(sleeper_pid).unwrap();
    let wrote = g
        .exec(exec(
            "write",
            &["sh", "-c", &format!("echo before > {}", marker.display())],
        ))
        .await
        .unwrap();
    assert_eq!(g.wait_exited(&wrote.id).await.unwrap().code, Some(0));
    drop(g);

    // Resume of a running VM is refused.
    let e = h.client.resume(uid).await.unwrap_err();
    assert_eq!(e.reason(), Some(reason::NOT_SUSPENDED));

    let info = h.client.suspend(uid).await.unwrap();
    let dir = h.vms_dir().join(uid);
    let snap = dir.join("suspend.vmstate");
    assert!(snap.is_file(), "snapshot written");
    assert!(dir.join("suspend.mem").is_file(), "memory file written");
    let st = h.client.inspect(uid).await.unwrap();
    assert_eq!((st.state, st.pid), (VmState::Suspended, None));
    assert!(!alive(vmm_pid, vmm_start), "the VMM is stopped");
    assert!(
        h.vmm_processes().is_empty(),
        "no VMM runs for a Suspended VM"
    );
    assert!(
        alive(sleeper_pid, sleeper_start),
        "the guest's process outlives the VMM"
    );
    assert!(dir.join("writable.img").is_file(), "writable drive kept");
    if network {
        let tap = st.tap.clone().unwrap();
        assert!(imp_runtime::tap::exists(&tap).unwrap(), "TAP kept");
        let ls = h.client.linkstats(uid).await.unwrap();
        assert_eq!(ls.wake_packets, 0);
    }
    let e = h.client.suspend(uid).await.unwrap_err();
    assert_eq!(e.reason(), Some(reason::NOT_RUNNING));
    let m = h.metrics().await;
    assert!(
        m.contains("imp_runtime_suspend_seconds_count{backend=\"firecracker\"} 1"),
        "{m}"
    );
    eprintln!(
        "suspend: simulator suspend took {} ms, snapshot {} bytes",
        info.took_ms, info.snapshot_bytes
    );

    // A suspended VM survives a runtime restart (kill -9 included).
    h.kill9_runtime();
    h.start_runtime().await;
    let st = h.client.inspect(uid).await.unwrap();
    assert_eq!(st.state, VmState::Suspended);
    assert!(alive(sleeper_pid, sleeper_start));

    let resumed = h.client.resume(uid).await.unwrap();
    assert_eq!(resumed.status.state, VmState::Running);
    let new_pid = resumed.status.pid.unwrap();
    assert_ne!(new_pid, vmm_pid, "a fresh VMM process");
    assert_eq!(resumed.status.vsock_path, st.vsock_path, "same vsock path");
    assert_eq!(resumed.status.tap, st.tap, "same TAP");
    if let Some(tap) = &resumed.status.tap {
        assert!(imp_runtime::tap::exists(tap).unwrap());
        h.client.linkstats(uid).await.unwrap();
    }
    assert!(!snap.exists(), "the snapshot is consumed by the resume");
    eprintln!("suspend: simulator resume took {} ms", resumed.took_ms);
    // Same guest: its process still runs, its file is there, its agent answers and still
    // knows the exec it started before the suspend.
    assert!(
        alive(sleeper_pid, sleeper_start),
        "process survived the resume"
    );
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "before\n");
    let mut g = guest(&resumed.status.vsock_path).await;
    let again = g.exec(exec("sleeper", &["sleep", "600"])).await.unwrap();
    assert_eq!(
        again.pid as i32, sleeper_pid,
        "the agent's exec table survived"
    );
    drop(g);

    // Suspend again, then DELETE while suspended: snapshot, keeper, guest tree, TAP all go.
    h.client.suspend(uid).await.unwrap();
    let tap = h.client.inspect(uid).await.unwrap().tap;
    h.client.delete(uid).await.unwrap();
    assert!(
        !dir.exists(),
        "the VM directory and its snapshot are deleted"
    );
    wait_until("the guest tree killed", Duration::from_secs(10), || {
        !alive(sleeper_pid, sleeper_start)
    })
    .await;
    wait_until("no keeper left", Duration::from_secs(10), || {
        keepers_under(&h.vms_dir()).is_empty()
    })
    .await;
    if let Some(tap) = tap {
        assert!(!imp_runtime::tap::exists(&tap).unwrap(), "TAP deleted");
    }
    assert!(h.vmm_processes().is_empty());
}

/// A VM deleted while Running still takes its keeper and guest with it (no leaks on the plain
/// path either).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_of_a_running_vm_leaves_no_keeper() {
    let mut h = Harness::new(simulator());
    h.start_runtime().await;
    let (_, st) = h
        .client
        .ensure_running("plain", &h.spec(false))
        .await
        .unwrap();
    let mut g = guest(&st.vsock_path).await;
    let s = g.exec(exec("s", &["sleep", "600"])).await.unwrap();
    let (pid, start) = (
        s.pid as i32,
        imp_runtime::procfs::start_time(s.pid as i32).unwrap(),
    );
    drop(g);
    assert_eq!(keepers_under(&h.vms_dir()).len(), 1);
    h.client.delete("plain").await.unwrap();
    wait_until("guest tree gone", Duration::from_secs(10), || {
        !alive(pid, start)
    })
    .await;
    wait_until("keeper gone", Duration::from_secs(10), || {
        keepers_under(&h.vms_dir()).is_empty()
    })
    .await;
}

/// Guest keepers (`--keep-guest <agent socket>`) of this state dir.
fn keepers_under(dir: &std::path::Path) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let args: Vec<String> = raw
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            args.iter()
                .position(|a| a == "--keep-guest")
                .and_then(|i| args.get(i + 1))
                .is_some_and(|p| p.starts_with(&*dir.to_string_lossy()))
        })
        .collect()
}

/// The wake counter: packets routed through the node towards a suspended VM's address (here
/// pings from the "internet" namespace) are counted in `linkstats.wake_packets`; the counter
/// and its table go with the resume and with DELETE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packets_to_a_suspended_vm_are_counted_until_it_resumes() {
    use imp_runtime::api::{NetworkAttachment, NetworkSpec};
    if !common::network_tests_can_run() {
        return;
    }
    // Declared before the harness: dropped after it.
    let tn = common::TestNetwork::new("impsw");
    let mut h = Harness::new(simulator());
    h.netns = Some(tn.node.clone());
    h.start_runtime().await;
    let spec = imp_runtime::api::VmSpec {
        network: Some(NetworkSpec {
            guest_mac: None,
            attachment: Some(NetworkAttachment {
                network_id: format!("wake-net-{}", std::process::id()),
                network_name: "ci/runners".into(),
                address: "198.51.100.20/24".parse().unwrap(),
                gateway: "198.51.100.1".parse().unwrap(),
                dns: vec![],
                mtu: None,
                nat: true,
                egress_interface: None,
                egress_allow: vec![],
                egress_deny: vec![],
                ingress: vec![],
            }),
        }),
        ..h.spec(false)
    };
    h.client
        .ensure_running("waker", &spec)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", h.runtime_log()));
    assert_eq!(h.client.linkstats("waker").await.unwrap().wake_packets, 0);
    h.client.suspend("waker").await.unwrap();
    assert_eq!(h.client.linkstats("waker").await.unwrap().wake_packets, 0);
    let tables = |tn: &common::TestNetwork| {
        common::output("ip", &["netns", "exec", &tn.node, "nft", "list", "tables"])
    };
    assert!(tables(&tn).contains("imp_wake"), "{}", tables(&tn));

    // From another namespace, routed through the node.
    common::output(
        "ip",
        &[
            "-n",
            &tn.inet,
            "route",
            "add",
            "198.51.100.0/24",
            "via",
            "192.0.2.2",
        ],
    );
    // Three UDP datagrams (bash's /dev/udp: no ping on every host).
    let sent = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &tn.inet,
            "bash",
            "-c",
            "for i in 1 2 3; do echo wake > /dev/udp/198.51.100.20/9; sleep 0.1; done",
        ])
        .status()
        .unwrap();
    assert!(sent.success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let counted = h.client.linkstats("waker").await.unwrap().wake_packets;
    assert!(
        counted >= 3,
        "wake_packets {counted} after 3 datagrams\n{}\n{}\n{}",
        common::output("ip", &["netns", "exec", &tn.node, "nft", "list", "ruleset"]),
        common::output("ip", &["-n", &tn.node, "route"]),
        common::output(
            "ip",
            &["netns", "exec", &tn.node, "sysctl", "net.ipv4.ip_forward"]
        ),
    );

    h.client.resume("waker").await.unwrap();
    assert_eq!(h.client.linkstats("waker").await.unwrap().wake_packets, 0);
    assert!(
        !tables(&tn).contains("imp_wake"),
        "counter removed on resume"
    );
    h.client.suspend("waker").await.unwrap();
    assert!(tables(&tn).contains("imp_wake"));
    h.client.delete("waker").await.unwrap();
    assert!(
        !tables(&tn).contains("imp_wake"),
        "counter removed on DELETE"
    );
}
