//! Suspend, resume and ScaleToZero, pure: what the ImpVM asks (`spec.desiredState`), the phase
//! and the `Suspended` condition it records, what imp-runtime reports, the VM's link counters and
//! the clock -> the next [`Plan`]. The controller observes and executes (docs/suspend.md, "The
//! agent: phases and ScaleToZero").
//!
//! Phases: Running -> Suspending (written before the runtime is asked) -> Suspended (the runtime
//! reports the snapshot taken and the VMM stopped) -> Resuming (written before the runtime is
//! asked) -> Running. Each write is guarded by the phase it was decided on, and a phase that lags
//! the runtime (an agent restart between the runtime call and the write) is caught up from what
//! the runtime reports, so no step depends on in-memory state surviving.
//!
//! Only persistent VMs without a runner config are suspended: an ephemeral runner VM holds one
//! job, and a suspended runner would hold it without running it. Such a VM asking for it keeps
//! running and says why in its `Suspended` condition and a Warning Event.
//!
//! ScaleToZero (only when the agent runs with IMP_SCALE_TO_ZERO=true): a Running VM whose TAP
//! byte counters did not move for `idleTimeout` is suspended; while it is suspended the runtime
//! counts packets routed to its address (LinkStats.wake_packets), and a rise resumes it. The
//! packet that woke it is not replayed: the sender's TCP retransmits its SYN to the resumed
//! guest. Wake-on-traffic has not been validated on hardware (Firecracker on a metal host); it is
//! tested inside network namespaces with the Firecracker simulator and with a real guest under
//! QEMU.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use imp_api::names::reason;
use imp_api::{DesiredState, VmPhase};

/// Why a VM may not be suspended at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ineligible {
    /// `lifecycle: ephemeral`: it runs one job and is deleted.
    Ephemeral,
    /// It has a runner config (a runner pool's VM).
    Runner,
}

impl Ineligible {
    pub fn message(self, desired: DesiredState) -> String {
        let what = match self {
            Ineligible::Ephemeral => "an ephemeral VM",
            Ineligible::Runner => "a runner VM",
        };
        format!(
            "desiredState {desired:?} is ignored: {what} is never suspended (only persistent VMs without a runner config are)"
        )
    }
}

/// imp-runtime's state of the VM, as far as suspending goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Runtime {
    Running,
    Suspending,
    Suspended,
    Resuming,
    /// Creating or Booting.
    Booting,
    Exited,
    Absent,
    Failed {
        reason: String,
        message: String,
    },
}

/// Why a VM is suspended or resumed: the reason of its `Suspended` condition and of the Event,
/// and the `trigger` label of the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// `desiredState: Suspended` (suspend) or `Running` (resume).
    Requested,
    /// ScaleToZero: no link traffic for `idleTimeout`.
    Idle,
    /// ScaleToZero: packets were sent to the suspended VM's address.
    Traffic,
    /// ScaleToZero asked, but the agent runs without IMP_SCALE_TO_ZERO=true.
    Disabled,
    /// An ephemeral or runner VM (it is never suspended; a forged phase is undone).
    NotAllowed,
}

impl Trigger {
    /// The reason this trigger writes when it suspends (`true`) or resumes.
    pub fn reason(self, suspend: bool) -> &'static str {
        match (self, suspend) {
            (Trigger::Requested, true) => reason::SUSPEND_REQUESTED,
            (Trigger::Requested, false) => reason::RESUME_REQUESTED,
            (Trigger::Idle, _) => reason::IDLE_TIMEOUT,
            (Trigger::Traffic, _) => reason::WOKEN_BY_TRAFFIC,
            (Trigger::Disabled, _) => reason::SCALE_TO_ZERO_DISABLED,
            (Trigger::NotAllowed, _) => reason::SUSPEND_NOT_ALLOWED,
        }
    }

    /// Read back from the `Suspended` condition's reason.
    pub fn from_reason(r: &str) -> Option<Self> {
        [
            (reason::SUSPEND_REQUESTED, Trigger::Requested),
            (reason::RESUME_REQUESTED, Trigger::Requested),
            (reason::IDLE_TIMEOUT, Trigger::Idle),
            (reason::WOKEN_BY_TRAFFIC, Trigger::Traffic),
            (reason::SCALE_TO_ZERO_DISABLED, Trigger::Disabled),
            (reason::SUSPEND_NOT_ALLOWED, Trigger::NotAllowed),
        ]
        .into_iter()
        .find_map(|(name, t)| (name == r).then_some(t))
    }

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Trigger::Requested => "requested",
            Trigger::Idle => "idle",
            Trigger::Traffic => "traffic",
            Trigger::Disabled => "disabled",
            Trigger::NotAllowed => "not_allowed",
        }
    }
}

