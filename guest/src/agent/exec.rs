//! The exec table: processes started by `Exec`, keyed by their idempotency id, and the reaper.
//!
//! Processes belong to the table, not to the connection that asked for them: a dropped host
//! connection leaves them running, and a later `Exec` with the same id (on any connection)
//! re-reports what was recorded. All reaping goes through [`ExecTable::reap`] (`waitpid(-1)`),
//! because as PID 1 (or a subreaper) the agent must also collect orphans, and a per-child wait
//! would race with that.

use std::collections::HashMap;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use imp_common::ExposeSecret;
use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::sync::{broadcast, oneshot, watch};

use crate::protocol::{Exec, Exited, OutputStream};

/// PATH used to resolve argv[0] when the Exec env has none (PID 1 has no PATH of its own).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long after a streaming process exits its pipes may keep delivering output before
/// `Exited` is published anyway (a background grandchild can hold them open forever).
const OUTPUT_DRAIN_GRACE: Duration = Duration::from_secs(2);
const OUTPUT_CHUNK: usize = 8 * 1024;
const OUTPUT_BACKLOG: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("exec id must not be empty")]
    EmptyId,
    #[error("argv must not be empty")]
    EmptyArgv,
    #[error("{program:?} not found in PATH")]
    NotFound { program: String },
    #[error(
        "refusing to start {program:?} as root (uid 0): it must run as an unprivileged user \
         unless its pool allows root (runnerUser.runAsRoot: true)"
    )]
    RootRefused { program: String },
    #[error("could not spawn {program:?}: {source}")]
    Spawn { program: String, source: io::Error },
}

/// What is recorded for an exec id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecState {
    Running,
    Exited(Exited),
    /// Spawning failed; recorded so a retry with the same id reports the same failure.
    SpawnFailed(String),
}

#[derive(Debug, Clone)]
pub struct OutputChunk {
    pub stream: OutputStream,
    pub data: Vec<u8>,
}

#[derive(Debug)]
pub struct ExecEntry {
    pub id: String,
    pub pid: Option<u32>,
    pub poweroff_on_exit: bool,
    state: watch::Sender<ExecState>,
    output: Option<broadcast::Sender<OutputChunk>>,
    timed_out: AtomicBool,
}

impl ExecEntry {
    pub fn state(&self) -> ExecState {
        self.state.borrow().clone()
    }

    pub fn subscribe_state(&self) -> watch::Receiver<ExecState> {
        self.state.subscribe()
    }

    /// Output chunks from now on; `None` unless the Exec asked for `stream_output`.
    pub fn subscribe_output(&self) -> Option<broadcast::Receiver<OutputChunk>> {
        self.output.as_ref().map(|tx| tx.subscribe())
    }
}

/// Result of [`ExecTable::start`].
#[derive(Debug)]
pub enum StartOutcome {
    /// A process was spawned for this request.
    New(Arc<ExecEntry>),
    /// The id was seen before: nothing was spawned.
    Existing(Arc<ExecEntry>),
}

impl StartOutcome {
    pub fn entry(&self) -> &Arc<ExecEntry> {
        match self {
            StartOutcome::New(e) | StartOutcome::Existing(e) => e,
        }
    }
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Arc<ExecEntry>>,
    /// Live children: pid -> where to deliver the wait status.
    waiters: HashMap<i32, oneshot::Sender<WaitStatus>>,
}

#[derive(Clone, Default)]
pub struct ExecTable {
    inner: Arc<Mutex<Inner>>,
}

