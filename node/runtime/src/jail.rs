//! Confinement of the processes imp-runtime starts for a VM (QEMU and vhost-device-vsock): the
//! one module that owns it (docs/security.md). Each VM gets an unprivileged uid/gid of its own
//! from a configured range ([`JailConfig`]), recorded as the owner of its directory (so a
//! restarted runtime finds it again, and a uid is never handed out while its VM's files exist).
//! Each of its processes is started, between fork and exec ([`Prepared::enter`]), in a network
//! namespace of its own (no interface but a down loopback: the TAP comes as a descriptor) and a
//! mount namespace of its own whose root is a fresh tmpfs holding only: that VM's directory
//! (read-write, at its host path, so command lines and sockets keep their host paths), the
//! read-only files it boots from (kernel, initrd, base image, the binary itself), `/usr`
//! read-only for the binary's libraries and firmware, and the device nodes it needs. The host's
//! root is detached (`pivot_root`), then the bounding, inheritable and ambient capability sets are
//! emptied, the uid/gid switched (which clears the effective and permitted sets), no_new_privs
//! set and, for a binary without a sandbox of its own, a seccomp filter installed.
//!
//! The plan ([`Jail`] -> [`Prepared`]) is built before the fork; the child runs only
//! async-signal-safe system calls over it, and reports which step failed through a pipe.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Component, Path, PathBuf};

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter};

/// The per-VM uid/gid range (uid = gid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JailConfig {
    pub uid_base: u32,
    pub uid_count: u32,
}

impl JailConfig {
    pub fn contains(&self, id: u32) -> bool {
        id >= self.uid_base && id - self.uid_base < self.uid_count
    }
}

/// One VM's identity: its uid/gid and where its processes' roots are mounted (an empty
/// directory of the state dir; each process mounts its own tmpfs there in its own namespace).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmJail {
    pub id: u32,
    pub mount_point: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("every uid of the VM range {base}..{end} is held by a VM directory", end = base + count)]
    RangeExhausted { base: u32, count: u32 },
    #[error("VM directory {path}: {source}")]
    VmDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("path {0} holds a NUL byte")]
    Nul(PathBuf),
    #[error("build the seccomp filter: {0}")]
    Filter(String),
    #[error("pipe for the jail's report: {0}")]
    Pipe(std::io::Error),
    #[error("confine: mount a tmpfs root on {path}: {errno}")]
    MountRoot { path: PathBuf, errno: nix::Error },
    #[error("confine: new mount and network namespaces: {0}")]
    Unshare(nix::Error),
    #[error("confine: make mounts private: {0}")]
    Private(nix::Error),
    #[error("confine: create {path} in the jail: {errno}")]
    Create { path: PathBuf, errno: nix::Error },
    #[error("confine: bind-mount {path} into the jail: {errno}")]
    Bind { path: PathBuf, errno: nix::Error },
    #[error("confine: make {path} read-only in the jail: {errno}")]
    ReadOnly { path: PathBuf, errno: nix::Error },
    #[error("confine: device node {path}: {errno}")]
    Device { path: PathBuf, errno: nix::Error },
    #[error("confine: pivot_root into the jail: {0}")]
    PivotRoot(nix::Error),
    #[error("confine: mark inherited descriptors close-on-exec: {0}")]
    Fds(nix::Error),
    #[error("confine: drop capabilities: {0}")]
    Caps(nix::Error),
    #[error("confine: switch to uid/gid {id}: {errno}")]
    Ids { id: u32, errno: nix::Error },
    #[error("confine: set no_new_privs: {0}")]
    NoNewPrivs(nix::Error),
    #[error("confine: install the seccomp filter: {0}")]
    Seccomp(nix::Error),
}

/// The uid of a VM directory (none when it is missing or not in `cfg`'s range).
pub fn id_of(cfg: &JailConfig, dir: &Path) -> Option<u32> {
    let uid = std::fs::metadata(dir).ok()?.uid();
    cfg.contains(uid).then_some(uid)
}

/// The lowest id of the range not in `used`.
pub fn free_id(cfg: &JailConfig, used: &BTreeSet<u32>) -> Option<u32> {
    (cfg.uid_base..cfg.uid_base.saturating_add(cfg.uid_count)).find(|i| !used.contains(i))
}

