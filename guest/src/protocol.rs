//! The host<->guest wire contract (ARCHITECTURE §4): every message that crosses the vsock.
//!
//! Messages are split by direction so each side can only send what the other expects:
//! [`HostToGuest`] (requests) and [`GuestToHost`] (hello, responses and events). Both are
//! serialized as JSON objects whose `type` field names the variant in snake_case, e.g.
//! `{"type":"exec","id":"run-1",...}`. Framing lives in [`crate::frame`]; docs/guest-protocol.md
//! is the narrative version of this file.

use std::collections::BTreeMap;

use imp_common::SecretString;

use serde::{Deserialize, Serialize};

/// Major protocol version. Bumped only for incompatible changes; additive changes (new optional
/// fields, new message types) keep it, because both sides ignore unknown fields and answer
/// unknown message types with an [`ErrorCode::UnknownType`] error instead of failing.
pub const PROTOCOL_VERSION: u32 = 1;

/// Oldest guest protocol version this build's host client accepts. The guest states its version
/// in [`Hello`]; the host refuses (closes) when it is outside `MIN_SUPPORTED..=PROTOCOL_VERSION`.
pub const MIN_SUPPORTED_PROTOCOL: u32 = 1;

/// The vsock port the guest agent listens on.
pub const AGENT_VSOCK_PORT: u32 = 10000;

/// The host vsock port a guest announces itself on once its agent listens: the host learns the
/// guest is ready when it is, instead of at its next connect attempt. Through hybrid vsock
/// (Firecracker, vhost-device-vsock) the guest's connection arrives at the host's Unix socket
/// `<uds_path>_<port>` (see `host::Announcements`). Nothing is read from it: a guest that announces
/// early, twice or never only changes when the host connects, never what it trusts.
pub const READY_VSOCK_PORT: u32 = 10001;

/// Sent by the guest as the first frame of every connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The guest's [`PROTOCOL_VERSION`].
    pub protocol: u32,
    /// imp-guest's crate version, for diagnostics only.
    pub agent_version: String,
    /// Changes on every guest boot (the kernel's boot_id): lets the host tell a reconnect to the
    /// same boot (exec table intact) from a rebooted guest (exec table lost).
    pub boot_id: String,
}

/// Start a process in the guest. `id` is an idempotency key: a repeated id never starts a second
/// process, it re-reports what was recorded for the first one. No `PartialEq`: env values are
/// secrets (they carry the one-time JIT runner config).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Exec {
    pub id: String,
    /// argv[0] is resolved against the PATH in `env` (or the default PATH when `env` has none).
    pub argv: Vec<String>,
    /// The complete environment of the process: nothing is inherited from the agent. Values are
    /// secrets (never in logs, Debug output or the serial console); on the wire, plain strings.
    #[serde(default, serialize_with = "imp_common::secret::serialize_values")]
    pub env: BTreeMap<String, SecretString>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Run as this uid (gid from `gid`, else the user's primary group in /etc/passwd, else = uid).
    #[serde(default)]
    pub uid: Option<u32>,
    #[serde(default)]
    pub gid: Option<u32>,
    /// Refuse to start the process as root: when the uid it would run as (`uid`, else the
    /// agent's own) is 0, the Exec fails with [`ErrorCode::SpawnFailed`]. The runner's Exec sets
    /// it unless its pool allows root (`runnerUser.runAsRoot`).
    #[serde(default)]
    pub refuse_root: bool,
    /// Kill the whole process group with SIGKILL after this many seconds; reported as
    /// `Exited{signal: 9, timed_out: true}`.
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// Send stdout/stderr as [`Output`] frames (best effort) instead of to the agent's own stdio.
    #[serde(default)]
    pub stream_output: bool,
    /// This process is the VM's workload: once it has exited and its [`Exited`] has been written
    /// to a host connection, the guest powers off (ephemeral VMs).
    #[serde(default)]
    pub poweroff_on_exit: bool,
}

/// Probe `GET http://127.0.0.1:{port}{path}` inside the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpProbe {
    pub path: String,
    pub port: u16,
    #[serde(default = "default_probe_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_probe_timeout_ms() -> u64 {
    1000
}

