//! The guest agent: serves the protocol on vsock (in the VM) or a Unix socket (host-process
//! mode, for the Firecracker simulator), one task per connection, all sharing one exec table.

pub mod exec;
pub mod identity;
pub mod metrics;
pub mod probe;
pub mod warm;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::frame::{FrameError, FrameReader, FrameWriter};
use crate::protocol::{
    ErrorCode, ErrorMsg, Exec, GuestToHost, Hello, HostToGuest, Output, PROTOCOL_VERSION,
    Reidentify, Started, Warm,
};
use exec::{ExecEntry, ExecState, ExecTable};
use identity::IdentityConfig;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("bind unix socket {path}: {source}")]
    BindUnix {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("bind vsock port {port}: {source}")]
    BindVsock { port: u32, source: std::io::Error },
    #[error("install SIGCHLD handler: {0}")]
    Signal(std::io::Error),
}

/// Why the agent stopped serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShutdownReason {
    /// The host sent `Shutdown`.
    HostRequested,
    /// A `poweroff_on_exit` exec ended and its `Exited` was written to the host.
    WorkloadExitReported { id: String },
    /// A `poweroff_on_exit` exec ended but no host collected its exit within the grace period.
    WorkloadExitUnreported { id: String },
    /// SIGTERM/SIGINT (or Ctrl-Alt-Del as PID 1).
    Signal(i32),
}

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub boot_id: String,
    /// How long to wait for a host to collect a `poweroff_on_exit` exit before powering off
    /// anyway.
    pub report_grace: Duration,
    /// Filesystem whose usage `Metrics` reports.
    pub metrics_root: PathBuf,
    /// What `Reidentify` may change; `None`: it is refused (a host-process agent that was not
    /// given a machine of its own to manage).
    pub identity: Option<IdentityConfig>,
}

pub struct Agent {
    config: AgentConfig,
    execs: ExecTable,
    shutdown: watch::Sender<Option<ShutdownReason>>,
    /// Held across a whole `Reidentify`, and taken by every `Exec` before anything of it is
    /// used: an Exec that arrives meanwhile waits until the identity is in place.
    identity: tokio::sync::Mutex<IdentityState>,
}

#[derive(Debug, Default)]
struct IdentityState {
    /// Identities applied so far.
    generation: u64,
    /// An Exec (and with it, perhaps, a secret) has arrived: the identity is final.
    locked: bool,
}

