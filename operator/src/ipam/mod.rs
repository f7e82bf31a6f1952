//! Built-in IPAM (docs/network.md): one IPv4 address per ImpVM from its ImpNetwork's subnet.
//!
//! The durable record is `ImpNetwork.status.allocations` (address -> VM name and uid) on the API
//! server. Every change is read-modify-write with the object's resourceVersion as precondition
//! (`replace_status`), retried on 409: two operator replicas, retries and restarts therefore
//! never hand out one address twice. Within one process, writes to one network are serialised
//! so its own callers do not conflict with each other. The decisions are pure (alloc.rs).

pub mod alloc;

use std::collections::{BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

use imp_api::ImpNetwork;
use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{condition, reason};
use imp_api::{ImpNetworkStatus, IpAllocation};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};

use crate::error::{Error, Result};
use alloc::{Decision, Pool};

/// Conflicts in a row before giving up (the caller's reconcile retries later).
const MAX_CONFLICTS: usize = 100;

/// An address for a VM, with what the guest needs to use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub ip: Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: Ipv4Addr,
}

/// Per (namespace, network name): the lock its writers in this process queue on.
type NetworkLocks = HashMap<(String, String), Arc<tokio::sync::Mutex<()>>>;

pub struct Ipam {
    client: Client,
    /// One lock per (namespace, network): this process's writers queue instead of conflicting.
    locks: Mutex<NetworkLocks>,
}

impl Ipam {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            locks: Mutex::default(),
        }
    }

    /// The VM's address on `network` (the one it holds, else a new one); `NetworkExhausted`
    /// when none is free (the network's Ready condition then says so too).
    pub async fn allocate(&self, ns: &str, network: &str, vm: &str, uid: &str) -> Result<Lease> {
        let (ip, pool) = self
            .update(ns, network, |pool, status| {
                Ok(match alloc::allocate(pool, &status.allocations, uid) {
                    Decision::Have(ip) => Ok(ip),
                    Decision::Take(ip) => {
                        status.allocations.insert(
                            ip.to_string(),
                            IpAllocation {
                                vm: vm.to_owned(),
                                uid: uid.to_owned(),
                            },
                        );
                        Ok(ip)
                    }
                    Decision::Exhausted => Err(Error::NetworkExhausted {
                        network: format!("{ns}/{network}"),
                        capacity: pool.capacity(),
                    }),
                })
            })
            .await?;
        Ok(Lease {
            ip: ip?,
            prefix_len: pool.prefix_len(),
            gateway: pool.gateway(),
        })
    }

    /// Free the address of VM `uid` (absent is fine); returns whether one was freed.
    pub async fn release(&self, ns: &str, network: &str, uid: &str) -> Result<bool> {
        self.update(ns, network, |_, status| {
            let before = status.allocations.len();
            status.allocations.retain(|_, a| a.uid != uid);
            Ok(status.allocations.len() != before)
        })
        .await
        .map(|(freed, _)| freed)
    }

    /// Free every address whose VM uid is not in `live`: VMs deleted or force-finalized
    /// without a release reach here. Returns the freed addresses.
    pub async fn release_missing(
        &self,
        ns: &str,
        network: &str,
        live: &BTreeSet<String>,
    ) -> Result<Vec<String>> {
        self.update(ns, network, |_, status| {
            Ok(alloc::retain_live(&mut status.allocations, live))
        })
        .await
        .map(|(freed, _)| freed)
    }

    fn lock(&self, ns: &str, network: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks
            .entry((ns.to_owned(), network.to_owned()))
            .or_default()
            .clone()
    }

    /// Read-modify-write of the network's status until it lands without a conflict. `f` may
    /// run several times (once per attempt, on the freshly read status).
    async fn update<T>(
        &self,
        ns: &str,
        network: &str,
        f: impl Fn(&Pool, &mut ImpNetworkStatus) -> Result<T>,
    ) -> Result<(T, Pool)> {
        let lock = self.lock(ns, network);
        let _held = lock.lock().await;
        let api: Api<ImpNetwork> = Api::namespaced(self.client.clone(), ns);
        let what = format!("impnetwork {ns}/{network}");
        for _ in 0..MAX_CONFLICTS {
            let mut net = api
                .get(network)
                .await
                .map_err(|e| Error::from_kube(&what, e))?;
            let pool = Pool::new(&net.spec.subnet, &net.spec.gateway).map_err(|message| {
                Error::NetworkInvalid {
                    network: format!("{ns}/{network}"),
                    message,
                }
            })?;
            let old = net.status.clone().unwrap_or_default();
            let mut status = old.clone();
            let out = f(&pool, &mut status)?;
            refresh(
                &pool,
                &mut status,
                net.metadata.generation,
                Timestamp::now(),
            );
            if status == old {
                return Ok((out, pool));
            }
            net.status = Some(status);
            // replace carries metadata.resourceVersion: the server refuses it (409) if the
            // network changed since the get above.
            match api
                .replace_status(network, &PostParams::default(), &net)
                .await
            {
                Ok(_) => return Ok((out, pool)),
                Err(e) => match Error::from_kube(&what, e) {
                    Error::Conflict(_) => continue,
                    other => return Err(other),
                },
            }
        }
        Err(Error::Conflict(what))
    }
}

/// allocated, capacity and the Ready condition from the allocations.
pub fn refresh(
    pool: &Pool,
    status: &mut ImpNetworkStatus,
    generation: Option<i64>,
    now: Timestamp,
) {
    let used = alloc::in_pool(pool, &status.allocations);
    let capacity = pool.capacity();
    status.allocated = Some(used);
    status.capacity = Some(capacity);
    status.observed_generation = generation;
    let (value, why, message) = if used < capacity {
        (
            ConditionStatus::True,
            reason::ADDRESSES_AVAILABLE,
            format!("{} of {capacity} addresses free", capacity - used),
        )
    } else {
        (
            ConditionStatus::False,
            reason::NETWORK_EXHAUSTED,
            format!("all {capacity} addresses are allocated"),
        )
    };
    conditions::set(
        &mut status.conditions,
        condition::NETWORK_READY,
        value,
        why,
        message,
        generation,
        now,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    #[test]
    fn refresh_counts_and_flips_ready_only_on_change() {
        let pool = Pool::new("192.0.2.0/30", "192.0.2.1").unwrap();
        let mut s = ImpNetworkStatus::default();
        let t0 = Timestamp::from_second(1_000).unwrap();
        let t1 = Timestamp::from_second(2_000).unwrap();
        refresh(&pool, &mut s, Some(3), t0);
        assert_eq!((s.allocated, s.capacity), (Some(0), Some(1)));
        assert_eq!(s.conditions[0].status, "True");
        assert_eq!(s.conditions[0].reason, reason::ADDRESSES_AVAILABLE);
        let before = s.clone();
        refresh(&pool, &mut s, Some(3), t1);
        assert_eq!(s, before, "an unchanged status is not rewritten");
        s.allocations.insert(
            "192.0.2.2".into(),
            IpAllocation {
                vm: "v".into(),
                uid: "u".into(),
            },
        );
        refresh(&pool, &mut s, Some(3), t1);
        assert_eq!(s.allocated, Some(1));
        let c = &s.conditions[0];
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", reason::NETWORK_EXHAUSTED)
        );
        assert_eq!(c.last_transition_time, Time(t1));
    }
}
