//! The rootfs pipeline's costs, against a real registry (docker-registry on 127.0.0.1) behind a
//! proxy that counts the requests reaching it. Prints numbers; not a test.
//! `cargo bench -p imp-runtime --bench rootfs` (release).
//!
//! 1. Cold build (resolve, pull with digest checks, safe flatten, inject, mkfs.ext4 -d; layers
//!    pipelined) against plain `tar -x` + `mkfs.ext4 -d` of the same layer blobs from local disk,
//!    for a small and a large image, in the same run.
//! 2. Per-VM disk preparation once the image is cached (cache hit + writable drive), for a
//!    digest-pinned reference (no registry round trip: requests counted at the registry) and for
//!    a tag under `Always` (one manifest round trip), small and large: the ratio shows it does not
//!    grow with the image.
//! 3. A newly rolled image: the first VM's preparation without a pre-build (it waits for the
//!    build) and with one (the agent asked the runtime to build it when the pool changed).
//!
//! IMP_BENCH_SMALL_MIB (default 20), IMP_BENCH_LARGE_MIB (default 512), IMP_BENCH_ROLL_MIB
//! (default 128), IMP_BENCH_HITS (default 50).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use imp_api::PullPolicy;
use imp_runtime::inventory::Inventory;
use imp_runtime::metrics::Metrics;
use imp_runtime::rootfs::flatten::Limits;
use imp_runtime::rootfs::pull::PullConfig;
use imp_runtime::rootfs::store::{ImageSpec, RootfsStore, StoreConfig};
use imp_runtime::rootfs::writable::WritableDrives;
use imp_testkit::oci::{LayerBlob, PushAuth, push_image};
use imp_testkit::proxy::CountingProxy;
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
/// `seed` tells images of one size apart (a rolled image must not share the old one's content key).
fn layers(total: u64, seed: u64) -> Vec<Vec<u8>> {
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
                    &noise(i * 31 + l as u64 + total + (seed << 40), size as usize),
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

struct Image {
    label: String,
    /// Through the counting proxy, by tag.
    reference: String,
    /// Through the counting proxy, by manifest digest.
    pinned: String,
    blobs: Vec<Vec<u8>>,
}

fn spec(reference: &str, policy: PullPolicy) -> ImageSpec {
    ImageSpec {
        base: reference.to_owned(),
        runner: None,
        credentials: None,
        pull_policy: Some(policy),
    }
}

fn percentile(v: &[Duration], p: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Push a `mib` MiB image as `bench/<name>:1` and name it through `proxy`.
async fn push(registry: &Registry, proxy: &CountingProxy, name: &str, mib: u64) -> Image {
    let t = Instant::now();
    let seed = name
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    let blobs = layers(mib << 20, seed);
    let pushed: Vec<LayerBlob> = blobs.iter().cloned().map(LayerBlob::gzipped).collect();
    let manifest = push_image(
        &registry.host(),
        &format!("bench/{name}:1"),
        &pushed,
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    eprintln!(
        "prepared and pushed the {mib} MiB image {name} ({} MiB gzip) in {:.1} s",
        blobs.iter().map(Vec::len).sum::<usize>() >> 20,
        t.elapsed().as_secs_f64()
    );
    Image {
        label: format!("{mib} MiB"),
        reference: format!("{}/bench/{name}:1", proxy.host()),
        pinned: format!("{}/bench/{name}@{}", proxy.host(), manifest.digest),
        blobs,
    }
}

async fn store(dir: &Path, inv: &Inventory, proxy: &CountingProxy, guest: &Path) -> RootfsStore {
    RootfsStore::open(
        StoreConfig {
            dir: dir.to_path_buf(),
            guest_bin: guest.to_path_buf(),
            budget_bytes: u64::MAX,
            limits: Limits::default(),
            pull: PullConfig {
                insecure_registries: vec![proxy.host()],
                node_local_registries: vec![proxy.host()],
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

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let small = env_u64("IMP_BENCH_SMALL_MIB", 20);
    let large = env_u64("IMP_BENCH_LARGE_MIB", 512);
    let roll = env_u64("IMP_BENCH_ROLL_MIB", 128);
    let hits = env_u64("IMP_BENCH_HITS", 50) as usize;
    // On disk (not tmpfs): images, trees and blobs of several GiB.
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rootfs-bench");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let guest = base.join("imp-guest");
    std::fs::write(&guest, noise(7, 4 << 20)).unwrap();
    println!("load average at start: {}", load());

    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let proxy = CountingProxy::start(registry.host()).await.unwrap();
    let images = vec![
        push(&registry, &proxy, &format!("img{small}"), small).await,
        push(&registry, &proxy, &format!("img{large}"), large).await,
    ];

    let inv = Inventory::open(&base).await.unwrap();
    let store = store(&base.join("rootfs"), &inv, &proxy, &guest).await;
    let drives = WritableDrives::new(&base.join("templates")).unwrap();
    // The template is made once per size, before any VM: not a per-VM cost.
    drives.template(WRITABLE_BYTES).unwrap();

    println!(
        "\n## Cold build: Imp's pipeline vs tar -x + mkfs.ext4 -d of the same layers (load {})",
        load()
    );
    println!("| image | imp cold build | plain tar + mkfs | ratio | ext4 image |");
    println!("|---|---|---|---|---|");
    let mut cached = Vec::new();
    for img in &images {
        let t = Instant::now();
        let got = store
            .acquire("cold", &spec(&img.pinned, PullPolicy::IfNotPresent))
            .await
            .unwrap();
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
        cached.push((img, got.path));
    }

    println!(
        "\n## Per-VM disk preparation with the image cached (hit + {} GiB writable drive), {hits} VMs each (load {})",
        WRITABLE_BYTES >> 30,
        load()
    );
    println!(
        "| image | reference | p50 | p90 | max | registry requests | copying the base instead (one run) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut p50s = BTreeMap::new();
    for (img, path) in &cached {
        for (kind, reference, policy) in [
            (
                "digest, IfNotPresent",
                &img.pinned,
                PullPolicy::IfNotPresent,
            ),
            ("tag, Always", &img.reference, PullPolicy::Always),
        ] {
            let spec = spec(reference, policy);
            let mut times = Vec::new();
            let before = proxy.requests();
            for i in 0..hits {
                let vm = format!("vm-{i}");
                let drive = base.join(format!("{vm}.img"));
                let t = Instant::now();
                let got = store.acquire(&vm, &spec).await.unwrap();
                drives.create(&drive, WRITABLE_BYTES).unwrap();
                times.push(t.elapsed());
                assert!(got.hit);
                WritableDrives::remove(&drive).unwrap();
                store.release(&vm).await.unwrap();
            }
            let requests = proxy.requests() - before;
            let copy = base.join("copy.ext4");
            let t = Instant::now();
            std::fs::copy(path, &copy).unwrap();
            std::fs::File::open(&copy).unwrap().sync_all().unwrap();
            let copied = t.elapsed();
            std::fs::remove_file(&copy).unwrap();
            let p50 = percentile(&times, 0.5);
            p50s.insert((kind, img.label.clone()), p50);
            println!(
                "| {} | {kind} | {:.2} ms | {:.2} ms | {:.2} ms | {requests} | {:.0} ms |",
                img.label,
                ms(p50),
                ms(percentile(&times, 0.9)),
                ms(*times.iter().max().unwrap()),
                ms(copied)
            );
        }
    }
    for kind in ["digest, IfNotPresent", "tag, Always"] {
        println!(
            "per-VM preparation p50 ratio ({kind}), {} / {}: {:.2}",
            images[1].label,
            images[0].label,
            p50s[&(kind, images[1].label.clone())].as_secs_f64()
                / p50s[&(kind, images[0].label.clone())].as_secs_f64()
        );
    }

    println!(
        "\n## A newly rolled {roll} MiB image: the first VM's preparation (load {})",
        load()
    );
    println!("| first VM | preparation | cache hit | pre-build (before the VM) |");
    println!("|---|---|---|---|");
    for (name, prebuild) in [("rolled-a", false), ("rolled-b", true)] {
        let img = push(&registry, &proxy, name, roll).await;
        let spec = spec(&img.reference, PullPolicy::IfNotPresent);
        let mut pre = String::from("none");
        if prebuild {
            // What the agent does when the pool's template changes.
            let t = Instant::now();
            let built = store.prebuild(&spec).await.unwrap();
            assert!(!built.hit);
            pre = format!("{:.0} ms", ms(t.elapsed()));
        }
        let drive = base.join("first.img");
        let t = Instant::now();
        let got = store.acquire("first", &spec).await.unwrap();
        drives.create(&drive, WRITABLE_BYTES).unwrap();
        let took = t.elapsed();
        WritableDrives::remove(&drive).unwrap();
        store.release("first").await.unwrap();
        assert_eq!(got.hit, prebuild);
        println!(
            "| {} | {:.1} ms | {} | {pre} |",
            if prebuild {
                "with pre-build"
            } else {
                "without pre-build"
            },
            ms(took),
            got.hit
        );
    }
    println!("\nload average at the end: {}", load());
    let _ = std::fs::remove_dir_all(&base);
}
