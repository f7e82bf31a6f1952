//! The scale-set intake against the simulator and the real API server: a pool with
//! `spec.github.scaleSet` and no working webhooks serves every job through the scale set, each by
//! one runner minted through `generatejitconfig`; a message whose ack is lost is redelivered and an
//! operator stopped between the ledger write and the ack neither binds a job twice nor loses one,
//! and waits out the old session (409) with backoff instead of crash-looping.

mod pool_common;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use imp_operator::runnerpool::PoolKey;
use imp_operator::scaleset::{Ledger, LedgerState, intake::ledger_name};
use imp_testkit::github::{JobSpec, JobStatus, SimJob, WebhookFault};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{Patch, PatchParams};
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(90);
const SET: &str = "imp-set";

/// A pool serving scale set [`SET`], webhooks all lost (the intake must do without them).
async fn scale_set_pool(h: &PoolHarness, name: &str, max_runners: u32) {
    h.sim
        .set_scale_set_timing(Duration::from_secs(10), Duration::from_secs(1));
    h.sim.inject_webhook_fault(WebhookFault::Drop, 100_000);
    h.create_pool(name, json!({ "maxRunners": max_runners }))
        .await;
    let patch = json!({"spec": {"github": {"scaleSet": {"name": SET}}}});
    h.pools()
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    h.wait("the scale set and its session", WAIT, || async {
        h.sim
            .scale_sets()
            .iter()
            .any(|s| s.name == SET && s.session.is_some())
            .then_some(())
    })
    .await;
}

fn set_job() -> JobSpec {
    JobSpec {
        labels: vec![SET.into()],
        ..Default::default()
    }
}

async fn ledger(h: &PoolHarness, pool: &str) -> Ledger {
    let api: Api<ConfigMap> = h.env.api();
    match api.get_opt(&ledger_name(pool)).await.unwrap() {
        Some(cm) => Ledger::from_data(&cm.data.unwrap_or_default()).unwrap(),
        None => Ledger::default(),
    }
}

async fn all_completed(h: &PoolHarness, ids: &[u64]) -> Vec<SimJob> {
    h.wait("every job completed", Duration::from_secs(180), || async {
        let jobs: Vec<SimJob> = ids.iter().filter_map(|id| h.sim.job(*id)).collect();
        (jobs.len() == ids.len() && jobs.iter().all(|j| j.status == JobStatus::Completed))
            .then_some(jobs)
    })
    .await
}

/// Every job ran on a runner of its own, and the scale set acquired each exactly once.
fn assert_bound_once(h: &PoolHarness, jobs: &[SimJob]) {
    let runners: HashSet<&str> = jobs
        .iter()
        .map(|j| j.runner_name.as_deref().expect("a runner ran it"))
        .collect();
    assert_eq!(runners.len(), jobs.len(), "one runner per job: {jobs:?}");
    assert!(
        jobs.iter()
            .all(|j| j.conclusion.as_deref() == Some("success"))
    );
    let set_jobs = h.sim.scale_set_jobs();
    assert_eq!(set_jobs.len(), jobs.len());
    assert!(
        set_jobs.iter().all(|j| matches!(
            j.state,
            imp_testkit::github::scaleset::ScaleSetJobState::Completed { .. }
        )),
        "{set_jobs:?}"
    );
    let stats = h.sim.scale_set_stats();
    assert_eq!(stats.jobs_acquired, jobs.len() as u64, "{stats:?}");
}