/// Give a guest restored from a memory snapshot an identity of its own, before anything secret
/// reaches it (docs/guest-protocol.md, "Identity"). Every clone of one snapshot wakes with the
/// snapshot's random pool, hostname, machine-id, MAC, address and wall clock; this message
/// replaces each of them and the guest answers [`Identified`] only once all were applied. Refused
/// with [`ErrorCode::IdentityLocked`] once the guest has received any `Exec`.
///
/// Fields are plain strings and numbers, checked by the guest, so a bad value is answered with
/// [`ErrorCode::InvalidRequest`] naming its field (`reidentify: <field>: <reason>`). No
/// `PartialEq`, and `Debug` hides the entropy: it is seed material.
#[derive(Clone, Default, Serialize, Deserialize)]
pub struct Reidentify {
    /// Random bytes from the host, standard base64, [`REIDENTIFY_ENTROPY_MIN`]..=
    /// [`REIDENTIFY_ENTROPY_MAX`] bytes: mixed into the guest kernel's pool with
    /// `RNDADDENTROPY` (credited in full), then the kernel's generator is reseeded
    /// (`RNDRESEEDCRNG`), so every later `getrandom` in this clone depends on them.
    #[serde(default)]
    pub entropy_b64: String,
    /// The hostname to set (1-64 of a-z, A-Z, 0-9, '-', '.', as `imp.hostname`).
    #[serde(default)]
    pub hostname: String,
    /// `/etc/machine-id`: 32 lowercase hex digits, not all zero. `None`: the guest makes one
    /// from its generator after the reseed.
    #[serde(default)]
    pub machine_id: Option<String>,
    /// The host's wall clock when it sent this, nanoseconds since the Unix epoch. A guest that
    /// owns its clock (PID 1 in a VM) steps it there when it is more than
    /// [`CLOCK_STEP_THRESHOLD_NS`] off; one that does not (host-process mode) only checks it.
    #[serde(default)]
    pub wall_clock_unix_ns: u64,
    /// The network identity. `None`: the network stays as the snapshot had it (e.g. a network
    /// namespace per clone with the same address).
    #[serde(default)]
    pub network: Option<NetIdentity>,
}

/// Fewest and most entropy bytes a [`Reidentify`] carries (the kernel credits at most 256 bits
/// per call; the rest is mixed in uncredited).
pub const REIDENTIFY_ENTROPY_MIN: usize = 32;
pub const REIDENTIFY_ENTROPY_MAX: usize = 512;

/// A guest that owns its wall clock leaves it alone when it is within this of the host's time
/// (stepping it by the message's transit time would only move it backwards).
pub const CLOCK_STEP_THRESHOLD_NS: u64 = 10_000_000;

impl std::fmt::Debug for Reidentify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reidentify")
            .field("entropy_b64", &"[REDACTED]")
            .field("hostname", &self.hostname)
            .field("machine_id", &self.machine_id)
            .field("wall_clock_unix_ns", &self.wall_clock_unix_ns)
            .field("network", &self.network)
            .finish()
    }
}

/// The guest's one interface after a [`Reidentify`]: the fields of `imp.net`, `imp.dns` and
/// `imp.dns_search` (docs/guest-protocol.md, kernel command line), plus the MAC the host gave
/// the clone's TAP side.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetIdentity {
    /// `aa:bb:cc:dd:ee:ff`, unicast.
    #[serde(default)]
    pub mac: String,
    /// IPv4 address of the interface; every other IPv4 address on it is removed.
    #[serde(default)]
    pub address: String,
    /// Prefix length, 1..=30.
    #[serde(default)]
    pub prefix: u32,
    /// Default gateway, inside the address's subnet.
    #[serde(default)]
    pub gateway: String,
    /// `None`: the MTU stays as it is.
    #[serde(default)]
    pub mtu: Option<u32>,
    /// Nameservers for /etc/resolv.conf (at most 3); empty: resolv.conf stays as it is.
    #[serde(default)]
    pub dns: Vec<String>,
    #[serde(default)]
    pub dns_search: Vec<String>,
}

