//! Firecracker through its jailer (Firecracker's docs/jailer.md; docs/security.md). The jailer
//! makes `<chroot_base>/<exec file name>/<id>/root`, copies Firecracker into it, creates the
//! VM's cgroups with the limits it is given, pivots into the chroot in a mount namespace of its
//! own, makes `/dev/kvm` and `/dev/net/tun` there, execs Firecracker as the VM's uid/gid (no
//! capabilities) in a new PID namespace, and writes Firecracker's host pid to
//! `<root>/<exec file name>.pid`. What Firecracker is handed through its API must then be in
//! the jail: the runtime hard-links the kernel, initrd and drives into the root beforehand
//! ([`stage`]) and names them by their path inside it ([`in_jail`]). Its API socket, vsock
//! socket, log and snapshots live in the root too; cleanup (the jail directory, the cgroups)
//! is the runtime's.
//!
//! Clones of a template (snapshot standby): a snapshot records every path as the template's
//! Firecracker saw it in its jail, and a load can override only the TAPs and the vsock socket,
//! not the drives. So the template runs jailed too, and each clone's jail provides the same
//! names: the template's memory and vmstate files ([`Place::Template`]: one hard-linked,
//! root-owned, read-only inode for all clones), the shared kernel and base image
//! ([`Place::Shared`]), and the clone's own copy of the template's writable drive at the
//! template's name ([`Place::Own`], owned by the clone's uid). Nothing of one clone is
//! reachable from another's jail, and nothing a clone can write is shared. The runtime
//! (runtime/template.rs) unlinks the template's two links from a clone's jail once the load
//! returned: the state was read, and the memory mapping holds its inode.
//!
//! Not used: `--daemonize` (it sends stdio to /dev/null, and Firecracker's stdout is the guest
//! console the runtime logs; the runtime gives the process a session of its own anyway) and
//! `--netns` (the VM's TAP is a port of the node's bridge in the runtime's network namespace;
//! Firecracker's own seccomp filters leave it no socket but Unix ones).

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

use crate::cgroup::{CgroupArgs, Version};

/// Names inside a VM's jail root (each also its path in API calls, with a leading `/`).
pub const API_SOCK: &str = "api.sock";
pub const VSOCK: &str = "vsock.sock";
pub const VMM_LOG: &str = "firecracker.log";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailerConfig {
    /// The jailer binary (the same release as Firecracker).
    pub bin: PathBuf,
    /// `--chroot-base-dir`: on the state disk, so drives hard-link into jails.
    pub chroot_base: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum JailerError {
    #[error("Firecracker binary {0} has no file name")]
    ExecName(PathBuf),
    #[error("run {bin} --version: {source}")]
    Version {
        bin: PathBuf,
        source: std::io::Error,
    },
    #[error("{bin} --version printed no version: {out:?}")]
    NoVersion { bin: PathBuf, out: String },
    #[error("jailer {jailer_version} (from {jailer}) is not Firecracker's {firecracker_version}")]
    VersionMismatch {
        jailer: PathBuf,
        jailer_version: String,
        firecracker_version: String,
    },
    #[error("stage {path} in the jail: {source}")]
    Stage {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the jailer wrote no pid file {path} within {timeout:?}")]
    NoPid { path: PathBuf, timeout: Duration },
}

/// The jail root of VM `id`: `<chroot_base>/<exec file name>/<id>/root`.
pub fn chroot_root(cfg: &JailerConfig, exec_file: &Path, id: &str) -> Result<PathBuf, JailerError> {
    let name = exec_name(exec_file)?;
    Ok(cfg.chroot_base.join(name).join(id).join("root"))
}

/// The directory of every jail of `exec_file` (`<chroot_base>/<exec file name>`).
pub fn jails_dir(cfg: &JailerConfig, exec_file: &Path) -> Result<PathBuf, JailerError> {
    Ok(cfg.chroot_base.join(exec_name(exec_file)?))
}

pub fn exec_name(exec_file: &Path) -> Result<String, JailerError> {
    exec_file
        .file_name()
        .and_then(|n| n.to_str())
        .map(String::from)
        .ok_or_else(|| JailerError::ExecName(exec_file.to_path_buf()))
}

/// The path a file of the jail has inside it (`<root>/a/b` -> `/a/b`); `None` outside it.
pub fn in_jail(root: &Path, host: &Path) -> Option<String> {
    let rel = host.strip_prefix(root).ok()?;
    Some(format!("/{}", rel.display()))
}

/// What one jailer run is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailerRun<'a> {
    pub id: &'a str,
    pub exec_file: &'a Path,
    /// The VM's uid (= gid), from the per-VM range (jail::assign).
    pub uid: u32,
    pub cgroups: Option<&'a CgroupArgs>,
    /// Firecracker's own arguments (after `--`).
    pub firecracker_args: Vec<OsString>,
}

/// Where the jailer must not look for cgroup hierarchies, when the runtime's view of the host's
/// cgroup tree (`root`) is elsewhere: the pod's own `/sys/fs/cgroup` (read-only in a
/// non-privileged container, the pod's subtree in any). The jailer takes the first cgroup mount
/// of `/proc/self/mounts` for each controller; with `/sys/fs/cgroup` detached in a mount
/// namespace of its own, that is the host's tree under `root`. `None`: the jailer sees the host's.
pub fn hidden_cgroup_mount(cgroups: Option<&CgroupArgs>) -> Option<&'static Path> {
    const DEFAULT: &str = "/sys/fs/cgroup";
    cgroups
        .filter(|cg| cg.root != Path::new(DEFAULT))
        .map(|_| Path::new(DEFAULT))
}

