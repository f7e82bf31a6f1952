//! Templates and clones on the Firecracker backend (docs/snapshots.md, "Firecracker"), through
//! the real imp-runtime binary with the Firecracker simulator behind testkit's jailer double
//! (`--jailer-path`, as production requires): a template is built (a jailed build VM paused and
//! snapshotted, its files taken out of its jail: `mem` and `vmstate` root's 0444, the writable
//! drive and `meta.json` root's 0600, the directory 0700); clones restore it in jails of their
//! own and are Running only after `Reidentify` (each its own machine-id and hostname, its
//! random sample checked against the earlier clones' by the runtime); a clone whose guest
//! refuses or never answers `Reidentify` is Failed `ReidentifyFailed` with nothing left; three
//! clones restore at once; a clone survives a kill -9'd runtime, a suspend and resume, and the
//! deletion of its template; a
//! template of another VMM release is `TemplateVmmMismatch` (cold boot, rebuilt); a template
//! whose memory file is cut short is `RestoreFailed` (cold boot). Nothing is left at the end:
//! no process, jail, TAP, VM or template file. Prints cold boot and clone create->Running
//! medians (`--nocapture`).
//!
//! The simulator's clone is a fresh guest agent process (its own identity root in its jail),
//! not the snapshot's memory: what this measures is the runtime's side (jails, links, the
//! load, Hello, Reidentify), not a real guest's restore.

mod common;

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::measure::median;
use common::template::{self, put};
use common::{Harness, exec, is_root, jailed_simulator, output};
use imp_runtime::api::{StartKind, TemplateState, TemplateStatus, VmSpec, VmState};
use imp_runtime::runtime::template::{holder, reason};
use imp_testkit::firecracker::{Knobs, ReidentifyKnob};

const JIT_KEY: &str = "ACTIONS_RUNNER_INPUT_JITCONFIG";

/// The template `key` once it is no longer Building.
async fn wait_built(h: &Harness, key: &str) -> TemplateStatus {
    template::wait_built(h, key, Duration::from_secs(60), Duration::from_millis(50)).await
}

/// The jail root of VM (or build VM) `id`.
fn jail_of(h: &Harness, id: &str) -> PathBuf {
    h.state_dir
        .join("jailer")
        .join("imp-firecracker-sim")
        .join(id)
        .join("root")
}

/// What the guest agent of `uid` runs `argv` to (stdout, trimmed).
async fn run(h: &Harness, uid: &str, argv: &[&str]) -> String {
    let info = h.client.vsock(uid).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut g = imp_guest::host::connect(&info.path, info.guest_agent_port, deadline)
        .await
        .unwrap_or_else(|e| panic!("connect to {uid}: {e}"));
    use base64::Engine as _;
    use imp_guest::protocol::{GuestToHost, OutputStream};
    let id = format!("q{}", argv.join("-").replace(['/', ' '], "_"));
    let mut e = exec(&id, argv);
    e.stream_output = true;
    g.exec(e).await.unwrap();
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), g.recv())
            .await
            .unwrap_or_else(|_| panic!("{argv:?} in {uid}: no Exited"))
            .unwrap();
        match msg {
            GuestToHost::Output(o) if o.id == id && o.stream == OutputStream::Stdout => {
                out.extend(
                    base64::engine::general_purpose::STANDARD
                        .decode(&o.data_b64)
                        .unwrap(),
                );
            }
            GuestToHost::Exited(x) if x.id == id => {
                assert_eq!(x.code, Some(0), "{argv:?} in {uid}: {x:?}");
                return String::from_utf8_lossy(&out).trim().to_string();
            }
            _ => {}
        }
    }
}

/// Processes of this harness but the runtime: any whose environment or command line names its
/// directory (jailed VMMs get `IMP_SIM_BEHAVIOUR` through the jailer double, and their guest
/// keepers and agents inherit it; a jail has no path of the host in its command lines).
fn processes_of(h: &Harness) -> Vec<(i32, String)> {
    let dir = h.dir.path().to_string_lossy().into_owned();
    let me = std::process::id() as i32;
    let runtime = h.runtime_pid().map(|p| p as i32);
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me || Some(pid) == runtime {
            continue;
        }
        let read = |f: &str| {
            std::fs::read(e.path().join(f))
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .unwrap_or_default()
        };
        let cmd = read("cmdline");
        if cmd.contains(&dir) || read("environ").contains(&dir) {
            out.push((pid, cmd));
        }
    }
    out
}

