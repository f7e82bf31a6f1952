//! The Firecracker driver's clone restore against the simulator (snapshot standby, issue 32): a
//! template booted, paused, snapshotted and stopped; clones restored from it into fresh VMMs
//! with `Vmm::restore_clone`, each on its own vsock socket and TAP, each answering Hello and
//! taking an identity of its own; a failed restore ends its VMM and says why.

mod common;

use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use common::vmm::{KillOnDrop, boot_source, files, machine};
use imp_api::names::reason;
use imp_guest::host::IdentityCheck;
use imp_runtime::firecracker::api::{InstanceState, NetworkInterface, NetworkOverride, Vsock};
use imp_runtime::firecracker::{self, BootPlan, CloneOverrides};
use imp_testkit::firecracker::reidentify_request;
use tokio::time::Instant;

/// TAPs this test made (`ip tuntap`), deleted when it ends.
#[derive(Default)]
struct Taps(Vec<String>);

impl Taps {
    fn add(&mut self, name: &str) {
        let ok = Command::new("ip")
            .args(["tuntap", "add", "dev", name, "mode", "tap"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "ip tuntap add {name}");
        self.0.push(name.into());
    }
}

impl Drop for Taps {
    fn drop(&mut self) {
        for t in &self.0 {
            let _ = Command::new("ip").args(["link", "del", "dev", t]).status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_restore_from_one_template_on_their_own_socket_and_tap() {
    if !nix::unistd::geteuid().is_root() {
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "clones_restore_from_one_template_on_their_own_socket_and_tap",
            "TAPs and a clone agent's identity need root",
        );
    }
    let common::Backend::Simulator { simulator, guest } = common::simulator() else {
        unreachable!("simulator() is the simulator")
    };
    // SAFETY: the only test in this binary; nothing reads the environment concurrently.
    unsafe { std::env::set_var("IMP_GUEST_BIN", &guest) };
    assert_eq!(
        firecracker::version(&simulator).unwrap(),
        imp_testkit::firecracker::sim::VMM_VERSION
    );
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, b"kernel").unwrap();
    let tag = std::process::id() % 100_000;
    let mut taps = Taps::default();
    let template_tap = format!("impt{tag}");
    taps.add(&template_tap);

    // The template: booted with a NIC, paused, snapshotted, stopped.
    let mut spawned = KillOnDrop::default();
    let t = files(dir.path(), "tpl");
    let vmm = spawned.spawn(&simulator, "tpl", &t).await;
    let plan = BootPlan {
        machine: machine(1, 256),
        boot_source: boot_source(&kernel),
        drives: vec![],
        network: vec![NetworkInterface {
            iface_id: "eth0".into(),
            host_dev_name: template_tap.clone(),
            guest_mac: Some("06:00:0a:00:00:02".into()),
            mtu: None,
        }],
        vsock: Vsock {
            guest_cid: 3,
            uds_path: t.vsock.display().to_string(),
        },
    };
    vmm.configure(&plan).await.unwrap();
    vmm.instance_start().await.unwrap();
    vmm.wait_for_hello(Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    vmm.pause().await.unwrap();
    let (snap, mem) = (dir.path().join("tpl.snap"), dir.path().join("tpl.mem"));
    vmm.snapshot_create(&snap, &mem).await.unwrap();
    vmm.resume().await.unwrap();
    vmm.stop(Duration::from_secs(5)).await;
    assert!(!vmm.is_alive());

    // Three clones, each with its own TAP and vsock socket.
    let mut samples: Vec<Vec<u8>> = Vec::new();
    let mut clones = Vec::new();
    for i in 0..3 {
        let tap = format!("impc{i}x{tag}");
        taps.add(&tap);
        let f = files(dir.path(), &format!("clone{i}"));
        let vmm = spawned.spawn(&simulator, &format!("clone{i}"), &f).await;
        let overrides = CloneOverrides {
            network: vec![NetworkOverride {
                iface_id: "eth0".into(),
                host_dev_name: tap.clone(),
            }],
            clock_realtime: false,
        };
        let t0 = Instant::now();
        vmm.restore_clone(&snap, &mem, &overrides).await.unwrap();
        assert_eq!(
            vmm.client.describe_instance().await.unwrap().state,
            InstanceState::Running
        );
        vmm.wait_for_hello(Instant::now() + Duration::from_secs(10))
            .await
            .unwrap();
        let load_to_hello = t0.elapsed();
        let mut client = imp_guest::host::connect(
            &f.vsock,
            imp_guest::protocol::AGENT_VSOCK_PORT,
            Instant::now() + Duration::from_secs(10),
        )
        .await
        .unwrap();
        let check = IdentityCheck {
            previous_samples: samples.clone(),
            ..IdentityCheck::default()
        };
        let got = client
            .reidentify(reidentify_request(&format!("clone{i}")), &check)
            .await
            .unwrap();
        assert_eq!(got.hostname, format!("clone{i}"));
        samples.push(
            base64::engine::general_purpose::STANDARD
                .decode(&got.random_sample_b64)
                .unwrap(),
        );
        println!("clone{i}: restore_clone -> Hello {load_to_hello:?}");
        clones.push(vmm);
    }

    // A restore onto a socket path already in use: refused, and the VMM is gone.
    let f = files(dir.path(), "clone-bad");
    std::fs::write(&f.vsock, b"taken").unwrap();
    let vmm = spawned.spawn(&simulator, "clone-bad", &f).await;
    let e = vmm
        .restore_clone(&snap, &mem, &CloneOverrides::default())
        .await
        .unwrap_err();
    assert_eq!(e.reason(), reason::FIRECRACKER_START_FAILED);
    // Without an override, the snapshot's own TAP is the template's, which still exists: the
    // failure is the socket.
    assert!(
        e.to_string()
            .contains("Error binding to the host-side Unix socket"),
        "{e}"
    );
    assert!(vmm.process.wait_gone(Duration::from_secs(5)).await);

    for c in &clones {
        c.stop(Duration::from_secs(5)).await;
        assert!(!c.is_alive());
    }
    spawned.0.clear();
}
