//! A TCP proxy on 127.0.0.1 that counts the HTTP/1.1 requests passing through it: "zero
//! registry requests" measured at the registry's door, not inferred from the client's code.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What ends every HTTP/1.1 request line (`GET /v2/... HTTP/1.1\r\n`). Only request lines
/// carry it on the client side: headers end in their values, and bodies sent to a registry
/// while counting (none: counts are taken during pulls) are not expected to.
const REQUEST_LINE_END: &[u8] = b" HTTP/1.1\r\n";

/// Forwards every connection to `upstream`; stops (and refuses new connections) on drop.
pub struct CountingProxy {
    host: String,
    requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl CountingProxy {
    pub async fn start(upstream: String) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let host = listener.local_addr()?.to_string();
        let requests = Arc::new(AtomicUsize::new(0));
        let counter = requests.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let counter = counter.clone();
                tokio::spawn(async move {
                    if let Ok(up) = tokio::net::TcpStream::connect(&upstream).await {
                        forward(conn, up, counter).await;
                    }
                });
            }
        });
        Ok(Self {
            host,
            requests,
            task,
        })
    }

    /// `127.0.0.1:<port>`, to put in image references instead of the registry's.
    pub fn host(&self) -> String {
        self.host.clone()
    }

    /// Requests forwarded so far.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for CountingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(
    client: tokio::net::TcpStream,
    up: tokio::net::TcpStream,
    counter: Arc<AtomicUsize>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut up_read, mut up_write) = up.into_split();
    let to_upstream = async {
        let mut buf = vec![0u8; 64 << 10];
        // The tail of the previous read: a request line may straddle two reads.
        let mut carry: Vec<u8> = Vec::new();
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            carry.extend_from_slice(&buf[..n]);
            counter.fetch_add(count(&carry, REQUEST_LINE_END), Ordering::SeqCst);
            let keep = carry.len().min(REQUEST_LINE_END.len() - 1);
            carry.drain(..carry.len() - keep);
            if up_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = up_write.shutdown().await;
    };
    let to_client = async {
        let _ = tokio::io::copy(&mut up_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    };
    tokio::join!(to_upstream, to_client);
}

fn count(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_line_split_over_reads_counts_once() {
        // What `forward` keeps between reads: never a whole needle, so nothing counts twice.
        let keep = REQUEST_LINE_END.len() - 1;
        let first = b"GET /v2/ HTTP/1.";
        let second = b"1\r\nHost: x\r\n\r\nHEAD /v2/a HTTP/1.1\r\n";
        let mut carry = first.to_vec();
        let mut total = count(&carry, REQUEST_LINE_END);
        let k = carry.len().min(keep);
        carry.drain(..carry.len() - k);
        carry.extend_from_slice(second);
        total += count(&carry, REQUEST_LINE_END);
        assert_eq!(total, 2);
    }
}