/// Whether any regular file under `dir` holds one of `needles`.
fn files_holding(dir: &Path, needles: &[&[u8]]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file()
                && let Ok(bytes) = std::fs::read(e.path())
                && needles
                    .iter()
                    .any(|n| bytes.windows(n.len()).any(|w| w == *n))
            {
                found.push(e.path());
            }
        }
    }
    found
}

/// Wait (up to 10 s) until `f` holds; else fail with what `what` returns.
async fn eventually<T: std::fmt::Debug>(what: impl Fn() -> T, f: impl Fn(&T) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = what();
        if f(&got) {
            return;
        }
        assert!(Instant::now() < deadline, "still: {got:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn firecracker_templates_clone_in_jails_and_leave_nothing() {
    if !is_root() {
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "firecracker_templates_clone_in_jails_and_leave_nothing",
            "the jailer switches uids and makes device nodes; clones have TAPs",
        );
    }
    let mut h = Harness::new(jailed_simulator());
    // The jailed simulator keeps root (CAP_SYS_ADMIN for a clone's UTS namespace), so its
    // clones take Reidentify (docs/runtime.md); a shorter boot timeout bounds the hang case.
    h.extra_env
        .push(("IMP_JAILER_DOUBLE_KEEP_ROOT".into(), "1".into()));
    h.boot_timeout_secs = 8.0;
    h.knobs(
        "silent",
        Knobs {
            silent_first_clone: true,
            ..Knobs::default()
        },
    );
    for (uid, knob) in [
        ("refused", ReidentifyKnob::Refuse),
        ("hung", ReidentifyKnob::Hang),
    ] {
        h.knobs(
            uid,
            Knobs {
                reidentify: knob,
                ..Knobs::default()
            },
        );
    }
    h.start_runtime().await;
    let cold_spec = h.spec(true);
    let spec = VmSpec {
        from_template: true,
        ..cold_spec.clone()
    };

    // Cold boots, for the comparison.
    let mut cold_s = Vec::new();
    let mut cold_boot_s = Vec::new();
    for i in 0..10 {
        let uid = format!("cold{i}");
        let (st, secs) = put(&h, &uid, &cold_spec).await;
        cold_s.push(secs);
        cold_boot_s.push(st.boot_seconds.unwrap_or_default());
        h.client.delete(&uid).await.unwrap();
    }

    // The template: the POST answers at once, the build runs in the background.
    let t = h.client.ensure_template(&cold_spec).await.unwrap();
    assert_eq!(t.key.len(), 24, "{t:?}");
    let key = t.key.clone();
    let built = wait_built(&h, &key).await;
    assert_eq!(
        built.state,
        TemplateState::Ready,
        "{built:?}\n{}",
        h.runtime_log()
    );
    assert!(
        built
            .vmm
            .contains(imp_testkit::firecracker::sim::VMM_VERSION),
        "{built:?}"
    );
    let tdir = h.state_dir.join("templates").join(&key);
    let mode = |p: &Path| {
        let m = std::fs::metadata(p).unwrap();
        (m.uid(), m.mode() & 0o777)
    };
    assert_eq!(mode(&tdir), (0, 0o700));
    for f in ["mem", "vmstate"] {
        assert_eq!(mode(&tdir.join(f)), (0, 0o444), "{f}");
    }
    for f in ["writable.img", "meta.json"] {
        assert_eq!(mode(&tdir.join(f)), (0, 0o600), "{f}");
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tdir.join("meta.json")).unwrap()).unwrap();
    assert_eq!(
        meta["vmm"]["version"],
        format!(
            "Firecracker v{}",
            imp_testkit::firecracker::sim::VMM_VERSION
        )
    );
    // The build VM is gone: its process, directory, jail and TAP.
    let build_vm = holder(&key);
    assert!(!h.vms_dir().join(&build_vm).exists());
    assert!(!jail_of(&h, &build_vm).exists());
    eventually(|| processes_of(&h), Vec::is_empty).await;

    // Clones: each in its own jail, its own identity.
    let mut clone_s = Vec::new();
    let mut restore_s = Vec::new();
    let mut reident_s = Vec::new();
    let mut identities: Vec<(String, String)> = Vec::new();
    for i in 0..10 {
        let uid = format!("clone{i}");
        let (st, secs) = put(&h, &uid, &spec).await;
        let start = st.start.clone().unwrap();
        assert_eq!(
            (
                start.from,
                start.template.as_deref(),
                start.fallback.as_ref()
            ),
            (StartKind::Clone, Some(key.as_str()), None),
            "{st:?}\n{}",
            h.runtime_log()
        );
        clone_s.push(secs);
        restore_s.push(start.restore_seconds.unwrap());
        reident_s.push(start.reidentify_seconds.unwrap());
        let root = jail_of(&h, &uid);
        // The snapshot's links left the jail once loaded (the mapping holds the memory); the
        // clone's drive is its own copy under the template's name, owned by its uid.
        assert!(!root.join("template.mem").exists());
        assert!(!root.join("template.vmstate").exists());
        let w = std::fs::metadata(root.join("writable.img")).unwrap();
        assert_ne!(
            w.ino(),
            std::fs::metadata(tdir.join("writable.img")).unwrap().ino()
        );
        assert_eq!((w.mode() & 0o777, w.uid() != 0), (0o600, true), "{uid}");
        if i < 3 {
            let machine_id =
                std::fs::read_to_string(root.join("vsock.sock.identity/etc/machine-id"))
                    .unwrap()
                    .trim()
                    .to_string();
            let hostname = run(&h, &uid, &["uname", "-n"]).await;
            assert_eq!(
                hostname, uid,
                "a clone's hostname is its uid (no imp.hostname)"
            );
            assert_eq!(machine_id.len(), 32, "{machine_id:?}");
            identities.push((machine_id, hostname));
            // The leftover check below sees a running clone's processes (VMM, guest agent).
            let procs = processes_of(&h);
            assert!(procs.len() >= 2, "{procs:?}");
        }
        if i >= 3 {
            h.client.delete(&uid).await.unwrap();
        }
    }
    for (i, a) in identities.iter().enumerate() {
        for b in &identities[i + 1..] {
            assert_ne!(a.0, b.0, "machine-ids differ");
            assert_ne!(a.1, b.1, "hostnames differ");
        }
    }
    for i in 0..3 {
        h.client.delete(&format!("clone{i}")).await.unwrap();
    }
    // Three at once: each its own jail and identity.
    let t = Instant::now();
    let (a, b, c) = tokio::join!(
        put(&h, "par0", &spec),
        put(&h, "par1", &spec),
        put(&h, "par2", &spec)
    );
    let par_wall = t.elapsed().as_secs_f64();
    let par_s: Vec<f64> = [&a, &b, &c].iter().map(|x| x.1).collect();
    let mut ids = Vec::new();
    for (uid, (st, _)) in [("par0", a), ("par1", b), ("par2", c)] {
        assert_eq!(st.start.map(|s| s.from), Some(StartKind::Clone), "{uid}");
        ids.push(
            std::fs::read_to_string(jail_of(&h, uid).join("vsock.sock.identity/etc/machine-id"))
                .unwrap(),
        );
        h.client.delete(uid).await.unwrap();
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "{ids:?}");
    let listed = h.client.templates().await.unwrap();
    assert_eq!(listed.iter().find(|t| t.key == key).unwrap().clones, 13);

    // A restored clone that never says Hello (its vsock device never woke up) is restored again,
    // once, from the template's files in the same jail: still a clone, its wait counted whole.
    let (st, _) = put(&h, "silent", &spec).await;
    let start = st.start.clone().unwrap();
    assert_eq!(
        (start.from, start.fallback.as_ref()),
        (StartKind::Clone, None),
        "{st:?}\n{}",
        h.runtime_log()
    );
    assert!(
        start.restore_seconds.unwrap() >= 7.0,
        "the first restore waited out its window (boot timeout 8 s): {start:?}"
    );
    assert!(jail_of(&h, "silent").join("vsock.sock.silenced").exists());
    assert!(h.runtime_log().contains("restoring it again"));
    assert_eq!(run(&h, "silent", &["uname", "-n"]).await, "silent");
    h.client.delete("silent").await.unwrap();

    // Reidentify refused, then never answered: Failed, never Running, everything released.
    for (uid, why) in [("refused", "refused"), ("hung", "timeout")] {
        let t = Instant::now();
        let e = h.client.ensure_running(uid, &spec).await.unwrap_err();
        assert_eq!(e.reason(), Some(reason::REIDENTIFY_FAILED), "{uid}: {e}");
        let st = h.client.inspect(uid).await.unwrap();
        assert_eq!(st.state, VmState::Failed, "{st:?}");
        assert_eq!(st.start.as_ref().map(|s| s.from), Some(StartKind::Clone));
        assert!(!h.vms_dir().join(uid).join("writable.img").exists());
        let tap = h.tap_for(uid);
        assert!(
            !output("ip", &["-o", "link", "show"]).contains(&tap),
            "{uid}: TAP {tap} left"
        );
        h.client.delete(uid).await.unwrap();
        assert!(!jail_of(&h, uid).exists(), "{uid}: jail left");
        eventually(|| processes_of(&h), Vec::is_empty).await;
        println!(
            "{uid}: Failed ReidentifyFailed ({why}) after {:.2} s",
            t.elapsed().as_secs_f64()
        );
    }
    let m = h.metrics().await;
    for line in [
        "imp_runtime_template_restores_total{outcome=\"cloned\"} 14",
        "imp_runtime_reidentify_failures_total{reason=\"refused\"} 1",
        "imp_runtime_reidentify_failures_total{reason=\"timeout\"} 1",
    ] {
        assert!(m.contains(line), "{line}\n{m}");
    }
    // Nothing JIT-like in the template, the VMs' directories or the jails.
    let needles: [&[u8]; 2] = [JIT_KEY.as_bytes(), b"jitconfig"];
    for dir in ["templates", "vms", "jailer"] {
        let found = files_holding(&h.state_dir.join(dir), &needles);
        assert!(found.is_empty(), "{found:?}");
    }

    // Another Firecracker release built it: cold boot with the reason, rebuilt, clones again.
    h.signal_runtime("TERM");
    let meta_path = tdir.join("meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    meta["vmm"]["version"] = "Firecracker v1.0.0".into();
    std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    h.start_runtime().await;
    let (st, _) = put(&h, "mism", &spec).await;
    let s = st.start.unwrap();
    let f = s.fallback.expect("a fallback");
    assert_eq!(
        (s.from, f.reason.as_str()),
        (StartKind::Boot, reason::TEMPLATE_VMM_MISMATCH),
        "{f:?}"
    );
    assert!(f.message.contains("v1.0.0"), "{}", f.message);
    h.client.delete("mism").await.unwrap();
    let rebuilt = wait_built(&h, &key).await;
    assert_eq!(rebuilt.state, TemplateState::Ready, "{rebuilt:?}");
    let (st, _) = put(&h, "clone-again", &spec).await;
    assert_eq!(st.start.clone().unwrap().from, StartKind::Clone);
    // A runtime restart finds the clone Running in its jail, with its start report.
    h.kill9_runtime();
    h.start_runtime().await;
    let again = h.client.inspect("clone-again").await.unwrap();
    assert_eq!(
        (again.state, again.pid, again.start),
        (VmState::Running, st.pid, st.start)
    );
    // A clone suspends and resumes like any VM (its own snapshot, in its own jail).
    h.client.suspend("clone-again").await.unwrap();
    assert_eq!(
        h.client.inspect("clone-again").await.unwrap().state,
        VmState::Suspended
    );
    h.client
        .resume("clone-again")
        .await
        .unwrap_or_else(|e| panic!("resume a clone: {e}\n{}", h.runtime_log()));
    assert_eq!(
        run(&h, "clone-again", &["echo", "resumed"]).await,
        "resumed"
    );
    // The template deleted under a running clone: its files go, the clone runs on.
    h.client.delete_template(&key).await.unwrap();
    assert!(!tdir.exists());
    assert_eq!(run(&h, "clone-again", &["echo", "still"]).await, "still");
    assert_eq!(
        h.client.inspect("clone-again").await.unwrap().state,
        VmState::Running
    );
    h.client.delete("clone-again").await.unwrap();
    // Built again for the next case.
    h.client.ensure_template(&cold_spec).await.unwrap();
    assert_eq!(wait_built(&h, &key).await.state, TemplateState::Ready);

    // A template whose memory file is cut short: the load fails, the VM boots instead.
    std::fs::OpenOptions::new()
        .write(true)
        .open(tdir.join("mem"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let (st, _) = put(&h, "broken", &spec).await;
    let s = st.start.unwrap();
    let f = s.fallback.expect("a fallback");
    assert_eq!(
        (s.from, f.reason.as_str()),
        (StartKind::Boot, reason::RESTORE_FAILED),
        "{f:?}"
    );
    assert!(!jail_of(&h, "broken").join("template.mem").exists());
    assert_eq!(run(&h, "broken", &["echo", "up"]).await, "up");
    h.client.delete("broken").await.unwrap();
    h.client.delete_template(&key).await.unwrap();

    // Nothing left: processes, VM and template directories, jails, TAPs.
    eventually(|| processes_of(&h), Vec::is_empty).await;
    assert!(h.client.list().await.unwrap().is_empty());
    assert!(h.client.templates().await.unwrap().is_empty());
    for dir in [
        h.state_dir.join("templates"),
        h.vms_dir(),
        h.state_dir.join("jailer").join("imp-firecracker-sim"),
    ] {
        let left: Vec<_> = std::fs::read_dir(&dir)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{}: {left:?}", dir.display());
    }
    let links = output("ip", &["-o", "link", "show"]);
    let mut owners: Vec<String> = (0..10)
        .flat_map(|i| [format!("cold{i}"), format!("clone{i}")])
        .collect();
    owners.extend(
        [
            "refused",
            "hung",
            "mism",
            "clone-again",
            "broken",
            "par0",
            "par1",
            "par2",
        ]
        .map(String::from),
    );
    owners.push(holder(&key));
    for o in owners {
        let tap = h.tap_for(&o);
        assert!(!links.contains(&tap), "TAP {tap} of {o} left");
    }
    h.signal_runtime("TERM");

    println!(
        "MEASURE template_fc (simulator, jailed): cold boot create->Running p50 {:.3} s (VMM spawn->Running p50 {:.3} s); clone create->Running p50 {:.3} s; restore p50 {:.3} s; reidentify p50 {:.3} s; template build {:.3} s; n=10 each; three clones at once: {:.3?} s each, {:.3} s in all",
        median(&cold_s),
        median(&cold_boot_s),
        median(&clone_s),
        median(&restore_s),
        median(&reident_s),
        built.build_seconds.unwrap_or_default(),
        par_s,
        par_wall,
    );
}

/// A runtime killed while a Firecracker template builds: the next start removes the build's
/// `.building` directory, its VMM and guest, jail and TAP; the next request builds it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_firecracker_build_leaves_nothing_after_a_restart() {
    if !is_root() {
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "an_interrupted_firecracker_build_leaves_nothing_after_a_restart",
            "the jailer switches uids and makes device nodes; the build VM has a TAP",
        );
    }
    let mut h = Harness::new(jailed_simulator());
    h.extra_env
        .push(("IMP_JAILER_DOUBLE_KEEP_ROOT".into(), "1".into()));
    h.start_runtime().await;
    let spec = h.spec(true);
    // Built once to learn the key (the build VM's id), then deleted.
    let key = h.client.ensure_template(&spec).await.unwrap().key;
    assert_eq!(wait_built(&h, &key).await.state, TemplateState::Ready);
    h.client.delete_template(&key).await.unwrap();
    // Its next build VM's guest takes 3 s to come up: the runtime dies meanwhile.
    let build_vm = holder(&key);
    h.knobs(
        &build_vm,
        Knobs {
            boot_delay_ms: 3000,
            ..Knobs::default()
        },
    );
    let t = h.client.ensure_template(&spec).await.unwrap();
    assert_eq!(t.state, TemplateState::Building);
    let building = h
        .state_dir
        .join("templates")
        .join(format!("{key}.building"));
    eventually(
        || {
            (
                jail_of(&h, &build_vm).join("api.sock").exists(),
                building.exists(),
            )
        },
        |&(a, b)| a && b,
    )
    .await;
    h.kill9_runtime();
    assert!(
        !processes_of(&h).is_empty(),
        "the build VM outlives the runtime"
    );
    let tap = h.tap_for(&build_vm);
    assert!(output("ip", &["-o", "link", "show"]).contains(&tap));

    h.start_runtime().await;
    eventually(|| processes_of(&h), Vec::is_empty).await;
    assert!(h.client.templates().await.unwrap().is_empty());
    assert!(!building.exists());
    assert!(!jail_of(&h, &build_vm).parent().unwrap().exists());
    assert!(!h.vms_dir().join(&build_vm).exists());
    assert!(!output("ip", &["-o", "link", "show"]).contains(&tap));

    // Asked again, it is built (slowly, the knob stays).
    h.client.ensure_template(&spec).await.unwrap();
    let rebuilt = wait_built(&h, &key).await;
    assert_eq!(rebuilt.state, TemplateState::Ready, "{rebuilt:?}");
    h.client.delete_template(&key).await.unwrap();
    eventually(|| processes_of(&h), Vec::is_empty).await;
    h.signal_runtime("TERM");
}

