//! Templates and clones with real guests (docs/snapshots.md): imp-runtime's QEMU backend (TCG
//! unless IMP_QEMU_ACCEL says otherwise) in a node namespace this test creates, VMs on one
//! ImpNetwork with NAT to an "internet" namespace (192.0.2.0/24 only inside them).
//!
//! One template is built and shared: the first `from_template` VM finds none and boots cold
//! (`TemplateMissing`), which starts the build; three clones restored from it in turn each
//! get their own address, MAC, hostname, machine-id and random state (read inside the guest
//! after identity), reach the "internet" through NAT, and run a job holding a fake secret;
//! then every file of the template is scanned for the secret and JIT-config-like content.
//! A spec with other boot args keys another template (`TemplateMissing`); a template whose
//! `meta.json` names another QEMU release boots cold after a runtime restart
//! (`TemplateVmmMismatch`) and is rebuilt, from which the next VM is cloned again; that clone
//! is suspended and resumed (same hostname, machine-id, MAC, address, a file it wrote, NAT),
//! then deleted with nothing left. Prints cold boot vs clone timings, restore and reidentify
//! seconds, an idle VM's QEMU RSS, the template's bytes and the clone's suspend and resume
//! (MEASURE lines). Everything (namespaces, processes, files) goes on drop, also on failure.
//!
//! Runs when the QEMU path can (imp_testkit::qemu) and with root and nft; otherwise says what
//! it skipped, or fails under IMP_REQUIRE_QEMU=1.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::measure::rss_kib;
use common::template::{self, put};
use common::{
    Children, Harness, TestNetwork, busybox_layer, nat_attachment, network_tests_can_run, output,
    peer_cgi, sh,
};
use imp_guest::host::HostClient;
use imp_runtime::api::{NetworkSpec, StartKind, TemplateState, TemplateStatus, VmSpec, VmState};
use imp_runtime::rootfs::store::ImageSpec;
use imp_runtime::runtime::template::reason;
use imp_testkit::qemu;

const GATEWAY: &str = "198.51.100.1";
const WEB: &str = "192.0.2.80";
/// The env key a runner's JIT config arrives in, and the fake secret the jobs get.
const JIT_KEY: &str = "ACTIONS_RUNNER_INPUT_JITCONFIG";

/// One test of this file at a time: each boots TCG guests, and two tests' guests at once load
/// two cores enough that restored guests now and then lose their vsock device (the runtime then
/// restores them again, see bring_up.rs `RESTORED_HELLO_WINDOW`): the tests measure, so they
/// take turns.
static GUESTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn ok(c: &mut HostClient, id: &str, script: &str) -> String {
    let (code, out) = sh(c, id, script, &[]).await;
    assert_eq!(code, Some(0), "{script}:\n{out}");
    out
}

async fn guest(h: &Harness, uid: &str) -> HostClient {
    let info = h.client.vsock(uid).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut c = imp_guest::host::connect(&info.path, info.guest_agent_port, deadline)
        .await
        .unwrap_or_else(|e| panic!("connect to {uid}: {e}\n{}", h.runtime_log()));
    c.set_answer_timeout(Duration::from_secs(120));
    c
}

/// The template `key` once it is no longer Building (fails on timeout).
async fn wait_built(h: &Harness, key: &str) -> TemplateStatus {
    template::wait_built(h, key, Duration::from_secs(600), Duration::from_millis(200)).await
}

/// Whether `needle` occurs in the file at `path` (read in chunks, overlapping by its length).
fn file_contains(path: &Path, needle: &[u8]) -> bool {
    use std::io::Read as _;
    let mut f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; 8 << 20];
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            return false;
        }
        let mut window = std::mem::take(&mut carry);
        window.extend_from_slice(&buf[..n]);
        if window.windows(needle.len()).any(|w| w == needle) {
            return true;
        }
        let keep = window.len().min(needle.len());
        carry = window[window.len() - keep..].to_vec();
    }
}

