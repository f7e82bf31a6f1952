//! Host side of the protocol: Firecracker hybrid-vsock connect and a framed client.
//!
//! Used by imp-node (imp-runtime waits for Hello, imp-agent does the handoff) and by testkit's
//! Firecracker simulator. Firecracker's hybrid vsock: connect to the VM's `uds_path`, write
//! `CONNECT <port>\n`, read `OK <assigned>\n`; from then on the stream is the guest port.

use std::collections::{HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

use crate::frame::{FrameError, FrameReader, FrameWriter};
use crate::protocol::{
    ErrorMsg, Exec, Exited, GuestMetrics, GuestToHost, Hello, HostToGuest, HttpProbe, Identified,
    MIN_SUPPORTED_PROTOCOL, PROTOCOL_VERSION, ProbeResult, READY_VSOCK_PORT, Reidentify, Started,
    Warm, Warmed,
};

/// The `OK <n>\n` line is short; more than this without a newline is not Firecracker.
const MAX_HANDSHAKE_LINE: usize = 64;
const RETRY_MIN: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_millis(500);

/// How long one request (an Exec, a probe, a metrics query) may wait for its answer by default.
pub const DEFAULT_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Frames nobody asked for (an answer to no request, an event of a process this connection did
/// not start, a second `Exited`, an undecodable frame) that one connection tolerates. One more and
/// the client gives up on the guest: it runs the job as root and may be hostile.
pub const MAX_UNEXPECTED_FRAMES: u32 = 32;
/// Expected events (`Exited` of an exec of this connection, `Output` of a streamed one) held
/// while the caller waits for something else. With frames capped at 1 MiB this bounds the
/// client's memory; an event past it counts as unexpected.
pub const MAX_QUEUED_EVENTS: usize = 16;

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
    #[error(
        "guest sent {count} frames nobody asked for (last: {last}); the connection was dropped"
    )]
    BudgetExceeded { count: u32, last: String },
    #[error("the guest's Reidentify answer does not hold: {0}")]
    Evidence(#[from] EvidenceError),
    #[error("guest did not answer {request} within {after:?}")]
    NoAnswer {
        request: &'static str,
        after: Duration,
    },
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

/// Bytes of the random sample in an [`Identified`].
pub const IDENTITY_SAMPLE_BYTES: usize = 32;
/// How far the guest's clock in an [`Identified`] may lie outside the host's clock over the
/// round trip, by default.
pub const DEFAULT_CLOCK_TOLERANCE: Duration = Duration::from_millis(500);

/// What the answer to a [`Reidentify`] must show beyond echoing the request
/// ([`check_identified`]).
#[derive(Debug, Clone)]
pub struct IdentityCheck {
    /// Random samples other clones of the same snapshot (and this guest, earlier) answered:
    /// this answer's must differ from every one.
    pub previous_samples: Vec<Vec<u8>>,
    /// The identity generation the host last knew for this guest (the snapshot's). `None`: the
    /// last one this connection saw, else 0.
    pub after_generation: Option<u64>,
    pub clock_tolerance: Duration,
}

impl Default for IdentityCheck {
    fn default() -> Self {
        IdentityCheck {
            previous_samples: Vec::new(),
            after_generation: None,
            clock_tolerance: DEFAULT_CLOCK_TOLERANCE,
        }
    }
}

/// Why an [`Identified`] is not accepted. Any of these fails the clone: it is given no config.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvidenceError {
    #[error("generation {got} does not advance past {after}: not this request's answer")]
    GenerationNotAdvanced { got: u64, after: u64 },
    #[error("random sample is not {IDENTITY_SAMPLE_BYTES} bytes of standard base64")]
    MalformedSample,
    #[error("random sample repeats one seen before: the guest's generator was not reseeded")]
    RepeatedSample,
    #[error("hostname is {got:?}, asked {asked:?}")]
    Hostname { got: String, asked: String },
    #[error("machine-id is {got:?}, asked {asked:?}")]
    MachineId { got: String, asked: String },
    #[error("machine-id {0:?} is not 32 lowercase hex digits")]
    MalformedMachineId(String),
    #[error(
        "guest clock {got_ns} ns is outside {from_ns}..={to_ns} (the host's clock over the \
         round trip, with tolerance)"
    )]
    Clock {
        got_ns: u64,
        from_ns: u64,
        to_ns: u64,
    },
    #[error("network: {0}")]
    Network(String),
}