/// Issue 32: what templates take is in `GET /v1/capacity`, through the real API: a build's VM
/// size while it builds (slowed by the simulator's boot delay so it is seen), none once it is
/// Ready, then the Ready template's bytes against the template budget; the dry run answers what
/// a request would do and starts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_reports_a_building_templates_vm_and_the_ready_ones_bytes() {
    use imp_runtime::api::TemplateBuild;
    if !is_root() {
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "capacity_reports_a_building_templates_vm_and_the_ready_ones_bytes",
            "the jailer switches uids and makes device nodes; the build VM has a TAP",
        );
    }
    let mut h = Harness::new(jailed_simulator());
    h.extra_env.extend([
        ("IMP_JAILER_DOUBLE_KEEP_ROOT".into(), "1".into()),
        ("IMP_TEMPLATE_BUDGET_BYTES".into(), (3u64 << 30).to_string()),
    ]);
    h.start_runtime().await;
    let spec = VmSpec {
        vcpu: 2,
        memory_mib: 384,
        ..h.spec(true)
    };
    let before = h.client.capacity().await.unwrap();
    assert_eq!(before.template_budget_bytes, 3 << 30);
    assert_eq!(
        (before.template_used_bytes, before.template_builds.len()),
        (0, 0)
    );

    // The dry run says a request would build, and builds nothing.
    let dry = h.client.template_dry_run(&spec).await.unwrap();
    assert!(dry.would_build && dry.template.is_none(), "{dry:?}");
    assert!(h.client.templates().await.unwrap().is_empty());
    assert!(
        h.client
            .capacity()
            .await
            .unwrap()
            .template_builds
            .is_empty()
    );

    // Its build VM's guest takes 1.5 s to come up: the build is seen with its size.
    let key = dry.key.clone();
    h.knobs(
        &holder(&key),
        Knobs {
            boot_delay_ms: 1500,
            ..Knobs::default()
        },
    );
    let t = h.client.ensure_template(&spec).await.unwrap();
    assert_eq!(
        (t.key.as_str(), t.state),
        (key.as_str(), TemplateState::Building)
    );
    let during = h.client.capacity().await.unwrap();
    assert_eq!(
        during.template_builds,
        [TemplateBuild {
            key: key.clone(),
            vcpu: 2,
            memory_mib: 384,
        }]
    );
    assert_eq!(during.template_used_bytes, 0);
    let dry = h.client.template_dry_run(&spec).await.unwrap();
    assert!(!dry.would_build, "{dry:?}");
    assert_eq!(dry.template.map(|t| t.state), Some(TemplateState::Building));

    let built = wait_built(&h, &key).await;
    assert_eq!(built.state, TemplateState::Ready, "{built:?}");
    assert!(built.bytes > 0, "{built:?}");
    let after = h.client.capacity().await.unwrap();
    assert!(after.template_builds.is_empty(), "{after:?}");
    assert_eq!(after.template_used_bytes, built.bytes);
    assert_eq!(after.template_budget_bytes, 3 << 30);
    let dry = h.client.template_dry_run(&spec).await.unwrap();
    assert!(!dry.would_build, "{dry:?}");
    assert_eq!(dry.template.map(|t| t.state), Some(TemplateState::Ready));

    h.client.delete_template(&key).await.unwrap();
    assert_eq!(h.client.capacity().await.unwrap().template_used_bytes, 0);
    eventually(|| processes_of(&h), Vec::is_empty).await;
    h.signal_runtime("TERM");
}

