//! The rootfs pipeline end to end in real guests: images the test builds and pushes to a real
//! registry (Debian's docker-registry on 127.0.0.1) become one cached read-only ext4 base with
//! RootfsStore, each VM gets its own writable drive from WritableDrives, and two VMs boot from
//! that one base under QEMU (imp_testkit::qemu: the initrd of images/initrd/build.sh, imp-guest
//! as /init with `imp.lower=/dev/vda imp.overlay=/dev/vdb`). Everything inside the guests is
//! checked over the hybrid vsock with the host client's Exec.
//!
//! Runs when the QEMU path can (see imp_testkit::qemu): otherwise it says what it skipped, or
//! fails under IMP_REQUIRE_QEMU=1. guest/vm-test.sh runs it.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use base64::Engine;
use imp_common::SecretString;
use imp_guest::host::HostClient;
use imp_guest::protocol::{Exec, Exited, GuestToHost, OutputStream};
use imp_runtime::inventory::Inventory;
use imp_runtime::metrics::Metrics;
use imp_runtime::rootfs::flatten::Limits;
use imp_runtime::rootfs::pull::PullConfig;
use imp_runtime::rootfs::store::{ImageSpec, RootfsStore, StoreConfig};
use imp_runtime::rootfs::writable::WritableDrives;
use imp_testkit::oci::push_gzip_image;
use imp_testkit::qemu::{self, Drive};
use imp_testkit::registry::{Registry, RegistryOptions};
use imp_testkit::tarball::TarBuilder;
use sha2::{Digest, Sha256};

const WRITABLE_BYTES: u64 = 128 << 20;

/// Layer 1: a static busybox as /bin/sh, /etc/passwd, the marker, a file layer 2 deletes and a
/// directory layer 2 makes opaque. Layer 2: the whiteout, the opaque marker and its own content.
fn base_layers() -> Vec<Vec<u8>> {
    let busybox = std::fs::read("/bin/busybox").unwrap();
    vec![
        TarBuilder::new()
            .dir("bin", 0o755)
            .file("bin/busybox", &busybox, 0o755)
            .symlink("bin/sh", "busybox")
            .dir("etc", 0o755)
            .file(
                "etc/passwd",
                b"root:x:0:0::/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n",
                0o644,
            )
            .file("etc/marker", b"from the registry\n", 0o644)
            .file("etc/gone", b"deleted by layer 2\n", 0o644)
            .dir("opt", 0o755)
            .dir("opt/data", 0o755)
            .file("opt/data/lower", b"hidden by the opaque dir\n", 0o644)
            .dir("opt/data/lower-dir", 0o755)
            .file("opt/data/lower-dir/deep", b"hidden too\n", 0o644)
            .into_gzip(),
        TarBuilder::new()
            .whiteout("etc/gone")
            .dir("opt/data", 0o755)
            .opaque("opt/data")
            .file("opt/data/upper", b"layer 2\n", 0o644)
            .into_gzip(),
    ]
}

fn sha256_file(path: &Path) -> String {
    hex::encode(Sha256::digest(std::fs::read(path).unwrap()))
}

/// One guest: its VM and host client, and a counter for unique exec ids.
struct Guest {
    vm: qemu::Vm,
    client: HostClient,
    execs: u32,
}

impl Guest {
    /// `sh -c script` to completion as root: stdout, stderr and how it ended.
    async fn sh(&mut self, script: &str) -> (String, String, Exited) {
        self.run(script, None, 60).await
    }

