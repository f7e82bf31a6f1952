//! Host-process-mode integration tests: the real imp-guest binary, driven through the host
//! client over a Unix socket.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{AgentProc, exec, run, sh};
use imp_common::{ExposeSecret, SecretString};
use imp_guest::frame::{MAX_FRAME_BYTES, encode};
use imp_guest::host::HostError;
use imp_guest::protocol::{ErrorCode, GuestToHost, HostToGuest, HttpProbe, PROTOCOL_VERSION};

#[tokio::test]
async fn hello_states_version_and_boot_id() {
    let agent = AgentProc::start();
    let a = agent.connect().await;
    let b = agent.connect().await;
    assert_eq!(a.hello().protocol, PROTOCOL_VERSION);
    assert_eq!(a.hello().agent_version, env!("CARGO_PKG_VERSION"));
    assert!(!a.hello().boot_id.is_empty());
    // Same process, same "boot": the host can tell a reconnect from a reboot.
    assert_eq!(a.hello().boot_id, b.hello().boot_id);
    let other = AgentProc::start();
    assert_ne!(other.connect().await.hello().boot_id, a.hello().boot_id);
}

#[tokio::test]
async fn env_is_delivered_exactly() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let env: BTreeMap<String, SecretString> = [
        ("PATH", "/usr/bin:/bin"),
        ("ACTIONS_RUNNER_INPUT_JITCONFIG", "eyJhIjoiYiJ9=="),
        ("WITH_SPACES", "  a b  "),
        ("MULTI", "line1\nline2"),
        ("EQUALS", "k=v=w"),
        ("UNICODE", "żółw 🐢"),
        ("EMPTY", ""),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), SecretString::from(v)))
    .collect();
    let mut req = exec("env", &["env", "-0"]);
    req.env = env.clone();
    let (out, _, exited) = run(&mut client, req).await;
    assert_eq!((exited.code, exited.signal), (Some(0), None));
    let got: BTreeMap<String, String> = out
        .split(|b| *b == 0)
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let kv = String::from_utf8(kv.to_vec()).unwrap();
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect();
    let want: BTreeMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.clone(), v.expose_secret().to_owned()))
        .collect();
    // Nothing inherited from the agent (it runs with RUST_LOG set), nothing missing.
    assert_eq!(got, want);
}

#[tokio::test]
async fn cwd_and_argv0_path_lookup() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let mut req = exec("pwd", &["pwd", "-P"]);
    req.cwd = Some(agent.dir.path().to_string_lossy().into_owned());
    let (out, _, exited) = run(&mut client, req).await;
    assert_eq!(exited.code, Some(0));
    let want = agent.dir.path().canonicalize().unwrap();
    assert_eq!(
        String::from_utf8(out).unwrap().trim_end(),
        want.to_string_lossy()
    );

    let mut req = exec("nopath", &["true"]);
    req.env.clear();
    // No PATH in env: the guest's default PATH is used for the lookup and nothing is added.
    let (_, _, exited) = run(&mut client, req).await;
    assert_eq!(exited.code, Some(0));
}

#[tokio::test]
async fn uid_switch() {
    if !common::is_root() {
        println!("skipped: uid switching needs root");
        return;
    }
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let mut req = sh("uid", "echo $(id -u):$(id -g):$(id -G)");
    req.uid = Some(65534);
    req.gid = Some(65533);
    let (out, _, exited) = run(&mut client, req).await;
    assert_eq!(exited.code, Some(0));
    // Supplementary groups of root are dropped, not inherited.
    assert_eq!(String::from_utf8(out).unwrap().trim(), "65534:65533:65533");
}

#[tokio::test]
async fn refuse_root_stops_a_root_exec_and_says_why() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let marker = agent.dir.path().join("ran");
    let script = format!("touch {}", marker.display());
    let mut req = sh("root", &script);
    req.uid = Some(0);
    req.refuse_root = true;
    match client.exec(req).await {
        Err(HostError::Guest(e)) => {
            assert_eq!(e.code, ErrorCode::SpawnFailed);
            assert_eq!(e.id.as_deref(), Some("root"));
            assert!(
                e.message.contains("as root (uid 0)") && e.message.contains("runAsRoot"),
                "{}",
                e.message
            );
        }
        other => panic!("a root exec with refuse_root started: {other:?}"),
    }
    assert!(!marker.exists(), "the refused process ran");

    // Without a uid the agent's own counts: refused when the agent is root.
    let mut req = sh("self", &script);
    req.refuse_root = true;
    let answer = client.exec(req).await;
    if common::is_root() {
        assert!(
            matches!(&answer, Err(HostError::Guest(e)) if e.code == ErrorCode::SpawnFailed),
            "{answer:?}"
        );
        // The same request allowed to be root runs.
        let mut req = sh("allowed", &script);
        req.uid = Some(0);
        let (_, _, exited) = run(&mut client, req).await;
        assert_eq!(exited.code, Some(0));
        assert!(marker.exists());
    } else {
        assert!(answer.is_ok(), "a non-root agent refused: {answer:?}");
    }
}

