//! jailer-double: a stand-in for Firecracker's `jailer` (docs/jailer.md of the Firecracker
//! release it ships with) on hosts without it. It takes exactly the jailer's command line and
//! fails on anything else (an unknown or misspelt flag exits 2, as clap does for the jailer),
//! and performs the jailer's documented steps for real, in its order:
//!
//! 1. validate the id (alphanumerics and `-`, at most 64) and the exec file (a file whose name
//!    contains `firecracker`);
//! 2. close every descriptor but 0-2 and clear the environment;
//! 3. create `<chroot-base-dir>/<exec-file-name>/<id>/root` and copy the exec file into it;
//! 4. join `--netns`; set the resource limits (no-file 2048 unless `--resource-limit`);
//! 5. for each `--cgroup FILE=VALUE`: create `<hierarchy>/<parent-cgroup>/<id>` (parent defaults
//!    to the exec file's name), write the value, then the jailer's pid into each cgroup;
//! 6. a mount namespace of its own (mounts made slaves), the chroot bind-mounted onto itself,
//!    `pivot_root` into it and the old root detached;
//! 7. `/dev/net/tun` (10,200), `/dev/kvm` (10,232) and `/dev/urandom` (1,9) made inside and,
//!    with `/dev`, `/dev/net`, `/run` and the root, owned by uid:gid;
//! 8. `--daemonize`: `setsid`, stdio to /dev/null;
//! 9. `--new-pid-ns`: a child in a new PID namespace (its pid 1), whose host pid the parent
//!    writes to `/<exec-file-name>.pid` in the jail before it exits;
//! 10. drop to uid/gid (no supplementary groups; the kernel clears the effective and
//!     permitted capabilities) and exec `/<exec-file-name> --id=<id> --start-time-us=..
//!     --start-time-cpu-us=.. --parent-cpu-time-us=..` plus the arguments after `--`.
//!
//! Deviations, for the Firecracker simulator only (a real Firecracker is static and needs
//! nothing outside its jail): the simulator and the imp-guest it runs as a host process are
//! dynamically linked host binaries, so `IMP_JAILER_DOUBLE_BIND` (comma-separated host paths)
//! are bound read-only at their host paths inside the jail (symlinks such as `/lib -> usr/lib`
//! recreated as symlinks), `/dev/null` is made (the simulator's child processes open it), and
//! `IMP_JAILER_DOUBLE_KEEP_ENV` names environment variables kept (the simulator's
//! `IMP_GUEST_BIN`, `IMP_SIM_BEHAVIOUR`). `IMP_JAILER_DOUBLE_KEEP_ROOT` skips step 10's uid/gid
//! drop (the simulated guest then switches to its runner's user, as a real guest, root in its VM,
//! does; the real-node test's lifecycle). Unset, the double is the jailer.

use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns, unshare};
use nix::sys::stat::{Mode, SFlag, makedev, mknod};
use nix::unistd::{ForkResult, Gid, Uid, chdir, chown, fork, pivot_root, setsid};

/// The command line of Firecracker's jailer, flag for flag.
#[derive(Parser, Debug)]
#[command(name = "jailer", disable_version_flag = true)]
struct Args {
    /// Print the version (`Jailer v<version>`, the Firecracker release it belongs to).
    #[arg(long)]
    version: bool,
    /// MicroVM id: alphanumerics and hyphens, at most 64 characters.
    #[arg(long)]
    id: Option<String>,
    /// The binary run in the jail (its name must contain `firecracker`).
    #[arg(long)]
    exec_file: Option<PathBuf>,
    #[arg(long)]
    uid: Option<u32>,
    #[arg(long)]
    gid: Option<u32>,
    #[arg(long, default_value = "/srv/jailer")]
    chroot_base_dir: PathBuf,
    /// Path to a network namespace to join.
    #[arg(long)]
    netns: Option<PathBuf>,
    /// Detach (setsid, stdio to /dev/null).
    #[arg(long)]
    daemonize: bool,
    /// Exec into a new PID namespace.
    #[arg(long)]
    new_pid_ns: bool,
    /// cgroup interface: 1 or 2.
    #[arg(long, default_value = "1")]
    cgroup_version: String,
    /// `FILE=VALUE`, e.g. `memory.max=1073741824` (repeatable).
    #[arg(long)]
    cgroup: Vec<String>,
    /// Parent of the VM's cgroup, relative to each hierarchy's root.
    #[arg(long)]
    parent_cgroup: Option<PathBuf>,
    /// `fsize=N` or `no-file=N` (repeatable).
    #[arg(long)]
    resource_limit: Vec<String>,
    /// Firecracker's own arguments.
    #[arg(last = true)]
    exec_args: Vec<OsString>,
}

