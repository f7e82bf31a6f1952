//! The host client against a stand-in for Firecracker's hybrid vsock: a Unix socket that
//! takes `CONNECT <port>\n`, answers `OK <n>\n` and then splices to the agent.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{AgentProc, sh};
use imp_guest::frame::encode;
use imp_guest::host::{self, HostError};
use imp_guest::protocol::{GuestToHost, Hello};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::time::Instant;

/// Behaviour of the fake Firecracker vsock device.
#[derive(Clone, Copy)]
struct Bridge {
    /// Close this many connections right after CONNECT, as Firecracker does while nothing
    /// listens on the guest port yet.
    refuse_first: usize,
    /// Send the OK line and the guest's first bytes in a single write.
    coalesce_ok_and_hello: bool,
}

async fn start_bridge(
    uds: PathBuf,
    agent_socket: PathBuf,
    expect_port: u32,
    cfg: Bridge,
) -> Arc<AtomicUsize> {
    let listener = UnixListener::bind(&uds).unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    tokio::spawn(async move {
        while let Ok((host_side, _)) = listener.accept().await {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            let agent_socket = agent_socket.clone();
            tokio::spawn(async move {
                let mut host_side = BufReader::new(host_side);
                let mut line = String::new();
                host_side.read_line(&mut line).await.unwrap();
                assert_eq!(line, format!("CONNECT {expect_port}\n"));
                if n < cfg.refuse_first {
                    return;
                }
                let mut guest = UnixStream::connect(&agent_socket).await.unwrap();
                let mut host_side = host_side.into_inner();
                if cfg.coalesce_ok_and_hello {
                    // Wait for the Hello so it lands in the same read as the OK line.
                    let mut first = vec![0u8; 4096];
                    let n = guest.read(&mut first).await.unwrap();
                    let mut out = b"OK 1073741824\n".to_vec();
                    out.extend_from_slice(&first[..n]);
                    host_side.write_all(&out).await.unwrap();
                } else {
                    host_side.write_all(b"OK 1073741824\n").await.unwrap();
                }
                let _ = tokio::io::copy_bidirectional(&mut host_side, &mut guest).await;
            });
        }
    });
    seen
}

fn uds(agent: &AgentProc) -> PathBuf {
    agent.dir.path().join("v.sock")
}

#[tokio::test]
async fn connect_keeps_bytes_that_arrive_with_the_ok_line() {
    let agent = AgentProc::start();
    let uds = uds(&agent);
    start_bridge(
        uds.clone(),
        agent.socket.clone(),
        10000,
        Bridge {
            refuse_first: 0,
            coalesce_ok_and_hello: true,
        },
    )
    .await;
    let mut client = host::connect(&uds, 10000, Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        client.hello().protocol,
        imp_guest::protocol::PROTOCOL_VERSION
    );
    client.exec(sh("via-vsock", "exit 9")).await.unwrap();
    assert_eq!(client.wait_exited("via-vsock").await.unwrap().code, Some(9));
}

#[tokio::test]
async fn connect_retries_until_the_guest_listens() {
    let agent = AgentProc::start();
    let uds = uds(&agent);
    // The socket does not exist yet, then the first attempts are refused.
    let (uds2, agent_sock) = (uds.clone(), agent.socket.clone());
    let seen = Arc::new(std::sync::Mutex::new(None));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let c = start_bridge(
            uds2,
            agent_sock,
            4242,
            Bridge {
                refuse_first: 3,
                coalesce_ok_and_hello: false,
            },
        )
        .await;
        *seen2.lock().unwrap() = Some(c);
    });
    let t0 = std::time::Instant::now();
    let mut client = host::connect(&uds, 4242, Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(300));
    let attempts = seen
        .lock()
        .unwrap()
        .as_ref()
        .unwrap()
        .load(Ordering::SeqCst);
    assert_eq!(attempts, 4, "three refused connections, then the good one");
    assert!(client.metrics().await.is_ok());
}

#[tokio::test]
async fn connect_gives_up_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = std::time::Instant::now();
    let err = host::connect(
        &dir.path().join("absent.sock"),
        10000,
        Instant::now() + Duration::from_millis(400),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, HostError::Timeout { .. }), "{err:?}");
    assert!(t0.elapsed() < Duration::from_secs(2));
}

/// A fake guest that greets with an arbitrary Hello (or raw bytes) on a plain Unix socket.
async fn fake_guest(path: &Path, first: Vec<u8>) {
    let listener = UnixListener::bind(path).unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let first = first.clone();
            tokio::spawn(async move {
                let _ = s.write_all(&first).await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            });
        }
    });
}

