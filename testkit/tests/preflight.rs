//! `make smoke` and `make test` on a machine that lacks Debian packages, as a newcomer runs them: the
//! real Makefile and testenv/preflight.sh, in a copy of the repository whose testenv/build.sh and
//! smoke/imp-smoke.sh only record that they ran, with a `dpkg-query` and an `apt-get` on PATH that
//! see (and install into) a package list of the test's own. The dependency check and installation
//! must come before the control-plane build; with installation refused (IMP_INSTALL_DEPS=0) the run
//! must fail within seconds, naming what is missing and the command that installs it, and build
//! nothing. Then the real smoke/imp-smoke.sh the same way.
//!
//! Needs root (the smoke's preflight asks for it) and make; IMP_REQUIRE_ROOT=1 makes a skip a failure.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use imp_testkit::{paths, skip};

/// Everything `preflight.sh smoke` checks, as installed on the fake machine but for `absent`.
const SMOKE_PACKAGES: [&str; 13] = [
    "iproute2",
    "nftables",
    "python3",
    "curl",
    "jq",
    "docker-registry",
    "qemu-system-x86",
    "cpio",
    "skopeo",
    "kmod",
    "binutils",
    "linux-image-cloud-amd64",
    "busybox-static",
];
const ABSENT: [&str; 2] = ["nftables", "docker-registry"];
/// How soon a refused run must fail: it checks a package list and hashes a few go.mod files.
const FAST: Duration = Duration::from_secs(10);

fn write_exec(path: &Path, body: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, body).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A fake machine: a repository copy and a PATH directory, under one temp dir.
struct Machine {
    dir: tempfile::TempDir,
}

