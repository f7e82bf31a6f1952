//! PID 1 logic without a VM: each test re-runs itself inside fresh namespaces (`unshare`),
//! where mounting, switching root, setting the hostname and bringing up `lo` touch nothing of
//! the host. Needs root (CI runs as root); skips with a message otherwise.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use imp_guest::pid1::cmdline::NetConfig;
use imp_guest::pid1::{mounts, net, root, system};

const CHILD_ENV: &str = "IMP_GUEST_NS_CHILD";
const DIR_ENV: &str = "IMP_GUEST_NS_DIR";
const CHILD_OK: &str = "IMP-GUEST-NS-CHILD-OK";

/// In the parent: run test `name` again inside new namespaces and check it passed.
/// In the child: return the scratch directory so the test body runs.
fn namespaced(name: &str, unshare: &[&str]) -> Option<PathBuf> {
    if std::env::var(CHILD_ENV).as_deref() == Ok(name) {
        return Some(PathBuf::from(std::env::var(DIR_ENV).unwrap()));
    }
    if !common::is_root() {
        assert!(
            std::env::var("IMP_REQUIRE_ROOT").as_deref() != Ok("1"),
            "IMP_REQUIRE_ROOT=1 but {name} needs root for mount/UTS/net namespaces"
        );
        println!("skipped {name}: needs root for mount/UTS/net namespaces");
        return None;
    }
    // The directory belongs to the parent: the child's mounts vanish with its namespace before
    // this TempDir is removed, so removal never descends into a live proc/sys/devtmpfs.
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("unshare")
        .args(unshare)
        .args(["--propagation", "private"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name)
        .env(DIR_ENV, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--- child stdout ---\n{stdout}\n--- child stderr ---\n{stderr}");
    assert!(
        out.status.success(),
        "namespaced child failed: {:?}",
        out.status
    );
    // Guards against a filter that matched nothing (which would "pass" with 0 tests).
    assert!(stdout.contains(CHILD_OK), "child did not run the test body");
    None
}

fn fs_magic(path: &Path) -> i64 {
    nix::sys::statfs::statfs(path).unwrap().filesystem_type().0 as i64
}

#[test]
fn api_filesystems_mount_idempotently() {
    let Some(dir) = namespaced("api_filesystems_mount_idempotently", &["--mount"]) else {
        return;
    };
    let root = dir.join("root");
    let mounted = mounts::mount_all(&root, mounts::EARLY).unwrap();
    assert_eq!(mounted.len(), mounts::EARLY.len());
    assert!(root.join("proc/self/status").exists());
    assert!(root.join("sys/kernel").is_dir());
    assert!(root.join("dev/null").exists());
    assert_eq!(fs_magic(&root.join("run")), libc::TMPFS_MAGIC);
    // Already-mounted targets are skipped (the kernel may have mounted devtmpfs itself).
    assert!(mounts::mount_all(&root, mounts::EARLY).unwrap().is_empty());

    let late = mounts::mount_all(&root, mounts::LATE).unwrap();
    let late: Vec<_> = late
        .iter()
        .map(|p| p.strip_prefix(&root).unwrap().to_owned())
        .collect();
    assert_eq!(
        late,
        [PathBuf::from("tmp"), "dev/pts".into(), "dev/shm".into()]
    );
    assert_eq!(fs_magic(&root.join("tmp")), libc::TMPFS_MAGIC);
    assert_eq!(
        std::fs::metadata(root.join("tmp"))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777,
        0o1777
    );
    assert!(root.join("dev/pts/ptmx").exists());
    println!("{CHILD_OK}");
}

#[test]
fn overlay_root_switch_hostname_resolv_and_loopback() {
    let Some(dir) = namespaced(
        "overlay_root_switch_hostname_resolv_and_loopback",
        &["--mount", "--uts", "--net"],
    ) else {
        return;
    };
    // The "base image": read-only lower layer.
    let lower = dir.join("base");
    std::fs::create_dir_all(lower.join("etc")).unwrap();
    std::fs::create_dir_all(lower.join("proc")).unwrap();
    std::fs::write(lower.join("marker"), "base").unwrap();
    std::os::unix::fs::symlink(
        "/run/systemd/resolve/stub-resolv.conf",
        lower.join("etc/resolv.conf"),
    )
    .unwrap();

    let scratch = dir.join("scratch");
    let upper = root::Upper {
        source: "tmpfs".into(),
        fstype: "tmpfs".into(),
    };
    let newroot = root::assemble(&scratch, &root::Lower::Bind(lower.clone()), &upper).unwrap();
    assert_eq!(fs_magic(&newroot), libc::OVERLAYFS_SUPER_MAGIC);
    assert_eq!(
        std::fs::read_to_string(newroot.join("marker")).unwrap(),
        "base"
    );
    // The lower layer is mounted read-only: the base image can never be written through it.
    let err = std::fs::write(scratch.join("lower/x"), "x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    // Writes land in the per-VM upper layer; the base stays pristine.
    std::fs::write(newroot.join("marker"), "changed").unwrap();
    std::fs::write(newroot.join("new"), "n").unwrap();
    assert_eq!(
        std::fs::read_to_string(lower.join("marker")).unwrap(),
        "base"
    );
    assert!(!lower.join("new").exists());
    assert_eq!(
        std::fs::read_to_string(scratch.join("rw/upper/new")).unwrap(),
        "n"
    );
    // Container storage bypasses the overlay: the writable drive's own filesystem (tmpfs here,
    // ext4 in a VM), outside upper/ and work/.
    for d in root::PLAIN_DIRS {
        assert_eq!(fs_magic(&newroot.join(d)), libc::TMPFS_MAGIC, "{d}");
        std::fs::write(newroot.join(d).join("probe"), "p").unwrap();
        assert_eq!(
            std::fs::read_to_string(scratch.join("rw/plain").join(d).join("probe")).unwrap(),
            "p"
        );
        assert!(!scratch.join("rw/upper").join(d).join("probe").exists());
    }

    system::write_resolv_conf(
        &newroot,
        &["192.0.2.53".parse().unwrap()],
        &["ci.example".into()],
    )
    .unwrap();
    assert!(
        std::fs::read_link(lower.join("etc/resolv.conf")).is_ok(),
        "base image was modified"
    );

    root::switch_root(&newroot, &["/proc"]).unwrap();
    assert_eq!(std::fs::read_to_string("/marker").unwrap(), "changed");
    // The plain directories moved along with the new root.
    assert_eq!(
        std::fs::read_to_string("/var/lib/docker/probe").unwrap(),
        "p"
    );
    assert_eq!(fs_magic(Path::new("/var/lib/docker")), libc::TMPFS_MAGIC);
    // /proc came along, and it reports the overlay as the root.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let root_fs = mountinfo
        .lines()
        .filter(|l| l.split_whitespace().nth(4) == Some("/"))
        .filter_map(|l| l.split(" - ").nth(1)?.split_whitespace().next())
        .next_back();
    assert_eq!(root_fs, Some("overlay"), "{mountinfo}");

    system::set_hostname("imp-vm-test").unwrap();
    assert_eq!(
        nix::unistd::gethostname().unwrap().to_str(),
        Some("imp-vm-test")
    );

    let resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap();
    assert!(
        resolv.contains("search ci.example\nnameserver 192.0.2.53\n"),
        "{resolv}"
    );

    // A new network namespace starts with lo down: 127.0.0.1 is unusable until loopback_up.
    let loopback_works = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
        std::net::TcpStream::connect(l.local_addr().ok()?).ok()
    };
    assert!(
        loopback_works().is_none(),
        "lo unexpectedly up in a fresh net namespace"
    );
    system::loopback_up().unwrap();
    assert!(loopback_works().is_some());
    println!("{CHILD_OK}");
}

#[test]
fn lower_from_device_is_mounted_read_only() {
    let Some(dir) = namespaced("lower_from_device_is_mounted_read_only", &["--mount"]) else {
        return;
    };
    // A "device" here is a tmpfs source; the Device path mounts it with MS_RDONLY.
    let scratch = dir.join("scratch");
    let lower = root::Lower::Device {
        path: "tmpfs".into(),
        fstype: "tmpfs".into(),
    };
    let upper = root::Upper {
        source: "tmpfs".into(),
        fstype: "tmpfs".into(),
    };
    let newroot = root::assemble(&scratch, &lower, &upper).unwrap();
    let vfs = nix::sys::statvfs::statvfs(&scratch.join("lower")).unwrap();
    assert!(vfs.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY));
    std::fs::write(newroot.join("f"), "x").unwrap();
    assert!(scratch.join("rw/upper/f").exists());
    println!("{CHILD_OK}");
}

#[test]
fn assemble_reports_which_mount_failed() {
    let Some(dir) = namespaced("assemble_reports_which_mount_failed", &["--mount"]) else {
        return;
    };
    let scratch = dir.join("scratch");
    let lower = root::Lower::Device {
        path: "/dev/imp-no-such-disk".into(),
        fstype: "ext4".into(),
    };
    let upper = root::Upper {
        source: "tmpfs".into(),
        fstype: "tmpfs".into(),
    };
    let err = root::assemble(&scratch, &lower, &upper).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, root::RootError::Mount { .. }), "{err:?}");
    assert!(msg.contains("/dev/imp-no-such-disk"), "{msg}");
    println!("{CHILD_OK}");
}

