//! The imp-operator binary against a real API server: /healthz, /readyz once its caches are filled, an
//! ImpVM scheduled by it, /metrics in the Prometheus text format, logs (JSON lines, or plain text
//! without terminal escapes when written to a file), and a graceful stop with exit 0 on SIGTERM.

mod vm_common;

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use imp_api::VmPhase;
use imp_testkit::binlog::{self, get};
use imp_testkit::fixtures;
use tokio::process::{Child, Command};
use vm_common::*;

#[tokio::test(flavor = "multi_thread")]
async fn operator_binary_serves_health_and_metrics_and_schedules() {
    let mut h = Harness::without_controller("vmbin").await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("operator.log");
    let (mut child, addr) = start_operator(&h, &log, "json");
    wait_ready(&addr, &log).await;
    let (code, body) = get(&addr, "/healthz").await.unwrap();
    assert_eq!(code, 200, "{body}");

    let node = h.add_node("n", 4, 4096).await;
    let class = h.add_class("c", 1, 1024, None).await;
    h.create_vm(fixtures::vm("vm1").class(&class)).await;
    let vm = h
        .wait_phase("vm1", VmPhase::Scheduled, Duration::from_secs(15))
        .await;
    assert_eq!(node_of(&vm), Some(node.as_str()));

    let (code, metrics) = get(&addr, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(
        metrics
            .to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{metrics}"
    );
    assert!(
        metrics.contains("imp_vm_scheduling_latency_seconds_count 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("imp_vm_scheduling_attempts_total{result=\"scheduled\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "imp_node_agent_heartbeat_timestamp_seconds{{node=\"{node}\"}}"
        )),
        "{metrics}"
    );
    assert!(metrics.trim_end().ends_with("# EOF"), "{metrics}");

    let (status, logs) = stop(&mut child, &log).await;
    binlog::assert_graceful_stop(status, &logs, "imp-operator stopped");
    // JSON logs: every line parses, and the binding was logged.
    binlog::assert_json_lines(&logs);
    assert!(logs.contains("\"scheduled\""), "{logs}");
    h.finish().await;
}

/// Text logs written to a file (stdout and stderr) carry no ANSI colour codes, and SIGTERM stops
/// the operator gracefully.
#[tokio::test(flavor = "multi_thread")]
async fn operator_binary_logs_plain_text_to_a_file_and_stops_on_sigterm() {
    let h = Harness::without_controller("vmtext").await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("operator.log");
    let (mut child, addr) = start_operator(&h, &log, "text");
    wait_ready(&addr, &log).await;
    let (status, logs) = stop(&mut child, &log).await;
    binlog::assert_no_ansi(&logs);
    binlog::assert_graceful_stop(status, &logs, "imp-operator stopped");
    assert!(logs.contains("imp-operator starting"), "{logs}");
    h.finish().await;
}

/// imp-operator on the test API server, logging in `format` to `log`; returns it and its HTTP
/// address.
fn start_operator(h: &Harness, log: &std::path::Path, format: &str) -> (Child, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let (out, err) = binlog::log_file(log);
    let child = Command::new(env!("CARGO_BIN_EXE_imp-operator"))
        .env("KUBECONFIG", h.env.kubeconfig_path())
        .env("IMP_HTTP_ADDR", &addr)
        .env("IMP_NAMESPACE", &h.ns)
        .env("IMP_WATCH_NAMESPACE", &h.ns)
        .env("IMP_NODE_SELECTOR", format!("{TEST_NODE_LABEL}={}", h.ns))
        .env("IMP_LOG", "info")
        .env("IMP_LOG_FORMAT", format)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    (child, addr)
}

async fn wait_ready(addr: &str, log: &std::path::Path) {
    let started = Instant::now();
    loop {
        if let Some((200, body)) = get(addr, "/readyz").await {
            assert!(body.ends_with("ready"), "{body}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "operator never became ready; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("operator binary ready after {:?}", started.elapsed());
}

/// `kill -TERM`, then the exit status and the whole log.
async fn stop(child: &mut Child, log: &std::path::Path) -> (std::process::ExitStatus, String) {
    binlog::send_signal(child.id().unwrap(), "TERM");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exit on SIGTERM")
        .unwrap();
    (status, std::fs::read_to_string(log).unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn operator_binary_rejects_a_bad_log_filter() {
    let out = Command::new(env!("CARGO_BIN_EXE_imp-operator"))
        .env("IMP_LOG", "imp=[")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("IMP_LOG"));
}