#[tokio::test]
async fn exit_codes_and_signals_reported() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let started = client.exec(sh("code", "exit 7")).await.unwrap();
    assert!(started.pid > 0);
    let e = client.wait_exited("code").await.unwrap();
    assert_eq!((e.code, e.signal, e.timed_out), (Some(7), None, false));

    client.exec(sh("sig", "kill -TERM $$")).await.unwrap();
    let e = client.wait_exited("sig").await.unwrap();
    assert_eq!(
        (e.code, e.signal, e.timed_out),
        (None, Some(libc::SIGTERM), false)
    );

    // Concurrent execs on one connection; exits come back as they happen, matched by id.
    client.exec(sh("slow", "sleep 0.5; exit 3")).await.unwrap();
    client.exec(sh("fast", "exit 4")).await.unwrap();
    assert_eq!(client.wait_exited("slow").await.unwrap().code, Some(3));
    assert_eq!(client.wait_exited("fast").await.unwrap().code, Some(4));
}

#[tokio::test]
async fn output_streams_are_separate_and_complete() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let (out, err, e) = run(
        &mut client,
        sh("streams", "echo to-out; echo to-err >&2; exit 1"),
    )
    .await;
    assert_eq!(
        (out.as_slice(), err.as_slice(), e.code),
        (&b"to-out\n"[..], &b"to-err\n"[..], Some(1))
    );
    // Larger than a pipe buffer and many chunks, all delivered in order before Exited.
    let (out, _, e) = run(&mut client, sh("big", "seq 1 50000")).await;
    assert_eq!(e.code, Some(0));
    let want: String = (1..=50000).map(|i| format!("{i}\n")).collect();
    assert_eq!(String::from_utf8(out).unwrap(), want);
}

#[tokio::test]
async fn timeout_kills_the_process_group() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let pidfile = agent.dir.path().join("bg.pid");
    let mut req = sh(
        "t",
        &format!("sleep 60 & echo $! > {}; wait", pidfile.display()),
    );
    req.timeout_s = Some(1);
    let t0 = std::time::Instant::now();
    client.exec(req).await.unwrap();
    let e = tokio::time::timeout(Duration::from_secs(10), client.wait_exited("t"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (e.code, e.signal, e.timed_out),
        (None, Some(libc::SIGKILL), true)
    );
    let elapsed = t0.elapsed();
    assert!(
        elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
    // The background child was in the group, so it is gone too (and reaped by the subreaper).
    let bg: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::path::Path::new(&format!("/proc/{bg}")).exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "background sleep {bg} survived the timeout"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn duplicate_exec_id_never_starts_a_second_process() {
    let agent = AgentProc::start();
    let counter = agent.dir.path().join("count");
    let req = sh(
        "dup",
        &format!("echo run >> {}; sleep 0.5", counter.display()),
    );
    let mut client = agent.connect().await;
    let first = client.exec(req.clone()).await.unwrap();
    // Same connection while running: same pid, no new process.
    let again = client.exec(req.clone()).await.unwrap();
    assert_eq!(first.pid, again.pid);
    // Another connection, while running.
    let mut other = agent.connect().await;
    assert_eq!(other.exec(req.clone()).await.unwrap().pid, first.pid);
    let e = client.wait_exited("dup").await.unwrap();
    assert_eq!(e.code, Some(0));
    assert_eq!(other.wait_exited("dup").await.unwrap(), e);
    // After the end, on a fresh connection: recorded Started and Exited, still no new process.
    let mut late = agent.connect().await;
    assert_eq!(late.exec(req).await.unwrap().pid, first.pid);
    assert_eq!(late.wait_exited("dup").await.unwrap(), e);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(std::fs::read_to_string(&counter).unwrap(), "run\n");
}

#[tokio::test]
async fn process_survives_connection_drop_and_exit_is_reported_on_reconnect() {
    let agent = AgentProc::start();
    let marker = agent.dir.path().join("done");
    let req = sh(
        "job",
        &format!("sleep 0.7; echo done > {}; exit 5", marker.display()),
    );
    let pid = {
        let mut client = agent.connect().await;
        client.exec(req.clone()).await.unwrap().pid
        // dropped here, mid-run
    };
    let mut client = agent.connect().await;
    let again = client.exec(req).await.unwrap();
    assert_eq!(again.pid, pid);
    let e = client.wait_exited("job").await.unwrap();
    assert_eq!(e.code, Some(5));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "done\n");
}

#[tokio::test]
async fn spawn_failure_is_recorded_not_retried() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    for _ in 0..2 {
        match client.exec(exec("missing", &["/nonexistent/binary"])).await {
            Err(HostError::Guest(e)) => {
                assert_eq!(e.code, ErrorCode::SpawnFailed);
                assert_eq!(e.id.as_deref(), Some("missing"));
            }
            other => panic!("expected spawn failure, got {other:?}"),
        }
    }
    match client.exec(exec("", &["true"])).await {
        Err(HostError::Guest(e)) => assert_eq!(e.code, ErrorCode::InvalidRequest),
        other => panic!("expected invalid request, got {other:?}"),
    }
    match client.exec(exec("noargv", &[])).await {
        Err(HostError::Guest(e)) => assert_eq!(e.code, ErrorCode::SpawnFailed),
        other => panic!("expected spawn failure, got {other:?}"),
    }
}

