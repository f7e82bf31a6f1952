//! The ImpVM controller: watches ImpVMs, and Nodes, agent Leases and ImpVMClasses mapped to the VMs they
//! affect; for each VM asks [`decide`] what to do and does it.
//!
//! Every write carries the resourceVersion the decision was based on, so a concurrent write by the agent
//! (or another pass) fails with 409 instead of being overwritten; the newer object is then decided again.
//! The finalizer is handled here rather than with `kube::runtime::finalizer`, whose cleanup removes the
//! finalizer as soon as it returns Ok: our cleanup has to wait, across many passes, for the agent.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use futures::StreamExt;
use imp_api::{
    ImpNetwork, ImpVM, ImpVMClass, VmPhase,
    names::{
        ANNOTATION_IP_ALLOCATION, ANNOTATION_RESET_RESTARTS, FINALIZER_VM_CLEANUP, lease_name,
        lease_node,
    },
};
use k8s_openapi::{
    api::{coordination::v1::Lease, core::v1::Node},
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    runtime::{
        Controller,
        controller::Action,
        events::{Recorder, Reporter},
        reflector::{ObjectRef, Store},
    },
};
use serde_json::json;
use tokio::sync::Mutex;
use tracing::{debug, info, warn};

use super::{
    config::VmControllerConfig,
    decide::{self, Counted, Input, Note, Plan},
    health::{self, NodeHealth},
};
use crate::{
    error::{Error, Result},
    index::{AbortOnDrop, Index},
    ipam::Ipam,
    metrics::{
        ModeLabels, NetworkAddressLabels, NodeLabels, PhaseLabels, ReasonLabels, ResultLabels,
        VmMetrics,
    },
    scheduler::{self, NodeInfo, Resident, VmRequest},
};

/// Label value for this controller in operator-wide metrics.
const CONTROLLER: &str = "impvm";
/// How long a binding we wrote is counted even if the VM cache has not shown it yet.
const ASSUME_FOR: Duration = Duration::from_secs(60);

/// A binding written by this process, counted against the node until the cache reflects it.
struct Assumed {
    node: String,
    vcpu: u32,
    memory_mib: u64,
    disk_mib: u64,
    at: Instant,
}

impl Assumed {
    /// `request`'s share of `node`, reserved from now.
    fn of(request: &VmRequest, node: &str) -> Self {
        Assumed {
            node: node.to_owned(),
            vcpu: request.vcpu,
            memory_mib: request.memory_mib,
            disk_mib: request.disk_mib,
            at: Instant::now(),
        }
    }
}

/// Shared state of the ImpVM controller.
pub struct Context {
    client: Client,
    config: VmControllerConfig,
    metrics: VmMetrics,
    recorder: Recorder,
    vms: Store<ImpVM>,
    nodes: Store<Node>,
    leases: Store<Lease>,
    classes: Store<ImpVMClass>,
    networks: Store<ImpNetwork>,
    /// Where the index watches the agents' Leases.
    lease_namespace: String,
    ipam: Ipam,
    /// Held across choose-and-bind so two VMs cannot both take the last free slot of a node.
    assumed: Mutex<HashMap<String, Assumed>>,
    caches_ready: AtomicBool,
    /// VMs to reconcile again now: the unbound ones once a bound VM's finalizer went, so capacity
    /// it freed is used at once rather than at the next unschedulable retry.
    nudge: tokio::sync::mpsc::UnboundedSender<ObjectRef<ImpVM>>,
}

