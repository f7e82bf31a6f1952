//! The I/O of suspend and ScaleToZero: [`observe`] gathers what [`suspend::decide`] needs (the
//! VM's link counters for the idle clock, its wake counter); the controller's executor calls
//! [`suspend`], [`resume`], [`mark_suspended`], [`mark_running`], [`refuse`] and
//! [`clear_refusal`], which write the phases, conditions and Events and call imp-runtime. The
//! wake loop polls the wake counters of suspended ScaleToZero VMs every [`WAKE_POLL`] and, on a
//! rise, triggers a reconcile.
//!
//! Wake-on-traffic has not been validated on hardware: the tests drive it in network namespaces
//! with the Firecracker simulator (node/runtime/tests/suspend_agent.rs) and with a real guest under QEMU
//! (node/runtime/tests/scale_to_zero_qemu.rs).

use std::time::{Duration, Instant};

use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{condition, reason as api_reason};
use imp_api::{DesiredState, ImpVM, Lifecycle, VmPhase};
use imp_common::Backoff;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, ResourceExt};
use tracing::{debug, info, warn};

use super::context::{Context, Error, runtime_facts};
use super::decide::{InFlight, RuntimeFacts, VmFacts};
use super::status::{self, Guard, Written};
use super::suspend::{Facts, Ineligible, Runtime, Traffic, Trigger, Wake};
use imp_runtime_api::api::{LinkStats, VmState};

/// How often the wake counters of suspended ScaleToZero VMs are read (one local socket request
/// per suspended VM; no Kubernetes request unless one rose).
pub const WAKE_POLL: Duration = Duration::from_secs(1);

/// After a failed suspend or resume call, the task waits this out before it ends (and the VM
/// may be planned again): a runtime that cannot suspend (SnapshotUnsupported) is not asked
/// every poll interval.
const CALL_RETRY: Backoff = Backoff::new(Duration::from_secs(2), Duration::from_secs(120));

/// The phases [`suspend::decide`] owns (Running only in part: it may start a suspend).
pub fn handles(phase: VmPhase) -> bool {
    matches!(
        phase,
        VmPhase::Running | VmPhase::Suspending | VmPhase::Suspended | VmPhase::Resuming
    )
}

fn ineligible(vm: &ImpVM) -> Option<Ineligible> {
    if vm.spec.runner_config_secret.is_some() {
        Some(Ineligible::Runner)
    } else if vm.spec.lifecycle == Lifecycle::Ephemeral {
        Some(Ineligible::Ephemeral)
    } else {
        None
    }
}

fn runtime(rt: &RuntimeFacts) -> Runtime {
    match rt {
        RuntimeFacts::Running => Runtime::Running,
        RuntimeFacts::Suspending => Runtime::Suspending,
        RuntimeFacts::Suspended => Runtime::Suspended,
        RuntimeFacts::Resuming => Runtime::Resuming,
        RuntimeFacts::Booting => Runtime::Booting,
        RuntimeFacts::Exited => Runtime::Exited,
        RuntimeFacts::Absent => Runtime::Absent,
        RuntimeFacts::Failed { reason, message } => Runtime::Failed {
            reason: reason.clone(),
            message: message.clone(),
        },
    }
}

/// The wake counter in a LinkStats answer: packets routed to the VM's address while it is
/// Suspended, 0 while it runs (the runtime starts it afresh for each suspension, so its
/// baseline is 0 and packets counted while this agent was down still wake the VM).
fn wake_packets(s: &LinkStats) -> u64 {
    s.wake_packets
}

fn recorded(vm: &ImpVM) -> Option<String> {
    vm.status
        .as_ref()
        .and_then(|s| conditions::find(&s.conditions, condition::SUSPENDED))
        .map(|c| c.reason.clone())
}

/// ScaleToZero applies to `vm` on this agent.
fn scale_to_zero(ctx: &Context, vm: &ImpVM) -> bool {
    ctx.config.scale_to_zero
        && vm.spec.desired_state() == DesiredState::ScaleToZero
        && ineligible(vm).is_none()
        // Without a network there is neither traffic to measure nor any to wake it.
        && vm.spec.network_ref.is_some()
}