    /// `sh -c script` as `uid` (its gid the same, no supplementary groups: how the guest starts
    /// the runner), or as root, with a timeout.
    async fn run(
        &mut self,
        script: &str,
        uid: Option<u32>,
        timeout_s: u64,
    ) -> (String, String, Exited) {
        self.execs += 1;
        let id = format!("exec-{}", self.execs);
        let req = Exec {
            id: id.clone(),
            argv: ["/bin/sh", "-c", script].map(String::from).to_vec(),
            env: BTreeMap::from([
                (
                    "PATH".to_owned(),
                    SecretString::from(
                        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    ),
                ),
                ("HOME".to_owned(), SecretString::from("/tmp")),
            ]),
            cwd: None,
            uid,
            gid: uid,
            refuse_root: false,
            timeout_s: Some(timeout_s),
            stream_output: true,
            poweroff_on_exit: false,
        };
        self.client.exec(req).await.unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(timeout_s + 30), self.client.recv())
                .await
                .unwrap_or_else(|_| panic!("{script}: no Exited\n{}", self.vm.console_text()))
                .unwrap();
            match msg {
                GuestToHost::Output(o) if o.id == id => {
                    let data = base64::engine::general_purpose::STANDARD
                        .decode(&o.data_b64)
                        .unwrap();
                    match o.stream {
                        OutputStream::Stdout => out.extend(data),
                        OutputStream::Stderr => err.extend(data),
                    }
                }
                GuestToHost::Exited(e) if e.id == id => {
                    return (
                        String::from_utf8(out).unwrap(),
                        String::from_utf8(err).unwrap(),
                        e,
                    );
                }
                _ => {}
            }
        }
    }

    /// `sh -c script`, which must succeed: its stdout.
    async fn ok(&mut self, script: &str) -> String {
        let (out, err, e) = self.sh(script).await;
        assert_eq!(e.code, Some(0), "{script}: {e:?}\n{out}\n{err}");
        out
    }

    async fn shutdown(mut self) {
        self.client.shutdown().await.unwrap();
        self.vm.wait_end();
        let text = self.vm.console_text();
        assert!(
            text.contains("IMP-GUEST stage=shutdown reason=HostRequested"),
            "{text}"
        );
    }
}

fn boot(s: &qemu::Setup, initrd: &Path, base: &Path, writable: &Path, name: &str) -> qemu::Vm {
    qemu::Vm::start(
        s,
        initrd,
        &[Drive::read_only(base), Drive::writable(writable)],
        &format!(
            "imp.lower=/dev/vda imp.overlay=/dev/vdb imp.hostname={name} imp.report_grace_s=60"
        ),
    )
}

/// `debugfs -R 'cat <path>'` on a copy of `drive` whose journal e2fsck has replayed (the guest
/// syncs but does not unmount, so the last metadata may still be in the journal). None when the
/// file is not there.
fn read_from_drive(drive: &Path, path: &str, scratch: &Path) -> Option<String> {
    let copy = scratch.join(format!(
        "{}.check",
        drive.file_name().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&copy);
    assert!(
        Command::new("cp")
            .arg("--sparse=always")
            .arg(drive)
            .arg(&copy)
            .status()
            .unwrap()
            .success()
    );
    let fsck = Command::new("e2fsck")
        .arg("-fy")
        .arg(&copy)
        .output()
        .unwrap();
    // 0: clean, 1: errors corrected (a replayed journal counts).
    assert!(
        matches!(fsck.status.code(), Some(0 | 1)),
        "e2fsck {}: {fsck:?}",
        drive.display()
    );
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("cat {path}"))
        .arg(&copy)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("File not found") {
        return None;
    }
    assert!(out.status.success(), "debugfs: {stderr}");
    Some(String::from_utf8(out.stdout).unwrap())
}

/// The mount of `path` in the guest's /proc/mounts text: (source, fstype).
fn mount_of(mounts: &str, path: &str) -> (String, String) {
    let line = mounts
        .lines()
        .rfind(|l| l.split_whitespace().nth(1) == Some(path))
        .unwrap_or_else(|| panic!("{path} is not a mount point in the guest:\n{mounts}"));
    let f: Vec<&str> = line.split_whitespace().collect();
    (f[0].to_owned(), f[2].to_owned())
}