/// A template built with `warm_paths` has its guest read them before the snapshot and reports
/// what it read (`TemplateStatus.warm`, meta.json): the regular files of a directory made here
/// (bound into the jail, where the simulated guest runs), a symlink out of it not followed.
/// The same spec without warm paths keys another template; a clone of the warm one restores
/// it; a warm path that is not absolute is refused, naming `warm_paths`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_warms_its_paths_before_the_snapshot_and_reports_them() {
    if !is_root() {
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "a_template_warms_its_paths_before_the_snapshot_and_reports_them",
            "the jailer switches uids and makes device nodes; the build VM has a TAP",
        );
    }
    let mut h = Harness::new(jailed_simulator());
    h.extra_env
        .push(("IMP_JAILER_DOUBLE_KEEP_ROOT".into(), "1".into()));
    let runner = h.dir.path().join("actions-runner");
    std::fs::create_dir_all(runner.join("bin/lib")).unwrap();
    let files: [(&str, usize); 3] = [
        ("bin/Runner.Listener", 200_000),
        ("bin/lib/libcoreclr.so", 50_000),
        ("run.sh", 10),
    ];
    for (name, len) in files {
        std::fs::write(runner.join(name), vec![b'r'; len]).unwrap();
    }
    std::os::unix::fs::symlink("/etc/passwd", runner.join("passwd")).unwrap();
    h.jail_binds.push(runner.clone());
    h.start_runtime().await;
    let spec = VmSpec {
        warm_paths: vec![runner.display().to_string()],
        ..h.spec(true)
    };

    let cold_key = h.client.ensure_template(&h.spec(true)).await.unwrap().key;
    let key = h.client.ensure_template(&spec).await.unwrap().key;
    assert_ne!(key, cold_key, "the warm paths are part of the key");
    let built = wait_built(&h, &key).await;
    assert_eq!(
        built.state,
        TemplateState::Ready,
        "{built:?}\n{}",
        h.runtime_log()
    );
    let warm = built.warm.clone().expect("a warm report");
    let bytes: usize = files.iter().map(|f| f.1).sum();
    assert_eq!(
        (
            warm.files,
            warm.bytes,
            warm.truncated,
            warm.skipped,
            warm.error
        ),
        (3, bytes as u64, false, 1, None),
        "the symlink skipped: {built:?}"
    );
    let meta: serde_json::Value = serde_json::from_slice(
        &std::fs::read(h.state_dir.join("templates").join(&key).join("meta.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(meta["warm"]["files"], 3, "{meta}");
    assert_eq!(
        meta["inputs"]["warm_paths"][0],
        runner.display().to_string()
    );
    assert!(
        h.runtime_log().contains("template page cache warmed"),
        "{}",
        h.runtime_log()
    );
    let cold = wait_built(&h, &cold_key).await;
    assert_eq!((cold.state, cold.warm), (TemplateState::Ready, None));

    let clone = VmSpec {
        from_template: true,
        ..spec.clone()
    };
    let (st, _) = put(&h, "warm0", &clone).await;
    let start = st.start.unwrap();
    assert_eq!(
        (start.from, start.template.as_deref()),
        (StartKind::Clone, Some(key.as_str()))
    );
    h.client.delete("warm0").await.unwrap();

    let bad = VmSpec {
        warm_paths: vec!["opt/actions-runner".into()],
        ..spec.clone()
    };
    let e = h.client.ensure_template(&bad).await.unwrap_err();
    assert_eq!(
        e.reason(),
        Some(imp_api::names::reason::INVALID_SPEC),
        "{e}"
    );
    assert!(e.to_string().contains("warm_paths"), "{e}");

    for k in [&key, &cold_key] {
        h.client.delete_template(k).await.unwrap();
    }
    eventually(|| processes_of(&h), Vec::is_empty).await;
    h.signal_runtime("TERM");
    println!(
        "MEASURE template_fc warm (simulator): {} files, {} bytes in {} ms; template build {:.3} s (without warm {:.3} s)",
        warm.files,
        warm.bytes,
        warm.millis,
        built.build_seconds.unwrap_or_default(),
        cold.build_seconds.unwrap_or_default()
    );
}