const VERSION: &str = imp_testkit::firecracker::sim::VMM_VERSION;
const DEFAULT_NO_FILE: u64 = 2048;

fn main() -> ExitCode {
    let args = Args::parse();
    if args.version {
        println!("Jailer v{VERSION}");
        return ExitCode::SUCCESS;
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Jailer error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `Ok` only in the parent of a `--new-pid-ns` child; otherwise the process is the exec'd
/// binary or an error.
fn run(args: Args) -> Result<(), String> {
    let id = args.id.ok_or("--id is required")?;
    let exec_file = args.exec_file.ok_or("--exec-file is required")?;
    let uid = args.uid.ok_or("--uid is required")?;
    let gid = args.gid.ok_or("--gid is required")?;
    if id.is_empty() || id.len() > 64 || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    {
        return Err(format!("Invalid instance ID: {id}"));
    }
    if !exec_file.is_file() {
        return Err(format!("{} is not a file", exec_file.display()));
    }
    let exec_name = exec_file
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| n.contains("firecracker"))
        .ok_or_else(|| {
            format!(
                "Invalid filename. The filename of `--exec-file` option must contain \"firecracker\": {}",
                exec_file.display()
            )
        })?
        .to_string();
    let cgroup_v2 = match args.cgroup_version.as_str() {
        "1" => false,
        "2" => true,
        v => return Err(format!("Invalid cgroup version: {v}")),
    };
    if let Some(p) = &args.parent_cgroup
        && (p.is_absolute() || p.components().any(|c| c.as_os_str() == ".."))
    {
        return Err(format!("Invalid parent cgroup: {}", p.display()));
    }
    let start_us = now_us(libc::CLOCK_MONOTONIC);
    let start_cpu_us = now_us(libc::CLOCK_PROCESS_CPUTIME_ID);

    close_inherited_fds()?;
    let env = kept_env();

    let chroot = args.chroot_base_dir.join(&exec_name).join(&id).join("root");
    std::fs::create_dir_all(&chroot).map_err(|e| format!("create {}: {e}", chroot.display()))?;
    let jailed_exec = chroot.join(&exec_name);
    std::fs::copy(&exec_file, &jailed_exec)
        .map_err(|e| format!("copy {} into the jail: {e}", exec_file.display()))?;

    if let Some(ns) = &args.netns {
        let f = std::fs::File::open(ns).map_err(|e| format!("open {}: {e}", ns.display()))?;
        setns(f, CloneFlags::CLONE_NEWNET).map_err(|e| format!("setns {}: {e}", ns.display()))?;
    }
    set_rlimits(&args.resource_limit)?;

    let parent = args
        .parent_cgroup
        .clone()
        .unwrap_or_else(|| PathBuf::from(&exec_name));
    let mut cgroup_dirs: Vec<PathBuf> = Vec::new();
    for spec in &args.cgroup {
        let (file, value) = spec
            .split_once('=')
            .filter(|(f, v)| f.contains('.') && !f.contains('/') && !v.is_empty())
            .ok_or_else(|| format!("Invalid cgroup: {spec}"))?;
        let controller = file.split('.').next().unwrap_or_default();
        let base = cgroup_mount(controller, cgroup_v2)?;
        let dir = base.join(&parent).join(&id);
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let path = dir.join(file);
        std::fs::write(&path, value).map_err(|e| format!("write {}: {e}", path.display()))?;
        if !cgroup_dirs.contains(&dir) {
            cgroup_dirs.push(dir);
        }
    }
    let me = std::process::id().to_string();
    for dir in &cgroup_dirs {
        let procs = dir.join(if cgroup_v2 { "cgroup.procs" } else { "tasks" });
        std::fs::write(&procs, &me).map_err(|e| format!("write {}: {e}", procs.display()))?;
    }

    let dev_null = if args.daemonize {
        Some(std::fs::File::open("/dev/null").map_err(|e| format!("open /dev/null: {e}"))?)
    } else {
        None
    };

    enter_chroot(&chroot)?;
    let (u, g) = (Uid::from_raw(uid), Gid::from_raw(gid));
    for d in ["/dev", "/dev/net", "/run"] {
        match std::fs::create_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("create {d}: {e}")),
        }
        chown(d, Some(u), Some(g)).map_err(|e| format!("chown {d}: {e}"))?;
    }
    chown("/", Some(u), Some(g)).map_err(|e| format!("chown the jail root: {e}"))?;
    let mut devices = vec![
        ("/dev/net/tun", 10, 200, 0o600),
        ("/dev/kvm", 10, 232, 0o600),
        ("/dev/urandom", 1, 9, 0o600),
    ];
    if std::env::var_os("IMP_JAILER_DOUBLE_BIND").is_some() || !env.is_empty() {
        // Deviation (simulator only): its child processes open /dev/null.
        devices.push(("/dev/null", 1, 3, 0o666));
    }
    for (path, major, minor, mode) in devices {
        mknod(
            path,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(mode),
            makedev(major, minor),
        )
        .map_err(|e| format!("mknod {path}: {e}"))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("chmod {path}: {e}"))?;
        chown(path, Some(u), Some(g)).map_err(|e| format!("chown {path}: {e}"))?;
    }

    if let Some(null) = dev_null {
        setsid().map_err(|e| format!("setsid: {e}"))?;
        let dup = |r: nix::Result<()>| r.map_err(|e| format!("dup2 /dev/null: {e}"));
        dup(nix::unistd::dup2_stdin(&null))?;
        dup(nix::unistd::dup2_stdout(&null))?;
        dup(nix::unistd::dup2_stderr(&null))?;
    }

    // The jailer's own CPU time, measured before a fork resets the clock.
    let parent_cpu_us = now_us(libc::CLOCK_PROCESS_CPUTIME_ID).saturating_sub(start_cpu_us);
    if args.new_pid_ns {
        unshare(CloneFlags::CLONE_NEWPID).map_err(|e| format!("new PID namespace: {e}"))?;
        // SAFETY: this process is single-threaded (no runtime, no threads spawned).
        match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
            ForkResult::Parent { child } => {
                let pid_file = format!("/{exec_name}.pid");
                std::fs::write(&pid_file, child.as_raw().to_string())
                    .map_err(|e| format!("write {pid_file}: {e}"))?;
                return Ok(());
            }
            ForkResult::Child => {}
        }
    }
    let mut argv = vec![
        format!("/{exec_name}"),
        format!("--id={id}"),
        format!("--start-time-us={start_us}"),
        format!("--start-time-cpu-us={start_cpu_us}"),
        format!("--parent-cpu-time-us={parent_cpu_us}"),
    ]
    .into_iter()
    .map(|s| CString::new(s).expect("no NUL"))
    .collect::<Vec<_>>();
    for a in &args.exec_args {
        argv.push(CString::new(a.as_bytes()).map_err(|_| "an argument holds a NUL byte")?);
    }
    // Deviation: IMP_JAILER_DOUBLE_KEEP_ROOT keeps the simulator root inside its jail, for a
    // simulated guest that switches to its runner's user as a real guest (root in its VM) does.
    if std::env::var_os("IMP_JAILER_DOUBLE_KEEP_ROOT").is_none() {
        nix::unistd::setgroups(&[]).map_err(|e| format!("setgroups: {e}"))?;
        nix::unistd::setresgid(g, g, g).map_err(|e| format!("setresgid {gid}: {e}"))?;
        nix::unistd::setresuid(u, u, u).map_err(|e| format!("setresuid {uid}: {e}"))?;
    }
    let e = nix::unistd::execve(&argv[0], &argv, &env);
    Err(format!("exec /{exec_name}: {e:?}"))
}