#[tokio::test]
async fn garbage_frames_get_errors_and_the_connection_goes_on() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let frame = |payload: &[u8]| {
        let mut v = (payload.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(payload);
        v
    };
    let cases: [(&[u8], ErrorCode); 5] = [
        (b"\xff\xfe not json", ErrorCode::InvalidMessage),
        (b"{\"no\":\"type\"}", ErrorCode::InvalidMessage),
        (b"{\"type\":\"reformat_disk\"}", ErrorCode::UnknownType),
        (
            b"{\"type\":\"started\",\"id\":\"x\",\"pid\":1}",
            ErrorCode::UnknownType,
        ),
        (b"{\"type\":\"exec\",\"id\":5}", ErrorCode::InvalidMessage),
    ];
    for (payload, code) in cases {
        client.send_raw(&frame(payload)).await.unwrap();
        match client.recv().await.unwrap() {
            GuestToHost::Error(e) => {
                assert_eq!(e.code, code, "{}", String::from_utf8_lossy(payload))
            }
            other => panic!("expected error, got {other:?}"),
        }
    }
    // Still usable.
    let m = client.metrics().await.unwrap();
    assert!(m.memory_total_bytes > 0 && m.disk_total_bytes > 0);
}

#[tokio::test]
async fn oversize_frame_is_rejected_and_the_connection_closed() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    client
        .send_raw(&((MAX_FRAME_BYTES as u32) + 1).to_be_bytes())
        .await
        .unwrap();
    match client.recv().await.unwrap() {
        GuestToHost::Error(e) => assert_eq!(e.code, ErrorCode::FrameTooLarge),
        other => panic!("expected error, got {other:?}"),
    }
    assert!(matches!(client.recv().await, Err(HostError::Closed)));
    // A u32::MAX length is refused the same way, and the agent is unharmed.
    let mut client = agent.connect().await;
    client.send_raw(&u32::MAX.to_be_bytes()).await.unwrap();
    assert!(matches!(
        client.recv().await.unwrap(),
        GuestToHost::Error(_)
    ));
    let mut client = agent.connect().await;
    assert!(client.metrics().await.is_ok());
    // Exactly at the limit is fine: a valid (if padded) request gets its answer.
    let pad = "x".repeat(MAX_FRAME_BYTES - r#"{"type":"metrics","pad":""}"#.len());
    let payload = format!(r#"{{"type":"metrics","pad":"{pad}"}}"#);
    let mut raw = (payload.len() as u32).to_be_bytes().to_vec();
    raw.extend(payload.as_bytes());
    client.send_raw(&raw).await.unwrap();
    assert!(matches!(
        client.recv().await.unwrap(),
        GuestToHost::GuestMetrics(_)
    ));
}

#[tokio::test]
async fn truncated_frame_then_disconnect_does_not_hurt_the_agent() {
    let agent = AgentProc::start();
    {
        let mut client = agent.connect().await;
        let bytes = encode(&HostToGuest::Metrics).unwrap();
        client.send_raw(&bytes[..bytes.len() - 2]).await.unwrap();
    }
    let mut client = agent.connect().await;
    assert!(client.metrics().await.is_ok());
}

async fn http_server(response: &'static str) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                if response.is_empty() {
                    // Hang: accept but never answer.
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                let _ = s.write_all(response.as_bytes()).await;
            });
        }
    });
    port
}