/// What [`suspend::decide`] looks at, for a VM bound here, not being deleted, in one of the
/// [`handles`] phases (`None` otherwise). Keeps the idle clock and registers suspended
/// ScaleToZero VMs with the wake loop.
pub async fn observe(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    facts: &VmFacts,
    rt: &RuntimeFacts,
    in_flight: Option<InFlight>,
) -> Option<Facts> {
    let phase = facts.phase.filter(|p| handles(*p))?;
    if !facts.bound_here || facts.deleting {
        return None;
    }
    let runtime = runtime(rt);
    let s2z = scale_to_zero(ctx, vm);
    let now = Instant::now();
    // The idle clock runs only while the VM runs and asks for ScaleToZero.
    let idle_for = if s2z && phase == VmPhase::Running && runtime == Runtime::Running {
        match ctx.runtime.linkstats(uid).await {
            Ok(s) => {
                let mut mem = ctx.sleep.lock().unwrap();
                let prev = mem.traffic.get(uid).copied();
                let t = Traffic::observe(prev, s.rx_bytes, s.tx_bytes, now);
                mem.traffic.insert(uid.to_owned(), t);
                Some(t.idle_for(now))
            }
            Err(e) => {
                debug!(uid, error = %e, "no link statistics; the idle clock waits");
                None
            }
        }
    } else {
        ctx.sleep.lock().unwrap().traffic.remove(uid);
        None
    };
    let woken = if s2z && matches!(phase, VmPhase::Suspending | VmPhase::Suspended) {
        watch_wakes(ctx, uid);
        ctx.sleep
            .lock()
            .unwrap()
            .wakes
            .get(uid)
            .is_some_and(Wake::woken)
    } else {
        if phase != VmPhase::Resuming {
            ctx.sleep.lock().unwrap().wakes.remove(uid);
        }
        false
    };
    Some(Facts {
        phase,
        desired: vm.spec.desired_state(),
        ineligible: ineligible(vm),
        scale_to_zero: ctx.config.scale_to_zero,
        runtime,
        idle_for,
        idle_timeout: vm
            .spec
            .idle_timeout()
            .unwrap_or(imp_api::DEFAULT_IDLE_TIMEOUT),
        woken,
        in_flight: matches!(in_flight, Some(InFlight::Suspend | InFlight::Resume)),
        recorded: recorded(vm),
    })
}

/// Registers `uid` with the wake loop unless it is.
fn watch_wakes(ctx: &Context, uid: &str) {
    ctx.sleep
        .lock()
        .unwrap()
        .wakes
        .entry(uid.to_owned())
        .or_insert_with(|| Wake::new(0));
}

fn why(t: Trigger, vm: &ImpVM, suspend: bool) -> String {
    match (t, suspend) {
        (Trigger::Requested, true) => "desiredState is Suspended".into(),
        (Trigger::Requested, false) => "desiredState is Running".into(),
        (Trigger::Idle, _) => format!(
            "ScaleToZero: no traffic on the VM's link for idleTimeout ({:?})",
            vm.spec
                .idle_timeout()
                .unwrap_or(imp_api::DEFAULT_IDLE_TIMEOUT)
        ),
        (Trigger::Traffic, _) => {
            "ScaleToZero: packets were sent to the VM's address (wake-on-traffic is not hardware-validated)".into()
        }
        (Trigger::Disabled, _) => {
            "desiredState ScaleToZero is disabled: this node's imp-agent runs without IMP_SCALE_TO_ZERO=true".into()
        }
        (Trigger::NotAllowed, _) => ineligible(vm)
            .unwrap_or(Ineligible::Runner)
            .message(vm.spec.desired_state()),
    }
}

