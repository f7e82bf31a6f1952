//! The ImpVM state machine as a pure function: observed VM, its class, the health of its node and the
//! time in; a [`Plan`] of writes, Events and a requeue out. The controller executes plans; nothing here
//! does I/O, so every transition is unit-tested below.
//!
//! One pass makes one step; the write it causes triggers the next pass. The operator writes phases
//! Pending, Scheduled, Terminating, Failed (NodeLost, SpecInvalid) and RetryExhausted, conditions
//! Scheduled and NodeHealthy, spec.nodeName and status.restarts; the agent writes the rest
//! (docs/vm-lifecycle.md).

use std::time::Duration;

use imp_api::{
    ImpVM, ImpVMClassSpec, ImpVMStatus, Lifecycle, OnExhaustion, ResolvedRestartPolicy,
    RestartMode, RestartPolicy, VmPhase,
    conditions::{self, ConditionStatus},
    names::{
        ANNOTATION_IP_ALLOCATION, ANNOTATION_RESET_RESTARTS, FINALIZER_VM_CLEANUP, condition,
        reason,
    },
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::ResourceExt;

use super::{
    config::Timing,
    health::{NodeHealth, add, until},
};
use crate::scheduler::{Unschedulable, VmRequest};

/// An Event to publish about the VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Note {
    fn normal(reason: &'static str, message: impl Into<String>) -> Self {
        Note {
            warning: false,
            reason,
            message: message.into(),
        }
    }
    fn warning(reason: &'static str, message: impl Into<String>) -> Self {
        Note {
            warning: true,
            reason,
            message: message.into(),
        }
    }
}

/// What the controller counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Counted {
    NodeLost(&'static str),
    Restart(RestartMode),
    RetryExhausted,
    BudgetReset(&'static str),
    Expired,
    FinalizerForced,
    SpecInvalid,
    /// The VM's address could not be allocated (NetworkExhausted, NetworkNotFound, NetworkInvalid).
    NetworkAllocationFailed(&'static str),
}

/// What one reconcile pass should do, in the order the controller applies it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub add_finalizer: bool,
    /// Run the scheduler with this request, then apply [`bound`] or [`unschedulable`].
    pub schedule: Option<VmRequest>,
    /// Allocate the VM's address on this ImpNetwork and record it in the allocation annotation:
    /// in the binding's own write when [`Plan::schedule`] is set, else before anything else
    /// (a VM bound by the user). A failure is applied with [`network_unavailable`].
    pub allocate: Option<String>,
    /// Free the VM's address on this ImpNetwork before the finalizer is removed.
    pub release: Option<String>,
    /// With [`Plan::schedule`]: the node in spec.nodeName (set by the user), checked alone; the
    /// status in [`Plan::status`] is the base the Scheduled or Unschedulable status builds on.
    pub schedule_on: Option<String>,
    /// Clear spec.nodeName (reschedule) before writing status.
    pub clear_node: bool,
    /// The full new status, when it differs from the observed one.
    pub status: Option<ImpVMStatus>,
    pub remove_reset_annotation: bool,
    pub delete: bool,
    pub remove_finalizer: bool,
    pub notes: Vec<Note>,
    pub counted: Vec<Counted>,
    pub requeue_after: Option<Duration>,
}

impl Plan {
    fn requeue_within(&mut self, d: Duration) {
        self.requeue_after = Some(self.requeue_after.map_or(d, |r| r.min(d)));
    }
    fn set_status(&mut self, observed: &ImpVMStatus, new: ImpVMStatus) {
        if &new != observed {
            self.status = Some(new);
        }
    }
}

/// Everything a decision depends on.
pub struct Input<'a> {
    pub vm: &'a ImpVM,
    /// None when the class named by classRef does not exist.
    pub class: Option<&'a ImpVMClassSpec>,
    /// Health of the node in spec.nodeName (ignored when unbound).
    pub node: &'a NodeHealth,
    /// Whether the ImpNetwork named by spec.networkRef exists (ignored without a networkRef).
    pub network_found: bool,
    pub timing: &'a Timing,
    pub now: Timestamp,
}

/// Delay before restart number `n + 1` (n restarts already spent): min(initialDelay * 2^n, maxDelay).
pub fn backoff_delay(policy: &ResolvedRestartPolicy, n: u32) -> Duration {
    imp_common::Backoff::new(policy.initial_delay, policy.max_delay).delay(n)
}

/// The VM's restart policy, inherited from the class when the VM sets none.
pub fn restart_policy(
    vm: &ImpVM,
    class: Option<&ImpVMClassSpec>,
) -> Result<ResolvedRestartPolicy, String> {
    match (
        &vm.spec.restart_policy,
        class.and_then(|c| c.restart_policy.as_ref()),
    ) {
        (Some(p), _) => p.resolve("spec.restartPolicy").map_err(|e| e.to_string()),
        (None, Some(p)) => p
            .resolve("ImpVMClass spec.restartPolicy")
            .map_err(|e| e.to_string()),
        (None, None) => RestartPolicy::default()
            .resolve("spec.restartPolicy")
            .map_err(|e| e.to_string()),
    }
}

pub fn request(vm: &ImpVM, class: &ImpVMClassSpec) -> VmRequest {
    VmRequest {
        vcpu: class.vcpu,
        memory_mib: u64::from(class.memory_mib),
        disk_mib: u64::from(class.disk_gib()) * 1024,
        node_selector: vm.spec.node_selector.clone().unwrap_or_default(),
        tolerations: vm.spec.tolerations.clone().unwrap_or_default(),
        template_of: template_of(vm),
    }
}

/// The pool whose snapshot template a `startFrom: Template` VM is cloned from: its controlling
/// ImpVMRunnerPool (the agents report Ready templates by pool uid). None for a VM that boots, or
/// one no pool controls (it boots cold on whichever node it lands).
pub fn template_of(vm: &ImpVM) -> Option<String> {
    if vm.spec.start_from() != imp_api::StartFrom::Template {
        return None;
    }
    vm.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "ImpVMRunnerPool")
        .map(|o| o.uid.clone())
}

/// The ImpNetwork the VM attaches to.
fn network(vm: &ImpVM) -> Option<&str> {
    vm.spec.network_ref.as_ref().map(|r| r.name.as_str())
}

/// The VM's recorded address (`ADDR/PREFIX`), see [`ANNOTATION_IP_ALLOCATION`].
pub fn allocation(vm: &ImpVM) -> Option<&str> {
    vm.annotations()
        .get(ANNOTATION_IP_ALLOCATION)
        .map(String::as_str)
        .filter(|a| !a.is_empty())
}

fn has_finalizer(vm: &ImpVM) -> bool {
    vm.finalizers().iter().any(|f| f == FINALIZER_VM_CLEANUP)
}

/// `now + d`, rounded up to a whole second. Status times are stored with second resolution, so a
/// deadline rounded down could fire up to a second early; rounded up it never fires before `d`.
pub fn deadline(now: Timestamp, d: Duration) -> Timestamp {
    let t = add(now, d);
    if t.subsec_nanosecond() == 0 {
        return t;
    }
    Timestamp::from_second(t.as_second()).map_or(t, |s| add(s, Duration::from_secs(1)))
}