/// Judge the evidence `got` for `req`: `last_generation` is what the host knew before,
/// `round_trip` how long the answer took (the guest read its clock somewhere in it).
pub fn check_identified(
    req: &Reidentify,
    got: &Identified,
    check: &IdentityCheck,
    last_generation: u64,
    round_trip: Duration,
) -> Result<(), EvidenceError> {
    let after = check.after_generation.unwrap_or(last_generation);
    if got.generation <= after {
        return Err(EvidenceError::GenerationNotAdvanced {
            got: got.generation,
            after,
        });
    }
    let sample = got
        .random_sample()
        .filter(|s| s.len() == IDENTITY_SAMPLE_BYTES)
        .ok_or(EvidenceError::MalformedSample)?;
    if check.previous_samples.contains(&sample) {
        return Err(EvidenceError::RepeatedSample);
    }
    if got.hostname != req.hostname {
        return Err(EvidenceError::Hostname {
            got: got.hostname.clone(),
            asked: req.hostname.clone(),
        });
    }
    match &req.machine_id {
        Some(asked) if *asked != got.machine_id => {
            return Err(EvidenceError::MachineId {
                got: got.machine_id.clone(),
                asked: asked.clone(),
            });
        }
        _ => {}
    }
    let hex = got.machine_id.len() == 32
        && got
            .machine_id
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        && got.machine_id.bytes().any(|b| b != b'0');
    if !hex {
        return Err(EvidenceError::MalformedMachineId(got.machine_id.clone()));
    }
    let tolerance = check.clock_tolerance.as_nanos() as u64;
    let from_ns = req.wall_clock_unix_ns.saturating_sub(tolerance);
    let to_ns = req
        .wall_clock_unix_ns
        .saturating_add(round_trip.as_nanos() as u64)
        .saturating_add(tolerance);
    if !(from_ns..=to_ns).contains(&got.wall_clock_unix_ns) {
        return Err(EvidenceError::Clock {
            got_ns: got.wall_clock_unix_ns,
            from_ns,
            to_ns,
        });
    }
    if let Some(asked) = &req.network {
        let Some(net) = &got.network else {
            return Err(EvidenceError::Network("no network evidence".into()));
        };
        if !net.mac.eq_ignore_ascii_case(&asked.mac) {
            return Err(EvidenceError::Network(format!(
                "MAC is {}, asked {}",
                net.mac, asked.mac
            )));
        }
        let want = format!("{}/{}", asked.address, asked.prefix);
        if net.addresses != [want.clone()] {
            return Err(EvidenceError::Network(format!(
                "addresses are {:?}, asked only {want}",
                net.addresses
            )));
        }
    }
    Ok(())
}

/// A connected, greeted guest agent. Requests on one client are sequential (`&mut self`); for
/// concurrent work (e.g. waiting for an exit while probing) open another connection: the agent
/// serves any number, all sharing one exec table.
///
/// The guest is not trusted: every request's answer is awaited at most
/// [`answer_timeout`](Self::set_answer_timeout), at most [`MAX_QUEUED_EVENTS`] events are held,
/// and frames nobody asked for are counted and dropped until [`MAX_UNEXPECTED_FRAMES`], after
/// which every call fails with [`HostError::BudgetExceeded`]. Memory stays bounded by the queue
/// and one frame (1 MiB) whatever the guest sends.
#[derive(Debug)]
pub struct HostClient {
    reader: FrameReader<OwnedReadHalf>,
    writer: FrameWriter<OwnedWriteHalf>,
    hello: Hello,
    /// Asynchronous events (`Exited`, `Output`) read while waiting for an answer.
    events: VecDeque<GuestToHost>,
    answer_timeout: Duration,
    /// Exec ids sent on this connection: their `Exited` (once) is expected.
    execs: HashSet<String>,
    /// Of those, the ones with `stream_output`: their `Output` is expected.
    streamed: HashSet<String>,
    /// Exec ids whose `Exited` was already read: a second one is unexpected.
    exited: HashSet<String>,
    unexpected: u32,
    /// Set once the budget is exceeded: the connection is not read any more.
    over_budget: Option<String>,
    /// The identity generation of the last accepted [`Identified`] on this connection.
    generation: u64,
}

/// What the client does with a frame that is not the answer it waits for.
#[derive(Debug, PartialEq, Eq)]
enum Fate {
    Queue,
    Drop,
}

/// Connect through Firecracker's hybrid vsock at `uds_path` to guest `port`, retrying (the VM
/// may still be booting, Firecracker closes the stream while nothing listens on the port) until
/// the guest's Hello arrives or `deadline` passes.
pub async fn connect(
    uds_path: &Path,
    port: u32,
    deadline: Instant,
) -> Result<HostClient, HostError> {
    retry(uds_path, deadline, None, || {
        connect_once(uds_path, Some(port))
    })
    .await
}

