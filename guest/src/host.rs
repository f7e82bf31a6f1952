//! Host side of the protocol: Firecracker hybrid-vsock connect and a framed client.
//!
//! Used by imp-node (imp-runtime waits for Hello, imp-agent does the handoff) and by testkit's
//! Firecracker simulator. Firecracker's hybrid vsock: connect to the VM's `uds_path`, write
//! `CONNECT <port>\n`, read `OK <assigned>\n`; from then on the stream is the guest port.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

use crate::frame::{FrameError, FrameReader, FrameWriter};
use crate::protocol::{
    ErrorMsg, Exec, Exited, GuestMetrics, GuestToHost, Hello, HostToGuest, HttpProbe,
    MIN_SUPPORTED_PROTOCOL, PROTOCOL_VERSION, ProbeResult, Started,
};

/// The `OK <n>\n` line is short; more than this without a newline is not Firecracker.
const MAX_HANDSHAKE_LINE: usize = 64;
const RETRY_MIN: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("no Hello from the guest via {path} before the deadline (last attempt: {last})")]
    Timeout { path: PathBuf, last: String },
    #[error("hybrid vsock handshake: expected \"OK <port>\", got {0:?}")]
    Handshake(String),
    #[error("guest speaks protocol {guest}; this host supports {min}..={max}")]
    IncompatibleProtocol { guest: u32, min: u32, max: u32 },
    #[error("expected Hello as the guest's first frame, got {0}")]
    NoHello(String),
    #[error("guest closed the connection")]
    Closed,
    #[error("guest answered with error {:?}: {}", .0.code, .0.message)]
    Guest(ErrorMsg),
    #[error("unexpected answer from the guest: {0}")]
    Unexpected(String),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("i/o on the guest connection: {0}")]
    Io(#[from] std::io::Error),
}

impl HostError {
    /// Worth another attempt while the guest may still be booting.
    fn retryable(&self) -> bool {
        matches!(
            self,
            HostError::Io(_) | HostError::Closed | HostError::Handshake(_) | HostError::Frame(_)
        )
    }
}

/// A connected, greeted guest agent. Requests on one client are sequential (`&mut self`); for
/// concurrent work (e.g. waiting for an exit while probing) open another connection: the agent
/// serves any number, all sharing one exec table.
#[derive(Debug)]
pub struct HostClient {
    reader: FrameReader<OwnedReadHalf>,
    writer: FrameWriter<OwnedWriteHalf>,
    hello: Hello,
    /// Asynchronous events (`Exited`, `Output`) read while waiting for an answer.
    events: VecDeque<GuestToHost>,
}

/// Connect through Firecracker's hybrid vsock at `uds_path` to guest `port`, retrying (the VM
/// may still be booting, Firecracker closes the stream while nothing listens on the port) until
/// the guest's Hello arrives or `deadline` passes.
pub async fn connect(
    uds_path: &Path,
    port: u32,
    deadline: Instant,
) -> Result<HostClient, HostError> {
    retry(uds_path, deadline, || connect_once(uds_path, Some(port))).await
}

/// Connect straight to an agent's Unix socket (`imp-guest agent --listen-unix`), no handshake.
pub async fn connect_unix(path: &Path, deadline: Instant) -> Result<HostClient, HostError> {
    retry(path, deadline, || connect_once(path, None)).await
}

async fn retry<F, Fut>(
    path: &Path,
    deadline: Instant,
    mut attempt: F,
) -> Result<HostClient, HostError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<HostClient, HostError>>,
{
    let mut delay = RETRY_MIN;
    let mut last: Option<String> = None;
    loop {
        match tokio::time::timeout_at(deadline, attempt()).await {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(e)) if e.retryable() => last = Some(e.to_string()),
            Ok(Err(e)) => return Err(e),
            // Keep the previous failure: it says more than "still waiting".
            Err(_) => {
                let last =
                    last.unwrap_or_else(|| "attempt still in progress at the deadline".into());
                return Err(HostError::Timeout {
                    path: path.to_owned(),
                    last,
                });
            }
        }
        if Instant::now() + delay >= deadline {
            return Err(HostError::Timeout {
                path: path.to_owned(),
                last: last.unwrap_or_default(),
            });
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(RETRY_MAX);
    }
}

