//! The pressureLifecycle's I/O: follows the index's Nodes, ImpVMs and ImpVMClasses, observes them into the views
//! [`decide`] takes, and executes its steps (the suspend patch, Events, the `PressureSuspended`
//! condition, the gauges).

use std::{sync::Arc, time::Duration};

use futures::{StreamExt, stream};
use imp_api::{
    DesiredState, ImpVM, ImpVMClass,
    conditions::{self, ConditionStatus},
    names::{ANNOTATION_PRESSURE_SUSPENDED_AT, condition, reason},
};
use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::{
        events::{Recorder, Reporter},
        reflector::{ObjectRef, Store},
    },
};
use serde_json::json;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use super::config::PressureConfig;
use super::decide::{
    NodeState, NodeView, Plan, Step, VmKey, VmView, decide, state_name, suspend_message,
};
use crate::{
    error::{Error, Result},
    index::Index,
    metrics::{NodeLabels, PressureMetrics, count_reconcile_error},
};

/// Label value of this controller in `imp_operator_reconcile_errors_total`.
const CONTROLLER: &str = "pressure";

// ---------------------------------------------------------------------------------------------------
// Execute

struct Context {
    client: Client,
    config: PressureConfig,
    metrics: PressureMetrics,
    recorder: Recorder,
    vms: Store<ImpVM>,
    nodes: Store<Node>,
    classes: Store<ImpVMClass>,
}

/// Runs the lifecycle on `index`'s caches until the task is dropped.
pub async fn run_pressure_lifecycle(
    client: Client,
    index: Index,
    config: PressureConfig,
    metrics: PressureMetrics,
) {
    let changes = stream::select_all([
        index.nodes.subscribe().map(|_| ()).boxed(),
        index.vms.subscribe().map(|_| ()).boxed(),
        index.classes.subscribe().map(|_| ()).boxed(),
    ]);
    let changed = Arc::new(Notify::new());
    let notify = changed.clone();
    // Every change wakes the pass loop (coalesced: one stored permit).
    let driver = changes.for_each(move |_| {
        notify.notify_one();
        async {}
    });

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: config.reporter.clone(),
            instance: None,
        },
    );
    let ctx = Context {
        client,
        config,
        metrics,
        recorder,
        vms: index.vms.store(),
        nodes: index.nodes.store(),
        classes: index.classes.store(),
    };
    let passes = async {
        // Deciding on half-filled caches would miss marked VMs or pressured nodes.
        index.ready().await;
        info!("pressureLifecycle caches filled; watching nodes for MemoryPressure");
        loop {
            let requeue = ctx.pass().await;
            tokio::select! {
                () = changed.notified() => {}
                () = tokio::time::sleep(requeue) => {}
            }
        }
    };
    tokio::select! {
        () = driver => warn!("pressureLifecycle watches ended"),
        () = passes => {}
    }
}

impl Context {
    /// Observe, decide, execute; returns when the next pass is due at the latest.
    async fn pass(&self) -> Duration {
        let now = Timestamp::now();
        let nodes: Vec<NodeView> = self
            .nodes
            .state()
            .iter()
            .map(|n| NodeView::from_node(n))
            .collect();
        let vms: Vec<VmView> = self
            .vms
            .state()
            .iter()
            .map(|vm| {
                let memory = self
                    .classes
                    .get(&ObjectRef::new(&vm.spec.class_ref.name))
                    .map(|c| u64::from(c.spec.memory_mib));
                VmView::from_vm(vm, memory)
            })
            .collect();
        let plan = decide(&nodes, &vms, now, self.config.suspend_timeout);
        self.gauges(&plan);
        for step in &plan.steps {
            if let Err(e) = self.execute(step, now).await {
                count_reconcile_error(&self.metrics.errors, CONTROLLER, &e);
                match e {
                    // The cache was behind; the newer object comes through the watch.
                    Error::Conflict(_) => debug!(error = %e, "pressureLifecycle write raced"),
                    e => warn!(error = %e, "pressureLifecycle step failed"),
                }
            }
        }
        plan.requeue_after
            .map_or(self.config.resync, |d| d.min(self.config.resync))
            .max(Duration::from_millis(50))
    }

    fn gauges(&self, plan: &Plan) {
        let m = &self.metrics;
        m.nodes.set(plan.pressured.len() as i64);
        m.nodes_exhausted.set(
            plan.pressured
                .values()
                .filter(|s| **s == NodeState::Exhausted)
                .count() as i64,
        );
        m.held.set(plan.held as i64);
    }

    fn vm(&self, key: &VmKey) -> Option<Arc<ImpVM>> {
        self.vms
            .get(&ObjectRef::new(&key.name).within(&key.namespace))
    }

