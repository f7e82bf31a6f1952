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

/// Requests, host -> guest. Answers come back in request order: `Exec` -> `Started` (or
/// `Error`), `HttpProbe` -> `ProbeResult`, `Metrics` -> `GuestMetrics`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum HostToGuest {
    Exec(Exec),
    HttpProbe(HttpProbe),
    Metrics,
    /// Power the guest off (host-process mode: the agent exits). No answer.
    Shutdown,
}

impl HostToGuest {
    /// Every `type` value of this direction, for telling an unknown type from a malformed one.
    pub const TYPES: &'static [&'static str] = &["exec", "http_probe", "metrics", "shutdown"];
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
    /// A well-formed request the guest refuses (e.g. empty id).
    InvalidRequest,
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
    const SECRET_BEARING: &'static [&'static str] = &["exec"];
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
