//! Start-up and shutdown of the node binaries, as Kubernetes runs them: stdout and stderr to a
//! file, `IMP_LOG_FORMAT` text (no ANSI escapes in the file) or json (one object per line), and a
//! signal (SIGTERM, what the kubelet sends, or SIGINT) stopping each gracefully with exit 0.
//! imp-runtime runs on a temp state dir with the Firecracker simulator; imp-agent against the
//! testkit control plane and that runtime.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{Harness, simulator};
use imp_testkit::TestEnv;
use imp_testkit::binlog;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

/// A runtime logging in `format`; "runtime.sock" and its state dir under the harness's temp dir.
async fn runtime(format: &str) -> Harness {
    let mut rt = Harness::new(simulator());
    rt.extra_env = vec![("IMP_LOG_FORMAT".into(), format.into())];
    rt.start_runtime().await;
    rt
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_logs_plain_text_to_a_file_and_stops_on_sigterm() {
    let mut rt = runtime("text").await;
    let status = rt.signal_runtime("TERM");
    let log = rt.runtime_log();
    binlog::assert_no_ansi(&log);
    binlog::assert_graceful_stop(status, &log, "imp-runtime stopped");
    assert!(log.contains("imp-runtime serving"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_logs_json_lines_and_stops_on_sigint() {
    let mut rt = runtime("json").await;
    let status = rt.signal_runtime("INT");
    let log = rt.runtime_log();
    let lines = binlog::assert_json_lines(&log);
    binlog::assert_graceful_stop(status, &log, "imp-runtime stopped");
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "imp-runtime serving"),
        "{log}"
    );
}

#[test]
fn runtime_rejects_a_duration_that_is_not_a_kubernetes_duration() {
    for (value, wanted) in [("30", "missing unit"), ("0s", "greater than zero")] {
        let out = Command::new(env!("CARGO_BIN_EXE_imp-runtime"))
            .args(["--kernel", "/nonexistent", "--boot-timeout", value])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{value}: {err}");
        assert!(
            err.contains("--boot-timeout") && err.contains(wanted),
            "{value}: {err}"
        );
    }
}

#[test]
fn runtime_refuses_firecracker_without_its_jailer() {
    let out = Command::new(env!("CARGO_BIN_EXE_imp-runtime"))
        .args(["--kernel", "/nonexistent", "--backend", "firecracker"])
        .env_remove("IMP_JAILER_PATH")
        .env_remove("IMP_UNJAILED_FIRECRACKER")
        .env_remove("IMP_NO_CONFINE")
        .env_remove("IMP_VMM_BACKEND")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--jailer-path"), "names the flag: {err}");
}

/// imp-agent on `node`, logging in `format` to `log`; killed on drop.
struct Agent(Option<Child>);

impl Agent {
    fn start(env: &TestEnv, rt: &Harness, node: &str, format: &str, log: &Path) -> Agent {
        let (out, err) = binlog::log_file(log);
        let child = common::agent_command(env, rt, node)
            .env("IMP_HTTP_ADDR", "127.0.0.1:0")
            .env("IMP_LOG", "info")
            .env("IMP_LOG_FORMAT", format)
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap();
        Agent(Some(child))
    }

    /// `kill -<signal>`, then the exit status.
    fn signal(&mut self, signal: &str) -> std::process::ExitStatus {
        let mut child = self.0.take().expect("agent running");
        binlog::send_signal(child.id(), signal);
        binlog::wait_exit(&mut child, Duration::from_secs(20))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts an agent and waits for its first heartbeat (it is then connected and running); stops it
/// with `signal` and returns the exit status and log.
async fn agent_run(prefix: &str, format: &str, signal: &str) -> (std::process::ExitStatus, String) {
    let rt = runtime("text").await;
    let env = TestEnv::new(prefix).await;
    let node = format!("{}-node", env.namespace);
    let log: PathBuf = rt.dir.path().join("agent.log");
    let mut agent = Agent::start(&env, &rt, &node, format, &log);
    let leases: Api<Lease> = env.api();
    let deadline = Instant::now() + Duration::from_secs(30);
    while leases
        .get_opt(&format!("imp-node-{node}"))
        .await
        .unwrap()
        .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "no heartbeat Lease; agent log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = agent.signal(signal);
    (status, std::fs::read_to_string(&log).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_logs_plain_text_to_a_file_and_stops_on_sigterm() {
    let (status, log) = agent_run("bin-agent-text", "text", "TERM").await;
    binlog::assert_no_ansi(&log);
    binlog::assert_graceful_stop(status, &log, "imp-agent stopped");
    assert!(log.contains("imp-agent starting"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_logs_json_lines_and_stops_on_sigint() {
    let (status, log) = agent_run("bin-agent-json", "json", "INT").await;
    let lines = binlog::assert_json_lines(&log);
    binlog::assert_graceful_stop(status, &log, "imp-agent stopped");
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "imp-agent starting"),
        "{log}"
    );
}