/// Runs the ImpVM controller on `index`'s caches until the task is dropped. `ready` turns true once the
/// index is filled, which is also when the controller starts deciding.
pub async fn run_vm_controller(
    client: Client,
    index: Index,
    config: VmControllerConfig,
    metrics: VmMetrics,
    ready: Arc<AtomicBool>,
) {
    let (nodes, leases, classes, networks) = (
        index.nodes.store(),
        index.leases.store(),
        index.classes.store(),
        index.networks.store(),
    );
    let node_events = index.nodes.subscribe();
    let heartbeat_gauge = metrics.agent_heartbeat.clone();
    let lease_events = index.leases.subscribe().inspect(move |lease: &Arc<Lease>| {
        if let (Some(node), Some(t)) = (lease_node(&lease.name_any()), health::lease_renewed(lease))
        {
            heartbeat_gauge
                .get_or_create(&NodeLabels {
                    node: node.to_owned(),
                })
                .set(t.as_millisecond() as f64 / 1000.0);
        }
    });
    let class_events = index.classes.subscribe();
    let network_events = index.networks.subscribe();
    let vm_events = index.vms.subscribe();

    let (nudge, nudged) = tokio::sync::mpsc::unbounded_channel();
    let nudged =
        futures::stream::unfold(
            nudged,
            |mut rx| async move { rx.recv().await.map(|r| (r, rx)) },
        );
    let vms = index.vms.store();
    let controller = Controller::for_shared_stream(vm_events, vms.clone()).reconcile_on(nudged);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: config.reporter.clone(),
            instance: None,
        },
    );
    let ctx = Arc::new(Context {
        client: client.clone(),
        config,
        metrics,
        recorder,
        vms: vms.clone(),
        nodes: nodes.clone(),
        leases: leases.clone(),
        classes: classes.clone(),
        networks: networks.clone(),
        lease_namespace: index.config().lease_namespace.clone(),
        ipam: Ipam::new(client.clone()),
        assumed: Mutex::new(HashMap::new()),
        caches_ready: AtomicBool::new(false),
        nudge,
    });

    // Deciding on half-filled caches would mistake a not-yet-listed node for a deleted one. Waiting
    // here, before the runtime's applier waits on the ImpVM store itself, also keeps that store to one
    // waiter at a time (see crate::index).
    index.ready().await;
    ctx.caches_ready.store(true, Ordering::SeqCst);
    ready.store(true, Ordering::SeqCst);
    info!("ImpVM controller caches filled; reconciling");

    let _gauges = AbortOnDrop(tokio::spawn(refresh_gauges(ctx.clone())));
    let _sweep = AbortOnDrop(tokio::spawn(sweep_allocations(ctx.clone())));

    let (vms_n, vms_l, vms_c, vms_w) = (vms.clone(), vms.clone(), vms.clone(), vms.clone());
    controller
        .watches_shared_stream(node_events, move |node: Arc<Node>| {
            // Its VMs (health), and every unbound VM (capacity may have appeared).
            let name = node.name_any();
            refs(&vms_n, |vm| {
                vm.spec.node_name.as_deref().is_none_or(|n| n == name)
            })
        })
        .watches_shared_stream(lease_events, move |lease: Arc<Lease>| {
            let name = lease.name_any();
            let node = lease_node(&name).map(str::to_owned);
            refs(&vms_l, |vm| node.is_some() && vm.spec.node_name == node)
        })
        .watches_shared_stream(class_events, move |class: Arc<ImpVMClass>| {
            let name = class.name_any();
            refs(&vms_c, |vm| vm.spec.class_ref.name == name)
        })
        .watches_shared_stream(network_events, move |net: Arc<ImpNetwork>| {
            // VMs waiting for an address: the network appeared, or one of its addresses was freed.
            let (name, ns) = (net.name_any(), net.namespace());
            refs(&vms_w, |vm| {
                vm.namespace() == ns
                    && vm.spec.network_ref.as_ref().is_some_and(|r| r.name == name)
                    && decide::allocation(vm).is_none()
            })
        })
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(vm = %obj, "reconciled"),
                Err(e) => debug!(error = %e, "reconcile failed"),
            }
        })
        .await;
}

/// VMs per phase, and per node the VMs bound to it that are not running yet (Scheduled or Starting).
fn gauge_counts(vms: &[Arc<ImpVM>]) -> (BTreeMap<String, i64>, BTreeMap<String, i64>) {
    let mut phases = BTreeMap::new();
    let mut backlog = BTreeMap::new();
    for vm in vms {
        let phase = vm.status.as_ref().and_then(|s| s.phase);
        let label = phase.map_or_else(|| "Unknown".to_owned(), |p| format!("{p:?}"));
        *phases.entry(label).or_insert(0) += 1;
        if let (Some(node), Some(VmPhase::Scheduled | VmPhase::Starting)) =
            (vm.spec.node_name.as_deref(), phase)
        {
            *backlog.entry(node.to_owned()).or_insert(0) += 1;
        }
    }
    (phases, backlog)
}

