//! Jailed clones: a jailed template's snapshot staged into each clone's jail
//! (`jailer::Place::Template`: one hard-linked, root-owned, read-only inode) beside the clone's
//! own copy of the writable drive at the path the snapshot recorded (a load has no drive
//! override; each jail resolves the same in-jail path to its own file); each clone's Firecracker
//! (the simulator through testkit's jailer double: chrooted, its own uid) restores it with
//! `Vmm::restore_clone` and answers Hello on its own socket. A jailed simulator has no CAP_SYS_ADMIN, so its clones
//! refuse `Reidentify`, unless `IMP_JAILER_DOUBLE_KEEP_ROOT` keeps it root (docs/runtime.md);
//! the real guest's side is guest/tests.

mod common;

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::vmm::KillOnDrop;
use imp_guest::host::{HostClient, HostError, IdentityCheck};
use imp_guest::protocol::{AGENT_VSOCK_PORT, ErrorCode, Reidentify};
use imp_runtime::firecracker::api::{BootSource, Drive, MachineConfiguration, Vsock};
use imp_runtime::firecracker::jailer::{self, JailerConfig, JailerRun, Place};
use imp_runtime::firecracker::{self, BootPlan, CloneOverrides, VmmFiles};
use tokio::time::Instant;

fn files(dir: &Path, name: &str, jail: Option<&Path>) -> VmmFiles {
    let inner = jail.unwrap_or(dir);
    VmmFiles {
        api_sock: inner.join(format!("{name}.api")),
        vsock: inner.join(format!("{name}.vsock")),
        serial_log: dir.join(format!("{name}.serial")),
        stderr_log: dir.join(format!("{name}.stderr")),
        vmm_log: inner.join(jailer::VMM_LOG),
        jail: jail.map(Path::to_path_buf),
    }
}