impl ExecTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, id: &str) -> Option<Arc<ExecEntry>> {
        self.lock().by_id.get(id).cloned()
    }

    /// Pids of processes still running (for shutdown).
    pub fn running_pids(&self) -> Vec<i32> {
        self.lock().waiters.keys().copied().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain maps behind; keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start `req` unless its id is known. Must be called inside a tokio runtime.
    /// `Err` only for requests that are refused outright (empty id); spawn failures are
    /// recorded in the entry.
    pub fn start(&self, req: &Exec) -> Result<StartOutcome, ExecError> {
        if req.id.is_empty() {
            return Err(ExecError::EmptyId);
        }
        let mut inner = self.lock();
        if let Some(entry) = inner.by_id.get(&req.id) {
            return Ok(StartOutcome::Existing(entry.clone()));
        }
        // Spawn with the lock held: the reaper takes it too, so a child that exits at once
        // cannot be reaped before its waiter is registered.
        let spawned = spawn(req);
        let (entry, child) = match spawned {
            Ok(child) => {
                let output = req
                    .stream_output
                    .then(|| broadcast::channel(OUTPUT_BACKLOG).0);
                let entry = Arc::new(ExecEntry {
                    id: req.id.clone(),
                    pid: Some(child.id()),
                    poweroff_on_exit: req.poweroff_on_exit,
                    state: watch::channel(ExecState::Running).0,
                    output,
                    timed_out: AtomicBool::new(false),
                });
                (entry, Some(child))
            }
            Err(e) => {
                tracing::warn!(exec_id = %req.id, error = %e, "exec failed to start");
                let entry = Arc::new(ExecEntry {
                    id: req.id.clone(),
                    pid: None,
                    poweroff_on_exit: req.poweroff_on_exit,
                    state: watch::channel(ExecState::SpawnFailed(e.to_string())).0,
                    output: None,
                    timed_out: AtomicBool::new(false),
                });
                (entry, None)
            }
        };
        inner.by_id.insert(req.id.clone(), entry.clone());
        if let Some(mut child) = child {
            let (tx, rx) = oneshot::channel();
            let pid = child.id() as i32;
            inner.waiters.insert(pid, tx);
            drop(inner);
            let pipes = (child.stdout.take(), child.stderr.take());
            // std's Child is only a handle; dropping it neither waits nor kills.
            drop(child);
            tokio::spawn(supervise(
                self.clone(),
                entry.clone(),
                rx,
                req.timeout_s,
                pipes,
            ));
        }
        Ok(StartOutcome::New(entry))
    }

    /// Collect every exited child. Statuses of children the table did not start (orphans
    /// inherited as PID 1 / subreaper) are dropped: reaping them is the point. Returns whether
    /// any child is left.
    pub fn reap(&self) -> bool {
        let mut inner = self.lock();
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => return true,
                Err(Errno::ECHILD) => return false,
                Ok(status) => {
                    if let Some(pid) = status.pid()
                        && let Some(tx) = inner.waiters.remove(&pid.as_raw())
                    {
                        let _ = tx.send(status);
                    }
                }
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "waitpid failed");
                    return true;
                }
            }
        }
    }

    /// Kill the process group of a still-running child. Checked under the lock so a pid that
    /// was already reaped (and maybe reused) is never signalled.
    fn kill_group(&self, pid: i32, signal: Signal) {
        let inner = self.lock();
        if inner.waiters.contains_key(&pid) {
            let _ = killpg(Pid::from_raw(pid), signal);
            // The leader may have left its group (setsid); signal it directly too.
            let _ = kill(Pid::from_raw(pid), signal);
        }
    }

    /// Signal every running exec's process group (shutdown).
    pub fn signal_all(&self, signal: Signal) {
        for pid in self.running_pids() {
            self.kill_group(pid, signal);
        }
    }
}

/// Waits for one child: enforces the timeout, drains output, publishes the final state.
async fn supervise(
    table: ExecTable,
    entry: Arc<ExecEntry>,
    mut exit_rx: oneshot::Receiver<WaitStatus>,
    timeout_s: Option<u64>,
    pipes: (
        Option<std::process::ChildStdout>,
        Option<std::process::ChildStderr>,
    ),
) {
    let pid = entry.pid.unwrap_or_default() as i32;
    let mut pumps = Vec::new();
    if let Some(tx) = &entry.output {
        if let Some(out) = pipes
            .0
            .and_then(|p| tokio::process::ChildStdout::from_std(p).ok())
        {
            pumps.push(tokio::spawn(pump(out, OutputStream::Stdout, tx.clone())));
        }
        if let Some(err) = pipes
            .1
            .and_then(|p| tokio::process::ChildStderr::from_std(p).ok())
        {
            pumps.push(tokio::spawn(pump(err, OutputStream::Stderr, tx.clone())));
        }
    }

    let status = match timeout_s {
        Some(secs) => {
            tokio::select! {
                // An exit that is already there wins over a timeout firing at the same moment.
                biased;
                status = &mut exit_rx => status,
                _ = tokio::time::sleep(Duration::from_secs(secs)) => {
                    tracing::warn!(exec_id = %entry.id, timeout_s = secs, "exec timed out, killing its process group");
                    entry.timed_out.store(true, Ordering::SeqCst);
                    table.kill_group(pid, Signal::SIGKILL);
                    exit_rx.await
                }
            }
        }
        None => exit_rx.await,
    };
    if !pumps.is_empty() {
        let _ = tokio::time::timeout(OUTPUT_DRAIN_GRACE, async {
            for p in pumps {
                let _ = p.await;
            }
        })
        .await;
    }
    let (code, signal) = match status {
        Ok(WaitStatus::Exited(_, code)) => (Some(code), None),
        Ok(WaitStatus::Signaled(_, sig, _)) => (None, Some(sig as i32)),
        // The sender is only dropped with the table; report it as lost rather than hang.
        other => {
            tracing::error!(exec_id = %entry.id, status = ?other, "unexpected wait status");
            (None, None)
        }
    };
    let exited = Exited {
        id: entry.id.clone(),
        code,
        signal,
        // Only if our SIGKILL is what ended it: a process that exited on its own just as the
        // timer fired (still unreaped when we signalled) did not time out.
        timed_out: entry.timed_out.load(Ordering::SeqCst) && signal == Some(libc::SIGKILL),
    };
    tracing::info!(exec_id = %entry.id, pid, ?code, ?signal, timed_out = exited.timed_out, "exec exited");
    entry.state.send_replace(ExecState::Exited(exited));
}