/// The jailer's arguments for `run` (pure; the order docs/jailer.md lists them in).
pub fn command_line(cfg: &JailerConfig, run: &JailerRun) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |s: &str, v: OsString| {
        a.push(s.into());
        a.push(v);
    };
    push("--id", run.id.into());
    push("--exec-file", run.exec_file.into());
    push("--uid", run.uid.to_string().into());
    push("--gid", run.uid.to_string().into());
    push("--chroot-base-dir", cfg.chroot_base.clone().into());
    if let Some(cg) = run.cgroups {
        let v = match cg.version {
            Version::V1 => "1",
            Version::V2 => "2",
        };
        push("--cgroup-version", v.into());
        push("--parent-cgroup", cg.parent.clone().into());
        for l in &cg.limits {
            push("--cgroup", l.into());
        }
    }
    a.push("--new-pid-ns".into());
    a.push("--".into());
    a.extend(run.firecracker_args.iter().cloned());
    a
}

/// How a file is placed in the jail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Shared with other VMs (kernel, initrd, base image): linked as it is, readable by all.
    Shared,
    /// The VM's own (its writable drive, owned by its uid already).
    Own,
    /// A template's snapshot (its memory and vmstate files), loaded by every clone of it.
    /// Hard-linked only, never copied: clones share the memory file's page cache (a copy per
    /// clone would cost the template's whole memory each), and the link keeps the inode, so the
    /// file outlives every clone even when the template is deleted. The one inode is made
    /// root-owned and read-only for all (0444): each clone's uid may read it (it holds no
    /// secret: the template booted without any), none may write it, since a write would change
    /// the memory of every clone that has not faulted that page in yet. What a clone's uid can
    /// reach of its own (sockets, log, writable drive) stays in its own jail, owned by it.
    Template,
}

/// Prepare VM `uid`'s jail root for a (re)start of the jailer: created if missing; what a
/// previous run left that the jailer makes again (device nodes, the copied binary, its pid
/// file, sockets) removed; `files` hard-linked in under their names (copied when on another
/// filesystem); Firecracker's log file made (it opens, never creates it), owned by `uid`.
pub fn stage(
    root: &Path,
    exec_file: &Path,
    uid: u32,
    files: &[(&Path, &str, Place)],
) -> Result<(), JailerError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| JailerError::Stage { path, source }
    };
    std::fs::create_dir_all(root).map_err(err(root))?;
    let name = exec_name(exec_file)?;
    let dev = root.join("dev");
    match std::fs::remove_dir_all(&dev) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(&dev)(e)),
        _ => {}
    }
    for stale in [
        name.clone(),
        format!("{name}.pid"),
        API_SOCK.into(),
        VSOCK.into(),
    ] {
        remove_if_there(&root.join(stale)).map_err(err(root))?;
    }
    for (src, name, place) in files {
        let dst = root.join(name);
        remove_if_there(&dst).map_err(err(&dst))?;
        if *place == Place::Template {
            std::fs::hard_link(src, &dst).map_err(|e| {
                let e = if e.raw_os_error() == Some(libc::EXDEV) {
                    std::io::Error::other(format!(
                        "{} is on another filesystem than the jails: a template is linked, never copied",
                        src.display()
                    ))
                } else {
                    e
                };
                err(&dst)(e)
            })?;
            std::os::unix::fs::chown(&dst, Some(0), Some(0)).map_err(err(&dst))?;
            std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o444))
                .map_err(err(&dst))?;
            continue;
        }
        match std::fs::hard_link(src, &dst) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                std::fs::copy(src, &dst).map_err(err(&dst))?;
                if *place == Place::Own {
                    crate::jail::own(&dst, uid, 0o600).map_err(err(&dst))?;
                }
            }
            Err(e) => return Err(err(&dst)(e)),
        }
    }
    let log = root.join(VMM_LOG);
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .map_err(err(&log))?;
    crate::jail::own(&log, uid, 0o600).map_err(err(&log))?;
    Ok(())
}