/// Suspending (condition Suspended=True), then the runtime call; Suspended once it reports so.
pub async fn suspend(
    ctx: &Context,
    api: &Api<ImpVM>,
    vm: ImpVM,
    uid: &str,
    t: Trigger,
) -> Result<(), Error> {
    let name = vm.name_any();
    let message = why(t, &vm, true);
    let guard = Guard::phases(&[VmPhase::Running, VmPhase::Suspending]);
    let written = status::update(api, &name, guard, |vm, s| {
        let now = Timestamp::now();
        s.phase = Some(VmPhase::Suspending);
        conditions::set(
            &mut s.conditions,
            condition::SUSPENDED,
            ConditionStatus::True,
            t.reason(true),
            &message,
            vm.metadata.generation,
            now,
        );
        conditions::set(
            &mut s.conditions,
            condition::READY,
            ConditionStatus::False,
            api_reason::VM_SUSPENDED,
            "suspending",
            vm.metadata.generation,
            now,
        );
        true
    })
    .await?;
    let Written::Done(now) = written else {
        return Ok(());
    };
    ctx.event(
        &now,
        false,
        t.reason(true),
        format!("suspending: {message}"),
    )
    .await;
    // Probes and metrics would only time out against a stopped guest.
    ctx.stop_monitor(uid);
    if scale_to_zero(ctx, &vm) {
        // Before the call: a packet sent while the snapshot is taken wakes it too.
        watch_wakes(ctx, uid);
    }
    info!(vm = %name, trigger = t.label(), "asking imp-runtime to suspend the VM");
    // Answered once the VM is Suspended (snapshot written, VMM gone).
    match ctx.runtime.suspend(uid).await {
        Ok(info) => {
            let note = format!(
                "suspended in {:.2}s, snapshot {} MiB",
                info.took_ms as f64 / 1000.0,
                info.snapshot_bytes >> 20
            );
            mark_suspended(ctx, api, &name, Some(note)).await?;
        }
        Err(e) => {
            warn!(vm = %name, error = %e, "suspend failed; the VM runs on");
            let message = format!("suspend: {e}");
            // Still running: say so rather than stay Suspending (the runtime's answer decides
            // anything else on the next reconcile).
            if runtime_facts(ctx.runtime.inspect(uid).await)? == RuntimeFacts::Running {
                let guard = Guard::phases(&[VmPhase::Suspending]).even_deleting();
                status::update(api, &name, guard, |vm, s| {
                    let now = Timestamp::now();
                    s.phase = Some(VmPhase::Running);
                    conditions::set(
                        &mut s.conditions,
                        condition::SUSPENDED,
                        ConditionStatus::False,
                        api_reason::SUSPEND_CALL_FAILED,
                        &message,
                        vm.metadata.generation,
                        now,
                    );
                    conditions::set(
                        &mut s.conditions,
                        condition::READY,
                        ConditionStatus::True,
                        api_reason::GUEST_READY,
                        "the suspend failed; the VM runs on",
                        vm.metadata.generation,
                        now,
                    );
                    true
                })
                .await?;
            }
            ctx.event(&now, true, api_reason::SUSPEND_CALL_FAILED, message)
                .await;
            back_off(ctx, uid).await;
            return Ok(());
        }
    }
    ctx.sleep.lock().unwrap().failures.remove(uid);
    ctx.kick();
    Ok(())
}

/// Phase Suspended (from Suspending, or a Running/Resuming phase that lags the runtime).
pub async fn mark_suspended(
    ctx: &Context,
    api: &Api<ImpVM>,
    name: &str,
    note: Option<String>,
) -> Result<(), Error> {
    let mut trigger = Trigger::Requested;
    let guard = Guard::phases(&[VmPhase::Running, VmPhase::Suspending, VmPhase::Resuming]);
    let written = status::update(api, name, guard, |vm, s| {
        let now = Timestamp::now();
        let recorded = conditions::find(&s.conditions, condition::SUSPENDED)
            .filter(|c| c.status == ConditionStatus::True.as_str())
            .and_then(|c| Trigger::from_reason(&c.reason));
        trigger = recorded.unwrap_or(match vm.spec.desired_state() {
            DesiredState::ScaleToZero => Trigger::Idle,
            _ => Trigger::Requested,
        });
        if recorded.is_none() {
            conditions::set(
                &mut s.conditions,
                condition::SUSPENDED,
                ConditionStatus::True,
                trigger.reason(true),
                "imp-runtime reports the VM suspended",
                vm.metadata.generation,
                now,
            );
        }
        s.phase = Some(VmPhase::Suspended);
        conditions::set(
            &mut s.conditions,
            condition::READY,
            ConditionStatus::False,
            api_reason::VM_SUSPENDED,
            "suspended: memory and disks are kept on the node",
            vm.metadata.generation,
            now,
        );
        true
    })
    .await?;
    if let Written::Done(now) = written {
        ctx.metrics.suspended(trigger.label());
        let note = note.unwrap_or_else(|| "imp-runtime reports the VM suspended".into());
        info!(vm = %name, trigger = trigger.label(), "{note}");
        ctx.event(&now, false, api_reason::VM_SUSPENDED, note).await;
    }
    Ok(())
}