/// Everything [`decide`] looks at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    /// Running, Suspending, Suspended or Resuming (others are [`super::decide`]'s).
    pub phase: VmPhase,
    pub desired: DesiredState,
    pub ineligible: Option<Ineligible>,
    /// The agent runs with IMP_SCALE_TO_ZERO=true.
    pub scale_to_zero: bool,
    pub runtime: Runtime,
    /// How long the VM's TAP byte counters have not moved (`None`: not observed yet).
    pub idle_for: Option<Duration>,
    pub idle_timeout: Duration,
    /// The wake counter rose since the VM was seen suspended.
    pub woken: bool,
    /// A suspend or resume call of this agent is in flight.
    pub in_flight: bool,
    /// The reason of the `Suspended` condition as recorded.
    pub recorded: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    Nothing,
    /// Write Suspending (condition Suspended=True with the trigger), then ask the runtime.
    Suspend(Trigger),
    /// Write Resuming (condition Suspended=False with the trigger), then ask the runtime.
    Resume(Trigger),
    /// The runtime reports the VM suspended: write Suspended.
    MarkSuspended,
    /// The runtime reports the VM running again: write Running (Ready=True).
    MarkRunning,
    /// Record condition Suspended=False with the trigger's reason and a Warning Event, once.
    Refuse(Trigger),
    /// The refusal no longer applies (desiredState is Running again): drop the condition.
    ClearRefusal,
    /// Write phase Failed.
    Fail {
        reason: String,
        message: String,
    },
}

/// Whether the VM should be suspended now, and why; `Err` with the trigger that keeps it
/// running (refused or resumed).
fn target(f: &Facts) -> Result<Trigger, Option<Trigger>> {
    if f.ineligible.is_some() {
        return Err((f.desired != DesiredState::Running).then_some(Trigger::NotAllowed));
    }
    match f.desired {
        DesiredState::Running => Err(Some(Trigger::Requested)),
        DesiredState::Suspended => Ok(Trigger::Requested),
        DesiredState::ScaleToZero if !f.scale_to_zero => Err(Some(Trigger::Disabled)),
        DesiredState::ScaleToZero => match f.phase {
            // Asleep: stays so until traffic arrives.
            VmPhase::Suspending | VmPhase::Suspended if !f.woken => Ok(Trigger::Idle),
            VmPhase::Suspending | VmPhase::Suspended => Err(Some(Trigger::Traffic)),
            // Waking: finish it; the idle clock starts again in Running.
            VmPhase::Resuming => Err(Some(Trigger::Traffic)),
            _ if f.idle_for.is_some_and(|d| d >= f.idle_timeout) => Ok(Trigger::Idle),
            _ => Err(None),
        },
    }
}

/// A refusal recorded in the condition, as opposed to a suspend or resume reason.
fn is_refusal(recorded: Option<&str>) -> bool {
    matches!(
        recorded.and_then(Trigger::from_reason),
        Some(Trigger::Disabled | Trigger::NotAllowed)
    )
}