fn remove_if_there(p: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Firecracker's host pid, once the jailer has written it to `<root>/<exec name>.pid` (it
/// forks Firecracker into a new PID namespace and exits). `jailer_alive` ends the wait early
/// when the jailer died without writing it.
pub async fn wait_pid(
    root: &Path,
    exec_file: &Path,
    timeout: Duration,
    jailer_alive: impl Fn() -> bool,
) -> Result<i32, JailerError> {
    let path = root.join(format!("{}.pid", exec_name(exec_file)?));
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(pid) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return Ok(pid);
        }
        let alive = jailer_alive();
        if Instant::now() >= deadline || (!alive && !path.exists()) {
            // One last look: the jailer may have written it as it exited.
            if let Some(pid) = std::fs::read_to_string(&path)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                return Ok(pid);
            }
            return Err(JailerError::NoPid { path, timeout });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Make the vsock socket Firecracker bound in its jail reachable at `link` (in the VM's
/// directory, where imp-agent connects): the socket's group becomes root with mode 0660 (the
/// agent holds no capability, so it needs the group), and it is hard-linked there.
pub fn expose_vsock(jail_sock: &Path, link: &Path, uid: u32) -> Result<(), JailerError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| JailerError::Stage { path, source }
    };
    std::os::unix::fs::chown(jail_sock, Some(uid), Some(0)).map_err(err(jail_sock))?;
    std::fs::set_permissions(jail_sock, std::fs::Permissions::from_mode(0o660))
        .map_err(err(jail_sock))?;
    remove_if_there(link).map_err(err(link))?;
    std::fs::hard_link(jail_sock, link).map_err(err(link))
}

/// The version `bin --version` prints (`Firecracker v1.7.0`, `Jailer v1.7.0`: the first word
/// that starts with a digit, or with `v` and a digit).
pub fn version_of(bin: &Path) -> Result<String, JailerError> {
    let out = std::process::Command::new(bin)
        .arg("--version")
        .output()
        .map_err(|source| JailerError::Version {
            bin: bin.to_path_buf(),
            source,
        })?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    parse_version(&text).ok_or(JailerError::NoVersion {
        bin: bin.to_path_buf(),
        out: text,
    })
}

fn parse_version(text: &str) -> Option<String> {
    text.split_whitespace().find_map(|w| {
        let v = w.strip_prefix('v').unwrap_or(w);
        v.starts_with(|c: char| c.is_ascii_digit())
            .then(|| v.to_string())
    })
}