/// Recomputes the gauges from the cache; series whose count dropped to nothing are removed.
async fn refresh_gauges(ctx: Arc<Context>) {
    let (mut last_phases, mut last_backlog) = (BTreeMap::new(), BTreeMap::new());
    let mut last_networks = BTreeMap::new();
    loop {
        tokio::time::sleep(ctx.config.timing.gauge_refresh).await;
        if !ctx.caches_ready.load(Ordering::SeqCst) {
            continue;
        }
        let (phases, backlog) = gauge_counts(&ctx.vms.state());
        let m = &ctx.metrics;
        for gone in last_phases.keys().filter(|k| !phases.contains_key(*k)) {
            m.vms_by_phase.remove(&PhaseLabels {
                phase: String::clone(gone),
            });
        }
        for (phase, n) in &phases {
            m.vms_by_phase
                .get_or_create(&PhaseLabels {
                    phase: phase.clone(),
                })
                .set(*n);
        }
        for gone in last_backlog.keys().filter(|k| !backlog.contains_key(*k)) {
            m.node_backlog.remove(&NodeLabels {
                node: String::clone(gone),
            });
        }
        for (node, n) in &backlog {
            m.node_backlog
                .get_or_create(&NodeLabels { node: node.clone() })
                .set(*n);
        }
        (last_phases, last_backlog) = (phases, backlog);
        last_networks = refresh_network_gauges(m, &ctx.networks.state(), &last_networks);
    }
}

/// Per network (`namespace/name`): (allocated, free) as the network's status records them.
fn network_counts(networks: &[Arc<ImpNetwork>]) -> BTreeMap<String, (i64, i64)> {
    networks
        .iter()
        .filter_map(|n| {
            let s = n.status.as_ref()?;
            let (allocated, capacity) = (s.allocated?, s.capacity?);
            let key = format!("{}/{}", n.namespace().unwrap_or_default(), n.name_any());
            Some((
                key,
                (
                    i64::from(allocated),
                    i64::from(capacity.saturating_sub(allocated)),
                ),
            ))
        })
        .collect()
}

fn refresh_network_gauges(
    m: &VmMetrics,
    networks: &[Arc<ImpNetwork>],
    last: &BTreeMap<String, (i64, i64)>,
) -> BTreeMap<String, (i64, i64)> {
    let counts = network_counts(networks);
    let labels = |network: &str, state: &str| NetworkAddressLabels {
        network: network.to_owned(),
        state: state.to_owned(),
    };
    for gone in last.keys().filter(|k| !counts.contains_key(*k)) {
        m.network_addresses.remove(&labels(gone, "allocated"));
        m.network_addresses.remove(&labels(gone, "free"));
    }
    for (network, (allocated, free)) in &counts {
        m.network_addresses
            .get_or_create(&labels(network, "allocated"))
            .set(*allocated);
        m.network_addresses
            .get_or_create(&labels(network, "free"))
            .set(*free);
    }
    counts
}

/// Frees the addresses of VMs that no longer exist, per network with allocations. The release at
/// finalizer removal covers the usual deletion; this covers VMs deleted while the operator was
/// down and releases that failed.
async fn sweep_allocations(ctx: Arc<Context>) {
    loop {
        tokio::time::sleep(ctx.config.timing.ipam_sweep).await;
        if !ctx.caches_ready.load(Ordering::SeqCst) {
            continue;
        }
        for net in ctx.networks.state() {
            if net.status.as_ref().is_none_or(|s| s.allocations.is_empty()) {
                continue;
            }
            let (ns, name) = (net.namespace().unwrap_or_default(), net.name_any());
            match ctx.ipam.sweep(&ns, &name).await {
                Ok(freed) if !freed.is_empty() => {
                    info!(network = %format!("{ns}/{name}"), ?freed, "freed addresses of VMs that no longer exist")
                }
                Ok(_) | Err(Error::NetworkNotFound { .. }) => {}
                Err(e) => {
                    warn!(network = %format!("{ns}/{name}"), error = %e, "allocation sweep failed")
                }
            }
        }
    }
}

fn refs(store: &Store<ImpVM>, pred: impl Fn(&ImpVM) -> bool) -> Vec<ObjectRef<ImpVM>> {
    store
        .state()
        .iter()
        .filter(|vm| pred(vm))
        .map(|vm| ObjectRef::from_obj(vm.as_ref()))
        .collect()
}