/// One reconcile step.
pub fn decide(i: &Input<'_>) -> Plan {
    let vm = i.vm;
    let observed = vm.status.clone().unwrap_or_default();
    let mut plan = Plan::default();

    if vm.metadata.deletion_timestamp.is_some() {
        let mut plan = cleanup(i, observed);
        if plan.remove_finalizer {
            // Also when forced: the node is gone, so nothing uses the address any more.
            plan.release = network(vm).map(str::to_owned);
        }
        return plan;
    }
    if !has_finalizer(vm) {
        plan.add_finalizer = true;
        return plan;
    }

    let policy = restart_policy(vm, i.class);
    let expire_after = vm.spec.expire_after().map_err(|e| e.to_string());
    let invalid = match (&policy, &expire_after) {
        (Err(e), _) | (_, Err(e)) => Some(e.clone()),
        _ => None,
    };
    if let Some(message) = invalid {
        return spec_invalid(&observed, message);
    }
    let (Ok(policy), Ok(expire_after)) = (policy, expire_after) else {
        unreachable!("checked above")
    };

    // expireAfter counts from the first Running, whatever the phase is now.
    if let (Some(expire), Some(first)) = (expire_after, observed.first_running_time.as_ref()) {
        let at = add(first.0, expire);
        if i.now >= at {
            let mut status = observed.clone();
            status.reason = Some(reason::EXPIRED.to_owned());
            status.message = Some(format!(
                "expireAfter {expire:?} elapsed since first Running at {}",
                first.0
            ));
            plan.set_status(&observed, status);
            plan.delete = true;
            plan.notes.push(Note::normal(
                reason::EXPIRED,
                format!(
                    "deleting: expireAfter {expire:?} elapsed since first Running at {}",
                    first.0
                ),
            ));
            plan.counted.push(Counted::Expired);
            return plan;
        }
        plan.requeue_within(until(i.now, at));
    }

    let persistent = vm.spec.lifecycle == Lifecycle::Persistent;
    if persistent && vm.annotations().contains_key(ANNOTATION_RESET_RESTARTS) {
        return manual_reset(i, observed, &policy, plan);
    }

    let bound = vm.spec.node_name.as_deref().filter(|n| !n.is_empty());
    let phase = observed.phase;
    match phase {
        Some(VmPhase::RetryExhausted) => exhausted(i, observed, &policy, plan),
        Some(VmPhase::Succeeded | VmPhase::Failed)
            if phase_is_spec_invalid(&observed) && bound.is_none() =>
        {
            // The class may have appeared since: try again from Pending. (A bound VM is never
            // rescheduled from here; it is handled as any stopped VM below.)
            schedule_or_invalid(i, observed, plan)
        }
        Some(VmPhase::Succeeded | VmPhase::Failed) if persistent => {
            stopped(i, observed, &policy, plan)
        }
        Some(VmPhase::Succeeded | VmPhase::Failed) => plan, // ephemeral: its pool deletes it
        Some(VmPhase::Suspending | VmPhase::Suspended | VmPhase::Resuming) => plan, // reserved, not driven yet
        Some(VmPhase::Terminating) => plan, // only without deletionTimestamp after a restore; nothing to do
        None
        | Some(VmPhase::Pending | VmPhase::Scheduled | VmPhase::Starting | VmPhase::Running) => {
            match bound {
                None => schedule_or_invalid(i, observed, plan),
                Some(node) => active_on_node(i, observed, node, plan),
            }
        }
    }
}

fn phase_is_spec_invalid(s: &ImpVMStatus) -> bool {
    s.phase == Some(VmPhase::Failed) && s.reason.as_deref() == Some(reason::SPEC_INVALID)
}

fn spec_invalid(observed: &ImpVMStatus, message: String) -> Plan {
    let mut plan = Plan::default();
    let mut status = observed.clone();
    status.phase = Some(VmPhase::Failed);
    status.reason = Some(reason::SPEC_INVALID.to_owned());
    status.message = Some(message.clone());
    if !phase_is_spec_invalid(observed) || observed.message.as_deref() != Some(&message) {
        plan.notes
            .push(Note::warning(reason::SPEC_INVALID, message));
        plan.counted.push(Counted::SpecInvalid);
    }
    plan.set_status(observed, status);
    plan
}

fn schedule_or_invalid(i: &Input<'_>, observed: ImpVMStatus, mut plan: Plan) -> Plan {
    let Some(class) = i.class else {
        let name = &i.vm.spec.class_ref.name;
        let message = format!("spec.classRef: ImpVMClass {name:?} does not exist");
        let mut p = spec_invalid(&observed, message.clone());
        let mut status = p.status.take().unwrap_or_else(|| observed.clone());
        conditions::set(
            &mut status.conditions,
            condition::SCHEDULED,
            ConditionStatus::False,
            reason::CLASS_NOT_FOUND,
            message,
            i.vm.metadata.generation,
            i.now,
        );
        p.set_status(&observed, status);
        p.requeue_after = plan.requeue_after;
        return p;
    };
    if let Some(net) = network(i.vm) {
        if !i.network_found {
            return network_missing(i, observed, net, plan);
        }
        plan.allocate = Some(net.to_owned());
    }
    plan.schedule = Some(request(i.vm, class));
    plan
}

/// Pending with NetworkNotFound: decided here from the cache, without asking IPAM.
fn network_missing(i: &Input<'_>, observed: ImpVMStatus, net: &str, mut plan: Plan) -> Plan {
    let message = network_not_found_message(net);
    let vm = ImpVM {
        status: Some(observed.clone()),
        ..i.vm.clone()
    };
    let (status, note) = network_unavailable(&vm, reason::NETWORK_NOT_FOUND, message, i.now);
    plan.set_status(&observed, status);
    if let Some(note) = note {
        plan.notes.push(note);
        plan.counted
            .push(Counted::NetworkAllocationFailed(reason::NETWORK_NOT_FOUND));
    }
    plan.requeue_within(i.timing.unschedulable_retry);
    plan
}

/// The message of NetworkNotFound.
pub fn network_not_found_message(net: &str) -> String {
    format!("spec.networkRef: ImpNetwork {net:?} does not exist")
}

/// Status of a VM that cannot get an address (`why`: NetworkExhausted, NetworkNotFound or
/// NetworkInvalid): Pending, not bound. The Event only when the verdict changes, so the retries
/// (every unschedulableRetry, and whenever the network changes) do not spam.
pub fn network_unavailable(
    vm: &ImpVM,
    why: &'static str,
    message: String,
    now: Timestamp,
) -> (ImpVMStatus, Option<Note>) {
    let observed = vm.status.clone().unwrap_or_default();
    let mut status = observed.clone();
    status.phase = Some(VmPhase::Pending);
    status.reason = Some(why.to_owned());
    status.message = Some(message.clone());
    conditions::set(
        &mut status.conditions,
        condition::SCHEDULED,
        ConditionStatus::False,
        why,
        message.clone(),
        vm.metadata.generation,
        now,
    );
    let changed =
        observed.reason.as_deref() != Some(why) || observed.message.as_deref() != Some(&message);
    (status, changed.then(|| Note::warning(why, message)))
}

/// Status after binding the VM to `node`; also the scheduling latency to record (first binding only).
pub fn bound(vm: &ImpVM, node: &str, now: Timestamp) -> (ImpVMStatus, Note, Option<Duration>) {
    let mut status = vm.status.clone().unwrap_or_default();
    let latency = match (&status.restarts, &vm.metadata.creation_timestamp) {
        (None, Some(created)) => Some(until(created.0, now)),
        _ => None,
    };
    status.phase = Some(VmPhase::Scheduled);
    status.reason = None;
    status.message = None;
    status.scheduled_time = Some(Time(now));
    conditions::set(
        &mut status.conditions,
        condition::SCHEDULED,
        ConditionStatus::True,
        reason::NODE_ASSIGNED,
        format!("bound to node {node}"),
        vm.metadata.generation,
        now,
    );
    (
        status,
        Note::normal(reason::SCHEDULED, format!("bound to node {node}")),
        latency,
    )
}

/// Status of a VM no node can take; the Event only when the reasons change, so retries do not spam.
pub fn unschedulable(
    vm: &ImpVM,
    why: &Unschedulable,
    now: Timestamp,
) -> (ImpVMStatus, Option<Note>) {
    let observed = vm.status.clone().unwrap_or_default();
    let message = why.to_string();
    let mut status = observed.clone();
    status.phase = Some(VmPhase::Pending);
    status.reason = Some(reason::UNSCHEDULABLE.to_owned());
    status.message = Some(message.clone());
    conditions::set(
        &mut status.conditions,
        condition::SCHEDULED,
        ConditionStatus::False,
        reason::UNSCHEDULABLE,
        message.clone(),
        vm.metadata.generation,
        now,
    );
    let changed = observed.reason.as_deref() != Some(reason::UNSCHEDULABLE)
        || observed.message.as_deref() != Some(&message);
    (
        status,
        changed.then(|| Note::warning(reason::FAILED_SCHEDULING, message)),
    )
}

