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

use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{condition, reason};
use imp_api::{ImpNetwork, ImpVM};
use imp_api::{ImpNetworkStatus, IpAllocation};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, PostParams};
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
    /// when none is free (the network's Ready condition then says so too), `NetworkNotFound`
    /// when the network does not exist, `NetworkInvalid` when its subnet or gateway is unusable.
    pub async fn allocate(&self, ns: &str, network: &str, vm: &str, uid: &str) -> Result<Lease> {
        self.update(ns, network, nothing, |pool, status, ()| {
            let pool = pool.map_err(|message| Error::NetworkInvalid {
                network: format!("{ns}/{network}"),
                message: message.to_owned(),
            })?;
            let lease = |ip| Lease {
                ip,
                prefix_len: pool.prefix_len(),
                gateway: pool.gateway(),
            };
            // Exhaustion is Ok(Err): the refreshed Ready=False condition is still written.
            Ok(match alloc::allocate(pool, &status.allocations, uid) {
                Decision::Have(ip) => Ok(lease(ip)),
                Decision::Take(ip) => {
                    status.allocations.insert(
                        ip.to_string(),
                        IpAllocation {
                            vm: vm.to_owned(),
                            uid: uid.to_owned(),
                        },
                    );
                    Ok(lease(ip))
                }
                Decision::Exhausted => Err(Error::NetworkExhausted {
                    network: format!("{ns}/{network}"),
                    capacity: pool.capacity(),
                }),
            })
        })
        .await?
    }

    /// Free the address of VM `uid` (absent is fine); returns whether one was freed. Works on a
    /// network whose subnet became unusable too, so a deletion is never held up by it.
    pub async fn release(&self, ns: &str, network: &str, uid: &str) -> Result<bool> {
        self.update(ns, network, nothing, |_, status, ()| {
            let before = status.allocations.len();
            status.allocations.retain(|_, a| a.uid != uid);
            Ok(status.allocations.len() != before)
        })
        .await
    }

    /// Free every address whose VM uid is not in `live`: VMs deleted or force-finalized
    /// without a release reach here. Returns the freed addresses. `live` must have been read
    /// after every allocation it could miss; [`Ipam::sweep`] guarantees that.
    pub async fn release_missing(
        &self,
        ns: &str,
        network: &str,
        live: &BTreeSet<String>,
    ) -> Result<Vec<String>> {
        self.update(ns, network, nothing, |_, status, ()| {
            Ok(alloc::retain_live(&mut status.allocations, live))
        })
        .await
    }

    /// [`Ipam::release_missing`] with the live set listed from the API server after each read
    /// of the network: an allocation for a VM the list missed was written after the read, so
    /// the write that would free it fails on the resourceVersion and is redone with a new list.
    /// Every ImpVM of the namespace counts as live (whatever its networkRef says now), so an
    /// existing VM's address is never freed under it.
    pub async fn sweep(&self, ns: &str, network: &str) -> Result<Vec<String>> {
        let vms: Api<ImpVM> = Api::namespaced(self.client.clone(), ns);
        self.update(
            ns,
            network,
            || async {
                let list = vms
                    .list_metadata(&ListParams::default())
                    .await
                    .map_err(|e| Error::from_kube(&format!("impvms in {ns}"), e))?;
                Ok(list
                    .items
                    .into_iter()
                    .filter_map(|m| m.metadata.uid)
                    .collect::<BTreeSet<_>>())
            },
            |_, status, live| Ok(alloc::retain_live(&mut status.allocations, live)),
        )
        .await
    }

    fn lock(&self, ns: &str, network: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks
            .entry((ns.to_owned(), network.to_owned()))
            .or_default()
            .clone()
    }

    /// Read-modify-write of the network's status until it lands without a conflict. Each
    /// attempt reads the network, then runs `observe` (so what it sees is at least as new as
    /// the read), then `f` on the freshly read status with the pool (`Err` names the fault of
    /// an unusable subnet/gateway) and what `observe` returned.
    async fn update<C, T, O: Future<Output = Result<C>>>(
        &self,
        ns: &str,
        network: &str,
        observe: impl Fn() -> O,
        f: impl Fn(Result<&Pool, &str>, &mut ImpNetworkStatus, &C) -> Result<T>,
    ) -> Result<T> {
        let lock = self.lock(ns, network);
        let _held = lock.lock().await;
        let api: Api<ImpNetwork> = Api::namespaced(self.client.clone(), ns);
        let what = format!("impnetwork {ns}/{network}");
        for _ in 0..MAX_CONFLICTS {
            let mut net = match api.get(network).await {
                Ok(net) => net,
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    return Err(Error::NetworkNotFound {
                        network: format!("{ns}/{network}"),
                    });
                }
                Err(e) => return Err(Error::from_kube(&what, e)),
            };
            let seen = observe().await?;
            let pool = Pool::new(&net.spec.subnet, &net.spec.gateway);
            let old = net.status.clone().unwrap_or_default();
            let mut status = old.clone();
            let out = f(pool.as_ref().map_err(String::as_str), &mut status, &seen)?;
            if let Ok(pool) = &pool {
                refresh(pool, &mut status, net.metadata.generation, Timestamp::now());
            }
            if status == old {
                return Ok(out);
            }
            net.status = Some(status);
            // replace carries metadata.resourceVersion: the server refuses it (409) if the
            // network changed since the get above.
            match api
                .replace_status(network, &PostParams::default(), &net)
                .await
            {
                Ok(_) => return Ok(out),
                Err(e) => match Error::from_kube(&what, e) {
                    Error::Conflict(_) => continue,
                    other => return Err(other),
                },
            }
        }
        Err(Error::Conflict(what))
    }
}

impl Lease {
    /// The value of the VM's [`imp_api::names::ANNOTATION_IP_ALLOCATION`]: `ADDR/PREFIX`.
    pub fn annotation(&self) -> String {
        format!("{}/{}", self.ip, self.prefix_len)
    }
}

/// The `observe` of an update that needs nothing besides the network.
fn nothing() -> std::future::Ready<Result<()>> {
    std::future::ready(Ok(()))
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