impl Agent {
    /// Create the agent and start its reaper. Call inside a tokio runtime, before anything
    /// can spawn children.
    pub fn start(config: AgentConfig) -> Result<Arc<Self>, AgentError> {
        let agent = Arc::new(Agent {
            config,
            execs: ExecTable::new(),
            shutdown: watch::channel(None).0,
            identity: tokio::sync::Mutex::new(IdentityState::default()),
        });
        let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())
            .map_err(AgentError::Signal)?;
        let execs = agent.execs.clone();
        tokio::spawn(async move {
            // SIGCHLD coalesces and can race with registration; the tick is the safety net.
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = sigchld.recv() => {}
                    _ = tick.tick() => {}
                }
                execs.reap();
            }
        });
        Ok(agent)
    }

    pub fn execs(&self) -> &ExecTable {
        &self.execs
    }

    pub fn hello(&self) -> Hello {
        Hello {
            protocol: PROTOCOL_VERSION,
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            boot_id: self.config.boot_id.clone(),
        }
    }

    /// First reason wins; later requests are ignored.
    pub fn request_shutdown(&self, reason: ShutdownReason) {
        self.shutdown.send_if_modified(|current| {
            if current.is_none() {
                tracing::info!(?reason, "shutdown requested");
                *current = Some(reason);
                true
            } else {
                false
            }
        });
    }

    pub async fn wait_shutdown(&self) -> ShutdownReason {
        let mut rx = self.shutdown.subscribe();
        let reason = rx
            .wait_for(|r| r.is_some())
            .await
            .expect("sender lives in self");
        reason.clone().expect("checked by wait_for")
    }

    /// Serve connections from `listener` until shutdown is requested.
    pub async fn serve(self: &Arc<Self>, listener: Listener) -> ShutdownReason {
        loop {
            let accepted = tokio::select! {
                reason = self.wait_shutdown() => return reason,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok(conn) => {
                    let agent = self.clone();
                    tokio::spawn(async move { agent.handle_connection(conn).await });
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    /// Speak the protocol on one connection until the host closes it or sends garbage that
    /// breaks framing. Processes started here outlive the connection.
    pub async fn handle_connection<S>(self: Arc<Self>, stream: S)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (rd, wr) = tokio::io::split(stream);
        let (tx, rx) = mpsc::channel::<Outgoing>(64);
        let writer = tokio::spawn(write_loop(self.clone(), FrameWriter::new(wr), rx));
        let mut watchers = JoinSet::new();
        let mut reader = FrameReader::new(rd);
        let _ = tx
            .send(Outgoing::plain(GuestToHost::Hello(self.hello())))
            .await;
        loop {
            // Drop finished watchers so a long-lived connection does not accumulate them.
            while watchers.try_join_next().is_some() {}
            let msg = match reader.read::<HostToGuest>().await {
                Ok(Some(msg)) => msg,
                Ok(None) => break,
                Err(e) if e.is_recoverable() || matches!(e, FrameError::TooLarge { .. }) => {
                    // A malformed Exec still brought its bytes, secrets perhaps: identity is final.
                    if matches!(&e, FrameError::InvalidMessage { type_name, .. } if type_name == "exec")
                    {
                        self.identity.lock().await.locked = true;
                    }
                    // An oversize payload was not consumed, so framing is lost: answer, then close.
                    let close = !e.is_recoverable();
                    tracing::warn!(error = %e, close, "rejected frame");
                    let _ = tx
                        .send(Outgoing::plain(error_msg(
                            e.error_code(),
                            e.to_string(),
                            None,
                        )))
                        .await;
                    if close {
                        break;
                    }
                    continue;
                }
                Err(e) => {
                    tracing::info!(error = %e, "connection ended");
                    break;
                }
            };
            match msg {
                HostToGuest::Exec(req) => self.exec(req, &tx, &mut watchers).await,
                HostToGuest::HttpProbe(req) => {
                    let result = probe::run(&req).await;
                    let _ = tx
                        .send(Outgoing::plain(GuestToHost::ProbeResult(result)))
                        .await;
                }
                HostToGuest::Metrics => {
                    let msg = match metrics::collect(&self.config.metrics_root) {
                        Ok(m) => GuestToHost::GuestMetrics(m),
                        Err(e) => error_msg(ErrorCode::Internal, e.to_string(), None),
                    };
                    let _ = tx.send(Outgoing::plain(msg)).await;
                }
                HostToGuest::Shutdown => self.request_shutdown(ShutdownReason::HostRequested),
                HostToGuest::Reidentify(req) => {
                    let answer = self.reidentify(req).await;
                    let _ = tx.send(Outgoing::plain(answer)).await;
                }
                // No identity lock either way: it reads files and answers counts, nothing
                // secret arrives with it.
                HostToGuest::Warm(req) => {
                    let _ = tx.send(Outgoing::plain(warm(req).await)).await;
                }
            }
        }
        // Watchers only relay to this connection; the processes keep running.
        watchers.shutdown().await;
        drop(tx);
        let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
    }

    /// Apply a new identity (identity::apply) unless an Exec came first; the answer is
    /// `Identified` or an error naming the field or part.
    async fn reidentify(&self, req: Reidentify) -> GuestToHost {
        let started = std::time::Instant::now();
        let mut state = self.identity.lock().await;
        if state.locked {
            tracing::warn!("reidentify refused: an exec has arrived");
            return error_msg(
                ErrorCode::IdentityLocked,
                "reidentify: refused: this guest has received an exec; its identity may change \
                 only before any secret"
                    .into(),
                None,
            );
        }
        let Some(config) = &self.config.identity else {
            return error_msg(
                ErrorCode::IdentityFailed,
                format!(
                    "reidentify: {}: this agent manages no identity (host-process mode without \
                     --identity-root)",
                    identity::Part::Identity
                ),
                None,
            );
        };
        let plan = match identity::plan(&req) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(field = e.field, reason = %e.reason, "reidentify refused");
                return error_msg(ErrorCode::InvalidRequest, e.to_string(), None);
            }
        };
        match identity::apply(&plan, config, state.generation + 1).await {
            Ok(evidence) => {
                state.generation = evidence.generation;
                tracing::info!(
                    generation = evidence.generation,
                    hostname = %evidence.hostname,
                    machine_id = %evidence.machine_id,
                    clock_step_ns = evidence.clock_step_ns,
                    network = ?evidence.network,
                    took_ms = started.elapsed().as_millis() as u64,
                    "identity applied"
                );
                GuestToHost::Identified(evidence)
            }
            Err(e) => {
                tracing::warn!(error = %e, "reidentify failed");
                error_msg(ErrorCode::IdentityFailed, e.to_string(), None)
            }
        }
    }

    async fn exec(
        self: &Arc<Self>,
        req: Exec,
        tx: &mpsc::Sender<Outgoing>,
        watchers: &mut JoinSet<()>,
    ) {
        // From here on the guest may hold a secret: its identity is final. Waits for a
        // Reidentify in progress to finish.
        self.identity.lock().await.locked = true;
        // Env keys only: values may be the JIT config.
        let env_keys: Vec<&str> = req.env.keys().map(String::as_str).collect();
        tracing::info!(exec_id = %req.id, argv = ?req.argv, ?env_keys, uid = ?req.uid, timeout_s = ?req.timeout_s, "exec requested");
        let started = match self.execs.start(&req) {
            Ok(s) => s,
            Err(e) => {
                let _ = tx
                    .send(Outgoing::plain(error_msg(
                        ErrorCode::InvalidRequest,
                        e.to_string(),
                        Some(&req.id),
                    )))
                    .await;
                return;
            }
        };
        let new = matches!(started, exec::StartOutcome::New(_));
        let entry = started.entry().clone();
        if !new {
            tracing::info!(exec_id = %req.id, "exec id seen before, reporting recorded state");
        }
        // Subscribe before reading the state so nothing between the two is missed.
        let state_rx = entry.subscribe_state();
        let output_rx = entry.subscribe_output();
        let state = entry.state();
        if let ExecState::SpawnFailed(message) = &state {
            let _ = tx
                .send(Outgoing::plain(error_msg(
                    ErrorCode::SpawnFailed,
                    message.clone(),
                    Some(&req.id),
                )))
                .await;
            return;
        }
        let pid = entry.pid.unwrap_or_default();
        // Started is the answer to this request, so it goes out before the next one is read.
        let _ = tx
            .send(Outgoing::plain(GuestToHost::Started(Started {
                id: entry.id.clone(),
                pid,
            })))
            .await;
        if new && entry.poweroff_on_exit {
            self.arm_unreported_exit_timer(entry.clone());
        }
        watchers.spawn(watch_exec(entry, state_rx, output_rx, tx.clone()));
    }

    /// If nobody collects the workload's exit, power off anyway after the grace period.
    fn arm_unreported_exit_timer(self: &Arc<Self>, entry: Arc<ExecEntry>) {
        let agent = self.clone();
        let grace = self.config.report_grace;
        tokio::spawn(async move {
            let mut rx = entry.subscribe_state();
            if rx
                .wait_for(|s| matches!(s, ExecState::Exited(_)))
                .await
                .is_ok()
            {
                tokio::time::sleep(grace).await;
                agent.request_shutdown(ShutdownReason::WorkloadExitUnreported {
                    id: entry.id.clone(),
                });
            }
        });
    }
}