/// Read the regular files under `paths` once, so they are in the guest's page cache (a
/// template's snapshot then holds them, and its clones' runners start without reading them
/// from disk; docs/snapshots.md, "Warming"). Each path is walked recursively without following
/// a symlink and without leaving its filesystem; unreadable and special files are skipped.
/// Answered with [`Warmed`], or with [`ErrorCode::InvalidRequest`] naming the field (`warm:
/// <field>: <reason>`). Allowed at any time, after an `Exec` too: it only reads files as the
/// agent and answers counts, never contents, and it does not make the identity final.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Warm {
    /// Absolute paths without `..`, 1..=[`WARM_MAX_PATHS`], each at most [`WARM_MAX_PATH_BYTES`].
    #[serde(default)]
    pub paths: Vec<String>,
    /// Stop after reading this many bytes (positive).
    #[serde(default)]
    pub max_bytes: u64,
    /// Stop after this many files, 1..=[`WARM_MAX_FILES`] (default [`WARM_DEFAULT_FILES`]).
    #[serde(default = "default_warm_files")]
    pub max_files: u64,
}

fn default_warm_files() -> u64 {
    WARM_DEFAULT_FILES
}

/// Bounds of a [`Warm`]: the paths fit a frame many times over.
pub const WARM_MAX_PATHS: usize = 64;
pub const WARM_MAX_PATH_BYTES: usize = 4096;
pub const WARM_MAX_FILES: u64 = 1_000_000;
pub const WARM_DEFAULT_FILES: u64 = 100_000;

/// Why `path` cannot be a [`Warm`] path (or a spec's warm path, checked by the same rule).
pub fn check_warm_path(path: &str) -> Result<(), String> {
    if path.is_empty() || path.len() > WARM_MAX_PATH_BYTES {
        return Err(format!("1-{WARM_MAX_PATH_BYTES} bytes"));
    }
    if !path.starts_with('/') {
        return Err(format!("{path:?} is not absolute"));
    }
    if path.split('/').any(|c| c == "..") {
        return Err(format!("{path:?} has a `..` component"));
    }
    if path.chars().any(char::is_control) {
        return Err("control characters".into());
    }
    Ok(())
}

/// The answer to [`Warm`]: what was read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Warmed {
    /// Regular files read (to their end, or to the byte bound).
    pub files: u64,
    pub bytes: u64,
    pub millis: u64,
    /// A bound (`max_bytes`, `max_files`) stopped the walk before its end.
    pub truncated: bool,
    /// Entries skipped: symlinks, special files, other filesystems, unreadable ones, and
    /// paths that do not exist.
    #[serde(default)]
    pub skipped: u64,
}

/// Requests, host -> guest. Answers come back in request order: `Exec` -> `Started` (or
/// `Error`), `HttpProbe` -> `ProbeResult`, `Metrics` -> `GuestMetrics`, `Reidentify` ->
/// `Identified` (or `Error`), `Warm` -> `Warmed` (or `Error`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum HostToGuest {
    Exec(Exec),
    HttpProbe(HttpProbe),
    Metrics,
    /// Power the guest off (host-process mode: the agent exits). No answer.
    Shutdown,
    Reidentify(Reidentify),
    Warm(Warm),
}

