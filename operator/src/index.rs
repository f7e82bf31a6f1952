//! The operator's one index of watched objects: a reflector each for Nodes, agent Leases, ImpVMClasses,
//! ImpNetworks and ImpVMs, built once per term of leadership and handed to every controller (the ImpVM
//! controller, the pressureLifecycle, the pool controller), so each kind is listed and watched once
//! instead of once per controller.
//!
//! Each kind offers its [`Store`] (the cache) and [`Shared::subscribe`], a stream of every object the
//! watch touched, deletions included. The fan-out is ours rather than kube-runtime's shared reflector
//! (`store_shared` / `subscribe`): kube-runtime's dispatcher sends no deletions and applies backpressure
//! to every subscriber from the slowest, while the controllers map a deleted Node or Lease to the VMs it
//! affects exactly as they map a changed one. A subscription starts with the objects already cached, so a
//! controller that subscribes late still sees every object once.
//!
//! Readiness is [`Index::ready`], not [`Store::wait_until_ready`]: kube-runtime 5's store readiness is a
//! oneshot that wakes only its last waiter, so the index is that store's one waiter and republishes the
//! fact on a `watch` channel any number of tasks may wait on. A controller that hands a store to
//! kube-runtime's `Controller` (whose applier waits on it) starts it only after [`Index::ready`].

use std::sync::{Arc, Mutex};

use futures::{StreamExt, channel::mpsc};
use imp_api::{ImpNetwork, ImpVM, ImpVMClass};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::Node};
use kube::{
    Api, Client, Resource,
    runtime::{
        WatchStreamExt,
        reflector::{self, Lookup, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tracing::{debug, info};

/// What the index watches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Namespace of the ImpVMs and ImpNetworks watched; None: every namespace.
    pub namespace: Option<String>,
    /// Label selector of the Nodes watched (`--node-selector`); None or empty: every Node.
    pub node_selector: Option<String>,
    /// Namespace of the agents' heartbeat Leases (`imp-node-<node>`): the operator's namespace.
    pub lease_namespace: String,
}

impl IndexConfig {
    /// ImpVMs, ImpNetworks and agent Leases of `namespace`, every Node (one namespace per test).
    pub fn namespace(namespace: &str) -> Self {
        IndexConfig {
            namespace: Some(namespace.to_owned()),
            node_selector: None,
            lease_namespace: namespace.to_owned(),
        }
    }
}

/// One watched kind: its cache and the subscribers of its changes.
pub struct Shared<K: Lookup<DynamicType = ()> + Clone + 'static> {
    store: Store<K>,
    subscribers: Arc<Mutex<Vec<mpsc::UnboundedSender<Arc<K>>>>>,
}

impl<K: Lookup<DynamicType = ()> + Clone + 'static> Clone for Shared<K> {
    fn clone(&self) -> Self {
        Shared {
            store: self.store.clone(),
            subscribers: self.subscribers.clone(),
        }
    }
}

impl<K: Lookup<DynamicType = ()> + Clone + Send + Sync + 'static> Shared<K> {
    /// The cache (never `wait_until_ready` on it: see [`Index::ready`]).
    pub fn store(&self) -> Store<K> {
        self.store.clone()
    }

    /// Every object the watch touches from now on, deletions included, after the ones cached already.
    /// Unbounded: a subscriber must be polled (a controller's trigger stream is, continuously); one
    /// dropped is forgotten at the next change.
    pub fn subscribe(&self) -> impl futures::Stream<Item = Arc<K>> + Send + 'static {
        let (tx, rx) = mpsc::unbounded();
        // Under the lock `publish` takes, so no change falls between the snapshot and the registration
        // (one may arrive twice, which a trigger does not mind).
        let mut subs = self.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        for obj in self.store.state() {
            let _ = tx.unbounded_send(obj);
        }
        subs.push(tx);
        rx
    }

    fn publish(&self, obj: K) {
        let obj = Arc::new(obj);
        let mut subs = self.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        subs.retain(|tx| tx.unbounded_send(obj.clone()).is_ok());
    }

    fn new() -> (Self, reflector::store::Writer<K>) {
        let (store, writer) = reflector::store::<K>();
        (
            Shared {
                store,
                subscribers: Arc::new(Mutex::new(Vec::new())),
            },
            writer,
        )
    }

    /// Runs the kind's reflector: fills the store and tells the subscribers, until the watch ends.
    async fn drive(self, api: Api<K>, wc: watcher::Config, writer: reflector::store::Writer<K>)
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + std::fmt::Debug,
    {
        reflector::reflector(writer, watcher(api, wc))
            .default_backoff()
            .touched_objects()
            .for_each(|r| {
                match r {
                    Ok(obj) => self.publish(obj),
                    // The backoff retries; the controllers keep deciding on the cache meanwhile.
                    Err(e) => debug!(kind = %<K as Lookup>::kind(&()), error = %e, "watch failed; retrying"),
                }
                std::future::ready(())
            })
            .await;
    }
}