async fn connect_once(path: &Path, vsock_port: Option<u32>) -> Result<HostClient, HostError> {
    let mut stream = UnixStream::connect(path).await?;
    let leftover = match vsock_port {
        Some(port) => handshake(&mut stream, port).await?,
        None => Vec::new(),
    };
    HostClient::greet(stream, leftover).await
}

/// Send `CONNECT`, read the `OK` line and return whatever followed it in the same reads: the
/// guest may already have sent its Hello.
async fn handshake(stream: &mut UnixStream, port: u32) -> Result<Vec<u8>, HostError> {
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await?;
    let mut buf = Vec::with_capacity(MAX_HANDSHAKE_LINE);
    let mut chunk = [0u8; 256];
    loop {
        if let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line = String::from_utf8_lossy(&buf[..nl]).into_owned();
            if !is_ok_line(&line) {
                return Err(HostError::Handshake(line));
            }
            return Ok(buf.split_off(nl + 1));
        }
        if buf.len() > MAX_HANDSHAKE_LINE {
            return Err(HostError::Handshake(
                String::from_utf8_lossy(&buf).into_owned(),
            ));
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(HostError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn is_ok_line(line: &str) -> bool {
    line.strip_prefix("OK ")
        .is_some_and(|n| n.trim_end_matches('\r').parse::<u32>().is_ok())
}

/// Version rule: the guest states its major version in Hello; the host accepts it when it is
/// within `MIN_SUPPORTED_PROTOCOL..=PROTOCOL_VERSION` and refuses (closes) otherwise.
pub fn check_protocol(guest: u32) -> Result<(), HostError> {
    if (MIN_SUPPORTED_PROTOCOL..=PROTOCOL_VERSION).contains(&guest) {
        Ok(())
    } else {
        Err(HostError::IncompatibleProtocol {
            guest,
            min: MIN_SUPPORTED_PROTOCOL,
            max: PROTOCOL_VERSION,
        })
    }
}

impl HostClient {
    async fn greet(stream: UnixStream, leftover: Vec<u8>) -> Result<Self, HostError> {
        let (rd, wr) = stream.into_split();
        let mut reader = FrameReader::with_buffered(rd, leftover);
        let hello = match reader.read::<GuestToHost>().await? {
            Some(GuestToHost::Hello(h)) => h,
            Some(other) => return Err(HostError::NoHello(type_name(&other))),
            None => return Err(HostError::Closed),
        };
        check_protocol(hello.protocol)?;
        Ok(Self {
            reader,
            writer: FrameWriter::new(wr),
            hello,
            events: VecDeque::new(),
        })
    }

    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    pub async fn send(&mut self, msg: &HostToGuest) -> Result<(), HostError> {
        Ok(self.writer.write(msg).await?)
    }

    /// Raw bytes (tests of the guest's frame validation).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<(), HostError> {
        Ok(self.writer.write_raw(bytes).await?)
    }

    /// The next frame from the guest: queued events first, then the wire.
    pub async fn recv(&mut self) -> Result<GuestToHost, HostError> {
        if let Some(ev) = self.events.pop_front() {
            return Ok(ev);
        }
        self.read_wire().await
    }

    async fn read_wire(&mut self) -> Result<GuestToHost, HostError> {
        self.reader
            .read::<GuestToHost>()
            .await?
            .ok_or(HostError::Closed)
    }

    /// Read until `pick` accepts a frame; frames it declines are queued as events.
    async fn answer<T>(
        &mut self,
        mut pick: impl FnMut(&GuestToHost) -> bool,
        take: impl Fn(GuestToHost) -> Option<T>,
    ) -> Result<T, HostError> {
        loop {
            let msg = self.read_wire().await?;
            if pick(&msg) {
                return take(msg)
                    .ok_or_else(|| HostError::Unexpected("answer did not match".into()));
            }
            self.events.push_back(msg);
        }
    }

    /// Start (or, for a known id, re-query) a process. Returns its `Started`; an `Exited`
    /// that follows (already finished, or later) is collected by [`wait_exited`](Self::wait_exited).
    pub async fn exec(&mut self, req: Exec) -> Result<Started, HostError> {
        let id = req.id.clone();
        self.send(&HostToGuest::Exec(req)).await?;
        let answer = self
            .answer(
                |m| match m {
                    GuestToHost::Started(s) => s.id == id,
                    GuestToHost::Error(e) => e.id.as_deref().is_none_or(|eid| eid == id),
                    _ => false,
                },
                Some,
            )
            .await?;
        match answer {
            GuestToHost::Started(s) => Ok(s),
            GuestToHost::Error(e) => Err(HostError::Guest(e)),
            other => Err(HostError::Unexpected(type_name(&other))),
        }
    }

    /// Wait for the `Exited` of exec `id` (queued or still to come).
    pub async fn wait_exited(&mut self, id: &str) -> Result<Exited, HostError> {
        if let Some(pos) = self
            .events
            .iter()
            .position(|m| matches!(m, GuestToHost::Exited(e) if e.id == id))
            && let Some(GuestToHost::Exited(e)) = self.events.remove(pos)
        {
            return Ok(e);
        }
        self.answer(
            |m| matches!(m, GuestToHost::Exited(e) if e.id == id),
            |m| match m {
                GuestToHost::Exited(e) => Some(e),
                _ => None,
            },
        )
        .await
    }

    pub async fn probe(&mut self, req: HttpProbe) -> Result<ProbeResult, HostError> {
        self.send(&HostToGuest::HttpProbe(req)).await?;
        match self
            .answer(
                |m| matches!(m, GuestToHost::ProbeResult(_) | GuestToHost::Error(_)),
                Some,
            )
            .await?
        {
            GuestToHost::ProbeResult(r) => Ok(r),
            GuestToHost::Error(e) => Err(HostError::Guest(e)),
            other => Err(HostError::Unexpected(type_name(&other))),
        }
    }

    pub async fn metrics(&mut self) -> Result<GuestMetrics, HostError> {
        self.send(&HostToGuest::Metrics).await?;
        match self
            .answer(
                |m| matches!(m, GuestToHost::GuestMetrics(_) | GuestToHost::Error(_)),
                Some,
            )
            .await?
        {
            GuestToHost::GuestMetrics(r) => Ok(r),
            GuestToHost::Error(e) => Err(HostError::Guest(e)),
            other => Err(HostError::Unexpected(type_name(&other))),
        }
    }

    /// Ask the guest to power off. There is no answer; the connection then closes.
    pub async fn shutdown(&mut self) -> Result<(), HostError> {
        self.send(&HostToGuest::Shutdown).await
    }
}

fn type_name(msg: &GuestToHost) -> String {
    serde_json::to_value(msg)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ok_line() {
        assert!(is_ok_line("OK 1073741824"));
        assert!(is_ok_line("OK 5\r"));
        assert!(!is_ok_line("OK"));
        assert!(!is_ok_line("ERR no listener"));
        assert!(!is_ok_line("OK x"));
    }

    #[test]
    fn protocol_range() {
        assert!(check_protocol(PROTOCOL_VERSION).is_ok());
        assert!(matches!(
            check_protocol(PROTOCOL_VERSION + 1),
            Err(HostError::IncompatibleProtocol { .. })
        ));
        assert!(check_protocol(0).is_err());
    }
}