/// What a container engine needs from the guest (issue 31), asserted inside it: cgroup v2 with
/// its controllers delegated (a child cgroup gets memory and pids limits), /var/lib/docker on
/// the writable drive's plain ext4 (overlay2 works there), the engine's modules loaded from the
/// initrd, and a wall clock that agrees with the host's.
async fn container_engine_support(g: &mut Guest) {
    let mounts = g.ok("cat /proc/mounts").await;
    let (_, fstype) = mount_of(&mounts, "/sys/fs/cgroup");
    assert_eq!(fstype, "cgroup2");
    let offered = g.ok("cat /sys/fs/cgroup/cgroup.controllers").await;
    let delegated = g.ok("cat /sys/fs/cgroup/cgroup.subtree_control").await;
    assert_eq!(delegated, offered, "not every controller is delegated");
    for c in ["cpu", "memory", "pids", "io"] {
        assert!(
            delegated.split_whitespace().any(|d| d == c),
            "{c} not delegated: {delegated}"
        );
    }
    // What dockerd/runc do: a child cgroup with limits, a process moved into it.
    let child = g
        .ok(
            "mkdir /sys/fs/cgroup/imp-test && echo 64M > /sys/fs/cgroup/imp-test/memory.max && \
             echo 50 > /sys/fs/cgroup/imp-test/pids.max && \
             sh -c 'echo $$ > /sys/fs/cgroup/imp-test/cgroup.procs && cat /proc/self/cgroup' && \
             cat /sys/fs/cgroup/imp-test/memory.max /sys/fs/cgroup/imp-test/pids.max",
        )
        .await;
    assert_eq!(child, "0::/imp-test\n67108864\n50\n");
    g.ok("rmdir /sys/fs/cgroup/imp-test").await;

    for dir in ["/var/lib/docker", "/var/lib/containerd"] {
        let (source, fstype) = mount_of(&mounts, dir);
        assert_eq!(
            (source.as_str(), fstype.as_str()),
            ("/dev/vdb", "ext4"),
            "{dir}"
        );
    }
    // overlay2's own mount, with its upper layer in /var/lib/docker (refused on an overlay).
    let merged = g
        .ok(
            "d=/var/lib/docker/probe && mkdir -p $d/l $d/u $d/w $d/m && echo low > $d/l/f && \
             mount -t overlay overlay -o lowerdir=$d/l,upperdir=$d/u,workdir=$d/w $d/m && \
             echo up >> $d/m/f && cat $d/m/f && umount $d/m && cat $d/u/f && rm -rf $d",
        )
        .await;
    assert_eq!(merged, "low\nup\nlow\nup\n");

    let modules = g.ok("cat /proc/modules").await;
    let loaded: Vec<&str> = modules
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for m in [
        "overlay",
        "bridge",
        "veth",
        "br_netfilter",
        "nf_tables",
        "nft_compat",
        "nft_chain_nat",
        "nf_nat",
        "nf_conntrack",
        "xt_MASQUERADE",
        "xt_addrtype",
        "xt_conntrack",
        "iptable_nat",
    ] {
        assert!(loaded.contains(&m), "module {m} not loaded: {loaded:?}");
    }
    assert!(
        g.vm.console_text()
            .contains("IMP-GUEST stage=cgroup ok delegated="),
        "{}",
        g.vm.console_text()
    );

    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let guest: i64 = g.ok("date +%s").await.trim().parse().unwrap();
    assert!(
        (guest - host).abs() <= 30,
        "guest clock {guest} vs host {host}"
    );
}

/// Run `test` on a thread with a 16 MiB stack: in a debug build each nested async fn polling
/// the host client's futures takes a large frame, and the test thread's 2 MiB overflows.
fn on_big_stack<F: std::future::Future<Output = ()> + Send + 'static>(test: F) {
    std::thread::Builder::new()
        .stack_size(16 << 20)
        .spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(test)
        })
        .unwrap()
        .join()
        .expect("the test failed (its panic is printed above)");
}

#[test]
fn two_vms_boot_from_one_registry_built_base() {
    let Some(s) = qemu::setup_or_skip() else {
        return;
    };
    on_big_stack(two_vms(s));
}

/// The reference base image's only layer (images/base/build.sh's OCI layout): gzip bytes.
/// The runtime's inventory and rootfs store in `dir`, pulling from the test's local `registry`.
async fn open_store(
    dir: &Path,
    s: &qemu::Setup,
    registry: &Registry,
    budget_bytes: u64,
) -> (Inventory, RootfsStore) {
    let inventory = Inventory::open(dir).await.unwrap();
    let store = RootfsStore::open(
        StoreConfig {
            dir: dir.join("rootfs"),
            guest_bin: s.guest_bin.clone(),
            budget_bytes,
            limits: Limits::default(),
            pull: PullConfig {
                insecure_registries: vec![registry.host()],
                node_local_registries: vec![registry.host()],
                ..PullConfig::default()
            },
            parallel_fetches: 3,
        },
        inventory.pool().clone(),
        Metrics::new().rootfs.clone(),
    )
    .await
    .unwrap();
    (inventory, store)
}

fn base_image_layer(layout: &Path) -> Vec<u8> {
    let json = |p: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_slice(
            &std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        )
        .unwrap()
    };
    let blob = |digest: &serde_json::Value| {
        layout
            .join("blobs/sha256")
            .join(digest.as_str().unwrap().trim_start_matches("sha256:"))
    };
    let index = json(layout.join("index.json"));
    let manifest = json(blob(&index["manifests"][0]["digest"]));
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "images/base/build.sh writes one layer");
    std::fs::read(blob(&layers[0]["digest"])).unwrap()
}

