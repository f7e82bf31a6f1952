//! A real VM without Firecracker: QEMU boots a distribution kernel with an initrd that loads
//! the virtio/overlay/vsock modules and runs imp-guest as PID 1 on an overlay of two ext4
//! drives. The from-initramfs cases use the initrd images/initrd/build.sh makes (imp-guest is
//! /init and loads the modules itself); the kernel-mounted case keeps a busybox script that
//! mounts the base drive as root first. vhost-device-vsock gives the host the same hybrid-vsock
//! socket Firecracker does, so the host client, the protocol, exec, probes, metrics and
//! power-off run for real. The harness (detection, processes, console, host client) is
//! imp_testkit::qemu, shared with node/runtime/tests/rootfs_qemu.rs.
//!
//! Runs when IMP_GUEST_STATIC_BIN (from guest/check-static.sh) is set and qemu-system-x86_64,
//! vhost-device-vsock, a static /bin/busybox and a kernel (IMP_QEMU_KERNEL, else the first
//! /boot/vmlinuz-*) with its /lib/modules are present. Otherwise it says what it skipped
//! (or fails, under IMP_REQUIRE_QEMU=1). guest/vm-test.sh sets all of this up.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use imp_common::SecretString;
use imp_guest::host::{HostClient, HostError, IdentityCheck};
use imp_guest::protocol::{ErrorCode, HttpProbe, NetIdentity, Reidentify};
use imp_testkit::qemu::{self, Drive, Setup, setup_or_skip};

const SECRET: &str = "jit-qemu-4f0c-do-not-print";

fn sh(cmd: &str) {
    assert!(
        Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .status()
            .unwrap()
            .success(),
        "{cmd}"
    );
}

/// How the base drive becomes the lower layer.
#[derive(Clone, Copy)]
enum Root {
    /// imp-guest runs from the initramfs and mounts the base drive itself (`imp.lower=`).
    FromInitramfs,
    /// The initrd mounts the base drive read-only and switch_roots into it, as the kernel does
    /// with `root=/dev/vda ro` (the Firecracker layout); imp-guest overlays the current root.
    KernelMounted,
}

/// The busybox-script initrd for [`Root::KernelMounted`].
fn busybox_initrd(s: &Setup, dir: &Path) {
    let initrd = dir.join("initrd");
    std::fs::create_dir_all(initrd.join("lib/mods")).unwrap();
    std::fs::create_dir_all(initrd.join("bin")).unwrap();
    std::fs::create_dir_all(initrd.join("sbin")).unwrap();
    std::fs::copy("/bin/busybox", initrd.join("bin/busybox")).unwrap();
    std::fs::copy(&s.guest_bin, initrd.join("sbin/imp-guest")).unwrap();
    for m in &s.modules {
        std::fs::copy(m, initrd.join("lib/mods").join(m.file_name().unwrap())).unwrap();
    }
    let handoff = "bb=/bin/busybox; $bb mkdir -p /dev /newroot; $bb mount -t devtmpfs devtmpfs /dev\n\
                   $bb mount -t ext4 -o ro /dev/vda /newroot; $bb umount /dev\n\
                   exec $bb switch_root /newroot /sbin/imp-guest";
    let init = format!(
        "#!/bin/busybox sh\nfor m in {}; do /bin/busybox insmod /lib/mods/$m.ko; done\n{handoff}\n",
        qemu::MODULES.join(" ")
    );
    std::fs::write(initrd.join("init"), init).unwrap();
    sh(&format!(
        "chmod +x {0}/init && cd {0} && find . | cpio -o -H newc --quiet > {1}/initrd.cpio",
        initrd.display(),
        dir.display()
    ));
}

