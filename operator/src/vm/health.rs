//! Node health as the ImpVM controller sees it (pure): the Node's Ready condition with a grace period,
//! and the freshness of the agent's heartbeat Lease.

use std::time::Duration;

use imp_api::names::reason;
use k8s_openapi::{
    api::{coordination::v1::Lease, core::v1::Node},
    jiff::{SignedDuration, Timestamp},
};

use crate::scheduler::Heartbeat;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeHealth {
    /// Ready with a fresh heartbeat; `recheck_at` is when the heartbeat goes stale unless renewed.
    Healthy { recheck_at: Option<Timestamp> },
    /// NotReady for less than the grace period: VMs stay put until `lost_at`.
    Degraded {
        reason: &'static str,
        message: String,
        lost_at: Timestamp,
    },
    /// Gone for good as far as its VMs are concerned.
    Lost {
        reason: &'static str,
        message: String,
    },
}

impl NodeHealth {
    pub fn is_healthy(&self) -> bool {
        matches!(self, NodeHealth::Healthy { .. })
    }
    pub fn is_lost(&self) -> bool {
        matches!(self, NodeHealth::Lost { .. })
    }
}

pub fn add(t: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d)
        .ok()
        .and_then(|d| t.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX)
}

/// Time from `now` until `t`, zero if `t` has passed.
pub fn until(now: Timestamp, t: Timestamp) -> Duration {
    Duration::try_from(t.duration_since(now)).unwrap_or(Duration::ZERO)
}

/// Last renewal of an agent Lease (renewTime, else acquireTime).
pub fn lease_renewed(lease: &Lease) -> Option<Timestamp> {
    let spec = lease.spec.as_ref()?;
    spec.renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map(|t| t.0)
}

/// Freshness of the heartbeat; a Lease that was never renewed counts as stale.
pub fn heartbeat(lease: Option<&Lease>, stale_after: Duration, now: Timestamp) -> Heartbeat {
    match lease {
        None => Heartbeat::Missing,
        Some(l) => match lease_renewed(l) {
            Some(t) if add(t, stale_after) > now => Heartbeat::Fresh,
            _ => Heartbeat::Stale,
        },
    }
}