/// A VM bound to `node` and not stopped: watch the node.
fn active_on_node(i: &Input<'_>, observed: ImpVMStatus, node: &str, mut plan: Plan) -> Plan {
    let generation = i.vm.metadata.generation;
    let mut status = observed.clone();
    match i.node {
        NodeHealth::Lost {
            reason: why,
            message,
        } => {
            conditions::set(
                &mut status.conditions,
                condition::NODE_HEALTHY,
                ConditionStatus::False,
                why,
                message.clone(),
                generation,
                i.now,
            );
            status.phase = Some(VmPhase::Failed);
            status.reason = Some(reason::NODE_LOST.to_owned());
            status.message = Some(format!("{why}: {message}"));
            plan.notes.push(Note::warning(
                reason::NODE_LOST,
                format!("{why}: {message}"),
            ));
            plan.counted.push(Counted::NodeLost(why));
            plan.set_status(&observed, status);
            return plan;
        }
        NodeHealth::Degraded {
            reason: why,
            message,
            lost_at,
        } => {
            conditions::set(
                &mut status.conditions,
                condition::NODE_HEALTHY,
                ConditionStatus::Unknown,
                why,
                message.clone(),
                generation,
                i.now,
            );
            plan.requeue_within(until(i.now, *lost_at));
        }
        NodeHealth::Healthy { recheck_at } => {
            conditions::set(
                &mut status.conditions,
                condition::NODE_HEALTHY,
                ConditionStatus::True,
                reason::NODE_READY,
                format!("node {node} Ready, agent heartbeat fresh"),
                generation,
                i.now,
            );
            if let Some(t) = recheck_at {
                plan.requeue_within(until(i.now, *t));
            }
        }
    }
    if matches!(observed.phase, None | Some(VmPhase::Pending)) {
        if let Some(net) = network(i.vm).filter(|_| allocation(i.vm).is_none()) {
            // Bound by the user: the address first (the agent waits for it), Scheduled after.
            if !i.network_found {
                return network_missing(i, observed, net, plan);
            }
            plan.allocate = Some(net.to_owned());
            plan.set_status(&observed, status);
            return plan;
        }
        // spec.nodeName set by the user, or the status half of our own binding did not land:
        // the node passes the scheduler's filters (taints, capacity) as any choice of ours does,
        // else the VM waits Pending and the agent never sees it Scheduled.
        let Some(class) = i.class else {
            return schedule_or_invalid(i, observed, plan);
        };
        plan.schedule = Some(request(i.vm, class));
        plan.schedule_on = Some(node.to_owned());
    }
    plan.set_status(&observed, status);
    plan
}

/// A persistent VM that stopped (agent reported Succeeded/Failed, or the operator failed it on node loss).
fn stopped(
    i: &Input<'_>,
    observed: ImpVMStatus,
    policy: &ResolvedRestartPolicy,
    mut plan: Plan,
) -> Plan {
    let restarts = observed.restarts.clone().unwrap_or_default();
    let last = describe_stop(&observed);
    if restarts.count >= policy.max_retries {
        let mut status = observed.clone();
        let mut r = restarts.clone();
        r.exhausted_time = Some(Time(i.now));
        r.next_restart_time = None;
        status.restarts = Some(r);
        status.phase = Some(VmPhase::RetryExhausted);
        status.reason = Some(reason::RETRY_EXHAUSTED.to_owned());
        let then = match policy.on_exhaustion {
            OnExhaustion::Fail => {
                "onExhaustion fail: stays down until changed or deleted".to_owned()
            }
            OnExhaustion::CoolDown => {
                let at = deadline(i.now, policy.cool_down_period.unwrap_or_default());
                // The reset is the next restart: recorded where the agent and kubectl can see it.
                status
                    .restarts
                    .as_mut()
                    .expect("set above")
                    .next_restart_time = Some(Time(at));
                plan.requeue_within(until(i.now, at));
                format!("onExhaustion cool-down: budget resets at {at}")
            }
            OnExhaustion::ManualReset => format!(
                "onExhaustion manual-reset: annotate {ANNOTATION_RESET_RESTARTS} to restart"
            ),
        };
        let message = format!(
            "{} of {} restarts spent; last stop: {last}; {then}",
            restarts.count, policy.max_retries
        );
        status.message = Some(message.clone());
        plan.notes
            .push(Note::warning(reason::RETRY_EXHAUSTED, message));
        plan.counted.push(Counted::RetryExhausted);
        plan.set_status(&observed, status);
        return plan;
    }
    match restarts.next_restart_time.as_ref().map(|t| t.0) {
        None => {
            let delay = backoff_delay(policy, restarts.count);
            let mut status = observed.clone();
            let mut r = restarts.clone();
            let at = deadline(i.now, delay);
            r.next_restart_time = Some(Time(at));
            status.restarts = Some(r);
            plan.notes.push(Note::normal(
                reason::BACK_OFF,
                format!(
                    "{last}; restart {} of {} in {delay:?}",
                    restarts.count + 1,
                    policy.max_retries
                ),
            ));
            plan.set_status(&observed, status);
            plan.requeue_within(until(i.now, at));
            plan
        }
        Some(at) if i.now < at => {
            plan.requeue_within(until(i.now, at));
            plan
        }
        Some(_) => {
            let base = observed.clone();
            restart(i, &observed, base, policy, restarts.count + 1, plan)
        }
    }
}

fn describe_stop(s: &ImpVMStatus) -> String {
    let phase = match s.phase {
        Some(VmPhase::Succeeded) => "Succeeded",
        _ => "Failed",
    };
    match (&s.reason, &s.message) {
        (Some(r), Some(m)) => format!("{phase} ({r}: {m})"),
        (Some(r), None) => format!("{phase} ({r})"),
        _ => phase.to_owned(),
    }
}

/// Starts run `count` of the budget: back to Pending on a fresh node, or Scheduled on the same one.
/// `base` is the status to build on (the observed one, or one with its budget just reset).
fn restart(
    i: &Input<'_>,
    observed: &ImpVMStatus,
    base: ImpVMStatus,
    policy: &ResolvedRestartPolicy,
    count: u32,
    mut plan: Plan,
) -> Plan {
    let generation = i.vm.metadata.generation;
    let node = i.vm.spec.node_name.as_deref().filter(|n| !n.is_empty());
    // In-place needs the node: a lost or deleted node means rescheduling whatever the policy says.
    let mode = match (policy.mode, node) {
        (RestartMode::InPlace, Some(_)) if i.node.is_healthy() => RestartMode::InPlace,
        _ => RestartMode::Reschedule,
    };
    let last = describe_stop(observed);
    let mut status = base;
    let mut r = status.restarts.clone().unwrap_or_default();
    r.count = count;
    r.last_restart_time = Some(Time(i.now));
    r.next_restart_time = None;
    r.exhausted_time = None;
    status.restarts = Some(r);
    status.reason = None;
    status.message = None;
    match mode {
        RestartMode::InPlace => {
            let node = node.unwrap_or_default();
            status.phase = Some(VmPhase::Scheduled);
            status.scheduled_time = Some(Time(i.now));
            conditions::set(
                &mut status.conditions,
                condition::SCHEDULED,
                ConditionStatus::True,
                reason::NODE_ASSIGNED,
                format!("restarting in place on node {node}"),
                generation,
                i.now,
            );
        }
        RestartMode::Reschedule => {
            plan.clear_node = node.is_some();
            status.phase = Some(VmPhase::Pending);
            status.scheduled_time = None;
            conditions::remove(&mut status.conditions, condition::NODE_HEALTHY);
            conditions::set(
                &mut status.conditions,
                condition::SCHEDULED,
                ConditionStatus::False,
                reason::RESCHEDULING,
                "restart: waiting for the scheduler to pick a node",
                generation,
                i.now,
            );
        }
    }
    let mode_name = match mode {
        RestartMode::InPlace => "in place",
        RestartMode::Reschedule => "on a newly chosen node",
    };
    let budget = if count == 0 {
        "budget reset".to_owned()
    } else {
        format!("restart {count} of {}", policy.max_retries)
    };
    plan.notes.push(Note::normal(
        reason::RESTARTING,
        format!("{budget}, {mode_name}, after {last}"),
    ));
    plan.counted.push(Counted::Restart(mode));
    plan.set_status(observed, status);
    plan
}

fn reset_budget(
    i: &Input<'_>,
    observed: ImpVMStatus,
    policy: &ResolvedRestartPolicy,
    why: &'static str,
    mut plan: Plan,
) -> Plan {
    let spent = observed.restarts.as_ref().map_or(0, |r| r.count);
    plan.notes.push(Note::normal(
        reason::RESTART_BUDGET_RESET,
        format!("{why}: {spent} spent restarts forgiven"),
    ));
    plan.counted.push(Counted::BudgetReset(why));
    let mut cleared = observed.clone();
    if let Some(r) = cleared.restarts.as_mut() {
        r.count = 0;
        r.exhausted_time = None;
        r.next_restart_time = None;
    }
    if observed.phase == Some(VmPhase::RetryExhausted) {
        // The reset itself restarts the VM; it does not spend from the new budget.
        return restart(i, &observed, cleared, policy, 0, plan);
    }
    plan.set_status(&observed, cleared);
    plan
}