/// The index: one [`Shared`] per watched kind. Clones share it; the watches stop when the last clone
/// is dropped (the controllers holding it ended, e.g. leadership was lost).
#[derive(Clone)]
pub struct Index {
    pub nodes: Shared<Node>,
    pub leases: Shared<Lease>,
    pub classes: Shared<ImpVMClass>,
    pub networks: Shared<ImpNetwork>,
    pub vms: Shared<ImpVM>,
    config: Arc<IndexConfig>,
    ready: watch::Receiver<bool>,
    _driver: Arc<AbortOnDrop>,
}

impl Index {
    /// Starts the five watches (on the current tokio runtime).
    pub fn start(client: Client, config: IndexConfig) -> Index {
        let (nodes, node_w) = Shared::<Node>::new();
        let (leases, lease_w) = Shared::<Lease>::new();
        let (classes, class_w) = Shared::<ImpVMClass>::new();
        let (networks, network_w) = Shared::<ImpNetwork>::new();
        let (vms, vm_w) = Shared::<ImpVM>::new();
        let node_wc = match config.node_selector.as_deref().filter(|s| !s.is_empty()) {
            Some(sel) => watcher::Config::default().labels(sel),
            None => watcher::Config::default(),
        };
        let (vms_api, networks_api): (Api<ImpVM>, Api<ImpNetwork>) = match &config.namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (Api::all(client.clone()), Api::all(client.clone())),
        };
        let (ready_tx, ready) = watch::channel(false);
        let stores = (
            nodes.store(),
            leases.store(),
            classes.store(),
            networks.store(),
            vms.store(),
        );
        let watches = futures::future::join5(
            nodes
                .clone()
                .drive(Api::all(client.clone()), node_wc, node_w),
            leases.clone().drive(
                Api::namespaced(client.clone(), &config.lease_namespace),
                watcher::Config::default(),
                lease_w,
            ),
            classes.clone().drive(
                Api::all(client.clone()),
                watcher::Config::default(),
                class_w,
            ),
            networks
                .clone()
                .drive(networks_api, watcher::Config::default(), network_w),
            vms.clone().drive(vms_api, watcher::Config::default(), vm_w),
        );
        let filled = async move {
            // The stores' one waiter each (see the module comment).
            let _ = tokio::join!(
                stores.0.wait_until_ready(),
                stores.1.wait_until_ready(),
                stores.2.wait_until_ready(),
                stores.3.wait_until_ready(),
                stores.4.wait_until_ready(),
            );
            info!("index filled: Nodes, Leases, ImpVMClasses, ImpNetworks, ImpVMs");
            let _ = ready_tx.send(true);
            // Keeps the sender, so waiters never see the channel closed while the watches run.
            std::future::pending::<()>().await;
        };
        let driver = tokio::spawn(async move {
            tokio::select! {
                _ = watches => tracing::warn!("index watches ended"),
                () = filled => {}
            }
        });
        Index {
            nodes,
            leases,
            classes,
            networks,
            vms,
            config: Arc::new(config),
            ready,
            _driver: Arc::new(AbortOnDrop(driver)),
        }
    }

    /// What the index watches.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Returns once every store holds its first full list (at once if they do already).
    pub async fn ready(&self) {
        let mut ready = self.ready.clone();
        if ready.wait_for(|r| *r).await.is_err() {
            // The watches ended before the stores filled: they never will.
            std::future::pending::<()>().await;
        }
    }

    /// Whether every store holds its first full list.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }
}

/// Aborts a background task when its owner is dropped.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    fn cm(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The names a subscription has ready now.
    fn drain(s: &mut (impl futures::Stream<Item = Arc<ConfigMap>> + Unpin)) -> Vec<String> {
        std::iter::from_fn(|| s.next().now_or_never().flatten())
            .map(|c| c.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    #[test]
    fn a_subscriber_sees_the_cached_objects_then_every_change_deletions_included() {
        let (shared, mut writer) = Shared::<ConfigMap>::new();
        writer.apply_watcher_event(&watcher::Event::Apply(cm("a")));
        let mut early = Box::pin(shared.subscribe());
        assert_eq!(drain(&mut early), ["a"], "what the cache holds already");
        writer.apply_watcher_event(&watcher::Event::Apply(cm("b")));
        shared.publish(cm("b"));
        let mut late = Box::pin(shared.subscribe());
        assert_eq!(drain(&mut early), ["b"]);
        let mut seen = drain(&mut late);
        seen.sort();
        assert_eq!(seen, ["a", "b"], "a late subscriber misses nothing");
        // A deletion reaches every subscriber though the object is no longer cached: a controller
        // maps a deleted Node to its VMs as it maps a changed one.
        writer.apply_watcher_event(&watcher::Event::Delete(cm("a")));
        shared.publish(cm("a"));
        assert_eq!(drain(&mut early), ["a"]);
        assert_eq!(drain(&mut late), ["a"]);
        // A dropped subscriber is forgotten at the next change.
        drop(late);
        shared.publish(cm("c"));
        assert_eq!(shared.subscribers.lock().unwrap().len(), 1);
        assert_eq!(drain(&mut early), ["c"]);
    }
}
