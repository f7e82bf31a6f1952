//! What the acceptance tests of imp-operator, imp-agent and imp-runtime check about a binary
//! started with stdout and stderr to one file: plain text without terminal escapes, JSON lines
//! under `IMP_LOG_FORMAT=json`, a graceful stop (exit 0, "stopped" logged) on a signal, and its
//! HTTP endpoints (`get`).

use std::path::Path;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Stdout and stderr of a child, both to `path` (created, truncated).
pub fn log_file(path: &Path) -> (std::fs::File, std::fs::File) {
    let f = std::fs::File::create(path)
        .unwrap_or_else(|e| panic!("create log file {}: {e}", path.display()));
    let g = f.try_clone().expect("clone the log file handle");
    (f, g)
}

/// `kill -<signal> <pid>` (`signal` as `kill` spells it: "TERM", "INT").
pub fn send_signal(pid: u32, signal: &str) {
    let ok = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill -{signal} {pid} failed");
}

/// Waits for `child` to exit; kills it and panics after `timeout`.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pid {} did not exit within {timeout:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The log has text and no ANSI escape sequence (`ESC [`).
pub fn assert_no_ansi(log: &str) {
    assert!(!log.trim().is_empty(), "the log is empty");
    if let Some(at) = log.find("\x1b[") {
        let start = log[..at].rfind('\n').map_or(0, |i| i + 1);
        let end = log[at..].find('\n').map_or(log.len(), |i| at + i);
        panic!(
            "ANSI escape in the log at byte {at}: {:?}",
            &log[start..end]
        );
    }
}

/// Every line of the log is a JSON object with `level` and `fields` (tracing-subscriber's JSON
/// format); returns them.
pub fn assert_json_lines(log: &str) -> Vec<serde_json::Value> {
    assert!(!log.trim().is_empty(), "the log is empty");
    log.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("log line is not JSON ({e}): {line}"));
            assert!(
                v.get("level").is_some() && v.get("fields").is_some(),
                "log line lacks level/fields: {line}"
            );
            v
        })
        .collect()
}

/// Exit code 0, and the log shows the signal was received and the binary stopped (`stopped`: the
/// binary's own last message, e.g. "imp-runtime stopped").
pub fn assert_graceful_stop(status: ExitStatus, log: &str, stopped: &str) {
    assert_eq!(status.code(), Some(0), "exit {status}; log:\n{log}");
    assert!(
        log.contains("shutdown signal received"),
        "no shutdown message; log:\n{log}"
    );
    assert!(log.contains(stopped), "no {stopped:?}; log:\n{log}");
}

/// A minimal HTTP/1.1 GET of a binary's endpoint (`/healthz`, `/readyz`, `/metrics`): (status
/// code, headers and body as text), or None when it does not answer.
pub async fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "ANSI escape in the log")]
    fn an_escape_sequence_is_found() {
        assert_no_ansi("ok\n\x1b[32m INFO\x1b[0m started\n");
    }

    #[test]
    fn plain_text_passes() {
        assert_no_ansi("2026-12-01T15:00:00Z  INFO imp_runtime: started\n");
    }

    #[test]
    #[should_panic(expected = "not JSON")]
    fn a_text_line_among_json_is_found() {
        assert_json_lines("{\"level\":\"INFO\",\"fields\":{}}\nplain\n");
    }

    #[test]
    fn json_lines_are_returned() {
        let v = assert_json_lines(
            "{\"level\":\"INFO\",\"fields\":{\"message\":\"a\"}}\n{\"level\":\"WARN\",\"fields\":{}}\n",
        );
        assert_eq!(v.len(), 2);
        assert_eq!(v[0]["fields"]["message"], "a");
    }
}