/// The preflight: the jailer runs and is Firecracker's release.
pub fn preflight(cfg: &JailerConfig, firecracker: &Path) -> Result<String, JailerError> {
    let j = version_of(&cfg.bin)?;
    let f = version_of(firecracker)?;
    if j != f {
        return Err(JailerError::VersionMismatch {
            jailer: cfg.bin.clone(),
            jailer_version: j,
            firecracker_version: f,
        });
    }
    Ok(j)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> JailerConfig {
        JailerConfig {
            bin: "/usr/local/bin/jailer".into(),
            chroot_base: "/var/lib/imp/jailer".into(),
        }
    }

    #[test]
    fn the_jail_root_is_base_exec_name_id_root() {
        let r = chroot_root(&cfg(), Path::new("/usr/local/bin/firecracker"), "vm-1").unwrap();
        assert_eq!(
            r,
            PathBuf::from("/var/lib/imp/jailer/firecracker/vm-1/root")
        );
        assert_eq!(
            in_jail(&r, &r.join("api.sock")).as_deref(),
            Some("/api.sock")
        );
        assert_eq!(in_jail(&r, Path::new("/etc/passwd")), None);
    }

    #[test]
    fn the_command_line_names_id_uid_chroot_cgroups_and_firecracker_args_after_the_separator() {
        let cg = CgroupArgs {
            version: Version::V2,
            root: "/sys/fs/cgroup".into(),
            parent: "imp-vms".into(),
            limits: vec!["memory.max=100".into(), "pids.max=9".into()],
        };
        let run = JailerRun {
            id: "vm-1",
            exec_file: Path::new("/bin/firecracker"),
            uid: 900_001,
            cgroups: Some(&cg),
            firecracker_args: vec!["--api-sock".into(), "/api.sock".into()],
        };
        let a: Vec<String> = command_line(&cfg(), &run)
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        assert_eq!(
            a.join(" "),
            "--id vm-1 --exec-file /bin/firecracker --uid 900001 --gid 900001 \
             --chroot-base-dir /var/lib/imp/jailer --cgroup-version 2 --parent-cgroup imp-vms \
             --cgroup memory.max=100 --cgroup pids.max=9 --new-pid-ns -- --api-sock /api.sock"
        );
        let bare = JailerRun {
            cgroups: None,
            ..run
        };
        let a = command_line(&cfg(), &bare);
        assert!(!a.iter().any(|s| s == "--cgroup" || s == "--cgroup-version"));
    }

    #[test]
    fn versions_are_read_from_either_binary_s_banner() {
        assert_eq!(
            parse_version("Firecracker v1.7.0\n\n").as_deref(),
            Some("1.7.0")
        );
        assert_eq!(parse_version("Jailer v1.7.0").as_deref(), Some("1.7.0"));
        assert_eq!(
            parse_version("firecracker 1.17.0-imp-sim").as_deref(),
            Some("1.17.0-imp-sim")
        );
        assert_eq!(parse_version("no version here"), None);
    }

    #[test]
    fn staging_links_files_makes_the_log_and_clears_what_the_jailer_remakes() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("jail/firecracker/a/root");
        let kernel = d.path().join("vmlinux");
        std::fs::write(&kernel, b"k").unwrap();
        std::fs::create_dir_all(root.join("dev/net")).unwrap();
        std::fs::write(root.join("firecracker.pid"), b"1").unwrap();
        let me = nix::unistd::geteuid().as_raw();
        stage(
            &root,
            Path::new("/x/firecracker"),
            me,
            &[(kernel.as_path(), "vmlinux", Place::Shared)],
        )
        .unwrap();
        use std::os::unix::fs::MetadataExt as _;
        let (a, b) = (
            std::fs::metadata(&kernel).unwrap(),
            std::fs::metadata(root.join("vmlinux")).unwrap(),
        );
        assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()), "hard-linked");
        assert!(!root.join("dev").exists() && !root.join("firecracker.pid").exists());
        let log = std::fs::metadata(root.join(VMM_LOG)).unwrap();
        assert_eq!((log.uid(), log.mode() & 0o777), (me, 0o600));
        // Staging again (a resume) is fine.
        stage(
            &root,
            Path::new("/x/firecracker"),
            me,
            &[(kernel.as_path(), "vmlinux", Place::Shared)],
        )
        .unwrap();
    }

    /// A template's files: the same inode in every clone's jail, root's and read-only; each
    /// clone's own files its own; the links outlive the template's files.
    #[test]
    fn template_files_are_one_read_only_root_inode_in_every_clone_jail() {
        use std::os::unix::fs::MetadataExt as _;
        // A template's files: the same inode in every clone's jail, root's and read-only.
        if !nix::unistd::geteuid().is_root() {
            return imp_testkit::skip::skip_or_fail(
                "IMP_REQUIRE_ROOT",
                "template staging",
                "chown to clone uids needs root",
            );
        }
        let d = tempfile::tempdir().unwrap();
        let mem = d.path().join("template.mem");
        std::fs::write(&mem, b"memory").unwrap();
        let clones: Vec<PathBuf> = (0..2)
            .map(|i| d.path().join(format!("jail/firecracker/c{i}/root")))
            .collect();
        for (i, r) in clones.iter().enumerate() {
            stage(
                r,
                Path::new("/x/firecracker"),
                900_100 + i as u32,
                &[(mem.as_path(), "template.mem", Place::Template)],
            )
            .unwrap();
        }
        let (a, b) = (
            std::fs::metadata(clones[0].join("template.mem")).unwrap(),
            std::fs::metadata(clones[1].join("template.mem")).unwrap(),
        );
        assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()));
        assert_eq!((a.uid(), a.gid(), a.mode() & 0o777), (0, 0, 0o444));
        // Each clone's own files are its own.
        let own = |r: &Path| std::fs::metadata(r.join(VMM_LOG)).unwrap();
        assert_eq!(
            (own(&clones[0]).uid(), own(&clones[0]).mode() & 0o777),
            (900_100, 0o600)
        );
        assert_eq!(own(&clones[1]).uid(), 900_101);
        // Deleting the template leaves the clones' links (the memory outlives them).
        std::fs::remove_file(&mem).unwrap();
        assert_eq!(
            std::fs::read(clones[0].join("template.mem")).unwrap(),
            b"memory"
        );
    }
}