#[tokio::test]
async fn probe_results() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let ok = http_server("HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n").await;
    let r = client
        .probe(HttpProbe {
            path: "/healthz".into(),
            port: ok,
            timeout_ms: 2000,
        })
        .await
        .unwrap();
    assert_eq!((r.status, r.error), (Some(204), None));

    let bad = http_server("HTTP/1.0 503 Service Unavailable\r\n\r\n").await;
    let r = client
        .probe(HttpProbe {
            path: "/".into(),
            port: bad,
            timeout_ms: 2000,
        })
        .await
        .unwrap();
    assert_eq!(r.status, Some(503));

    let hang = http_server("").await;
    let t0 = std::time::Instant::now();
    let r = client
        .probe(HttpProbe {
            path: "/".into(),
            port: hang,
            timeout_ms: 300,
        })
        .await
        .unwrap();
    assert_eq!(r.status, None);
    assert!(r.error.unwrap().contains("timed out"));
    assert!(t0.elapsed() < Duration::from_secs(3));

    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let r = client
        .probe(HttpProbe {
            path: "/".into(),
            port: closed,
            timeout_ms: 1000,
        })
        .await
        .unwrap();
    assert_eq!(r.status, None);
    assert!(r.error.unwrap().contains("connect"));

    let garbage = http_server("SSH-2.0-OpenSSH_9.2\r\n").await;
    let r = client
        .probe(HttpProbe {
            path: "/".into(),
            port: garbage,
            timeout_ms: 1000,
        })
        .await
        .unwrap();
    assert_eq!(r.status, None);

    let r = client
        .probe(HttpProbe {
            path: "/x\r\nEvil: 1".into(),
            port: ok,
            timeout_ms: 1000,
        })
        .await
        .unwrap();
    assert!(r.error.unwrap().contains("invalid probe path"));
}

#[tokio::test]
async fn metrics_are_plausible() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let m = client.metrics().await.unwrap();
    assert!(m.memory_used_bytes > 0 && m.memory_used_bytes <= m.memory_total_bytes);
    assert!(m.disk_used_bytes <= m.disk_total_bytes && m.disk_total_bytes > 0);
    assert!(m.uptime_seconds > 0.0);
}

#[tokio::test]
async fn orphans_are_reaped() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    // The shell exits at once; its background child is reparented to the agent (subreaper,
    // like PID 1 in the VM) and must not linger as a zombie once it exits.
    client
        .exec(sh("orphan", "sleep 0.3 & exit 0"))
        .await
        .unwrap();
    assert_eq!(client.wait_exited("orphan").await.unwrap().code, Some(0));
    tokio::time::sleep(Duration::from_millis(1800)).await;
    assert_eq!(common::zombie_children(agent.pid()), Vec::<u32>::new());
}

#[tokio::test]
async fn poweroff_on_exit_after_the_exit_was_reported() {
    let mut agent = AgentProc::start();
    let mut client = agent.connect().await;
    let mut req = sh("runner", "sleep 0.2; exit 0");
    req.poweroff_on_exit = true;
    client.exec(req).await.unwrap();
    assert_eq!(client.wait_exited("runner").await.unwrap().code, Some(0));
    let status = agent
        .wait_exit(Duration::from_secs(10))
        .expect("agent did not power off");
    assert!(status.success());
    let log = agent.stop();
    assert!(log.contains("WorkloadExitReported"), "{log}");
}

#[tokio::test]
async fn poweroff_on_exit_without_a_host_waits_for_the_grace_period() {
    let mut agent = AgentProc::start_with(&["--report-grace-s", "1"]);
    let t0 = std::time::Instant::now();
    {
        let mut client = agent.connect().await;
        let mut req = sh("runner", "sleep 0.5");
        req.poweroff_on_exit = true;
        client.exec(req).await.unwrap();
        // Gone long before the exit: nobody can be told.
    }
    let status = agent
        .wait_exit(Duration::from_secs(10))
        .expect("agent did not power off");
    assert!(status.success());
    assert!(
        t0.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        t0.elapsed()
    );
    let log = agent.stop();
    assert!(log.contains("WorkloadExitUnreported"), "{log}");
}

#[tokio::test]
async fn shutdown_request_ends_the_agent() {
    let mut agent = AgentProc::start();
    let mut client = agent.connect().await;
    client.shutdown().await.unwrap();
    assert!(
        agent
            .wait_exit(Duration::from_secs(10))
            .expect("still running")
            .success()
    );
    assert!(!agent.socket.exists(), "socket file left behind");
}

