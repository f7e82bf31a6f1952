//! pressureLifecycle against the real API server: nodes whose MemoryPressure condition the test sets (Node
//! status writes, as the kubelet would), ImpVMs run by the test playing the agent (it reports Suspending and
//! Suspended the way imp-agent does). The largest resident persistent VM goes first, the next only after the
//! first reports Suspended and only while the pressure lasts; nothing resumes by itself; ephemeral VMs and
//! other nodes are untouched; and the operator binary leaves it all alone unless IMP_PRESSURE_LIFECYCLE=true.

mod vm_common;

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use imp_api::{
    DesiredState, ImpVM, VmPhase,
    names::{ANNOTATION_PRESSURE_SUSPENDED_AT, condition, reason},
};
use imp_operator::{
    index::{Index, IndexConfig},
    metrics::{PressureMetrics, encode},
    pressure::{PressureConfig, run_pressure_lifecycle},
};
use imp_testkit::{
    binlog::{self, get},
    fixtures,
};
use kube::{
    ResourceExt,
    api::{Patch, PatchParams},
};
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::process::{Child, Command};
use vm_common::*;

const WITHIN: Duration = Duration::from_secs(15);
/// How long "nothing more happens" is watched for: several lifecycle passes (resync 300 ms below).
const QUIET: Duration = Duration::from_secs(3);

fn desired(vm: &ImpVM) -> DesiredState {
    vm.spec.desired_state()
}

fn marked(vm: &ImpVM) -> bool {
    vm.annotations()
        .contains_key(ANNOTATION_PRESSURE_SUSPENDED_AT)
}

/// A persistent VM of `class` bound to `node`, booted by the (emulated) agent.
async fn running_vm(h: &Harness, name: &str, class: &str, node: &str, persistent: bool) {
    let mut vm = fixtures::vm(name).class(class).bound(node);
    if persistent {
        vm = vm.persistent();
    }
    h.create_vm(vm).await;
    h.wait_phase(name, VmPhase::Scheduled, WITHIN).await;
    h.agent_run(name).await;
}