/// [`connect`] to a guest that was just resumed from a snapshot: its agent has been listening
/// since before the snapshot and answers as soon as its vsock transport is back (a re-probed
/// device, a reset connection), so attempts come every [`RESUMED_STEP`] rather than on a growing
/// backoff, which would see a guest ready at 70 ms only at the attempt of 140 ms. After
/// [`RESUMED_STEADY_FOR`] the backoff takes over (a guest that slow is not a resume's).
pub async fn connect_resumed(
    uds_path: &Path,
    port: u32,
    deadline: Instant,
) -> Result<HostClient, HostError> {
    let pace = Pace::Steady {
        step: RESUMED_STEP,
        until: (Instant::now() + RESUMED_STEADY_FOR).min(deadline),
    };
    retry_paced(uds_path, deadline, None, pace, || {
        connect_once(uds_path, Some(port))
    })
    .await
}

/// Attempts of [`connect_resumed`]: every 5 ms for 2 s.
pub const RESUMED_STEP: Duration = Duration::from_millis(5);
pub const RESUMED_STEADY_FOR: Duration = Duration::from_secs(2);

/// How [`retry_paced`] spaces its attempts.
#[derive(Debug, Clone, Copy)]
enum Pace {
    /// From [`RETRY_MIN`] doubling to [`RETRY_MAX`].
    Backoff,
    /// Every `step` until `until`, then as [`Pace::Backoff`].
    Steady { step: Duration, until: Instant },
}

/// [`connect`], attempting again as soon as the guest announces itself on `announcements`
/// (bound before the VM started) instead of at the next step of the backoff. The backoff stays
/// as the fallback for a guest that does not announce (an older image, a lost announcement).
pub async fn connect_announced(
    uds_path: &Path,
    port: u32,
    announcements: &mut Announcements,
    deadline: Instant,
) -> Result<HostClient, HostError> {
    let wake = tokio::net::UnixListener::from_std(announcements.listener.try_clone()?)?;
    let mut heard = None;
    let r = retry(uds_path, deadline, Some((&wake, &mut heard)), || {
        connect_once(uds_path, Some(port))
    })
    .await;
    if let Some((n, at)) = heard {
        announcements.heard += n;
        announcements.last_heard = Some(at);
    }
    r
}

/// Connect straight to an agent's Unix socket (`imp-guest agent --listen-unix`), no handshake.
pub async fn connect_unix(path: &Path, deadline: Instant) -> Result<HostClient, HostError> {
    retry(path, deadline, None, || connect_once(path, None)).await
}

/// The host side of a guest's announcement ([`READY_VSOCK_PORT`]): a Unix socket at
/// `<uds_path>_<port>`, where the hybrid vsock (Firecracker, vhost-device-vsock) delivers the
/// guest's connection to a host port. Bind it before the VM starts, so an early announcement is
/// not lost; the socket file is removed on drop. Nothing is read from a connection: it only
/// says "attempt now".
#[derive(Debug)]
pub struct Announcements {
    listener: std::os::unix::net::UnixListener,
    path: PathBuf,
    heard: u32,
    last_heard: Option<Instant>,
}

/// Where the hybrid vsock of `uds_path` delivers a guest's announcement.
pub fn announce_path(uds_path: &Path) -> PathBuf {
    let mut p = uds_path.as_os_str().to_owned();
    p.push(format!("_{READY_VSOCK_PORT}"));
    p.into()
}

