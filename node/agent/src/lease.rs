//! The heartbeat Lease `imp-node-<node>` in the operator's namespace (docs/vm-lifecycle.md rule 5):
//! created if missing, `spec.renewTime` renewed every heartbeat interval, but only while
//! imp-runtime answers: a node whose runtime is down cannot run VMs, so its heartbeat goes stale
//! and the operator stops scheduling onto it and, past its finalizer timeout, releases the VMs
//! deleted meanwhile (docs/agent.md "Node truth"). The same loop publishes the node's capacity
//! for VMs on its Node ([`super::capacity`]), from what the runtime just answered.

use std::time::Duration;

use imp_api::names::lease_name;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client, api::PostParams};
use tracing::{debug, warn};

use super::capacity::{self, CapacityConfig, HostFacts};
use super::metrics::AgentMetrics;
use imp_runtime_api::client::RuntimeClient;

/// `leaseDurationSeconds` advertised: four missed renewals (informational; the operator applies
/// its own staleness threshold).
pub fn lease_duration_secs(interval: Duration) -> i32 {
    i32::try_from((interval.as_secs() * 4).max(1)).unwrap_or(i32::MAX)
}

/// Heartbeats between two patches of unchanged capacity annotations.
const REPUBLISH_EVERY: u32 = 30;

/// Renews once: create, or replace with the read resourceVersion.
pub async fn renew(api: &Api<Lease>, node: &str, interval: Duration) -> Result<(), kube::Error> {
    let name = lease_name(node);
    let now = MicroTime(Timestamp::now());
    match api.get_opt(&name).await? {
        None => {
            let lease = Lease {
                metadata: kube::api::ObjectMeta {
                    name: Some(name),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(node.to_owned()),
                    lease_duration_seconds: Some(lease_duration_secs(interval)),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    ..Default::default()
                }),
            };
            api.create(&PostParams::default(), &lease).await?;
        }
        Some(mut lease) => {
            let spec = lease.spec.get_or_insert_with(Default::default);
            if spec.holder_identity.as_deref() != Some(node) {
                spec.holder_identity = Some(node.to_owned());
                spec.acquire_time = Some(now.clone());
            }
            spec.lease_duration_seconds = Some(lease_duration_secs(interval));
            spec.renew_time = Some(now);
            api.replace(&name, &PostParams::default(), &lease).await?;
        }
    }
    Ok(())
}

/// Renews forever, every `interval`, while `runtime` answers (a failed renewal, or a runtime
/// that does not answer, is retried after a short pause), and publishes the node's capacity
/// when it differs from what was last published.
pub async fn heartbeat(
    client: Client,
    namespace: String,
    node: String,
    interval: Duration,
    metrics: AgentMetrics,
    runtime: RuntimeClient,
    capacity_config: CapacityConfig,
) {
    let api: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client);
    let mut runtime_was_down = false;
    let mut published = None;
    let mut publish_failed = false;
    // Heartbeats since the last patch: re-published now and then, so an annotation removed or
    // edited by someone else is restored without an agent restart.
    let mut since_publish: u32 = 0;
    loop {
        let runtime_capacity = match runtime.capacity().await {
            Ok(c) => c,
            Err(e) => {
                if !runtime_was_down {
                    warn!(error = %e, "imp-runtime does not answer: the heartbeat is held until it does");
                }
                runtime_was_down = true;
                metrics.heartbeat_failed();
                tokio::time::sleep(interval.min(Duration::from_secs(1))).await;
                continue;
            }
        };
        if runtime_was_down {
            tracing::info!("imp-runtime answers again: heartbeat resumed");
            runtime_was_down = false;
        }
        let wanted = capacity::annotations(&capacity_config, HostFacts::read(), &runtime_capacity);
        since_publish = since_publish.saturating_add(1);
        if published.as_ref() != Some(&wanted) || since_publish >= REPUBLISH_EVERY {
            match capacity::publish(&nodes, &node, &wanted).await {
                Ok(()) => {
                    if published.as_ref() == Some(&wanted) {
                        debug!(node = %node, "re-published the node's capacity for VMs");
                    } else {
                        tracing::info!(node = %node, capacity = ?wanted, "published the node's capacity for VMs");
                    }
                    published = Some(wanted);
                    publish_failed = false;
                    since_publish = 0;
                }
                Err(e) => {
                    // Retried with the next heartbeat; said once (a test or a cluster without
                    // the Node object would repeat it every interval).
                    if !publish_failed {
                        warn!(node = %node, error = %e, "publishing the node's capacity failed");
                    }
                    publish_failed = true;
                }
            }
        }
        match renew(&api, &node, interval).await {
            Ok(()) => {
                metrics.heartbeat_ok();
                debug!(lease = %lease_name(&node), "heartbeat renewed");
                tokio::time::sleep(interval).await;
            }
            Err(e) => {
                metrics.heartbeat_failed();
                warn!(lease = %lease_name(&node), error = %e, "heartbeat renewal failed");
                tokio::time::sleep(interval.min(Duration::from_secs(1))).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duration_is_four_intervals() {
        assert_eq!(lease_duration_secs(Duration::from_secs(10)), 40);
        assert_eq!(lease_duration_secs(Duration::from_millis(300)), 1);
    }
}
