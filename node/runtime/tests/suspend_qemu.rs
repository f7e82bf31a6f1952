//! Suspend and resume on a real guest under QEMU (TCG unless IMP_QEMU_ACCEL says otherwise),
//! through imp-runtime's socket API: the vsock device is unplugged, the VM migrated into a
//! file and QEMU stopped; the resume starts QEMU with `-incoming` from that file, plugs the
//! vsock device back and continues. A process started in the guest keeps running (the guest
//! agent's exec table knows it by id and `kill -0` finds it), a file written before is read
//! after, the TAP and vsock path are the same, a suspended VM survives a `kill -9` of the
//! runtime, and DELETE leaves nothing. Several round trips measure suspend time, snapshot
//! size and resume-to-Hello time (medians printed, docs/suspend.md).
//!
//! Timeouts are generous: under TCG on a saturated host a hot-unplug, a migration of a few
//! hundred MiB or a resume take tens of seconds. Runs when the QEMU path can
//! (imp_testkit::qemu), otherwise says what it skipped, or fails under IMP_REQUIRE_QEMU=1.
//! guest/vm-test.sh runs it.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Harness, is_root};
use imp_common::SecretString;
use imp_guest::host::HostClient;
use imp_guest::protocol::Exec;
use imp_runtime::api::VmState;
use imp_testkit::oci::push_gzip_image;
use imp_testkit::qemu;
use imp_testkit::registry::{Registry, RegistryOptions};

const ROUND_TRIPS: usize = 3;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn sh(id: &str, script: &str) -> Exec {
    Exec {
        env: BTreeMap::from([("PATH".into(), SecretString::from("/bin"))]),
        timeout_s: Some(120),
        ..common::exec(id, &["/bin/sh", "-c", script])
    }
}

async fn guest(h: &Harness, uid: &str) -> HostClient {
    let info = h.client.vsock(uid).await.unwrap();
    // Generous: a TCG guest on a loaded host answers slowly right after a resume.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    let mut c = imp_guest::host::connect(&info.path, info.guest_agent_port, deadline)
        .await
        .unwrap_or_else(|e| panic!("connect to {uid}: {e}\n{}", h.runtime_log()));
    c.set_answer_timeout(Duration::from_secs(180));
    c
}

async fn run(c: &mut HostClient, id: &str, script: &str) -> Option<i32> {
    c.exec(sh(id, script)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(240), c.wait_exited(id))
        .await
        .expect("Exited in time")
        .unwrap()
        .code
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_suspend_resume_keeps_the_guest() {
    let Some(s) = qemu::setup_or_skip() else {
        return;
    };
    let images = tempfile::tempdir().unwrap();
    let initrd = images.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);
    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let base = push_gzip_image(
        &registry.host(),
        "imp/runner-base:suspend",
        vec![common::busybox_layer().into_gzip()],
    )
    .await;
    let mut h = Harness::qemu(&s, &initrd, registry.host());
    h.start_runtime().await;
    let network = is_root();
    let spec = common::image_vm(base, 256, 64 << 20, network);
    let uid = "qsus";
    let (_, st) = h
        .client
        .ensure_running(uid, &spec)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", h.runtime_log()));
    assert_eq!(st.state, VmState::Running);

    let mut c = guest(&h, uid).await;
    let sleeper = c.exec(sh("sleeper", "exec sleep 3600")).await.unwrap();
    assert_eq!(
        run(&mut c, "write", "echo before > /suspend-marker").await,
        Some(0)
    );
    drop(c);

    let (mut suspend_s, mut size_mib, mut resume_s) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUND_TRIPS {
        let before = h.client.inspect(uid).await.unwrap();
        let info = h
            .client
            .suspend(uid)
            .await
            .unwrap_or_else(|e| panic!("suspend {round}: {e}\n{}", h.runtime_log()));
        let st = h.client.inspect(uid).await.unwrap();
        assert_eq!((st.state, st.pid), (VmState::Suspended, None));
        assert!(
            h.vmm_processes().is_empty(),
            "no QEMU nor vsock device runs"
        );
        assert!(info.snapshot_bytes > 0, "the migration stream is on disk");
        if let Some(tap) = &st.tap {
            assert!(imp_runtime::tap::exists(tap).unwrap(), "TAP kept");
        }
        if round == 0 {
            // A suspended VM survives a runtime restart.
            h.kill9_runtime();
            h.start_runtime().await;
            assert_eq!(
                h.client.inspect(uid).await.unwrap().state,
                VmState::Suspended
            );
        }
        let resumed = h
            .client
            .resume(uid)
            .await
            .unwrap_or_else(|e| panic!("resume {round}: {e}\n{}", h.runtime_log()));
        assert_eq!(resumed.status.state, VmState::Running);
        assert_eq!(resumed.status.vsock_path, before.vsock_path);
        assert_eq!(resumed.status.tap, before.tap);
        suspend_s.push(info.took_ms as f64 / 1000.0);
        size_mib.push(info.snapshot_bytes as f64 / f64::from(1u32 << 20));
        resume_s.push(resumed.took_ms as f64 / 1000.0);

        // The same guest: the exec table knows the sleeper (same pid), it still runs, the
        // file written before the first suspend is there.
        let mut c = guest(&h, uid).await;
        let again = c.exec(sh("sleeper", "exec sleep 3600")).await.unwrap();
        assert_eq!(
            again.pid, sleeper.pid,
            "the guest agent's exec table survived"
        );
        let check = format!(
            "kill -0 {} && [ \"$(cat /suspend-marker)\" = before ]",
            sleeper.pid
        );
        assert_eq!(
            run(&mut c, &format!("check-{round}"), &check).await,
            Some(0),
            "process and file survived round {round}\n{}",
            h.runtime_log()
        );
        drop(c);
    }
    println!(
        "suspend_qemu: {ROUND_TRIPS} round trips, 256 MiB guest: median suspend {:.2} s, snapshot {:.1} MiB, resume to Hello {:.2} s",
        median(&mut suspend_s),
        median(&mut size_mib),
        median(&mut resume_s)
    );

    // Suspended, then deleted: nothing left.
    h.client.suspend(uid).await.unwrap();
    let tap = h.client.inspect(uid).await.unwrap().tap;
    h.client.delete(uid).await.unwrap();
    assert!(h.vmm_processes().is_empty(), "no process left");
    assert!(h.client.list().await.unwrap().is_empty(), "no row left");
    assert!(
        !h.vms_dir().join(uid).exists(),
        "snapshot and files deleted"
    );
    if let Some(tap) = tap {
        assert!(!imp_runtime::tap::exists(&tap).unwrap(), "TAP deleted");
    }
}