fn exhausted(
    i: &Input<'_>,
    observed: ImpVMStatus,
    policy: &ResolvedRestartPolicy,
    mut plan: Plan,
) -> Plan {
    if policy.on_exhaustion != OnExhaustion::CoolDown {
        return plan;
    }
    let Some(period) = policy.cool_down_period else {
        return plan;
    };
    let restarts = observed.restarts.as_ref();
    let at = match restarts.and_then(|r| r.next_restart_time.as_ref()) {
        Some(t) => t.0,
        None => {
            let since = restarts
                .and_then(|r| r.exhausted_time.as_ref())
                .map(|t| t.0)
                .unwrap_or(i.now);
            deadline(since, period)
        }
    };
    if i.now >= at {
        return reset_budget(i, observed, policy, reason::COOL_DOWN_ELAPSED, plan);
    }
    plan.requeue_within(until(i.now, at));
    plan
}

fn manual_reset(
    i: &Input<'_>,
    observed: ImpVMStatus,
    policy: &ResolvedRestartPolicy,
    mut plan: Plan,
) -> Plan {
    plan.remove_reset_annotation = true;
    let spent = observed
        .restarts
        .as_ref()
        .is_some_and(|r| r.count > 0 || r.exhausted_time.is_some());
    if !spent {
        return plan;
    }
    reset_budget(i, observed, policy, reason::MANUAL_RESET, plan)
}

