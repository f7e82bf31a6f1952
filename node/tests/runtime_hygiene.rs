//! imp-runtime under requests it must refuse or survive, through its socket API with the
//! Firecracker simulator: host paths outside the image directories, oversize bodies, bad uids,
//! writable drives past the node's budget, a client that goes away mid-start, a DELETE during
//! a start.

mod common;

use std::time::{Duration, Instant};

use common::{Harness, simulator};
use http::{Method, StatusCode};
use imp_node::api::VmState;
use imp_testkit::firecracker::Knobs;

async fn put_raw(h: &Harness, uid: &str, body: Vec<u8>) -> (StatusCode, serde_json::Value) {
    let (s, b) = h
        .client
        .request(Method::PUT, &format!("/v1/vms/{uid}"), Some(body))
        .await
        .unwrap();
    let v = serde_json::from_slice(&b).unwrap_or_else(|e| {
        panic!(
            "{s}: undecodable body {:?}: {e}",
            String::from_utf8_lossy(&b)
        )
    });
    (s, v)
}

/// A PUT whose body is written concurrently with reading the answer (status, JSON body).
async fn oversize_put(h: &Harness, uid: &str, body: String) -> (u16, serde_json::Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = tokio::net::UnixStream::connect(&h.socket).await.unwrap();
    let (mut r, mut w) = stream.into_split();
    let head = format!(
        "PUT /v1/vms/{uid} HTTP/1.1\r\nHost: imp-runtime\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let writer = tokio::spawn(async move {
        let _ = w.write_all(head.as_bytes()).await;
        let _ = w.write_all(body.as_bytes()).await;
    });
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut answer)).await;
    writer.abort();
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let json = text.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v = serde_json::from_str(json).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    (status, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_are_refused_naming_the_field() {
    let mut h = Harness::new(simulator());
    h.start_runtime().await;
    let spec = serde_json::to_value(h.spec(false)).unwrap();
    // A link inside the image directory that points out of it.
    let link = h.kernel.with_file_name("innocent.img");
    std::os::unix::fs::symlink("/etc/passwd", &link).unwrap();
    let with = |field: &str, value: serde_json::Value| {
        let mut s = spec.clone();
        s[field] = value;
        s
    };
    let cases = [
        ("base_disk", with("base_disk", "/etc/shadow".into())),
        ("kernel", with("kernel", "/etc/passwd".into())),
        ("initrd", with("initrd", "/proc/self/environ".into())),
        (
            "base_disk",
            with("base_disk", link.display().to_string().into()),
        ),
        (
            "base_disk",
            with(
                "base_disk",
                format!(
                    "{}/../../../etc/shadow",
                    h.kernel.parent().unwrap().display()
                )
                .into(),
            ),
        ),
        ("kernel", with("kernel", "vmlinux".into())),
        (
            "kernel",
            with(
                "kernel",
                h.kernel
                    .with_file_name("no-such-vmlinux")
                    .display()
                    .to_string()
                    .into(),
            ),
        ),
        (
            "extra_boot_args",
            with("extra_boot_args", "a\ninit=/bin/sh".into()),
        ),
    ];
    for (field, body) in cases {
        let (s, b) = put_raw(&h, "hostile", body.to_string().into_bytes()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body} -> {b}");
        assert_eq!(b["error"], "InvalidSpec", "{b}");
        assert_eq!(b["field"], field, "{b}");
        assert!(
            b["message"].as_str().unwrap().contains(field),
            "the message names the field: {b}"
        );
    }
    for uid in ["Bad_Uid", "a.b", "-a", &"a".repeat(64)] {
        let (s, b) = put_raw(&h, uid, spec.to_string().into_bytes()).await;
        assert_eq!(
            (s, &b["field"]),
            (StatusCode::BAD_REQUEST, &"uid".into()),
            "{uid}: {b}"
        );
        assert_eq!(b["error"], "InvalidUid");
    }
    // Oversize: refused before it is read whole. The server may answer and close while the
    // body is still being sent, so the body goes from a task of its own and only the answer
    // is awaited.
    let huge = with("extra_boot_args", "x".repeat(1 << 20).into()).to_string();
    let (status, b) = oversize_put(&h, "hostile", huge).await;
    assert_eq!(status, 413, "{b}");
    assert_eq!(
        (&b["error"], &b["field"]),
        (&"BodyTooLarge".into(), &"body".into())
    );

    assert!(
        h.vmm_processes().is_empty(),
        "no hostile request may start a VM"
    );
    assert_eq!(h.client.list().await.unwrap(), vec![], "nor leave a row");
    // The allow-list does not get in the way of the configured paths.
    let (code, st) = h
        .client
        .ensure_running("fine", &h.spec(false))
        .await
        .unwrap();
    assert_eq!((code, st.state), (StatusCode::CREATED, VmState::Running));
    h.client.delete("fine").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writable_drives_past_the_budget_are_refused() {
    let mut h = Harness::new(simulator());
    // The harness's spec asks for 256 MiB: one fits, two do not.
    h.extra_env.push((
        "IMP_WRITABLE_BUDGET_BYTES".into(),
        (400u64 << 20).to_string(),
    ));
    h.start_runtime().await;
    let spec = h.spec(false);
    h.client.ensure_running("first", &spec).await.unwrap();
    let cap = h.client.capacity().await.unwrap();
    assert_eq!(
        (cap.writable_budget_bytes, cap.writable_used_bytes),
        (400 << 20, 256 << 20)
    );
    let e = h.client.ensure_running("second", &spec).await.unwrap_err();
    let imp_node::client::ClientError::Api { status, body } = &e else {
        panic!("{e}");
    };
    assert_eq!(*status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body.error, imp_api::names::reason::DISK_BUDGET_EXCEEDED);
    assert_eq!(body.field.as_deref(), Some("writable_disk_bytes"));
    assert!(
        body.message.contains("268435456 of 419430400"),
        "the reason says what is in use: {}",
        body.message
    );
    assert!(
        h.client.inspect("second").await.is_err(),
        "a refused PUT writes no row"
    );
    h.client.delete("first").await.unwrap();
    let (code, _) = h.client.ensure_running("second", &spec).await.unwrap();
    assert_eq!(
        code,
        StatusCode::CREATED,
        "the budget is free again after DELETE"
    );
    h.client.delete("second").await.unwrap();
}

async fn wait_state(h: &Harness, uid: &str, want: VmState, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(st) = h.client.inspect(uid).await
            && st.state == want
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{uid} never reached {want:?}\n{}",
            h.runtime_log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bring_up_outlives_its_client_and_a_delete_cancels_it() {
    let mut h = Harness::new(simulator());
    h.knobs(
        "dropped",
        Knobs {
            boot_delay_ms: 1500,
            ..Knobs::default()
        },
    );
    h.knobs(
        "stuck",
        Knobs {
            boot_delay_ms: 600_000,
            ..Knobs::default()
        },
    );
    h.start_runtime().await;
    let spec = h.spec(false);

    // The client goes away while the guest boots: the VM comes up anyway.
    let c = h.client.clone();
    let s = spec.clone();
    let put = tokio::spawn(async move { c.ensure_running("dropped", &s).await });
    wait_state(&h, "dropped", VmState::Booting, Duration::from_secs(15)).await;
    put.abort();
    let _ = put.await;
    wait_state(&h, "dropped", VmState::Running, Duration::from_secs(15)).await;
    let (code, st) = h.client.ensure_running("dropped", &spec).await.unwrap();
    assert_eq!((code, st.state), (StatusCode::OK, VmState::Running));
    h.client.delete("dropped").await.unwrap();

    // A start that never ends: a repeated PUT reports where it is, DELETE ends it.
    let c = h.client.clone();
    let s = spec.clone();
    let first = tokio::spawn(async move { c.ensure_running("stuck", &s).await });
    wait_state(&h, "stuck", VmState::Booting, Duration::from_secs(15)).await;
    let t = Instant::now();
    let (code, st) = h.client.ensure_running("stuck", &spec).await.unwrap();
    assert_eq!((code, st.state), (StatusCode::OK, VmState::Booting));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "a repeated PUT does not wait for the boot"
    );
    let pid = st.pid.expect("the process is recorded while booting");
    let start = imp_node::procfs::start_time(pid).unwrap();
    h.client.delete("stuck").await.unwrap();
    assert!(!common::alive(pid, start), "DELETE killed the booting VM");
    let e = first.await.unwrap().unwrap_err();
    assert_eq!(
        e.reason(),
        Some(imp_api::names::reason::START_CANCELLED),
        "{e}"
    );
    assert!(h.client.inspect("stuck").await.is_err(), "no row left");
    assert!(!h.vms_dir().join("stuck").exists(), "no files left");
    assert!(h.vmm_processes().is_empty(), "no process left");
}