impl Announcements {
    /// Listen for the announcements of the VM whose hybrid vsock is `uds_path`, replacing a
    /// socket file left by an earlier VMM.
    pub fn bind(uds_path: &Path) -> std::io::Result<Self> {
        let path = announce_path(uds_path);
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        Ok(Announcements {
            listener,
            path,
            heard: 0,
            last_heard: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Announcements that woke a connect attempt so far.
    pub fn heard(&self) -> u32 {
        self.heard
    }

    /// When the last of them was taken: with the Hello's time, how long detection took.
    pub fn last_heard(&self) -> Option<Instant> {
        self.last_heard
    }
}

impl Drop for Announcements {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

async fn retry<F, Fut>(
    path: &Path,
    deadline: Instant,
    wake: Option<(&tokio::net::UnixListener, &mut Option<(u32, Instant)>)>,
    attempt: F,
) -> Result<HostClient, HostError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<HostClient, HostError>>,
{
    retry_paced(path, deadline, wake, Pace::Backoff, attempt).await
}

async fn retry_paced<F, Fut>(
    path: &Path,
    deadline: Instant,
    mut wake: Option<(&tokio::net::UnixListener, &mut Option<(u32, Instant)>)>,
    pace: Pace,
    mut attempt: F,
) -> Result<HostClient, HostError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<HostClient, HostError>>,
{
    let mut delay = match pace {
        Pace::Backoff => RETRY_MIN,
        Pace::Steady { step, .. } => step,
    };
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
        let timeout = || HostError::Timeout {
            path: path.to_owned(),
            last: last.clone().unwrap_or_default(),
        };
        // Without announcements, no attempt is left before the deadline; with them, one may
        // still come: wait for it until the deadline.
        if wake.is_none() && Instant::now() + delay >= deadline {
            return Err(timeout());
        }
        if Instant::now() >= deadline {
            return Err(timeout());
        }
        let woken = match wake.as_mut() {
            Some((listener, heard)) => tokio::select! {
                _ = tokio::time::sleep_until((Instant::now() + delay).min(deadline)) => false,
                accepted = listener.accept() => match accepted {
                    // Dropped unread: the connection itself is the news.
                    Ok(_) => {
                        let n = heard.map_or(0, |(n, _)| n);
                        **heard = Some((n + 1, Instant::now()));
                        true
                    }
                    Err(_) => {
                        tokio::time::sleep(delay).await;
                        false
                    }
                },
            },
            None => {
                tokio::time::sleep(delay).await;
                false
            }
        };
        delay = match pace {
            Pace::Steady { step, until } if Instant::now() < until => step,
            _ if woken => RETRY_MIN,
            _ => (delay * 2).min(RETRY_MAX),
        };
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
            answer_timeout: DEFAULT_ANSWER_TIMEOUT,
            execs: HashSet::new(),
            streamed: HashSet::new(),
            exited: HashSet::new(),
            unexpected: 0,
            over_budget: None,
            generation: 0,
        })
    }

    /// How long [`exec`](Self::exec), [`probe`](Self::probe) and [`metrics`](Self::metrics) wait
    /// for their answer ([`HostError::NoAnswer`] after that). [`wait_exited`](Self::wait_exited)
    /// has no bound of its own: a job runs as long as it runs.
    pub fn set_answer_timeout(&mut self, timeout: Duration) {
        self.answer_timeout = timeout;
    }

    /// Frames nobody asked for, dropped so far on this connection.
    pub fn unexpected_frames(&self) -> u32 {
        self.unexpected
    }

    fn fate(&self, msg: &GuestToHost) -> Fate {
        let expected = match msg {
            GuestToHost::Exited(e) => {
                self.execs.contains(&e.id)
                    && !self.exited.contains(&e.id)
                    && !self
                        .events
                        .iter()
                        .any(|q| matches!(q, GuestToHost::Exited(x) if x.id == e.id))
            }
            GuestToHost::Output(o) => self.streamed.contains(&o.id),
            _ => false,
        };
        if expected && self.events.len() < MAX_QUEUED_EVENTS {
            Fate::Queue
        } else {
            Fate::Drop
        }
    }

    /// Counts a dropped frame; past the budget the connection is given up.
    fn drop_frame(&mut self, what: String) -> Result<(), HostError> {
        self.unexpected += 1;
        if self.unexpected > MAX_UNEXPECTED_FRAMES {
            self.over_budget = Some(what.clone());
            return Err(HostError::BudgetExceeded {
                count: self.unexpected,
                last: what,
            });
        }
        Ok(())
    }

    fn check_budget(&self) -> Result<(), HostError> {
        match &self.over_budget {
            Some(last) => Err(HostError::BudgetExceeded {
                count: self.unexpected,
                last: last.clone(),
            }),
            None => Ok(()),
        }
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

    /// Read until `pick` accepts a frame; of the frames it declines, expected events are queued
    /// and the rest counted and dropped (undecodable but whole frames included).
    async fn answer<T>(
        &mut self,
        mut pick: impl FnMut(&GuestToHost) -> bool,
        take: impl Fn(GuestToHost) -> Option<T>,
    ) -> Result<T, HostError> {
        self.check_budget()?;
        loop {
            let msg = match self.reader.read::<GuestToHost>().await {
                Ok(Some(m)) => m,
                Ok(None) => return Err(HostError::Closed),
                Err(e) if e.is_recoverable() => {
                    self.drop_frame(e.to_string())?;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            if pick(&msg) {
                return take(msg)
                    .ok_or_else(|| HostError::Unexpected("answer did not match".into()));
            }
            match self.fate(&msg) {
                Fate::Queue => self.events.push_back(msg),
                Fate::Drop => self.drop_frame(type_name(&msg))?,
            }
        }
    }

    /// Start (or, for a known id, re-query) a process. Returns its `Started`; an `Exited`
    /// that follows (already finished, or later) is collected by [`wait_exited`](Self::wait_exited).
    pub async fn exec(&mut self, req: Exec) -> Result<Started, HostError> {
        self.check_budget()?;
        let id = req.id.clone();
        self.execs.insert(id.clone());
        if req.stream_output {
            self.streamed.insert(id.clone());
        }
        self.send(&HostToGuest::Exec(req)).await?;
        let pick = |m: &GuestToHost| match m {
            GuestToHost::Started(s) => s.id == id,
            GuestToHost::Error(e) => e.id.as_deref().is_none_or(|eid| eid == id),
            _ => false,
        };
        let after = self.answer_timeout;
        let answer = within("the Exec", after, self.answer(pick, Some)).await?;
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
            self.exited.insert(e.id.clone());
            return Ok(e);
        }
        let e = self
            .answer(
                |m| matches!(m, GuestToHost::Exited(e) if e.id == id),
                |m| match m {
                    GuestToHost::Exited(e) => Some(e),
                    _ => None,
                },
            )
            .await?;
        self.exited.insert(e.id.clone());
        Ok(e)
    }

    pub async fn probe(&mut self, req: HttpProbe) -> Result<ProbeResult, HostError> {
        self.check_budget()?;
        self.send(&HostToGuest::HttpProbe(req)).await?;
        let pick =
            |m: &GuestToHost| matches!(m, GuestToHost::ProbeResult(_) | GuestToHost::Error(_));
        let after = self.answer_timeout;
        match within("the probe", after, self.answer(pick, Some)).await? {
            GuestToHost::ProbeResult(r) => Ok(r),
            GuestToHost::Error(e) => Err(HostError::Guest(e)),
            other => Err(HostError::Unexpected(type_name(&other))),
        }
    }

    pub async fn metrics(&mut self) -> Result<GuestMetrics, HostError> {
        self.check_budget()?;
        self.send(&HostToGuest::Metrics).await?;
        let pick =
            |m: &GuestToHost| matches!(m, GuestToHost::GuestMetrics(_) | GuestToHost::Error(_));
        let after = self.answer_timeout;
        match within("the metrics query", after, self.answer(pick, Some)).await? {
            GuestToHost::GuestMetrics(r) => Ok(r),
            GuestToHost::Error(e) => Err(HostError::Guest(e)),
            other => Err(HostError::Unexpected(type_name(&other))),
        }
    }

    /// Give a clone its own identity before anything secret (docs/guest-protocol.md,
    /// "Identity") and check the guest's evidence with [`check_identified`]. `Ok` only when the
    /// guest applied every part and the evidence holds; any error means: fail the clone, hand
    /// it no config. Set `req.wall_clock_unix_ns` just before calling.
    pub async fn reidentify(
        &mut self,
        req: Reidentify,
        check: &IdentityCheck,
    ) -> Result<Identified, HostError> {
        self.check_budget()?;
        let sent = Instant::now();
        self.send(&HostToGuest::Reidentify(req.clone())).await?;
        let pick = |m: &GuestToHost| match m {
            GuestToHost::Identified(_) => true,
            GuestToHost::Error(e) => e.id.is_none(),
            _ => false,
        };
        let after = self.answer_timeout;
        let got = match within("the Reidentify", after, self.answer(pick, Some)).await? {
            GuestToHost::Identified(i) => i,
            GuestToHost::Error(e) => return Err(HostError::Guest(e)),
            other => return Err(HostError::Unexpected(type_name(&other))),
        };
        check_identified(&req, &got, check, self.generation, sent.elapsed())?;
        self.generation = got.generation;
        Ok(got)
    }

    /// Have the guest read `req.paths` into its page cache (docs/guest-protocol.md, "Warm").
    /// An `Error` answer (a field refused, or an older guest's `unknown_type`) is
    /// [`HostError::Guest`]; the answer timeout applies.
    pub async fn warm(&mut self, req: Warm) -> Result<Warmed, HostError> {
        self.check_budget()?;
        self.send(&HostToGuest::Warm(req)).await?;
        let pick = |m: &GuestToHost| match m {
            GuestToHost::Warmed(_) => true,
            GuestToHost::Error(e) => e.id.is_none(),
            _ => false,
        };
        let after = self.answer_timeout;
        match within("the Warm", after, self.answer(pick, Some)).await? {
            GuestToHost::Warmed(w) => Ok(w),
            GuestToHost::Error(e) => Err(HostError::Guest(e)),
            other => Err(HostError::Unexpected(type_name(&other))),
        }
    }

    /// Ask the guest to power off. There is no answer; the connection then closes.
    pub async fn shutdown(&mut self) -> Result<(), HostError> {
        self.send(&HostToGuest::Shutdown).await
    }
}

/// `fut` within `after`, else [`HostError::NoAnswer`]. Reads are cancel safe, so the connection
/// stays aligned on a frame boundary after a timeout.
async fn within<T>(
    request: &'static str,
    after: Duration,
    fut: impl Future<Output = Result<T, HostError>>,
) -> Result<T, HostError> {
    tokio::time::timeout(after, fut)
        .await
        .unwrap_or(Err(HostError::NoAnswer { request, after }))
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
    use crate::frame::{MAX_FRAME_BYTES, encode};
    use crate::protocol::{Output, OutputStream};
    use tokio::net::UnixListener;

    /// A fake guest on a Unix socket: says Hello, then runs `script` on the accepted stream.
    async fn fake_guest<F, Fut>(script: F) -> (tempfile::TempDir, HostClient)
    where
        F: FnOnce(UnixStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("guest.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let hello = GuestToHost::Hello(Hello {
                protocol: PROTOCOL_VERSION,
                agent_version: "fake".into(),
                boot_id: "b".into(),
            });
            s.write_all(&encode(&hello).unwrap()).await.unwrap();
            script(s).await;
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        let client = connect_unix(&path, deadline).await.unwrap();
        (dir, client)
    }

    fn exec(id: &str, stream_output: bool) -> Exec {
        Exec {
            id: id.into(),
            argv: vec!["runner".into()],
            env: Default::default(),
            cwd: None,
            uid: None,
            gid: None,
            refuse_root: false,
            timeout_s: None,
            stream_output,
            poweroff_on_exit: false,
        }
    }

    async fn send(s: &mut UnixStream, msg: GuestToHost) -> std::io::Result<()> {
        s.write_all(&encode(&msg).unwrap()).await
    }

    /// Reads (and discards) one host frame: the Exec.
    async fn read_request(s: &mut UnixStream) {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.unwrap();
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).await.unwrap();
    }

    fn output(id: &str, bytes: usize) -> GuestToHost {
        GuestToHost::Output(Output {
            id: id.into(),
            stream: OutputStream::Stdout,
            data_b64: "A".repeat(bytes),
        })
    }

    fn exited(id: &str) -> GuestToHost {
        GuestToHost::Exited(Exited {
            id: id.into(),
            code: Some(0),
            signal: None,
            timed_out: false,
        })
    }

    #[tokio::test]
    async fn a_flood_of_unsolicited_megabyte_frames_ends_in_budget_exceeded() {
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counter = sent.clone();
        let (_dir, mut client) = fake_guest(move |mut s| async move {
            read_request(&mut s).await;
            let started = GuestToHost::Started(Started {
                id: "runner".into(),
                pid: 7,
            });
            send(&mut s, started).await.unwrap();
            // 500 frames just under the 1 MiB cap, for a process nobody started here.
            let frame = output("not-mine", MAX_FRAME_BYTES - 100);
            for _ in 0..500 {
                if send(&mut s, frame.clone()).await.is_err() {
                    return; // the host gave up on us
                }
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let _ = send(&mut s, exited("runner")).await;
        })
        .await;
        assert_eq!(client.exec(exec("runner", false)).await.unwrap().pid, 7);
        let err = client.wait_exited("runner").await.unwrap_err();
        match &err {
            HostError::BudgetExceeded { count, last } => {
                assert_eq!(*count, MAX_UNEXPECTED_FRAMES + 1);
                assert_eq!(last, "output");
            }
            other => panic!("expected BudgetExceeded, got {other:?}"),
        }
        assert!(client.events.is_empty(), "unsolicited frames were queued");
        // Nothing more is read from this guest: every further call fails at once.
        assert!(matches!(
            client.wait_exited("runner").await,
            Err(HostError::BudgetExceeded { .. })
        ));
        assert!(matches!(
            client.metrics().await,
            Err(HostError::BudgetExceeded { .. })
        ));
        drop(client);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let n = sent.load(std::sync::atomic::Ordering::Relaxed);
        assert!(n < 500, "the host read all {n} frames");
    }

    #[tokio::test]
    async fn a_guest_that_never_answers_times_out_per_request() {
        let (_dir, mut client) = fake_guest(|mut s| async move {
            read_request(&mut s).await;
            // Hold the connection open, answer nothing.
            tokio::time::sleep(Duration::from_secs(30)).await;
        })
        .await;
        client.set_answer_timeout(Duration::from_millis(300));
        let started = std::time::Instant::now();
        let err = client.exec(exec("runner", false)).await.unwrap_err();
        assert!(
            matches!(err, HostError::NoAnswer { request: "the Exec", after } if after == Duration::from_millis(300)),
            "{err:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn expected_events_are_queued_and_duplicates_and_strays_are_counted() {
        let (_dir, mut client) = fake_guest(|mut s| async move {
            read_request(&mut s).await; // Exec "a" (streamed)
            read_request(&mut s).await; // Exec "b"
            let started = |id: &str| {
                GuestToHost::Started(Started {
                    id: id.into(),
                    pid: 1,
                })
            };
            send(&mut s, started("a")).await.unwrap();
            // While the host waits for b's Started: a's output and exit (expected), a stray
            // Started, a second Exited of a, an undecodable frame.
            send(&mut s, output("a", 8)).await.unwrap();
            send(&mut s, exited("a")).await.unwrap();
            send(&mut s, exited("a")).await.unwrap();
            send(&mut s, started("zzz")).await.unwrap();
            s.write_all(&[0, 0, 0, 2, b'{', b'}']).await.unwrap();
            send(&mut s, started("b")).await.unwrap();
            send(&mut s, exited("a")).await.unwrap();
            send(&mut s, exited("b")).await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        })
        .await;
        // Both requests are written before any answer is read (as two callers would).
        client.execs.insert("a".into());
        client.streamed.insert("a".into());
        client
            .send(&HostToGuest::Exec(exec("a", true)))
            .await
            .unwrap();
        assert_eq!(client.exec(exec("b", false)).await.unwrap().id, "b");
        // Queued: a's Output and one Exited. Dropped: Started(a) (no answer is queued, only
        // events), the second Exited(a), Started(zzz), `{}`.
        assert_eq!(client.events.len(), 2, "{:?}", client.events);
        assert_eq!(client.unexpected_frames(), 4);
        assert!(matches!(
            client.recv().await.unwrap(),
            GuestToHost::Output(_)
        ));
        assert_eq!(client.wait_exited("a").await.unwrap().id, "a");
        assert_eq!(client.wait_exited("b").await.unwrap().id, "b");
        // Once a's exit was read, a third Exited(a) is a stray as well.
        assert_eq!(client.unexpected_frames(), 5);
    }

    const NOW_NS: u64 = 1_796_342_399_000_000_000;

    fn reidentify_req() -> Reidentify {
        Reidentify {
            entropy_b64: "AAEC".into(),
            hostname: "clone-1".into(),
            machine_id: Some("0123456789abcdef0123456789abcdef".into()),
            wall_clock_unix_ns: NOW_NS,
            network: Some(crate::protocol::NetIdentity {
                mac: "02:00:0a:2c:00:05".into(),
                address: "10.44.0.5".into(),
                prefix: 24,
                gateway: "10.44.0.1".into(),
                ..Default::default()
            }),
        }
    }

    fn identified(sample: u8) -> Identified {
        use base64::Engine;
        Identified {
            generation: 1,
            vmgenid_device: None,
            random_sample_b64: base64::engine::general_purpose::STANDARD.encode([sample; 32]),
            hostname: "clone-1".into(),
            machine_id: "0123456789abcdef0123456789abcdef".into(),
            wall_clock_unix_ns: NOW_NS + 2_000_000,
            clock_step_ns: -5,
            network: Some(crate::protocol::NetEvidence {
                mac: "02:00:0A:2C:00:05".into(),
                addresses: vec!["10.44.0.5/24".into()],
                neighbours_flushed: 3,
                gratuitous_arps: 1,
            }),
        }
    }

    #[test]
    fn identity_evidence_is_checked_part_by_part() {
        let req = reidentify_req();
        let check = IdentityCheck::default();
        let rt = Duration::from_millis(3);
        assert_eq!(
            check_identified(&req, &identified(1), &check, 0, rt),
            Ok(())
        );

        let fails = |edit: fn(&mut Identified), last: u64| {
            let mut got = identified(1);
            edit(&mut got);
            check_identified(&req, &got, &check, last, rt).unwrap_err()
        };
        assert_eq!(
            fails(|_| {}, 1),
            EvidenceError::GenerationNotAdvanced { got: 1, after: 1 }
        );
        assert_eq!(
            fails(|g| g.random_sample_b64 = "AAEC".into(), 0),
            EvidenceError::MalformedSample
        );
        assert!(matches!(
            fails(|g| g.hostname = "snapshot".into(), 0),
            EvidenceError::Hostname { .. }
        ));
        assert!(matches!(
            fails(|g| g.machine_id = "f".repeat(32), 0),
            EvidenceError::MachineId { .. }
        ));
        // The snapshot's clock, an hour behind, and one ahead of the round trip.
        assert!(matches!(
            fails(|g| g.wall_clock_unix_ns = NOW_NS - 3_600_000_000_000, 0),
            EvidenceError::Clock { .. }
        ));
        assert!(matches!(
            fails(|g| g.wall_clock_unix_ns = NOW_NS + 504_000_000, 0),
            EvidenceError::Clock { .. }
        ));
        assert!(matches!(
            fails(|g| g.network = None, 0),
            EvidenceError::Network(_)
        ));
        assert!(matches!(
            fails(|g| g.network.as_mut().unwrap().mac = "02:00:0a:2c:00:06".into(), 0),
            EvidenceError::Network(m) if m.contains("MAC")
        ));
        // The snapshot's address left beside the new one.
        assert!(matches!(
            fails(|g| g.network.as_mut().unwrap().addresses.push("10.9.0.2/24".into()), 0),
            EvidenceError::Network(m) if m.contains("addresses")
        ));

        // The cross-clone comparison: the sample of another clone of the same snapshot.
        let other_clone = identified(1).random_sample().unwrap();
        let check = IdentityCheck {
            previous_samples: vec![vec![9; 32], other_clone],
            ..IdentityCheck::default()
        };
        assert_eq!(
            check_identified(&req, &identified(1), &check, 0, rt),
            Err(EvidenceError::RepeatedSample)
        );
        assert_eq!(
            check_identified(&req, &identified(2), &check, 0, rt),
            Ok(())
        );
        // The caller's knowledge of the snapshot's generation overrides the connection's.
        let check = IdentityCheck {
            after_generation: Some(4),
            ..IdentityCheck::default()
        };
        assert!(matches!(
            check_identified(&req, &identified(2), &check, 0, rt),
            Err(EvidenceError::GenerationNotAdvanced { after: 4, .. })
        ));

        // A generated machine-id must still be one.
        let mut req = reidentify_req();
        req.machine_id = None;
        let mut got = identified(1);
        got.machine_id = "0".repeat(32);
        assert!(matches!(
            check_identified(&req, &got, &IdentityCheck::default(), 0, rt),
            Err(EvidenceError::MalformedMachineId(_))
        ));
    }

    #[tokio::test]
    async fn reidentify_answers_are_checked_and_errors_passed_through() {
        let (_dir, mut client) = fake_guest(|mut s| async move {
            for sample in [1u8, 1] {
                read_request(&mut s).await;
                let mut got = identified(sample);
                got.generation = u64::from(sample) + 1;
                got.wall_clock_unix_ns = now_ns();
                send(&mut s, GuestToHost::Identified(got)).await.unwrap();
            }
            read_request(&mut s).await;
            let locked = GuestToHost::Error(ErrorMsg {
                code: crate::protocol::ErrorCode::IdentityLocked,
                message: "refused".into(),
                id: None,
            });
            send(&mut s, locked).await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        })
        .await;
        let req = || {
            let mut r = reidentify_req();
            r.wall_clock_unix_ns = now_ns();
            r
        };
        let first = client
            .reidentify(req(), &IdentityCheck::default())
            .await
            .unwrap();
        assert_eq!(first.generation, 2);
        // Same sample again, and a generation that did not advance past the first answer's.
        let check = IdentityCheck {
            previous_samples: vec![first.random_sample().unwrap()],
            ..IdentityCheck::default()
        };
        let err = client.reidentify(req(), &check).await.unwrap_err();
        assert!(
            matches!(
                err,
                HostError::Evidence(EvidenceError::GenerationNotAdvanced { got: 2, after: 2 })
            ),
            "{err:?}"
        );
        let err = client
            .reidentify(req(), &IdentityCheck::default())
            .await
            .unwrap_err();
        assert!(
            matches!(&err, HostError::Guest(e) if e.code == crate::protocol::ErrorCode::IdentityLocked),
            "{err:?}"
        );
    }

    fn now_ns() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    }

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
