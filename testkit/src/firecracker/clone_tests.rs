//! Clones in the simulator (snapshot standby, issue 32): many VMMs load one template snapshot,
//! each with its own vsock path and a fresh guest agent that takes `Reidentify`; the load does
//! not read the memory file; every way a load fails, as Firecracker fails it. The simulator and
//! its guests run as the real binaries, as imp-runtime runs them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use imp_guest::host::{HostClient, HostError, IdentityCheck};
use imp_guest::protocol::ErrorCode;
use serde_json::{Value, json};

use super::reidentify_request;
use super::sim_tests::call;

const AGENT_PORT: u32 = 10000;

/// Root (TAPs; a clone agent's UTS namespace and entropy need CAP_SYS_ADMIN), else the
/// `SKIPPED` line and false.
fn root_or_skip(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    crate::skip::skip_or_fail("IMP_REQUIRE_ROOT", what, "needs root");
    false
}

fn fault(v: &Value) -> String {
    v["fault_message"].as_str().unwrap_or_default().to_string()
}

/// One simulator process (`--id <name>`, API socket `<dir>/<name>.api`), killed on drop. Its
/// guest's keeper sees the VMM go and takes the guest with it.
struct Sim {
    child: Child,
    api: PathBuf,
    console: PathBuf,
}

impl Sim {
    async fn start(dir: &Path, name: &str, env: &[(&str, &str)]) -> Sim {
        Sim::start_bin(&super::binaries().simulator, dir, name, env).await
    }