/// Read the request's files into the page cache (warm::run, on a blocking thread); the answer
/// is `Warmed` or an error naming the field.
async fn warm(req: Warm) -> GuestToHost {
    let plan = match warm::plan(&req) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(field = e.field, reason = %e.reason, "warm refused");
            return error_msg(ErrorCode::InvalidRequest, e.to_string(), None);
        }
    };
    match tokio::task::spawn_blocking(move || warm::run(&plan)).await {
        Ok(w) => {
            tracing::info!(
                files = w.files,
                bytes = w.bytes,
                millis = w.millis,
                truncated = w.truncated,
                skipped = w.skipped,
                "page cache warmed"
            );
            GuestToHost::Warmed(w)
        }
        Err(e) => error_msg(ErrorCode::Internal, format!("warm: {e}"), None),
    }
}

/// Relays output and the final `Exited` of one exec to one connection.
async fn watch_exec(
    entry: Arc<ExecEntry>,
    mut state_rx: watch::Receiver<ExecState>,
    mut output_rx: Option<tokio::sync::broadcast::Receiver<exec::OutputChunk>>,
    tx: mpsc::Sender<Outgoing>,
) {
    loop {
        let state = state_rx.borrow_and_update().clone();
        if let ExecState::Exited(exited) = state {
            // Flush output that arrived before the exit was published.
            if let Some(rx) = output_rx.as_mut() {
                while let Ok(chunk) = rx.try_recv() {
                    let _ = tx.send(Outgoing::plain(output_msg(&entry.id, chunk))).await;
                }
            }
            let _ = tx
                .send(Outgoing {
                    msg: GuestToHost::Exited(exited),
                    poweroff_after: entry.poweroff_on_exit,
                })
                .await;
            return;
        }
        tokio::select! {
            changed = state_rx.changed() => if changed.is_err() { return },
            chunk = recv_output(&mut output_rx) => match chunk {
                Some(chunk) => { let _ = tx.send(Outgoing::plain(output_msg(&entry.id, chunk))).await; }
                None => output_rx = None,
            },
        }
    }
}