pub fn decide(f: &Facts) -> Plan {
    let target = target(f);
    let lost = |what: &str| match &f.runtime {
        Runtime::Absent => Some(Plan::Fail {
            reason: reason::VM_LOST.into(),
            message: format!("imp-runtime has no record of the VM while it was {what}"),
        }),
        Runtime::Exited => Some(Plan::Fail {
            reason: reason::GUEST_EXITED.into(),
            message: format!("the VM's process ended while it was {what}"),
        }),
        Runtime::Failed { reason, message } => Some(Plan::Fail {
            reason: reason.clone(),
            message: message.clone(),
        }),
        _ => None,
    };
    match f.phase {
        VmPhase::Running => {
            if f.in_flight {
                return Plan::Nothing;
            }
            match (&f.runtime, target) {
                (Runtime::Running, Ok(t)) => Plan::Suspend(t),
                // Suspended behind our back (or our Suspending write was lost): catch up.
                (Runtime::Suspended, Ok(_)) => Plan::MarkSuspended,
                (Runtime::Suspended, Err(t)) => Plan::Resume(t.unwrap_or(Trigger::Requested)),
                (Runtime::Running, Err(Some(t @ (Trigger::Disabled | Trigger::NotAllowed)))) => {
                    refuse_once(f, t)
                }
                // A refusal that no longer applies (desiredState changed, or the agent now
                // runs with ScaleToZero enabled) is dropped.
                (Runtime::Running, Err(_)) => clear(f),
                // Booting, Exited, Absent, Failed: the lifecycle's (decide.rs) to handle.
                _ => Plan::Nothing,
            }
        }
        VmPhase::Suspending => {
            if let Some(p) = lost("suspending") {
                return p;
            }
            if f.in_flight {
                return Plan::Nothing;
            }
            match (&f.runtime, target) {
                (Runtime::Suspended, Ok(_)) => Plan::MarkSuspended,
                (Runtime::Suspended, Err(t)) => Plan::Resume(t.unwrap_or(Trigger::Requested)),
                // The call never landed or was refused: ask again, or give up suspending.
                (Runtime::Running, Ok(t)) => Plan::Suspend(t),
                (Runtime::Running, Err(_)) => Plan::MarkRunning,
                _ => Plan::Nothing, // the runtime is still at it
            }
        }
        VmPhase::Suspended => {
            if let Some(p) = lost("suspended") {
                return p;
            }
            if f.in_flight {
                return Plan::Nothing;
            }
            match (&f.runtime, target) {
                (Runtime::Suspended, Err(t)) => Plan::Resume(t.unwrap_or(Trigger::Requested)),
                (Runtime::Running, _) => Plan::MarkRunning,
                _ => Plan::Nothing,
            }
        }
        VmPhase::Resuming => {
            if let Some(p) = lost("resuming") {
                return p;
            }
            if f.in_flight {
                return Plan::Nothing;
            }
            match (&f.runtime, target) {
                (Runtime::Running, _) => Plan::MarkRunning,
                // Asked to sleep again before the resume was sent: stay suspended.
                (Runtime::Suspended, Ok(_)) if f.desired == DesiredState::Suspended => {
                    Plan::MarkSuspended
                }
                (Runtime::Suspended, _) => {
                    let t = f
                        .recorded
                        .as_deref()
                        .and_then(Trigger::from_reason)
                        .unwrap_or(Trigger::Requested);
                    Plan::Resume(t)
                }
                _ => Plan::Nothing,
            }
        }
        _ => Plan::Nothing,
    }
}

fn refuse_once(f: &Facts, t: Trigger) -> Plan {
    if f.recorded.as_deref() == Some(t.reason(false)) {
        Plan::Nothing
    } else {
        Plan::Refuse(t)
    }
}

fn clear(f: &Facts) -> Plan {
    if is_refusal(f.recorded.as_deref()) {
        Plan::ClearRefusal
    } else {
        Plan::Nothing
    }
}

/// ScaleToZero's in-memory clocks, per VM uid. Lost on an agent restart, which only delays a
/// suspend (the idle clock starts again) or a wake (the baseline is read again; the sender
/// retransmits).
#[derive(Default)]
pub struct Memory {
    pub traffic: HashMap<String, Traffic>,
    pub wakes: HashMap<String, Wake>,
    /// Consecutive failed suspend/resume calls.
    pub failures: HashMap<String, u32>,
}

