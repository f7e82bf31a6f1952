//! imp-runtime under requests it must refuse or survive, through its socket API with the
//! Firecracker simulator: host paths outside the image directories, oversize bodies, bad uids,
//! writable drives past the node's budget, a client that goes away mid-start, a DELETE during
//! a start.

mod common;

use std::time::{Duration, Instant};

use common::{Harness, simulator};
use http::{Method, StatusCode};
use imp_api::names::reason;
use imp_runtime::api::VmState;
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
        assert_eq!(b["error"], reason::INVALID_SPEC, "{b}");
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
        assert_eq!(b["error"], reason::INVALID_UID);
    }
    // Oversize: refused before it is read whole. The server may answer and close while the
    // body is still being sent, so the body goes from a task of its own and only the answer
    // is awaited.
    let huge = with("extra_boot_args", "x".repeat(1 << 20).into()).to_string();
    let (status, b) = oversize_put(&h, "hostile", huge).await;
    assert_eq!(status, 413, "{b}");
    assert_eq!(
        (&b["error"], &b["field"]),
        (&reason::BODY_TOO_LARGE.into(), &"body".into())
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
    let imp_runtime::client::ClientError::Api { status, body } = &e else {
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
    let start = imp_runtime::procfs::start_time(pid).unwrap();
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

/// A proxy in front of a registry: forwards every request (one per connection) except, while
/// `stall` is set, blob GETs, which it holds open without an answer (a registry that stalls
/// mid-pull, after the manifest).
async fn stalling_proxy(
    upstream: String,
    stall: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let host = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let (upstream, stall) = (upstream.clone(), stall.clone());
            tokio::spawn(async move {
                let mut client = tokio::io::BufReader::new(client);
                let mut head = Vec::new();
                loop {
                    let mut line = String::new();
                    if client.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let end = line == "\r\n";
                    // One request per connection: the client may not reuse it.
                    if !line.to_ascii_lowercase().starts_with("connection:") && !end {
                        head.push(line);
                    }
                    if end {
                        break;
                    }
                }
                if head[0].contains("/blobs/") && stall.load(std::sync::atomic::Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                head.push("Connection: close\r\n\r\n".into());
                let Ok(mut up) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = up.write_all(head.concat().as_bytes()).await;
                let _ = tokio::io::copy(&mut up, client.get_mut()).await;
            });
        }
    });
    (host, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_dropped_mid_pull_then_deleted_leaves_nothing_and_a_clean_cache() {
    use imp_runtime::rootfs::store::ImageSpec;
    use imp_testkit::registry::{Registry, RegistryOptions};
    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let layer = imp_testkit::tarball::TarBuilder::new()
        .dir("etc", 0o755)
        .file("etc/stalled", b"eventually\n", 0o644)
        .into_gzip();
    imp_testkit::oci::push_gzip_image(&registry.host(), "imp/stall:1", vec![layer]).await;
    let stall = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (proxy, proxy_task) = stalling_proxy(registry.host(), stall.clone()).await;

    let mut h = Harness::new(simulator());
    h.extra_env
        .push(("IMP_INSECURE_REGISTRIES".into(), proxy.clone()));
    h.extra_env
        .push(("IMP_NODE_LOCAL_REGISTRIES".into(), proxy.clone()));
    h.start_runtime().await;
    let network = common::is_root();
    let spec = imp_runtime::api::VmSpec {
        base_disk: None,
        image: Some(ImageSpec {
            base: format!("{proxy}/imp/stall:1"),
            runner: None,
            credentials: None,
            pull_policy: None,
        }),
        ..h.spec(network)
    };
    let tmp = h.state_dir.join("rootfs/tmp");
    let entries = |d: &std::path::Path| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(d)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    };

    let c = h.client.clone();
    let s = spec.clone();
    let put = tokio::spawn(async move { c.ensure_running("stalled", &s).await });
    let deadline = Instant::now() + Duration::from_secs(20);
    while entries(&tmp).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the pull never reached its layers\n{}",
            h.runtime_log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The client goes away mid-pull; the bring-up carries on (still stalled).
    put.abort();
    let _ = put.await;
    let (code, st) = h.client.ensure_running("stalled", &spec).await.unwrap();
    assert_eq!(
        (code, st.state),
        (StatusCode::OK, VmState::Creating),
        "progress"
    );
    h.client.delete("stalled").await.unwrap();

    assert!(h.client.inspect("stalled").await.is_err(), "no row");
    assert!(h.vmm_processes().is_empty(), "no process");
    assert!(!h.vms_dir().join("stalled").exists(), "no VM files");
    assert!(
        !imp_runtime::tap::exists(&h.tap_for("stalled")).unwrap(),
        "no TAP"
    );
    assert_eq!(
        entries(&tmp),
        Vec::<std::path::PathBuf>::new(),
        "tmp/ is empty"
    );
    let images = h.state_dir.join("rootfs/images");
    assert!(
        entries(&images).is_empty(),
        "no half-built image in the cache"
    );

    // The registry recovers: the next start builds a clean image from scratch.
    stall.store(false, std::sync::atomic::Ordering::SeqCst);
    let (code, st) = h.client.ensure_running("stalled", &spec).await.unwrap();
    assert_eq!((code, st.state), (StatusCode::CREATED, VmState::Running));
    let built = entries(&images);
    assert_eq!(built.len(), 1, "{built:?}");
    imp_testkit::ext4::assert_fsck_clean(&built[0]);
    assert!(
        entries(&tmp).is_empty(),
        "a finished build leaves no work dir"
    );
    h.client.delete("stalled").await.unwrap();
    proxy_task.abort();
}

/// What the VMM itself logs (the simulator's API log, as Firecracker's logger words it).
fn vmm_lines(text: &str, uid: &str) -> Vec<String> {
    text.lines()
        .filter(|l| {
            l.contains(&format!("[{uid}:"))
                || l.contains("The API server received")
                || l.contains("Running Firecracker")
        })
        .map(String::from)
        .collect()
}

/// Firecracker's own log goes to `firecracker.log` (`--log-path`): `serial.log` and a failure's
/// serial tail hold the guest's console lines and none of the VMM's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_log_and_failure_tails_quote_the_guest_not_the_vmm() {
    let mut h = Harness::new(simulator());
    h.knobs(
        "panics",
        Knobs {
            boot_delay_ms: 100,
            panic_text: Some("Kernel panic - not syncing: Attempted to kill init!".into()),
            ..Knobs::default()
        },
    );
    h.start_runtime().await;
    let spec = h.spec(false);

    let st = h.client.ensure_running("boots", &spec).await.unwrap();
    assert_eq!(st.1.state, VmState::Running);
    let dir = h.vms_dir().join("boots");
    let serial = std::fs::read_to_string(dir.join("serial.log")).unwrap();
    assert!(serial.contains("Linux version"), "{serial}");
    assert!(serial.contains("imp-guest: agent started"), "{serial}");
    assert_eq!(
        vmm_lines(&serial, "boots"),
        Vec::<String>::new(),
        "{serial}"
    );
    let vmm_log =
        std::fs::read_to_string(dir.join("firecracker.log")).expect("the VMM log file exists");
    assert!(
        vmm_log.contains("[boots:main] Running Firecracker"),
        "{vmm_log}"
    );
    assert!(
        vmm_log.contains(r#"received a Put request on "/boot-source""#),
        "{vmm_log}"
    );
    assert!(!vmm_log.contains("Linux version"), "{vmm_log}");

    let e = h.client.ensure_running("panics", &spec).await.unwrap_err();
    assert_eq!(e.reason(), Some(reason::GUEST_PANICKED), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("Kernel panic - not syncing"), "{msg}");
    assert!(
        msg.contains("Linux version"),
        "the tail quotes the boot: {msg}"
    );
    assert_eq!(vmm_lines(&msg, "panics"), Vec::<String>::new(), "{msg}");
    let st = h.client.inspect("panics").await.unwrap();
    let recorded = st.failure.expect("a failure").message;
    assert_eq!(
        vmm_lines(&recorded, "panics"),
        Vec::<String>::new(),
        "{recorded}"
    );
    assert!(recorded.contains("Kernel panic"), "{recorded}");

    for uid in ["boots", "panics"] {
        h.client.delete(uid).await.unwrap();
    }
    assert_eq!(std::fs::read_dir(h.vms_dir()).unwrap().count(), 0);
}

/// A guest flooding its console (`yes > /dev/ttyS0`) at 128 KiB/s for longer than its cap
/// lasts: `serial.log` plus `serial.log.1` stay within the cap plus what the flood writes
/// between two of the runtime's checks (1 s; two allowed for a loaded machine), and the failure
/// reason still quotes the newest console bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_guest_keeps_its_serial_log_under_the_cap() {
    const CAP: u64 = 512 << 10;
    const RATE: u64 = 128 << 10;
    let mut h = Harness::new(simulator());
    h.boot_timeout_secs = 10.0;
    h.extra_env
        .push(("IMP_SERIAL_LOG_CAP_BYTES".into(), CAP.to_string()));
    h.knobs(
        "floods",
        Knobs {
            hang: true,
            serial_flood_bytes_per_sec: RATE,
            ..Knobs::default()
        },
    );
    h.start_runtime().await;
    let spec = h.spec(false);
    let client = h.client.clone();
    let put = tokio::spawn(async move { client.ensure_running("floods", &spec).await });
    let log = h.vms_dir().join("floods").join("serial.log");
    let rotated = h.vms_dir().join("floods").join("serial.log.1");
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let (mut peak, mut samples) = (0, 0);
    while !put.is_finished() {
        let total = size(&log) + size(&rotated);
        peak = peak.max(total);
        samples += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let e = put.await.unwrap().unwrap_err();
    assert_eq!(e.reason(), Some(reason::GUEST_AGENT_TIMEOUT), "{e}");
    // The flood wrote about 10 s x 128 KiB = 1.25 MiB, more than twice the cap.
    assert!(rotated.exists(), "the log was never rotated");
    let bound = CAP + 2 * RATE;
    println!("serial log peak {peak} bytes over {samples} samples (cap {CAP}, bound {bound})");
    assert!(
        peak <= bound,
        "serial log peaked at {peak} bytes, cap {CAP}"
    );
    assert!(
        e.to_string().contains("yyyyyyyy"),
        "the tail quotes the flood: {e}"
    );
    h.client.delete("floods").await.unwrap();
    assert!(!log.exists() && !rotated.exists());
}