fn error_policy(vm: Arc<ImpVM>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_failed(CONTROLLER, err);
    match err {
        // The newer object is already on its way through the watch; look again soon regardless.
        Error::Conflict(_) => Action::requeue(Duration::from_millis(200)),
        _ => {
            warn!(vm = %vm.name_any(), namespace = vm.namespace().unwrap_or_default(), error = %err, "reconcile failed");
            Action::requeue(Duration::from_secs(5))
        }
    }
}

async fn reconcile(vm: Arc<ImpVM>, ctx: Arc<Context>) -> Result<Action> {
    if !ctx.caches_ready.load(Ordering::SeqCst) {
        return Ok(Action::requeue(Duration::from_millis(200)));
    }
    let started = Instant::now();
    let result = ctx.reconcile(&vm).await;
    ctx.metrics
        .reconcile_duration
        .get_or_create(&crate::metrics::ControllerLabels {
            controller: CONTROLLER.to_owned(),
        })
        .observe(started.elapsed().as_secs_f64());
    result
}

impl Context {
    fn api(&self, vm: &ImpVM) -> Result<Api<ImpVM>> {
        let ns = vm
            .namespace()
            .ok_or(Error::MissingObjectKey(".metadata.namespace"))?;
        Ok(Api::namespaced(self.client.clone(), &ns))
    }

    fn lease(&self, node: &str) -> Option<Arc<Lease>> {
        self.leases
            .get(&ObjectRef::new(&lease_name(node)).within(&self.lease_namespace))
    }

    fn node_health(&self, node: &str, now: Timestamp) -> NodeHealth {
        let t = &self.config.timing;
        health::node_health(
            node,
            self.nodes.get(&ObjectRef::new(node)).as_deref(),
            self.lease(node).as_deref(),
            t.node_not_ready_grace,
            t.heartbeat_stale_after,
            now,
        )
    }

    async fn reconcile(&self, vm: &ImpVM) -> Result<Action> {
        let now = Timestamp::now();
        let class = self.classes.get(&ObjectRef::new(&vm.spec.class_ref.name));
        let node_health = match vm.spec.node_name.as_deref().filter(|n| !n.is_empty()) {
            Some(node) => self.node_health(node, now),
            None => NodeHealth::Healthy { recheck_at: None },
        };
        let network_found = match (&vm.spec.network_ref, vm.namespace()) {
            (Some(r), Some(ns)) => self
                .networks
                .get(&ObjectRef::new(&r.name).within(&ns))
                .is_some(),
            _ => false,
        };
        let plan = decide::decide(&Input {
            vm,
            class: class.as_deref().map(|c| &c.spec),
            node: &node_health,
            network_found,
            timing: &self.config.timing,
            now,
        });
        self.execute(vm, plan, now).await
    }

