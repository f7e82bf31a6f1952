//! The real-guest path: time from a VM's create request to imp-runtime's QEMU backend (PUT
//! /v1/vms/{uid}, what the agent sends once the VM is bound to its node) until the runtime reports it
//! Running, which it does on the guest's Hello over the hybrid vsock; beside a bare
//! qemu-system-x86_64 boot of the same kernel, initrd and base image to the same Hello
//! (imp_testkit::qemu, QEMU started directly). Several runs each, p50. Prints numbers; not a test.
//! A second runtime with `IMP_NO_CONFINE=1` (its own state dir) boots the same VMs unconfined,
//! interleaved with the confined ones: the cost of confinement (docs/security.md) in one run.
//!
//! The first VM builds the base image from a local registry (docker-registry) and is reported on its
//! own; the measured VMs hit the cache, as a pool's VMs do. Both paths use the same accelerator
//! (IMP_QEMU_ACCEL, default tcg, for imp-runtime; the bare boot uses testkit's TCG).
//!
//! Runs when the QEMU path can (imp_testkit::qemu::setup_or_skip: the static imp-guest in
//! IMP_GUEST_STATIC_BIN, qemu-system-x86_64, vhost-device-vsock, static busybox, kernel modules) and
//! docker-registry is installed; otherwise it prints why it skipped, and IMP_REQUIRE_QEMU=1 makes that
//! a failure. `cargo bench -p imp-runtime --bench boot`; IMP_BENCH_RUNS (default 5).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::Harness;
use common::measure::{env_u64, median, summary};
use http::StatusCode;
use imp_runtime::api::VmState;
use imp_testkit::oci::push_gzip_image;
use imp_testkit::qemu::{self, Drive};
use imp_testkit::registry::{Registry, RegistryOptions};

