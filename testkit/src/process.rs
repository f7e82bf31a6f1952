//! Child processes that cannot outlive the test process.
//!
//! Every child is spawned from one long-lived thread with `PR_SET_PDEATHSIG` (the signal fires when the
//! *spawning thread* exits, so spawning from short-lived test threads would kill children early), and is
//! registered so an `atexit` hook can stop it when the test binary exits normally. Teardown only ever
//! signals pids this process started. A child joins the network namespace of the thread that asked
//! for it (a test's thread inside a namespace), not the spawner thread's: whichever test spawned
//! first no longer decides where every later child lives.

use std::{
    fs::File,
    io,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Mutex, OnceLock, mpsc},
    time::{Duration, Instant},
};

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
/// The network namespace (inode) the spawner thread was created in, so its children's.
static SPAWNER_NETNS: OnceLock<Option<u64>> = OnceLock::new();
static LIVE_PIDS: Mutex<Vec<i32>> = Mutex::new(Vec::new());
static CLEANUP_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The inode of the calling thread's network namespace.
fn thread_netns() -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/thread-self/ns/net")
        .ok()
        .map(|m| m.ino())
}

fn spawner() -> mpsc::Sender<SpawnRequest> {
    SPAWNER
        .get_or_init(|| {
            // The thread below is created here: it is in this thread's namespace.
            SPAWNER_NETNS.get_or_init(thread_netns);
            let (tx, rx) = mpsc::channel::<SpawnRequest>();
            std::thread::Builder::new()
                .name("imp-testkit-spawner".into())
                .spawn(move || {
                    for (mut cmd, reply) in rx {
                        let _ = reply.send(cmd.spawn());
                    }
                    // The sender lives in a static, so this loop only ends with the process.
                })
                .expect("spawn the testkit spawner thread");
            // SAFETY: registering a plain extern "C" fn is always sound.
            unsafe { libc::atexit(stop_everything_at_exit) };
            Mutex::new(tx)
        })
        .lock()
        .expect("spawner lock")
        .clone()
}

extern "C" fn stop_everything_at_exit() {
    let pids: Vec<i32> = LIVE_PIDS
        .lock()
        .map(|mut p| std::mem::take(&mut *p))
        .unwrap_or_default();
    for &pid in &pids {
        // SAFETY: pid is a child we spawned and have not reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for &pid in &pids {
        loop {
            // SAFETY: waitpid on our own child.
            let r = unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
            if r != 0 {
                break;
            }
            if Instant::now() > deadline {
                unsafe { libc::kill(pid, libc::SIGKILL) };
                unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    if let Ok(mut dirs) = CLEANUP_DIRS.lock() {
        for dir in dirs.drain(..) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Removes `dir` when the test process exits normally.
pub fn remove_at_exit(dir: &Path) {
    let _ = spawner(); // make sure the atexit hook is registered
    CLEANUP_DIRS
        .lock()
        .expect("cleanup lock")
        .push(dir.to_path_buf());
}

/// A running child whose output goes to a log file.
pub struct ManagedProcess {
    pub name: String,
    child: Child,
    pub log_path: PathBuf,
}

impl ManagedProcess {
    /// Spawns `cmd` with stdout and stderr appended to `log_path`; the child gets SIGKILL if this
    /// process dies.
    pub fn spawn(name: &str, mut cmd: Command, log_path: &Path) -> io::Result<Self> {
        let log = File::create(log_path)?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let spawner = spawner();
        let here = thread_netns();
        if here.is_some() && SPAWNER_NETNS.get().copied().flatten() != here {
            // Entered in the child, before exec (setns is a plain syscall); the file is open
            // until then.
            let ns = File::open("/proc/thread-self/ns/net")?;
            // SAFETY: setns only changes the child's network namespace.
            unsafe {
                cmd.pre_exec(move || {
                    use std::os::fd::AsRawFd as _;
                    if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let (tx, rx) = mpsc::channel();
        spawner
            .send((cmd, tx))
            .map_err(|_| io::Error::other("testkit spawner thread is gone"))?;
        let child = rx
            .recv()
            .map_err(|_| io::Error::other("testkit spawner thread is gone"))??;
        LIVE_PIDS.lock().expect("pid lock").push(child.id() as i32);
        Ok(Self {
            name: name.to_owned(),
            child,
            log_path: log_path.to_path_buf(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the child has exited.
    pub fn try_exit_status(&mut self) -> io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// The last `lines` lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log_path, lines)
    }

    /// SIGTERM, then SIGKILL after `grace`; reaps the child.
    pub fn stop(&mut self, grace: Duration) {
        let pid = self.child.id() as i32;
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling our own unreaped child.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let deadline = Instant::now() + grace;
            while self.child.try_wait().ok().flatten().is_none() {
                if Instant::now() > deadline {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        LIVE_PIDS.lock().expect("pid lock").retain(|p| *p != pid);
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// The last `lines` lines of a text file ("" when unreadable).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