fn build_images(s: &Setup, dir: &Path, root: Root) {
    match root {
        Root::FromInitramfs => qemu::scripted_initrd(s, &dir.join("initrd.cpio")),
        Root::KernelMounted => busybox_initrd(s, dir),
    }
    let base = dir.join("base");
    for d in ["sbin", "bin", "proc", "sys", "dev", "run", "tmp", "etc"] {
        std::fs::create_dir_all(base.join(d)).unwrap();
    }
    std::fs::copy(&s.guest_bin, base.join("sbin/imp-guest")).unwrap();
    std::fs::copy("/bin/busybox", base.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", base.join("bin/sh")).unwrap();
    std::fs::write(
        base.join("etc/passwd"),
        "root:x:0:0::/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(base.join("etc/marker"), "pristine\n").unwrap();
    for (img, content) in [("base.ext4", Some(&base)), ("rw.ext4", None)] {
        let path = dir.join(img);
        std::fs::File::create(&path)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let d = content
            .map(|c| format!("-d {}", c.display()))
            .unwrap_or_default();
        sh(&format!("mkfs.ext4 -q -F {d} {}", path.display()));
    }
}

/// One booted VM and the directory holding its initrd and drives.
struct Vm {
    images: tempfile::TempDir,
    vm: qemu::Vm,
}

impl Vm {
    fn boot(s: &Setup, root: Root, extra_append: &str) -> Vm {
        let images = tempfile::tempdir().unwrap();
        let dir = images.path();
        build_images(s, dir, root);
        let append = format!(
            "imp.overlay=/dev/vdb imp.hostname=imp-qemu imp.dns=192.0.2.53 \
             imp.report_grace_s=60 {lower} {extra_append}",
            lower = match root {
                Root::FromInitramfs => "imp.lower=/dev/vda",
                Root::KernelMounted => "",
            }
        );
        let vm = qemu::Vm::start(
            s,
            &dir.join("initrd.cpio"),
            &[
                Drive::read_only(dir.join("base.ext4")),
                Drive::writable(dir.join("rw.ext4")),
            ],
            &append,
        );
        Vm { images, vm }
    }
}

impl std::ops::Deref for Vm {
    type Target = qemu::Vm;
    fn deref(&self) -> &qemu::Vm {
        &self.vm
    }
}

impl std::ops::DerefMut for Vm {
    fn deref_mut(&mut self) -> &mut qemu::Vm {
        &mut self.vm
    }
}

#[tokio::test]
async fn pid1_and_agent_in_a_real_vm() {
    let Some(s) = setup_or_skip() else { return };
    let mut vm = Vm::boot(&s, Root::FromInitramfs, "");
    let mut client = vm.connect().await;
    assert_eq!(
        client.hello().protocol,
        imp_guest::protocol::PROTOCOL_VERSION
    );

    // Exact env, hostname and resolv.conf from the command line, the overlay root.
    let mut req = common::exec("env", &["/bin/busybox", "env"]);
    req.env.insert(
        "ACTIONS_RUNNER_INPUT_JITCONFIG".into(),
        SecretString::from(SECRET),
    );
    let (out, _, e) = common::run(&mut client, req).await;
    assert_eq!(e.code, Some(0));
    let mut lines: Vec<String> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            format!("ACTIONS_RUNNER_INPUT_JITCONFIG={SECRET}"),
            "PATH=/usr/bin:/bin".to_owned()
        ]
    );

    let script = "busybox hostname; busybox cat /etc/resolv.conf; busybox cat /etc/marker; \
                  echo changed > /etc/marker; busybox grep ' / ' /proc/mounts";
    let (out, _, e) = common::run(&mut client, common::sh("sys", script)).await;
    assert_eq!(e.code, Some(0));
    let out = String::from_utf8(out).unwrap();
    assert!(out.starts_with("imp-qemu\n"), "{out}");
    assert!(out.contains("nameserver 192.0.2.53"), "{out}");
    assert!(out.contains("pristine"), "{out}");
    assert!(out.contains("overlay / overlay"), "{out}");

    // uid switch, timeout, duplicate id inside the VM.
    let mut req = common::sh("uid", "busybox id -u");
    req.uid = Some(65534);
    let (out, _, _) = common::run(&mut client, req).await;
    assert_eq!(String::from_utf8(out).unwrap().trim(), "65534");
    let mut req = common::exec("sleep", &["/bin/busybox", "sleep", "60"]);
    req.timeout_s = Some(1);
    let pid = client.exec(req.clone()).await.unwrap().pid;
    let e = client.wait_exited("sleep").await.unwrap();
    assert_eq!((e.signal, e.timed_out), (Some(9), true));
    assert_eq!(client.exec(req).await.unwrap().pid, pid);

    let m = client.metrics().await.unwrap();
    assert!(m.memory_total_bytes > 256 << 20, "{m:?}");
    assert!(
        m.disk_total_bytes > 0 && m.disk_used_bytes <= m.disk_total_bytes,
        "{m:?}"
    );
    let r = client
        .probe(HttpProbe {
            path: "/".into(),
            port: 1,
            timeout_ms: 2000,
        })
        .await
        .unwrap();
    assert!(
        r.error.as_deref().unwrap_or_default().contains("refused"),
        "{r:?}"
    );

    // The workload ends, its exit is reported, the VM powers off.
    let mut req = common::sh("runner", "exit 3");
    req.poweroff_on_exit = true;
    client.exec(req).await.unwrap();
    assert_eq!(client.wait_exited("runner").await.unwrap().code, Some(3));
    vm.wait_end();

    vm.print_markers();
    let text = vm.console_text();
    for stage in [
        "modules ok loaded=",
        "overlay-root ok",
        "hostname ok",
        "resolv-conf ok",
        "ready",
        "shutdown reason=WorkloadExitReported",
    ] {
        assert!(
            text.contains(&format!("IMP-GUEST stage={stage}")),
            "missing {stage}:\n{text}"
        );
    }
    assert!(!text.contains(SECRET), "secret on the serial console");
    // The base image was never written.
    sh(&format!(
        "debugfs -R 'cat /etc/marker' {} 2>/dev/null | grep -qx pristine",
        vm.images.path().join("base.ext4").display()
    ));
}