#[tokio::test]
async fn incompatible_protocol_is_refused_without_retrying() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.sock");
    let hello = GuestToHost::Hello(Hello {
        protocol: 99,
        agent_version: "9.0.0".into(),
        boot_id: "b".into(),
    });
    fake_guest(&path, encode(&hello).unwrap()).await;
    let t0 = std::time::Instant::now();
    let err = host::connect_unix(&path, Instant::now() + Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(
        matches!(err, HostError::IncompatibleProtocol { guest: 99, .. }),
        "{err:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(2), "should not retry");
}

#[tokio::test]
async fn first_frame_must_be_hello() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.sock");
    let started = GuestToHost::Started(imp_guest::protocol::Started {
        id: "x".into(),
        pid: 1,
    });
    fake_guest(&path, encode(&started).unwrap()).await;
    let err = host::connect_unix(&path, Instant::now() + Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(
        matches!(err, HostError::NoHello(ref t) if t == "started"),
        "{err:?}"
    );
}

#[tokio::test]
async fn bad_handshake_reply_is_retried_then_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.sock");
    fake_guest(&path, b"NOPE\n".to_vec()).await;
    let err = host::connect(&path, 10000, Instant::now() + Duration::from_millis(500))
        .await
        .unwrap_err();
    match err {
        HostError::Timeout { last, .. } => assert!(last.contains("NOPE"), "{last}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn library_bridge_routes_ports_and_refuses_unknown_ones() {
    let agent = AgentProc::start();
    let uds = uds(&agent);
    let listener = UnixListener::bind(&uds).unwrap();
    let routes = std::collections::HashMap::from([(10000, agent.socket.clone())]);
    tokio::spawn(imp_guest::hybrid::serve_bridge(listener, routes));

    let mut client = host::connect(&uds, 10000, Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    client.exec(sh("bridged", "exit 6")).await.unwrap();
    assert_eq!(client.wait_exited("bridged").await.unwrap().code, Some(6));

    // Nothing listens on 10001: closed after CONNECT, retried until the deadline.
    let err = host::connect(&uds, 10001, Instant::now() + Duration::from_millis(400))
        .await
        .unwrap_err();
    match err {
        HostError::Timeout { last, .. } => assert!(last.contains("closed"), "{last}"),
        other => panic!("{other:?}"),
    }
}

/// The guest agent announces itself once it listens (`--announce-unix`, standing in for its
/// vsock connection to the host's READY port), and the host attempts at once. The agent starts
/// at 800 ms: the backoff's attempts fall at 0, 20, 60, 140, 300 and 620 ms and the next at
/// 1,120 ms, after the 1,100 ms deadline, so only the announcement can connect in time.
#[tokio::test]
async fn an_announcing_guest_is_connected_at_once_not_at_the_next_backoff_step() {
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("v.sock");
    let t0 = Instant::now();
    let mut announcements = host::Announcements::bind(&uds).unwrap();
    let announce_path = announcements.path().to_owned();
    assert_eq!(announce_path, host::announce_path(&uds));
    assert!(announce_path.to_str().unwrap().ends_with("v.sock_10001"));
    let (uds2, path2) = (uds.clone(), announce_path.clone());
    let agent = tokio::spawn(async move {
        tokio::time::sleep_until(t0 + Duration::from_millis(800)).await;
        let agent = AgentProc::start_with(&["--announce-unix", path2.to_str().unwrap()]);
        start_bridge(
            uds2,
            agent.socket.clone(),
            10000,
            Bridge {
                refuse_first: 0,
                coalesce_ok_and_hello: false,
            },
        )
        .await;
        agent
    });
    let r = host::connect_announced(
        &uds,
        10000,
        &mut announcements,
        t0 + Duration::from_millis(1100),
    )
    .await;
    let _agent = agent.await.unwrap();
    let client = r.expect("connected on the announcement before the deadline");
    assert_eq!(
        client.hello().protocol,
        imp_guest::protocol::PROTOCOL_VERSION
    );
    assert_eq!(announcements.heard(), 1);
    drop(announcements);
    assert!(
        !announce_path.exists(),
        "the announcement socket is removed on drop"
    );
}

/// A guest that never announces (an older image) is still found by the backoff.
#[tokio::test]
async fn a_guest_that_does_not_announce_is_found_by_the_backoff() {
    let agent = AgentProc::start();
    let uds = uds(&agent);
    let mut announcements = host::Announcements::bind(&uds).unwrap();
    let (uds2, agent_sock) = (uds.clone(), agent.socket.clone());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        start_bridge(
            uds2,
            agent_sock,
            10000,
            Bridge {
                refuse_first: 1,
                coalesce_ok_and_hello: false,
            },
        )
        .await;
    });
    let client = host::connect_announced(
        &uds,
        10000,
        &mut announcements,
        Instant::now() + Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(
        client.hello().protocol,
        imp_guest::protocol::PROTOCOL_VERSION
    );
    assert_eq!(announcements.heard(), 0);
}