/// Health of the node `name` a VM is bound to.
pub fn node_health(
    name: &str,
    node: Option<&Node>,
    lease: Option<&Lease>,
    grace: Duration,
    stale_after: Duration,
    now: Timestamp,
) -> NodeHealth {
    let Some(node) = node else {
        return NodeHealth::Lost {
            reason: reason::NODE_DELETED,
            message: format!("node {name} no longer exists"),
        };
    };
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    if ready.is_none_or(|c| c.status != "True") {
        // Without a transition time (a node that never reported), count from the node's creation.
        let since = ready
            .and_then(|c| c.last_transition_time.as_ref())
            .or(node.metadata.creation_timestamp.as_ref())
            .map(|t| t.0)
            .unwrap_or(now);
        let status = ready.map(|c| c.status.as_str()).unwrap_or("absent");
        let lost_at = add(since, grace);
        if now >= lost_at {
            return NodeHealth::Lost {
                reason: reason::NODE_NOT_READY,
                message: format!(
                    "node {name} Ready={status} since {since}, longer than the {grace:?} grace period"
                ),
            };
        }
        return NodeHealth::Degraded {
            reason: reason::NODE_NOT_READY,
            message: format!(
                "node {name} Ready={status} since {since}; its VMs are lost at {lost_at} unless it recovers"
            ),
            lost_at,
        };
    }
    match (lease, lease.and_then(lease_renewed)) {
        (None, _) => NodeHealth::Lost {
            reason: reason::AGENT_HEARTBEAT_MISSING,
            message: format!("no heartbeat Lease from the imp agent on node {name}"),
        },
        (Some(_), None) => NodeHealth::Lost {
            reason: reason::AGENT_HEARTBEAT_STALE,
            message: format!("the imp agent on node {name} never renewed its heartbeat Lease"),
        },
        (Some(_), Some(renewed)) => {
            let stale_at = add(renewed, stale_after);
            if now >= stale_at {
                NodeHealth::Lost {
                    reason: reason::AGENT_HEARTBEAT_STALE,
                    message: format!(
                        "the imp agent on node {name} last renewed its heartbeat at {renewed}, more than {stale_after:?} ago"
                    ),
                }
            } else {
                NodeHealth::Healthy {
                    recheck_at: Some(stale_at),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::{
        api::{
            coordination::v1::LeaseSpec,
            core::v1::{NodeCondition, NodeStatus},
        },
        apimachinery::pkg::apis::meta::v1::{MicroTime, Time},
    };

    const GRACE: Duration = Duration::from_secs(40);
    const STALE: Duration = Duration::from_secs(30);

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn node(ready: &str, since: i64) -> Node {
        let mut n = Node::default();
        n.metadata.creation_timestamp = Some(Time(t(-1000)));
        n.status = Some(NodeStatus {
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: ready.into(),
                last_transition_time: Some(Time(t(since))),
                ..Default::default()
            }]),
            ..Default::default()
        });
        n
    }

    fn lease(renewed: Option<i64>) -> Lease {
        Lease {
            spec: Some(LeaseSpec {
                renew_time: renewed.map(|s| MicroTime(t(s))),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn health(node: Option<&Node>, lease: Option<&Lease>, now: i64) -> NodeHealth {
        node_health("n1", node, lease, GRACE, STALE, t(now))
    }

    #[test]
    fn ready_with_fresh_lease_is_healthy_until_the_lease_goes_stale() {
        let h = health(Some(&node("True", 0)), Some(&lease(Some(100))), 110);
        assert_eq!(
            h,
            NodeHealth::Healthy {
                recheck_at: Some(t(130))
            }
        );
        let h = health(Some(&node("True", 0)), Some(&lease(Some(100))), 130);
        assert!(
            matches!(
                h,
                NodeHealth::Lost {
                    reason: reason::AGENT_HEARTBEAT_STALE,
                    ..
                }
            ),
            "{h:?}"
        );
    }

    #[test]
    fn not_ready_is_degraded_within_grace_and_lost_after() {
        let h = health(Some(&node("False", 100)), Some(&lease(Some(100))), 139);
        assert!(
            matches!(h, NodeHealth::Degraded { lost_at, .. } if lost_at == t(140)),
            "{h:?}"
        );
        let h = health(Some(&node("Unknown", 100)), Some(&lease(Some(100))), 140);
        match h {
            NodeHealth::Lost { reason, message } => {
                assert_eq!(reason, reason::NODE_NOT_READY);
                assert!(message.contains("Ready=Unknown"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn not_ready_wins_over_heartbeat() {
        // A NotReady node within grace is not failed early because its agent is also silent.
        let h = health(Some(&node("False", 100)), None, 110);
        assert!(matches!(h, NodeHealth::Degraded { .. }), "{h:?}");
    }

    #[test]
    fn deleted_node_and_missing_or_unrenewed_lease_are_lost() {
        assert!(matches!(
            health(None, Some(&lease(Some(100))), 100),
            NodeHealth::Lost {
                reason: reason::NODE_DELETED,
                ..
            }
        ));
        assert!(matches!(
            health(Some(&node("True", 0)), None, 100),
            NodeHealth::Lost {
                reason: reason::AGENT_HEARTBEAT_MISSING,
                ..
            }
        ));
        assert!(matches!(
            health(Some(&node("True", 0)), Some(&lease(None)), 100),
            NodeHealth::Lost {
                reason: reason::AGENT_HEARTBEAT_STALE,
                ..
            }
        ));
    }

    #[test]
    fn node_without_ready_condition_counts_from_creation() {
        let mut n = Node::default();
        n.metadata.creation_timestamp = Some(Time(t(0)));
        assert!(matches!(
            health(Some(&n), Some(&lease(Some(0))), 10),
            NodeHealth::Degraded { .. }
        ));
        assert!(matches!(
            health(Some(&n), Some(&lease(Some(0))), 40),
            NodeHealth::Lost { .. }
        ));
    }

    #[test]
    fn heartbeat_freshness() {
        assert_eq!(heartbeat(None, STALE, t(0)), Heartbeat::Missing);
        assert_eq!(
            heartbeat(Some(&lease(Some(0))), STALE, t(29)),
            Heartbeat::Fresh
        );
        assert_eq!(
            heartbeat(Some(&lease(Some(0))), STALE, t(30)),
            Heartbeat::Stale
        );
        assert_eq!(heartbeat(Some(&lease(None)), STALE, t(0)), Heartbeat::Stale);
    }

    #[test]
    fn until_and_add_saturate() {
        assert_eq!(until(t(10), t(5)), Duration::ZERO);
        assert_eq!(until(t(5), t(10)), Duration::from_secs(5));
        assert_eq!(add(t(0), Duration::from_secs(3)), t(3));
        assert_eq!(add(t(0), Duration::MAX), Timestamp::MAX);
    }
}
