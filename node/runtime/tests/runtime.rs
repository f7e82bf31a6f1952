//! imp-runtime through its socket API, with the Firecracker simulator (and real Firecracker when
//! configured): lifecycle, bad requests, boot failure reasons.

mod common;

use std::time::Duration;

use common::{Harness, alive, backends, is_root, simulator};
use http::{Method, StatusCode};
use imp_api::names::reason;
use imp_runtime::api::VmState;
use imp_testkit::firecracker::Knobs;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_inspect_linkstats_vsock_snapshot_delete() {
    for backend in backends("create_inspect_linkstats_vsock_snapshot_delete") {
        let name = backend.name();
        let mut h = Harness::new(backend);
        h.start_runtime().await;
        let network = is_root();
        if !network {
            imp_testkit::skip::skip_or_fail(
                "IMP_REQUIRE_ROOT",
                "the TAP/linkstats part",
                "not root (creating TAP devices needs root)",
            );
        }
        let uid = "vm-life";
        let spec = h.spec(network);

        let (code, st) = h
            .client
            .ensure_running(uid, &spec)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", h.runtime_log()));
        assert_eq!(code, StatusCode::CREATED);
        assert_eq!(st.state, VmState::Running);
        let pid = st.pid.expect("pid");
        let boot = st.boot_seconds.expect("boot latency recorded");
        assert!(boot > 0.0 && boot < h.boot_timeout_secs, "{boot}");
        let start = imp_runtime::procfs::start_time(pid).expect("VM process runs");

        // Idempotent: the same spec again neither restarts nor duplicates.
        let (code, again) = h.client.ensure_running(uid, &spec).await.unwrap();
        assert_eq!((code, again.pid), (StatusCode::OK, Some(pid)));
        assert_eq!(h.vmm_processes().len(), 1);
        // Another spec for the same uid is a conflict.
        let mut other = spec.clone();
        other.memory_mib = 256;
        let e = h.client.ensure_running(uid, &other).await.unwrap_err();
        assert_eq!(e.reason(), Some(reason::SPEC_CONFLICT), "{e}");

        let got = h.client.inspect(uid).await.unwrap();
        assert_eq!(got, st);
        // The per-VM writable drive is a sparse ext4 image (superblock magic 0xEF53 at 1080).
        let img = std::fs::read(h.vms_dir().join(uid).join("writable.img")).unwrap();
        assert_eq!(img.len() as u64, 256 << 20);
        assert_eq!(&img[1080..1082], &[0x53, 0xEF]);

        if network {
            let tap = st.tap.clone().expect("tap recorded");
            assert_eq!(tap, h.tap_for(uid));
            let stats = h.client.linkstats(uid).await.unwrap();
            let sysfs = |c: &str| -> u64 {
                std::fs::read_to_string(format!("/sys/class/net/{tap}/statistics/{c}"))
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap()
            };
            if h.backend.is_simulator() {
                // The simulated guest announced itself with one 42-byte ARP frame.
                assert!(stats.rx_bytes >= 42, "{stats:?}");
            }
            assert!(stats.rx_bytes <= sysfs("rx_bytes") && stats.tx_bytes <= sysfs("tx_bytes"));
        }

        // The vsock path leads to the guest agent.
        let vs = h.client.vsock(uid).await.unwrap();
        assert_eq!(vs.path, st.vsock_path);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let guest = imp_guest::host::connect(&vs.path, vs.guest_agent_port, deadline)
            .await
            .unwrap();
        assert!(!guest.hello().boot_id.is_empty());
        drop(guest);

        if h.backend.is_simulator() {
            let snap = h.client.snapshot(uid).await.unwrap();
            assert!(snap.snapshot_path.exists() && snap.mem_file_path.exists());
            assert_eq!(h.client.inspect(uid).await.unwrap().state, VmState::Running);
            // Resumed: the guest still answers.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            imp_guest::host::connect(&vs.path, vs.guest_agent_port, deadline)
                .await
                .unwrap();
        }

        let m = h.metrics().await;
        assert!(m.contains("imp_vm_boot_latency_seconds_count 1"), "{m}");
        // The same registry on IMP_METRICS_ADDR (TCP), whose bound port the log names.
        let log = h.runtime_log();
        let addr = log
            .split_whitespace()
            .find_map(|w| w.strip_prefix("metrics="))
            .unwrap_or_else(|| panic!("no metrics address in the log: {log}"));
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        tcp.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut text = String::new();
        tcp.read_to_string(&mut text).await.unwrap();
        assert!(
            text.starts_with("HTTP/1.0 200")
                && text.contains("imp_vm_boot_latency_seconds_count 1"),
            "{text}"
        );
        // The API socket is group-accessible only (0660).
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&h.socket).unwrap().permissions().mode() & 0o777,
            0o660
        );
        assert!(m.contains("imp_runtime_vms{state=\"Running\"} 1"), "{m}");
        let (code, body) = h
            .client
            .request(Method::GET, "/readyz", None)
            .await
            .unwrap();
        let ready: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(ready["backend"], "firecracker");
        assert_eq!(ready["vmm_bin"], true);
        assert_eq!(ready["kernel"], true);
        assert_eq!(
            ready["not_ready"].as_array().unwrap().is_empty(),
            code.is_success(),
            "{ready}"
        );
        assert_eq!(code.is_success(), ready["kvm"] == true);
        assert!(
            m.contains(&format!(
                "imp_runtime_ready{{backend=\"firecracker\"}} {}",
                i32::from(code.is_success())
            )),
            "{m}"
        );

        h.client.delete(uid).await.unwrap();
        assert!(
            !alive(pid, start),
            "{name}: VM process still runs after DELETE"
        );
        assert!(!h.vms_dir().join(uid).exists(), "VM directory left behind");
        assert!(
            !imp_runtime::tap::exists(&h.tap_for(uid)).unwrap(),
            "TAP left behind"
        );
        let e = h.client.inspect(uid).await.unwrap_err();
        assert_eq!(e.reason(), Some(reason::NOT_FOUND));
        h.client.delete(uid).await.expect("DELETE is idempotent");
        assert!(h.vmm_processes().is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_4xx_with_a_reason() {
    let mut h = Harness::new(simulator());
    h.start_runtime().await;
    let spec = serde_json::to_value(h.spec(false)).unwrap();
    let put = |uid: &str, body: serde_json::Value| {
        let c = h.client.clone();
        let path = format!("/v1/vms/{uid}");
        async move {
            let (s, b) = c
                .request(Method::PUT, &path, Some(body.to_string().into_bytes()))
                .await
                .unwrap();
            (s, serde_json::from_slice::<serde_json::Value>(&b).unwrap())
        }
    };
    let cases = [
        ("Bad_Uid", spec.clone(), 400, reason::INVALID_UID),
        (
            "ok-uid",
            serde_json::json!({"vcpu": 1}),
            400,
            reason::INVALID_BODY,
        ),
        (
            "ok-uid",
            {
                let mut s = spec.clone();
                s["surprise"] = 1.into();
                s
            },
            400,
            reason::INVALID_BODY,
        ),
        (
            "ok-uid",
            {
                let mut s = spec.clone();
                s["vcpu"] = 3.into();
                s
            },
            400,
            reason::INVALID_SPEC,
        ),
        (
            "ok-uid",
            {
                let mut s = spec.clone();
                s["base_disk"] = "/nonexistent/disk".into();
                s
            },
            400,
            reason::INVALID_SPEC,
        ),
        (
            "ok-uid",
            {
                let mut s = spec.clone();
                s["network"] = serde_json::json!({"guest_mac": "zz"});
                s
            },
            400,
            reason::INVALID_SPEC,
        ),
    ];
    for (uid, body, code, reason) in cases {
        let (s, b) = put(uid, body.clone()).await;
        assert_eq!(
            (s.as_u16(), b["error"].as_str()),
            (code, Some(reason)),
            "{body} -> {b}"
        );
        assert!(!b["message"].as_str().unwrap().is_empty());
    }
    let (s, b) = h
        .client
        .request(Method::PUT, "/v1/vms/ok-uid", Some(b"{not json".to_vec()))
        .await
        .unwrap();
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b:?}");
    assert_eq!(
        h.client.inspect("nothing-here").await.unwrap_err().reason(),
        Some(reason::NOT_FOUND)
    );
    assert_eq!(
        h.client
            .linkstats("nothing-here")
            .await
            .unwrap_err()
            .reason(),
        Some(reason::NOT_FOUND)
    );
    let (s, _) = h
        .client
        .request(Method::GET, "/v2/whatever", None)
        .await
        .unwrap();
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(
        h.vmm_processes().is_empty(),
        "no bad request may start a VM"
    );

    // linkstats of a VM without a network interface: a conflict with a reason.
    let (code, _) = h
        .client
        .ensure_running("no-net", &h.spec(false))
        .await
        .unwrap();
    assert_eq!(code, StatusCode::CREATED);
    assert_eq!(
        h.client.linkstats("no-net").await.unwrap_err().reason(),
        Some(reason::NO_NETWORK)
    );
    h.client.delete("no-net").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_failures_carry_precise_reasons_and_release_everything() {
    let mut h = Harness::new(simulator());
    h.boot_timeout_secs = 2.0;
    h.knobs(
        "crash",
        Knobs {
            crash_at_start: true,
            ..Knobs::default()
        },
    );
    h.knobs(
        "panic",
        Knobs {
            boot_delay_ms: 100,
            panic_text: Some("Kernel panic - not syncing: VFS: Unable to mount root fs".into()),
            ..Knobs::default()
        },
    );
    h.knobs(
        "hang",
        Knobs {
            hang: true,
            ..Knobs::default()
        },
    );
    h.knobs(
        "resets",
        Knobs {
            panic_text: Some("reboot: Restarting system".into()),
            ..Knobs::default()
        },
    );
    h.start_runtime().await;

    let network = is_root();
    // (A spec naming a kernel that does not exist is a bad request: runtime_hygiene.rs.)
    let cases = [
        (
            "crash",
            h.spec(network),
            reason::FIRECRACKER_START_FAILED,
            "simulated crash",
        ),
        (
            "panic",
            h.spec(network),
            reason::GUEST_PANICKED,
            "Kernel panic - not syncing",
        ),
        (
            "hang",
            h.spec(network),
            reason::GUEST_AGENT_TIMEOUT,
            "hanging",
        ),
        (
            "resets",
            h.spec(network),
            reason::GUEST_EXITED,
            "Restarting system",
        ),
        // Last: the runtime's own kernel disappears from the node.
        ("nokernel", h.spec(false), reason::KERNEL_MISSING, "vmlinux"),
    ];
    for (uid, spec, reason, detail) in cases {
        if uid == "nokernel" {
            std::fs::remove_file(&h.kernel).unwrap();
        }
        let t0 = std::time::Instant::now();
        let e = h.client.ensure_running(uid, &spec).await.unwrap_err();
        assert_eq!(e.reason(), Some(reason), "{uid}: {e}");
        assert!(e.to_string().contains(detail), "{uid}: {e}");
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{uid} took {:?}",
            t0.elapsed()
        );
        let st = h.client.inspect(uid).await.unwrap();
        assert_eq!(st.state, VmState::Failed);
        assert_eq!(st.failure.as_ref().map(|f| f.reason.as_str()), Some(reason));
        // Nothing of a failed VM keeps running or holds the network.
        if let Some(pid) = st.pid {
            common::wait_until("failed VM process gone", Duration::from_secs(5), || {
                imp_runtime::procfs::start_time(pid).is_none_or(|_| {
                    !imp_runtime::procfs::cmdline(pid)
                        .iter()
                        .any(|a| a.contains(uid))
                })
            })
            .await;
        }
        assert!(!imp_runtime::tap::exists(&h.tap_for(uid)).unwrap());
        // A repeated PUT reports the recorded failure and starts nothing.
        let e2 = h.client.ensure_running(uid, &spec).await.unwrap_err();
        assert_eq!(e2.reason(), Some(reason));
        assert!(
            h.vmm_processes().is_empty(),
            "{uid}: {:?}",
            h.vmm_processes()
        );
    }
    let m = h.metrics().await;
    for reason in [
        reason::KERNEL_MISSING,
        reason::FIRECRACKER_START_FAILED,
        reason::GUEST_PANICKED,
        reason::GUEST_EXITED,
        reason::GUEST_AGENT_TIMEOUT,
    ] {
        assert!(
            m.contains(&format!(
                "imp_vm_start_failures_total{{reason=\"{reason}\"}} 1"
            )),
            "{reason}: {m}"
        );
    }
    assert!(m.contains("imp_runtime_vms{state=\"Failed\"} 5"), "{m}");
    for uid in ["nokernel", "crash", "panic", "hang", "resets"] {
        h.client.delete(uid).await.unwrap();
    }
    assert_eq!(std::fs::read_dir(h.vms_dir()).unwrap().count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_kills_a_guest_that_ignores_ctrl_alt_del() {
    let mut h = Harness::new(simulator());
    h.knobs(
        "stubborn",
        Knobs {
            ignore_ctrl_alt_del: true,
            ..Knobs::default()
        },
    );
    h.knobs("polite", Knobs::default());
    h.start_runtime().await;
    for uid in ["stubborn", "polite"] {
        let st = h
            .client
            .ensure_running(uid, &h.spec(false))
            .await
            .unwrap()
            .1;
        let pid = st.pid.unwrap();
        let start = imp_runtime::procfs::start_time(pid).unwrap();
        let serial = st.serial_log.clone();
        let t0 = std::time::Instant::now();
        h.client.delete(uid).await.unwrap();
        let took = t0.elapsed();
        assert!(!alive(pid, start));
        assert!(!serial.exists());
        if uid == "stubborn" {
            // IMP_STOP_TIMEOUT=2s, then SIGKILL.
            assert!(took >= Duration::from_secs(2), "{took:?}");
        } else {
            assert!(
                took < Duration::from_secs(2),
                "a guest that resets stops without the kill: {took:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_powers_off_is_reported_exited() {
    for backend in backends("a_guest_that_powers_off_is_reported_exited") {
        let mut h = Harness::new(backend);
        h.start_runtime().await;
        let st = h
            .client
            .ensure_running("off", &h.spec(false))
            .await
            .unwrap()
            .1;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut guest = imp_guest::host::connect(
            &st.vsock_path,
            imp_guest::protocol::AGENT_VSOCK_PORT,
            deadline,
        )
        .await
        .unwrap();
        guest.shutdown().await.unwrap();
        let t0 = std::time::Instant::now();
        loop {
            if h.client.inspect("off").await.unwrap().state == VmState::Exited {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "VM not reported Exited after poweroff"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            h.client.linkstats("off").await.unwrap_err().reason(),
            Some(reason::NOT_RUNNING)
        );
        // PUT does not resurrect an exited (ephemeral) VM.
        let (code, again) = h
            .client
            .ensure_running("off", &h.spec(false))
            .await
            .unwrap();
        assert_eq!((code, again.state), (StatusCode::OK, VmState::Exited));
        assert!(h.vmm_processes().is_empty());
        h.client.delete("off").await.unwrap();
        assert!(!h.vms_dir().join("off").exists());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_of_one_uid_start_one_vm() {
    let mut h = Harness::new(simulator());
    h.knobs(
        "racy",
        Knobs {
            boot_delay_ms: 300,
            ..Knobs::default()
        },
    );
    h.start_runtime().await;
    let spec = h.spec(false);
    let puts: Vec<_> = (0..8)
        .map(|_| {
            let (c, s) = (h.client.clone(), spec.clone());
            tokio::spawn(async move { c.ensure_running("racy", &s).await.unwrap() })
        })
        .collect();
    let mut created = 0;
    for p in puts {
        let (code, st) = p.await.unwrap();
        if code == StatusCode::CREATED {
            created += 1;
            assert_eq!(st.state, VmState::Running);
        } else {
            // Later PUTs report the bring-up's progress instead of waiting for it.
            assert_eq!(code, StatusCode::OK);
            assert!(
                matches!(
                    st.state,
                    VmState::Creating | VmState::Booting | VmState::Running
                ),
                "{st:?}"
            );
        }
    }
    assert_eq!(created, 1, "exactly one PUT creates");
    assert_eq!(h.vmm_processes().len(), 1, "one process for all PUTs");
    let (code, st) = h.client.ensure_running("racy", &spec).await.unwrap();
    assert_eq!((code, st.state), (StatusCode::OK, VmState::Running));
    h.client.delete("racy").await.unwrap();
}
