//! The agent's one decision for an ImpVM, pure: what the ImpVM says + what imp-runtime reports +
//! what this agent has in flight (+ what suspend and ScaleToZero observed) -> the next action. No
//! I/O; the controller executes the action. The lifecycle (boot, handoff, failure, release,
//! teardown) decides first; where it has nothing to do, [`suspend::decide`] may.

use imp_api::{VmPhase, names::reason};

use super::handoff::{self, Handoff, Step};
use super::suspend::{self, Plan, Trigger};

/// The facts of the ImpVM that matter to the agent on one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmFacts {
    /// `spec.nodeName` is this agent's node.
    pub bound_here: bool,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    pub phase: Option<VmPhase>,
    /// Condition TornDown=True is recorded.
    pub torn_down: bool,
    /// `spec.runnerConfigSecret` is set.
    pub runner: bool,
    pub handoff: Handoff,
}

/// What imp-runtime reports for the VM's uid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RuntimeFacts {
    Absent,
    /// Creating or Booting.
    Booting,
    Running,
    /// Suspending, Suspended or Resuming ([`suspend`] decides on these).
    Suspending,
    Suspended,
    Resuming,
    /// The VM's process ended.
    Exited,
    Failed {
        reason: String,
        message: String,
    },
}

/// Work this agent is doing for the VM right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFlight {
    /// Writing Starting, PUT to the runtime, writing Running.
    Boot,
    /// The handoff and the wait for the runner's exit.
    Runner,
    /// Writing Suspending and asking the runtime to suspend ([`suspend`]).
    Suspend,
    /// Writing Resuming and asking the runtime to resume.
    Resume,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Nothing,
    /// Abort local work, DELETE the runtime VM, then record TornDown=True.
    Teardown,
    /// Only record TornDown=True (nothing is left on the host).
    RecordTornDown,
    /// Abort local work and DELETE the runtime VM (terminal phase or no longer bound here).
    Release,
    /// Write Starting, PUT the spec, write Running (or Failed with the runtime's reason).
    Boot,
    /// In-place restart: DELETE the old instance, then Boot.
    Restart,
    /// Begin the handoff: Secret, Sent, Exec, Started, Secret deleted, then wait for Exited.
    Handoff,
    /// The runner started before: reconnect and wait for its Exited.
    Reattach,
    /// `Sent` without `Started` and nothing in flight: Failed HandoffAmbiguous, delete the Secret.
    DeclareAmbiguous,
    /// Write phase Failed (the VM lives: Starting, Running or a suspend phase).
    Fail {
        reason: String,
        message: String,
    },
    /// Write Suspending (condition Suspended=True with the trigger), then ask the runtime.
    Suspend(Trigger),
    /// Write Resuming (condition Suspended=False with the trigger), then ask the runtime.
    Resume(Trigger),
    /// The runtime reports the VM suspended: write Suspended.
    MarkSuspended,
    /// The runtime reports the VM running again: write Running (Ready=True).
    MarkRunning,
    /// Record condition Suspended=False with the trigger's reason and a Warning Event, once.
    RefuseSuspend(Trigger),
    /// The refusal no longer applies: drop the condition.
    ClearSuspendRefusal,
}

/// The next action for a VM. `sleep` is what suspend and ScaleToZero observed, for a VM bound
/// here, not being deleted, in a phase [`suspend::decide`] owns (Running only in part).
pub fn decide(
    vm: &VmFacts,
    rt: &RuntimeFacts,
    in_flight: Option<InFlight>,
    sleep: Option<&suspend::Facts>,
) -> Action {
    match (lifecycle(vm, rt, in_flight), sleep) {
        (Action::Nothing, Some(f)) if vm.bound_here && !vm.deleting => {
            from_plan(suspend::decide(f))
        }
        (action, _) => action,
    }
}

fn from_plan(plan: Plan) -> Action {
    match plan {
        Plan::Nothing => Action::Nothing,
        Plan::Suspend(t) => Action::Suspend(t),
        Plan::Resume(t) => Action::Resume(t),
        Plan::MarkSuspended => Action::MarkSuspended,
        Plan::MarkRunning => Action::MarkRunning,
        Plan::Refuse(t) => Action::RefuseSuspend(t),
        Plan::ClearRefusal => Action::ClearSuspendRefusal,
        Plan::Fail { reason, message } => Action::Fail { reason, message },
    }
}