fn ip_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new("ip").arg("-j").args(args).output().unwrap();
    assert!(out.status.success(), "ip -j {args:?}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// imp.net's configuration code on a veth in a fresh network namespace (the peer end plays
/// the bridge): address, MTU, link up, default route; a second run changes nothing.
#[test]
fn network_configures_eth0_on_a_veth() {
    if namespaced("network_configures_eth0_on_a_veth", &["--net"]).is_none() {
        return;
    }
    let ip = |args: &[&str]| {
        let st = Command::new("ip").args(args).status().unwrap();
        assert!(st.success(), "ip {args:?}");
    };
    ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "bridge0",
    ]);
    ip(&["link", "set", "bridge0", "up"]);
    let cfg = NetConfig::parse("192.0.2.10/24,192.0.2.1,1400").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for _ in 0..2 {
        rt.block_on(net::configure("eth0", &cfg, Duration::from_secs(2)))
            .unwrap();
        let link = &ip_json(&["addr", "show", "dev", "eth0"])[0];
        assert_eq!(link["mtu"], 1400, "{link}");
        assert!(
            link["flags"].as_array().unwrap().contains(&"UP".into()),
            "{link}"
        );
        let v4: Vec<_> = link["addr_info"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["family"] == "inet")
            .map(|a| {
                (
                    a["local"].as_str().unwrap().to_owned(),
                    a["prefixlen"].clone(),
                )
            })
            .collect();
        assert_eq!(v4, [("192.0.2.10".to_owned(), 24.into())]);
        let routes = ip_json(&["-4", "route", "show", "default"]);
        let routes = routes.as_array().unwrap();
        assert_eq!(routes.len(), 1, "{routes:?}");
        assert_eq!(routes[0]["gateway"], "192.0.2.1");
        assert_eq!(routes[0]["dev"], "eth0");
        // IPv4 only: no IPv6 address (not even link-local), so no router solicitations.
        let v6 = std::fs::read_to_string("/proc/sys/net/ipv6/conf/eth0/disable_ipv6").unwrap();
        assert_eq!(v6.trim(), "1");
        assert!(
            !link["addr_info"]
                .as_array()
                .unwrap()
                .iter()
                .any(|a| a["family"] == "inet6"),
            "{link}"
        );
    }
    // A missing interface is a precise error, not a hang.
    let err = rt
        .block_on(net::configure("eth9", &cfg, Duration::from_millis(200)))
        .unwrap_err();
    assert!(
        matches!(err, net::NetError::NoInterface(ref n, _) if n == "eth9"),
        "{err}"
    );
    println!("{CHILD_OK}");
}