async fn pump<R: tokio::io::AsyncRead + Unpin>(
    mut r: R,
    stream: OutputStream,
    tx: broadcast::Sender<OutputChunk>,
) {
    let mut buf = vec![0u8; OUTPUT_CHUNK];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            // No subscriber is fine: streaming is best effort, the pipe must still be drained.
            Ok(n) => {
                let _ = tx.send(OutputChunk {
                    stream,
                    data: buf[..n].to_vec(),
                });
            }
        }
    }
}

fn spawn(req: &Exec) -> Result<std::process::Child, ExecError> {
    let Some(argv0) = req.argv.first() else {
        return Err(ExecError::EmptyArgv);
    };
    if req.refuse_root && req.uid.unwrap_or_else(|| nix::unistd::geteuid().as_raw()) == 0 {
        return Err(ExecError::RootRefused {
            program: argv0.clone(),
        });
    }
    let path_var = req
        .env
        .get("PATH")
        .map(|v| v.expose_secret())
        .unwrap_or(DEFAULT_PATH);
    let program = resolve_program(argv0, path_var).ok_or_else(|| ExecError::NotFound {
        program: argv0.clone(),
    })?;
    let mut cmd = Command::new(&program);
    cmd.arg0(argv0)
        .args(&req.argv[1..])
        .env_clear()
        .envs(req.env.iter().map(|(k, v)| (k, v.expose_secret())))
        .current_dir(req.cwd.as_deref().unwrap_or("/"))
        .stdin(Stdio::null())
        // Own process group, so a timeout kills the whole job tree.
        .process_group(0);
    if req.stream_output {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    if let Some(uid) = req.uid {
        let gid = req
            .gid
            .or_else(|| {
                std::fs::read_to_string("/etc/passwd")
                    .ok()
                    .and_then(|p| primary_gid(&p, uid))
            })
            .unwrap_or(uid);
        // std drops supplementary groups (setgroups(0)) when switching away from root.
        cmd.uid(uid).gid(gid);
    } else if let Some(gid) = req.gid {
        cmd.gid(gid);
    }
    cmd.spawn().map_err(|source| ExecError::Spawn {
        program: argv0.clone(),
        source,
    })
}

/// Resolve argv[0] like execvp, but against an explicit PATH (the child's, not ours).
pub fn resolve_program(argv0: &str, path_var: &str) -> Option<PathBuf> {
    if argv0.contains('/') {
        return Some(PathBuf::from(argv0));
    }
    if argv0.is_empty() {
        return None;
    }
    path_var
        .split(':')
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(argv0))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The primary gid of `uid` in an /etc/passwd text (parsed by hand: NSS does not work in a
/// static glibc binary).
pub fn primary_gid(passwd: &str, uid: u32) -> Option<u32> {
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        let (_name, _pw, u, g) = (
            fields.next()?,
            fields.next()?,
            fields.next()?,
            fields.next()?,
        );
        (u.parse::<u32>().ok()? == uid)
            .then(|| g.parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primary_gid_from_passwd() {
        let passwd =
            "root:x:0:0:root:/root:/bin/sh\nrunner:x:1001:121::/home/runner:/bin/bash\nbad line\n";
        assert_eq!(primary_gid(passwd, 1001), Some(121));
        assert_eq!(primary_gid(passwd, 0), Some(0));
        assert_eq!(primary_gid(passwd, 5), None);
    }

    #[test]
    fn resolve_against_given_path() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("tool");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        let plain = dir.path().join("notexec");
        std::fs::write(&plain, "").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path_var = format!("/nonexistent::{}", dir.path().display());
        assert_eq!(resolve_program("tool", &path_var), Some(exe));
        assert_eq!(resolve_program("notexec", &path_var), None);
        assert_eq!(resolve_program("/abs/x", ""), Some(PathBuf::from("/abs/x")));
        assert_eq!(resolve_program("", &path_var), None);
    }
}
