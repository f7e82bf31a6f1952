//! The Firecracker driver on its own against the simulator: configure, start, Hello, pause,
//! snapshot, and restore of that snapshot into a fresh process (the ScaleToZero building blocks).

mod common;

use std::time::Duration;

use common::vmm::{KillOnDrop, boot_source, files, machine};
use imp_api::names::reason;
use imp_runtime::firecracker::BootPlan;
use imp_runtime::firecracker::api::{Drive, InstanceState, Vsock};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_of_a_paused_vm_restores_into_a_fresh_process() {
    let common::Backend::Simulator { simulator, guest } = common::simulator() else {
        unreachable!("simulator() is the simulator")
    };
    // SAFETY: the only test in this binary; nothing reads the environment concurrently.
    unsafe { std::env::set_var("IMP_GUEST_BIN", &guest) };
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("vmlinux");
    let disk = dir.path().join("rootfs.ext4");
    std::fs::write(&kernel, b"kernel").unwrap();
    std::fs::write(&disk, b"disk").unwrap();

    let a = files(dir.path(), "a");
    let mut spawned = KillOnDrop::default();
    let vmm = spawned.spawn(&simulator, "snap-a", &a).await;
    let plan = BootPlan {
        machine: machine(2, 64),
        boot_source: boot_source(&kernel),
        drives: vec![Drive {
            drive_id: "rootfs".into(),
            is_root_device: true,
            partuuid: None,
            cache_type: None,
            is_read_only: Some(true),
            path_on_host: Some(disk.display().to_string()),
            io_engine: None,
            socket: None,
        }],
        network: vec![],
        vsock: Vsock {
            guest_cid: 3,
            uds_path: a.vsock.display().to_string(),
        },
    };
    vmm.configure(&plan).await.unwrap();
    assert_eq!(
        vmm.client.describe_instance().await.unwrap().state,
        InstanceState::NotStarted
    );
    vmm.instance_start().await.unwrap();
    vmm.wait_for_hello(Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    // A second configuration after start is refused by Firecracker's rules, with its message.
    let e = vmm.configure(&plan).await.unwrap_err();
    assert_eq!(e.reason(), reason::FIRECRACKER_START_FAILED);
    assert!(
        e.to_string().contains("not supported after starting"),
        "{e}"
    );

    vmm.pause().await.unwrap();
    assert_eq!(
        vmm.client.describe_instance().await.unwrap().state,
        InstanceState::Paused
    );
    let (snap, mem) = (dir.path().join("vm.snap"), dir.path().join("vm.mem"));
    vmm.snapshot_create(&snap, &mem).await.unwrap();
    assert_eq!(std::fs::metadata(&mem).unwrap().len(), 64 << 20);
    vmm.resume().await.unwrap();
    assert_eq!(
        vmm.client.describe_instance().await.unwrap().state,
        InstanceState::Running
    );
    vmm.stop(Duration::from_secs(5)).await;
    assert!(!vmm.is_alive());
    assert!(
        imp_runtime::vmm::serial::tail(&a.serial_log).contains("Restarting system"),
        "SendCtrlAltDel reset the guest"
    );

    // Restore into a new process with a new vsock path.
    let b = files(dir.path(), "b");
    let restored = spawned.spawn(&simulator, "snap-b", &b).await;
    restored.snapshot_load(&snap, &mem, true).await.unwrap();
    assert_eq!(
        restored.client.describe_instance().await.unwrap().state,
        InstanceState::Running
    );
    let hello = restored
        .wait_for_hello(Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    assert!(!hello.boot_id.is_empty());
    // Loading twice is refused: the VM is already running.
    assert!(restored.snapshot_load(&snap, &mem, true).await.is_err());
    restored.kill().await;
    assert!(!restored.is_alive());
    // Both are gone: their pids are no longer ours to signal.
    spawned.0.clear();
}
