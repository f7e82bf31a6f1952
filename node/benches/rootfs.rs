//! The rootfs pipeline's costs, against a real registry (docker-registry on 127.0.0.1). Prints
//! numbers; not a test. `cargo bench -p imp-node --bench rootfs`.
//!
//! 1. Per-VM disk preparation once the image is cached (cache hit + writable drive), for a small
//!    and a large image: the ratio shows it does not grow with the image.
//! 2. Cold build (resolve, pull with digest checks, safe flatten, inject, mkfs.ext4 -d) against
//!    plain `tar -x` + `mkfs.ext4 -d` of the same layer blobs from local disk.
//!
//! IMP_BENCH_SMALL_MIB (default 20), IMP_BENCH_LARGE_MIB (default 2048), IMP_BENCH_HITS (20).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use imp_node::inventory::Inventory;
use imp_node::metrics::Metrics;
use imp_node::rootfs::flatten::Limits;
use imp_node::rootfs::pull::PullConfig;
use imp_node::rootfs::store::{ImageSpec, RootfsStore, StoreConfig};
use imp_node::rootfs::writable::WritableDrives;
use imp_testkit::oci::{LayerBlob, PushAuth, push_image};
use imp_testkit::registry::{Registry, RegistryOptions};
use imp_testkit::tarball::TarBuilder;

