//! The runner handoff on a real guest: the real `imp-agent` against a real kube-apiserver
//! (testkit TestEnv), the real `imp-runtime` with its QEMU backend (TCG, Debian's kernel, Imp's
//! initrd, one vhost-device-vsock per VM) booting a root filesystem built from an image in a
//! local registry. JIT Secret -> Exec of the runner inside the guest (a script that checks the
//! config arrived in its environment and that it runs as uid 1001, not root) -> `Started` recorded -> Secret deleted -> exit 0 ->
//! `Succeeded`; deletion -> TornDown and no process left (issue 15: "the same handoff test also
//! runs on a real guest").
//!
//! Runs when the QEMU path can (imp_testkit::qemu): otherwise it says what it skipped, or fails
//! under IMP_REQUIRE_QEMU=1. guest/vm-test.sh runs it.

mod common;

use std::time::{Duration, Instant};

use common::Harness;
use common::agent::{Agent, tail};
use imp_api::names::{self, condition, reason};
use imp_api::{HandoffState, ImpVM, ImpVMClass, ImpVMRunnerPool, VmPhase, conditions};
use imp_testkit::oci::push_gzip_image;
use imp_testkit::qemu;
use imp_testkit::registry::{Registry, RegistryOptions};
use imp_testkit::{TestEnv, fixtures, waits};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

const JIT: &str = "eyJqaXQiOiJxZW11LWd1ZXN0In0=-JITSECRET-q3mu";
const RUNNER: &str = "/opt/actions-runner/run.sh";

/// A base with a static busybox as /bin/sh and the runner stand-in: exit 0 only when its JIT
/// config arrived intact in its environment (99), nothing of it in its argv (98), and it runs as
/// uid 1001 and gid 1001 (97), the pool's default runner user, asked for in the guest itself.
fn layers() -> Vec<Vec<u8>> {
    let script = format!(
        "#!/bin/sh\n[ \"$ACTIONS_RUNNER_INPUT_JITCONFIG\" = '{JIT}' ] || exit 99\n[ $# -eq 0 ] || exit 98\n\
         [ \"$(/bin/busybox id -u):$(/bin/busybox id -g)\" = 1001:1001 ] || exit 97\nexit 0\n"
    );
    vec![
        common::busybox_layer()
            .dir("opt", 0o755)
            .dir("opt/actions-runner", 0o755)
            .file("opt/actions-runner/run.sh", script.as_bytes(), 0o755)
            .into_gzip(),
    ]
}

async fn wait_vm(
    vms: &Api<ImpVM>,
    name: &str,
    what: &str,
    within: Duration,
    agent: &Agent,
    rt: &Harness,
    pred: impl Fn(&ImpVM) -> bool,
) -> ImpVM {
    let started = Instant::now();
    let vm = waits::wait_vm(vms, name, what, within, pred, || {
        format!(
            "\nagent log tail:\n{}\nruntime log tail:\n{}",
            tail(&agent.log(), 40),
            tail(&rt.runtime_log(), 30)
        )
    })
    .await;
    // A real guest's timings, for the log.
    eprintln!("{name}: {what} after {:?}", started.elapsed());
    vm
}

