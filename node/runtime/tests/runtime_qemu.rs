//! imp-runtime's QEMU backend end to end, through its socket API: a root filesystem built from
//! an image in a local registry (Debian's docker-registry), Debian's kernel with Imp's initrd
//! (images/initrd/build.sh), QEMU under TCG with one vhost-device-vsock per VM. PUT -> guest
//! Hello -> Exec of a runner-like command with a JIT-like environment -> Exited with its code;
//! `kill -9` of the runtime while the VM runs, restart, reattach, Exec again; DELETE leaves no
//! process, socket, file or row. Also measures boot to Hello per VM against a bare
//! qemu-system-x86_64 boot of the same kernel, initrd and base, and the RSS of the runtime and
//! of each VM's vsock device.
//!
//! Runs when the QEMU path can (imp_testkit::qemu): otherwise it says what it skipped, or fails
//! under IMP_REQUIRE_QEMU=1. guest/vm-test.sh runs it.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::measure::rss_kib;
use common::{Harness, is_root};
use http::StatusCode;
use imp_common::SecretString;
use imp_guest::host::HostClient;
use imp_guest::protocol::Exec;
use imp_runtime::api::VmState;
use imp_testkit::oci::push_gzip_image;
use imp_testkit::qemu::{self, Drive};
use imp_testkit::registry::{Registry, RegistryOptions};