/// Give VM directory `dir` (under `vms_dir`) a uid of its own: the one it has, or the lowest
/// one no directory of `vms_dir` holds. The directory becomes `id:0` with mode [`VM_DIR_MODE`].
/// The caller serialises allocations (two at once could pick the same id).
pub fn assign(cfg: &JailConfig, vms_dir: &Path, dir: &Path) -> Result<u32, JailError> {
    let io = |source| JailError::VmDir {
        path: dir.to_path_buf(),
        source,
    };
    let id = match id_of(cfg, dir) {
        Some(id) => id,
        None => {
            let used: BTreeSet<u32> = std::fs::read_dir(vms_dir)
                .map_err(io)?
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.uid())
                .collect();
            free_id(cfg, &used).ok_or(JailError::RangeExhausted {
                base: cfg.uid_base,
                count: cfg.uid_count,
            })?
        }
    };
    std::os::unix::fs::chown(dir, Some(id), Some(0)).map_err(io)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(VM_DIR_MODE)).map_err(io)?;
    Ok(id)
}

/// A VM directory: its VMM's (uid) to use, group root's only to pass through, setgid so what the
/// VMM creates in it (the vsock socket, 0770 under [`VMM_UMASK`]) is group root: imp-agent, uid 0
/// with no capability in the chart, connects to the guest that way. Another VM's uid (no group
/// root) gets nothing.
pub const VM_DIR_MODE: u32 = 0o2710;
/// The jailed processes' umask: their sockets and files are open to the directory's group (root),
/// never to others.
pub const VMM_UMASK: u32 = 0o007;

/// `path` owned by `id:id` with `mode`.
pub fn own(path: &Path, id: u32, mode: u32) -> std::io::Result<()> {
    std::os::unix::fs::chown(path, Some(id), Some(id))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// A device node a jailed process may open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Kvm,
}

/// What one process is confined to.
#[derive(Debug, Clone)]
pub struct Jail {
    pub vm: VmJail,
    /// Directories it reads and writes (its VM directory), at their host paths.
    pub rw_dirs: Vec<PathBuf>,
    /// Files it only reads (kernel, initrd, base image, its binary), at their host paths.
    pub ro_files: Vec<PathBuf>,
    pub devices: Vec<Device>,
    /// For a binary with no sandbox of its own.
    pub seccomp: Option<BpfProgram>,
}

/// Host directories every jail gets read-only: the binaries' libraries, loader and firmware.
const SYSTEM_DIRS: &[&str] = &["/usr"];
/// Top-level names that are symlinks into /usr on a merged-/usr host (bound when they are real
/// directories).
const SYSTEM_LINKS: &[&str] = &["/bin", "/sbin", "/lib", "/lib64"];
/// Character devices every jail gets (mode 0666): harmless sources and sinks.
const CHAR_DEVICES: &[(&str, u64, u64)] = &[
    ("dev/null", 1, 3),
    ("dev/zero", 1, 5),
    ("dev/random", 1, 8),
    ("dev/urandom", 1, 9),
];

/// One step of entering a jail, in order; paths absolute, or relative to the new root.
#[derive(Debug)]
enum Op {
    Mkdir(CString),
    Touch(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    Bind {
        src: CString,
        dst: CString,
    },
    /// Remount a bind read-only (and nosuid, nodev; noexec for data files).
    ReadOnly {
        dst: CString,
        noexec: bool,
    },
    Mknod {
        path: CString,
        major: u64,
        minor: u64,
        mode: u32,
        owner: Option<u32>,
    },
}

impl Op {
    fn path(&self) -> &CString {
        match self {
            Op::Mkdir(p) | Op::Touch(p) => p,
            Op::Symlink { link, .. } => link,
            Op::Bind { dst, .. } | Op::ReadOnly { dst, .. } => dst,
            Op::Mknod { path, .. } => path,
        }
    }
}

/// A jail ready to enter in a forked child.
#[derive(Debug)]
pub struct Prepared {
    id: u32,
    root: CString,
    ops: Vec<Op>,
    creds: Credentials,
    /// Write end: the child writes the index of the step that failed (CLOEXEC: a successful
    /// exec closes it).
    report: OwnedFd,
    /// Read end, for the parent.
    reports: OwnedFd,
}

/// The credential half of a jail: what a confined process is left with (uid/gid, no
/// capability, no_new_privs, the seccomp filter). Public so an escape drill can put a process
/// into exactly a VMM's state (node/runtime/tests/escape_qemu.rs).
#[derive(Debug, Clone)]
pub struct Credentials {
    pub id: u32,
    pub seccomp: Option<BpfProgram>,
    last_cap: u32,
}

impl Credentials {
    pub fn new(id: u32, seccomp: Option<BpfProgram>) -> Self {
        let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(63);
        Credentials {
            id,
            seccomp,
            last_cap,
        }
    }

