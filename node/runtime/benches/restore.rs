//! Snapshot standby (docs/snapshots.md): cold boot vs clone, each to "runner started", through
//! imp-runtime, one run, same host. Per VM: the create request (PUT /v1/vms/{uid}, what the agent
//! sends) until the runtime reports it Running (a clone: restored and reidentified), then what the
//! agent does next: connect to the guest agent over the vsock and `Exec` a command until the guest
//! answers `Started` (where the agent's handoff records the runner Started). Cold boots and clones
//! alternate (`IMP_BENCH_RUNS` each, default 5) so load on the shared host hits both alike; p50s and
//! their ratio (issue 32's goal: clone <= 0.5 x cold), the runtime's own restore and reidentify
//! seconds, the template build, and memory: the VMM's RSS of an idle cold-booted VM and of an idle
//! clone beside what a standby holds (the template's files on disk, no process).
//!
//! Backends: QEMU/TCG when the real-VM path can run (imp_testkit::qemu::setup_or_skip, a local
//! docker-registry for the image), and the Firecracker simulator through the jailer double (always;
//! its "guest" is a host process, so it measures Imp's own path, not a restore of guest memory).
//! A backend that cannot run prints why; IMP_REQUIRE_QEMU=1 makes QEMU's skip a failure.
//! `cargo bench -p imp-runtime --bench restore`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::Harness;
use common::measure::{env_u64, median, rss_kib, summary};
use imp_runtime::api::{StartKind, TemplateState, VmSpec, VmState};
use imp_testkit::oci::push_gzip_image;
use imp_testkit::qemu;
use imp_testkit::registry::{Registry, RegistryOptions};

/// One VM's start: create -> Running, and -> the guest's `Started` of the first Exec.
struct Start {
    running: f64,
    started: f64,
    restore: Option<f64>,
    reidentify: Option<f64>,
    rss_kib: u64,
}

async fn start(h: &Harness, uid: &str, spec: &VmSpec, clone: bool) -> Start {
    let spec = VmSpec {
        from_template: clone,
        ..spec.clone()
    };
    let t = Instant::now();
    let (_, st) = h
        .client
        .ensure_running(uid, &spec)
        .await
        .unwrap_or_else(|e| panic!("PUT {uid}: {e}\n{}", h.runtime_log()));
    assert_eq!(st.state, VmState::Running, "{st:?}");
    let running = t.elapsed().as_secs_f64();
    let report = st.start.clone().expect("a start report");
    let want = if clone {
        StartKind::Clone
    } else {
        StartKind::Boot
    };
    assert_eq!(report.from, want, "{uid}: {report:?}");
    let info = h.client.vsock(uid).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut c = imp_guest::host::connect(&info.path, info.guest_agent_port, deadline)
        .await
        .unwrap_or_else(|e| panic!("connect to {uid}: {e}"));
    c.set_answer_timeout(Duration::from_secs(120));
    c.exec(common::exec("runner", &["/bin/sh", "-c", "exit 0"]))
        .await
        .unwrap_or_else(|e| panic!("{uid}: exec: {e}"));
    let started = t.elapsed().as_secs_f64();
    c.wait_exited("runner").await.unwrap();
    Start {
        running,
        started,
        restore: report.restore_seconds,
        reidentify: report.reidentify_seconds,
        rss_kib: st.pid.map(rss_kib).unwrap_or(0),
    }
}