/// The guest agent of the VMM with files `f` (waits up to 10 s for it).
async fn agent(f: &VmmFiles) -> HostClient {
    imp_guest::host::connect(
        &f.vsock,
        AGENT_VSOCK_PORT,
        Instant::now() + Duration::from_secs(10),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jailed_clones_load_the_template_linked_read_only_into_their_jails() {
    if !common::is_root() {
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "jailed_clones_load_the_template_linked_read_only_into_their_jails",
            "the jailer switches uids and makes device nodes",
        );
    }
    let common::Backend::JailedSimulator {
        simulator,
        guest,
        jailer: jailer_bin,
    } = common::jailed_simulator()
    else {
        unreachable!("jailed_simulator() is the jailed simulator")
    };
    let bind = ["/usr", "/bin", "/sbin", "/lib", "/lib64"]
        .iter()
        .map(PathBuf::from)
        .filter(|p| p.exists())
        .chain([guest.clone()])
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(",");
    // SAFETY: the only test in this binary; nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("IMP_GUEST_BIN", &guest);
        std::env::set_var("IMP_JAILER_DOUBLE_BIND", bind);
        std::env::set_var("IMP_JAILER_DOUBLE_KEEP_ENV", "IMP_GUEST_BIN");
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, b"kernel").unwrap();
    let mut spawned = KillOnDrop::default();

    let cfg = JailerConfig {
        bin: jailer_bin,
        chroot_base: dir.path().join("jails"),
    };
    // The shared base image and the template's writable drive (each clone gets its own copy).
    let base = dir.path().join("base.ext4");
    std::fs::write(&base, b"base image").unwrap();
    let overlay = dir.path().join("template-overlay.ext4");
    std::fs::write(&overlay, b"overlay at snapshot time").unwrap();

    // The template, jailed like every Firecracker: the snapshot records the paths it had in its
    // jail (/vmlinux, /base.ext4, /overlay.ext4, /vsock.sock), which each clone's jail provides.
    let tpl_uid = 900_299;
    let tpl_root = jailer::chroot_root(&cfg, &simulator, "tpl").unwrap();
    jailer::stage(
        &tpl_root,
        &simulator,
        tpl_uid,
        &[
            (kernel.as_path(), "vmlinux", Place::Shared),
            (base.as_path(), "base.ext4", Place::Shared),
            (overlay.as_path(), "overlay.ext4", Place::Own),
        ],
    )
    .unwrap();
    imp_runtime::jail::own(&tpl_root.join("overlay.ext4"), tpl_uid, 0o600).unwrap();
    let t = VmmFiles {
        api_sock: tpl_root.join(jailer::API_SOCK),
        vsock: tpl_root.join(jailer::VSOCK),
        ..files(dir.path(), "tpl", Some(&tpl_root))
    };
    let run = JailerRun {
        id: "tpl",
        exec_file: &simulator,
        uid: tpl_uid,
        cgroups: None,
        firecracker_args: vec![],
    };
    let vmm = firecracker::spawn_jailed(&cfg, &run, &t).await.unwrap();
    spawned.0.push(vmm.process.pid);
    vmm.wait_api_ready().await.unwrap();
    let in_jail = |name: &str| t.vmm_path(&tpl_root.join(name));
    vmm.configure(&BootPlan {
        machine: MachineConfiguration {
            vcpu_count: 1,
            mem_size_mib: 128,
            smt: None,
            track_dirty_pages: None,
            huge_pages: None,
        },
        boot_source: BootSource {
            kernel_image_path: in_jail("vmlinux"),
            initrd_path: None,
            boot_args: None,
        },
        drives: vec![
            Drive {
                drive_id: "base".into(),
                is_root_device: true,
                partuuid: None,
                cache_type: None,
                is_read_only: Some(true),
                path_on_host: Some(in_jail("base.ext4")),
                io_engine: None,
                socket: None,
            },
            Drive {
                drive_id: "overlay".into(),
                is_root_device: false,
                partuuid: None,
                cache_type: None,
                is_read_only: Some(false),
                path_on_host: Some(in_jail("overlay.ext4")),
                io_engine: None,
                socket: None,
            },
        ],
        network: vec![],
        vsock: Vsock {
            guest_cid: 3,
            uds_path: in_jail(jailer::VSOCK),
        },
    })
    .await
    .unwrap();
    vmm.instance_start().await.unwrap();
    vmm.wait_for_hello(Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    vmm.pause().await.unwrap();
    let (snap, mem) = (
        tpl_root.join("template.snap"),
        tpl_root.join("template.mem"),
    );
    vmm.snapshot_create(&snap, &mem).await.unwrap();
    // The template VMM goes; its snapshot stays (the template's own copy of the overlay too).
    vmm.resume().await.unwrap();
    vmm.stop(Duration::from_secs(5)).await;
    let saved = std::fs::read(&overlay).unwrap();

    let mut clones = Vec::new();
    // clone-2 with IMP_JAILER_DOUBLE_KEEP_ROOT: the simulator keeps root (and CAP_SYS_ADMIN) in
    // its jail, so its clone takes `Reidentify`; the others run as their own uid.
    for i in 0..3u32 {
        let id = format!("clone-{i}");
        let uid = 900_300 + i;
        let root = jailer::chroot_root(&cfg, &simulator, &id).unwrap();
        jailer::stage(
            &root,
            &simulator,
            uid,
            &[
                (snap.as_path(), "template.snap", Place::Template),
                (mem.as_path(), "template.mem", Place::Template),
                (kernel.as_path(), "vmlinux", Place::Shared),
                (base.as_path(), "base.ext4", Place::Shared),
            ],
        )
        .unwrap();
        // Its own writable drive, at the path the snapshot recorded: a copy of the template's.
        let own_overlay = root.join("overlay.ext4");
        std::fs::write(&own_overlay, &saved).unwrap();
        imp_runtime::jail::own(&own_overlay, uid, 0o600).unwrap();
        let f = VmmFiles {
            api_sock: root.join(jailer::API_SOCK),
            vsock: root.join(jailer::VSOCK),
            ..files(dir.path(), &id, Some(&root))
        };
        let run = JailerRun {
            id: &id,
            exec_file: &simulator,
            uid,
            cgroups: None,
            firecracker_args: vec![],
        };
        if i == 2 {
            // SAFETY: the only test in this binary; nothing reads the environment concurrently.
            unsafe { std::env::set_var("IMP_JAILER_DOUBLE_KEEP_ROOT", "1") };
        }
        let vmm = firecracker::spawn_jailed(&cfg, &run, &f).await;
        // SAFETY: as above.
        unsafe { std::env::remove_var("IMP_JAILER_DOUBLE_KEEP_ROOT") };
        let vmm = vmm.unwrap();
        spawned.0.push(vmm.process.pid);
        vmm.wait_api_ready().await.unwrap();
        vmm.restore_clone(
            &root.join("template.snap"),
            &root.join("template.mem"),
            &CloneOverrides::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("{id}: {e}"));
        vmm.wait_for_hello(Instant::now() + Duration::from_secs(15))
            .await
            .unwrap_or_else(|e| panic!("{id}: {e}"));
        // The one template inode, root's and read-only, in this jail; the clone's own log its own.
        let (a, b) = (
            std::fs::metadata(&mem).unwrap(),
            std::fs::metadata(root.join("template.mem")).unwrap(),
        );
        assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()), "{id}");
        assert_eq!((b.uid(), b.mode() & 0o777), (0, 0o444), "{id}");
        let log = std::fs::metadata(root.join(jailer::VMM_LOG)).unwrap();
        assert_eq!((log.uid(), log.mode() & 0o777), (uid, 0o600), "{id}");
        clones.push((vmm, f));
    }
    // Without CAP_SYS_ADMIN, a jailed simulator's clone manages no identity: it refuses.
    let (_, f) = &clones[0];
    let mut g = agent(f).await;
    let req = Reidentify {
        entropy_b64: "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".into(),
        hostname: "clone-0".into(),
        machine_id: None,
        wall_clock_unix_ns: 0,
        network: None,
    };
    match g.reidentify(req.clone(), &IdentityCheck::default()).await {
        Err(HostError::Guest(e)) => assert_eq!(e.code, ErrorCode::IdentityFailed, "{e:?}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let (_, f) = &clones[2];
    let mut g = agent(f).await;
    let req = Reidentify {
        entropy_b64: "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=".into(),
        hostname: "clone-2".into(),
        wall_clock_unix_ns: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
        ..req
    };
    let got = g
        .reidentify(req, &IdentityCheck::default())
        .await
        .unwrap_or_else(|e| panic!("a root jailed clone: {e}"));
    assert_eq!((got.generation, got.hostname.as_str()), (1, "clone-2"));
    let root = jailer::chroot_root(&cfg, &simulator, "clone-2").unwrap();
    assert_eq!(
        std::fs::read_to_string(root.join("vsock.sock.identity/etc/machine-id"))
            .unwrap()
            .trim(),
        got.machine_id
    );
    // The template's files may go: the clones' links keep the memory.
    std::fs::remove_file(&mem).unwrap();
    for (vmm, _) in &clones {
        assert!(vmm.is_alive());
        vmm.kill().await;
    }
    spawned.0.clear();
}