    /// Drop to these credentials, for good. Async-signal-safe (for a forked child).
    ///
    /// # Safety
    /// Changes the calling process's credentials irreversibly: call it in a child before exec.
    pub unsafe fn drop_privileges(&self) -> Result<(), nix::Error> {
        unsafe { self.apply() }.map_err(|(_, e)| e)
    }

    unsafe fn apply(&self) -> Result<(), (Fixed, nix::Error)> {
        use libc::*;
        let ck = |f: Fixed, rc: c_int| {
            if rc < 0 {
                Err((f, nix::Error::last()))
            } else {
                Ok(())
            }
        };
        unsafe {
            for cap in 0..=self.last_cap {
                ck(Fixed::Caps, prctl(PR_CAPBSET_DROP, cap as c_ulong, 0, 0, 0))?;
            }
            umask(VMM_UMASK as mode_t);
            ck(Fixed::Ids, setgroups(0, std::ptr::null()))?;
            ck(Fixed::Ids, setresgid(self.id, self.id, self.id))?;
            // From uid 0 to a non-zero uid: the kernel clears the permitted and effective sets.
            ck(Fixed::Ids, setresuid(self.id, self.id, self.id))?;
            let mut header = CapHeader {
                version: LINUX_CAPABILITY_VERSION_3,
                pid: 0,
            };
            let data = [CapData::default(); 2];
            ck(
                Fixed::Caps,
                syscall(SYS_capset, &mut header, data.as_ptr()) as c_int,
            )?;
            ck(
                Fixed::Caps,
                prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL as c_ulong, 0, 0, 0),
            )?;
            ck(Fixed::NoNewPrivs, prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
            if let Some(f) = &self.seccomp {
                seccompiler::apply_filter(f).map_err(|_| (Fixed::Seccomp, nix::Error::last()))?;
            }
        }
        Ok(())
    }
}

/// Where, counted from the steps after `ops`, the fixed steps are reported.
#[derive(Debug, Clone, Copy)]
#[repr(u8)]
enum Fixed {
    Unshare = 0,
    Private,
    MountRoot,
    ReadOnlyRoot,
    PivotRoot,
    Fds,
    Caps,
    Ids,
    NoNewPrivs,
    Seccomp,
}

const FIXED: [Fixed; 10] = [
    Fixed::Unshare,
    Fixed::Private,
    Fixed::MountRoot,
    Fixed::ReadOnlyRoot,
    Fixed::PivotRoot,
    Fixed::Fds,
    Fixed::Caps,
    Fixed::Ids,
    Fixed::NoNewPrivs,
    Fixed::Seccomp,
];

fn cstr(p: &Path) -> Result<CString, JailError> {
    CString::new(p.as_os_str().as_encoded_bytes()).map_err(|_| JailError::Nul(p.to_path_buf()))
}

/// `p` relative to the new root (`/a/b` -> `a/b`), so steps run from inside the tmpfs.
fn inside(p: &Path) -> PathBuf {
    p.components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .collect()
}

/// Every ancestor directory of `paths` inside the new root, parents first.
fn ancestors(paths: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = BTreeSet::new();
    for p in paths {
        let mut acc = PathBuf::new();
        let rel = inside(p);
        let n = rel.components().count();
        for c in rel.components().take(n.saturating_sub(1)) {
            acc.push(c);
            dirs.insert(acc.clone());
        }
    }
    // BTreeSet order puts a parent before its children.
    dirs.into_iter().collect()
}

impl Jail {
    /// The steps for this jail.
    pub fn prepare(&self) -> Result<Prepared, JailError> {
        let mut ops = Vec::new();
        let mut system: Vec<PathBuf> = SYSTEM_DIRS.iter().map(PathBuf::from).collect();
        for l in SYSTEM_LINKS {
            match std::fs::read_link(l) {
                Ok(target) => ops.push(Op::Symlink {
                    target: cstr(&target)?,
                    link: cstr(&inside(Path::new(l)))?,
                }),
                Err(_) if Path::new(l).is_dir() => system.push(PathBuf::from(l)),
                Err(_) => {}
            }
        }
        // Files under a system directory are already there.
        let ro_files: Vec<&PathBuf> = self
            .ro_files
            .iter()
            .filter(|f| !system.iter().any(|s| f.starts_with(s)))
            .collect();
        let mut leaves: Vec<PathBuf> = system.clone();
        leaves.extend(self.rw_dirs.iter().cloned());
        leaves.extend(ro_files.iter().map(|p| p.to_path_buf()));
        leaves.push(PathBuf::from("/dev/x"));
        for d in ancestors(&leaves) {
            ops.push(Op::Mkdir(cstr(&d)?));
        }
        for d in system.iter().chain(&self.rw_dirs) {
            let dst = inside(d);
            ops.push(Op::Mkdir(cstr(&dst)?));
            ops.push(Op::Bind {
                src: cstr(d)?,
                dst: cstr(&dst)?,
            });
        }
        for d in &system {
            ops.push(Op::ReadOnly {
                dst: cstr(&inside(d))?,
                noexec: false,
            });
        }
        for f in ro_files {
            let dst = cstr(&inside(f))?;
            ops.push(Op::Touch(dst.clone()));
            ops.push(Op::Bind {
                src: cstr(f)?,
                dst: dst.clone(),
            });
            let exe = std::fs::metadata(f).is_ok_and(|m| m.mode() & 0o111 != 0);
            ops.push(Op::ReadOnly { dst, noexec: !exe });
        }
        for (p, major, minor) in CHAR_DEVICES {
            ops.push(Op::Mknod {
                path: cstr(Path::new(p))?,
                major: *major,
                minor: *minor,
                mode: 0o666,
                owner: None,
            });
        }
        for d in &self.devices {
            let (p, major, minor) = match d {
                Device::Kvm => ("dev/kvm", 10, 232),
            };
            ops.push(Op::Mknod {
                path: cstr(Path::new(p))?,
                major,
                minor,
                mode: 0o600,
                owner: Some(self.vm.id),
            });
        }
        let (reports, report) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| JailError::Pipe(e.into()))?;
        Ok(Prepared {
            id: self.vm.id,
            root: cstr(&self.vm.mount_point)?,
            ops,
            creds: Credentials::new(self.vm.id, self.seccomp.clone()),
            report,
            reports,
        })
    }
}