fn skip(why: &str) {
    if std::env::var("IMP_REQUIRE_QEMU").as_deref() == Ok("1") {
        panic!("IMP_REQUIRE_QEMU=1 but the boot bench cannot run: {why}");
    }
    println!("skipped the boot bench: {why}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes --bench; nothing else to parse.
    let Some(s) = qemu::setup_or_skip() else {
        skip("the QEMU real-VM path cannot run here (reason above)");
        return;
    };
    let runs = env_u64("IMP_BENCH_RUNS", 5).max(1) as usize;
    let registry = match Registry::start(RegistryOptions::default()).await {
        Ok(r) => r,
        Err(e) => return skip(&format!("no local registry: {e}")),
    };
    let images = tempfile::tempdir().unwrap();
    let initrd = images.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);
    let base = push_gzip_image(
        &registry.host(),
        "imp/runner-base:boot",
        vec![common::busybox_layer().into_gzip()],
    )
    .await;

    let mut h = Harness::qemu(&s, &initrd, registry.host());
    h.start_runtime().await;
    let mut open = Harness::qemu(&s, &initrd, registry.host());
    open.extra_env
        .push(("IMP_NO_CONFINE".to_string(), "1".to_string()));
    open.start_runtime().await;
    let spec = common::image_vm(base, 512, 128 << 20, false);
    let put = |h: &Harness, uid: String| {
        let client = h.client.clone();
        let spec = spec.clone();
        async move {
            let t = Instant::now();
            let (code, st) = client
                .ensure_running(&uid, &spec)
                .await
                .unwrap_or_else(|e| panic!("{uid}: {e}"));
            assert_eq!((code, st.state), (StatusCode::CREATED, VmState::Running));
            (
                t.elapsed().as_secs_f64(),
                st.boot_seconds.unwrap_or_default(),
            )
        }
    };

    // The first VM builds the base image; then the measured runs, one VM at a time.
    let (first, _) = put(&h, "boot-0".into()).await;
    h.client.delete("boot-0").await.unwrap();
    put(&open, "boot-0".into()).await;
    open.client.delete("boot-0").await.unwrap();
    let mut wall = Vec::new();
    let mut reported = Vec::new();
    let (mut open_wall, mut open_reported) = (Vec::new(), Vec::new());
    for i in 1..=runs {
        let uid = format!("boot-{i}");
        let (w, b) = put(&h, uid.clone()).await;
        wall.push(w);
        reported.push(b);
        h.client.delete(&uid).await.unwrap();
        let (w, b) = put(&open, uid.clone()).await;
        open_wall.push(w);
        open_reported.push(b);
        open.client.delete(&uid).await.unwrap();
    }

    // The same kernel, initrd and base booted by QEMU alone.
    let base_img = std::fs::read_dir(h.state_dir.join("rootfs/images"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "ext4"))
        .expect("the built base image");
    let drives =
        imp_runtime::rootfs::writable::WritableDrives::new(&images.path().join("templates"))
            .unwrap();
    let mut bare = Vec::new();
    for i in 0..runs {
        let rw = images.path().join(format!("bare-{i}.rw"));
        drives.create(&rw, 128 << 20).unwrap();
        let vm = qemu::Vm::start(
            &s,
            &initrd,
            &[Drive::read_only(&base_img), Drive::writable(&rw)],
            "imp.lower=/dev/vda imp.overlay=/dev/vdb imp.report_grace_s=60",
        );
        let _ = tokio::time::timeout(Duration::from_secs(240), vm.connect())
            .await
            .expect("bare Hello in time");
        bare.push(vm.started.elapsed().as_secs_f64());
        drop(vm);
        let _ = std::fs::remove_file(&rw);
    }
    assert!(h.vmm_processes().is_empty(), "no VMM left");
    assert!(open.vmm_processes().is_empty(), "no VMM left");

    println!(
        "boot bench, QEMU {} (accel {}), 1 vCPU, 512 MiB:",
        s.kernel.display(),
        std::env::var("IMP_QEMU_ACCEL").unwrap_or_else(|_| "tcg".into())
    );
    println!("  first VM (builds the base image): {first:.2} s create request -> Running");
    println!(
        "  imp-runtime create request -> guest Hello (Running): {}",
        summary(&wall, 2)
    );
    println!(
        "  imp-runtime's own boot_seconds (VMM spawn -> Hello): {}",
        summary(&reported, 2)
    );
    println!(
        "  unconfined (IMP_NO_CONFINE=1) create request -> Running: {}",
        summary(&open_wall, 2)
    );
    println!(
        "  unconfined boot_seconds (VMM spawn -> Hello): {}",
        summary(&open_reported, 2)
    );
    println!(
        "  confined / unconfined p50: create request {:.3}x, boot_seconds {:.3}x",
        median(&wall) / median(&open_wall),
        median(&reported) / median(&open_reported)
    );
    println!(
        "  bare qemu-system-x86_64 start -> guest Hello: {}",
        summary(&bare, 2)
    );
    println!(
        "  imp-runtime p50 - bare p50: {:.2} s ({:.2}x)",
        median(&wall) - median(&bare),
        median(&wall) / median(&bare)
    );
    // Detection: from the guest's announcement (taken by the runtime) to its Hello, per VM, as
    // imp-runtime logs it; the connect's backoff alone would add up to its 500 ms step.
    let detect: Vec<f64> = [h.runtime_log(), open.runtime_log()]
        .iter()
        .flat_map(|log| {
            log.lines()
                .filter_map(hello_after_announce_ms)
                .collect::<Vec<_>>()
        })
        .collect();
    let polled = (2 * (runs + 1)).saturating_sub(detect.len());
    if detect.is_empty() {
        println!("  announcement -> Hello: no VM's Hello followed an announcement");
    } else {
        let max = detect.iter().cloned().fold(0.0, f64::max);
        println!(
            "  announcement -> Hello: p50 {:.1} ms (max {max:.1} ms, {} VMs; {polled} found by a connect attempt first)",
            median(&detect),
            detect.len()
        );
    }
}

/// The `hello_after_announce_ms` of a "VM running" log line.
fn hello_after_announce_ms(line: &str) -> Option<f64> {
    let rest = line.split("hello_after_announce_ms=").nth(1)?;
    let rest = rest.strip_prefix("Some(").unwrap_or(rest);
    let num: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse().ok()
}