/// Resuming (condition Suspended=False with the trigger), the runtime call, Running once it
/// reports so.
pub async fn resume(
    ctx: &Context,
    api: &Api<ImpVM>,
    vm: ImpVM,
    uid: &str,
    t: Trigger,
) -> Result<(), Error> {
    let name = vm.name_any();
    let message = why(t, &vm, false);
    let guard = Guard::phases(&[
        VmPhase::Running,
        VmPhase::Suspending,
        VmPhase::Suspended,
        VmPhase::Resuming,
    ]);
    let written = status::update(api, &name, guard, |vm, s| {
        s.phase = Some(VmPhase::Resuming);
        conditions::set(
            &mut s.conditions,
            condition::SUSPENDED,
            ConditionStatus::False,
            t.reason(false),
            &message,
            vm.metadata.generation,
            Timestamp::now(),
        );
        true
    })
    .await?;
    let Written::Done(now) = written else {
        return Ok(());
    };
    let warning = matches!(t, Trigger::Disabled | Trigger::NotAllowed);
    ctx.event(
        &now,
        warning,
        t.reason(false),
        format!("resuming: {message}"),
    )
    .await;
    info!(vm = %name, trigger = t.label(), "asking imp-runtime to resume the VM");
    // Answered once the restored guest's agent said Hello.
    match ctx.runtime.resume(uid).await {
        Ok(info) if info.status.state == VmState::Running => {
            let took = Duration::from_millis(info.took_ms);
            mark_running(ctx, api, &name, uid, Some(took)).await?;
        }
        Ok(info) => {
            debug!(vm = %name, state = ?info.status.state, "resumed VM not Running; the next reconcile decides");
        }
        Err(e) => {
            warn!(vm = %name, error = %e, "resume failed; retried after a backoff");
            let note = format!("resume: {e}");
            ctx.event(&now, true, api_reason::SUSPEND_CALL_FAILED, note)
                .await;
            back_off(ctx, uid).await;
            return Ok(());
        }
    }
    ctx.sleep.lock().unwrap().failures.remove(uid);
    ctx.kick();
    Ok(())
}

/// Holds the VM's task (so nothing is planned for it) for the next backoff step, then asks for
/// a reconcile.
async fn back_off(ctx: &Context, uid: &str) {
    let attempt = {
        let mut mem = ctx.sleep.lock().unwrap();
        let n = mem.failures.entry(uid.to_owned()).or_insert(0);
        *n = n.saturating_add(1);
        *n - 1
    };
    tokio::time::sleep(CALL_RETRY.delay(attempt)).await;
    ctx.kick();
}