/// What a clone says about itself from inside.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Inside {
    hostname: String,
    machine_id: String,
    mac: String,
    address: String,
    random: String,
}

/// What the guest of `c` says about itself, asked by exec `id` (the agent answers a known id
/// from its exec table, so each asking needs its own).
async fn whoami(c: &mut HostClient, id: &str) -> Inside {
    let out = ok(
        c,
        id,
        "busybox hostname; busybox cat /etc/machine-id; busybox cat /sys/class/net/eth0/address; \
         busybox ip -4 -o addr show dev eth0 | busybox awk '{print $4}'; \
         busybox head -c 32 /dev/urandom | busybox od -An -tx1 | busybox tr -d ' \\n'; echo",
    )
    .await;
    let l: Vec<&str> = out.lines().collect();
    assert_eq!(l.len(), 5, "{out}");
    Inside {
        hostname: l[0].into(),
        machine_id: l[1].into(),
        mac: l[2].into(),
        address: l[3].into(),
        random: l[4].into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_one_template_are_distinct_networked_and_leave_no_secret_in_it() {
    let _turn = GUESTS.lock().await;
    let Some(s) = qemu::setup_or_skip() else {
        return;
    };
    if !network_tests_can_run() {
        return;
    }
    let id = std::process::id();
    // Declared first, dropped last: after the harness stopped the runtime and its VMMs.
    let tn = TestNetwork::new("imptq");
    let node = tn.node.clone();
    let mut children = Children::default();
    let files = tempfile::tempdir().unwrap();
    let initrd = files.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);
    let layers = vec![busybox_layer().dir("tmp", 0o1777).into_gzip()];
    let (registry, base) = tn.registry_in_node("imp/tmpl-base:qemu", layers);
    // The "internet": a web server whose CGI answers the address it sees.
    output(
        "ip",
        &[
            "-n",
            &tn.inet,
            "addr",
            "add",
            &format!("{WEB}/32"),
            "dev",
            "wan0",
        ],
    );
    let www = files.path().join("www");
    peer_cgi(&www);
    let www_s = www.display().to_string();
    children.spawn(
        &tn.inet,
        &["busybox", "httpd", "-f", "-p", "0.0.0.0:8080", "-h", &www_s],
    );

    let mut h = Harness::qemu(&s, &initrd, registry.host());
    h.netns = Some(node.clone());
    h.start_runtime().await;
    let net_id = format!("net-uid-{id}");
    let spec = |address: &str, extra: &str| VmSpec {
        vcpu: 1,
        memory_mib: 256,
        base_disk: None,
        image: Some(ImageSpec {
            base: base.clone(),
            runner: None,
            credentials: None,
            pull_policy: None,
        }),
        writable_disk_bytes: Some(64 << 20),
        kernel: None,
        initrd: None,
        extra_boot_args: Some(extra.into()),
        network: Some(NetworkSpec {
            guest_mac: None,
            attachment: Some(nat_attachment(&net_id, address, GATEWAY)),
        }),
        from_template: true,
        warm_paths: Vec::new(),
    };
    const ARGS: &str = "imp.report_grace_s=60";

    // No template yet: booted cold, and the build started.
    let (cold, cold_s) = put(&h, "boot1", &spec("198.51.100.10/24", ARGS)).await;
    let start = cold.start.clone().expect("start reported");
    assert_eq!(start.from, StartKind::Boot);
    assert_eq!(
        start.fallback.as_ref().map(|f| f.reason.as_str()),
        Some(reason::TEMPLATE_MISSING),
        "{start:?}"
    );
    // POST is idempotent and answers at once: the same key, Building (or already Ready).
    let t0 = Instant::now();
    let asked = h
        .client
        .ensure_template(&spec("198.51.100.99/24", ARGS))
        .await
        .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "POST answers at once"
    );
    assert_ne!(asked.state, TemplateState::Failed, "{asked:?}");
    let key = asked.key.clone();
    // The identity of the request is no part of the key.
    let again = h
        .client
        .ensure_template(&spec(
            "198.51.100.98/24",
            "imp.hostname=other imp.report_grace_s=60",
        ))
        .await
        .unwrap();
    assert_eq!(again.key, key);
    let idle_cold_rss = rss_kib(cold.pid.unwrap());
    let built = wait_built(&h, &key).await;
    assert_eq!(
        built.state,
        TemplateState::Ready,
        "{built:?}\n{}",
        h.runtime_log()
    );
    h.client.delete("boot1").await.unwrap();

    // The template's files: root's, 0600, and the rootfs image is referenced.
    let tdir = h.state_dir.join("templates").join(&key);
    let tfiles: Vec<_> = std::fs::read_dir(&tdir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(tfiles.iter().any(|p| p.ends_with("mem")), "{tfiles:?}");
    assert!(
        tfiles.iter().any(|p| p.ends_with("writable.img")),
        "{tfiles:?}"
    );
    for f in &tfiles {
        use std::os::unix::fs::MetadataExt as _;
        let m = std::fs::metadata(f).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o600), "{}", f.display());
    }

    // Three clones in turn.
    let mut seen: Vec<Inside> = Vec::new();
    let mut clone_s = Vec::new();
    let mut restore_s = Vec::new();
    let mut reident_s = Vec::new();
    let mut idle_clone_rss = 0;
    let secret = format!(
        "jit-secret-marker-{id}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    // The first alone, then two at once (a pool starts several VMs together).
    let ips = ["198.51.100.11", "198.51.100.12", "198.51.100.13"];
    let mut started = vec![put(&h, "clone0", &spec(&format!("{}/24", ips[0]), ARGS)).await];
    let (spec1, spec2) = (
        spec(&format!("{}/24", ips[1]), ARGS),
        spec(&format!("{}/24", ips[2]), ARGS),
    );
    let (s1, s2) = tokio::join!(put(&h, "clone1", &spec1), put(&h, "clone2", &spec2));
    started.extend([s1, s2]);
    for (i, (ip, (st, secs))) in ips.iter().zip(started).enumerate() {
        let uid = format!("clone{i}");
        let start = st.start.clone().expect("start reported");
        assert_eq!(
            start.from,
            StartKind::Clone,
            "{start:?}\n{}",
            h.runtime_log()
        );
        assert_eq!(start.template.as_deref(), Some(key.as_str()));
        assert!(start.fallback.is_none(), "{start:?}");
        clone_s.push(secs);
        restore_s.push(start.restore_seconds.unwrap());
        reident_s.push(start.reidentify_seconds.unwrap());
        if i == 0 {
            idle_clone_rss = rss_kib(st.pid.unwrap());
        }
        let mut c = guest(&h, &uid).await;
        let inside = whoami(&mut c, "whoami").await;
        assert_eq!(
            inside.hostname, uid,
            "the hostname a cold boot of the spec would get"
        );
        assert_eq!(inside.address, format!("{ip}/24"));
        assert_eq!(
            inside.mac,
            imp_runtime::network::format_mac(&imp_runtime::network::vm_mac(&uid)),
            "the MAC the bridge's anti-spoofing expects"
        );
        assert_eq!(inside.machine_id.len(), 32, "{inside:?}");
        for other in &seen {
            assert_ne!(other.hostname, inside.hostname);
            assert_ne!(other.machine_id, inside.machine_id);
            assert_ne!(other.mac, inside.mac);
            assert_ne!(other.address, inside.address);
            assert_ne!(other.random, inside.random, "random state shared");
        }
        // The "internet" through NAT: only a frame with this port's MAC and address passes
        // the bridge's anti-spoofing, so the answer proves the clone uses its own.
        let page = ok(
            &mut c,
            "web",
            &format!("busybox wget -q -O - http://{WEB}:8080/cgi-bin/peer"),
        )
        .await;
        assert_eq!(page, "peer=192.0.2.2", "NAT to the node's uplink address");
        // A job with a secret, written to the clone's drive.
        let (code, out) = sh(
            &mut c,
            "job",
            &format!("echo \"${JIT_KEY}\" > /job-output; busybox sync; busybox cat /job-output"),
            &[(JIT_KEY, &secret)],
        )
        .await;
        assert_eq!((code, out.trim()), (Some(0), secret.as_str()));
        drop(c);
        seen.push(inside);
        h.client.delete(&uid).await.unwrap();
    }
    // A clone the guest refuses an identity (a hostname it rejects; the template is the same,
    // identity words are no part of the key): Failed, never Running, its resources released.
    let e = h
        .client
        .ensure_running(
            "refused1",
            &spec(
                "198.51.100.14/24",
                "imp.hostname=bad_name imp.report_grace_s=60",
            ),
        )
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Some(reason::REIDENTIFY_FAILED), "{e}");
    let st = h.client.inspect("refused1").await.unwrap();
    assert_eq!(st.state, VmState::Failed);
    assert_eq!(st.start.as_ref().map(|s| s.from), Some(StartKind::Clone));
    assert!(
        !h.vms_dir().join("refused1").join("writable.img").exists(),
        "drive released"
    );
    assert!(
        imp_runtime::procfs::firecrackers_under(&h.vms_dir().join("refused1")).is_empty(),
        "no process left"
    );
    h.client.delete("refused1").await.unwrap();
    let listed = h.client.templates().await.unwrap();
    let t = listed.iter().find(|t| t.key == key).unwrap();
    assert_eq!(t.clones, 3, "{t:?}");
    // No secret, no JIT-config-like content in the template.
    for f in &tfiles {
        for needle in [
            secret.as_bytes(),
            JIT_KEY.as_bytes(),
            b"jitconfig".as_slice(),
        ] {
            assert!(
                !file_contains(f, needle),
                "{} holds {:?}",
                f.display(),
                String::from_utf8_lossy(needle)
            );
        }
    }
    let metrics = h.metrics().await;
    assert!(
        metrics.contains("imp_runtime_template_restores_total{outcome=\"cloned\"} 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("imp_runtime_reidentify_failures_total{reason=\"refused\"} 1"),
        "{metrics}"
    );

    // Other boot args: another template (a new key), not this one.
    let (other, _) = put(
        &h,
        "other1",
        &spec("198.51.100.20/24", "imp.report_grace_s=61"),
    )
    .await;
    let o = other.start.unwrap();
    assert_eq!(
        (o.from, o.fallback.map(|f| f.reason)),
        (StartKind::Boot, Some(reason::TEMPLATE_MISSING.to_string()))
    );
    h.client.delete("other1").await.unwrap();
    let other_key = h
        .client
        .templates()
        .await
        .unwrap()
        .into_iter()
        .find(|t| t.key != key)
        .expect("the other spec's template")
        .key;
    // Let its build finish (a runtime stopped mid-build leaves the build VM to the next
    // start's orphan sweep), then delete it: its files go.
    wait_built(&h, &other_key).await;
    h.client.delete_template(&other_key).await.unwrap();
    assert!(!h.state_dir.join("templates").join(&other_key).exists());

    // A template another QEMU release built (its recorded version edited; the QEMU stays the
    // real one, confined): cold boot with the reason, the template rebuilt, clones again.
    h.signal_runtime("TERM");
    let meta_path = tdir.join("meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    let recorded = meta["vmm"]["version"].as_str().unwrap().to_string();
    assert!(built.vmm.starts_with(&recorded), "{meta}");
    meta["vmm"]["version"] = "QEMU emulator version 99.0.0 (imp test)".into();
    std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    h.start_runtime().await;
    let (mm, _) = put(&h, "mism1", &spec("198.51.100.21/24", ARGS)).await;
    let m = mm.start.unwrap();
    assert_eq!(m.from, StartKind::Boot);
    let f = m.fallback.expect("a fallback");
    assert_eq!(f.reason, reason::TEMPLATE_VMM_MISMATCH, "{f:?}");
    assert!(f.message.contains("99.0.0"), "{}", f.message);
    h.client.delete("mism1").await.unwrap();
    let rebuilt = wait_built(&h, &key).await;
    assert_eq!(rebuilt.state, TemplateState::Ready, "{rebuilt:?}");
    assert_eq!(rebuilt.vmm, built.vmm, "rebuilt by this runtime's QEMU");
    let (st, _) = put(&h, "clone9", &spec("198.51.100.22/24", ARGS)).await;
    assert_eq!(st.start.unwrap().from, StartKind::Clone);

    // A clone suspends and resumes (its vsock device, plugged after the incoming migration,
    // unplugged; the VM migrated to a file) and comes back as itself.
    let mut c = guest(&h, "clone9").await;
    let before = whoami(&mut c, "whoami-suspend").await;
    ok(
        &mut c,
        "mark",
        "echo clone9-before > /suspend-marker; busybox sync",
    )
    .await;
    drop(c);
    let pre = h.client.inspect("clone9").await.unwrap();
    let info = h
        .client
        .suspend("clone9")
        .await
        .unwrap_or_else(|e| panic!("suspend a clone: {e}\n{}", h.runtime_log()));
    assert!(info.snapshot_bytes > 0, "{info:?}");
    let st = h.client.inspect("clone9").await.unwrap();
    assert_eq!((st.state, st.pid), (VmState::Suspended, None));
    assert!(h.vmm_processes().is_empty(), "{:?}", h.vmm_processes());
    let tap = h.tap_for("clone9");
    assert!(output("ip", &["-n", &node, "-o", "link", "show"]).contains(&tap));
    let resumed = h
        .client
        .resume("clone9")
        .await
        .unwrap_or_else(|e| panic!("resume a clone: {e}\n{}", h.runtime_log()));
    assert_eq!(resumed.status.state, VmState::Running);
    assert_eq!(
        (&resumed.status.vsock_path, &resumed.status.tap),
        (&pre.vsock_path, &pre.tap)
    );
    let mut c = guest(&h, "clone9").await;
    let after = whoami(&mut c, "whoami-resumed").await;
    assert_eq!(
        Inside {
            random: String::new(),
            ..after
        },
        Inside {
            random: String::new(),
            ..before
        },
        "the same identity after a resume"
    );
    assert_eq!(
        ok(&mut c, "marker", "busybox cat /suspend-marker")
            .await
            .trim(),
        "clone9-before"
    );
    let page = ok(
        &mut c,
        "web-resumed",
        &format!("busybox wget -q -O - http://{WEB}:8080/cgi-bin/peer"),
    )
    .await;
    assert_eq!(page, "peer=192.0.2.2", "its TAP carries it again");
    drop(c);
    println!(
        "MEASURE template_qemu: clone suspend {:.2} s ({:.1} MiB), resume to Hello {:.2} s",
        info.took_ms as f64 / 1000.0,
        info.snapshot_bytes as f64 / f64::from(1u32 << 20),
        resumed.took_ms as f64 / 1000.0
    );
    h.client.delete("clone9").await.unwrap();
    assert!(h.vmm_processes().is_empty(), "{:?}", h.vmm_processes());
    assert!(
        !h.vms_dir().join("clone9").exists(),
        "snapshot and files deleted"
    );
    assert!(!output("ip", &["-n", &node, "-o", "link", "show"]).contains(&tap));
    // A template whose memory file is cut short: the restore fails, the VM boots instead.
    std::fs::OpenOptions::new()
        .write(true)
        .open(tdir.join("mem"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let (st, _) = put(&h, "broken1", &spec("198.51.100.23/24", ARGS)).await;
    let b = st.start.unwrap();
    assert_eq!(b.from, StartKind::Boot);
    let f = b.fallback.expect("a fallback");
    assert_eq!(f.reason, reason::RESTORE_FAILED, "{f:?}");
    let mut c = guest(&h, "broken1").await;
    assert_eq!(ok(&mut c, "alive", "echo up").await.trim(), "up");
    drop(c);
    h.client.delete("broken1").await.unwrap();
    h.client.delete_template(&key).await.unwrap();

    // Nothing left: no process, no VM or template directory, no template in the list.
    assert!(h.vmm_processes().is_empty(), "{:?}", h.vmm_processes());
    assert!(h.client.list().await.unwrap().is_empty());
    assert!(h.client.templates().await.unwrap().is_empty());
    let left: Vec<_> = std::fs::read_dir(h.state_dir.join("templates"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let left: Vec<_> = std::fs::read_dir(h.vms_dir())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let links = output("ip", &["-n", &node, "-o", "link", "show"]);
    let mut owners: Vec<String> = [
        "boot1", "clone0", "clone1", "clone2", "refused1", "other1", "mism1", "clone9", "broken1",
    ]
    .map(String::from)
    .to_vec();
    owners.extend([&key, &other_key].map(|k| imp_runtime::runtime::template::holder(k)));
    for o in owners {
        let tap = h.tap_for(&o);
        assert!(!links.contains(&tap), "TAP {tap} of {o} left: {links}");
    }

    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    println!(
        "MEASURE template_qemu: cold boot create->Running {cold_s:.2} s (boot {:.2} s); clone create->Running median {:.2} s ({clone_s:.2?}: one alone, then two at once); restore median {:.2} s, reidentify median {:.3} s; template build {:.2} s",
        cold.boot_seconds.unwrap_or_default(),
        median(&mut clone_s.clone()),
        median(&mut restore_s),
        median(&mut reident_s),
        built.build_seconds.unwrap_or_default(),
    );
    println!(
        "MEASURE template_qemu: idle QEMU RSS cold VM {} MiB, clone {} MiB (256 MiB guest); template on disk {:.1} MiB",
        idle_cold_rss / 1024,
        idle_clone_rss / 1024,
        built.bytes as f64 / f64::from(1u32 << 20)
    );
    drop(children);
}

/// Warming with a real guest (docs/snapshots.md, "Warming"): a template whose spec has
/// `warm_paths` reads a directory of its image before the snapshot, and its `Warmed` counts
/// exactly that directory's files and bytes. Then the effect, measured (printed, not asserted):
/// an Exec reading those files in a clone of the warm template, against the same Exec in the
/// VM that booted cold meanwhile: from the disk (its first read, and reads after dropping its
/// page cache: what a clone of a template built without warming does) and from its page cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_template_holds_its_image_s_files_in_the_page_cache() {
    let _turn = GUESTS.lock().await;
    let Some(s) = qemu::setup_or_skip() else {
        return;
    };
    const FILES: usize = 16;
    const FILE_BYTES: usize = 3 << 20;
    let files = tempfile::tempdir().unwrap();
    let initrd = files.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);
    // Pseudo-random bytes: nothing in the image is a hole or compresses away.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut layer = busybox_layer()
        .dir("tmp", 0o1777)
        .dir("opt", 0o755)
        .dir("opt/runner", 0o755);
    for i in 0..FILES {
        let data: Vec<u8> = (0..FILE_BYTES)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        layer = layer.file(&format!("opt/runner/f{i:02}"), &data, 0o644);
    }
    let registry = imp_testkit::registry::Registry::start(Default::default())
        .await
        .unwrap();
    let base = imp_testkit::oci::push_gzip_image(
        &registry.host(),
        "imp/tmpl-warm:qemu",
        vec![layer.into_gzip()],
    )
    .await;
    let mut h = Harness::qemu(&s, &initrd, registry.host());
    h.start_runtime().await;
    let spec = VmSpec {
        vcpu: 1,
        memory_mib: 256,
        base_disk: None,
        image: Some(ImageSpec {
            base,
            runner: None,
            credentials: None,
            pull_policy: None,
        }),
        writable_disk_bytes: Some(64 << 20),
        kernel: None,
        initrd: None,
        extra_boot_args: Some("imp.report_grace_s=60".into()),
        network: None,
        from_template: true,
        warm_paths: vec!["/opt/runner".into()],
    };
    // No template yet: this VM boots cold and starts the build.
    let (cold, _) = put(&h, "wboot", &spec).await;
    assert_eq!(cold.start.map(|s| s.from), Some(StartKind::Boot));
    let key = h.client.ensure_template(&spec).await.unwrap().key;
    let built = wait_built(&h, &key).await;
    assert_eq!(
        built.state,
        TemplateState::Ready,
        "{built:?}\n{}",
        h.runtime_log()
    );
    let warm = built.warm.clone().expect("a warm report");
    assert_eq!(
        (
            warm.files,
            warm.bytes,
            warm.truncated,
            warm.error.as_deref()
        ),
        (FILES as u64, (FILES * FILE_BYTES) as u64, false, None),
        "{built:?}"
    );

    // An Exec reading the files, timed from the host: request to exit.
    let read = "busybox cat /opt/runner/* > /dev/null";
    async fn timed(c: &mut HostClient, id: &str, script: &str) -> f64 {
        let t = Instant::now();
        ok(c, id, script).await;
        t.elapsed().as_secs_f64()
    }
    let mut c = guest(&h, "wboot").await;
    let cold_noop = timed(&mut c, "noop", "true").await;
    let mut cold_reads = vec![timed(&mut c, "read1", read).await];
    let cold_again = timed(&mut c, "read2", read).await;
    for i in 0..3 {
        // The Exec's own shell is read back first (it was dropped too): a no-op before each.
        ok(
            &mut c,
            &format!("drop{i}"),
            "busybox sync; echo 3 > /proc/sys/vm/drop_caches",
        )
        .await;
        timed(&mut c, &format!("noop{i}"), "true").await;
        cold_reads.push(timed(&mut c, &format!("cold{i}"), read).await);
    }
    drop(c);
    h.client.delete("wboot").await.unwrap();
    let (st, clone_s) = put(&h, "wclone", &spec).await;
    assert_eq!(
        st.start.as_ref().map(|s| (s.from, s.template.clone())),
        Some((StartKind::Clone, Some(key.clone()))),
        "{st:?}"
    );
    let mut c = guest(&h, "wclone").await;
    let clone_noop = timed(&mut c, "noop", "true").await;
    let clone_first = timed(&mut c, "read1", read).await;
    let clone_again = timed(&mut c, "read2", read).await;
    drop(c);
    h.client.delete("wclone").await.unwrap();
    h.client.delete_template(&key).await.unwrap();
    assert!(h.vmm_processes().is_empty(), "{:?}", h.vmm_processes());
    assert!(h.client.templates().await.unwrap().is_empty());
    println!(
        "MEASURE template_qemu warm: {} files, {:.1} MiB warmed in {} ms; template build {:.2} s, {:.1} MiB on disk; clone create->Running {clone_s:.2} s",
        warm.files,
        warm.bytes as f64 / f64::from(1u32 << 20),
        warm.millis,
        built.build_seconds.unwrap_or_default(),
        built.bytes as f64 / f64::from(1u32 << 20),
    );
    println!(
        "MEASURE template_qemu warm: Exec reading them: cold-booted VM from its disk {cold_reads:.3?} s (first, then after dropping its page cache), from its page cache {cold_again:.3} s (no-op Exec {cold_noop:.3} s); clone of the warm template first {clone_first:.3} s, again {clone_again:.3} s (no-op Exec {clone_noop:.3} s)",
    );
}