async fn set_desired(h: &Harness, name: &str, state: &str) {
    let patch = json!({"spec": {"desiredState": state}});
    h.vms()
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// Asserts that for `QUIET` none of `names` is asked to suspend.
async fn stays_unsuspended(h: &Harness, names: &[&str], why: &str) {
    let started = Instant::now();
    while started.elapsed() < QUIET {
        for name in names {
            let vm = h.vms().get(name).await.unwrap();
            assert_eq!(desired(&vm), DesiredState::Running, "{name}: {why}");
            assert!(!marked(&vm), "{name}: {why}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_suspend_asked(h: &Harness, name: &str) -> ImpVM {
    h.wait_vm(name, "asked to suspend", WITHIN, |vm| {
        desired(vm) == DesiredState::Suspended
            && marked(vm)
            && cond(vm, condition::PRESSURE_SUSPENDED)
                == Some(("True".into(), reason::SUSPENDED_FOR_MEMORY_PRESSURE.into()))
    })
    .await
}

fn start_lifecycle(
    h: &Harness,
    suspend_timeout: Duration,
) -> (tokio::task::JoinHandle<()>, Registry) {
    let index = Index::start(
        h.client.clone(),
        IndexConfig {
            node_selector: Some(format!("{TEST_NODE_LABEL}={}", h.ns)),
            ..IndexConfig::namespace(&h.ns)
        },
    );
    let config = PressureConfig {
        suspend_timeout,
        resync: Duration::from_millis(300),
        ..PressureConfig::new()
    };
    let metrics = PressureMetrics::sharing_reconcile(&h.metrics);
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    (
        tokio::spawn(run_pressure_lifecycle(
            h.client.clone(),
            index,
            config,
            metrics,
        )),
        registry,
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_pressure_suspends_the_largest_first_one_at_a_time_and_never_resumes() {
    let mut h = Harness::start("pressure").await;
    let n1 = h.add_node("n1", 16, 32768).await;
    let n2 = h.add_node("n2", 16, 32768).await;
    let small = h.add_class("small", 1, 512, None).await;
    let mid = h.add_class("mid", 1, 1024, None).await;
    let big = h.add_class("big", 1, 2048, None).await;
    let huge = h.add_class("huge", 1, 4096, None).await;
    running_vm(&h, "small", &small, &n1, true).await;
    running_vm(&h, "big", &big, &n1, true).await;
    running_vm(&h, "mid", &mid, &n1, true).await;
    // The largest on n1, but a one-job VM: never suspended.
    running_vm(&h, "job", &huge, &n1, false).await;
    // Largest of all, on a node without pressure.
    running_vm(&h, "other", &huge, &n2, true).await;
    let (lifecycle, registry) = start_lifecycle(&h, Duration::from_secs(120));

    stays_unsuspended(
        &h,
        &["small", "big", "mid", "job", "other"],
        "no node is under pressure",
    )
    .await;

    h.set_node_condition(&n1, "MemoryPressure", "True").await;
    let first = wait_suspend_asked(&h, "big").await;
    let message = &condition(&first, condition::PRESSURE_SUSPENDED)
        .unwrap()
        .message;
    assert!(
        message.contains(&format!("node {n1} reports MemoryPressure")),
        "{message}"
    );
    assert!(
        message.contains("set spec.desiredState: Running"),
        "{message}"
    );
    let note = h
        .wait_event("big", reason::SUSPENDED_FOR_MEMORY_PRESSURE, WITHIN)
        .await;
    assert!(note.contains("never resumed automatically"), "{note}");
    assert!(note.contains("2048 MiB"), "{note}");

    // One at a time: while "big" is not Suspended, "mid" waits.
    stays_unsuspended(&h, &["mid", "small"], "the first suspend has not completed").await;
    h.agent_status("big", |s| s.phase = Some(VmPhase::Suspending))
        .await;
    stays_unsuspended(&h, &["mid", "small"], "the first VM is still Suspending").await;
    h.agent_status("big", |s| s.phase = Some(VmPhase::Suspended))
        .await;
    wait_suspend_asked(&h, "mid").await;
    stays_unsuspended(&h, &["small"], "the second suspend has not completed").await;

    // The pressure clears before the second suspend completes: no third suspend.
    h.set_node_condition(&n1, "MemoryPressure", "False").await;
    h.agent_status("mid", |s| s.phase = Some(VmPhase::Suspended))
        .await;
    stays_unsuspended(&h, &["small", "job", "other"], "the pressure cleared").await;

    // Nothing was resumed by the lifecycle.
    for name in ["big", "mid"] {
        let vm = h.vms().get(name).await.unwrap();
        assert_eq!(desired(&vm), DesiredState::Suspended, "{name}");
        assert_eq!(phase_of(&vm), Some(VmPhase::Suspended), "{name}");
        assert!(marked(&vm), "{name}");
    }
    let text = encode(&registry).unwrap();
    for line in [
        format!("imp_pressure_suspensions_total{{node=\"{n1}\"}} 2"),
        "imp_pressure_suspended_vms 2".into(),
        "imp_pressure_nodes 0".into(),
    ] {
        assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
    }
    assert!(!text.contains(&format!("node=\"{n2}\"")), "{text}");

    // A person resumes "big": the lifecycle drops its mark and says so in the condition and an Event.
    set_desired(&h, "big", "Running").await;
    let lifted = h
        .wait_vm("big", "lifted", WITHIN, |vm| {
            !marked(vm)
                && cond(vm, condition::PRESSURE_SUSPENDED)
                    == Some(("False".into(), reason::PRESSURE_SUSPEND_LIFTED.into()))
        })
        .await;
    assert_eq!(desired(&lifted), DesiredState::Running);
    h.wait_event("big", reason::PRESSURE_SUSPEND_LIFTED, WITHIN)
        .await;
    h.agent_status("big", |s| s.phase = Some(VmPhase::Running))
        .await;

    // A new episode: "big" (2048), resumed before it began, is again the largest Running persistent VM.
    tokio::time::sleep(Duration::from_millis(1100)).await; // lastTransitionTime has second resolution
    h.set_node_condition(&n1, "MemoryPressure", "True").await;
    wait_suspend_asked(&h, "big").await;
    // Resumed by hand during this episode: left running, and "small" is next once it is not blocking.
    set_desired(&h, "big", "Running").await;
    h.wait_vm("big", "lifted again", WITHIN, |vm| !marked(vm))
        .await;
    h.agent_status("big", |s| s.phase = Some(VmPhase::Running))
        .await;
    wait_suspend_asked(&h, "small").await;
    let big_now = h.vms().get("big").await.unwrap();
    assert_eq!(desired(&big_now), DesiredState::Running);
    assert!(!marked(&big_now));

    for name in ["job", "other"] {
        let vm = h.vms().get(name).await.unwrap();
        assert_eq!(desired(&vm), DesiredState::Running, "{name}");
        assert!(
            condition(&vm, condition::PRESSURE_SUSPENDED).is_none(),
            "{name}"
        );
    }
    lifecycle.abort();
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_suspend_that_never_completes_stops_holding_back_the_next_after_the_timeout() {
    let mut h = Harness::start("pressstall").await;
    let n1 = h.add_node("n1", 8, 16384).await;
    let small = h.add_class("small", 1, 512, None).await;
    let big = h.add_class("big", 1, 2048, None).await;
    running_vm(&h, "big", &big, &n1, true).await;
    running_vm(&h, "small", &small, &n1, true).await;
    let (lifecycle, registry) = start_lifecycle(&h, Duration::from_secs(3));
    h.set_node_condition(&n1, "MemoryPressure", "True").await;
    let asked = Instant::now();
    wait_suspend_asked(&h, "big").await;
    // The agent never reports Suspending or Suspended.
    let note = h
        .wait_event("big", reason::PRESSURE_SUSPEND_STALLED, WITHIN)
        .await;
    assert!(
        asked.elapsed() >= Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    assert!(note.contains("still Running"), "{note}");
    let next = wait_suspend_asked(&h, "small").await;
    let big_now = h.vms().get("big").await.unwrap();
    assert_eq!(desired(&big_now), DesiredState::Suspended);
    assert_eq!(
        cond(&big_now, condition::PRESSURE_SUSPENDED),
        Some(("True".into(), reason::PRESSURE_SUSPEND_STALLED.into()))
    );
    assert!(marked(&next));
    let text = encode(&registry).unwrap();
    assert!(
        text.lines()
            .any(|l| l == "imp_pressure_suspend_stalls_total 1"),
        "{text}"
    );
    lifecycle.abort();
    h.finish().await;
}

// --- The operator binary: off unless IMP_PRESSURE_LIFECYCLE=true ---------------------------------------

/// imp-operator with IMP_PRESSURE_LIFECYCLE as the chart renders it (`None`: unset).
async fn operator(h: &Harness, log: &std::path::Path, pressure: Option<&str>) -> (Child, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let (out, err) = binlog::log_file(log);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_imp-operator"));
    cmd.env("KUBECONFIG", h.env.kubeconfig_path())
        .env("IMP_HTTP_ADDR", &addr)
        .env("IMP_NAMESPACE", &h.ns)
        .env("IMP_WATCH_NAMESPACE", &h.ns)
        .env("IMP_NODE_SELECTOR", format!("{TEST_NODE_LABEL}={}", h.ns))
        .env("IMP_LOG", "info")
        .env_remove("IMP_PRESSURE_LIFECYCLE")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true);
    if let Some(v) = pressure {
        cmd.env("IMP_PRESSURE_LIFECYCLE", v);
    }
    let child = cmd.spawn().unwrap();
    let started = Instant::now();
    loop {
        if let Some((200, _)) = get(&addr, "/readyz").await {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "operator never became ready; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (child, addr)
}

async fn stop(child: &mut Child) {
    binlog::send_signal(child.id().unwrap(), "TERM");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exit on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operator_binary_suspends_only_when_enabled() {
    let mut h = Harness::without_controller("pressbin").await;
    let dir = tempfile::tempdir().unwrap();
    let n1 = h.add_node("n1", 8, 16384).await;
    let class = h.add_class("c", 1, 1024, None).await;
    h.set_node_condition(&n1, "MemoryPressure", "True").await;

    for (i, setting) in [None, Some("false")].into_iter().enumerate() {
        let log = dir.path().join(format!("off-{i}.log"));
        let (mut child, addr) = operator(&h, &log, setting).await;
        if i == 0 {
            h.create_vm(fixtures::vm("svc").class(&class).bound(&n1).persistent())
                .await;
            h.wait_phase("svc", VmPhase::Scheduled, WITHIN).await;
            h.agent_run("svc").await;
        }
        stays_unsuspended(&h, &["svc"], "the lifecycle is off by default").await;
        let (_, metrics) = get(&addr, "/metrics").await.unwrap();
        assert!(!metrics.contains("imp_pressure_"), "{metrics}");
        stop(&mut child).await;
        let logs = std::fs::read_to_string(&log).unwrap();
        assert!(logs.contains("pressureLifecycle disabled"), "{logs}");
    }

    let log = dir.path().join("on.log");
    let (mut child, addr) = operator(&h, &log, Some("true")).await;
    wait_suspend_asked(&h, "svc").await;
    h.wait_event("svc", reason::SUSPENDED_FOR_MEMORY_PRESSURE, WITHIN)
        .await;
    let (_, metrics) = get(&addr, "/metrics").await.unwrap();
    assert!(
        metrics.contains(&format!(
            "imp_pressure_suspensions_total{{node=\"{n1}\"}} 1"
        )),
        "{metrics}"
    );
    stop(&mut child).await;
    h.finish().await;
}