/// The VM's TAP byte counters and since when they have not moved: the idle clock of ScaleToZero.
/// Kept in memory only; after an agent restart the clock starts again, which can only delay a
/// suspend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Traffic {
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub since: Instant,
}

impl Traffic {
    /// The next clock from the previous one and a new reading at `now`.
    pub fn observe(prev: Option<Traffic>, rx_bytes: u64, tx_bytes: u64, now: Instant) -> Traffic {
        match prev {
            Some(p) if p.rx_bytes == rx_bytes && p.tx_bytes == tx_bytes => p,
            _ => Traffic {
                rx_bytes,
                tx_bytes,
                since: now,
            },
        }
    }

    pub fn idle_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.since)
    }
}

/// The wake counter of one suspended VM: the value it had when the agent first saw the VM
/// suspended, and when it was first seen above it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wake {
    pub baseline: u64,
    pub woken_at: Option<Instant>,
}

impl Wake {
    pub fn new(baseline: u64) -> Self {
        Self {
            baseline,
            woken_at: None,
        }
    }

    /// Records a reading; `true` the first time it is above the baseline.
    pub fn observe(&mut self, packets: u64, now: Instant) -> bool {
        if self.woken_at.is_none() && packets > self.baseline {
            self.woken_at = Some(now);
            return true;
        }
        false
    }