/// Phase Running again, Ready=True; the wake's latency when traffic woke it.
pub async fn mark_running(
    ctx: &Context,
    api: &Api<ImpVM>,
    name: &str,
    uid: &str,
    took: Option<Duration>,
) -> Result<(), Error> {
    let mut trigger = Trigger::Requested;
    let guard = Guard::phases(&[VmPhase::Suspending, VmPhase::Suspended, VmPhase::Resuming]);
    let written = status::update(api, name, guard, |vm, s| {
        let now = Timestamp::now();
        let recorded = conditions::find(&s.conditions, condition::SUSPENDED).map(|c| {
            (
                c.status == ConditionStatus::False.as_str(),
                Trigger::from_reason(&c.reason),
            )
        });
        match recorded {
            Some((true, Some(t))) => trigger = t,
            // Resumed behind our back, or an abandoned suspend: say so.
            _ => {
                conditions::set(
                    &mut s.conditions,
                    condition::SUSPENDED,
                    ConditionStatus::False,
                    api_reason::RESUME_REQUESTED,
                    "imp-runtime reports the VM running",
                    vm.metadata.generation,
                    now,
                );
            }
        }
        s.phase = Some(VmPhase::Running);
        conditions::set(
            &mut s.conditions,
            condition::READY,
            ConditionStatus::True,
            api_reason::GUEST_READY,
            "the guest agent answered after the resume",
            vm.metadata.generation,
            now,
        );
        true
    })
    .await?;
    let Written::Done(now) = written else {
        return Ok(());
    };
    let woken_at = {
        let mut mem = ctx.sleep.lock().unwrap();
        mem.traffic.remove(uid);
        mem.wakes.remove(uid).and_then(|w| w.woken_at)
    };
    ctx.metrics.resumed(trigger.label());
    let mut note = match took {
        Some(d) => format!("resumed in {:.2}s", d.as_secs_f64()),
        None => "imp-runtime reports the VM running".into(),
    };
    if trigger == Trigger::Traffic
        && let Some(at) = woken_at
    {
        let wake = at.elapsed().as_secs_f64();
        ctx.metrics.wake(wake);
        note.push_str(&format!("; {wake:.2}s after the wake was seen"));
    }
    info!(vm = %name, trigger = trigger.label(), "{note}");
    ctx.event(&now, false, api_reason::VM_RESUMED, note).await;
    Ok(())
}

/// Condition Suspended=False with the refusal's reason, and a Warning Event (once: the
/// decision only refuses while the condition does not say so already).
pub async fn refuse(ctx: &Context, api: &Api<ImpVM>, vm: &ImpVM, t: Trigger) -> Result<(), Error> {
    let message = why(t, vm, false);
    let written = status::update(api, &vm.name_any(), Guard::ANY, |vm, s| {
        conditions::set(
            &mut s.conditions,
            condition::SUSPENDED,
            ConditionStatus::False,
            t.reason(false),
            &message,
            vm.metadata.generation,
            Timestamp::now(),
        );
        true
    })
    .await?;
    if let Written::Done(now) = written {
        warn!(vm = %vm.name_any(), reason = t.reason(false), "{message}");
        ctx.event(&now, true, t.reason(false), message).await;
    }
    Ok(())
}

/// The refusal no longer applies (desiredState is Running again): drop the condition.
pub async fn clear_refusal(api: &Api<ImpVM>, name: &str) -> Result<(), Error> {
    status::update(api, name, Guard::ANY.even_deleting(), |_, s| {
        conditions::remove(&mut s.conditions, condition::SUSPENDED);
        true
    })
    .await?;
    Ok(())
}

/// Polls the wake counters of the suspended ScaleToZero VMs every [`WAKE_POLL`]; a rise
/// triggers a reconcile (which resumes the VM).
pub async fn wake_loop(ctx: std::sync::Arc<Context>) {
    loop {
        tokio::time::sleep(WAKE_POLL).await;
        let watched: Vec<String> = ctx.sleep.lock().unwrap().wakes.keys().cloned().collect();
        let mut rose = false;
        for uid in watched {
            let Ok(s) = ctx.runtime.linkstats(&uid).await else {
                continue;
            };
            let now = Instant::now();
            let mut mem = ctx.sleep.lock().unwrap();
            if let Some(w) = mem.wakes.get_mut(&uid)
                && w.observe(wake_packets(&s), now)
            {
                info!(uid = %uid, packets = wake_packets(&s), "traffic for a suspended VM: waking it");
                rose = true;
            }
        }
        if rose {
            ctx.kick();
        }
    }
}
