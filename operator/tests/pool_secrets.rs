//! JIT Secrets: owned by their VM and collected with it by kube-controller-manager's garbage collector; a
//! failed mint deletes its VM; no JIT config ever reaches logs, Events, status or the VM object.

mod pool_common;

use std::time::Duration;

use imp_api::names::{
    ANNOTATION_BOOT_DIGEST, ANNOTATION_RUNNER_ID, ANNOTATION_RUNNER_NAME, LABEL_RUNNER_POOL,
    LABEL_SECRET_KIND, SECRET_KEY_JITCONFIG, SECRET_KIND_JIT, condition, jit_secret_name, reason,
};
use imp_testkit::github::{
    Fault, FaultRule, JobStatus,
    runner_protocol::{FakeRunnerOptions, JitConfigPayload, run_fake_runner},
};
use k8s_openapi::api::core::v1::Secret;
use kube::{ResourceExt, api::ListParams};
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn the_jit_secret_is_owned_by_its_vm_and_collected_with_it() {
    let h = PoolHarness::start("pool-owner").await;
    h.create_pool("own", json!({"minIdle": 1, "maxRunners": 2}))
        .await;
    let vm = h.wait_minted("own", 1, WAIT).await.remove(0);
    let uid = vm.uid().unwrap();
    let name = jit_secret_name(&uid);
    assert_eq!(vm.spec.runner_config_secret.as_deref(), Some(name.as_str()));
    assert_eq!(vm.spec.lifecycle, imp_api::Lifecycle::Ephemeral);
    assert_eq!(vm.labels()[LABEL_RUNNER_POOL], "own");
    assert!(vm.metadata.generate_name.as_deref() == Some("own-"));
    let pool_owner = &vm.owner_references()[0];
    assert_eq!(
        (pool_owner.kind.as_str(), pool_owner.controller),
        ("ImpVMRunnerPool", Some(true))
    );

    let secret: Secret = h.secrets().get(&name).await.unwrap();
    let owners = secret.owner_references();
    assert_eq!(owners.len(), 1);
    assert_eq!(
        (owners[0].kind.as_str(), owners[0].uid.as_str()),
        ("ImpVM", uid.as_str())
    );
    assert_eq!(owners[0].controller, Some(true));
    assert_eq!(secret.labels()[LABEL_SECRET_KIND], SECRET_KIND_JIT);
    let config =
        String::from_utf8(secret.data.clone().unwrap()[SECRET_KEY_JITCONFIG].0.clone()).unwrap();
    let payload = JitConfigPayload::decode(&config).unwrap();
    let ann = secret.annotations();
    assert_eq!(ann[ANNOTATION_RUNNER_ID], payload.runner_id.to_string());
    assert_eq!(ann[ANNOTATION_RUNNER_NAME], payload.runner_name);
    // What the config was minted for (issue 30): the agent compares it with the VM it boots.
    assert_eq!(
        ann[ANNOTATION_BOOT_DIGEST],
        imp_api::frozen::boot_digest(&vm.spec)
    );
    assert_eq!(
        vm.annotations()[ANNOTATION_RUNNER_ID],
        payload.runner_id.to_string()
    );
    let sim_runner = h
        .sim
        .runners()
        .into_iter()
        .find(|r| r.id == payload.runner_id)
        .unwrap();
    assert_eq!(sim_runner.name, payload.runner_name);

    // Once registered and idle, scaling to zero retires the runner; the garbage collector takes the
    // Secret with the VM. (The agent would have deleted the Secret after the handoff; here it did not.)
    h.agent_started(&vm).await;
    h.patch_scaling("own", json!({"minIdle": 0, "maxRunners": 2}))
        .await;
    h.wait(
        "the Secret to be collected",
        Duration::from_secs(60),
        || async {
            h.secrets()
                .get_opt(&name)
                .await
                .unwrap()
                .is_none()
                .then_some(())
        },
    )
    .await;
    assert!(h.vms().get_opt(&vm.name_any()).await.unwrap().is_none());
    assert!(h.sim.runners().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_mint_deletes_its_vm_and_backs_off() {
    let h = PoolHarness::start("pool-mint").await;
    // Every generate-jitconfig fails (500, after the client's own retries) until cleared.
    h.sim.inject(
        FaultRule::next(10_000, Fault::ServerError { status: 500 }).on_path("generate-jitconfig"),
    );
    h.create_pool("mint", json!({"minIdle": 1, "maxRunners": 2}))
        .await;
    let note = h
        .wait("a MintFailed event", WAIT, || async {
            h.events("mint")
                .await
                .into_iter()
                .find(|(r, _)| r == reason::MINT_FAILED)
                .map(|(_, n)| n)
        })
        .await;
    assert!(note.contains("server_error"), "{note}");
    let failed_vm = note
        .split_whitespace()
        .skip_while(|w| *w != "VM")
        .nth(1)
        .unwrap()
        .to_owned();
    h.wait("the failed VM to go", WAIT, || async {
        h.vms()
            .get_opt(&failed_vm)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert!(h.metric("imp_runner_jit_mint_errors_total{reason=\"server_error\"}") >= 1.0);
    let s = h
        .wait("ScalingLimited by the backoff", WAIT, || async {
            let s = h.pool_status("mint").await;
            imp_api::conditions::find(&s.conditions, condition::SCALING_LIMITED)
                .is_some_and(|c| c.reason == reason::MINT_BACKOFF)
                .then_some(s)
        })
        .await;
    assert_eq!(s.desired, 1);
    // No VM ever kept without a config.
    for vm in h.runner_vms("mint").await {
        assert!(
            vm.spec.runner_config_secret.is_none()
                || h.secrets()
                    .get_opt(vm.spec.runner_config_secret.as_deref().unwrap())
                    .await
                    .unwrap()
                    .is_some()
        );
    }
    assert!(h.sim.runners().is_empty());

    h.sim.clear_faults();
    h.wait_minted("mint", 1, WAIT).await;
    // The status is written at the end of the pass that minted: it may lag the VM by a moment.
    h.wait("pool status counting the minted VM", WAIT, || async {
        (h.pool_status("mint").await.total == 1).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn no_jit_config_reaches_logs_events_status_or_vms() {
    let h = PoolHarness::start("pool-leak").await;
    h.create_pool("leak", json!({"minIdle": 2, "maxRunners": 3}))
        .await;
    let vms = h.wait_minted("leak", 2, WAIT).await;
    let mut configs = Vec::new();
    for vm in &vms {
        let s: Secret = h
            .secrets()
            .get(vm.spec.runner_config_secret.as_deref().unwrap())
            .await
            .unwrap();
        let c = String::from_utf8(s.data.unwrap()[SECRET_KEY_JITCONFIG].0.clone()).unwrap();
        let credential = JitConfigPayload::decode(&c).unwrap().credential;
        configs.push(c);
        configs.push(credential);
    }
    // One runner runs a job through its whole life, so the webhook and cleanup paths log too.
    h.agent_started(&vms[0]).await;
    let job = h.sim.queue_job(job());
    run_fake_runner(&configs[0], &FakeRunnerOptions::default())
        .await
        .unwrap();
    h.agent_exited(&vms[0].name_any()).await;
    assert_eq!(h.sim.job(job.id).unwrap().status, JobStatus::Completed);
    h.wait("the finished VM to be replaced", WAIT, || async {
        let v = h.runner_vms("leak").await;
        (v.len() == 2 && v.iter().all(|x| x.name_any() != vms[0].name_any())).then_some(())
    })
    .await;

    let logs = captured_logs();
    assert!(
        logs.contains("minted JIT runner config"),
        "log capture works"
    );
    assert!(logs.contains("runner VM deleted"), "cleanup path logged");
    let events = format!("{:?}", h.events("leak").await);
    let status = serde_json::to_string(&h.pool_status("leak").await).unwrap();
    let vm_objects =
        serde_json::to_string(&h.vms().list(&ListParams::default()).await.unwrap().items).unwrap();
    for secret in &configs {
        assert!(
            !logs.contains(secret.as_str()),
            "a JIT config leaked into the logs"
        );
        assert!(
            !events.contains(secret.as_str()),
            "a JIT config leaked into Events"
        );
        assert!(
            !status.contains(secret.as_str()),
            "a JIT config leaked into status"
        );
        assert!(
            !vm_objects.contains(secret.as_str()),
            "a JIT config leaked into an ImpVM"
        );
    }
}