#[tokio::test]
async fn secrets_never_reach_logs_or_console() {
    const SECRET: &str = "jitcfg-5b7d1e0a-TOP-SECRET-9c3f";
    let mut agent = AgentProc::start();
    let mut client = agent.connect().await;
    let mut req = exec("runner", &["true"]);
    req.env.insert(
        "ACTIONS_RUNNER_INPUT_JITCONFIG".into(),
        SecretString::from(SECRET),
    );
    client.exec(req.clone()).await.unwrap();
    client.wait_exited("runner").await.unwrap();
    // A replay of the same request, and one that fails to spawn, are logged too.
    client.exec(req.clone()).await.unwrap();
    let mut failing = req.clone();
    failing.id = "failing".into();
    failing.argv = vec!["/nonexistent".into()];
    assert!(client.exec(failing).await.is_err());
    // A malformed Exec carrying the secret where a number belongs.
    let payload = format!(r#"{{"type":"exec","id":"bad","argv":["true"],"uid":"{SECRET}"}}"#);
    let mut raw = (payload.len() as u32).to_be_bytes().to_vec();
    raw.extend(payload.as_bytes());
    client.send_raw(&raw).await.unwrap();
    loop {
        match client.recv().await.unwrap() {
            GuestToHost::Error(e) => {
                assert_eq!(e.code, ErrorCode::InvalidMessage);
                assert!(!e.message.contains(SECRET), "{}", e.message);
                break;
            }
            // The replay's Exited.
            GuestToHost::Exited(_) => continue,
            other => panic!("{other:?}"),
        }
    }
    let log = agent.stop();
    assert!(
        log.contains("exec requested"),
        "log capture is not working: {log}"
    );
    assert!(
        log.contains("ACTIONS_RUNNER_INPUT_JITCONFIG"),
        "env keys are expected in the log: {log}"
    );
    assert!(
        !log.contains(SECRET),
        "secret leaked into the agent's output:\n{log}"
    );
    // Nor on disk under the agent's working area.
    for entry in std::fs::read_dir(agent.dir.path()).unwrap().flatten() {
        if entry.path() != agent.log && entry.path().is_file() {
            assert!(
                !std::fs::read_to_string(entry.path())
                    .unwrap_or_default()
                    .contains(SECRET)
            );
        }
    }
}

/// `Warm` through the agent: a tree is read (counted, links not followed), a bad field is named,
/// and it is answered after an Exec too without making the identity final (a later Reidentify
/// is refused for the missing identity root, not as locked).
#[tokio::test]
async fn warm_reads_a_tree_names_bad_fields_and_leaves_the_identity_alone() {
    use imp_guest::protocol::Warm;
    let agent = AgentProc::start();
    let root = agent.dir.path().join("runner");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::write(root.join("bin/Runner.Listener"), vec![7u8; 300_000]).unwrap();
    std::fs::write(root.join("run.sh"), b"#!/bin/sh\n").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", root.join("passwd")).unwrap();
    let mut client = agent.connect().await;
    let req = |paths: Vec<String>| Warm {
        paths,
        max_bytes: 1 << 30,
        max_files: 1000,
    };
    let w = client
        .warm(req(vec![root.display().to_string()]))
        .await
        .unwrap();
    assert_eq!(
        (w.files, w.bytes, w.truncated, w.skipped),
        (2, 300_010, false, 1),
        "{w:?}"
    );
    match client.warm(req(vec!["runner".into()])).await {
        Err(HostError::Guest(e)) => {
            assert_eq!(e.code, ErrorCode::InvalidRequest);
            assert!(e.message.starts_with("warm: paths: [0]: "), "{e:?}");
        }
        other => panic!("{other:?}"),
    }
    // Not locked by a Warm: refused only because this agent manages no identity.
    let check = imp_guest::host::IdentityCheck::default();
    match client
        .reidentify(imp_guest::protocol::Reidentify::default(), &check)
        .await
    {
        Err(HostError::Guest(e)) => assert_eq!(e.code, ErrorCode::IdentityFailed, "{e:?}"),
        other => panic!("{other:?}"),
    }
    let (_, _, exited) = run(&mut client, exec("first", &["true"])).await;
    assert_eq!(exited.code, Some(0));
    let w = client
        .warm(req(vec![root.join("run.sh").display().to_string()]))
        .await
        .unwrap();
    assert_eq!((w.files, w.bytes), (1, 10));
}