/// Docker in a real guest (QEMU, TCG) booted from the reference base image: the runner user
/// (uid 1001, no supplementary groups, as the guest starts the runner) starts dockerd through
/// passwordless sudo (imp-start-dockerd, what imp-runner does), then imports an image and runs a
/// container on the default bridge network that prints a marker. Prints boot -> dockerd ready.
/// Needs IMP_BASE_IMAGE_LAYOUT (the layout of images/base/build.sh); otherwise SKIPPED
/// (IMP_REQUIRE_BASE_IMAGE=1 fails instead).
#[test]
fn docker_runs_in_a_reference_base_image_guest() {
    let Some(s) = qemu::setup_or_skip() else {
        return;
    };
    // `make unit` passes it empty when it built no layout.
    let Some(layout) = std::env::var_os("IMP_BASE_IMAGE_LAYOUT").filter(|v| !v.is_empty()) else {
        imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_BASE_IMAGE",
            "Docker in a reference-base-image guest",
            "IMP_BASE_IMAGE_LAYOUT is not set (an OCI layout from images/base/build.sh --out DIR)",
        );
        return;
    };
    on_big_stack(docker_in_guest(s, std::path::PathBuf::from(layout)));
}

async fn docker_in_guest(s: qemu::Setup, layout: std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let base_ref = push_gzip_image(
        &registry.host(),
        "imp/runner-base:docker",
        vec![base_image_layer(&layout)],
    )
    .await;
    let (_inventory, store) = open_store(dir.path(), &s, &registry, 4 << 30).await;
    let spec = ImageSpec {
        base: base_ref,
        runner: None,
        credentials: None,
        pull_policy: None,
    };
    let built = std::time::Instant::now();
    let rootfs = store.acquire("vm-docker", &spec).await.unwrap();
    println!(
        "base image pulled and built in {:.1} s ({} bytes)",
        built.elapsed().as_secs_f64(),
        std::fs::metadata(&rootfs.path).unwrap().len()
    );
    let drives = WritableDrives::new(&dir.path().join("templates")).unwrap();
    let rw = dir.path().join("vm-docker.rw");
    drives.create(&rw, 2 << 30).unwrap();
    let initrd = dir.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);

    let vm = boot(&s, &initrd, &rootfs.path, &rw, "imp-docker");
    let client = vm.connect().await;
    let mut g = Guest {
        vm,
        client,
        execs: 0,
    };
    let (out, err, e) = g
        .run("sudo -n /usr/local/sbin/imp-start-dockerd", Some(1001), 300)
        .await;
    let ready = g.vm.started.elapsed();
    assert_eq!(
        e.code,
        Some(0),
        "imp-start-dockerd: {out}\n{err}\n{}",
        g.ok("tail -n 40 /var/log/imp/dockerd.log").await
    );
    println!(
        "QEMU start -> dockerd ready: {:.1} s ({})",
        ready.as_secs_f64(),
        out.trim()
    );
    let info = g
        .run(
            "docker info --format '{{.Driver}} {{.CgroupVersion}} {{.DockerRootDir}}'",
            Some(1001),
            120,
        )
        .await;
    assert_eq!(info.2.code, Some(0), "{info:?}");
    assert_eq!(info.0.trim(), "overlay2 2 /var/lib/docker", "{info:?}");
    // An image from the guest's own files (no registry needed), run on the default bridge.
    let step = std::time::Instant::now();
    let (out, err, e) = g
        .run(
            "set -e; tar -chf /tmp/img.tar -C / usr/bin/echo lib64/ld-linux-x86-64.so.2 \
             usr/lib/x86_64-linux-gnu/libc.so.6 && docker import /tmp/img.tar imp/echo:1 >/dev/null && \
             docker run --rm imp/echo:1 /usr/bin/echo IMP-DOCKER-MARKER from $(id -u)",
            Some(1001),
            300,
        )
        .await;
    assert_eq!(e.code, Some(0), "docker step: {out}\n{err}");
    assert_eq!(out.trim(), "IMP-DOCKER-MARKER from 1001", "{err}");
    println!("docker import + run: {:.1} s", step.elapsed().as_secs_f64());
    g.shutdown().await;
    store.release("vm-docker").await.unwrap();
}