    pub fn woken(&self) -> bool {
        self.woken_at.is_some()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use DesiredState as D;
    use Runtime as R;

    const IDLE: Duration = Duration::from_secs(10);

    /// Facts of a persistent VM on an agent with ScaleToZero enabled, nothing observed yet.
    pub(crate) fn facts(phase: VmPhase, desired: D, runtime: R) -> Facts {
        Facts {
            phase,
            desired,
            ineligible: None,
            scale_to_zero: true,
            runtime,
            idle_for: None,
            idle_timeout: IDLE,
            woken: false,
            in_flight: false,
            recorded: None,
        }
    }

    fn failed() -> R {
        R::Failed {
            reason: reason::FIRECRACKER_UNRESPONSIVE.into(),
            message: "m".into(),
        }
    }

    #[test]
    fn desired_suspended_suspends_a_running_vm_and_records_it_when_done() {
        let f = facts(VmPhase::Running, D::Suspended, R::Running);
        assert_eq!(decide(&f), Plan::Suspend(Trigger::Requested));
        let f = facts(VmPhase::Suspending, D::Suspended, R::Suspended);
        assert_eq!(decide(&f), Plan::MarkSuspended);
        let f = facts(VmPhase::Suspended, D::Suspended, R::Suspended);
        assert_eq!(decide(&f), Plan::Nothing);
    }

    #[test]
    fn desired_running_resumes_a_suspended_vm_and_records_it_when_done() {
        let f = facts(VmPhase::Suspended, D::Running, R::Suspended);
        assert_eq!(decide(&f), Plan::Resume(Trigger::Requested));
        let f = facts(VmPhase::Resuming, D::Running, R::Running);
        assert_eq!(decide(&f), Plan::MarkRunning);
        let f = facts(VmPhase::Running, D::Running, R::Running);
        assert_eq!(decide(&f), Plan::Nothing);
    }

    #[test]
    fn nothing_is_started_while_a_call_is_in_flight() {
        for (phase, desired, rt) in [
            (VmPhase::Running, D::Suspended, R::Running),
            (VmPhase::Suspending, D::Suspended, R::Suspending),
            (VmPhase::Suspending, D::Suspended, R::Running),
            (VmPhase::Suspended, D::Running, R::Suspended),
            (VmPhase::Resuming, D::Running, R::Suspended),
        ] {
            let mut f = facts(phase, desired, rt);
            f.in_flight = true;
            assert_eq!(decide(&f), Plan::Nothing, "{f:?}");
        }
    }

    #[test]
    fn the_runtime_still_working_is_waited_for() {
        for (phase, rt) in [
            (VmPhase::Suspending, R::Suspending),
            (VmPhase::Suspending, R::Resuming),
            (VmPhase::Suspended, R::Suspending),
            (VmPhase::Suspended, R::Resuming),
            (VmPhase::Resuming, R::Resuming),
            (VmPhase::Resuming, R::Suspending),
        ] {
            for d in [D::Running, D::Suspended] {
                assert_eq!(decide(&facts(phase, d, rt.clone())), Plan::Nothing);
            }
        }
    }

    #[test]
    fn a_lagging_phase_catches_up_with_the_runtime() {
        // Agent restarted after the runtime finished but before the phase write.
        let f = facts(VmPhase::Suspending, D::Suspended, R::Suspended);
        assert_eq!(decide(&f), Plan::MarkSuspended);
        let f = facts(VmPhase::Resuming, D::Running, R::Running);
        assert_eq!(decide(&f), Plan::MarkRunning);
        // Running in status, suspended in the runtime (the Suspending write was lost on its way).
        let f = facts(VmPhase::Running, D::Suspended, R::Suspended);
        assert_eq!(decide(&f), Plan::MarkSuspended);
        // Suspended in status but running in the runtime: Running is the truth.
        for d in [D::Running, D::Suspended] {
            let f = facts(VmPhase::Suspended, d, R::Running);
            assert_eq!(decide(&f), Plan::MarkRunning);
        }
    }

    #[test]
    fn a_call_that_never_landed_is_repeated_or_abandoned() {
        // Suspending written, runtime still Running: ask again while still wanted...
        let f = facts(VmPhase::Suspending, D::Suspended, R::Running);
        assert_eq!(decide(&f), Plan::Suspend(Trigger::Requested));
        // ...or go back to Running when it is not.
        let f = facts(VmPhase::Suspending, D::Running, R::Running);
        assert_eq!(decide(&f), Plan::MarkRunning);
        // Resuming written, runtime still Suspended: ask again with the recorded trigger.
        let mut f = facts(VmPhase::Resuming, D::ScaleToZero, R::Suspended);
        f.recorded = Some(reason::WOKEN_BY_TRAFFIC.into());
        assert_eq!(decide(&f), Plan::Resume(Trigger::Traffic));
        let f = facts(VmPhase::Resuming, D::Running, R::Suspended);
        assert_eq!(decide(&f), Plan::Resume(Trigger::Requested));
        // ...unless it is asked to sleep again meanwhile.
        let f = facts(VmPhase::Resuming, D::Suspended, R::Suspended);
        assert_eq!(decide(&f), Plan::MarkSuspended);
    }

    #[test]
    fn changing_ones_mind_while_suspending_resumes_once_suspended() {
        let f = facts(VmPhase::Suspending, D::Running, R::Suspended);
        assert_eq!(decide(&f), Plan::Resume(Trigger::Requested));
        let f = facts(VmPhase::Running, D::Running, R::Suspended);
        assert_eq!(decide(&f), Plan::Resume(Trigger::Requested));
    }

    #[test]
    fn a_vm_lost_while_suspended_fails_with_the_runtimes_word() {
        for phase in [VmPhase::Suspending, VmPhase::Suspended, VmPhase::Resuming] {
            for d in [D::Running, D::Suspended, D::ScaleToZero] {
                let mut f = facts(phase, d, R::Absent);
                f.in_flight = true; // even with a call in flight: the VM is gone
                assert!(
                    matches!(decide(&f), Plan::Fail { reason, .. } if reason == reason::VM_LOST)
                );
                f.runtime = R::Exited;
                assert!(
                    matches!(decide(&f), Plan::Fail { reason, .. } if reason == reason::GUEST_EXITED)
                );
                f.runtime = failed();
                assert_eq!(
                    decide(&f),
                    Plan::Fail {
                        reason: reason::FIRECRACKER_UNRESPONSIVE.into(),
                        message: "m".into()
                    }
                );
            }
        }
    }

    #[test]
    fn running_vm_failures_are_left_to_the_lifecycle() {
        for rt in [R::Absent, R::Exited, failed(), R::Booting] {
            let f = facts(VmPhase::Running, D::Suspended, rt);
            assert_eq!(decide(&f), Plan::Nothing);
        }
    }

    #[test]
    fn ephemeral_and_runner_vms_are_refused_once_and_never_suspended() {
        for why in [Ineligible::Ephemeral, Ineligible::Runner] {
            for d in [D::Suspended, D::ScaleToZero] {
                let mut f = facts(VmPhase::Running, d, R::Running);
                f.ineligible = Some(why);
                f.idle_for = Some(Duration::from_secs(3600));
                assert_eq!(decide(&f), Plan::Refuse(Trigger::NotAllowed));
                f.recorded = Some(reason::SUSPEND_NOT_ALLOWED.into());
                assert_eq!(decide(&f), Plan::Nothing);
            }
            // A forged suspend phase on such a VM is undone.
            let mut f = facts(VmPhase::Suspended, D::Suspended, R::Suspended);
            f.ineligible = Some(why);
            assert_eq!(decide(&f), Plan::Resume(Trigger::NotAllowed));
            // Back to Running: the refusal is dropped.
            let mut f = facts(VmPhase::Running, D::Running, R::Running);
            f.ineligible = Some(why);
            f.recorded = Some(reason::SUSPEND_NOT_ALLOWED.into());
            assert_eq!(decide(&f), Plan::ClearRefusal);
        }
        assert!(
            Ineligible::Runner
                .message(D::Suspended)
                .contains("runner VM")
        );
    }

    #[test]
    fn scale_to_zero_disabled_keeps_the_vm_running_and_says_so_once() {
        let mut f = facts(VmPhase::Running, D::ScaleToZero, R::Running);
        f.scale_to_zero = false;
        f.idle_for = Some(Duration::from_secs(3600));
        assert_eq!(decide(&f), Plan::Refuse(Trigger::Disabled));
        f.recorded = Some(reason::SCALE_TO_ZERO_DISABLED.into());
        assert_eq!(decide(&f), Plan::Nothing);
        // Suspended by an agent that had it enabled: woken up.
        let mut f = facts(VmPhase::Suspended, D::ScaleToZero, R::Suspended);
        f.scale_to_zero = false;
        assert_eq!(decide(&f), Plan::Resume(Trigger::Disabled));
        // Asking for Running again clears the notice; a plain Suspended request is unaffected.
        let mut f = facts(VmPhase::Running, D::Running, R::Running);
        f.scale_to_zero = false;
        f.recorded = Some(reason::SCALE_TO_ZERO_DISABLED.into());
        assert_eq!(decide(&f), Plan::ClearRefusal);
        f.desired = D::Suspended;
        assert_eq!(decide(&f), Plan::Suspend(Trigger::Requested));
        // Restarted with IMP_SCALE_TO_ZERO=true: the notice goes, the idle clock decides.
        let mut f = facts(VmPhase::Running, D::ScaleToZero, R::Running);
        f.recorded = Some(reason::SCALE_TO_ZERO_DISABLED.into());
        assert_eq!(decide(&f), Plan::ClearRefusal);
    }

    #[test]
    fn scale_to_zero_suspends_after_the_idle_timeout_only() {
        let mut f = facts(VmPhase::Running, D::ScaleToZero, R::Running);
        assert_eq!(decide(&f), Plan::Nothing, "idle clock not started");
        f.idle_for = Some(IDLE - Duration::from_millis(1));
        assert_eq!(decide(&f), Plan::Nothing);
        f.idle_for = Some(IDLE);
        assert_eq!(decide(&f), Plan::Suspend(Trigger::Idle));
        // Nothing to clear after a wake: the condition says WokenByTraffic.
        f.idle_for = Some(Duration::ZERO);
        f.recorded = Some(reason::WOKEN_BY_TRAFFIC.into());
        assert_eq!(decide(&f), Plan::Nothing);
    }

    #[test]
    fn scale_to_zero_sleeps_until_traffic_wakes_it() {
        let mut f = facts(VmPhase::Suspended, D::ScaleToZero, R::Suspended);
        f.recorded = Some(reason::IDLE_TIMEOUT.into());
        assert_eq!(decide(&f), Plan::Nothing);
        f.woken = true;
        assert_eq!(decide(&f), Plan::Resume(Trigger::Traffic));
        // Woken while the suspend was still finishing: resumed once the runtime is done.
        let mut f = facts(VmPhase::Suspending, D::ScaleToZero, R::Suspended);
        f.woken = true;
        assert_eq!(decide(&f), Plan::Resume(Trigger::Traffic));
        let mut f = facts(VmPhase::Suspending, D::ScaleToZero, R::Suspended);
        f.woken = false;
        assert_eq!(decide(&f), Plan::MarkSuspended);
        // Resuming is finished, never turned back into a suspend by the idle clock.
        let mut f = facts(VmPhase::Resuming, D::ScaleToZero, R::Running);
        f.idle_for = Some(Duration::from_secs(3600));
        assert_eq!(decide(&f), Plan::MarkRunning);
    }

    #[test]
    fn desired_suspended_is_not_woken_by_traffic() {
        let mut f = facts(VmPhase::Suspended, D::Suspended, R::Suspended);
        f.woken = true;
        assert_eq!(decide(&f), Plan::Nothing);
    }

    #[test]
    fn other_phases_are_not_ours() {
        for p in [
            VmPhase::Pending,
            VmPhase::Scheduled,
            VmPhase::Starting,
            VmPhase::Succeeded,
            VmPhase::Failed,
            VmPhase::Terminating,
            VmPhase::RetryExhausted,
        ] {
            assert_eq!(decide(&facts(p, D::Suspended, R::Suspended)), Plan::Nothing);
        }
    }

    #[test]
    fn triggers_round_trip_through_their_reasons() {
        for t in [
            Trigger::Requested,
            Trigger::Idle,
            Trigger::Traffic,
            Trigger::Disabled,
            Trigger::NotAllowed,
        ] {
            for suspend in [true, false] {
                assert_eq!(Trigger::from_reason(t.reason(suspend)), Some(t));
            }
        }
        assert_eq!(Trigger::from_reason(reason::GUEST_READY), None);
    }

    #[test]
    fn the_idle_clock_restarts_on_any_byte() {
        let t0 = Instant::now();
        let a = Traffic::observe(None, 10, 20, t0);
        assert_eq!(a.idle_for(t0), Duration::ZERO);
        let t1 = t0 + Duration::from_secs(5);
        let b = Traffic::observe(Some(a), 10, 20, t1);
        assert_eq!(b.idle_for(t1), Duration::from_secs(5));
        let c = Traffic::observe(Some(b), 10, 21, t1);
        assert_eq!(c.idle_for(t1), Duration::ZERO);
        let d = Traffic::observe(Some(c), 11, 21, t1 + Duration::from_secs(1));
        assert_eq!(d.since, t1 + Duration::from_secs(1));
        // A clock never reads negative.
        assert_eq!(d.idle_for(t0), Duration::ZERO);
    }

    #[test]
    fn a_wake_is_a_rise_above_the_baseline_seen_once() {
        let t0 = Instant::now();
        let mut w = Wake::new(3);
        assert!(!w.observe(3, t0));
        assert!(!w.woken());
        assert!(w.observe(4, t0 + Duration::from_secs(1)));
        assert!(!w.observe(9, t0 + Duration::from_secs(2)), "reported once");
        assert_eq!(w.woken_at, Some(t0 + Duration::from_secs(1)));
        // A counter reset (rules re-created) below the baseline is no wake.
        let mut w = Wake::new(5);
        assert!(!w.observe(0, t0));
    }
}