/// Build the template of `spec`, then `runs` cold boots and `runs` clones, alternating; print.
async fn measure(name: &str, h: &Harness, spec: &VmSpec, runs: usize) {
    // The first VM builds (or finds) the base image; a template request then builds the template.
    let warm = start(h, "warm-0", spec, false).await;
    h.client.delete("warm-0").await.unwrap();
    let t = Instant::now();
    let key = h.client.ensure_template(spec).await.unwrap().key;
    let template = loop {
        let all = h.client.templates().await.unwrap();
        if let Some(t) = all.iter().find(|t| t.key == key)
            && t.state != TemplateState::Building
        {
            break t.clone();
        }
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "{name}: template not built\n{}",
            h.runtime_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        template.state,
        TemplateState::Ready,
        "{name}: {template:?}\n{}",
        h.runtime_log()
    );
    let (mut cold, mut clones) = (Vec::new(), Vec::new());
    for i in 1..=runs {
        let uid = format!("cold-{i}");
        cold.push(start(h, &uid, spec, false).await);
        h.client.delete(&uid).await.unwrap();
        let uid = format!("clone-{i}");
        clones.push(start(h, &uid, spec, true).await);
        h.client.delete(&uid).await.unwrap();
    }
    assert!(h.vmm_processes().is_empty(), "{name}: a VMM was left");
    let col = |v: &[Start], f: fn(&Start) -> f64| v.iter().map(f).collect::<Vec<f64>>();
    let cold_started = col(&cold, |s| s.started);
    let clone_started = col(&clones, |s| s.started);
    println!(
        "{name}: {} vCPU, {} MiB, template {} MiB on disk, built in {:.2} s",
        spec.vcpu,
        spec.memory_mib,
        template.bytes >> 20,
        template.build_seconds.unwrap_or_default()
    );
    println!(
        "  first VM (image build or cache): {:.2} s to Running",
        warm.running
    );
    println!(
        "  cold boot: create -> Running {}",
        summary(&col(&cold, |s| s.running), 3)
    );
    println!(
        "  cold boot: create -> runner started {}",
        summary(&cold_started, 3)
    );
    println!(
        "  clone:     create -> Running {}",
        summary(&col(&clones, |s| s.running), 3)
    );
    println!(
        "  clone:     create -> runner started {}",
        summary(&clone_started, 3)
    );
    println!(
        "  clone:     restore (fresh VMM -> Hello) {}, reidentify {}",
        summary(&col(&clones, |s| s.restore.unwrap_or_default()), 3),
        summary(&col(&clones, |s| s.reidentify.unwrap_or_default()), 3)
    );
    println!(
        "  ratio clone / cold, create -> runner started (p50): {:.3}",
        median(&clone_started) / median(&cold_started)
    );
    // Detection: from the restored guest running (QEMU `cont`, Firecracker's load with
    // resume_vm) to its Hello, as imp-runtime logs it per clone.
    let detect: Vec<f64> = h
        .runtime_log()
        .lines()
        .filter(|l| l.contains("clone resumed"))
        .filter_map(|l| field_ms(l, "hello_after_resume_ms="))
        .collect();
    if !detect.is_empty() {
        let max = detect.iter().cloned().fold(0.0, f64::max);
        println!(
            "  clone: guest resumed -> Hello seen p50 {:.1} ms (max {max:.1} ms, {} clones)",
            median(&detect),
            detect.len()
        );
    }
    let rss = |v: &[Start]| median(&v.iter().map(|s| s.rss_kib as f64).collect::<Vec<_>>());
    println!(
        "  memory: idle cold-booted VM's VMM RSS p50 {:.0} MiB, idle clone's {:.0} MiB; a standby holds no process, {} MiB of template files on disk per node (shared by the pool)",
        rss(&cold) / 1024.0,
        rss(&clones) / 1024.0,
        template.bytes >> 20
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let runs = env_u64("IMP_BENCH_RUNS", 5).max(1) as usize;

    let Some(s) = qemu::setup_or_skip() else {
        if std::env::var("IMP_REQUIRE_QEMU").as_deref() == Ok("1") {
            panic!("IMP_REQUIRE_QEMU=1 but the QEMU path cannot run (reason above)");
        }
        println!("skipped QEMU: the real-VM path cannot run here (reason above)");
        return firecracker(runs).await;
    };
    let registry = match Registry::start(RegistryOptions::default()).await {
        Ok(r) => r,
        Err(e) => {
            println!("skipped QEMU: no local registry: {e}");
            return firecracker(runs).await;
        }
    };
    let images = tempfile::tempdir().unwrap();
    let initrd = images.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);
    let base = push_gzip_image(
        &registry.host(),
        "imp/runner-base:restore",
        vec![common::busybox_layer().into_gzip()],
    )
    .await;
    let mut h = Harness::qemu(&s, &initrd, registry.host());
    h.start_runtime().await;
    let spec = common::image_vm(base, 512, 128 << 20, false);
    measure(
        &format!("QEMU {} (TCG)", s.kernel.display()),
        &h,
        &spec,
        runs,
    )
    .await;
    drop(h);
    firecracker(runs).await;
}

/// The Firecracker simulator through the jailer double (production confines Firecracker).
async fn firecracker(runs: usize) {
    if common::is_root() {
        let mut h = Harness::new(common::jailed_simulator());
        h.extra_env
            .push(("IMP_JAILER_DOUBLE_KEEP_ROOT".into(), "1".into()));
        h.start_runtime().await;
        let spec = h.spec(false);
        measure("Firecracker simulator (jailed)", &h, &spec, runs.max(10)).await;
    } else {
        println!("skipped the Firecracker simulator: the jailer double needs root");
    }
}

/// The number after `field` in a log line.
fn field_ms(line: &str, field: &str) -> Option<f64> {
    let rest = line.split(field).nth(1)?;
    let num: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse().ok()
}