    async fn execute(&self, vm: &ImpVM, plan: Plan, now: Timestamp) -> Result<Action> {
        let api = self.api(vm)?;
        let name = vm.name_any();
        let what = format!("impvm {}/{}", vm.namespace().unwrap_or_default(), name);
        let rv = vm
            .resource_version()
            .ok_or(Error::MissingObjectKey(".metadata.resourceVersion"))?;
        let resync = Action::requeue(self.config.timing.resync);

        if let Some(net) = &plan.release {
            let ns = vm.namespace().unwrap_or_default();
            let uid = vm.uid().ok_or(Error::MissingObjectKey(".metadata.uid"))?;
            match self.ipam.release(&ns, net, &uid).await {
                Ok(true) => info!(vm = %what, network = %net, "address released"),
                // Nothing held, or the network itself is gone: nothing to free.
                Ok(false) | Err(Error::NetworkNotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        if plan.add_finalizer || plan.remove_finalizer {
            let mut finalizers: Vec<String> = vm
                .finalizers()
                .iter()
                .filter(|f| *f != FINALIZER_VM_CLEANUP)
                .cloned()
                .collect();
            if plan.add_finalizer {
                finalizers.push(FINALIZER_VM_CLEANUP.to_owned());
            }
            let patch = json!({"metadata": {"resourceVersion": rv, "finalizers": finalizers}});
            match api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {}
                // Already gone: nothing left to hold or release.
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Action::await_change()),
                Err(e) => return Err(Error::from_kube(&what, e)),
            }
            if plan.remove_finalizer {
                info!(vm = %what, "finalizer removed");
                // Its resources on the node are released: VMs waiting for room try again now.
                if vm.spec.node_name.as_deref().is_some_and(|n| !n.is_empty()) {
                    for r in refs(&self.vms, |v| {
                        v.spec.node_name.as_deref().is_none_or(str::is_empty)
                            && v.metadata.deletion_timestamp.is_none()
                    }) {
                        let _ = self.nudge.send(r);
                    }
                }
            }
            self.report(vm, &plan.notes, &plan.counted).await;
            return Ok(resync);
        }

        if let Some(request) = &plan.schedule {
            if let Some(node) = &plan.schedule_on {
                let base = ImpVM {
                    status: plan.status.clone().or_else(|| vm.status.clone()),
                    ..vm.clone()
                };
                return self.schedule_pinned(&api, &base, request, node, now).await;
            }
            return self
                .schedule(&api, vm, request, plan.allocate.as_deref(), now)
                .await;
        }

        let mut current = vm.clone();
        if let Some(net) = &plan.allocate {
            // Bound by the user: record the address; the next pass marks the VM Scheduled.
            let lease = match self.allocate(vm, net).await {
                Ok(lease) => lease,
                Err(e) => return self.no_address(vm, net, e).await,
            };
            let patch = json!({"metadata": {"resourceVersion": rv,
                "annotations": {ANNOTATION_IP_ALLOCATION: lease.annotation()}}});
            current = api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| Error::from_kube(&what, e))?;
        }
        if plan.clear_node {
            let patch = json!({"metadata": {"resourceVersion": rv}, "spec": {"nodeName": null}});
            current = api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| Error::from_kube(&what, e))?;
        }
        if let Some(status) = plan.status.clone() {
            let phase = status.phase;
            self.write_status(&api, current, status).await?;
            if phase != vm.status.as_ref().and_then(|s| s.phase) {
                info!(vm = %what, from = ?vm.status.as_ref().and_then(|s| s.phase), to = ?phase, "phase changed");
            }
        }
        if plan.remove_reset_annotation {
            let patch = json!({"metadata": {"annotations": {ANNOTATION_RESET_RESTARTS: null}}});
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| Error::from_kube(&what, e))?;
        }
        if plan.delete {
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => info!(vm = %what, "deleted"),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(Error::from_kube(&what, e)),
            }
        }
        self.report(vm, &plan.notes, &plan.counted).await;
        let requeue = plan.requeue_after.map_or(self.config.timing.resync, |d| {
            d.min(self.config.timing.resync)
        });
        // A timer that is due now still needs a moment for our own write to come back through the watch.
        Ok(Action::requeue(requeue.max(Duration::from_millis(50))))
    }

    /// Replaces the status, with `current`'s resourceVersion as precondition.
    async fn write_status(
        &self,
        api: &Api<ImpVM>,
        mut current: ImpVM,
        status: imp_api::ImpVMStatus,
    ) -> Result<ImpVM> {
        let name = current.name_any();
        current.status = Some(status);
        api.replace_status(&name, &PostParams::default(), &current)
            .await
            .map_err(|e| Error::from_kube(&format!("impvm {}/status", name), e))
    }

    /// VMs occupying capacity on nodes: bound and not stopped, plus our recent bindings the cache lags behind.
    fn residents(&self, except_uid: &str, assumed: &mut HashMap<String, Assumed>) -> Vec<Resident> {
        let size = |class: &str| {
            self.classes.get(&ObjectRef::new(class)).map(|c| {
                (
                    c.spec.vcpu,
                    u64::from(c.spec.memory_mib),
                    u64::from(c.spec.disk_gib()) * 1024,
                )
            })
        };
        let mut out = Vec::new();
        let mut seen_bound = HashMap::new();
        let mut present = std::collections::HashSet::new();
        for vm in self.vms.state() {
            let uid = vm.uid().unwrap_or_default();
            present.insert(uid.clone());
            let Some(node) = vm.spec.node_name.as_deref().filter(|n| !n.is_empty()) else {
                continue;
            };
            seen_bound.insert(uid.clone(), node.to_owned());
            // Torn down counts as stopped: the node released its resources (the VM object goes
            // a moment later, when its finalizer is removed).
            let stopped = matches!(
                vm.status.as_ref().and_then(|s| s.phase),
                Some(VmPhase::Succeeded | VmPhase::Failed | VmPhase::RetryExhausted)
            ) || vm.status.as_ref().is_some_and(|s| {
                imp_api::conditions::is_true(&s.conditions, imp_api::names::condition::TORN_DOWN)
            });
            // A VM the user bound to a node that cannot take it waits there and holds nothing.
            let waiting = vm.status.as_ref().is_some_and(|s| {
                s.phase == Some(VmPhase::Pending)
                    && s.reason.as_deref() == Some(imp_api::names::reason::UNSCHEDULABLE)
            });
            if uid == except_uid || stopped || waiting {
                continue;
            }
            if let Some((vcpu, memory_mib, disk_mib)) = size(&vm.spec.class_ref.name) {
                out.push(Resident {
                    node: node.to_owned(),
                    vcpu,
                    memory_mib,
                    disk_mib,
                });
            }
        }
        assumed
            // A VM gone from the cache holds nothing any more (its finalizer went after the
            // teardown): its reservation must not outlive it for ASSUME_FOR (the chaos suite's node
            // loss kept the next runner Unschedulable for 60 s).
            .retain(|uid, a| {
                present.contains(uid)
                    && seen_bound.get(uid) != Some(&a.node)
                    && a.at.elapsed() < ASSUME_FOR
            });
        for (uid, a) in assumed.iter() {
            if uid != except_uid {
                out.push(Resident {
                    node: a.node.clone(),
                    vcpu: a.vcpu,
                    memory_mib: a.memory_mib,
                    disk_mib: a.disk_mib,
                });
            }
        }
        out
    }

    /// A VM whose spec.nodeName the user set: that node alone, through the scheduler's filters;
    /// Scheduled if it fits (its capacity reserved as for our own choices), else Pending and
    /// Unschedulable naming the node and why.
    async fn schedule_pinned(
        &self,
        api: &Api<ImpVM>,
        vm: &ImpVM,
        request: &VmRequest,
        node: &str,
        now: Timestamp,
    ) -> Result<Action> {
        let what = format!(
            "impvm {}/{}",
            vm.namespace().unwrap_or_default(),
            vm.name_any()
        );
        let uid = vm.uid().ok_or(Error::MissingObjectKey(".metadata.uid"))?;
        let mut assumed = self.assumed.lock().await;
        let nodes = self.node_infos(now);
        let residents = self.residents(&uid, &mut assumed);
        match scheduler::schedule_pinned(request, node, &nodes, &residents) {
            Ok(node) => {
                assumed.insert(uid, Assumed::of(request, &node));
                drop(assumed);
                self.attempt("scheduled");
                let (status, note, _) = decide::bound(vm, &node, now);
                info!(vm = %what, node = %node, "bound by the user: fits, scheduled");
                self.write_status(api, vm.clone(), status).await?;
                self.report(vm, &[note], &[]).await;
                Ok(Action::requeue(self.config.timing.resync))
            }
            Err(why) => {
                drop(assumed);
                self.unschedulable(api, vm, &why, now).await
            }
        }
    }

    async fn schedule(
        &self,
        api: &Api<ImpVM>,
        vm: &ImpVM,
        request: &VmRequest,
        network: Option<&str>,
        now: Timestamp,
    ) -> Result<Action> {
        let name = vm.name_any();
        let what = format!("impvm {}/{}", vm.namespace().unwrap_or_default(), name);
        let uid = vm.uid().ok_or(Error::MissingObjectKey(".metadata.uid"))?;
        let rv = vm
            .resource_version()
            .ok_or(Error::MissingObjectKey(".metadata.resourceVersion"))?;

        let mut assumed = self.assumed.lock().await;
        let nodes = self.node_infos(now);
        let residents = self.residents(&uid, &mut assumed);
        match scheduler::schedule(request, &nodes, &residents) {
            Ok(node) => {
                // The address goes in the binding's own write: the agent never sees the VM bound
                // without it. Allocating under the lock keeps the node's capacity reserved.
                let mut patch =
                    json!({"metadata": {"resourceVersion": rv}, "spec": {"nodeName": node}});
                if let Some(net) = network {
                    match self.allocate(vm, net).await {
                        Ok(lease) => {
                            patch["metadata"]["annotations"] =
                                json!({ANNOTATION_IP_ALLOCATION: lease.annotation()})
                        }
                        Err(e) => {
                            drop(assumed);
                            return self.no_address(vm, net, e).await;
                        }
                    }
                }
                let patched = api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(|e| Error::from_kube(&what, e))?;
                assumed.insert(uid, Assumed::of(request, &node));
                drop(assumed);
                self.attempt("scheduled");
                let (status, note, latency) = decide::bound(&patched, &node, now);
                if let Some(l) = latency {
                    self.metrics.scheduling_latency.observe(l.as_secs_f64());
                }
                info!(vm = %what, node = %node, latency = ?latency, "scheduled");
                // If this write is lost, the next pass finds nodeName set and phase Pending and finishes it.
                self.write_status(api, patched, status).await?;
                self.report(vm, &[note], &[]).await;
                Ok(Action::requeue(self.config.timing.resync))
            }
            Err(why) => {
                drop(assumed);
                self.unschedulable(api, vm, &why, now).await
            }
        }
    }

    /// The scheduler's view of every node in the cache, heartbeats judged at `now`.
    fn node_infos(&self, now: Timestamp) -> Vec<NodeInfo> {
        let stale_after = self.config.timing.heartbeat_stale_after;
        self.nodes
            .state()
            .iter()
            .map(|n| {
                NodeInfo::from_node(
                    n,
                    health::heartbeat(self.lease(&n.name_any()).as_deref(), stale_after, now),
                )
            })
            .collect()
    }

    /// Pending Unschedulable with `why` (status and Event when it changed); retried later.
    async fn unschedulable(
        &self,
        api: &Api<ImpVM>,
        vm: &ImpVM,
        why: &scheduler::Unschedulable,
        now: Timestamp,
    ) -> Result<Action> {
        self.attempt("unschedulable");
        let (status, note) = decide::unschedulable(vm, why, now);
        if Some(&status) != vm.status.as_ref() {
            self.write_status(api, vm.clone(), status).await?;
        }
        if let Some(note) = note {
            info!(vm = %vm.name_any(), reason = %why, "unschedulable");
            self.report(vm, &[note], &[]).await;
        }
        Ok(Action::requeue(self.config.timing.unschedulable_retry))
    }

    /// The VM's address on `net` (the one it holds, else a new one).
    async fn allocate(&self, vm: &ImpVM, net: &str) -> Result<crate::ipam::Lease> {
        let ns = vm
            .namespace()
            .ok_or(Error::MissingObjectKey(".metadata.namespace"))?;
        let uid = vm.uid().ok_or(Error::MissingObjectKey(".metadata.uid"))?;
        self.ipam.allocate(&ns, net, &vm.name_any(), &uid).await
    }

    /// Applies a failed allocation: a network verdict makes the VM Pending with its reason (Event
    /// and metric when the verdict changes) and retries later; any other error is the pass's.
    async fn no_address(&self, vm: &ImpVM, net: &str, err: Error) -> Result<Action> {
        let Some(why) = err.network_reason() else {
            return Err(err);
        };
        // The same words as the verdict decided from the cache, so a lagging cache flips nothing.
        let message = match err {
            Error::NetworkNotFound { .. } => decide::network_not_found_message(net),
            _ => err.to_string(),
        };
        let (status, note) = decide::network_unavailable(vm, why, message, Timestamp::now());
        if Some(&status) != vm.status.as_ref() {
            self.write_status(&self.api(vm)?, vm.clone(), status)
                .await?;
        }
        if let Some(note) = note {
            info!(vm = %vm.name_any(), network = %net, reason = why, error = %err, "no address");
            self.report(vm, &[note], &[Counted::NetworkAllocationFailed(why)])
                .await;
        }
        Ok(Action::requeue(self.config.timing.unschedulable_retry))
    }

    fn attempt(&self, result: &str) {
        self.metrics
            .scheduling_attempts
            .get_or_create(&ResultLabels {
                result: result.to_owned(),
            })
            .inc();
    }

    /// Counts outcomes and publishes Events. Event failures are logged, not fatal: the state is in status.
    async fn report(&self, vm: &ImpVM, notes: &[Note], counted: &[Counted]) {
        // Count first: whoever sees the Event can rely on the metric already being there.
        let m = &self.metrics;
        for c in counted {
            match c {
                Counted::NodeLost(r) => m
                    .node_lost
                    .get_or_create(&ReasonLabels {
                        reason: (*r).to_owned(),
                    })
                    .inc(),
                Counted::Restart(mode) => {
                    let mode = match mode {
                        imp_api::RestartMode::InPlace => "in-place",
                        imp_api::RestartMode::Reschedule => "reschedule",
                    };
                    m.restarts
                        .get_or_create(&ModeLabels {
                            mode: mode.to_owned(),
                        })
                        .inc()
                }
                Counted::RetryExhausted => m.retry_exhausted.inc(),
                Counted::BudgetReset(r) => m
                    .budget_resets
                    .get_or_create(&ReasonLabels {
                        reason: (*r).to_owned(),
                    })
                    .inc(),
                Counted::Expired => m.expired.inc(),
                Counted::FinalizerForced => m.finalizer_forced.inc(),
                Counted::SpecInvalid => m.spec_invalid.inc(),
                Counted::NetworkAllocationFailed(r) => m
                    .network_allocation_failures
                    .get_or_create(&ReasonLabels {
                        reason: (*r).to_owned(),
                    })
                    .inc(),
            };
        }
        for note in notes {
            let ev =
                imp_api::events::event(note.warning, note.reason, truncate(&note.message, 1000));
            if let Err(e) = self.recorder.publish(&ev, &vm.object_ref(&())).await {
                warn!(vm = %vm.name_any(), reason = note.reason, error = %e, "publishing Event failed");
            }
        }
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(node: Option<&str>, phase: Option<VmPhase>) -> Arc<ImpVM> {
        let mut v = json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM", "metadata": {"name": "x"},
            "spec": {"classRef": {"name": "c"}, "image": "i", "lifecycle": "ephemeral", "nodeName": node}});
        if let Some(p) = phase {
            v["status"] = json!({"phase": p});
        }
        Arc::new(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn gauges_count_phases_and_the_per_node_backlog() {
        let vms = [
            vm(None, None),
            vm(None, Some(VmPhase::Pending)),
            vm(Some("a"), Some(VmPhase::Scheduled)),
            vm(Some("a"), Some(VmPhase::Starting)),
            vm(Some("a"), Some(VmPhase::Running)),
            vm(Some("b"), Some(VmPhase::Scheduled)),
            vm(Some("b"), Some(VmPhase::Failed)),
        ];
        let (phases, backlog) = gauge_counts(&vms);
        let phases: Vec<_> = phases.into_iter().collect();
        assert_eq!(
            phases,
            [
                ("Failed", 1),
                ("Pending", 1),
                ("Running", 1),
                (format!("{:?}", VmPhase::Scheduled).as_str(), 2),
                ("Starting", 1),
                ("Unknown", 1)
            ]
            .map(|(p, n)| (p.to_owned(), n))
        );
        assert_eq!(
            backlog.into_iter().collect::<Vec<_>>(),
            [("a".to_owned(), 2), ("b".to_owned(), 1)]
        );
    }

    #[test]
    fn network_gauges_come_from_the_status_and_vanish_with_the_network() {
        let net = |name: &str, status: serde_json::Value| -> Arc<ImpNetwork> {
            Arc::new(
                serde_json::from_value(
                    json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
                    "metadata": {"name": name, "namespace": "ns"},
                    "spec": {"subnet": "192.0.2.0/24", "gateway": "192.0.2.1"}, "status": status}),
                )
                .unwrap(),
            )
        };
        let nets = [
            net("a", json!({"allocated": 3, "capacity": 253})),
            net("full", json!({"allocated": 1, "capacity": 1})),
            net("fresh", json!({})),
        ];
        let counts = network_counts(&nets);
        assert_eq!(
            counts.into_iter().collect::<Vec<_>>(),
            [
                ("ns/a".to_owned(), (3, 250)),
                ("ns/full".to_owned(), (1, 0))
            ]
        );
        let m = VmMetrics::default();
        let last = refresh_network_gauges(&m, &nets, &BTreeMap::new());
        let mut registry = prometheus_client::registry::Registry::default();
        m.register(&mut registry);
        let text = crate::metrics::encode(&registry).unwrap();
        assert!(
            text.contains("imp_network_addresses{network=\"ns/a\",state=\"free\"} 250"),
            "{text}"
        );
        refresh_network_gauges(&m, &nets[1..2], &last);
        let text = crate::metrics::encode(&registry).unwrap();
        assert!(!text.contains("ns/a"), "{text}");
        assert!(text.contains("imp_network_addresses{network=\"ns/full\",state=\"allocated\"} 1"));
    }

    #[test]
    fn long_event_notes_are_cut_on_a_char_boundary() {
        assert_eq!(truncate("short", 10), "short");
        let cut = truncate(&"é".repeat(10), 5);
        assert_eq!(cut, "éé…");
    }
}