fn assert_no_credentials_in_logs(h: &PoolHarness) {
    let logs = captured_logs();
    for secret in h.sim.scale_set_credentials() {
        assert!(
            !logs.contains(&secret),
            "a scale-set credential reached the log"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn jobs_routed_to_the_scale_set_are_served_one_runner_each() {
    let mut h = PoolHarness::start("pool-scaleset").await;
    scale_set_pool(&h, "sets", 3).await;
    h.start_agent(true, Duration::from_millis(200));
    let ids: Vec<u64> = (0..8).map(|_| h.sim.queue_job(set_job()).id).collect();
    let jobs = all_completed(&h, &ids).await;
    assert_bound_once(&h, &jobs);
    // Minted through the scale set: one JIT config per job, no more.
    let stats = h.sim.scale_set_stats();
    assert_eq!(stats.jit_configs, ids.len() as u64, "{stats:?}");
    // The capacity GitHub was told is the pool's maxRunners (no Imp node publishes capacity here).
    let set = h
        .sim
        .scale_sets()
        .into_iter()
        .find(|s| s.name == SET)
        .unwrap();
    assert_eq!(set.last_max_capacity, Some(3));
    // The ledger saw every job through to Completed, bound to the runner that ran it.
    let key = PoolKey::new(h.ns.clone(), "sets");
    h.wait("the ledger to record every completion", WAIT, || async {
        let l = ledger(&h, "sets").await;
        (l.entries.len() == ids.len()
            && l.entries
                .values()
                .all(|e| e.state == LedgerState::Completed))
        .then_some(())
    })
    .await;
    let l = ledger(&h, "sets").await;
    let by_job: BTreeMap<String, String> = l
        .entries
        .values()
        .map(|e| (e.job_id.clone(), e.runner_name.clone().unwrap_or_default()))
        .collect();
    for j in &jobs {
        assert_eq!(by_job.get(&j.id.to_string()), j.runner_name.as_ref());
    }
    assert_eq!(
        h.shared.scale_sets.health(&key).map(|x| x.reason),
        Some("Listening")
    );
    assert_eq!(h.sim.scale_set_stats().sessions_created, 1);
    assert_no_credentials_in_logs(&h);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_ack_and_a_restart_between_ledger_write_and_ack_bind_each_job_once() {
    let mut h = PoolHarness::start("pool-scaleset-ack").await;
    scale_set_pool(&h, "acks", 5).await;
    // Every ack fails from now on: the intake writes the ledger, fails to delete the message and
    // gets the same message again and again (the later jobs wait behind it, as at GitHub).
    h.sim.fail_scale_set_acks(u32::MAX);
    let ids: Vec<u64> = (0..5).map(|_| h.sim.queue_job(set_job()).id).collect();
    h.wait(
        "a job acquired in the ledger and its message redelivered",
        WAIT,
        || async {
            let l = ledger(&h, "acks").await;
            let acquired = l
                .entries
                .values()
                .filter(|e| e.state == LedgerState::Acquired)
                .count();
            (acquired >= 1 && h.sim.scale_set_stats().redeliveries >= 2).then_some(acquired)
        },
    )
    .await;
    // The redeliveries acquired nothing twice.
    let stats = h.sim.scale_set_stats();
    let in_ledger = ledger(&h, "acks").await.entries.len() as u64;
    assert_eq!(stats.jobs_acquired, in_ledger, "{stats:?}");
    // Killed between the ledger write and the ack: the session is not deleted (as after kill -9).
    h.stop_operator().await;
    h.sim.fail_scale_set_acks(0);
    h.restart_operator().await;
    h.start_agent(true, Duration::from_millis(200));
    let jobs = all_completed(&h, &ids).await;
    // The successor takes the session over once the old one expired, and records the rest.
    h.wait("the ledger to record every completion", WAIT, || async {
        let l = ledger(&h, "acks").await;
        (l.entries.len() == ids.len()
            && l.entries
                .values()
                .all(|e| e.state == LedgerState::Completed))
        .then_some(())
    })
    .await;
    assert_bound_once(&h, &jobs);
    let stats = h.sim.scale_set_stats();
    assert_eq!(
        stats.jit_configs,
        ids.len() as u64,
        "one VM per job: {stats:?}"
    );
    // One session per operator lifetime: the successor waited out the old one, and every new
    // session followed the expiry of the one before (on a stalled machine a live holder's session
    // can expire too; it then opens one more, never a loop of them).
    assert!(stats.sessions_expired >= 1, "{stats:?}");
    assert_eq!(
        stats.sessions_created,
        1 + stats.sessions_expired,
        "{stats:?}"
    );
    assert!(stats.session_conflicts >= 1, "{stats:?}");
    assert!(
        stats.session_conflicts <= 5,
        "backoff, not a tight loop: {stats:?}"
    );
    let events = h.events("acks").await;
    assert!(
        events
            .iter()
            .any(|(reason, _)| reason == "ScaleSetSessionConflict"),
        "{events:?}"
    );
    assert_no_credentials_in_logs(&h);
}

/// A Ready, schedulable Imp node publishing `vcpu`/`memory_mib` for VMs, labelled for this test.
async fn cap_node(h: &PoolHarness, name: &str, vcpu: u32, memory_mib: u32) {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::PostParams;
    let nodes: Api<Node> = Api::all(h.client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name,
            "labels": {"imp/enabled": "true", "imp-cap-test": h.ns},
            "annotations": {"imp.dev/capacity-vcpu": vcpu.to_string(),
                            "imp.dev/capacity-memory-mib": memory_mib.to_string()}},
    }))
    .unwrap();
    let created = nodes.create(&PostParams::default(), &node).await.unwrap();
    // The API server taints new nodes not-ready; nothing here lifts it but the test.
    let taints: Vec<_> = created
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.key != "node.kubernetes.io/not-ready")
        .collect();
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"taints": taints}})),
        )
        .await
        .unwrap();
    let status = json!({"status": {"conditions": [{"type": "Ready", "status": "True",
        "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z",
        "reason": "KubeletReady", "message": "test"}]}});
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_capacity_github_is_told_is_what_the_nodes_can_host() {
    use imp_api::ImpVMClass;
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{DeleteParams, PostParams};
    let h = PoolHarness::start("pool-scaleset-cap").await;
    let class_name = format!("{}-cap", h.ns);
    let classes: Api<ImpVMClass> = Api::all(h.client.clone());
    let class: ImpVMClass = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
        "metadata": {"name": class_name},
        "spec": {"vcpu": 2, "memoryMiB": 2048},
    }))
    .unwrap();
    classes
        .create(&PostParams::default(), &class)
        .await
        .unwrap();
    let names = [format!("{}-n1", h.ns), format!("{}-n2", h.ns)];
    // 8 vCPU / 8 GiB each: 4 VMs of 2 vCPU / 2 GiB per node, 8 in all.
    for n in &names {
        cap_node(&h, n, 8, 8192).await;
    }
    h.sim
        .set_scale_set_timing(Duration::from_secs(10), Duration::from_secs(1));
    h.create_pool("cap", json!({ "maxRunners": 20 })).await;
    let patch = json!({"spec": {
        "github": {"scaleSet": {"name": SET}},
        "template": {"spec": {"classRef": {"name": class_name},
                              "nodeSelector": {"imp-cap-test": h.ns}}}}});
    h.pools()
        .patch("cap", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let told = |want: u32| {
        let h = &h;
        async move {
            h.sim
                .scale_sets()
                .iter()
                .any(|s| s.name == SET && s.last_max_capacity == Some(want))
                .then_some(())
        }
    };
    h.wait("X-ScaleSetMaxCapacity = the nodes' 8 slots", WAIT, || {
        told(8)
    })
    .await;
    // One node cordoned: 4 (recomputed within 30 s, told on the next poll).
    let nodes: Api<Node> = Api::all(h.client.clone());
    nodes
        .patch(
            &names[0],
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"unschedulable": true}})),
        )
        .await
        .unwrap();
    h.wait("X-ScaleSetMaxCapacity = 4 after a cordon", WAIT, || told(4))
        .await;
    // maxRunners below the nodes' room wins.
    h.patch_scaling("cap", json!({"maxRunners": 3})).await;
    h.wait("X-ScaleSetMaxCapacity = maxRunners 3", WAIT, || told(3))
        .await;
    for n in &names {
        let _ = nodes.delete(n, &DeleteParams::default()).await;
    }
    let _ = classes.delete(&class_name, &DeleteParams::default()).await;
}