impl HostToGuest {
    /// Every `type` value of this direction, for telling an unknown type from a malformed one.
    pub const TYPES: &'static [&'static str] = &[
        "exec",
        "http_probe",
        "metrics",
        "shutdown",
        "reidentify",
        "warm",
    ];
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    pub id: String,
    pub pid: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputStream {
    Stdout,
    Stderr,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Output {
    pub id: String,
    pub stream: OutputStream,
    /// Raw bytes, base64 (standard alphabet, padded): output need not be UTF-8.
    pub data_b64: String,
}

/// A process ended. Exactly one of `code` (normal exit) and `signal` (killed) is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exited {
    pub id: String,
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// The agent killed it because `timeout_s` elapsed (then `signal` is 9).
    #[serde(default)]
    pub timed_out: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeResult {
    /// The HTTP status code, when a response status line was read.
    pub status: Option<u16>,
    /// Why there is no status (refused, timeout, malformed response).
    #[serde(default)]
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuestMetrics {
    pub memory_total_bytes: u64,
    /// MemTotal - MemAvailable from /proc/meminfo.
    pub memory_used_bytes: u64,
    /// statvfs("/"): total and used (total - free) bytes of the root filesystem.
    pub disk_total_bytes: u64,
    pub disk_used_bytes: u64,
    pub uptime_seconds: f64,
}

/// The guest's answer to [`Reidentify`]: every part was applied, and what it shows now. The host
/// checks it (`host::HostClient::reidentify`) before it hands the clone anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identified {
    /// Identities applied by this guest so far, this one included: 1 after the first. It lives
    /// in guest memory, so every clone of a snapshot resumes with the snapshot's count; an
    /// answer that does not advance past what the host knew was not produced by this request.
    pub generation: u64,
    /// The ACPI device bound to the kernel's VM generation ID driver (`QEMUVGID:00`,
    /// `VMGENCTR:00`), when there is one: that kernel reseeds its generator by itself on a
    /// restore. Linux keeps the ID itself from userspace, so this is the device, not the ID.
    #[serde(default)]
    pub vmgenid_device: Option<String>,
    /// 32 bytes of `getrandom(2)` read after the seeding, standard base64. Clones of one
    /// snapshot that were not reseeded would answer the same bytes; the host compares.
    pub random_sample_b64: String,
    /// The hostname in effect (`uname`), read back.
    pub hostname: String,
    /// `/etc/machine-id` in effect, read back.
    pub machine_id: String,
    /// The guest's wall clock after the clock part, nanoseconds since the Unix epoch.
    pub wall_clock_unix_ns: u64,
    /// How far the clock was stepped (the host's time minus the guest's before), 0 when it was
    /// left alone.
    #[serde(default)]
    pub clock_step_ns: i64,
    /// What the interface shows after the network part; `None` when there was none.
    #[serde(default)]
    pub network: Option<NetEvidence>,
}

impl Identified {
    /// The decoded random sample, `None` when it is not base64.
    pub fn random_sample(&self) -> Option<Vec<u8>> {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD
            .decode(&self.random_sample_b64)
            .ok()
    }
}

/// The guest's interface after a network part, read back through rtnetlink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetEvidence {
    pub mac: String,
    /// Every IPv4 address on the interface, `ADDR/PREFIX`: exactly the one asked for.
    pub addresses: Vec<String>,
    /// Learnt neighbour (ARP) entries the interface had before (the snapshot's); none is left.
    pub neighbours_flushed: u32,
    /// Gratuitous ARP announcements sent for the new address.
    pub gratuitous_arps: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The frame's `type` is not one this side understands.
    UnknownType,
    /// Not JSON, no `type`, or fields of the wrong shape.
    InvalidMessage,
    /// Longer than [`crate::frame::MAX_FRAME_BYTES`]; the connection is closed after this.
    FrameTooLarge,
    /// The Exec could not start (no such program, bad cwd, bad uid, empty argv...).
    SpawnFailed,
    /// A well-formed request the guest refuses (e.g. empty id, a `Reidentify` field out of
    /// range: the message names the field).
    InvalidRequest,
    /// `Reidentify` after the guest received an `Exec`: identity may change only before any
    /// secret arrives.
    IdentityLocked,
    /// A part of a `Reidentify` could not be applied; the message names it
    /// (`reidentify: <part>: <reason>`). Parts before it were applied: fail the clone.
    IdentityFailed,
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMsg {
    pub code: ErrorCode,
    pub message: String,
    /// The Exec id this error answers, when it answers one.
    #[serde(default)]
    pub id: Option<String>,
}

/// Guest -> host: the hello, answers to requests, and asynchronous events (`Output`, `Exited`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum GuestToHost {
    Hello(Hello),
    Started(Started),
    Output(Output),
    Exited(Exited),
    ProbeResult(ProbeResult),
    GuestMetrics(GuestMetrics),
    Error(ErrorMsg),
    Identified(Identified),
    Warmed(Warmed),
}

