//! Per-VM orchestration overhead of imp-runtime with the Firecracker simulator, and the
//! runtime's RSS per live VM. Prints numbers; not a test.
//!
//! Overhead = PUT /v1/vms/{uid} wall time (spawn, API configuration, TAP, disk, inventory,
//! InstanceStart, Hello over the hybrid vsock) minus the simulator's configured boot delay.
//! IMP_BENCH_VMS (default 100), IMP_BENCH_BOOT_DELAY_MS (default 0).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::measure::{env_u64, rss_kib};
use common::{Harness, is_root, simulator};
use imp_testkit::firecracker::Knobs;

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes --bench; nothing else to parse.
    let n = env_u64("IMP_BENCH_VMS", 100) as usize;
    let delay = Duration::from_millis(env_u64("IMP_BENCH_BOOT_DELAY_MS", 0));
    let network = is_root();
    let mut h = Harness::new(simulator());
    h.knobs(
        "*",
        Knobs {
            boot_delay_ms: delay.as_millis() as u64,
            ..Knobs::default()
        },
    );
    h.start_runtime().await;
    let pid = h.runtime_pid().expect("runtime pid");

    // Warm up (first sqlite writes, first spawn) and measure the idle baseline.
    let spec = h.spec(network);
    h.client
        .ensure_running("warmup", &spec)
        .await
        .expect("warmup VM");
    h.client.delete("warmup").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_idle = rss_kib(pid as i32);

    let mut put = Vec::with_capacity(n);
    let mut boot = Vec::with_capacity(n);
    for i in 0..n {
        let uid = format!("bench-{i}");
        let t0 = Instant::now();
        let (_, st) = h
            .client
            .ensure_running(&uid, &spec)
            .await
            .expect("VM starts");
        put.push(t0.elapsed().saturating_sub(delay));
        boot.push(Duration::from_secs_f64(st.boot_seconds.unwrap()).saturating_sub(delay));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_loaded = rss_kib(pid as i32);

    let mut inspect = Vec::with_capacity(n);
    for i in 0..n {
        let t0 = Instant::now();
        h.client.inspect(&format!("bench-{i}")).await.unwrap();
        inspect.push(t0.elapsed());
    }
    let mut delete = Vec::with_capacity(n);
    for i in 0..n {
        let t0 = Instant::now();
        h.client.delete(&format!("bench-{i}")).await.unwrap();
        delete.push(t0.elapsed());
    }
    assert!(h.vmm_processes().is_empty(), "every VM stopped");

    for v in [&mut put, &mut boot, &mut inspect, &mut delete] {
        v.sort();
    }
    println!(
        "imp-runtime orchestration benchmark: {n} VMs, simulator boot delay {delay:?} (subtracted), TAP {}",
        if network { "on" } else { "off (not root)" }
    );
    for (name, v) in [
        ("PUT (ensure running) overhead", &put),
        ("  of which spawn -> Hello", &boot),
        ("GET (inspect)", &inspect),
        ("DELETE (SendCtrlAltDel, cleanup)", &delete),
    ] {
        println!(
            "{name:36} p50 {:8.2} ms   p99 {:8.2} ms   max {:8.2} ms",
            ms(pct(v, 0.5)),
            ms(pct(v, 0.99)),
            ms(*v.last().unwrap())
        );
    }
    println!(
        "imp-runtime RSS: idle {} KiB, with {n} live VMs {} KiB => {:.1} KiB per live VM",
        rss_idle,
        rss_loaded,
        (rss_loaded.saturating_sub(rss_idle)) as f64 / n as f64
    );
}
