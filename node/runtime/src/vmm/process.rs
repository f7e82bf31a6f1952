//! The one place imp-runtime starts VMM and helper processes, and how it knows them afterwards:
//! by pid and start time, so a recycled pid is never taken for one of its VMs.

use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::time::Instant;

use crate::jail::{JailError, Prepared};
use crate::procfs;

const POLL: Duration = Duration::from_millis(5);

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("cgroup path {0} holds a NUL byte")]
    NulInCgroup(PathBuf),
    #[error("spawn {bin}: {source}")]
    Spawn { bin: String, source: std::io::Error },
    #[error("spawn {bin}: {source}")]
    Jail { bin: String, source: JailError },
}

/// A process by identity (pid + start time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    pub pid: i32,
    pub start_time: u64,
}

impl Proc {
    pub fn is_alive(&self) -> bool {
        procfs::is_alive(self.pid, self.start_time)
    }

    /// SIGKILL (only if it is still ours), then wait until it is gone.
    pub async fn kill(&self) {
        if self.is_alive() {
            let _ = kill(Pid::from_raw(self.pid), Signal::SIGKILL);
        }
        self.wait_gone(Duration::from_secs(10)).await;
    }

    /// Whether it was gone within `timeout`.
    pub async fn wait_gone(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.is_alive() {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(POLL).await;
        }
        true
    }
}

/// A log file a spawned process appends to (created if missing).
pub fn append_log(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

/// Spawn `cmd` in a session of its own (no controlling terminal, no parent-death signal: the
/// runtime dying never takes a VM with it) and inside `cgroups` (`cgroup.procs` files, one per
/// hierarchy) from before it execs, so none of its memory or CPU is ever charged to the
/// runtime's. With `jail`, it is confined before it execs (`jail::Prepared::enter`). `keep`
/// are descriptors it inherits across exec (a TAP, a migration stream), named by number on its
/// command line.
/// A task reaps it if it exits while this runtime is its parent. Returns its pid and start
/// time (none when it has already exited).
pub fn spawn_detached(
    mut cmd: std::process::Command,
    cgroups: &[PathBuf],
    keep: &[RawFd],
    jail: Option<Prepared>,
) -> Result<(i32, Option<u64>), SpawnError> {
    use std::os::unix::process::CommandExt as _;
    let procs = cgroups
        .iter()
        .map(|p| {
            std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
                .map_err(|_| SpawnError::NulInCgroup(p.clone()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let keep = keep.to_vec();
    let jail = jail.map(std::sync::Arc::new);
    let in_child = jail.clone();
    // SAFETY: between fork and exec only async-signal-safe calls, no allocation: setsid,
    // getpid, open/write/close of a path prepared before the fork, the jail's system calls
    // (jail.rs), fcntl.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            for p in &procs {
                enter_cgroup(p)?;
            }
            if let Some(j) = &in_child {
                j.enter()?;
            }
            for fd in &keep {
                if libc::fcntl(*fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let bin = cmd.get_program().to_string_lossy().into_owned();
    let spawned = tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn();
    let mut child = spawned.map_err(|source| {
        match jail.as_ref().and_then(|j| j.failure(source.raw_os_error())) {
            Some(source) => SpawnError::Jail {
                bin: bin.clone(),
                source,
            },
            None => SpawnError::Spawn {
                bin: bin.clone(),
                source,
            },
        }
    })?;
    let pid = child.id().expect("a just-spawned child has a pid") as i32;
    tokio::spawn(async move {
        let _ = child.wait().await;
    });
    Ok((pid, procfs::start_time(pid)))
}

/// Write this process's pid into `procs` (a `cgroup.procs` file). Runs in a forked child:
/// formats on the stack, calls only async-signal-safe functions.
fn enter_cgroup(procs: &std::ffi::CStr) -> std::io::Result<()> {
    let mut buf = [0u8; 20];
    let mut n = unsafe { libc::getpid() } as u64;
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // SAFETY: a valid C string and a stack buffer; the fd is closed on every path.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let written = libc::write(fd, buf[i..].as_ptr().cast(), buf.len() - i);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if written < 0 {
            return Err(err);
        }
    }
    Ok(())
}