impl GuestToHost {
    pub const TYPES: &'static [&'static str] = &[
        "hello",
        "started",
        "output",
        "exited",
        "probe_result",
        "guest_metrics",
        "error",
        "identified",
        "warmed",
    ];
}

/// A message type of one direction: what the frame codec needs to classify decode failures.
pub trait Message: Serialize + serde::de::DeserializeOwned {
    const TYPES: &'static [&'static str];
    /// Types whose decode errors must not echo input (serde errors quote offending values).
    const SECRET_BEARING: &'static [&'static str];
}

impl Message for HostToGuest {
    const TYPES: &'static [&'static str] = HostToGuest::TYPES;
    const SECRET_BEARING: &'static [&'static str] = &["exec", "reidentify"];
}

impl Message for GuestToHost {
    const TYPES: &'static [&'static str] = GuestToHost::TYPES;
    const SECRET_BEARING: &'static [&'static str] = &[];
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_common::ExposeSecret;
    use serde_json::json;

    #[test]
    fn exec_wire_shape_and_defaults() {
        let msg: HostToGuest = serde_json::from_value(json!({
            "type": "exec", "id": "a", "argv": ["/bin/true"], "env": {"K": "v"}
        }))
        .unwrap();
        let HostToGuest::Exec(exec) = msg else {
            panic!("not exec")
        };
        assert_eq!(exec.env["K"].expose_secret(), "v");
        assert_eq!(exec.timeout_s, None);
        assert!(!exec.poweroff_on_exit);
        // An older host that does not know the field asks for no refusal.
        assert!(!exec.refuse_root);
        let back = serde_json::to_value(HostToGuest::Exec(exec)).unwrap();
        assert_eq!(back["type"], "exec");
        assert_eq!(back["env"]["K"], "v");
    }

    #[test]
    fn unit_variants_are_bare_type_objects() {
        assert_eq!(
            serde_json::to_value(HostToGuest::Metrics).unwrap(),
            json!({"type": "metrics"})
        );
        let s: HostToGuest = serde_json::from_value(json!({"type": "shutdown"})).unwrap();
        assert!(matches!(s, HostToGuest::Shutdown), "{s:?}");
    }

    #[test]
    fn type_lists_match_serde_names() {
        let host = [
            HostToGuest::Exec(Exec {
                id: "i".into(),
                argv: vec![],
                env: BTreeMap::new(),
                cwd: None,
                uid: None,
                gid: None,
                refuse_root: false,
                timeout_s: None,
                stream_output: false,
                poweroff_on_exit: false,
            }),
            HostToGuest::HttpProbe(HttpProbe {
                path: "/".into(),
                port: 1,
                timeout_ms: 1,
            }),
            HostToGuest::Metrics,
            HostToGuest::Shutdown,
            HostToGuest::Reidentify(Reidentify::default()),
            HostToGuest::Warm(Warm {
                paths: vec!["/opt".into()],
                max_bytes: 1,
                max_files: 1,
            }),
        ];
        let names: Vec<String> = host
            .iter()
            .map(|m| {
                serde_json::to_value(m).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(names, HostToGuest::TYPES);

        let guest = [
            GuestToHost::Hello(Hello {
                protocol: 1,
                agent_version: "x".into(),
                boot_id: "b".into(),
            }),
            GuestToHost::Started(Started {
                id: "i".into(),
                pid: 1,
            }),
            GuestToHost::Output(Output {
                id: "i".into(),
                stream: OutputStream::Stderr,
                data_b64: String::new(),
            }),
            GuestToHost::Exited(Exited {
                id: "i".into(),
                code: Some(0),
                signal: None,
                timed_out: false,
            }),
            GuestToHost::ProbeResult(ProbeResult {
                status: Some(200),
                error: None,
            }),
            GuestToHost::GuestMetrics(GuestMetrics {
                memory_total_bytes: 1,
                memory_used_bytes: 1,
                disk_total_bytes: 1,
                disk_used_bytes: 1,
                uptime_seconds: 1.0,
            }),
            GuestToHost::Error(ErrorMsg {
                code: ErrorCode::Internal,
                message: "m".into(),
                id: None,
            }),
            GuestToHost::Identified(Identified {
                generation: 1,
                vmgenid_device: None,
                random_sample_b64: String::new(),
                hostname: "h".into(),
                machine_id: "m".into(),
                wall_clock_unix_ns: 1,
                clock_step_ns: 0,
                network: None,
            }),
            GuestToHost::Warmed(Warmed {
                files: 1,
                bytes: 1,
                millis: 1,
                truncated: false,
                skipped: 0,
            }),
        ];
        let names: Vec<String> = guest
            .iter()
            .map(|m| {
                serde_json::to_value(m).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(names, GuestToHost::TYPES);
    }

    #[test]
    fn reidentify_wire_shape_defaults_and_redaction() {
        let msg: HostToGuest = serde_json::from_value(json!({
            "type": "reidentify", "entropy_b64": "c2VlZC1tYXRlcmlhbA==", "hostname": "clone-1",
            "wall_clock_unix_ns": 1_800_000_000_000_000_000u64,
            "network": {"mac": "02:00:0a:2c:00:05", "address": "10.44.0.5", "prefix": 24,
                        "gateway": "10.44.0.1"}
        }))
        .unwrap();
        let HostToGuest::Reidentify(r) = msg else {
            panic!("not reidentify")
        };
        // Optional parts default to "not asked for"; missing fields reach the guest's checks,
        // which name them, rather than a serde error.
        assert_eq!(r.machine_id, None);
        let net = r.network.as_ref().unwrap();
        assert_eq!((net.mtu, net.dns.len()), (None, 0));
        let dbg = format!("{r:?}");
        assert!(!dbg.contains("c2VlZC1tYXRlcmlhbA"), "{dbg}");
        assert!(dbg.contains("clone-1"), "{dbg}");
        let empty: HostToGuest = serde_json::from_value(json!({"type": "reidentify"})).unwrap();
        assert!(matches!(empty, HostToGuest::Reidentify(r) if r.hostname.is_empty()));
        // A shape error in a reidentify frame does not quote values (the entropy is seed material).
        let err = crate::frame::decode_payload::<HostToGuest>(
            br#"{"type":"reidentify","entropy_b64":["c2VjcmV0LXNlZWQ"]}"#,
        )
        .unwrap_err();
        assert!(!err.to_string().contains("c2VjcmV0LXNlZWQ"), "{err}");
    }

    #[test]
    fn warm_defaults_and_path_rule() {
        let w: HostToGuest =
            serde_json::from_value(json!({"type": "warm", "paths": ["/opt/actions-runner"]}))
                .unwrap();
        let HostToGuest::Warm(w) = w else {
            panic!("not warm")
        };
        // Missing bounds reach the guest's checks (max_bytes 0 is refused, naming it).
        assert_eq!((w.max_bytes, w.max_files), (0, WARM_DEFAULT_FILES));
        assert_eq!(check_warm_path("/opt/actions-runner"), Ok(()));
        assert_eq!(check_warm_path("/a/..b/c."), Ok(()));
        for bad in ["", "opt", "/opt/../etc", "/..", "/a\nb"] {
            assert!(check_warm_path(bad).is_err(), "{bad:?}");
        }
        assert!(check_warm_path(&format!("/{}", "a".repeat(WARM_MAX_PATH_BYTES))).is_err());
    }

    #[test]
    fn redacted_debug_hides_value() {
        let mut env = BTreeMap::new();
        env.insert(
            "ACTIONS_RUNNER_INPUT_JITCONFIG".to_owned(),
            SecretString::from("s3cr3t-jit"),
        );
        let exec = Exec {
            id: "i".into(),
            argv: vec!["run.sh".into()],
            env,
            cwd: None,
            uid: None,
            gid: None,
            refuse_root: true,
            timeout_s: None,
            stream_output: false,
            poweroff_on_exit: true,
        };
        let dbg = format!("{:?} {:#?}", exec, HostToGuest::Exec(exec.clone()));
        assert!(!dbg.contains("s3cr3t-jit"), "{dbg}");
        assert!(dbg.contains("[REDACTED]"), "{dbg}");
    }
}