fn handoff(vm: &ImpVM) -> Option<HandoffState> {
    vm.status
        .as_ref()
        .and_then(|s| s.runner.as_ref())
        .and_then(|r| r.handoff)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_handoff_on_a_real_qemu_guest() {
    let Some(s) = qemu::setup_or_skip() else {
        return;
    };
    let images = tempfile::tempdir().unwrap();
    let initrd = images.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);
    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let base = push_gzip_image(&registry.host(), "imp/runner-base:agent-qemu", layers()).await;
    let mut rt = Harness::qemu(&s, &initrd, registry.host());
    rt.start_runtime().await;

    let env = TestEnv::new("agent-qemu").await;
    let node = format!("{}-node", env.namespace);
    let class = format!("{}-qemu", env.namespace);
    Api::<ImpVMClass>::all(env.client.clone())
        .create(
            &PostParams::default(),
            &fixtures::class(&class)
                .vcpu(1)
                .memory_mib(512)
                .disk_gib(1)
                .build(),
        )
        .await
        .unwrap();
    let pools: Api<ImpVMRunnerPool> = env.api();
    let pool = pools
        .create(
            &PostParams::default(),
            &fixtures::pool("pool").class(&class).image(&base).build(),
        )
        .await
        .unwrap();
    let vms: Api<ImpVM> = env.api();
    let vm = vms
        .create(
            &PostParams::default(),
            &fixtures::vm("runner-q")
                .runner_of(&pool)
                .class(&class)
                .image(&base)
                .bound(&node)
                .finalizer(names::FINALIZER_VM_CLEANUP)
                .runner_config("jit-q")
                .build(),
        )
        .await
        .unwrap();
    let secrets: Api<Secret> = env.api();
    let secret = fixtures::jit_secret_for(&vm, "jit-q", JIT, 42, "imp-qemu-runner");
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    vms.patch_status(
        "runner-q",
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": {"phase": VmPhase::Scheduled}})),
    )
    .await
    .unwrap();

    let agent = Agent::start(&env, &rt, &node, 1, &[("IMP_RUNNER_COMMAND", RUNNER)]);

    // TCG boots take a while; the runtime's boot timeout is 240 s.
    let started = wait_vm(
        &vms,
        "runner-q",
        "handoff Started",
        Duration::from_secs(300),
        &agent,
        &rt,
        |vm| {
            matches!(
                handoff(vm),
                Some(HandoffState::Started | HandoffState::Exited)
            )
        },
    )
    .await;
    let r = started.status.as_ref().unwrap().runner.clone().unwrap();
    assert!(r.pid.is_some() && r.started_time.is_some(), "{r:?}");
    assert_eq!(
        r.exec_id,
        Some(format!("impvm-{}-runner", vm.uid().unwrap()))
    );
    let done = wait_vm(
        &vms,
        "runner-q",
        "Succeeded",
        Duration::from_secs(120),
        &agent,
        &rt,
        |vm| {
            matches!(
                vm.status.as_ref().and_then(|s| s.phase),
                Some(VmPhase::Succeeded | VmPhase::Failed)
            )
        },
    )
    .await;
    let s = done.status.clone().unwrap();
    assert_eq!(
        s.phase,
        Some(VmPhase::Succeeded),
        "the runner in the guest exited non-zero (99: config missing or altered, 98: argv, 97: not uid 1001): {s:#?}"
    );
    let r = s.runner.unwrap();
    assert_eq!(
        (r.handoff, r.exit_code),
        (Some(HandoffState::Exited), Some(0))
    );
    assert!(
        secrets.get_opt("jit-q").await.unwrap().is_none(),
        "the JIT Secret was not deleted"
    );
    let agent_log = agent.log();
    assert!(
        !agent_log.contains("JITSECRET"),
        "the JIT config reached the agent's log"
    );
    assert!(!serde_json::to_string(&done).unwrap().contains("JITSECRET"));

    // Deletion as the operator does it: Terminating, the agent records TornDown.
    vms.delete("runner-q", &DeleteParams::default())
        .await
        .unwrap();
    vms.patch_status(
        "runner-q",
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": {"phase": VmPhase::Terminating}})),
    )
    .await
    .unwrap();
    wait_vm(
        &vms,
        "runner-q",
        reason::TORN_DOWN,
        Duration::from_secs(60),
        &agent,
        &rt,
        |vm| {
            vm.status
                .as_ref()
                .and_then(|s| conditions::find(&s.conditions, condition::TORN_DOWN))
                .is_some_and(|c| c.status == "True" && c.reason == reason::TEARDOWN_COMPLETE)
        },
    )
    .await;
    vms.patch(
        "runner-q",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert!(rt.client.inspect(&vm.uid().unwrap()).await.is_err());
    let started = Instant::now();
    while !rt.vmm_processes().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "QEMU or vhost-device-vsock left: {:?}",
            rt.vmm_processes()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(agent);
    let _ = pools.delete("pool", &DeleteParams::default()).await;
    let _ = Api::<ImpVMClass>::all(env.client.clone())
        .delete(&class, &DeleteParams::default())
        .await;
}