/// A base with a static busybox as /bin/sh and a stand-in for the runner: it checks that its
/// JIT config arrived and exits with a code of its own.
fn layers() -> Vec<Vec<u8>> {
    vec![
        common::busybox_layer()
            .dir("opt", 0o755)
            .dir("opt/actions-runner", 0o755)
            .file(
                "opt/actions-runner/run.sh",
                b"#!/bin/sh\n[ \"$ACTIONS_RUNNER_INPUT_JITCONFIG\" = jit-7f3a ] || exit 99\nexit 7\n",
                0o755,
            )
            .into_gzip(),
    ]
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

async fn guest(h: &Harness, uid: &str) -> HostClient {
    let info = h.client.vsock(uid).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    imp_guest::host::connect(&info.path, info.guest_agent_port, deadline)
        .await
        .unwrap_or_else(|e| panic!("connect to {uid}: {e}"))
}

/// The runner stand-in with a JIT-like environment, to its exit code.
async fn run_runner(c: &mut HostClient, id: &str) -> Option<i32> {
    c.exec(Exec {
        id: id.into(),
        argv: vec!["/opt/actions-runner/run.sh".into()],
        env: BTreeMap::from([
            ("PATH".into(), SecretString::from("/bin")),
            (
                "ACTIONS_RUNNER_INPUT_JITCONFIG".into(),
                SecretString::from("jit-7f3a"),
            ),
        ]),
        cwd: None,
        uid: None,
        gid: None,
        refuse_root: false,
        timeout_s: Some(60),
        stream_output: false,
        poweroff_on_exit: false,
    })
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(90), c.wait_exited(id))
        .await
        .expect("Exited in time")
        .unwrap()
        .code
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_vms_boot_run_survive_a_runtime_kill_and_leave_nothing() {
    let Some(s) = qemu::setup_or_skip() else {
        return;
    };
    let images = tempfile::tempdir().unwrap();
    let initrd = images.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);
    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let base = push_gzip_image(&registry.host(), "imp/runner-base:qemu", layers()).await;

    let mut h = Harness::qemu(&s, &initrd, registry.host());
    h.start_runtime().await;
    let network = is_root();
    let spec = common::image_vm(base.clone(), 512, 128 << 20, network);
    let (code, st) = h
        .client
        .ensure_running("qemu-a", &spec)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", h.runtime_log()));
    assert_eq!((code, st.state), (StatusCode::CREATED, VmState::Running));
    let pid = st.pid.unwrap();
    let start = imp_runtime::procfs::start_time(pid).unwrap();
    let mut boots = vec![st.boot_seconds.unwrap()];

    let mut c = guest(&h, "qemu-a").await;
    assert_eq!(run_runner(&mut c, "run-1").await, Some(7));
    drop(c);

    // kill -9 of the runtime while the VM runs: the VM and its vsock device stay.
    let vmm_before = h.vmm_processes();
    assert_eq!(
        vmm_before.len(),
        2,
        "QEMU and its vhost-device-vsock: {vmm_before:?}"
    );
    h.kill9_runtime();
    for (p, t, _) in &vmm_before {
        assert!(common::alive(*p, *t), "pid {p} died with the runtime");
    }
    h.start_runtime().await;
    let again = h.client.inspect("qemu-a").await.unwrap();
    assert_eq!(
        (again.state, again.pid),
        (VmState::Running, Some(pid)),
        "reattached"
    );
    assert!(
        h.metrics()
            .await
            .contains("imp_runtime_recovered_vms_total{outcome=\"reattached\"} 1"),
        "{}",
        h.runtime_log()
    );
    let mut c = guest(&h, "qemu-a").await;
    assert_eq!(
        run_runner(&mut c, "run-2").await,
        Some(7),
        "Exec after the reattach"
    );
    drop(c);

    // Measurements: two more VMs for boot times; RSS of the runtime and a vsock device.
    for uid in ["qemu-b", "qemu-c"] {
        let (_, st) = h.client.ensure_running(uid, &spec).await.unwrap();
        boots.push(st.boot_seconds.unwrap());
        // The guest's announcement reached the runtime through the confined vsock device: the
        // guest says so only when the host end accepted its connection. It prints that after the
        // connection, so the Hello (which the connection triggers) may come first: wait for it.
        let serial = h.vms_dir().join(uid).join("serial.log");
        let marker = "IMP-GUEST stage=announce ";
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let console = loop {
            let console = std::fs::read_to_string(&serial).unwrap_or_default();
            if console.contains(marker) || std::time::Instant::now() >= deadline {
                break console;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(
            console.contains("IMP-GUEST stage=announce ok"),
            "{uid}: no announcement taken\n{console}"
        );
    }
    // Either Hello followed its announcement (a connect attempt landing between the guest's
    // listen and its announcement, microseconds apart, could come first for one of them).
    assert!(
        h.runtime_log().contains("announced=true"),
        "{}",
        h.runtime_log()
    );
    let runtime_rss = rss_kib(h.runtime_pid().unwrap() as i32);
    let vhost_rss: Vec<u64> = h
        .vmm_processes()
        .iter()
        .filter(|(p, _, sock)| sock.ends_with("vsock.sock") && rss_kib(*p) > 0)
        .map(|(p, _, _)| rss_kib(*p))
        .collect();
    assert_eq!(vhost_rss.len(), 3, "one vsock device per VM");
    for uid in ["qemu-b", "qemu-c"] {
        h.client.delete(uid).await.unwrap();
    }

    // The same kernel, initrd and base booted by QEMU alone (testkit's harness).
    let base_img = std::fs::read_dir(h.state_dir.join("rootfs/images"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "ext4"))
        .expect("the built base image");
    let rw = images.path().join("bare.rw");
    imp_runtime::rootfs::writable::WritableDrives::new(&images.path().join("templates"))
        .unwrap()
        .create(&rw, 128 << 20)
        .unwrap();
    let bare = qemu::Vm::start(
        &s,
        &initrd,
        &[Drive::read_only(&base_img), Drive::writable(&rw)],
        "imp.lower=/dev/vda imp.overlay=/dev/vdb imp.report_grace_s=60",
    );
    let _ = bare.connect().await;
    let bare_secs = bare.started.elapsed().as_secs_f64();
    drop(bare);

    let (min, max) = (
        boots.iter().cloned().fold(f64::MAX, f64::min),
        boots.iter().cloned().fold(0.0, f64::max),
    );
    let med = median(&mut boots.clone());
    println!(
        "MEASURE qemu boot to Hello via imp-runtime ({} VMs, TCG): min {min:.2} s, median {med:.2} s, max {max:.2} s",
        boots.len()
    );
    println!(
        "MEASURE bare qemu-system-x86_64 boot to Hello: {bare_secs:.2} s; runtime median / bare = {:.2}",
        med / bare_secs
    );
    println!(
        "MEASURE RSS: imp-runtime {runtime_rss} KiB; vhost-device-vsock per VM {vhost_rss:?} KiB"
    );

    h.client.delete("qemu-a").await.unwrap();
    assert!(!common::alive(pid, start));
    assert!(h.vmm_processes().is_empty(), "no process left");
    assert!(h.client.list().await.unwrap().is_empty(), "no row left");
    let left: Vec<_> = std::fs::read_dir(h.vms_dir()).unwrap().flatten().collect();
    assert!(left.is_empty(), "no VM files left: {left:?}");
    if network {
        assert!(
            !std::path::Path::new(&format!("/sys/class/net/{}", h.tap_for("qemu-a"))).exists(),
            "no TAP left"
        );
    }
}