    async fn execute(&self, step: &Step, now: Timestamp) -> Result<()> {
        match step {
            Step::Suspend {
                vm: key,
                node,
                memory_mib,
                previous,
            } => {
                let Some(vm) = self.vm(key) else {
                    return Ok(());
                };
                let rv = vm
                    .resource_version()
                    .ok_or(Error::MissingObjectKey(".metadata.resourceVersion"))?;
                let patch = json!({
                    "metadata": {"resourceVersion": rv,
                                 "annotations": {ANNOTATION_PRESSURE_SUSPENDED_AT: now.to_string()}},
                    "spec": {"desiredState": "Suspended"},
                });
                let api = self.api(key);
                let patched = api
                    .patch(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(|e| Error::from_kube(&format!("impvm {key}"), e))?;
                self.metrics
                    .suspensions
                    .get_or_create(&NodeLabels { node: node.clone() })
                    .inc();
                info!(vm = %key, node = %node, memory_mib = ?memory_mib, "suspending for node memory pressure");
                let message = suspend_message(key, Some(node), *memory_mib, *previous);
                self.event(
                    &patched,
                    true,
                    reason::SUSPENDED_FOR_MEMORY_PRESSURE,
                    &message,
                )
                .await;
                self.set_condition(
                    key,
                    ConditionStatus::True,
                    reason::SUSPENDED_FOR_MEMORY_PRESSURE,
                    &message,
                )
                .await
            }
            Step::Record { vm: key, node } => {
                let Some(vm) = self.vm(key) else {
                    return Ok(());
                };
                let memory = self
                    .classes
                    .get(&ObjectRef::new(&vm.spec.class_ref.name))
                    .map(|c| u64::from(c.spec.memory_mib));
                let message = suspend_message(key, node.as_deref(), memory, DesiredState::Running);
                self.event(&vm, true, reason::SUSPENDED_FOR_MEMORY_PRESSURE, &message)
                    .await;
                self.set_condition(
                    key,
                    ConditionStatus::True,
                    reason::SUSPENDED_FOR_MEMORY_PRESSURE,
                    &message,
                )
                .await
            }
            Step::Stall {
                vm: key,
                node,
                phase,
                waited,
            } => {
                let Some(vm) = self.vm(key) else {
                    return Ok(());
                };
                let phase = phase.map_or_else(|| "none".to_owned(), |p| format!("{p:?}"));
                let message = format!(
                    "asked to suspend for memory pressure on node {node} {}s ago, the VM is still {phase}: the \
                     pressureLifecycle moves on to the next VM there. It stays at desiredState: Suspended; check \
                     the node's agent (SuspendCallFailed Events); resume with spec.desiredState: Running",
                    waited.as_secs()
                );
                self.metrics.stalls.inc();
                warn!(vm = %key, node = %node, "suspend for memory pressure stalled");
                self.event(&vm, true, reason::PRESSURE_SUSPEND_STALLED, &message)
                    .await;
                self.set_condition(
                    key,
                    ConditionStatus::True,
                    reason::PRESSURE_SUSPEND_STALLED,
                    &message,
                )
                .await
            }
            Step::Lift { vm: key, desired } => {
                let Some(vm) = self.vm(key) else {
                    return Ok(());
                };
                let message = format!(
                    "spec.desiredState is {} again: the memory-pressure suspend is lifted. The pressureLifecycle \
                     does not suspend this VM again while its node's current memory pressure lasts",
                    state_name(*desired)
                );
                // Condition first: if the mark's removal is lost, the next pass lifts again.
                self.set_condition(
                    key,
                    ConditionStatus::False,
                    reason::PRESSURE_SUSPEND_LIFTED,
                    &message,
                )
                .await?;
                let patch =
                    json!({"metadata": {"annotations": {ANNOTATION_PRESSURE_SUSPENDED_AT: null}}});
                self.api(key)
                    .patch(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(|e| Error::from_kube(&format!("impvm {key}"), e))?;
                self.metrics.lifts.inc();
                info!(vm = %key, "memory-pressure suspend lifted");
                self.event(&vm, false, reason::PRESSURE_SUSPEND_LIFTED, &message)
                    .await;
                Ok(())
            }
        }
    }

    fn api(&self, key: &VmKey) -> Api<ImpVM> {
        Api::namespaced(self.client.clone(), &key.namespace)
    }

    /// Read-modify-write of the status (the agent and the ImpVM controller write it too), retried on
    /// conflict; other conditions are kept as read.
    async fn set_condition(
        &self,
        key: &VmKey,
        status: ConditionStatus,
        reason: &str,
        message: &str,
    ) -> Result<()> {
        let api = self.api(key);
        let what = format!("impvm {key}/status");
        for _ in 0..5 {
            let mut vm = match api.get_status(&key.name).await {
                Ok(vm) => vm,
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
                Err(e) => return Err(Error::from_kube(&what, e)),
            };
            let generation = vm.metadata.generation;
            let s = vm.status.get_or_insert_with(Default::default);
            if !conditions::set(
                &mut s.conditions,
                condition::PRESSURE_SUSPENDED,
                status,
                reason,
                message,
                generation,
                Timestamp::now(),
            ) {
                return Ok(());
            }
            match api
                .replace_status(&key.name, &PostParams::default(), &vm)
                .await
            {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(Error::from_kube(&what, e)),
            }
        }
        Err(Error::Conflict(what))
    }

    async fn event(&self, vm: &ImpVM, warning: bool, reason: &str, message: &str) {
        let ev = imp_api::events::event(warning, reason, message.to_owned());
        if let Err(e) = self.recorder.publish(&ev, &vm.object_ref(&())).await {
            warn!(vm = %vm.name_any(), reason, error = %e, "publishing Event failed");
        }
    }
}