async fn two_vms(s: qemu::Setup) {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let base_ref = push_gzip_image(&registry.host(), "imp/base:qemu", base_layers()).await;
    let runner_ref = push_gzip_image(
        &registry.host(),
        "imp/runner:qemu",
        vec![
            TarBuilder::new()
                .dir("opt", 0o755)
                .dir("opt/actions-runner", 0o755)
                .file(
                    "opt/actions-runner/run.sh",
                    b"#!/bin/sh\necho runner says hello\n",
                    0o755,
                )
                .into_gzip(),
        ],
    )
    .await;

    let (_inventory, store) = open_store(dir.path(), &s, &registry, 1 << 30).await;
    let spec = ImageSpec {
        base: base_ref,
        runner: Some(runner_ref),
        credentials: None,
        pull_policy: None,
    };
    let built = std::time::Instant::now();
    let first = store.acquire("vm-1", &spec).await.unwrap();
    println!(
        "base image built in {:.1} s: {} ({} bytes)",
        built.elapsed().as_secs_f64(),
        first.path.display(),
        std::fs::metadata(&first.path).unwrap().len()
    );
    let second = store.acquire("vm-2", &spec).await.unwrap();
    assert!(!first.hit && second.hit, "{first:?} {second:?}");
    assert_eq!(first.path, second.path);
    let base = first.path.clone();
    let base_sha = sha256_file(&base);

    let drives = WritableDrives::new(&dir.path().join("templates")).unwrap();
    let (rw1, rw2) = (dir.path().join("vm-1.rw"), dir.path().join("vm-2.rw"));
    drives.create(&rw1, WRITABLE_BYTES).unwrap();
    drives.create(&rw2, WRITABLE_BYTES).unwrap();
    let initrd = dir.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);

    let vm = boot(&s, &initrd, &base, &rw1, "imp-vm-1");
    let client = vm.connect().await;
    let mut g1 = Guest {
        vm,
        client,
        execs: 0,
    };
    // The image's content, layers applied in order, the runner layer on top.
    assert_eq!(g1.ok("cat /etc/marker").await, "from the registry\n");
    assert_eq!(
        g1.ok("/opt/actions-runner/run.sh").await,
        "runner says hello\n"
    );
    assert_eq!(
        g1.ok("ls -l /bin/sh").await.split(" -> ").nth(1),
        Some("busybox\n")
    );
    let (_, _, e) = g1.sh("test -e /etc/gone").await;
    assert_eq!(e.code, Some(1), "the whited-out file is there");
    assert_eq!(g1.ok("ls -A /opt/data").await, "upper\n");
    assert_eq!(g1.ok("cat /opt/data/upper").await, "layer 2\n");
    // The injected guest agent is the binary that runs as PID 1.
    let injected = g1.ok("sha256sum /sbin/imp-guest").await;
    assert_eq!(
        injected.split_whitespace().next(),
        Some(sha256_file(&s.guest_bin).as_str())
    );
    assert!(
        g1.ok("grep ' / ' /proc/mounts")
            .await
            .starts_with("overlay / overlay")
    );
    container_engine_support(&mut g1).await;
    g1.ok("echo written in vm 1 > /etc/vm1-note && sync").await;

    // VM 2 boots from the same cached base while VM 1 runs, with its own writable drive.
    let vm = boot(&s, &initrd, &base, &rw2, "imp-vm-2");
    let client = vm.connect().await;
    let mut g2 = Guest {
        vm,
        client,
        execs: 0,
    };
    assert_eq!(g2.ok("hostname").await, "imp-vm-2\n");
    assert_eq!(g2.ok("cat /etc/marker").await, "from the registry\n");
    let (_, _, e) = g2.sh("test -e /etc/vm1-note").await;
    assert_eq!(e.code, Some(1), "VM 1's file is visible in VM 2");
    g2.ok("echo written in vm 2 > /etc/vm2-note && sync").await;
    assert_eq!(g1.ok("cat /etc/vm1-note").await, "written in vm 1\n");
    let (_, _, e) = g1.sh("test -e /etc/vm2-note").await;
    assert_eq!(e.code, Some(1), "VM 2's file is visible in VM 1");

    g1.shutdown().await;
    g2.shutdown().await;

    // The base was only read; each VM's changes are on its own writable drive (overlay upper).
    assert_eq!(sha256_file(&base), base_sha, "the base image changed");
    assert_eq!(
        read_from_drive(&rw1, "/upper/etc/vm1-note", dir.path()).as_deref(),
        Some("written in vm 1\n")
    );
    assert_eq!(
        read_from_drive(&rw1, "/upper/etc/vm2-note", dir.path()),
        None
    );
    assert_eq!(
        read_from_drive(&rw2, "/upper/etc/vm2-note", dir.path()).as_deref(),
        Some("written in vm 2\n")
    );
    assert_eq!(
        read_from_drive(&rw2, "/upper/etc/vm1-note", dir.path()),
        None
    );
    store.release("vm-1").await.unwrap();
    store.release("vm-2").await.unwrap();
}
