//! The device side of Firecracker's hybrid vsock, for hosts without Firecracker: the testkit
//! simulator runs the agent as a host process (`imp-guest agent --listen-unix`) and puts this
//! bridge on the VM's `uds_path`, so imp-node talks to it exactly as to a real VM.
//!
//! Protocol (Firecracker docs/vsock.md): the host connects to `uds_path`, writes
//! `CONNECT <port>\n`; the device connects to the guest port and answers `OK <host-port>\n`, or
//! closes the connection when nothing listens there. Then bytes flow both ways.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

const MAX_CONNECT_LINE: usize = 64;
/// Firecracker numbers host-side ports from here upwards.
const FIRST_HOST_PORT: u32 = 1 << 30;

/// Accept host connections on `listener` forever, routing `CONNECT <port>` to the Unix socket
/// `guest_ports[port]`. Unknown ports and unreachable guests get the connection closed, as a
/// real VM whose port has no listener would.
pub async fn serve_bridge(listener: UnixListener, guest_ports: HashMap<u32, PathBuf>) {
    let routes = Arc::new(guest_ports);
    let next_port = Arc::new(AtomicU32::new(FIRST_HOST_PORT));
    while let Ok((host, _)) = listener.accept().await {
        let (routes, next_port) = (routes.clone(), next_port.clone());
        tokio::spawn(async move {
            if let Err(e) = bridge_one(host, &routes, &next_port).await {
                tracing::debug!(error = %e, "hybrid vsock connection ended");
            }
        });
    }
}

async fn bridge_one(
    mut host: UnixStream,
    routes: &HashMap<u32, PathBuf>,
    next_port: &AtomicU32,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 256];
    let newline = loop {
        if let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            break nl;
        }
        if buf.len() > MAX_CONNECT_LINE {
            return Ok(());
        }
        let n = host.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let line = String::from_utf8_lossy(&buf[..newline]).into_owned();
    let Some(target) = parse_connect(&line).and_then(|port| routes.get(&port)) else {
        return Ok(());
    };
    let Ok(mut guest) = UnixStream::connect(target).await else {
        return Ok(());
    };
    let host_port = next_port.fetch_add(1, Ordering::Relaxed);
    host.write_all(format!("OK {host_port}\n").as_bytes())
        .await?;
    // Whatever the host sent right after its CONNECT line belongs to the guest.
    guest.write_all(&buf[newline + 1..]).await?;
    tokio::io::copy_bidirectional(&mut host, &mut guest).await?;
    Ok(())
}

/// `CONNECT <port>` -> port.
pub fn parse_connect(line: &str) -> Option<u32> {
    line.trim_end_matches('\r')
        .strip_prefix("CONNECT ")?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_lines() {
        assert_eq!(parse_connect("CONNECT 10000"), Some(10000));
        assert_eq!(parse_connect("CONNECT 52\r"), Some(52));
        assert_eq!(parse_connect("CONNECT"), None);
        assert_eq!(parse_connect("connect 1"), None);
        assert_eq!(parse_connect("CONNECT -1"), None);
    }
}