/// Whether the VM's monitor (probes, guest metrics) should run: a Running guest that is not
/// being deleted, suspended or resumed.
pub fn monitored(vm: &VmFacts, rt: &RuntimeFacts, in_flight: Option<InFlight>) -> bool {
    vm.phase == Some(VmPhase::Running)
        && !vm.deleting
        && *rt == RuntimeFacts::Running
        && !matches!(in_flight, Some(InFlight::Suspend | InFlight::Resume))
}

/// Boot, handoff, failure, release and teardown.
fn lifecycle(vm: &VmFacts, rt: &RuntimeFacts, in_flight: Option<InFlight>) -> Action {
    let present = *rt != RuntimeFacts::Absent;
    // Deletion (the operator also sets Terminating), or no longer ours: tear down, then record it.
    if vm.deleting || vm.phase == Some(VmPhase::Terminating) || !vm.bound_here {
        if present || in_flight.is_some() {
            return if vm.bound_here {
                Action::Teardown
            } else {
                Action::Release
            };
        }
        return if vm.bound_here && !vm.torn_down {
            Action::RecordTornDown
        } else {
            Action::Nothing
        };
    }
    match vm.phase {
        Some(VmPhase::Succeeded | VmPhase::Failed | VmPhase::RetryExhausted) => {
            // The run is over (or the operator declared it lost): release the host resources
            // (an exited instance still holds its TAP and disk until DELETE).
            if present || in_flight.is_some() {
                Action::Release
            } else {
                Action::Nothing
            }
        }
        Some(VmPhase::Scheduled) => match (in_flight, rt) {
            (Some(InFlight::Boot), _) => Action::Nothing,
            // Starting is written before the PUT, so an instance here is from a previous run.
            (_, RuntimeFacts::Absent) if in_flight.is_none() => Action::Boot,
            (None, _) => Action::Restart,
            (Some(_), _) => Action::Release,
        },
        Some(VmPhase::Starting) => match (in_flight, rt) {
            (Some(_), _) => Action::Nothing,
            (None, RuntimeFacts::Failed { reason, message }) => Action::Fail {
                reason: reason.clone(),
                message: message.clone(),
            },
            (None, RuntimeFacts::Exited) => Action::Fail {
                reason: reason::GUEST_EXITED.into(),
                message: "the VM's process ended during boot".into(),
            },
            // Absent (PUT never landed), Booting or Running: PUT again (idempotent by uid).
            (None, _) => Action::Boot,
        },
        Some(VmPhase::Running) => running(vm, rt, in_flight),
        // Suspending, Suspended, Resuming: suspend.rs decides (deletion and release are above).
        _ => Action::Nothing,
    }
}

