//! `HttpProbe`: one plain HTTP/1.1 GET to 127.0.0.1 inside the guest. Hand-written because only
//! the status line matters and the static binary should not carry an HTTP stack.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::protocol::{HttpProbe, ProbeResult};

/// Upper bound on a probe's timeout, whatever the host asks: probes run inline on the
/// connection, so a huge timeout would stall its other requests.
pub const MAX_PROBE_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_STATUS_LINE: usize = 8 * 1024;

pub async fn run(req: &HttpProbe) -> ProbeResult {
    if !valid_path(&req.path) {
        return failure(
            "invalid probe path: must start with '/' and contain no spaces or control characters",
        );
    }
    let timeout = Duration::from_millis(req.timeout_ms).min(MAX_PROBE_TIMEOUT);
    match tokio::time::timeout(timeout, get_status(req.port, &req.path)).await {
        Ok(Ok(status)) => ProbeResult {
            status: Some(status),
            error: None,
        },
        Ok(Err(e)) => failure(e),
        Err(_) => failure(format!("timed out after {} ms", timeout.as_millis())),
    }
}

fn failure(msg: impl Into<String>) -> ProbeResult {
    ProbeResult {
        status: None,
        error: Some(msg.into()),
    }
}

fn valid_path(path: &str) -> bool {
    path.starts_with('/') && !path.bytes().any(|b| b.is_ascii_control() || b == b' ')
}

async fn get_status(port: u16, path: &str) -> Result<u16, String> {
    // A SocketAddr, not ("127.0.0.1", port): no resolver code (getaddrinfo) in the static binary.
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect 127.0.0.1:{port}: {e}"))?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: imp-guest-probe\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("send request: {e}"))?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 512];
    loop {
        if let Some(end) = buf.windows(2).position(|w| w == b"\r\n") {
            return parse_status_line(&buf[..end]);
        }
        if buf.len() > MAX_STATUS_LINE {
            return Err("status line too long".into());
        }
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("read response: {e}"))?;
        if n == 0 {
            return Err("connection closed before a status line".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// `HTTP/1.x NNN reason` -> NNN.
pub fn parse_status_line(line: &[u8]) -> Result<u16, String> {
    let line = std::str::from_utf8(line).map_err(|_| "status line is not UTF-8".to_owned())?;
    let mut parts = line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/") || code.len() != 3 {
        return Err(format!("malformed status line {:?}", truncate(line, 64)));
    }
    code.parse::<u16>()
        .ok()
        .filter(|c| (100..=599).contains(c))
        .ok_or_else(|| format!("malformed status code {code:?}"))
}

fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines() {
        assert_eq!(parse_status_line(b"HTTP/1.1 200 OK"), Ok(200));
        assert_eq!(parse_status_line(b"HTTP/1.0 503"), Ok(503));
        assert!(parse_status_line(b"HTTP/1.1 2000 OK").is_err());
        assert!(parse_status_line(b"SSH-2.0-OpenSSH").is_err());
        assert!(parse_status_line(b"HTTP/1.1 abc").is_err());
        assert!(parse_status_line(b"HTTP/1.1 099 x").is_err());
    }

    #[test]
    fn paths() {
        assert!(valid_path("/healthz?x=1"));
        assert!(!valid_path("healthz"));
        assert!(!valid_path("/a b"));
        assert!(!valid_path("/a\r\nHost: evil"));
    }
}