#[tokio::test]
async fn pid1_reaps_orphans_and_shuts_down_on_sigterm() {
    let Some(s) = setup_or_skip() else { return };
    let mut vm = Vm::boot(&s, Root::FromInitramfs, "imp.halt=reboot");
    let mut client = vm.connect().await;
    // The shell exits at once; its background child is orphaned to PID 1, which must reap it.
    let (_, _, e) = common::run(
        &mut client,
        common::sh("orphan", "busybox sleep 0.3 & exit 0"),
    )
    .await;
    assert_eq!(e.code, Some(0));
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Field 3 of /proc/<pid>/stat is the state; count zombies.
    let (out, _, e) = common::run(
        &mut client,
        common::sh(
            "zombies",
            "busybox cat /proc/[0-9]*/stat | busybox awk '$3 == \"Z\"' | busybox wc -l",
        ),
    )
    .await;
    assert_eq!(e.code, Some(0));
    assert_eq!(String::from_utf8(out).unwrap().trim(), "0");

    // A long-running process, then SIGTERM to PID 1: orderly shutdown, reboot(RB_AUTOBOOT).
    client
        .exec(common::exec("long", &["/bin/busybox", "sleep", "600"]))
        .await
        .unwrap();
    client
        .exec(common::exec(
            "term",
            &["/bin/busybox", "kill", "-TERM", "1"],
        ))
        .await
        .unwrap();
    vm.wait_end();
    vm.print_markers();
    let text = vm.console_text();
    for stage in ["shutdown reason=Signal(15)", "poweroff RB_AUTOBOOT"] {
        assert!(
            text.contains(&format!("IMP-GUEST stage={stage}")),
            "missing {stage}:\n{text}"
        );
    }
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn entropy_b64(n: usize) -> String {
    use base64::Engine;
    let mut bytes = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .unwrap();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

const HOUR_NS: i64 = 3_600_000_000_000;

/// A clone's identity step in a real guest, before its first Exec: the entropy ioctls of a
/// guest kernel, the wall clock stepped by PID 1, hostname and machine-id; a network part the
/// guest cannot apply (this VM has no NIC: the network part runs in guest/tests/reidentify.rs)
/// fails naming it; after an Exec the identity is final.
async fn reidentify_before_any_exec(client: &mut HostClient) {
    let mut no_nic = Reidentify {
        entropy_b64: entropy_b64(32),
        hostname: "imp-clone-0".into(),
        machine_id: None,
        wall_clock_unix_ns: now_ns(),
        network: Some(NetIdentity {
            mac: "02:00:0a:2c:00:05".into(),
            address: "10.44.0.5".into(),
            prefix: 24,
            gateway: "10.44.0.1".into(),
            ..NetIdentity::default()
        }),
    };
    match client
        .reidentify(no_nic.clone(), &IdentityCheck::default())
        .await
    {
        Err(HostError::Guest(e)) => {
            assert_eq!(e.code, ErrorCode::IdentityFailed);
            assert!(
                e.message.starts_with("reidentify: network: ") && e.message.contains("eth0"),
                "{e:?}"
            );
        }
        other => panic!("a network part without a NIC: {other:?}"),
    }
    no_nic.network = None;

    // First: the host says it is an hour later than it is, as a host would after a clone
    // restored from an hour-old snapshot. The guest steps its clock forward.
    let mut first = no_nic.clone();
    first.entropy_b64 = entropy_b64(32);
    first.hostname = "imp-clone-1".into();
    first.machine_id = Some("0123456789abcdef0123456789abcdef".into());
    first.wall_clock_unix_ns = now_ns() + HOUR_NS as u64;
    let t = std::time::Instant::now();
    let one = client
        .reidentify(first, &IdentityCheck::default())
        .await
        .unwrap();
    let first_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(one.generation, 1);
    assert!(
        (one.clock_step_ns - HOUR_NS).abs() < 30_000_000_000,
        "stepped by {} ns, not an hour",
        one.clock_step_ns
    );
    // Second, as the next clone would get it: other entropy, the true time (back an hour), a
    // machine-id the guest makes.
    let mut second = no_nic.clone();
    second.entropy_b64 = entropy_b64(64);
    second.hostname = "imp-clone-2".into();
    second.wall_clock_unix_ns = now_ns();
    let check = IdentityCheck {
        previous_samples: vec![one.random_sample().unwrap()],
        after_generation: Some(1),
        ..IdentityCheck::default()
    };
    let t = std::time::Instant::now();
    let two = client.reidentify(second, &check).await.unwrap();
    let second_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(two.generation, 2);
    assert!(
        (two.clock_step_ns + HOUR_NS).abs() < 30_000_000_000,
        "stepped by {} ns, not back an hour",
        two.clock_step_ns
    );
    assert_ne!(two.random_sample(), one.random_sample());
    assert_ne!(two.machine_id, one.machine_id);
    println!(
        "MEASURE reidentify round trip (QEMU TCG guest, PID 1): {first_ms:.1} ms (+1 h), {second_ms:.1} ms (-1 h); samples {} / {}; vmgenid device {:?}",
        one.random_sample_b64, two.random_sample_b64, two.vmgenid_device
    );

    // What the guest's own tools see.
    let script = "busybox hostname; busybox cat /etc/machine-id; busybox date +%s";
    let (out, _, e) = common::run(client, common::sh("identity", script)).await;
    assert_eq!(e.code, Some(0));
    let out = String::from_utf8(out).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[..2],
        ["imp-clone-2", two.machine_id.as_str()],
        "{out}"
    );
    let guest_s: i64 = lines[2].parse().unwrap();
    let host_s = (now_ns() / 1_000_000_000) as i64;
    assert!(
        (guest_s - host_s).abs() <= 5,
        "guest clock {guest_s}, host {host_s}"
    );

    // The guest has received an Exec: no identity change any more.
    let mut late = no_nic;
    late.wall_clock_unix_ns = now_ns();
    match client.reidentify(late, &IdentityCheck::default()).await {
        Err(HostError::Guest(e)) => assert_eq!(e.code, ErrorCode::IdentityLocked, "{e:?}"),
        other => panic!("Reidentify after an Exec: {other:?}"),
    }
}

#[tokio::test]
async fn overlay_over_the_kernel_mounted_root_and_host_shutdown() {
    let Some(s) = setup_or_skip() else { return };
    let mut vm = Vm::boot(&s, Root::KernelMounted, "");
    let mut client = vm.connect().await;
    // This boot doubles as a restored clone: its identity comes first.
    reidentify_before_any_exec(&mut client).await;
    let script = "busybox grep ' / ' /proc/mounts; busybox cat /etc/marker; \
                  echo changed > /etc/marker; busybox cat /etc/marker";
    let (out, _, e) = common::run(&mut client, common::sh("root", script)).await;
    assert_eq!(e.code, Some(0));
    let out = String::from_utf8(out).unwrap();
    assert!(out.contains("overlay / overlay"), "{out}");
    assert!(out.ends_with("pristine\nchanged\n"), "{out}");
    // Shutdown from the host: no answer, the VM powers off.
    client.shutdown().await.unwrap();
    vm.wait_end();
    vm.print_markers();
    let text = vm.console_text();
    assert!(
        text.contains("IMP-GUEST stage=shutdown reason=HostRequested"),
        "{text}"
    );
    sh(&format!(
        "debugfs -R 'cat /etc/marker' {} 2>/dev/null | grep -qx pristine",
        vm.images.path().join("base.ext4").display()
    ));
}