const LAYERS: usize = 3;
const WRITABLE_BYTES: u64 = 10 << 30;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Deterministic, incompressible bytes (xorshift): the worst case for gzip and for the copy.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// `total` bytes over LAYERS layers: a third in 1 MiB files, the rest in 64 KiB and 4 KiB files
/// (an OS image is mostly small files). Layer 2 whites out a few layer-1 files.
fn layers(total: u64) -> Vec<Vec<u8>> {
    let per_layer = total / LAYERS as u64;
    (0..LAYERS)
        .map(|l| {
            let mut tar = TarBuilder::new().dir(&format!("l{l}"), 0o755);
            let mut left = per_layer;
            let mut i = 0u64;
            while left > 0 {
                let size = match i % 3 {
                    0 => 1 << 20,
                    1 => 64 << 10,
                    _ => 4 << 10,
                }
                .min(left);
                tar = tar.file(
                    &format!("l{l}/f{i}"),
                    &noise(i * 31 + l as u64 + total, size as usize),
                    0o644,
                );
                left -= size;
                i += 1;
            }
            if l == 1 {
                for k in 0..10 {
                    tar = tar.whiteout(&format!("l0/f{k}"));
                }
            }
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            std::io::Write::write_all(&mut gz, &tar.into_tar()).unwrap();
            gz.finish().unwrap()
        })
        .collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

struct Image {
    label: String,
    reference: String,
    blobs: Vec<Vec<u8>>,
}

async fn store(dir: &Path, inv: &Inventory, registry: &Registry, guest: &Path) -> RootfsStore {
    RootfsStore::open(
        StoreConfig {
            dir: dir.to_path_buf(),
            guest_bin: guest.to_path_buf(),
            budget_bytes: u64::MAX,
            limits: Limits::default(),
            pull: PullConfig {
                insecure_registries: vec![registry.host()],
                ..PullConfig::default()
            },
            parallel_fetches: 3,
        },
        inv.pool().clone(),
        Metrics::new().rootfs.clone(),
    )
    .await
    .unwrap()
}

/// `tar -x` every layer in order, then `mkfs.ext4 -d` at the size the store chose.
fn plain_build(work: &Path, blobs: &[Vec<u8>], bytes: u64) -> Duration {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work.join("root")).unwrap();
    let files: Vec<PathBuf> = blobs
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let p = work.join(format!("layer{i}.tar.gz"));
            std::fs::write(&p, b).unwrap();
            p
        })
        .collect();
    let started = Instant::now();
    for f in &files {
        let ok = Command::new("tar")
            .arg("-xzf")
            .arg(f)
            .arg("-C")
            .arg(work.join("root"))
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }
    let img = work.join("plain.ext4");
    std::fs::File::create(&img).unwrap().set_len(bytes).unwrap();
    let ok = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-O", "^has_journal", "-d"])
        .arg(work.join("root"))
        .arg(&img)
        .status()
        .unwrap()
        .success();
    assert!(ok);
    std::fs::File::open(&img).unwrap().sync_all().unwrap();
    let took = started.elapsed();
    let _ = std::fs::remove_dir_all(work);
    took
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let small = env_u64("IMP_BENCH_SMALL_MIB", 20);
    let large = env_u64("IMP_BENCH_LARGE_MIB", 2048);
    let hits = env_u64("IMP_BENCH_HITS", 20) as usize;
    // On disk (not tmpfs): images, trees and blobs of several GiB.
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rootfs-bench");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let guest = base.join("imp-guest");
    std::fs::write(&guest, noise(7, 4 << 20)).unwrap();

    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let mut images = Vec::new();
    for mib in [small, large] {
        let t = Instant::now();
        let blobs = layers(mib << 20);
        let pushed: Vec<LayerBlob> = blobs.iter().cloned().map(LayerBlob::gzipped).collect();
        push_image(
            &registry.host(),
            &format!("bench/img{mib}:1"),
            &pushed,
            &PushAuth::Anonymous,
        )
        .await
        .unwrap();
        eprintln!(
            "prepared and pushed the {mib} MiB image ({} MiB gzip) in {:.1} s",
            blobs.iter().map(Vec::len).sum::<usize>() >> 20,
            t.elapsed().as_secs_f64()
        );
        images.push(Image {
            label: format!("{mib} MiB"),
            reference: format!("{}/bench/img{mib}:1", registry.host()),
            blobs,
        });
    }

    let inv = Inventory::open(&base).await.unwrap();
    let store = store(&base.join("rootfs"), &inv, &registry, &guest).await;
    let drives = WritableDrives::new(&base.join("templates")).unwrap();
    // The template is made once per size, before any VM: not a per-VM cost.
    drives.template(WRITABLE_BYTES).unwrap();

    println!("\n## Cold build: Imp's pipeline vs tar -x + mkfs.ext4 -d of the same layers");
    println!("| image | imp cold build | plain tar + mkfs | ratio | ext4 image |");
    println!("|---|---|---|---|---|");
    let mut cached = Vec::new();
    for img in &images {
        let spec = ImageSpec {
            base: img.reference.clone(),
            runner: None,
            credentials: None,
        };
        let t = Instant::now();
        let got = store.acquire("cold", &spec).await.unwrap();
        let cold = t.elapsed();
        assert!(!got.hit);
        store.release("cold").await.unwrap();
        let bytes = std::fs::metadata(&got.path).unwrap().len();
        let plain = plain_build(&base.join("plain"), &img.blobs, bytes);
        println!(
            "| {} | {:.0} ms | {:.0} ms | {:.2} | {} MiB |",
            img.label,
            ms(cold),
            ms(plain),
            cold.as_secs_f64() / plain.as_secs_f64(),
            bytes >> 20
        );
        cached.push((img, spec, got.path));
    }

    println!(
        "\n## Per-VM disk preparation with the image cached (hit + {} GiB writable drive)",
        WRITABLE_BYTES >> 30
    );
    println!("| image | median | max | copying the base instead (one run) |");
    println!("|---|---|---|---|");
    let mut medians = Vec::new();
    for (img, spec, path) in &cached {
        let mut times = Vec::new();
        for i in 0..hits {
            let vm = format!("vm-{i}");
            let drive = base.join(format!("{vm}.img"));
            let t = Instant::now();
            let got = store.acquire(&vm, spec).await.unwrap();
            drives.create(&drive, WRITABLE_BYTES).unwrap();
            times.push(t.elapsed());
            assert!(got.hit);
            WritableDrives::remove(&drive).unwrap();
            store.release(&vm).await.unwrap();
        }
        let copy = base.join("copy.ext4");
        let t = Instant::now();
        std::fs::copy(path, &copy).unwrap();
        std::fs::File::open(&copy).unwrap().sync_all().unwrap();
        let copied = t.elapsed();
        std::fs::remove_file(&copy).unwrap();
        let max = *times.iter().max().unwrap();
        let med = median(times);
        medians.push(med);
        println!(
            "| {} | {:.1} ms | {:.1} ms | {:.0} ms |",
            img.label,
            ms(med),
            ms(max),
            ms(copied)
        );
    }
    println!(
        "\nper-VM preparation ratio, {} / {}: {:.2}",
        images[1].label,
        images[0].label,
        medians[1].as_secs_f64() / medians[0].as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&base);
}
