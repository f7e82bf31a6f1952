//! The simulator's API in-process: validation, pre-boot-only resources, state, pause and
//! snapshot. (Booting a guest agent is covered by imp-node's runtime tests.)

use std::path::{Path, PathBuf};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use super::sim::{self, Knobs, Options};

/// One request to a VMM's API socket: the status and the JSON body (Null when there is none).
pub(super) async fn call(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let stream = tokio::net::UnixStream::connect(sock)
        .await
        .expect("connect");
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = tx.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn start_sim(dir: &Path, knobs: Knobs) -> PathBuf {
    let sock = dir.join("api.sock");
    let opts = Options {
        id: "vm-1".into(),
        api_sock: Some(sock.clone()),
        config_file: None,
        knobs,
        guest_bin: PathBuf::from("/nonexistent/imp-guest"),
        ..Options::default()
    };
    tokio::spawn(sim::run(opts));
    for _ in 0..200 {
        if sock.exists() {
            return sock;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("simulator API socket did not appear");
}

fn fault(v: &Value) -> &str {
    v["fault_message"]
        .as_str()
        .expect("400 bodies carry fault_message")
}

#[tokio::test]
async fn api_validates_like_firecracker_and_enforces_pre_boot_only() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("vmlinux");
    let disk = dir.path().join("rootfs.ext4");
    std::fs::write(&kernel, b"kernel").unwrap();
    std::fs::write(&disk, b"disk").unwrap();
    // hang: no guest agent is needed for API behaviour.
    let sock = start_sim(
        dir.path(),
        Knobs {
            hang: true,
            ..Knobs::default()
        },
    )
    .await;

    let (s, v) = call(&sock, "GET", "/", None).await;
    assert_eq!(
        (s, v["state"].as_str(), v["id"].as_str()),
        (200, Some("Not started"), Some("vm-1"))
    );

    let (s, v) = call(
        &sock,
        "PUT",
        "/boot-source",
        Some(json!({"boot_args": "x"})),
    )
    .await;
    assert_eq!(s, 400);
    assert!(fault(&v).contains("kernel_image_path"), "{v}");
    let (s, v) = call(
        &sock,
        "PUT",
        "/boot-source",
        Some(json!({"kernel_image_path": "/nonexistent"})),
    )
    .await;
    assert_eq!(s, 400);
    assert!(fault(&v).contains("kernel"), "{v}");
    let (s, v) = call(
        &sock,
        "PUT",
        "/boot-source",
        Some(json!({"kernel_image_path": kernel, "bogus": 1})),
    )
    .await;
    assert_eq!(s, 400);
    assert!(fault(&v).contains("bogus"), "{v}");
    let (s, v) = call(&sock, "PUT", "/nope", Some(json!({}))).await;
    assert_eq!(s, 400);
    assert!(
        fault(&v).contains("Invalid request method and/or path"),
        "{v}"
    );
    let (s, _) = call(&sock, "DELETE", "/vsock", None).await;
    assert_eq!(s, 400);

    let (s, v) = call(
        &sock,
        "PUT",
        "/actions",
        Some(json!({"action_type": "InstanceStart"})),
    )
    .await;
    assert_eq!(s, 400, "no boot source yet: {v}");

    let (s, v) = call(
        &sock,
        "PUT",
        "/machine-config",
        Some(json!({"vcpu_count": 3, "mem_size_mib": 128})),
    )
    .await;
    assert_eq!(s, 400, "odd vcpu count: {v}");
    let (s, _) = call(
        &sock,
        "PUT",
        "/machine-config",
        Some(json!({"vcpu_count": 2, "mem_size_mib": 256})),
    )
    .await;
    assert_eq!(s, 204);
    let (s, v) = call(&sock, "GET", "/machine-config", None).await;
    assert_eq!((s, v["mem_size_mib"].as_u64()), (200, Some(256)));
    let (s, _) = call(
        &sock,
        "PUT",
        "/boot-source",
        Some(json!({"kernel_image_path": kernel, "boot_args": "console=ttyS0"})),
    )
    .await;
    assert_eq!(s, 204);
    let drive = json!({"drive_id": "rootfs", "is_root_device": true, "is_read_only": true, "path_on_host": disk});
    let (s, v) = call(&sock, "PUT", "/drives/other", Some(drive.clone())).await;
    assert_eq!(s, 400);
    assert!(fault(&v).contains("does not match"), "{v}");
    let (s, _) = call(&sock, "PUT", "/drives/rootfs", Some(drive)).await;
    assert_eq!(s, 204);
    let second_root = json!({"drive_id": "b", "is_root_device": true, "path_on_host": disk});
    assert_eq!(
        call(&sock, "PUT", "/drives/b", Some(second_root)).await.0,
        400
    );
    let (s, _) = call(
        &sock,
        "PUT",
        "/vsock",
        Some(json!({"guest_cid": 2, "uds_path": dir.path().join("v.sock")})),
    )
    .await;
    assert_eq!(s, 400, "CID 2 is the host");
    let (s, _) = call(
        &sock,
        "PUT",
        "/vsock",
        Some(json!({"guest_cid": 3, "uds_path": dir.path().join("v.sock")})),
    )
    .await;
    assert_eq!(s, 204);
    assert!(
        dir.path().join("v.sock").exists(),
        "uds_path is bound when configured"
    );

    assert_eq!(
        call(&sock, "PATCH", "/vm", Some(json!({"state": "Paused"})))
            .await
            .0,
        400,
        "not started"
    );
    let (s, _) = call(
        &sock,
        "PUT",
        "/actions",
        Some(json!({"action_type": "InstanceStart"})),
    )
    .await;
    assert_eq!(s, 204);
    assert_eq!(call(&sock, "GET", "/", None).await.1["state"], "Running");
    let (s, v) = call(
        &sock,
        "PUT",
        "/boot-source",
        Some(json!({"kernel_image_path": kernel})),
    )
    .await;
    assert_eq!(s, 400);
    assert!(fault(&v).contains("not supported after starting"), "{v}");
    assert_eq!(
        call(
            &sock,
            "PUT",
            "/actions",
            Some(json!({"action_type": "InstanceStart"}))
        )
        .await
        .0,
        400
    );

    let snap = dir.path().join("snap");
    let mem = dir.path().join("mem");
    let create = json!({"snapshot_path": snap, "mem_file_path": mem});
    assert_eq!(
        call(&sock, "PUT", "/snapshot/create", Some(create.clone()))
            .await
            .0,
        400,
        "must be paused"
    );
    assert_eq!(
        call(&sock, "PATCH", "/vm", Some(json!({"state": "Paused"})))
            .await
            .0,
        204
    );
    assert_eq!(call(&sock, "GET", "/", None).await.1["state"], "Paused");
    assert_eq!(
        call(&sock, "PUT", "/snapshot/create", Some(create)).await.0,
        204
    );
    assert_eq!(std::fs::metadata(&mem).unwrap().len(), 256 << 20);
    let saved: Value = serde_json::from_slice(&std::fs::read(&snap).unwrap()).unwrap();
    assert_eq!(saved["machine-config"]["vcpu_count"], 2);
    assert_eq!(
        call(&sock, "PATCH", "/vm", Some(json!({"state": "Resumed"})))
            .await
            .0,
        204
    );
    assert_eq!(
        call(&sock, "PATCH", "/vm", Some(json!({"state": "Sleeping"})))
            .await
            .0,
        400
    );
}

#[tokio::test]
async fn crash_at_start_never_binds_the_api_socket() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Options {
        id: "vm-2".into(),
        api_sock: Some(dir.path().join("api.sock")),
        config_file: None,
        knobs: Knobs {
            crash_at_start: true,
            ..Knobs::default()
        },
        guest_bin: PathBuf::from("/nonexistent"),
        ..Options::default()
    };
    let err = sim::run(opts).await.unwrap_err();
    assert!(err.contains("crash"), "{err}");
    assert!(!dir.path().join("api.sock").exists());
}

/// `--no-api --config-file`: boots from Firecracker's full-configuration JSON; the guest agent
/// answers Hello through the hybrid vsock, and dies with the simulator.
#[tokio::test]
async fn config_file_boot_without_api_reaches_the_guest_agent() {
    let bins = super::binaries();
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("vmlinux");
    let disk = dir.path().join("rootfs.ext4");
    std::fs::write(&kernel, b"kernel").unwrap();
    std::fs::write(&disk, b"disk").unwrap();
    let uds = dir.path().join("v.sock");
    let config = json!({
        "boot-source": {"kernel_image_path": kernel, "boot_args": "console=ttyS0"},
        "drives": [{"drive_id": "rootfs", "is_root_device": true, "is_read_only": true, "path_on_host": disk}],
        "machine-config": {"vcpu_count": 1, "mem_size_mib": 128},
        "vsock": {"guest_cid": 3, "uds_path": uds},
    });
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, config.to_string()).unwrap();
    let serial = dir.path().join("serial.log");
    let mut child = std::process::Command::new(&bins.simulator)
        .args(["--no-api", "--id", "cfg-vm", "--config-file"])
        .arg(&cfg)
        .env("IMP_GUEST_BIN", &bins.guest)
        .env_remove("IMP_SIM_BEHAVIOUR")
        .stdout(std::fs::File::create(&serial).unwrap())
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(15);
    let guest = imp_guest::host::connect(&uds, 10000, deadline).await;
    let log = std::fs::read_to_string(&serial).unwrap_or_default();
    let guest = guest.unwrap_or_else(|e| panic!("{e}; serial: {log}"));
    assert_eq!(
        guest.hello().protocol,
        imp_guest::protocol::PROTOCOL_VERSION
    );
    assert!(log.contains("Command line: console=ttyS0"), "{log}");
    assert!(!dir.path().join("api.sock").exists());
    let agent_sock = PathBuf::from(format!("{}.agent", uds.display()));
    assert!(agent_sock.exists());
    drop(guest);

    child.kill().unwrap();
    child.wait().unwrap();
    // The agent has the simulator as its VMM: it goes with it (parent-death signal).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        if tokio::net::UnixStream::connect(&agent_sock).await.is_err() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "guest agent outlived the simulator"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Firecracker's own log: on stdout (into the console) by default; with `--log-path` in that
/// file only, which must exist beforehand; `PUT /logger` is validated against the spec and
/// refused after boot.
#[tokio::test]
async fn the_vmm_log_goes_to_its_own_file_and_never_to_the_console() {
    let bins = super::binaries();
    let dir = tempfile::tempdir().unwrap();
    let run = |log_path: Option<&Path>| {
        let sock = dir.path().join("api.sock");
        let _ = std::fs::remove_file(&sock);
        let console = dir.path().join("console.log");
        let mut cmd = std::process::Command::new(&bins.simulator);
        cmd.args(["--id", "log-vm", "--api-sock"])
            .arg(&sock)
            .env("IMP_GUEST_BIN", &bins.guest)
            .env_remove("IMP_SIM_BEHAVIOUR")
            .stdout(std::fs::File::create(&console).unwrap())
            .stderr(std::process::Stdio::piped());
        if let Some(p) = log_path {
            cmd.arg("--log-path").arg(p).args(["--level", "info"]);
        }
        (cmd.spawn().unwrap(), sock, console)
    };
    let wait_sock = |sock: PathBuf| async move {
        for _ in 0..400 {
            if sock.exists() {
                return sock;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("simulator API socket did not appear");
    };

    // A missing log file: refused at start, as Firecracker does.
    let missing = dir.path().join("missing.log");
    let (child, _, _) = run(Some(&missing));
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing.log"), "{err}");
    assert!(!missing.exists(), "Firecracker never creates its log file");

    // Default: the VMM's lines land in the console.
    let (mut child, sock, console) = run(None);
    let sock = wait_sock(sock).await;
    let (s, _) = call(&sock, "GET", "/", None).await;
    assert_eq!(s, 200);
    child.kill().unwrap();
    child.wait().unwrap();
    let text = std::fs::read_to_string(&console).unwrap();
    assert!(text.contains("[log-vm:main] Running Firecracker"), "{text}");
    assert!(
        text.contains("The API server received a Get request"),
        "{text}"
    );

    // --log-path: the console holds none of them; the file holds all of them.
    let log = dir.path().join("firecracker.log");
    std::fs::File::create(&log).unwrap();
    let (mut child, sock, console) = run(Some(&log));
    let sock = wait_sock(sock).await;
    let (s, b) = call(&sock, "PUT", "/logger", Some(json!({"level": "Loud"}))).await;
    assert_eq!(s, 400, "{b}");
    assert!(fault(&b).contains("Loud"), "{b}");
    let (s, b) = call(&sock, "PUT", "/logger", Some(json!({"colour": true}))).await;
    assert_eq!(s, 400, "{b}");
    let (s, b) = call(
        &sock,
        "PUT",
        "/logger",
        Some(json!({"level": "DEBUG", "show_level": true})),
    )
    .await;
    assert_eq!(s, 204, "{b}");
    let (s, _) = call(&sock, "GET", "/machine-config", None).await;
    assert_eq!(s, 200);
    child.kill().unwrap();
    child.wait().unwrap();
    let text = std::fs::read_to_string(&console).unwrap();
    assert!(
        !text.contains("[log-vm:"),
        "VMM lines in the console: {text}"
    );
    let vmm = std::fs::read_to_string(&log).unwrap();
    assert!(vmm.contains("[log-vm:main] Running Firecracker"), "{vmm}");
    assert!(
        vmm.contains(r#"received a Put request on "/logger""#),
        "{vmm}"
    );
    assert!(
        vmm.contains("[log-vm:fc_api:DEBUG] The request was executed successfully"),
        "{vmm}"
    );
    assert!(vmm.contains("Received Error. Status code: 400"), "{vmm}");
}

/// The `hold_started_while` relay passes frames through and holds a `started` answer exactly
/// while its hold file exists.
#[tokio::test]
async fn the_relay_holds_started_answers_while_the_hold_file_exists() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    fn frame(v: Value) -> Vec<u8> {
        let body = v.to_string().into_bytes();
        let mut f = (body.len() as u32).to_be_bytes().to_vec();
        f.extend(body);
        f
    }
    let dir = tempfile::tempdir().unwrap();
    let hold = dir.path().join("hold");
    std::fs::write(&hold, b"").unwrap();
    let (mut guest, guest_end) = tokio::io::duplex(4096);
    let (host_end, mut host) = tokio::io::duplex(4096);
    let relay_hold = hold.clone();
    tokio::spawn(async move {
        let (mut from, mut to) = (guest_end, host_end);
        let _ = sim::relay_frames(&mut from, &mut to, &relay_hold).await;
    });
    let hello = frame(json!({"type": "hello", "version": 1}));
    let started = frame(json!({"type": "started", "id": "x", "pid": 7}));
    guest.write_all(&hello).await.unwrap();
    guest.write_all(&started).await.unwrap();
    let mut got = vec![0u8; hello.len()];
    host.read_exact(&mut got).await.unwrap();
    assert_eq!(got, hello, "frames before the started answer pass at once");
    let mut byte = [0u8; 1];
    let held =
        tokio::time::timeout(std::time::Duration::from_millis(400), host.read(&mut byte)).await;
    assert!(
        held.is_err(),
        "the started answer is held while the file exists"
    );
    std::fs::remove_file(&hold).unwrap();
    let mut got = vec![0u8; started.len()];
    tokio::time::timeout(std::time::Duration::from_secs(5), host.read_exact(&mut got))
        .await
        .expect("released once the file is gone")
        .unwrap();
    assert_eq!(got, started);
}

/// `reidentify` in the IMP_SIM_BEHAVIOUR file (per VM id) and as the flag's value.
#[test]
fn the_reidentify_knob_reads_from_the_behaviour_file_and_the_flag() {
    let k: Knobs = serde_json::from_value(json!({"reidentify": "hang"})).unwrap();
    assert_eq!(k.reidentify, sim::ReidentifyKnob::Hang);
    let k: Knobs = serde_json::from_value(json!({})).unwrap();
    assert_eq!(k.reidentify, sim::ReidentifyKnob::Answer);
    assert!(serde_json::from_value::<Knobs>(json!({"reidentify": "sometimes"})).is_err());
    assert_eq!(
        "refuse".parse::<sim::ReidentifyKnob>(),
        Ok(sim::ReidentifyKnob::Refuse)
    );
    assert!("Refuse".parse::<sim::ReidentifyKnob>().is_err());
}
