//! Kubernetes Nodes standing in for Imp nodes where no agent runs (the operator's pool tests and
//! benches): a Ready, untainted Node labelled for Imp and for its test, and the heartbeat Lease its
//! agent would hold and renew.

use std::time::Duration;

use imp_api::names::{LABEL_NODE_ENABLED, lease_name};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;

/// Creates Node `name` labelled `imp/enabled` and `label` (key, value), lifts the not-ready taint
/// the API server puts on new nodes (nothing else would) and reports it Ready with room to spare.
pub async fn ready_node(
    nodes: &Api<Node>,
    name: &str,
    label: (&str, &str),
) -> Result<(), kube::Error> {
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {LABEL_NODE_ENABLED: "true", label.0: label.1}},
    }))
    .expect("a Node");
    nodes.create(&PostParams::default(), &node).await?;
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": []}})),
        )
        .await?;
    let now = Timestamp::now().to_string();
    let cond = |t: &str, s: &str| {
        json!({"type": t, "status": s, "reason": "FakeNode", "message": "a test's stand-in node",
        "lastHeartbeatTime": now, "lastTransitionTime": now})
    };
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "allocatable": {"cpu": "64", "memory": "256Gi"},
                "capacity": {"cpu": "64", "memory": "256Gi"},
                "conditions": [cond("Ready", "True"), cond("MemoryPressure", "False"),
                               cond("DiskPressure", "False"), cond("PIDPressure", "False")],
            }})),
        )
        .await?;
    Ok(())
}

/// Creates node `node`'s heartbeat Lease (40 s), renewed now, as its agent would.
pub async fn heartbeat_lease(leases: &Api<Lease>, node: &str) -> Result<(), kube::Error> {
    let lease = Lease {
        metadata: kube::api::ObjectMeta {
            name: Some(lease_name(node)),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.to_owned()),
            lease_duration_seconds: Some(40),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..Default::default()
        }),
    };
    leases.create(&PostParams::default(), &lease).await?;
    Ok(())
}

/// Renews the heartbeat Leases of `nodes` every 5 s, as their agents would; runs until dropped.
pub async fn renew_leases(leases: Api<Lease>, nodes: Vec<String>) {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        for n in &nodes {
            let patch = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
            let _ = leases
                .patch(
                    &lease_name(n),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await;
        }
    }
}