/// Deletion: Terminating until the agent reports TornDown; forced after the timeout if the node is lost.
fn cleanup(i: &Input<'_>, observed: ImpVMStatus) -> Plan {
    let mut plan = Plan::default();
    if !has_finalizer(i.vm) {
        return plan;
    }
    let Some(node) = i.vm.spec.node_name.as_deref().filter(|n| !n.is_empty()) else {
        // Never bound: nothing exists on any host.
        plan.remove_finalizer = true;
        return plan;
    };
    if conditions::is_true(&observed.conditions, condition::TORN_DOWN) {
        plan.remove_finalizer = true;
        plan.notes.push(Note::normal(
            reason::TORN_DOWN,
            format!("node {node} released the VM's resources"),
        ));
        return plan;
    }
    if observed.phase != Some(VmPhase::Terminating) {
        let mut status = observed.clone();
        status.phase = Some(VmPhase::Terminating);
        plan.notes.push(Note::normal(
            reason::TERMINATING,
            format!("waiting for the imp agent on node {node} to tear the VM down"),
        ));
        plan.set_status(&observed, status);
    }
    let since =
        i.vm.metadata
            .deletion_timestamp
            .as_ref()
            .map(|t| t.0)
            .unwrap_or(i.now);
    let deadline = add(since, i.timing.finalizer_timeout);
    match i.node {
        NodeHealth::Lost {
            reason: why,
            message,
        } if i.now >= deadline => {
            plan.status = None;
            plan.remove_finalizer = true;
            plan.notes.push(Note::warning(
                reason::FINALIZER_FORCED,
                format!(
                    "removed {FINALIZER_VM_CLEANUP} without a teardown record after {:?}: {why}: {message}; \
                     check the host for a leftover Firecracker process, TAP device and disk",
                    i.timing.finalizer_timeout
                ),
            ));
            plan.counted.push(Counted::FinalizerForced);
        }
        NodeHealth::Lost { .. } => plan.requeue_within(until(i.now, deadline)),
        NodeHealth::Degraded { lost_at, .. } => {
            plan.requeue_within(until(i.now, (*lost_at).max(deadline)))
        }
        NodeHealth::Healthy { recheck_at } => {
            plan.requeue_within(i.timing.resync);
            if let Some(t) = recheck_at {
                plan.requeue_within(until(i.now, *t));
            }
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::Rejection;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use serde_json::json;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn timing() -> Timing {
        Timing {
            node_not_ready_grace: Duration::from_secs(40),
            heartbeat_stale_after: Duration::from_secs(40),
            finalizer_timeout: Duration::from_secs(300),
            unschedulable_retry: Duration::from_secs(15),
            resync: Duration::from_secs(600),
            gauge_refresh: Duration::from_secs(10),
            ipam_sweep: Duration::from_secs(60),
        }
    }

    fn class() -> ImpVMClassSpec {
        serde_json::from_value(json!({"vcpu": 2, "memoryMiB": 1024})).unwrap()
    }

    fn vm(lifecycle: &str, extra_spec: serde_json::Value) -> ImpVM {
        let mut spec =
            json!({"classRef": {"name": "small"}, "image": "img:1", "lifecycle": lifecycle});
        spec.as_object_mut()
            .unwrap()
            .extend(extra_spec.as_object().unwrap().clone());
        let mut v: ImpVM = serde_json::from_value(json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "vm", "namespace": "ns", "uid": "u1", "generation": 1,
                         "creationTimestamp": t(0).to_string(), "finalizers": [FINALIZER_VM_CLEANUP]},
            "spec": spec}))
        .unwrap();
        v.status = Some(ImpVMStatus::default());
        v
    }

    #[test]
    fn a_template_vm_asks_for_its_controlling_pool_s_template() {
        let owned = |v: &mut ImpVM, kind: &str, controller: bool| {
            v.metadata.owner_references = Some(vec![
                serde_json::from_value(json!({"apiVersion": "imp.dev/v1alpha1", "kind": kind,
                    "name": "p", "uid": "pool-uid", "controller": controller}))
                .unwrap(),
            ]);
        };
        let mut standby = vm("ephemeral", json!({"startFrom": "Template"}));
        assert_eq!(template_of(&standby), None, "no pool: nothing to prefer");
        owned(&mut standby, "ImpVMRunnerPool", true);
        assert_eq!(template_of(&standby).as_deref(), Some("pool-uid"));
        assert_eq!(
            request(&standby, &class()).template_of.as_deref(),
            Some("pool-uid")
        );
        let mut boot = vm("ephemeral", json!({}));
        owned(&mut boot, "ImpVMRunnerPool", true);
        assert_eq!(request(&boot, &class()).template_of, None);
        owned(&mut standby, "ImpVMRunnerPool", false);
        assert_eq!(template_of(&standby), None, "an owner, not the controller");
    }

    fn bound_vm(lifecycle: &str, phase: VmPhase, extra_spec: serde_json::Value) -> ImpVM {
        let mut v = vm(lifecycle, extra_spec);
        v.spec.node_name = Some("n1".into());
        v.status.as_mut().unwrap().phase = Some(phase);
        v
    }

    fn persistent(policy: serde_json::Value, phase: VmPhase) -> ImpVM {
        bound_vm("persistent", phase, json!({"restartPolicy": policy}))
    }

    const HEALTHY: NodeHealth = NodeHealth::Healthy { recheck_at: None };

    fn lost() -> NodeHealth {
        NodeHealth::Lost {
            reason: reason::NODE_DELETED,
            message: "node n1 no longer exists".into(),
        }
    }

    fn run(vm: &ImpVM, node: &NodeHealth, now: i64) -> Plan {
        let c = class();
        decide(&Input {
            vm,
            class: Some(&c),
            node,
            network_found: true,
            timing: &timing(),
            now: t(now),
        })
    }

    fn status(p: &Plan) -> &ImpVMStatus {
        p.status.as_ref().expect("plan writes status")
    }

    fn cond<'a>(s: &'a ImpVMStatus, type_: &str) -> &'a Condition {
        conditions::find(&s.conditions, type_)
            .unwrap_or_else(|| panic!("no {type_} condition in {s:?}"))
    }

    /// Applies a plan's status (and node clearing) to a VM, as the controller would.
    fn apply(mut vm: ImpVM, p: &Plan) -> ImpVM {
        if let Some(s) = &p.status {
            vm.status = Some(s.clone());
        }
        if p.clear_node {
            vm.spec.node_name = None;
        }
        vm
    }

    fn policy(v: serde_json::Value) -> ResolvedRestartPolicy {
        serde_json::from_value::<RestartPolicy>(v)
            .unwrap()
            .resolve("p")
            .unwrap()
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let p = policy(json!({"backoff": {"initialDelay": "10s", "maxDelay": "60s"}}));
        let delays: Vec<u64> = (0..6).map(|n| backoff_delay(&p, n).as_secs()).collect();
        assert_eq!(delays, [10, 20, 40, 60, 60, 60]);
        // No overflow for absurd counts.
        assert_eq!(backoff_delay(&p, 40).as_secs(), 60);
        assert_eq!(backoff_delay(&p, u32::MAX).as_secs(), 60);
        let sub = policy(json!({"backoff": {"initialDelay": "250ms", "maxDelay": "1s"}}));
        assert_eq!(backoff_delay(&sub, 1), Duration::from_millis(500));
    }

    #[test]
    fn deadlines_round_up_to_whole_seconds() {
        let now = Timestamp::from_millisecond(1_800_000_000_250).unwrap();
        assert_eq!(deadline(now, Duration::from_secs(1)), t(2));
        assert_eq!(deadline(t(0), Duration::from_secs(1)), t(1));
        assert_eq!(deadline(t(0), Duration::from_millis(1)), t(1));
        // A sub-second now still waits the full backoff.
        let v = persistent(json!({"backoff": {"initialDelay": "1s"}}), VmPhase::Failed);
        let c = class();
        let p = decide(&Input {
            vm: &v,
            class: Some(&c),
            node: &HEALTHY,
            network_found: true,
            timing: &timing(),
            now,
        });
        assert_eq!(
            status(&p).restarts.as_ref().unwrap().next_restart_time,
            Some(Time(t(2)))
        );
        assert_eq!(p.requeue_after, Some(Duration::from_millis(1750)));
    }

    #[test]
    fn new_vm_gets_the_finalizer_first() {
        let mut v = vm("ephemeral", json!({}));
        v.metadata.finalizers = None;
        let p = run(&v, &HEALTHY, 1);
        assert_eq!(
            p,
            Plan {
                add_finalizer: true,
                ..Default::default()
            }
        );
    }

    #[test]
    fn unbound_vm_asks_for_scheduling_with_class_size_and_constraints() {
        let v = vm(
            "ephemeral",
            json!({"nodeSelector": {"zone": "a"},
            "tolerations": [{"key": "k", "operator": "Exists"}]}),
        );
        let p = run(&v, &HEALTHY, 1);
        let r = p.schedule.expect("schedule");
        assert_eq!((r.vcpu, r.memory_mib), (2, 1024));
        assert_eq!(r.node_selector.get("zone").map(String::as_str), Some("a"));
        assert_eq!(r.tolerations.len(), 1);
        assert!(p.status.is_none());
    }

    #[test]
    fn missing_class_fails_spec_invalid_once_and_recovers_when_it_appears() {
        let v = vm("ephemeral", json!({}));
        let p = decide(&Input {
            vm: &v,
            class: None,
            node: &HEALTHY,
            network_found: true,
            timing: &timing(),
            now: t(1),
        });
        let s = status(&p);
        assert_eq!(s.phase, Some(VmPhase::Failed));
        assert_eq!(s.reason.as_deref(), Some(reason::SPEC_INVALID));
        assert!(
            s.message
                .as_deref()
                .unwrap()
                .contains("ImpVMClass \"small\" does not exist")
        );
        assert_eq!(
            cond(s, condition::SCHEDULED).reason,
            reason::CLASS_NOT_FOUND
        );
        assert_eq!(p.notes.len(), 1);
        assert_eq!(p.counted, vec![Counted::SpecInvalid]);
        // Seen again: nothing new to write or say.
        let v = apply(v, &p);
        let again = decide(&Input {
            vm: &v,
            class: None,
            node: &HEALTHY,
            network_found: true,
            timing: &timing(),
            now: t(5),
        });
        assert!(
            again.status.is_none() && again.notes.is_empty(),
            "{again:?}"
        );
        // The class appears: scheduling resumes.
        assert!(run(&v, &HEALTHY, 9).schedule.is_some());
    }

    #[test]
    fn a_bound_spec_invalid_vm_is_not_rescheduled_from_under_its_node() {
        let mut v = bound_vm("ephemeral", VmPhase::Failed, json!({}));
        v.status.as_mut().unwrap().reason = Some(reason::SPEC_INVALID.into());
        let p = run(&v, &HEALTHY, 1);
        assert!(p.schedule.is_none(), "{p:?}");
    }

    #[test]
    fn bad_duration_is_spec_invalid() {
        let mut v = vm("ephemeral", json!({}));
        v.spec.expire_after = Some(serde_json::from_value(json!("10x")).unwrap());
        let p = run(&v, &HEALTHY, 1);
        assert_eq!(status(&p).reason.as_deref(), Some(reason::SPEC_INVALID));
        assert!(
            status(&p)
                .message
                .as_deref()
                .unwrap()
                .contains("spec.expireAfter")
        );
    }

    #[test]
    fn binding_sets_scheduled_and_measures_latency_only_the_first_time() {
        let v = vm("ephemeral", json!({}));
        let (s, note, latency) = bound(&v, "n1", t(3));
        assert_eq!(s.phase, Some(VmPhase::Scheduled));
        assert_eq!(s.scheduled_time, Some(Time(t(3))));
        let c = cond(&s, condition::SCHEDULED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", reason::NODE_ASSIGNED)
        );
        assert_eq!(note.reason, reason::SCHEDULED);
        assert_eq!(latency, Some(Duration::from_secs(3)));
        let mut restarted = v.clone();
        restarted.status.as_mut().unwrap().restarts = Some(imp_api::RestartStatus {
            count: 1,
            ..Default::default()
        });
        assert_eq!(bound(&restarted, "n1", t(9)).2, None);
    }

    #[test]
    fn unschedulable_is_pending_with_the_reasons_and_warns_only_on_change() {
        let v = vm("ephemeral", json!({}));
        let why = Unschedulable {
            rejections: [("n1".to_owned(), Rejection::Cordoned)].into(),
            pinned: None,
        };
        let (s, note) = unschedulable(&v, &why, t(1));
        assert_eq!(s.phase, Some(VmPhase::Pending));
        assert_eq!(s.reason.as_deref(), Some(reason::UNSCHEDULABLE));
        assert_eq!(
            s.message.as_deref(),
            Some("0/1 nodes are available: 1 cordoned")
        );
        assert_eq!(cond(&s, condition::SCHEDULED).status, "False");
        assert_eq!(note.unwrap().reason, reason::FAILED_SCHEDULING);
        let v = ImpVM {
            status: Some(s),
            ..v
        };
        let (s2, note) = unschedulable(&v, &why, t(20));
        assert!(note.is_none());
        // lastTransitionTime kept while the condition stays False.
        assert_eq!(
            cond(&s2, condition::SCHEDULED).last_transition_time,
            Time(t(1))
        );
        let other = Unschedulable {
            rejections: [("n1".to_owned(), Rejection::NotReady)].into(),
            pinned: None,
        };
        assert!(unschedulable(&v, &other, t(21)).1.is_some());
    }

    #[test]
    fn a_user_bound_vm_goes_through_the_scheduler_on_its_node_alone() {
        let mut v = vm("ephemeral", json!({}));
        v.spec.node_name = Some("n1".into());
        let p = run(
            &v,
            &NodeHealth::Healthy {
                recheck_at: Some(t(30)),
            },
            10,
        );
        // Not Scheduled by the decision: the executor checks n1's taints and capacity first.
        let s = status(&p);
        assert_eq!(s.phase, None);
        assert_eq!(cond(s, condition::NODE_HEALTHY).status, "True");
        assert_eq!(p.requeue_after, Some(Duration::from_secs(20)));
        assert!(p.schedule.is_some());
        assert_eq!(p.schedule_on.as_deref(), Some("n1"));
        // Once Scheduled (by the executor), the decision leaves the binding alone.
        let (scheduled, _, _) = bound(&apply(v, &p), "n1", t(11));
        let mut v = vm("ephemeral", json!({}));
        v.spec.node_name = Some("n1".into());
        v.status = Some(scheduled);
        let p = run(&v, &HEALTHY, 12);
        assert!(p.schedule.is_none() && p.schedule_on.is_none(), "{p:?}");
    }

    #[test]
    fn a_user_bound_vm_on_a_node_that_cannot_take_it_waits_pending_naming_why() {
        let mut v = vm("ephemeral", json!({}));
        v.spec.node_name = Some("n1".into());
        let full = Unschedulable {
            rejections: [(
                "n1".to_owned(),
                Rejection::InsufficientMemory {
                    requested_mib: 512,
                    free_mib: 100,
                },
            )]
            .into(),
            pinned: Some("n1".into()),
        };
        let (s, note) = unschedulable(&v, &full, t(1));
        assert_eq!(s.phase, Some(VmPhase::Pending));
        assert_eq!(s.reason.as_deref(), Some(reason::UNSCHEDULABLE));
        let message = "spec.nodeName n1: insufficient memory: requested 512Mi, free 100Mi";
        assert_eq!(s.message.as_deref(), Some(message));
        assert_eq!(cond(&s, condition::SCHEDULED).message, message);
        assert_eq!(note.unwrap().reason, reason::FAILED_SCHEDULING);
        // Still Pending and unschedulable: the next pass asks the executor again, nothing more.
        v.status = Some(s);
        let p = run(&v, &HEALTHY, 5);
        assert_eq!(p.schedule_on.as_deref(), Some("n1"));
        assert_eq!(
            p.status
                .as_ref()
                .and_then(|s| s.phase)
                .or(Some(VmPhase::Pending)),
            Some(VmPhase::Pending)
        );
    }

    #[test]
    fn running_vm_on_healthy_node_is_left_alone_once_node_healthy_is_recorded() {
        let v = bound_vm("ephemeral", VmPhase::Running, json!({}));
        let p = run(&v, &HEALTHY, 1);
        let v = apply(v, &p);
        let p = run(&v, &HEALTHY, 2);
        assert!(p.status.is_none() && p.notes.is_empty(), "{p:?}");
    }

    #[test]
    fn degraded_node_waits_for_the_grace_period() {
        let v = bound_vm("ephemeral", VmPhase::Running, json!({}));
        let h = NodeHealth::Degraded {
            reason: reason::NODE_NOT_READY,
            message: "x".into(),
            lost_at: t(40),
        };
        let p = run(&v, &h, 10);
        let s = status(&p);
        assert_eq!(s.phase, Some(VmPhase::Running));
        assert_eq!(cond(s, condition::NODE_HEALTHY).status, "Unknown");
        assert_eq!(p.requeue_after, Some(Duration::from_secs(30)));
    }

    #[test]
    fn node_loss_fails_ephemeral_vms_with_node_lost() {
        for phase in [VmPhase::Scheduled, VmPhase::Starting, VmPhase::Running] {
            let v = bound_vm("ephemeral", phase, json!({}));
            let p = run(&v, &lost(), 100);
            let s = status(&p);
            assert_eq!(s.phase, Some(VmPhase::Failed));
            assert_eq!(s.reason.as_deref(), Some(reason::NODE_LOST));
            assert!(
                s.message
                    .as_deref()
                    .unwrap()
                    .starts_with("NodeDeleted: node n1 no longer exists")
            );
            let c = cond(s, condition::NODE_HEALTHY);
            assert_eq!(
                (c.status.as_str(), c.reason.as_str()),
                ("False", reason::NODE_DELETED)
            );
            assert_eq!(p.counted, vec![Counted::NodeLost(reason::NODE_DELETED)]);
            assert!(p.notes[0].warning);
            // Failed ephemeral VMs are the pool's to delete: no further action.
            let after = run(&apply(v, &p), &lost(), 200);
            assert_eq!(after, Plan::default());
        }
    }

    #[test]
    fn node_loss_of_a_persistent_vm_reschedules_even_in_place() {
        let v = persistent(
            json!({"mode": "in-place", "backoff": {"initialDelay": "5s", "maxRetries": 3}}),
            VmPhase::Running,
        );
        let p = run(&v, &lost(), 100);
        assert_eq!(status(&p).phase, Some(VmPhase::Failed));
        let v = apply(v, &p);
        // Backoff starts.
        let p = run(&v, &lost(), 100);
        assert_eq!(
            status(&p).restarts.as_ref().unwrap().next_restart_time,
            Some(Time(t(105)))
        );
        assert_eq!(p.requeue_after, Some(Duration::from_secs(5)));
        let v = apply(v, &p);
        let p = run(&v, &lost(), 105);
        assert!(p.clear_node);
        let s = status(&p);
        assert_eq!(s.phase, Some(VmPhase::Pending));
        assert!(conditions::find(&s.conditions, condition::NODE_HEALTHY).is_none());
        assert_eq!(p.counted, vec![Counted::Restart(RestartMode::Reschedule)]);
    }

    #[test]
    fn persistent_stop_backs_off_then_restarts_in_place() {
        let v = persistent(
            json!({"mode": "in-place", "backoff": {"initialDelay": "10s", "maxDelay": "15s", "maxRetries": 3}}),
            VmPhase::Failed,
        );
        // First stop: wait initialDelay.
        let p = run(&v, &HEALTHY, 0);
        assert_eq!(p.requeue_after, Some(Duration::from_secs(10)));
        assert_eq!(p.notes[0].reason, reason::BACK_OFF);
        let v = apply(v, &p);
        // Early passes only wait.
        let p = run(&v, &HEALTHY, 4);
        assert!(p.status.is_none());
        assert_eq!(p.requeue_after, Some(Duration::from_secs(6)));
        // Due: Scheduled again on the same node.
        let p = run(&v, &HEALTHY, 10);
        assert!(!p.clear_node);
        let s = status(&p);
        assert_eq!(s.phase, Some(VmPhase::Scheduled));
        let r = s.restarts.as_ref().unwrap();
        assert_eq!(
            (
                r.count,
                r.next_restart_time.clone(),
                r.last_restart_time.clone()
            ),
            (1, None, Some(Time(t(10))))
        );
        assert_eq!(p.counted, vec![Counted::Restart(RestartMode::InPlace)]);
        // It runs and stops again: the second delay doubles, capped at maxDelay.
        let mut v = apply(v, &p);
        v.status.as_mut().unwrap().phase = Some(VmPhase::Succeeded);
        let p = run(&v, &HEALTHY, 20);
        assert_eq!(p.requeue_after, Some(Duration::from_secs(15)));
    }

    #[test]
    fn in_place_restart_reschedules_when_the_node_is_unhealthy() {
        let v = persistent(json!({"mode": "in-place"}), VmPhase::Failed);
        let mut v = apply(v.clone(), &run(&v, &HEALTHY, 0));
        v.status
            .as_mut()
            .unwrap()
            .restarts
            .as_mut()
            .unwrap()
            .next_restart_time = Some(Time(t(1)));
        let degraded = NodeHealth::Degraded {
            reason: reason::NODE_NOT_READY,
            message: "x".into(),
            lost_at: t(99),
        };
        let p = run(&v, &degraded, 2);
        assert!(p.clear_node);
        assert_eq!(status(&p).phase, Some(VmPhase::Pending));
    }

    #[test]
    fn reschedule_mode_clears_the_node() {
        let v = persistent(
            json!({"backoff": {"initialDelay": "1s"}}),
            VmPhase::Succeeded,
        );
        let v = apply(v.clone(), &run(&v, &HEALTHY, 0));
        let p = run(&v, &HEALTHY, 1);
        assert!(p.clear_node);
        let s = status(&p);
        assert_eq!(s.phase, Some(VmPhase::Pending));
        assert_eq!(s.scheduled_time, None);
        assert_eq!(cond(s, condition::SCHEDULED).reason, reason::RESCHEDULING);
        // The next pass (node cleared, Pending) asks the scheduler.
        assert!(run(&apply(v, &p), &HEALTHY, 2).schedule.is_some());
    }

    /// Drives a persistent VM through stops until the budget is spent; returns the exhausted VM.
    fn exhaust(policy_json: serde_json::Value, max: u32) -> (ImpVM, i64) {
        let mut v = persistent(policy_json, VmPhase::Failed);
        v.status.as_mut().unwrap().reason = Some(reason::RUNNER_EXITED_NON_ZERO.into());
        let mut now = 0;
        for n in 0..max {
            let p = run(&v, &HEALTHY, now);
            v = apply(v, &p);
            now += 1000; // past any backoff
            let p = run(&v, &HEALTHY, now);
            assert_eq!(status(&p).restarts.as_ref().unwrap().count, n + 1);
            v = apply(v, &p);
            // Rescheduled (if the mode cleared it) onto n1 again, ran, and failed again.
            v.spec.node_name = Some("n1".into());
            v.status.as_mut().unwrap().phase = Some(VmPhase::Failed);
            v.status.as_mut().unwrap().reason = Some(reason::RUNNER_EXITED_NON_ZERO.into());
        }
        let p = run(&v, &HEALTHY, now);
        let s = status(&p);
        assert_eq!(s.phase, Some(VmPhase::RetryExhausted), "{s:?}");
        assert_eq!(s.reason.as_deref(), Some(reason::RETRY_EXHAUSTED));
        assert!(
            s.message
                .as_deref()
                .unwrap()
                .contains(&format!("{max} of {max} restarts spent")),
            "{s:?}"
        );
        assert!(
            s.message
                .as_deref()
                .unwrap()
                .contains(reason::RUNNER_EXITED_NON_ZERO)
        );
        assert_eq!(p.counted, vec![Counted::RetryExhausted]);
        (apply(v, &p), now)
    }

    #[test]
    fn exhaustion_with_fail_stays_down() {
        let (v, now) = exhaust(
            json!({"mode": "in-place", "backoff": {"initialDelay": "1s", "maxRetries": 2}}),
            2,
        );
        assert_eq!(run(&v, &HEALTHY, now + 100_000), Plan::default());
    }

    #[test]
    fn zero_retries_exhaust_on_the_first_stop() {
        exhaust(
            json!({"backoff": {"maxRetries": 0}, "onExhaustion": "manual-reset"}),
            0,
        );
    }

    #[test]
    fn cool_down_resets_the_budget_and_restarts() {
        let (v, now) = exhaust(
            json!({"mode": "in-place", "backoff": {"initialDelay": "1s", "maxRetries": 1}, "onExhaustion": "cool-down", "coolDownPeriod": "30s"}),
            1,
        );
        let p = run(&v, &HEALTHY, now + 10);
        assert!(p.status.is_none());
        assert_eq!(p.requeue_after, Some(Duration::from_secs(20)));
        let p = run(&v, &HEALTHY, now + 30);
        let s = status(&p);
        assert_eq!(s.phase, Some(VmPhase::Scheduled));
        let r = s.restarts.as_ref().unwrap();
        assert_eq!((r.count, r.exhausted_time.clone()), (0, None));
        assert_eq!(
            p.counted,
            vec![
                Counted::BudgetReset(reason::COOL_DOWN_ELAPSED),
                Counted::Restart(RestartMode::InPlace)
            ]
        );
        assert_eq!(
            p.notes.iter().map(|n| n.reason).collect::<Vec<_>>(),
            [reason::RESTART_BUDGET_RESET, reason::RESTARTING]
        );
    }

    #[test]
    fn manual_reset_needs_the_annotation_and_consumes_it() {
        let (mut v, now) = exhaust(
            json!({"backoff": {"initialDelay": "1s", "maxRetries": 1}, "onExhaustion": "manual-reset"}),
            1,
        );
        assert_eq!(run(&v, &HEALTHY, now + 10_000), Plan::default());
        v.metadata.annotations =
            Some([(ANNOTATION_RESET_RESTARTS.to_owned(), "now".to_owned())].into());
        let p = run(&v, &HEALTHY, now + 10_001);
        assert!(p.remove_reset_annotation);
        assert!(p.clear_node, "reschedule mode");
        let s = status(&p);
        assert_eq!(s.phase, Some(VmPhase::Pending));
        assert_eq!(s.restarts.as_ref().unwrap().count, 0);
        assert!(
            p.counted
                .contains(&Counted::BudgetReset(reason::MANUAL_RESET))
        );
    }

    #[test]
    fn reset_annotation_on_a_fresh_vm_is_just_removed() {
        let mut v = persistent(json!({}), VmPhase::Running);
        v.metadata.annotations =
            Some([(ANNOTATION_RESET_RESTARTS.to_owned(), "x".to_owned())].into());
        let p = run(&v, &HEALTHY, 1);
        assert_eq!(
            p,
            Plan {
                remove_reset_annotation: true,
                ..Default::default()
            }
        );
    }

    #[test]
    fn class_restart_policy_is_inherited_and_vm_policy_wins() {
        let mut c = class();
        c.restart_policy = Some(
            serde_json::from_value(json!({"mode": "in-place", "backoff": {"maxRetries": 9}}))
                .unwrap(),
        );
        let v = vm("persistent", json!({}));
        let p = restart_policy(&v, Some(&c)).unwrap();
        assert_eq!((p.mode, p.max_retries), (RestartMode::InPlace, 9));
        let own = vm(
            "persistent",
            json!({"restartPolicy": {"backoff": {"maxRetries": 2}}}),
        );
        let p = restart_policy(&own, Some(&c)).unwrap();
        assert_eq!((p.mode, p.max_retries), (RestartMode::Reschedule, 2));
        assert_eq!(
            restart_policy(&v, None).unwrap().max_retries,
            imp_api::DEFAULT_MAX_RETRIES
        );
    }

    #[test]
    fn ephemeral_stops_are_not_restarted() {
        let v = bound_vm(
            "ephemeral",
            VmPhase::Failed,
            json!({"restartPolicy": {"mode": "in-place"}}),
        );
        assert_eq!(run(&v, &HEALTHY, 1), Plan::default());
    }

    #[test]
    fn expiry_counts_from_first_running_and_deletes() {
        let mut v = bound_vm("ephemeral", VmPhase::Running, json!({"expireAfter": "1m"}));
        v.status.as_mut().unwrap().first_running_time = Some(Time(t(100)));
        let p = run(&v, &HEALTHY, 130);
        assert!(!p.delete);
        assert_eq!(p.requeue_after, Some(Duration::from_secs(30)));
        let p = run(&v, &HEALTHY, 160);
        assert!(p.delete);
        assert_eq!(status(&p).reason.as_deref(), Some(reason::EXPIRED));
        assert_eq!(p.notes[0].reason, reason::EXPIRED);
        assert_eq!(p.counted, vec![Counted::Expired]);
        // Not running yet: no clock.
        let mut fresh = bound_vm("ephemeral", VmPhase::Starting, json!({"expireAfter": "1m"}));
        fresh.status.as_mut().unwrap().first_running_time = None;
        assert!(!run(&fresh, &HEALTHY, 100_000).delete);
    }

    fn with_network(mut v: ImpVM) -> ImpVM {
        v.spec.network_ref = Some(imp_api::NetworkRef { name: "net".into() });
        v
    }

    fn run_net(vm: &ImpVM, node: &NodeHealth, network_found: bool, now: i64) -> Plan {
        let c = class();
        decide(&Input {
            vm,
            class: Some(&c),
            node,
            network_found,
            timing: &timing(),
            now: t(now),
        })
    }

    #[test]
    fn scheduling_a_vm_with_a_network_allocates_in_the_binding() {
        let v = with_network(vm("ephemeral", json!({})));
        let p = run_net(&v, &HEALTHY, true, 1);
        assert!(p.schedule.is_some());
        assert_eq!(p.allocate.as_deref(), Some("net"));
        assert!(p.status.is_none() && p.notes.is_empty());
        // Without a networkRef nothing is allocated.
        let p = run_net(&vm("ephemeral", json!({})), &HEALTHY, false, 1);
        assert!(p.schedule.is_some() && p.allocate.is_none());
    }

    #[test]
    fn missing_network_keeps_the_vm_pending_and_warns_once() {
        let v = with_network(vm("ephemeral", json!({})));
        let p = run_net(&v, &HEALTHY, false, 1);
        assert!(p.schedule.is_none() && p.allocate.is_none());
        let s = status(&p);
        assert_eq!(s.phase, Some(VmPhase::Pending));
        assert_eq!(s.reason.as_deref(), Some(reason::NETWORK_NOT_FOUND));
        assert_eq!(
            s.message.as_deref(),
            Some("spec.networkRef: ImpNetwork \"net\" does not exist")
        );
        assert_eq!(
            cond(s, condition::SCHEDULED).reason,
            reason::NETWORK_NOT_FOUND
        );
        assert_eq!(p.notes.len(), 1);
        assert!(p.notes[0].warning);
        assert_eq!(
            p.counted,
            vec![Counted::NetworkAllocationFailed(reason::NETWORK_NOT_FOUND)]
        );
        assert_eq!(p.requeue_after, Some(Duration::from_secs(15)));
        // Seen again: nothing to write or say, still retried.
        let v = apply(v, &p);
        let again = run_net(&v, &HEALTHY, false, 5);
        assert!(again.status.is_none() && again.notes.is_empty() && again.counted.is_empty());
        assert_eq!(again.requeue_after, Some(Duration::from_secs(15)));
        // The network appears: scheduling with allocation resumes.
        let p = run_net(&v, &HEALTHY, true, 9);
        assert_eq!(p.allocate.as_deref(), Some("net"));
    }

    #[test]
    fn network_unavailable_is_pending_and_warns_only_on_a_new_verdict() {
        let v = vm("ephemeral", json!({}));
        let msg = "ImpNetwork ns/net has no free address (capacity 1)".to_owned();
        let (s, note) = network_unavailable(&v, reason::NETWORK_EXHAUSTED, msg.clone(), t(1));
        assert_eq!(s.phase, Some(VmPhase::Pending));
        assert_eq!(s.reason.as_deref(), Some(reason::NETWORK_EXHAUSTED));
        let c = cond(&s, condition::SCHEDULED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
            ("False", reason::NETWORK_EXHAUSTED, msg.as_str())
        );
        let note = note.expect("first verdict warns");
        assert!(note.warning && note.reason == reason::NETWORK_EXHAUSTED);
        let v = ImpVM {
            status: Some(s.clone()),
            ..v
        };
        let (s2, note) = network_unavailable(&v, reason::NETWORK_EXHAUSTED, msg, t(20));
        assert!(note.is_none());
        assert_eq!(s2, s, "a retry rewrites nothing");
        let (_, note) = network_unavailable(&v, reason::NETWORK_INVALID, "x".into(), t(21));
        assert!(note.is_some());
    }

    #[test]
    fn a_user_bound_vm_gets_its_address_before_it_is_marked_scheduled() {
        let mut v = with_network(vm("ephemeral", json!({})));
        v.spec.node_name = Some("n1".into());
        let p = run_net(&v, &HEALTHY, true, 1);
        assert_eq!(p.allocate.as_deref(), Some("net"));
        assert!(p.schedule.is_none());
        assert!(p.notes.is_empty(), "no Scheduled Event yet: {p:?}");
        assert_ne!(status(&p).phase, Some(VmPhase::Scheduled));
        // With the annotation recorded, the next pass marks it Scheduled.
        let mut v = apply(v, &p);
        v.metadata.annotations = Some(
            [(
                ANNOTATION_IP_ALLOCATION.to_owned(),
                "192.0.2.2/24".to_owned(),
            )]
            .into(),
        );
        let p = run_net(&v, &HEALTHY, true, 2);
        assert!(p.allocate.is_none());
        // With the address, the node's filters next (the executor marks it Scheduled).
        assert_eq!(p.schedule_on.as_deref(), Some("n1"));
        // Bound by the user to a network that does not exist: Pending, said why.
        let mut v = with_network(vm("ephemeral", json!({})));
        v.spec.node_name = Some("n1".into());
        let p = run_net(&v, &HEALTHY, false, 1);
        assert!(p.allocate.is_none());
        assert_eq!(
            status(&p).reason.as_deref(),
            Some(reason::NETWORK_NOT_FOUND)
        );
    }

    #[test]
    fn a_running_vm_keeps_its_address_and_allocates_nothing() {
        let mut v = with_network(bound_vm("ephemeral", VmPhase::Running, json!({})));
        v.metadata.annotations = Some(
            [(
                ANNOTATION_IP_ALLOCATION.to_owned(),
                "192.0.2.2/24".to_owned(),
            )]
            .into(),
        );
        let p = run_net(&v, &HEALTHY, false, 1);
        assert!(p.allocate.is_none() && p.release.is_none(), "{p:?}");
    }

    #[test]
    fn the_address_is_released_exactly_when_the_finalizer_goes() {
        // Never bound: at once.
        let v = deleting(with_network(vm("ephemeral", json!({}))), 0);
        let p = run_net(&v, &HEALTHY, true, 0);
        assert!(p.remove_finalizer);
        assert_eq!(p.release.as_deref(), Some("net"));
        // Bound: not while the agent tears down, then with the finalizer.
        let v = deleting(
            with_network(bound_vm("ephemeral", VmPhase::Running, json!({}))),
            0,
        );
        let p = run_net(&v, &HEALTHY, true, 1);
        assert!(!p.remove_finalizer && p.release.is_none());
        let mut v = apply(v, &p);
        torn_down(&mut v, 2);
        let p = run_net(&v, &HEALTHY, true, 2);
        assert!(p.remove_finalizer);
        assert_eq!(p.release.as_deref(), Some("net"));
        // Forced on a lost node: released too; before the timeout, not.
        let v = deleting(
            with_network(bound_vm("ephemeral", VmPhase::Running, json!({}))),
            0,
        );
        let v = apply(v.clone(), &run_net(&v, &lost(), true, 0));
        assert!(run_net(&v, &lost(), true, 299).release.is_none());
        let p = run_net(&v, &lost(), true, 300);
        assert!(p.remove_finalizer);
        assert_eq!(p.counted, vec![Counted::FinalizerForced]);
        assert_eq!(p.release.as_deref(), Some("net"));
        // Without a networkRef there is nothing to release.
        let v = deleting(vm("ephemeral", json!({})), 0);
        assert!(run_net(&v, &HEALTHY, true, 0).release.is_none());
    }

    /// The agent records teardown at `at`.
    fn torn_down(v: &mut ImpVM, at: i64) {
        conditions::set(
            &mut v.status.as_mut().unwrap().conditions,
            condition::TORN_DOWN,
            ConditionStatus::True,
            reason::TEARDOWN_COMPLETE,
            "",
            None,
            t(at),
        );
    }

    fn deleting(mut v: ImpVM, at: i64) -> ImpVM {
        v.metadata.deletion_timestamp = Some(Time(t(at)));
        v
    }

    #[test]
    fn deletion_of_an_unbound_vm_releases_at_once() {
        let v = deleting(vm("ephemeral", json!({})), 0);
        assert_eq!(
            run(&v, &HEALTHY, 0),
            Plan {
                remove_finalizer: true,
                ..Default::default()
            }
        );
    }

    #[test]
    fn deletion_waits_for_torn_down_from_the_agent() {
        let v = deleting(bound_vm("ephemeral", VmPhase::Running, json!({})), 0);
        let p = run(&v, &HEALTHY, 1);
        assert!(!p.remove_finalizer);
        assert_eq!(status(&p).phase, Some(VmPhase::Terminating));
        assert_eq!(p.notes[0].reason, reason::TERMINATING);
        let mut v = apply(v, &p);
        // Still waiting: no rewrite, no new event.
        let p = run(&v, &HEALTHY, 2);
        assert!(p.status.is_none() && p.notes.is_empty() && !p.remove_finalizer);
        // The agent records teardown.
        torn_down(&mut v, 3);
        let p = run(&v, &HEALTHY, 3);
        assert!(p.remove_finalizer);
        assert_eq!(p.notes[0].reason, reason::TORN_DOWN);
    }

    #[test]
    fn finalizer_is_forced_only_after_the_timeout_and_only_when_the_node_is_lost() {
        let v = deleting(bound_vm("ephemeral", VmPhase::Running, json!({})), 0);
        let v = apply(v.clone(), &run(&v, &lost(), 0));
        let p = run(&v, &lost(), 299);
        assert!(!p.remove_finalizer);
        assert_eq!(p.requeue_after, Some(Duration::from_secs(1)));
        let p = run(&v, &lost(), 300);
        assert!(p.remove_finalizer);
        assert_eq!(p.counted, vec![Counted::FinalizerForced]);
        let note = &p.notes[0];
        assert!(
            note.warning
                && note.reason == reason::FINALIZER_FORCED
                && note.message.contains(reason::NODE_DELETED),
            "{note:?}"
        );
        // A healthy node never gets its VM's finalizer forced.
        let p = run(&v, &HEALTHY, 100_000);
        assert!(!p.remove_finalizer);
    }

    #[test]
    fn deletion_without_our_finalizer_does_nothing() {
        let mut v = deleting(bound_vm("ephemeral", VmPhase::Running, json!({})), 0);
        v.metadata.finalizers = Some(vec!["other/finalizer".into()]);
        assert_eq!(run(&v, &lost(), 100_000), Plan::default());
    }
}