    /// `bin` (the simulator, or a real Firecracker) with Firecracker's flags.
    async fn start_bin(bin: &Path, dir: &Path, name: &str, env: &[(&str, &str)]) -> Sim {
        let bins = super::binaries();
        let api = dir.join(format!("{name}.api"));
        let console = dir.join(format!("{name}.console"));
        let mut cmd = Command::new(bin);
        cmd.args(["--id", name, "--api-sock"])
            .arg(&api)
            .env("IMP_GUEST_BIN", &bins.guest)
            .env_remove("IMP_SIM_BEHAVIOUR")
            .env_remove("IMP_SIM_REIDENTIFY")
            .stdout(std::fs::File::create(&console).unwrap())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        let sim = Sim {
            child,
            api,
            console,
        };
        // The file appears at bind(2), a moment before listen(2): wait for a connection.
        for _ in 0..1000 {
            if tokio::net::UnixStream::connect(&sim.api).await.is_ok() {
                return sim;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("simulator {name} did not bind its API socket");
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        call(&self.api, method, path, body).await
    }

    /// Exit status within 5 s (None: still running).
    fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn stderr(&mut self) -> String {
        let mut s = String::new();
        if let Some(e) = self.child.stderr.as_mut() {
            let _ = std::io::Read::read_to_string(e, &mut s);
        }
        s
    }

    /// Resident memory of the VMM process (kB, `VmRSS`).
    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TAP that exists for the test's length (`ip tuntap`), deleted on drop.
struct PersistentTap(String);

impl PersistentTap {
    fn add(name: &str) -> PersistentTap {
        let ok = Command::new("ip")
            .args(["tuntap", "add", "dev", name, "mode", "tap"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "ip tuntap add {name}");
        PersistentTap(name.into())
    }
}

impl Drop for PersistentTap {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", "dev", &self.0])
            .status();
    }
}

/// A TAP name of this test process (at most 15 characters).
fn tap_name(tag: &str) -> String {
    format!("i{tag}{}", std::process::id() % 1_000_000)
}

struct Template {
    snap: PathBuf,
    mem: PathBuf,
    /// The template VM's own vsock path (recorded in its snapshot).
    vsock: PathBuf,
    /// Cold boot: process spawn -> Hello, and InstanceStart -> Hello.
    spawn_to_hello: Duration,
    start_to_hello: Duration,
}

/// Boot a template VM ("tpl-<tag>", `mem_mib` of memory, optionally a NIC on a TAP the
/// simulator creates for the VM's lifetime), wait for its Hello, pause it and take a full
/// snapshot; then resume and stop it, so no guest of it is left behind.
async fn template(dir: &Path, tag: &str, mem_mib: u64, tap: Option<&str>) -> Template {
    let kernel = dir.join("vmlinux");
    std::fs::write(&kernel, b"kernel").unwrap();
    let t0 = Instant::now();
    let sim = Sim::start(dir, &format!("tpl-{tag}"), &[]).await;
    let vsock = dir.join(format!("tpl-{tag}.vsock"));
    let disk = dir.join(format!("tpl-{tag}.disk"));
    std::fs::write(&disk, b"disk").unwrap();
    for (path, body) in [
        (
            "/drives/rootfs",
            json!({"drive_id": "rootfs", "is_root_device": true, "is_read_only": true, "path_on_host": disk}),
        ),
        (
            "/machine-config",
            json!({"vcpu_count": 1, "mem_size_mib": mem_mib}),
        ),
        (
            "/boot-source",
            json!({"kernel_image_path": kernel, "boot_args": "console=ttyS0"}),
        ),
        ("/vsock", json!({"guest_cid": 3, "uds_path": vsock})),
    ] {
        let (s, v) = sim.call("PUT", path, Some(body)).await;
        assert_eq!(s, 204, "{path}: {v}");
    }
    if let Some(tap) = tap {
        let (s, v) = sim
            .call(
                "PUT",
                "/network-interfaces/eth0",
                Some(json!({"iface_id": "eth0", "host_dev_name": tap, "guest_mac": "06:00:0a:00:00:02"})),
            )
            .await;
        assert_eq!(s, 204, "{v}");
    }
    let started = Instant::now();
    let (s, v) = sim
        .call(
            "PUT",
            "/actions",
            Some(json!({"action_type": "InstanceStart"})),
        )
        .await;
    assert_eq!(s, 204, "{v}");
    let guest = connect(&vsock).await;
    let (spawn_to_hello, start_to_hello) = (t0.elapsed(), started.elapsed());
    drop(guest);
    let snap = dir.join(format!("tpl-{tag}.snap"));
    let mem = dir.join(format!("tpl-{tag}.mem"));
    for (path, method, body) in [
        ("/vm", "PATCH", json!({"state": "Paused"})),
        (
            "/snapshot/create",
            "PUT",
            json!({"snapshot_path": snap, "mem_file_path": mem, "snapshot_type": "Full"}),
        ),
        ("/vm", "PATCH", json!({"state": "Resumed"})),
    ] {
        let (s, v) = sim.call(method, path, Some(body)).await;
        assert_eq!(s, 204, "{path}: {v}");
    }
    drop(sim);
    // The template VMM's vsock socket: a clone must not find it (it binds its own).
    let _ = std::fs::remove_file(&vsock);
    Template {
        snap,
        mem,
        vsock,
        spawn_to_hello,
        start_to_hello,
    }
}

async fn connect(uds: &Path) -> HostClient {
    imp_guest::host::connect(
        uds,
        AGENT_PORT,
        tokio::time::Instant::now() + Duration::from_secs(15),
    )
    .await
    .unwrap_or_else(|e| panic!("no Hello on {}: {e}", uds.display()))
}

fn load_body(t: &Template, uds: &Path) -> Value {
    json!({
        "snapshot_path": t.snap,
        "mem_backend": {"backend_type": "File", "backend_path": t.mem},
        "vsock_override": {"uds_path": uds},
        "resume_vm": true,
    })
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Three clones of one template, loaded concurrently: each answers Hello on its own vsock
/// path, takes its own identity (hostname, machine-id, a random sample no other clone
/// answered), and its identity root lies beside its socket. The snapshot's own vsock path is
/// never bound by a clone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_clones_of_one_snapshot_each_answer_on_their_own_socket_and_take_their_own_identity()
{
    if !root_or_skip(
        "three_clones_of_one_snapshot_each_answer_on_their_own_socket_and_take_their_own_identity",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let t = template(dir.path(), "3c", 128, None).await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..3 {
        let dir = dir.path().to_path_buf();
        let body = load_body(&t, &dir.join(format!("clone-{i}.vsock")));
        tasks.spawn(async move {
            let sim = Sim::start(&dir, &format!("clone-{i}"), &[]).await;
            let (s, v) = sim.call("PUT", "/snapshot/load", Some(body)).await;
            assert_eq!(s, 204, "clone-{i}: {v}");
            let (_, info) = sim.call("GET", "/", None).await;
            assert_eq!(info["state"], "Running");
            let uds = dir.join(format!("clone-{i}.vsock"));
            let mut guest = connect(&uds).await;
            if i == 0 {
                // A clone agent manages no interface: a network part is refused, naming it.
                let mut req = reidentify_request("clone-0");
                req.network = Some(imp_guest::protocol::NetIdentity {
                    mac: "06:00:0a:00:00:07".into(),
                    address: "10.0.0.7".into(),
                    prefix: 24,
                    gateway: "10.0.0.1".into(),
                    mtu: None,
                    dns: vec![],
                    dns_search: vec![],
                });
                match guest.reidentify(req, &IdentityCheck::default()).await {
                    Err(HostError::Guest(e)) => {
                        assert_eq!(e.code, ErrorCode::IdentityFailed, "{e:?}");
                        assert!(e.message.contains("network"), "{e:?}");
                    }
                    other => panic!("a network part was not refused: {other:?}"),
                }
            }
            let req = reidentify_request(&format!("clone-{i}"));
            let got = guest
                .reidentify(req, &IdentityCheck::default())
                .await
                .unwrap_or_else(|e| panic!("clone-{i} reidentify: {e}"));
            (i, sim, guest, got)
        });
    }
    let mut clones = Vec::new();
    while let Some(r) = tasks.join_next().await {
        clones.push(r.unwrap());
    }
    clones.sort_by_key(|c| c.0);
    let mut samples = std::collections::BTreeSet::new();
    let mut machine_ids = std::collections::BTreeSet::new();
    for (i, sim, _, got) in &clones {
        assert_eq!(
            got.generation, 1,
            "clone-{i}: a fresh agent's first identity"
        );
        assert_eq!(got.hostname, format!("clone-{i}"));
        assert!(samples.insert(got.random_sample_b64.clone()), "clone-{i}");
        assert!(machine_ids.insert(got.machine_id.clone()), "clone-{i}");
        let root = dir.path().join(format!("clone-{i}.vsock.identity"));
        assert_eq!(
            std::fs::read_to_string(root.join("etc/machine-id"))
                .unwrap()
                .trim(),
            got.machine_id
        );
        let console = std::fs::read_to_string(&sim.console).unwrap();
        assert!(console.contains("clone of snapshot"), "{console}");
    }
    // The host's own hostname is untouched (each agent has a UTS namespace of its own).
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert!(!host.starts_with("clone-"), "{host}");
    assert!(!t.vsock.exists(), "no clone bound the template's socket");
    // Stopping a clone takes its guest and its identity root with it.
    let (_, sim, guest, _) = clones.remove(0);
    drop(guest);
    drop(sim);
    let root = dir.path().join("clone-0.vsock.identity");
    let deadline = Instant::now() + Duration::from_secs(5);
    while root.exists()
        || tokio::net::UnixStream::connect(dir.path().join("clone-0.vsock.agent"))
            .await
            .is_ok()
    {
        assert!(
            Instant::now() < deadline,
            "clone-0's guest outlived its VMM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A load maps the memory file and reads none of it: the same time for 64 MiB and 2 GiB, and
/// the VMM's resident memory stays far below the snapshot's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_time_and_resident_memory_do_not_grow_with_the_memory_size() {
    let dir = tempfile::tempdir().unwrap();
    let small = template(dir.path(), "small", 64, None).await;
    let big = template(dir.path(), "big", 2048, None).await;
    assert_eq!(std::fs::metadata(&big.mem).unwrap().len(), 2048 << 20);
    let mut times = [Vec::new(), Vec::new()];
    let mut rss = [0u64; 2];
    for round in 0..5 {
        for (k, t) in [&small, &big].into_iter().enumerate() {
            let name = format!("lazy-{k}-{round}");
            let sim = Sim::start(dir.path(), &name, &[]).await;
            let body = load_body(t, &dir.path().join(format!("{name}.vsock")));
            let t0 = Instant::now();
            let (s, v) = sim.call("PUT", "/snapshot/load", Some(body)).await;
            times[k].push(t0.elapsed());
            assert_eq!(s, 204, "{v}");
            rss[k] = rss[k].max(sim.rss_kib());
        }
    }
    let (small_t, big_t) = (median(times[0].clone()), median(times[1].clone()));
    println!(
        "snapshot load (PUT /snapshot/load, 5 each, median): 64 MiB {:.1} ms, 2 GiB {:.1} ms; VMM resident after load: {} KiB / {} KiB",
        ms(small_t),
        ms(big_t),
        rss[0],
        rss[1]
    );
    assert!(
        big_t < small_t * 3 + Duration::from_millis(30),
        "2 GiB load {big_t:?} vs 64 MiB {small_t:?}"
    );
    assert!(
        rss[1] < 64 * 1024,
        "the 2 GiB memory file was read in: {} KiB resident",
        rss[1]
    );
}

/// Every way a load fails, with Firecracker's messages: the body (refused, the process lives
/// on), a configured process (refused, lives on), and the restore (refused, then the process
/// exits with an error, as Firecracker's does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_fail_like_firecracker() {
    if !root_or_skip("loads_fail_like_firecracker") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tpl_tap = tap_name("t");
    let t = template(dir.path(), "fail", 64, Some(&tpl_tap)).await;
    let uds = dir.path().join("f.vsock");
    let base = load_body(&t, &uds);
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    let without = |k: &str| {
        let mut b = base.clone();
        b.as_object_mut().unwrap().remove(k);
        b
    };

    // The body, checked before anything is done: the process stays usable.
    let mut sim = Sim::start(dir.path(), "body", &[]).await;
    for (body, want) in [
        (with("bogus", json!(1)), "bogus"),
        (
            with("mem_file_path", json!(t.mem)),
            "too many fields: either `mem_backend` or `mem_file_path` exclusively is required",
        ),
        (
            without("mem_backend"),
            "missing field: either `mem_backend` or `mem_file_path` is required",
        ),
        (
            with(
                "mem_backend",
                json!({"backend_type": "File", "backend_path": t.mem, "extra": 1}),
            ),
            "extra",
        ),
        (
            with(
                "mem_backend",
                json!({"backend_type": "Disk", "backend_path": t.mem}),
            ),
            "Disk",
        ),
        (
            with("network_overrides", json!([{"iface_id": "eth0"}])),
            "host_dev_name",
        ),
        (
            with("network_overrides", json!({"iface_id": "eth0"})),
            "sequence",
        ),
        (with("resume_vm", json!("yes")), "boolean"),
        (with("vsock_override", json!({})), "uds_path"),
        (without("snapshot_path"), "snapshot_path"),
    ] {
        let (s, v) = sim.call("PUT", "/snapshot/load", Some(body.clone())).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert!(fault(&v).contains(want), "{body}: {v}");
    }
    assert_eq!(sim.call("GET", "/", None).await.1["state"], "Not started");
    // A configured process: refused, and it lives on.
    let (s, _) = sim
        .call(
            "PUT",
            "/machine-config",
            Some(json!({"vcpu_count": 1, "mem_size_mib": 64})),
        )
        .await;
    assert_eq!(s, 204);
    let override_tap = tap_name("o");
    let _tap = PersistentTap::add(&override_tap);
    let good = with(
        "network_overrides",
        json!([{"iface_id": "eth0", "host_dev_name": override_tap}]),
    );
    let (s, v) = sim.call("PUT", "/snapshot/load", Some(good.clone())).await;
    assert_eq!(s, 400);
    assert_eq!(
        fault(&v),
        "Load snapshot error: Loading a microVM snapshot not allowed after configuring boot-specific resources."
    );
    assert_eq!(sim.call("GET", "/", None).await.0, 200);
    assert!(
        sim.child.try_wait().unwrap().is_none(),
        "a refused load is not fatal"
    );
    drop(sim);

    // Restore failures: answered, then the process exits with an error; nothing is bound.
    std::fs::write(&uds, b"left behind").unwrap();
    let missing_mem = dir.path().join("gone.mem");
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "no-snap",
            with("snapshot_path", json!(dir.path().join("gone.snap"))),
            "Failed to restore from snapshot: Failed to get snapshot state from file: Failed to open snapshot file: No such file or directory",
        ),
        (
            "no-mem",
            with(
                "mem_backend",
                json!({"backend_type": "File", "backend_path": missing_mem}),
            ),
            "Failed to load guest memory: Error creating guest memory from file: Failed to load guest memory: No such file or directory",
        ),
        (
            "unknown-iface",
            with(
                "network_overrides",
                json!([{"iface_id": "eth9", "host_dev_name": override_tap}]),
            ),
            "Failed to get snapshot state from file: Unknown Network Device.",
        ),
        (
            "no-tap",
            with(
                "network_overrides",
                json!([{"iface_id": "eth0", "host_dev_name": tap_name("x")}]),
            ),
            "Net: Failed to create a network device: Open tap device failed: Error while creating ifreq structure: Operation not permitted (os error 1). Invalid TUN/TAP Backend provided by",
        ),
        // The snapshot's own TAP went with the template VMM: a load without an override
        // fails the same way.
        (
            "own-tap-gone",
            base.clone(),
            "Invalid TUN/TAP Backend provided by",
        ),
        (
            "uds-exists",
            good.clone(),
            "Failed to build microVM from snapshot: Failed to restore devices: Error restoring MMIO devices: VsockUnixBackend: Error binding to the host-side Unix socket: Address already in use",
        ),
        // Unknown fields inside an override are ignored, as Firecracker's structs do; this load
        // gets past the body to the restore.
        (
            "override-extra",
            with(
                "vsock_override",
                json!({"uds_path": dir.path().join("x/none.vsock"), "extra": true}),
            ),
            "Invalid TUN/TAP Backend",
        ),
    ];
    for (name, body, want) in cases {
        let mut sim = Sim::start(dir.path(), name, &[]).await;
        let (s, v) = sim.call("PUT", "/snapshot/load", Some(body)).await;
        assert_eq!(s, 400, "{name}: {v}");
        assert!(
            fault(&v).starts_with("Load snapshot error: "),
            "{name}: {v}"
        );
        assert!(fault(&v).contains(want), "{name}: {v}");
        let status = sim
            .exit_status()
            .unwrap_or_else(|| panic!("{name}: still running"));
        assert!(!status.success(), "{name}");
        assert!(sim.stderr().contains("Loading snapshot failed"), "{name}");
        assert!(!dir.path().join("x/none.vsock").exists());
    }
    // A drive of the snapshot that is gone (a load has no override for drives).
    let disk = dir.path().join("tpl-fail.disk");
    let moved = dir.path().join("moved.disk");
    std::fs::rename(&disk, &moved).unwrap();
    let mut sim = Sim::start(dir.path(), "no-drive", &[]).await;
    let (s, v) = sim.call("PUT", "/snapshot/load", Some(good.clone())).await;
    assert_eq!(s, 400, "{v}");
    assert!(
        fault(&v).contains("Error restoring MMIO devices: Block: Virtio backend error: Error manipulating the backing file: No such file or directory"),
        "{v}"
    );
    assert!(!sim.exit_status().unwrap().success());
    std::fs::rename(&moved, &disk).unwrap();
    // The same load with the socket file gone and the override TAP present succeeds.
    std::fs::remove_file(&uds).unwrap();
    let sim = Sim::start(dir.path(), "ok", &[]).await;
    let (s, v) = sim.call("PUT", "/snapshot/load", Some(good)).await;
    assert_eq!(s, 204, "{v}");
    drop(connect(&uds).await);
}

/// The knob IMP_SIM_REIDENTIFY: a clone whose agent refuses `Reidentify` (it manages no
/// identity), and one whose agent never answers it (the request is swallowed on its way in),
/// while the rest of the protocol works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reidentify_knob_makes_a_clone_refuse_or_never_answer() {
    let dir = tempfile::tempdir().unwrap();
    let t = template(dir.path(), "knob", 64, None).await;

    let refuse = Sim::start(dir.path(), "refuse", &[("IMP_SIM_REIDENTIFY", "refuse")]).await;
    let uds = dir.path().join("refuse.vsock");
    let (s, v) = refuse
        .call("PUT", "/snapshot/load", Some(load_body(&t, &uds)))
        .await;
    assert_eq!(s, 204, "{v}");
    let mut guest = connect(&uds).await;
    match guest
        .reidentify(reidentify_request("refuser"), &IdentityCheck::default())
        .await
    {
        Err(HostError::Guest(e)) => {
            assert_eq!(e.code, ErrorCode::IdentityFailed, "{e:?}");
            assert!(e.message.contains("manages no identity"), "{e:?}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(!dir.path().join("refuse.vsock.identity").exists());

    let hang = Sim::start(dir.path(), "hang", &[("IMP_SIM_REIDENTIFY", "hang")]).await;
    let uds = dir.path().join("hang.vsock");
    let (s, v) = hang
        .call("PUT", "/snapshot/load", Some(load_body(&t, &uds)))
        .await;
    assert_eq!(s, 204, "{v}");
    let mut guest = connect(&uds).await;
    guest.metrics().await.expect("other requests pass");
    let r = tokio::time::timeout(
        Duration::from_millis(1500),
        guest.reidentify(reidentify_request("hanger"), &IdentityCheck::default()),
    )
    .await;
    assert!(r.is_err(), "answered: {r:?}");
    let mut other = connect(&uds).await;
    other.metrics().await.expect("the guest is alive");
}

/// Timings (printed with --nocapture): cold boot to Hello; over 20 clones, load to Hello and the
/// Reidentify round trip (p50).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clone_timings() {
    if !root_or_skip("clone_timings") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cold = Vec::new();
    let mut cold_start = Vec::new();
    let mut t = None;
    for i in 0..10 {
        let tpl = template(dir.path(), &format!("time{i}"), 128, None).await;
        cold.push(tpl.spawn_to_hello);
        cold_start.push(tpl.start_to_hello);
        t = Some(tpl);
    }
    let t = t.unwrap();
    let (mut spawn_hello, mut load_hello, mut reid) = (Vec::new(), Vec::new(), Vec::new());
    let mut samples = Vec::new();
    for i in 0..20 {
        let name = format!("c{i}");
        let uds = dir.path().join(format!("{name}.vsock"));
        let t0 = Instant::now();
        let sim = Sim::start(dir.path(), &name, &[]).await;
        let t1 = Instant::now();
        let (s, v) = sim
            .call("PUT", "/snapshot/load", Some(load_body(&t, &uds)))
            .await;
        assert_eq!(s, 204, "{v}");
        let mut guest = connect(&uds).await;
        spawn_hello.push(t0.elapsed());
        load_hello.push(t1.elapsed());
        let t2 = Instant::now();
        let check = IdentityCheck {
            previous_samples: samples.clone(),
            ..IdentityCheck::default()
        };
        let got = guest
            .reidentify(reidentify_request(&name), &check)
            .await
            .unwrap();
        reid.push(t2.elapsed());
        samples.push(
            base64::engine::general_purpose::STANDARD
                .decode(&got.random_sample_b64)
                .unwrap(),
        );
    }
    println!(
        "simulator cold boot -> Hello: p50 {:.1} ms (InstanceStart -> Hello {:.1} ms), 10 runs",
        ms(median(cold)),
        ms(median(cold_start))
    );
    println!(
        "simulator clone, 20 runs: PUT /snapshot/load -> Hello p50 {:.1} ms (VMM spawn -> Hello {:.1} ms); Reidentify round trip p50 {:.1} ms",
        ms(median(load_hello)),
        ms(median(spawn_hello)),
        ms(median(reid))
    );
}

/// What needs no guest kernel is held against a real Firecracker when one is configured
/// (`IMP_FIRECRACKER_BIN` and the rest, see `real_or_skip`): the body checks, the refusal on a
/// configured process, and a missing state file (fatal to the process), in the same words from
/// the simulator and from Firecracker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_read_the_same_from_the_simulator_and_a_real_firecracker() {
    let mut vmms = vec![("sim", super::binaries().simulator.clone())];
    if let Some(fc) = super::real_or_skip(
        "refusals_read_the_same_from_the_simulator_and_a_real_firecracker",
        super::Needs::BaseDrive,
    ) {
        vmms.push(("real", fc.firecracker));
    }
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("any.mem");
    std::fs::write(&mem, b"").unwrap();
    let snap = dir.path().join("gone.snap");
    let base = json!({
        "snapshot_path": snap,
        "mem_backend": {"backend_type": "File", "backend_path": mem},
        "vsock_override": {"uds_path": dir.path().join("v.sock")},
    });
    for (kind, bin) in vmms {
        let sim = Sim::start_bin(&bin, dir.path(), &format!("{kind}-a"), &[]).await;
        for (body, want) in [
            (
                {
                    let mut b = base.clone();
                    b["mem_file_path"] = json!(mem);
                    b
                },
                "too many fields: either `mem_backend` or `mem_file_path` exclusively is required",
            ),
            (
                json!({"snapshot_path": snap}),
                "missing field: either `mem_backend` or `mem_file_path` is required",
            ),
            (
                {
                    let mut b = base.clone();
                    b["bogus"] = json!(true);
                    b
                },
                "bogus",
            ),
        ] {
            let (s, v) = sim.call("PUT", "/snapshot/load", Some(body)).await;
            assert_eq!(s, 400, "{kind}: {v}");
            assert!(fault(&v).contains(want), "{kind}: {v}");
        }
        let (s, v) = sim
            .call(
                "PUT",
                "/machine-config",
                Some(json!({"vcpu_count": 1, "mem_size_mib": 64})),
            )
            .await;
        assert_eq!(s, 204, "{kind}: {v}");
        let (s, v) = sim.call("PUT", "/snapshot/load", Some(base.clone())).await;
        assert_eq!(s, 400, "{kind}: {v}");
        assert_eq!(
            fault(&v),
            "Load snapshot error: Loading a microVM snapshot not allowed after configuring boot-specific resources.",
            "{kind}"
        );
        drop(sim);

        let mut sim = Sim::start_bin(&bin, dir.path(), &format!("{kind}-b"), &[]).await;
        let (s, v) = sim.call("PUT", "/snapshot/load", Some(base.clone())).await;
        assert_eq!(s, 400, "{kind}: {v}");
        assert!(
            fault(&v).starts_with(
                "Load snapshot error: Failed to restore from snapshot: Failed to get snapshot state from file: Failed to open snapshot file: No such file or directory"
            ),
            "{kind}: {v}"
        );
        let status = sim
            .exit_status()
            .unwrap_or_else(|| panic!("{kind}: still running"));
        assert!(!status.success(), "{kind}");
    }
}

/// A clone loaded without `resume_vm` is Paused and runs no guest code: no Hello until
/// `PATCH /vm Resumed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_loaded_paused_answers_once_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let t = template(dir.path(), "paused", 64, None).await;
    let sim = Sim::start(dir.path(), "paused-clone", &[]).await;
    let uds = dir.path().join("paused-clone.vsock");
    let mut body = load_body(&t, &uds);
    body["resume_vm"] = json!(false);
    let (s, v) = sim.call("PUT", "/snapshot/load", Some(body)).await;
    assert_eq!(s, 204, "{v}");
    assert_eq!(sim.call("GET", "/", None).await.1["state"], "Paused");
    let early = imp_guest::host::connect(
        &uds,
        AGENT_PORT,
        tokio::time::Instant::now() + Duration::from_millis(500),
    )
    .await;
    assert!(early.is_err(), "a paused clone answered");
    let (s, v) = sim
        .call("PATCH", "/vm", Some(json!({"state": "Resumed"})))
        .await;
    assert_eq!(s, 204, "{v}");
    drop(connect(&uds).await);
}