fn now_us(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

/// Every descriptor but stdio closed, as the jailer does first.
fn close_inherited_fds() -> Result<(), String> {
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map_err(|e| format!("list /proc/self/fd: {e}"))?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // The directory's own descriptor is among them and already closed: EBADF is fine.
        // SAFETY: closing descriptors this process owns and no Rust object holds.
        unsafe { libc::close(fd) };
    }
    Ok(())
}

/// The environment the exec file gets: none (the jailer clears it), except the deviation's
/// `IMP_JAILER_DOUBLE_KEEP_ENV` names.
fn kept_env() -> Vec<CString> {
    let keep: Vec<String> = std::env::var("IMP_JAILER_DOUBLE_KEEP_ENV")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    std::env::vars_os()
        .filter(|(k, _)| keep.iter().any(|n| k.as_bytes() == n.as_bytes()))
        .filter_map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).ok()
        })
        .collect()
}

fn set_rlimits(specs: &[String]) -> Result<(), String> {
    let mut no_file = DEFAULT_NO_FILE;
    let mut fsize = None;
    for s in specs {
        let (k, v) = s
            .split_once('=')
            .and_then(|(k, v)| Some((k, v.parse::<u64>().ok()?)))
            .ok_or_else(|| format!("Invalid resource limit: {s}"))?;
        match k {
            "no-file" => no_file = v,
            "fsize" => fsize = Some(v),
            _ => return Err(format!("Invalid resource limit: {s}")),
        }
    }
    let set = |res, v: u64| {
        let l = libc::rlimit {
            rlim_cur: v,
            rlim_max: v,
        };
        // SAFETY: setrlimit reads the struct we own.
        if unsafe { libc::setrlimit(res, &l) } < 0 {
            return Err(format!("setrlimit: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    };
    set(libc::RLIMIT_NOFILE, no_file)?;
    if let Some(f) = fsize {
        set(libc::RLIMIT_FSIZE, f)?;
    }
    Ok(())
}

/// Where `controller`'s hierarchy is mounted (v1: the `cgroup` mount naming it among its
/// options; v2: the `cgroup2` mount), from /proc/self/mounts.
fn cgroup_mount(controller: &str, v2: bool) -> Result<PathBuf, String> {
    let mounts =
        std::fs::read_to_string("/proc/self/mounts").map_err(|e| format!("read mounts: {e}"))?;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        let found = if v2 {
            f[2] == "cgroup2"
        } else {
            f[2] == "cgroup" && f[3].split(',').any(|o| o == controller)
        };
        if found {
            return Ok(PathBuf::from(f[1]));
        }
    }
    Err(format!(
        "Cgroup hierarchy for controller {controller} not found (cgroup v{})",
        if v2 { 2 } else { 1 }
    ))
}

/// A mount namespace of its own whose root is `chroot` (pivot_root; the old root detached).
fn enter_chroot(chroot: &Path) -> Result<(), String> {
    let none: Option<&str> = None;
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare the mount namespace: {e}"))?;
    mount(none, "/", none, MsFlags::MS_SLAVE | MsFlags::MS_REC, none)
        .map_err(|e| format!("make mounts slaves: {e}"))?;
    mount(
        Some(chroot),
        chroot,
        none,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        none,
    )
    .map_err(|e| format!("bind {} onto itself: {e}", chroot.display()))?;
    bind_deviation(chroot)?;
    chdir(chroot).map_err(|e| format!("chdir {}: {e}", chroot.display()))?;
    let old = "old_root";
    match std::fs::create_dir(old) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("create old_root: {e}")),
    }
    pivot_root(".", old).map_err(|e| format!("pivot_root: {e}"))?;
    chdir("/").map_err(|e| format!("chdir /: {e}"))?;
    umount2(old, MntFlags::MNT_DETACH).map_err(|e| format!("detach the old root: {e}"))?;
    std::fs::remove_dir(old).map_err(|e| format!("remove old_root: {e}"))?;
    Ok(())
}

/// The deviation's read-only binds (see the header), before pivot_root.
fn bind_deviation(chroot: &Path) -> Result<(), String> {
    let Some(list) = std::env::var_os("IMP_JAILER_DOUBLE_BIND") else {
        return Ok(());
    };
    let none: Option<&str> = None;
    for host in list.to_string_lossy().split(',').filter(|s| !s.is_empty()) {
        let host = Path::new(host);
        let Ok(rel) = host.strip_prefix("/") else {
            return Err(format!(
                "IMP_JAILER_DOUBLE_BIND: {} is relative",
                host.display()
            ));
        };
        let inside = chroot.join(rel);
        if let Some(p) = inside.parent() {
            std::fs::create_dir_all(p).map_err(|e| format!("create {}: {e}", p.display()))?;
        }
        let meta = std::fs::symlink_metadata(host)
            .map_err(|e| format!("IMP_JAILER_DOUBLE_BIND {}: {e}", host.display()))?;
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(host).map_err(|e| e.to_string())?;
            let _ = std::fs::remove_file(&inside);
            std::os::unix::fs::symlink(&target, &inside)
                .map_err(|e| format!("symlink {}: {e}", inside.display()))?;
            continue;
        }
        if meta.is_dir() {
            std::fs::create_dir_all(&inside).map_err(|e| e.to_string())?;
        } else if !inside.exists() {
            std::fs::File::create(&inside).map_err(|e| e.to_string())?;
        }
        mount(
            Some(host),
            &inside,
            none,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            none,
        )
        .map_err(|e| format!("bind {}: {e}", host.display()))?;
        mount(
            none,
            &inside,
            none,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
            none,
        )
        .map_err(|e| format!("make {} read-only: {e}", host.display()))?;
    }
    Ok(())
}
