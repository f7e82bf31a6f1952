//! The real path: boot imp-guest as PID 1 in real Firecracker. Runs only when
//! IMP_FIRECRACKER_BIN (firecracker binary), IMP_KERNEL (uncompressed guest kernel with
//! virtio-blk, vsock, ext4 and overlayfs built in) and IMP_GUEST_STATIC_BIN (the output of
//! guest/check-static.sh) are set. Otherwise it says it skipped, or fails under
//! IMP_REQUIRE_FIRECRACKER=1 (imp_testkit::firecracker::real_or_skip).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use imp_common::SecretString;
use imp_guest::host;
use imp_guest::protocol::HttpProbe;
use imp_testkit::firecracker::{Needs, real_or_skip};
use tokio::time::Instant;

const SECRET: &str = "jit-7e1d-fc-real-path-secret";

fn mkfs(image: &Path, size_mib: u64) {
    let f = std::fs::File::create(image).unwrap();
    f.set_len(size_mib * 1024 * 1024).unwrap();
    let mut cmd = Command::new("mkfs.ext4");
    cmd.args(["-q", "-F"]);
    assert!(
        cmd.arg(image).status().unwrap().success(),
        "mkfs.ext4 failed"
    );
}

struct Vm(std::process::Child);

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn boots_as_pid1_in_real_firecracker() {
    // tests/qemu.rs boots the same PID 1 + agent in QEMU with hybrid vsock; tests/pid1.rs and
    // tests/agent.rs cover the pieces.
    let Some(real) = real_or_skip("boots_as_pid1_in_real_firecracker", Needs::GuestBinary) else {
        return;
    };
    let (fc, kernel) = (&real.firecracker, &real.kernel);
    let dir = tempfile::tempdir().unwrap();

    // Base image: nothing but imp-guest and the mount points it needs.
    let base_img = real.base_drive();
    let rw_img = dir.path().join("rw.ext4");
    mkfs(&rw_img, 64);

    let uds = dir.path().join("vsock.sock");
    let config = serde_json::json!({
        "boot-source": {
            "kernel_image_path": kernel,
            // root=/dev/vda ro is added by Firecracker for the read-only root drive.
            "boot_args": "console=ttyS0 reboot=k panic=1 pci=off init=/sbin/imp-guest \
                          imp.overlay=/dev/vdb imp.hostname=imp-fc-test imp.dns=192.0.2.53 imp.halt=reboot"
        },
        "drives": [
            {"drive_id": "base", "path_on_host": base_img, "is_root_device": true, "is_read_only": true},
            {"drive_id": "rw", "path_on_host": rw_img, "is_root_device": false, "is_read_only": false}
        ],
        "machine-config": {"vcpu_count": 1, "mem_size_mib": 256},
        "vsock": {"guest_cid": 3, "uds_path": uds}
    });
    let config_path = dir.path().join("vm.json");
    std::fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    let console = dir.path().join("console.log");
    let mut vm = Vm(Command::new(fc)
        .arg("--no-api")
        .arg("--config-file")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&console).unwrap())
        .stderr(std::fs::File::create(dir.path().join("firecracker.log")).unwrap())
        .spawn()
        .unwrap());

    let console_text = || std::fs::read_to_string(&console).unwrap_or_default();
    let mut client =
        match host::connect(&uds, 10000, Instant::now() + Duration::from_secs(60)).await {
            Ok(c) => c,
            Err(e) => panic!(
                "no Hello from the guest: {e}\n--- console ---\n{}",
                console_text()
            ),
        };
    assert_eq!(
        client.hello().protocol,
        imp_guest::protocol::PROTOCOL_VERSION
    );

    let m = client.metrics().await.unwrap();
    assert!(m.memory_total_bytes > 100 * 1024 * 1024 && m.disk_total_bytes > 0);
    // lo is up (connection refused, not unreachable) and the probe reports it.
    let r = client
        .probe(HttpProbe {
            path: "/".into(),
            port: 1,
            timeout_ms: 1000,
        })
        .await
        .unwrap();
    assert_eq!(r.status, None);
    assert!(r.error.unwrap().contains("refused"));

    // Not PID 1 and no subcommand: imp-guest exits 2. Env carries a secret.
    let mut req = common::exec("not-pid1", &["/sbin/imp-guest"]);
    req.env.insert(
        "ACTIONS_RUNNER_INPUT_JITCONFIG".into(),
        SecretString::from(SECRET),
    );
    client.exec(req).await.unwrap();
    assert_eq!(client.wait_exited("not-pid1").await.unwrap().code, Some(2));

    // The workload: exits 0, the exit is reported, the VM ends and Firecracker exits.
    let mut req = common::exec("runner", &["/sbin/imp-guest", "--version"]);
    req.poweroff_on_exit = true;
    client.exec(req).await.unwrap();
    assert_eq!(client.wait_exited("runner").await.unwrap().code, Some(0));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while vm.0.try_wait().unwrap().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "VM did not end\n{}",
            console_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let text = console_text();
    for stage in [
        "mount-early ok",
        "cmdline ok",
        "overlay-root ok",
        "hostname ok",
        "resolv-conf ok",
        "ready",
    ] {
        assert!(
            text.contains(&format!("IMP-GUEST stage={stage}")),
            "missing {stage}:\n{text}"
        );
    }
    assert!(!text.contains(SECRET), "secret on the serial console");
}