type Step<T> = Result<T, (usize, nix::Error)>;

fn check(step: usize, rc: libc::c_int) -> Step<()> {
    if rc < 0 {
        Err((step, nix::Error::last()))
    } else {
        Ok(())
    }
}

impl Prepared {
    /// Enter the jail: runs in the forked child, before exec. Only async-signal-safe calls on
    /// data prepared before the fork; on failure it writes the failed step to the report pipe.
    ///
    /// # Safety
    /// Call only in a child between fork and exec (it changes the calling process's root,
    /// credentials and capabilities for good).
    pub unsafe fn enter(&self) -> std::io::Result<()> {
        match unsafe { self.steps() } {
            Ok(()) => Ok(()),
            Err((step, errno)) => {
                let b = (step.min(255) as u8).to_ne_bytes();
                unsafe { libc::write(self.report.as_raw_fd(), b.as_ptr().cast(), 1) };
                Err(std::io::Error::from_raw_os_error(errno as i32))
            }
        }
    }

    fn fixed(&self, f: Fixed) -> usize {
        self.ops.len() + f as usize
    }

    unsafe fn steps(&self) -> Step<()> {
        use libc::*;
        let null = std::ptr::null::<c_char>();
        let fx = |f| self.fixed(f);
        unsafe {
            check(fx(Fixed::Unshare), unshare(CLONE_NEWNS | CLONE_NEWNET))?;
            check(
                fx(Fixed::Private),
                mount(
                    null,
                    c"/".as_ptr(),
                    null,
                    MS_REC | MS_PRIVATE,
                    std::ptr::null(),
                ),
            )?;
            check(
                fx(Fixed::MountRoot),
                mount(
                    c"tmpfs".as_ptr(),
                    self.root.as_ptr(),
                    c"tmpfs".as_ptr(),
                    MS_NOSUID,
                    c"size=1m,nr_inodes=256,mode=0755".as_ptr().cast(),
                ),
            )?;
            check(fx(Fixed::MountRoot), chdir(self.root.as_ptr()))?;
            for (i, op) in self.ops.iter().enumerate() {
                let rc = match op {
                    Op::Mkdir(p) => {
                        let rc = mkdir(p.as_ptr(), 0o755);
                        if rc < 0 && nix::Error::last() == nix::Error::EEXIST {
                            0
                        } else {
                            rc
                        }
                    }
                    Op::Touch(p) => {
                        let fd = open(p.as_ptr(), O_CREAT | O_WRONLY | O_CLOEXEC, 0o644);
                        if fd >= 0 {
                            close(fd);
                        }
                        fd
                    }
                    Op::Symlink { target, link } => symlink(target.as_ptr(), link.as_ptr()),
                    Op::Bind { src, dst } => {
                        mount(src.as_ptr(), dst.as_ptr(), null, MS_BIND, std::ptr::null())
                    }
                    Op::ReadOnly { dst, noexec } => {
                        let flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV;
                        let flags = if *noexec { flags | MS_NOEXEC } else { flags };
                        mount(null, dst.as_ptr(), null, flags, std::ptr::null())
                    }
                    Op::Mknod {
                        path,
                        major,
                        minor,
                        mode,
                        owner,
                    } => {
                        let rc = mknod(
                            path.as_ptr(),
                            S_IFCHR | mode,
                            makedev(*major as _, *minor as _),
                        );
                        let rc = if rc == 0 {
                            chmod(path.as_ptr(), *mode)
                        } else {
                            rc
                        };
                        match owner {
                            Some(id) if rc == 0 => chown(path.as_ptr(), *id, *id),
                            _ => rc,
                        }
                    }
                };
                check(i, rc)?;
            }
            // Nothing in the root itself is writable: only the VM's own directory.
            check(
                fx(Fixed::ReadOnlyRoot),
                mount(
                    null,
                    c".".as_ptr(),
                    null,
                    MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID,
                    std::ptr::null(),
                ),
            )?;
            // pivot_root(".", "."): the old root is stacked under the new one, then detached.
            let dot = c".".as_ptr();
            check(
                fx(Fixed::PivotRoot),
                syscall(SYS_pivot_root, dot, dot) as c_int,
            )?;
            check(fx(Fixed::PivotRoot), umount2(dot, MNT_DETACH))?;
            check(fx(Fixed::PivotRoot), chdir(c"/".as_ptr()))?;
            // Every descriptor but stdio ends at exec (the caller then keeps the ones it hands
            // to the process: process::spawn_detached).
            check(
                fx(Fixed::Fds),
                syscall(SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC) as c_int,
            )?;
            self.creds.apply().map_err(|(f, e)| (fx(f), e))?;
        }
        Ok(())
    }