impl Machine {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = paths::workspace_root();
        let repo = dir.path().join("repo");
        std::fs::create_dir_all(repo.join("testenv")).unwrap();
        std::fs::copy(root.join("Makefile"), repo.join("Makefile")).unwrap();
        std::fs::copy(
            root.join("testenv/preflight.sh"),
            repo.join("testenv/preflight.sh"),
        )
        .unwrap();
        let order = dir.path().join("order");
        // The long steps, reduced to a record of their turn (build.sh --stale: nothing to build).
        write_exec(
            &repo.join("testenv/build.sh"),
            &format!(
                "#!/bin/sh\n[ \"$1\" = --stale ] && exit 0\necho build >>{}\n",
                order.display()
            ),
        );
        write_exec(
            &repo.join("smoke/imp-smoke.sh"),
            &format!("#!/bin/sh\necho \"smoke $*\" >>{}\n", order.display()),
        );
        let state = dir.path().join("dpkg");
        let installed: Vec<&str> = SMOKE_PACKAGES
            .iter()
            .copied()
            .filter(|p| !ABSENT.contains(p))
            .collect();
        std::fs::write(&state, installed.join("\n") + "\n").unwrap();
        let bin = dir.path().join("bin");
        // dpkg-query -W -f='${Status}' PKG, answered from the state file.
        write_exec(
            &bin.join("dpkg-query"),
            &format!(
                "#!/bin/sh\nfor p; do :; done\ngrep -qx \"$p\" {s} && printf 'install ok installed' && exit 0\n\
                 echo \"dpkg-query: no packages found matching $p\" >&2; exit 1\n",
                s = state.display()
            ),
        );
        // apt-get update | install -y ... PKG...: recorded; install adds to the state file.
        write_exec(
            &bin.join("apt-get"),
            &format!(
                "#!/bin/sh\necho \"apt-get $*\" >>{o}\n[ \"$1\" = install ] || exit 0\n\
                 for p; do case \"$p\" in -*|install) ;; *) echo \"$p\" >>{s} ;; esac; done\n",
                o = order.display(),
                s = state.display()
            ),
        );
        // Present, so the test does not build it with cargo.
        write_exec(&bin.join("vhost-device-vsock"), "#!/bin/sh\nexit 0\n");
        Self { dir }
    }

    fn repo(&self) -> PathBuf {
        self.dir.path().join("repo")
    }

    /// `make TARGET` in the copy, with the fake tools first on PATH; how long it took.
    fn make(&self, target: &str, install: Option<&str>) -> (Output, Duration) {
        let mut cmd = Command::new("make");
        cmd.arg("-s").arg(target).current_dir(self.repo());
        self.env(&mut cmd, install);
        let t = Instant::now();
        let out = cmd.output().expect("run make");
        (out, t.elapsed())
    }

    fn env(&self, cmd: &mut Command, install: Option<&str>) {
        let path = format!(
            "{}:{}",
            self.dir.path().join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        cmd.env("PATH", path).env_remove("IMP_INSTALL_DEPS");
        if let Some(v) = install {
            cmd.env("IMP_INSTALL_DEPS", v);
        }
    }

    fn order(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("order"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let make = Command::new("make").arg("--version").output().is_ok();
    if !root || !make {
        skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "the preflight tests",
            "need root (the smoke's preflight asks for it) and make",
        );
        return false;
    }
    true
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn make_smoke_refused_installation_fails_at_once_naming_what_is_missing() {
    if !can_run() {
        return;
    }
    let m = Machine::new();
    let (out, took) = m.make("smoke", Some("0"));
    let said = text(&out);
    assert!(!out.status.success(), "make smoke passed: {said}");
    assert!(took < FAST, "make smoke took {took:?} to fail: {said}");
    assert!(
        said.contains("missing nftables docker-registry")
            && said.contains("apt-get install -y --no-install-recommends nftables docker-registry"),
        "the failure names neither what is missing nor the command: {said}"
    );
    assert!(
        m.order().is_empty(),
        "something ran after a refused install: {:?}",
        m.order()
    );
}

#[test]
fn make_smoke_installs_what_is_missing_before_the_control_plane_builds() {
    if !can_run() {
        return;
    }
    let m = Machine::new();
    // Unset IMP_INSTALL_DEPS: installing is the default.
    let (out, _) = m.make("smoke", None);
    assert!(out.status.success(), "make smoke failed: {}", text(&out));
    let order = m.order();
    let install = order
        .iter()
        .position(|l| l.starts_with("apt-get install") && l.ends_with("nftables docker-registry"));
    let build = order.iter().position(|l| l == "build");
    let smoke = order.iter().position(|l| l.starts_with("smoke"));
    assert!(
        matches!((install, build, smoke), (Some(i), Some(b), Some(s)) if i < b && b < s),
        "expected apt-get install, then the testenv build, then the smoke: {order:?}"
    );
    assert!(
        order[..install.unwrap()]
            .iter()
            .any(|l| l.starts_with("apt-get update"))
    );
    // A second run finds everything and installs nothing.
    let (out, _) = m.make("smoke", Some("0"));
    assert!(out.status.success(), "second make smoke: {}", text(&out));
    assert_eq!(
        m.order()
            .iter()
            .filter(|l| l.starts_with("apt-get install"))
            .count(),
        1
    );
}

#[test]
fn make_test_refused_installation_names_the_whole_suites_packages() {
    if !can_run() {
        return;
    }
    let m = Machine::new();
    let (out, took) = m.make("test", Some("0"));
    let said = text(&out);
    assert!(!out.status.success() && took < FAST, "{took:?}: {said}");
    // The suite's own packages beyond the smoke's, e.g. the dashboard test's Prometheus.
    for pkg in ABSENT.iter().chain(&["prometheus", "containerd"]) {
        assert!(said.contains(pkg), "{pkg} not named: {said}");
    }
    assert!(m.order().is_empty(), "ran: {:?}", m.order());
}

#[test]
fn the_real_smoke_script_checks_before_it_builds() {
    if !can_run() {
        return;
    }
    let m = Machine::new();
    let mut cmd = Command::new(paths::workspace_root().join("smoke/imp-smoke.sh"));
    cmd.args(["--local", "--guest", "simulated"]);
    m.env(&mut cmd, Some("0"));
    let t = Instant::now();
    let out = cmd.output().unwrap();
    let said = text(&out);
    assert!(!out.status.success(), "the smoke passed: {said}");
    assert!(t.elapsed() < FAST, "{:?}: {said}", t.elapsed());
    assert!(
        said.contains("missing nftables docker-registry") && !said.contains("testenv:"),
        "{said}"
    );
}