async fn recv_output(
    rx: &mut Option<tokio::sync::broadcast::Receiver<exec::OutputChunk>>,
) -> Option<exec::OutputChunk> {
    let Some(r) = rx.as_mut() else {
        return std::future::pending().await;
    };
    loop {
        match r.recv().await {
            Ok(chunk) => return Some(chunk),
            // A slow host loses output rather than stalling the process: best effort.
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                tracing::warn!(skipped = n, "output subscriber lagged");
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
        }
    }
}

fn output_msg(id: &str, chunk: exec::OutputChunk) -> GuestToHost {
    GuestToHost::Output(Output {
        id: id.to_owned(),
        stream: chunk.stream,
        data_b64: base64::engine::general_purpose::STANDARD.encode(chunk.data),
    })
}

fn error_msg(code: ErrorCode, message: String, id: Option<&str>) -> GuestToHost {
    GuestToHost::Error(ErrorMsg {
        code,
        message,
        id: id.map(str::to_owned),
    })
}

struct Outgoing {
    msg: GuestToHost,
    /// Request power-off once this frame has been written (the workload's exit was reported).
    poweroff_after: bool,
}

impl Outgoing {
    fn plain(msg: GuestToHost) -> Self {
        Self {
            msg,
            poweroff_after: false,
        }
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    agent: Arc<Agent>,
    mut writer: FrameWriter<W>,
    mut rx: mpsc::Receiver<Outgoing>,
) {
    while let Some(out) = rx.recv().await {
        if let Err(e) = writer.write(&out.msg).await {
            tracing::info!(error = %e, "write to host failed, dropping connection");
            return;
        }
        if out.poweroff_after
            && let GuestToHost::Exited(exited) = &out.msg
        {
            agent.request_shutdown(ShutdownReason::WorkloadExitReported {
                id: exited.id.clone(),
            });
        }
    }
    let _ = writer.shutdown().await;
}

/// Where the agent accepts connections.
pub enum Listener {
    Unix(tokio::net::UnixListener),
    Vsock(tokio_vsock::VsockListener),
}

impl Listener {
    /// Bind a Unix socket, replacing a stale socket file from a previous run.
    pub fn bind_unix(path: &Path) -> Result<Self, AgentError> {
        let _ = std::fs::remove_file(path);
        tokio::net::UnixListener::bind(path)
            .map(Listener::Unix)
            .map_err(|source| AgentError::BindUnix {
                path: path.to_owned(),
                source,
            })
    }

    pub fn bind_vsock(port: u32) -> Result<Self, AgentError> {
        let addr = tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_ANY, port);
        tokio_vsock::VsockListener::bind(addr)
            .map(Listener::Vsock)
            .map_err(|source| AgentError::BindVsock { port, source })
    }

    async fn accept(&self) -> std::io::Result<Box<dyn ConnectionBox>> {
        Ok(match self {
            Listener::Unix(l) => Box::new(l.accept().await?.0),
            Listener::Vsock(l) => Box::new(l.accept().await?.0),
        })
    }
}

/// Where the agent tells the host it listens ([`crate::protocol::READY_VSOCK_PORT`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Announce {
    /// A port of the host (vsock CID 2): the agent runs in a VM.
    Vsock(u32),
    /// A Unix socket: the agent is a host process standing in for a guest (the Firecracker
    /// simulator passes the path its hybrid vsock would connect the guest to).
    Unix(PathBuf),
}

/// How long one announcement may take; the host connects anyway when it gets none.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(2);

/// Tell the host the agent listens: one connection, then closed. The connection is the news:
/// the host may close it at once, so the line written on it (for a human reading a capture) is
/// best effort and only a failed connect is an error. Best effort as a whole too: a host without
/// a listener (an older runtime, a resumed VM) finds the agent by connecting.
pub async fn announce(to: &Announce, boot_id: &str) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt as _;
    let line = format!("ready {boot_id}\n");
    let send = async {
        match to {
            Announce::Vsock(port) => {
                let addr = tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_HOST, *port);
                let mut s = tokio_vsock::VsockStream::connect(addr).await?;
                let _ = s.write_all(line.as_bytes()).await;
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            Announce::Unix(path) => {
                let mut s = tokio::net::UnixStream::connect(path).await?;
                let _ = s.write_all(line.as_bytes()).await;
                let _ = s.shutdown().await;
            }
        }
        Ok(())
    };
    tokio::time::timeout(ANNOUNCE_TIMEOUT, send)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "announce timed out"))?
}

/// Object-safe connection, so one handler serves both listener kinds.
pub trait ConnectionBox: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> ConnectionBox for T {}