    /// After a failed spawn: which step failed, as the error to report (none if the jail was
    /// not the cause).
    pub fn failure(&self, errno: Option<i32>) -> Option<JailError> {
        let mut b = [0u8; 1];
        nix::fcntl::fcntl(
            &self.reports,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        )
        .ok()?;
        let n = nix::unistd::read(&self.reports, &mut b).ok()?;
        if n != 1 {
            return None;
        }
        let errno = nix::Error::from_raw(errno.unwrap_or(0));
        let step = b[0] as usize;
        let path = |p: &CString| PathBuf::from(std::ffi::OsStr::from_bytes(p.as_bytes()));
        if let Some(op) = self.ops.get(step) {
            let p = path(op.path());
            return Some(match op {
                Op::Mkdir(_) | Op::Touch(_) | Op::Symlink { .. } => {
                    JailError::Create { path: p, errno }
                }
                Op::Bind { .. } => JailError::Bind { path: p, errno },
                Op::ReadOnly { .. } => JailError::ReadOnly { path: p, errno },
                Op::Mknod { .. } => JailError::Device { path: p, errno },
            });
        }
        let root = path(&self.root);
        Some(match FIXED.get(step - self.ops.len())? {
            Fixed::Unshare => JailError::Unshare(errno),
            Fixed::Private => JailError::Private(errno),
            Fixed::MountRoot => JailError::MountRoot { path: root, errno },
            Fixed::ReadOnlyRoot => JailError::ReadOnly { path: root, errno },
            Fixed::PivotRoot => JailError::PivotRoot(errno),
            Fixed::Fds => JailError::Fds(errno),
            Fixed::Caps => JailError::Caps(errno),
            Fixed::Ids => JailError::Ids { id: self.id, errno },
            Fixed::NoNewPrivs => JailError::NoNewPrivs(errno),
            Fixed::Seccomp => JailError::Seccomp(errno),
        })
    }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// System calls vhost-device-vsock never makes once running (it serves one vhost-user socket
/// and one Unix listener): a deny-list, each answered EPERM. Kernel-, namespace-, mount-,
/// module-, key-, tracing- and credential-changing calls, the usual escape routes.
const VHOST_DENIED: &[libc::c_long] = &[
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_setns,
    libc::SYS_unshare,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_mknod,
    libc::SYS_mknodat,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_reboot,
    libc::SYS_acct,
    libc::SYS_syslog,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_adjtimex,
    libc::SYS_quotactl,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_setuid,
    libc::SYS_setgid,
    libc::SYS_setreuid,
    libc::SYS_setregid,
    libc::SYS_setresuid,
    libc::SYS_setresgid,
    libc::SYS_setgroups,
    libc::SYS_setfsuid,
    libc::SYS_setfsgid,
    libc::SYS_capset,
    libc::SYS_personality,
];

/// vhost-device-vsock's filter: every call allowed but [`VHOST_DENIED`] (EPERM).
pub fn vhost_filter() -> Result<BpfProgram, JailError> {
    let rules = VHOST_DENIED.iter().map(|s| (*s, vec![])).collect();
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| JailError::Filter(format!("{e:?}")))?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| JailError::Filter(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| JailError::Filter(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_come_from_the_range_lowest_free_first() {
        let cfg = JailConfig {
            uid_base: 900_000,
            uid_count: 3,
        };
        let used = BTreeSet::from([0, 900_000, 900_002]);
        assert_eq!(free_id(&cfg, &used), Some(900_001));
        let full = BTreeSet::from([900_000, 900_001, 900_002]);
        assert_eq!(free_id(&cfg, &full), None);
        assert!(cfg.contains(900_002) && !cfg.contains(900_003) && !cfg.contains(0));
    }

    #[test]
    fn a_vm_directory_keeps_its_id_and_a_new_one_gets_a_free_one() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: chown needs root");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let cfg = JailConfig {
            uid_base: 900_100,
            uid_count: 2,
        };
        let (a, b, c) = (d.path().join("a"), d.path().join("b"), d.path().join("c"));
        for p in [&a, &b, &c] {
            std::fs::create_dir(p).unwrap();
        }
        let ia = assign(&cfg, d.path(), &a).unwrap();
        assert_eq!(ia, 900_100);
        assert_eq!(assign(&cfg, d.path(), &a).unwrap(), ia, "kept");
        assert_eq!(id_of(&cfg, &a), Some(ia));
        let m = std::fs::metadata(&a).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (ia, 0, VM_DIR_MODE));
        assert_eq!(assign(&cfg, d.path(), &b).unwrap(), 900_101);
        assert!(matches!(
            assign(&cfg, d.path(), &c),
            Err(JailError::RangeExhausted { .. })
        ));
        std::fs::remove_dir(&a).unwrap();
        assert_eq!(
            assign(&cfg, d.path(), &c).unwrap(),
            900_100,
            "freed with its dir"
        );
    }

    #[test]
    fn ancestors_are_created_parents_first() {
        let a = ancestors(&[
            PathBuf::from("/var/lib/imp/vms/a"),
            PathBuf::from("/usr"),
            PathBuf::from("/images/vmlinuz"),
        ]);
        let s: Vec<_> = a.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(
            s,
            ["images", "var", "var/lib", "var/lib/imp", "var/lib/imp/vms"]
        );
    }

    #[test]
    fn the_vhost_filter_compiles_for_this_arch() {
        let f = vhost_filter().unwrap();
        assert!(
            f.len() > VHOST_DENIED.len(),
            "one check per denied call at least"
        );
    }
}