fn running(vm: &VmFacts, rt: &RuntimeFacts, in_flight: Option<InFlight>) -> Action {
    if let RuntimeFacts::Failed { reason, message } = rt {
        return Action::Fail {
            reason: reason.clone(),
            message: message.clone(),
        };
    }
    if !vm.runner {
        return match rt {
            RuntimeFacts::Exited => Action::Fail {
                reason: reason::GUEST_EXITED.into(),
                message: "the VM's process ended".into(),
            },
            RuntimeFacts::Absent => Action::Fail {
                reason: reason::VM_LOST.into(),
                message: "imp-runtime has no record of the VM".into(),
            },
            _ => Action::Nothing,
        };
    }
    if in_flight == Some(InFlight::Runner) {
        return Action::Nothing;
    }
    // Where a runner task would start from the recorded handoff (the machine's restart rule).
    match handoff::start(vm.handoff).step {
        // Whatever the runtime says: the config may have reached the guest, never send it again.
        Step::DeclareAmbiguous => Action::DeclareAmbiguous,
        Step::VerifyBinding => match rt {
            RuntimeFacts::Running => Action::Handoff,
            RuntimeFacts::Booting => Action::Nothing,
            RuntimeFacts::Absent => Action::Fail {
                reason: reason::VM_LOST.into(),
                message: "imp-runtime has no record of the VM".into(),
            },
            _ => Action::Fail {
                reason: reason::GUEST_EXITED.into(),
                message: "the VM's process ended before the runner was handed its config".into(),
            },
        },
        Step::Connect => match rt {
            RuntimeFacts::Running => Action::Reattach,
            _ => Action::Fail {
                reason: reason::RUNNER_EXIT_UNKNOWN.into(),
                message: "the VM ended before the runner's exit code was collected".into(),
            },
        },
        // The handoff is over.
        _ => Action::Nothing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RuntimeFacts as R;

    fn vm(phase: VmPhase) -> VmFacts {
        VmFacts {
            bound_here: true,
            deleting: false,
            phase: Some(phase),
            torn_down: false,
            runner: false,
            handoff: Handoff::NotStarted,
        }
    }

    fn runner(phase: VmPhase, handoff: Handoff) -> VmFacts {
        VmFacts {
            runner: true,
            handoff,
            ..vm(phase)
        }
    }

    fn failed(reason: &str) -> R {
        R::Failed {
            reason: reason.into(),
            message: "m".into(),
        }
    }

    #[test]
    fn scheduled_boots() {
        assert_eq!(
            lifecycle(&vm(VmPhase::Scheduled), &R::Absent, None),
            Action::Boot
        );
        assert_eq!(
            lifecycle(&vm(VmPhase::Scheduled), &R::Absent, Some(InFlight::Boot)),
            Action::Nothing
        );
    }

    #[test]
    fn scheduled_with_an_old_instance_restarts_in_place() {
        for rt in [R::Running, R::Exited, failed(reason::GUEST_PANICKED)] {
            assert_eq!(
                lifecycle(&vm(VmPhase::Scheduled), &rt, None),
                Action::Restart
            );
        }
    }

    #[test]
    fn starting_resumes_or_reports_the_runtime_failure() {
        for rt in [R::Absent, R::Booting, R::Running] {
            assert_eq!(
                lifecycle(&vm(VmPhase::Starting), &rt, None),
                Action::Boot,
                "{rt:?}"
            );
        }
        assert_eq!(
            lifecycle(&vm(VmPhase::Starting), &R::Booting, Some(InFlight::Boot)),
            Action::Nothing
        );
        assert_eq!(
            lifecycle(
                &vm(VmPhase::Starting),
                &failed(reason::ROOTFS_PULL_FAILED),
                None
            ),
            Action::Fail {
                reason: reason::ROOTFS_PULL_FAILED.into(),
                message: "m".into()
            }
        );
        assert!(matches!(
            lifecycle(&vm(VmPhase::Starting), &R::Exited, None),
            Action::Fail { reason, .. } if reason == reason::GUEST_EXITED
        ));
    }

    #[test]
    fn running_plain_vm_is_watched() {
        assert_eq!(
            lifecycle(&vm(VmPhase::Running), &R::Running, None),
            Action::Nothing
        );
        assert!(matches!(
            lifecycle(&vm(VmPhase::Running), &R::Exited, None),
            Action::Fail { reason, .. } if reason == reason::GUEST_EXITED
        ));
        assert!(matches!(
            lifecycle(&vm(VmPhase::Running), &R::Absent, None),
            Action::Fail { reason, .. } if reason == reason::VM_LOST
        ));
        assert!(matches!(
            lifecycle(&vm(VmPhase::Running), &failed(reason::FIRECRACKER_UNRESPONSIVE), None),
            Action::Fail { reason, .. } if reason == reason::FIRECRACKER_UNRESPONSIVE
        ));
    }

    #[test]
    fn running_runner_vm_hands_off_once() {
        let v = runner(VmPhase::Running, Handoff::NotStarted);
        assert_eq!(lifecycle(&v, &R::Running, None), Action::Handoff);
        assert_eq!(
            lifecycle(&v, &R::Running, Some(InFlight::Runner)),
            Action::Nothing
        );
        assert_eq!(lifecycle(&v, &R::Booting, None), Action::Nothing);
    }

    #[test]
    fn sent_without_started_and_nothing_in_flight_is_ambiguous_whatever_the_runtime_says() {
        let v = runner(VmPhase::Running, Handoff::Sent);
        for rt in [R::Running, R::Exited, R::Absent, R::Booting] {
            assert_eq!(lifecycle(&v, &rt, None), Action::DeclareAmbiguous, "{rt:?}");
        }
        // Our own handoff in flight: not ambiguous (yet).
        assert_eq!(
            lifecycle(&v, &R::Running, Some(InFlight::Runner)),
            Action::Nothing
        );
    }

    #[test]
    fn started_runner_is_reattached_or_its_loss_reported() {
        let v = runner(VmPhase::Running, Handoff::Started);
        assert_eq!(lifecycle(&v, &R::Running, None), Action::Reattach);
        for rt in [R::Exited, R::Absent] {
            assert!(matches!(
                lifecycle(&v, &rt, None),
                Action::Fail { reason, .. } if reason == reason::RUNNER_EXIT_UNKNOWN
            ));
        }
    }

    #[test]
    fn deletion_tears_down_then_records() {
        let mut v = runner(VmPhase::Terminating, Handoff::Started);
        assert_eq!(lifecycle(&v, &R::Running, None), Action::Teardown);
        assert_eq!(
            lifecycle(&v, &R::Exited, Some(InFlight::Runner)),
            Action::Teardown
        );
        assert_eq!(
            lifecycle(&v, &R::Absent, Some(InFlight::Runner)),
            Action::Teardown
        );
        assert_eq!(lifecycle(&v, &R::Absent, None), Action::RecordTornDown);
        v.torn_down = true;
        assert_eq!(lifecycle(&v, &R::Absent, None), Action::Nothing);
        // deletionTimestamp before the operator wrote Terminating
        let mut d = vm(VmPhase::Running);
        d.deleting = true;
        assert_eq!(lifecycle(&d, &R::Running, None), Action::Teardown);
    }

    #[test]
    fn unbound_vm_is_released_without_a_record() {
        let mut v = vm(VmPhase::Pending);
        v.bound_here = false;
        assert_eq!(lifecycle(&v, &R::Running, None), Action::Release);
        assert_eq!(lifecycle(&v, &R::Absent, None), Action::Nothing);
    }

    #[test]
    fn terminal_phases_release_the_instance() {
        for p in [VmPhase::Succeeded, VmPhase::Failed, VmPhase::RetryExhausted] {
            assert_eq!(lifecycle(&vm(p), &R::Exited, None), Action::Release);
            assert_eq!(
                lifecycle(&vm(p), &R::Running, Some(InFlight::Runner)),
                Action::Release
            );
            assert_eq!(lifecycle(&vm(p), &R::Absent, None), Action::Nothing);
        }
    }

    #[test]
    fn suspend_phases_are_left_to_suspend_rs_except_deletion_and_release() {
        for p in [VmPhase::Suspending, VmPhase::Suspended, VmPhase::Resuming] {
            for rt in [
                R::Suspended,
                R::Suspending,
                R::Resuming,
                R::Running,
                R::Absent,
            ] {
                assert_eq!(
                    lifecycle(&vm(p), &rt, None),
                    Action::Nothing,
                    "{p:?} {rt:?}"
                );
            }
            let mut d = vm(p);
            d.deleting = true;
            assert_eq!(lifecycle(&d, &R::Suspended, None), Action::Teardown);
            assert_eq!(
                lifecycle(&d, &R::Absent, Some(InFlight::Resume)),
                Action::Teardown
            );
            d.bound_here = false;
            assert_eq!(lifecycle(&d, &R::Suspended, None), Action::Release);
        }
        // A plain Running VM whose runtime suspends is no failure.
        for rt in [R::Suspending, R::Suspended, R::Resuming] {
            assert_eq!(lifecycle(&vm(VmPhase::Running), &rt, None), Action::Nothing);
        }
    }

    #[test]
    fn operator_phases_are_left_alone() {
        for p in [VmPhase::Pending, VmPhase::Suspended] {
            assert_eq!(lifecycle(&vm(p), &R::Absent, None), Action::Nothing);
        }
        let mut v = vm(VmPhase::Scheduled);
        v.phase = None;
        assert_eq!(lifecycle(&v, &R::Absent, None), Action::Nothing);
    }

    #[test]
    fn suspend_decides_where_the_lifecycle_has_nothing_to_do() {
        use imp_api::DesiredState as D;
        use suspend::Runtime as S;
        let f = suspend::tests::facts(VmPhase::Running, D::Suspended, S::Running);
        let v = vm(VmPhase::Running);
        assert_eq!(
            decide(&v, &R::Running, None, Some(&f)),
            Action::Suspend(Trigger::Requested)
        );
        assert_eq!(decide(&v, &R::Running, None, None), Action::Nothing);
        let f = suspend::tests::facts(VmPhase::Suspended, D::Running, S::Suspended);
        assert_eq!(
            decide(&vm(VmPhase::Suspended), &R::Suspended, None, Some(&f)),
            Action::Resume(Trigger::Requested)
        );
        let f = suspend::tests::facts(VmPhase::Suspending, D::Suspended, S::Suspended);
        assert_eq!(
            decide(&vm(VmPhase::Suspending), &R::Suspended, None, Some(&f)),
            Action::MarkSuspended
        );
        let f = suspend::tests::facts(VmPhase::Resuming, D::Running, S::Running);
        assert_eq!(
            decide(&vm(VmPhase::Resuming), &R::Running, None, Some(&f)),
            Action::MarkRunning
        );
        // The suspend plan's failure is the lifecycle's Fail.
        let f = suspend::tests::facts(VmPhase::Suspended, D::Suspended, S::Absent);
        assert!(matches!(
            decide(&vm(VmPhase::Suspended), &R::Absent, None, Some(&f)),
            Action::Fail { reason, .. } if reason == reason::VM_LOST
        ));
        // Refusals, once.
        let mut f = suspend::tests::facts(VmPhase::Running, D::ScaleToZero, S::Running);
        f.scale_to_zero = false;
        assert_eq!(
            decide(&v, &R::Running, None, Some(&f)),
            Action::RefuseSuspend(Trigger::Disabled)
        );
        let mut f = suspend::tests::facts(VmPhase::Running, D::Running, S::Running);
        f.recorded = Some(reason::SCALE_TO_ZERO_DISABLED.into());
        assert_eq!(
            decide(&v, &R::Running, None, Some(&f)),
            Action::ClearSuspendRefusal
        );
    }

    #[test]
    fn the_lifecycle_goes_first() {
        use imp_api::DesiredState as D;
        use suspend::Runtime as S;
        // Deleted while suspended: torn down, whatever suspend would do.
        let f = suspend::tests::facts(VmPhase::Suspended, D::Running, S::Suspended);
        let mut d = vm(VmPhase::Suspended);
        d.deleting = true;
        assert_eq!(decide(&d, &R::Suspended, None, Some(&f)), Action::Teardown);
        // A Running runner VM hands off; a failed runtime fails the VM.
        let f = suspend::tests::facts(VmPhase::Running, D::Suspended, S::Running);
        let r = runner(VmPhase::Running, Handoff::NotStarted);
        assert_eq!(decide(&r, &R::Running, None, Some(&f)), Action::Handoff);
        assert!(matches!(
            decide(&vm(VmPhase::Running), &failed(reason::GUEST_PANICKED), None, Some(&f)),
            Action::Fail { reason, .. } if reason == reason::GUEST_PANICKED
        ));
        // Facts of a VM no longer bound here are not suspend's.
        let mut u = vm(VmPhase::Running);
        u.bound_here = false;
        assert_eq!(decide(&u, &R::Absent, None, Some(&f)), Action::Nothing);
    }

    #[test]
    fn the_monitor_runs_only_beside_a_running_guest() {
        let v = vm(VmPhase::Running);
        assert!(monitored(&v, &R::Running, None));
        assert!(monitored(&v, &R::Running, Some(InFlight::Runner)));
        assert!(!monitored(&v, &R::Running, Some(InFlight::Suspend)));
        assert!(!monitored(&v, &R::Running, Some(InFlight::Resume)));
        assert!(!monitored(&v, &R::Suspended, None));
        assert!(!monitored(&vm(VmPhase::Starting), &R::Running, None));
        let mut d = v.clone();
        d.deleting = true;
        assert!(!monitored(&d, &R::Running, None));
    }
}
