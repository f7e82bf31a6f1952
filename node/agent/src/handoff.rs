//! The runner handoff (ARCHITECTURE §2 step 6, the binding rule and the ambiguity rule), pure: the
//! one place that knows the order of its steps. [`next`] takes where a run stands ([`State`]: the
//! handoff as recorded by this run, and the step it just performed) and what that step found out
//! ([`Fact`]), and returns the next state; the executor (`runner.rs`) performs `state.step` and
//! reports the fact, nothing else.
//!
//! Recorded states: `NotStarted -> Sent -> Started -> Exited`, or `Sent -> Ambiguous`. `Sent` is
//! recorded in the ImpVM status *before* the JIT config leaves the host. Once `Sent` is recorded
//! without `Started`, the outcome of the Exec is unknowable after a lost connection or an agent
//! restart, and the one-time config is never replayed: the VM fails with `HandoffAmbiguous`.
//!
//! The steps of a first handoff: verify the binding (VM side; the place where a check of the
//! frozen spec belongs too), connect to the guest, read the Secret (binding, Secret side), record
//! Sent, Exec, record Started, delete the Secret, announce it, wait for the exit, record Exited.
//! A run that starts on a recorded state ([`start`]: a first pick-up, or an agent that restarted
//! or lost its task) follows the recorded state, never a guess.

use imp_api::HandoffState;
use imp_api::names::reason;
/// Where a runner VM's handoff stands, as recorded in `status.runner.handoff`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handoff {
    NotStarted,
    Sent,
    Started,
    Exited,
    Ambiguous,
}

impl Handoff {
    pub fn from_status(s: Option<HandoffState>) -> Self {
        match s {
            None => Handoff::NotStarted,
            Some(HandoffState::Sent) => Handoff::Sent,
            Some(HandoffState::Started) => Handoff::Started,
            Some(HandoffState::Exited) => Handoff::Exited,
            Some(HandoffState::Ambiguous) => Handoff::Ambiguous,
        }
    }

    /// The value to record; `None` for NotStarted.
    pub fn to_status(self) -> Option<HandoffState> {
        match self {
            Handoff::NotStarted => None,
            Handoff::Sent => Some(HandoffState::Sent),
            Handoff::Started => Some(HandoffState::Started),
            Handoff::Exited => Some(HandoffState::Exited),
            Handoff::Ambiguous => Some(HandoffState::Ambiguous),
        }
    }
}

/// What the run does next. The executor performs it and answers with a [`Fact`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The binding rule, VM side, before anything is read: only a pool's VM gets a config.
    VerifyBinding,
    /// Open a connection to the guest agent (Hello exchanged).
    Connect,
    /// Uncached GET of the JIT Secret, then the binding rule, Secret side.
    ReadSecret,
    /// Record Sent (exec id, sentTime, runner id and name), guarded by NotStarted.
    RecordSent,
    /// Send the Exec with the config; wait (bounded) for its answer.
    Exec,
    /// Record Started and the pid, guarded by Sent; retried until it is written, since a lost
    /// write would make the next run find Sent and declare a running job ambiguous.
    RecordStarted { pid: u32 },
    /// Delete the JIT Secret if it is bound to this VM (retried until done); then, when
    /// `announce` holds the runner's pid, say that it was handed its config.
    DeleteSecret { announce: Option<u32> },
    /// The Event that the runner was handed its config and its Secret is gone.
    AnnounceHandedOff { pid: u32 },
    /// Ask the guest for the runner again: the same exec id and no config, which never spawns.
    Requery,
    /// Wait for the runner's Exited on the open connection.
    WaitExit,
    /// The connection broke while waiting: after a pause, ask the runtime whether the VM runs.
    Reconnect,
    /// Record Exited, the exit code and the phase (Succeeded or Failed), guarded by Started.
    RecordExited(Exit),
    /// Record Ambiguous and phase Failed `HandoffAmbiguous`, guarded by Sent.
    DeclareAmbiguous,
    /// Phase Failed with `reason` (guarded by Running); `outcome` labels the handoff metric.
    Fail {
        reason: &'static str,
        message: String,
        outcome: &'static str,
    },
    /// The run is over.
    Done,
}

/// How the runner ended, as the guest reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
}

/// What a step found out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fact {
    /// The binding rule holds (VM side).
    Bound,
    /// The binding rule refuses the VM or its Secret; the Secret is left as it is.
    Unbound {
        reason: &'static str,
        message: String,
    },
    /// The guest agent answered Hello.
    Connected,
    /// The Secret holds a config, and it is bound to this VM.
    ConfigRead,
    /// The Secret is missing or has no `jitconfig` key.
    ConfigMissing { message: String },
    /// A status write went through.
    Recorded,
    /// A status write was refused by its guard (the VM moved on, or is gone).
    Refused,
    /// The guest answered `Started{pid}` (to the Exec or to a re-query).
    Started { pid: u32 },
    /// The guest answered that the Exec could not spawn: the config was not used.
    SpawnFailed { message: String },
    /// The guest connection broke, or the Exec went unanswered.
    ConnectionLost,
    /// The Secret is gone (deleted, already gone, or not this VM's to delete).
    SecretDeleted,
    /// The Event is published (best effort).
    Announced,
    /// The guest reported the runner's end.
    Exited(Exit),
    /// The runtime reports the VM running (the same guest boot: a reboot ends the VMM).
    VmRunning,
    /// The VM ended without its runner's exit being reported.
    VmEnded,
}

/// Where a run stands: the handoff as this run knows it recorded, and the step it performs now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct State {
    pub handoff: Handoff,
    pub step: Step,
}

/// `fact` is not an answer the step of `state` can give.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("handoff fact {fact:?} does not answer step {:?} (handoff {:?})", state.step, state.handoff)]
pub struct InvalidTransition {
    pub state: State,
    pub fact: Fact,
}

/// The first step of a run that finds `recorded` in status with no handoff of this agent in
/// flight: a first pick-up, or the agent restarted (or lost its task). Nothing sent: begin.
/// `Sent` without `Started`: ambiguous, never replayed. `Started`: reattach with the same exec
/// id (ids are idempotency keys: a repeat never spawns a second process). Over: nothing.
pub fn start(recorded: Handoff) -> State {
    let step = match recorded {
        Handoff::NotStarted => Step::VerifyBinding,
        Handoff::Sent => Step::DeclareAmbiguous,
        Handoff::Started => Step::Connect,
        Handoff::Exited | Handoff::Ambiguous => Step::Done,
    };
    State {
        handoff: recorded,
        step,
    }
}

/// The transition function: the step after `state.step` answered with `fact`.
pub fn next(state: &State, fact: &Fact) -> Result<State, InvalidTransition> {
    use Handoff as H;
    let to = |handoff: Handoff, step: Step| Ok(State { handoff, step });
    let fail = |reason: &'static str, message: &str, outcome: &'static str| Step::Fail {
        reason,
        message: message.to_owned(),
        outcome,
    };
    let h = state.handoff;
    match (h, &state.step, fact) {
        (H::NotStarted, Step::VerifyBinding, Fact::Bound) => to(h, Step::Connect),
        (
            H::NotStarted,
            Step::VerifyBinding | Step::ReadSecret,
            Fact::Unbound { reason, message },
        ) => to(h, fail(reason, message, "unbound")),
        (H::NotStarted, Step::Connect, Fact::Connected) => to(h, Step::ReadSecret),
        (H::Started, Step::Connect, Fact::Connected) => to(h, Step::Requery),
        (H::NotStarted, Step::ReadSecret, Fact::ConfigRead) => to(h, Step::RecordSent),
        (H::NotStarted, Step::ReadSecret, Fact::ConfigMissing { message }) => to(
            h,
            fail(reason::RUNNER_CONFIG_MISSING, message, "config_missing"),
        ),
        (H::NotStarted, Step::RecordSent, Fact::Recorded) => to(H::Sent, Step::Exec),
        // Someone else moved the VM on: nothing was sent, nothing to undo.
        (H::NotStarted, Step::RecordSent, Fact::Refused) => to(h, Step::Done),
        (H::Sent, Step::Exec, Fact::Started { pid }) => to(h, Step::RecordStarted { pid: *pid }),
        // Definitely not started: the config was not used. The VM fails; the Secret goes.
        (H::Sent, Step::Exec, Fact::SpawnFailed { message }) => to(
            h,
            fail(reason::RUNNER_START_FAILED, message, "spawn_failed"),
        ),
        // The ambiguity rule: the config may have reached the guest; never send it again.
        (H::Sent, Step::Exec, Fact::ConnectionLost) => to(h, Step::DeclareAmbiguous),
        // The runner runs whether or not the write went through: it is waited for either way,
        // but announced only when recorded.
        (H::Sent, Step::RecordStarted { pid }, Fact::Recorded) => to(
            H::Started,
            Step::DeleteSecret {
                announce: Some(*pid),
            },
        ),
        (H::Sent, Step::RecordStarted { .. }, Fact::Refused) => {
            to(H::Started, Step::DeleteSecret { announce: None })
        }
        // A previous run may have ended between Started and the delete.
        (H::Started, Step::Requery, Fact::Started { .. }) => {
            to(h, Step::DeleteSecret { announce: None })
        }
        (
            H::Started,
            Step::DeleteSecret {
                announce: Some(pid),
            },
            Fact::SecretDeleted,
        ) => to(h, Step::AnnounceHandedOff { pid: *pid }),
        (H::Started, Step::DeleteSecret { announce: None }, Fact::SecretDeleted)
        | (H::Started, Step::AnnounceHandedOff { .. }, Fact::Announced) => to(h, Step::WaitExit),
        // Spawn failed (Sent) or ambiguous: the config is spent; the run ends.
        (H::Sent | H::Ambiguous, Step::DeleteSecret { announce: None }, Fact::SecretDeleted) => {
            to(h, Step::Done)
        }
        (H::Started, Step::WaitExit, Fact::Exited(exit)) => to(h, Step::RecordExited(*exit)),
        (H::Started, Step::WaitExit, Fact::ConnectionLost) => to(h, Step::Reconnect),
        (H::Started, Step::Reconnect, Fact::VmRunning) => to(h, Step::Connect),
        // The exit code is lost; the next reconcile decides (RunnerExitUnknown).
        (H::Started, Step::Reconnect, Fact::VmEnded) => to(h, Step::Done),
        (H::Started, Step::RecordExited(_), Fact::Recorded | Fact::Refused) => {
            to(H::Exited, Step::Done)
        }
        // The Secret goes whether or not this run's write went through (it was sent).
        (H::Sent, Step::DeclareAmbiguous, Fact::Recorded | Fact::Refused) => {
            to(H::Ambiguous, Step::DeleteSecret { announce: None })
        }
        (H::NotStarted, Step::Fail { .. }, Fact::Recorded | Fact::Refused) => to(h, Step::Done),
        (H::Sent, Step::Fail { .. }, Fact::Recorded | Fact::Refused) => {
            to(h, Step::DeleteSecret { announce: None })
        }
        _ => Err(InvalidTransition {
            state: state.clone(),
            fact: fact.clone(),
        }),
    }
}

/// The guest's exec id of a VM's runner: stable per VM, so a repeat is an idempotent re-query.
pub fn exec_id(vm_uid: &str) -> String {
    format!("impvm-{vm_uid}-runner")
}

/// How the runner's end maps onto the ImpVM: `Ok(())` = Succeeded; `Err((reason, message))` = Failed.
pub fn exit_outcome(
    code: Option<i32>,
    signal: Option<i32>,
    timed_out: bool,
) -> Result<(), (&'static str, String)> {
    use imp_api::names::reason::RUNNER_EXITED_NON_ZERO;
    match (code, signal) {
        (Some(0), _) => Ok(()),
        (Some(c), _) => Err((
            RUNNER_EXITED_NON_ZERO,
            format!("runner exited with code {c}"),
        )),
        (None, Some(s)) if timed_out => Err((
            RUNNER_EXITED_NON_ZERO,
            format!("runner killed by signal {s} after its timeout"),
        )),
        (None, Some(s)) => Err((
            RUNNER_EXITED_NON_ZERO,
            format!("runner killed by signal {s}"),
        )),
        (None, None) => Err((
            RUNNER_EXITED_NON_ZERO,
            "runner ended without an exit code or signal".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Handoff as H;

    const EXIT: Exit = Exit {
        code: Some(0),
        signal: None,
        timed_out: false,
    };

    fn at(handoff: Handoff, step: Step) -> State {
        State { handoff, step }
    }

    /// One value of every fact.
    fn facts() -> Vec<Fact> {
        vec![
            Fact::Bound,
            Fact::Unbound {
                reason: reason::RUNNER_VM_NOT_POOLED,
                message: "m".into(),
            },
            Fact::Connected,
            Fact::ConfigRead,
            Fact::ConfigMissing {
                message: "m".into(),
            },
            Fact::Recorded,
            Fact::Refused,
            Fact::Started { pid: 7 },
            Fact::SpawnFailed {
                message: "m".into(),
            },
            Fact::ConnectionLost,
            Fact::SecretDeleted,
            Fact::Announced,
            Fact::Exited(EXIT),
            Fact::VmRunning,
            Fact::VmEnded,
        ]
    }

    const RECORDED: [Handoff; 5] = [H::NotStarted, H::Sent, H::Started, H::Exited, H::Ambiguous];

    /// The states reachable from `from` through any fact.
    fn closure(from: Vec<State>) -> Vec<State> {
        let mut seen = from;
        let mut i = 0;
        while i < seen.len() {
            let s = seen[i].clone();
            for f in facts() {
                if let Ok(n) = next(&s, &f)
                    && !seen.contains(&n)
                {
                    seen.push(n);
                }
            }
            i += 1;
        }
        seen
    }

    /// Every state a run can be in: from every recorded state, every answer of every step.
    fn reachable() -> Vec<State> {
        closure(RECORDED.iter().map(|h| start(*h)).collect())
    }

    /// A first handoff that just recorded Sent.
    fn sent() -> State {
        let facts = [
            Fact::Bound,
            Fact::Connected,
            Fact::ConfigRead,
            Fact::Recorded,
        ];
        let s = walk(start(H::NotStarted), &facts);
        assert_eq!(s, at(H::Sent, Step::Exec));
        s
    }

    fn walk(mut s: State, facts: &[Fact]) -> State {
        for f in facts {
            s = next(&s, f).unwrap_or_else(|e| panic!("{e}"));
        }
        s
    }

    /// The whole table: every (state, fact) pair a run can meet, and where it leads; every pair
    /// not listed is refused.
    #[test]
    fn every_fact_in_every_state() {
        let fail = |reason: &'static str, outcome: &'static str| Step::Fail {
            reason,
            message: "m".into(),
            outcome,
        };
        let del = |announce| Step::DeleteSecret { announce };
        let unbound = Fact::Unbound {
            reason: reason::RUNNER_VM_NOT_POOLED,
            message: "m".into(),
        };
        let missing = Fact::ConfigMissing {
            message: "m".into(),
        };
        let spawn_failed = Fact::SpawnFailed {
            message: "m".into(),
        };
        let unbound_fail = fail(reason::RUNNER_VM_NOT_POOLED, "unbound");
        let missing_fail = fail(reason::RUNNER_CONFIG_MISSING, "config_missing");
        let spawn_fail = fail(reason::RUNNER_START_FAILED, "spawn_failed");
        let started = Fact::Started { pid: 7 };
        let record_started = Step::RecordStarted { pid: 7 };
        let announce = Step::AnnounceHandedOff { pid: 7 };
        #[rustfmt::skip]
        let table: Vec<(State, Fact, State)> = vec![
            (at(H::NotStarted, Step::VerifyBinding), Fact::Bound, at(H::NotStarted, Step::Connect)),
            (at(H::NotStarted, Step::VerifyBinding), unbound.clone(), at(H::NotStarted, unbound_fail.clone())),
            (at(H::NotStarted, Step::Connect), Fact::Connected, at(H::NotStarted, Step::ReadSecret)),
            (at(H::NotStarted, Step::ReadSecret), Fact::ConfigRead, at(H::NotStarted, Step::RecordSent)),
            (at(H::NotStarted, Step::ReadSecret), unbound, at(H::NotStarted, unbound_fail.clone())),
            (at(H::NotStarted, Step::ReadSecret), missing, at(H::NotStarted, missing_fail.clone())),
            (at(H::NotStarted, Step::RecordSent), Fact::Recorded, at(H::Sent, Step::Exec)),
            (at(H::NotStarted, Step::RecordSent), Fact::Refused, at(H::NotStarted, Step::Done)),
            (at(H::NotStarted, unbound_fail.clone()), Fact::Recorded, at(H::NotStarted, Step::Done)),
            (at(H::NotStarted, unbound_fail), Fact::Refused, at(H::NotStarted, Step::Done)),
            (at(H::NotStarted, missing_fail.clone()), Fact::Recorded, at(H::NotStarted, Step::Done)),
            (at(H::NotStarted, missing_fail), Fact::Refused, at(H::NotStarted, Step::Done)),
            (at(H::Sent, Step::Exec), started.clone(), at(H::Sent, record_started.clone())),
            (at(H::Sent, Step::Exec), spawn_failed, at(H::Sent, spawn_fail.clone())),
            (at(H::Sent, Step::Exec), Fact::ConnectionLost, at(H::Sent, Step::DeclareAmbiguous)),
            (at(H::Sent, spawn_fail.clone()), Fact::Recorded, at(H::Sent, del(None))),
            (at(H::Sent, spawn_fail), Fact::Refused, at(H::Sent, del(None))),
            (at(H::Sent, del(None)), Fact::SecretDeleted, at(H::Sent, Step::Done)),
            (at(H::Sent, record_started.clone()), Fact::Recorded, at(H::Started, del(Some(7)))),
            (at(H::Sent, record_started), Fact::Refused, at(H::Started, del(None))),
            (at(H::Started, del(Some(7))), Fact::SecretDeleted, at(H::Started, announce.clone())),
            (at(H::Started, announce), Fact::Announced, at(H::Started, Step::WaitExit)),
            (at(H::Started, del(None)), Fact::SecretDeleted, at(H::Started, Step::WaitExit)),
            (at(H::Started, Step::WaitExit), Fact::Exited(EXIT), at(H::Started, Step::RecordExited(EXIT))),
            (at(H::Started, Step::WaitExit), Fact::ConnectionLost, at(H::Started, Step::Reconnect)),
            (at(H::Started, Step::Reconnect), Fact::VmRunning, at(H::Started, Step::Connect)),
            (at(H::Started, Step::Reconnect), Fact::VmEnded, at(H::Started, Step::Done)),
            (at(H::Started, Step::Connect), Fact::Connected, at(H::Started, Step::Requery)),
            (at(H::Started, Step::Requery), started, at(H::Started, del(None))),
            (at(H::Started, Step::RecordExited(EXIT)), Fact::Recorded, at(H::Exited, Step::Done)),
            (at(H::Started, Step::RecordExited(EXIT)), Fact::Refused, at(H::Exited, Step::Done)),
            (at(H::Sent, Step::DeclareAmbiguous), Fact::Recorded, at(H::Ambiguous, del(None))),
            (at(H::Sent, Step::DeclareAmbiguous), Fact::Refused, at(H::Ambiguous, del(None))),
            (at(H::Ambiguous, del(None)), Fact::SecretDeleted, at(H::Ambiguous, Step::Done)),
        ];
        let states = reachable();
        for (s, f, want) in &table {
            assert!(states.contains(s), "{s:?} is not reachable");
            assert_eq!(next(s, f).as_ref(), Ok(want), "{s:?} + {f:?}");
        }
        let mut allowed = 0;
        for s in &states {
            for f in facts() {
                if table.iter().any(|(ts, tf, _)| ts == s && *tf == f) {
                    allowed += 1;
                } else {
                    let got = next(s, &f);
                    assert!(got.is_err(), "{s:?} + {f:?} -> {got:?} is not in the table");
                }
            }
        }
        assert_eq!(allowed, table.len(), "every row is reachable and distinct");
    }

    #[test]
    fn a_first_handoff_runs_in_order() {
        let s = walk(
            start(H::NotStarted),
            &[
                Fact::Bound,
                Fact::Connected,
                Fact::ConfigRead,
                Fact::Recorded,
                Fact::Started { pid: 7 },
                Fact::Recorded,
                Fact::SecretDeleted,
                Fact::Announced,
                Fact::Exited(EXIT),
                Fact::Recorded,
            ],
        );
        assert_eq!(s, at(H::Exited, Step::Done));
    }

    #[test]
    fn the_binding_is_verified_before_the_secret_is_read_and_sent_recorded_before_the_exec() {
        assert_eq!(start(H::NotStarted).step, Step::VerifyBinding);
        for s in reachable() {
            for f in facts() {
                let Ok(n) = next(&s, &f) else { continue };
                if n.step == Step::ReadSecret {
                    assert_eq!((&s.step, &f), (&Step::Connect, &Fact::Connected));
                    assert_eq!(s.handoff, H::NotStarted);
                }
                if n.step == Step::Exec {
                    assert_eq!((&s.step, &f), (&Step::RecordSent, &Fact::Recorded));
                    assert_eq!(n.handoff, H::Sent);
                }
            }
        }
        // The only way to Connect on a fresh handoff is through a verified binding.
        let s = start(H::NotStarted);
        let unbound = Fact::Unbound {
            reason: reason::RUNNER_VM_NOT_POOLED,
            message: "m".into(),
        };
        assert!(matches!(
            next(&s, &unbound).unwrap().step,
            Step::Fail { .. }
        ));
    }

    #[test]
    fn connection_lost_after_sent_is_ambiguous_and_the_secret_goes() {
        let s = sent();
        let s = walk(s, &[Fact::ConnectionLost]);
        assert_eq!(s, at(H::Sent, Step::DeclareAmbiguous));
        let s = walk(s, &[Fact::Recorded]);
        assert_eq!(s, at(H::Ambiguous, Step::DeleteSecret { announce: None }));
        assert_eq!(
            walk(s, &[Fact::SecretDeleted]),
            at(H::Ambiguous, Step::Done)
        );
        // Connection losses before Sent are not facts of the machine: the run ends with an
        // error and the next reconcile starts again from NotStarted.
        for step in [
            Step::VerifyBinding,
            Step::Connect,
            Step::ReadSecret,
            Step::RecordSent,
        ] {
            assert!(next(&at(H::NotStarted, step), &Fact::ConnectionLost).is_err());
        }
    }

    #[test]
    fn spawn_failed_fails_the_vm_and_deletes_the_unused_secret() {
        let s = sent();
        let message = "no such file".to_owned();
        let s = walk(s, &[Fact::SpawnFailed { message }]);
        assert_eq!(
            s.step,
            Step::Fail {
                reason: reason::RUNNER_START_FAILED,
                message: "no such file".into(),
                outcome: "spawn_failed"
            }
        );
        let s = walk(s, &[Fact::Recorded]);
        assert_eq!(s, at(H::Sent, Step::DeleteSecret { announce: None }));
        assert_eq!(walk(s, &[Fact::SecretDeleted]), at(H::Sent, Step::Done));
    }

    #[test]
    fn an_agent_restart_follows_the_recorded_state_and_never_replays() {
        assert_eq!(start(H::NotStarted).step, Step::VerifyBinding);
        assert_eq!(start(H::Sent).step, Step::DeclareAmbiguous);
        assert_eq!(start(H::Started).step, Step::Connect);
        assert_eq!(start(H::Exited).step, Step::Done);
        assert_eq!(start(H::Ambiguous).step, Step::Done);
        // A restart in any state of a run starts again from what that run recorded: from
        // anything but NotStarted, no path leads to reading the Secret or sending an Exec.
        for s in reachable()
            .into_iter()
            .filter(|s| s.handoff != H::NotStarted)
        {
            for cur in closure(vec![start(s.handoff)]) {
                assert!(
                    !matches!(cur.step, Step::ReadSecret | Step::RecordSent | Step::Exec),
                    "a restart in {s:?} reaches {cur:?}"
                );
            }
        }
    }

    #[test]
    fn a_restart_after_started_reattaches_and_a_broken_wait_reconnects() {
        let s = walk(
            start(H::Started),
            &[Fact::Connected, Fact::Started { pid: 7 }],
        );
        assert_eq!(s, at(H::Started, Step::DeleteSecret { announce: None }));
        let s = walk(s, &[Fact::SecretDeleted, Fact::ConnectionLost]);
        assert_eq!(s.step, Step::Reconnect);
        assert_eq!(
            walk(s.clone(), &[Fact::VmEnded]),
            at(H::Started, Step::Done)
        );
        let s = walk(s, &[Fact::VmRunning, Fact::Connected]);
        assert_eq!(s.step, Step::Requery);
    }

    #[test]
    fn refused_writes_end_or_carry_on_as_the_guest_requires() {
        // Sent refused: nothing left the host.
        let read = [Fact::Bound, Fact::Connected, Fact::ConfigRead];
        let s = walk(start(H::NotStarted), &read);
        assert_eq!(walk(s, &[Fact::Refused]), at(H::NotStarted, Step::Done));
        // Started refused: the runner runs anyway and is waited for, without the Event.
        let s = at(H::Sent, Step::RecordStarted { pid: 7 });
        let s = walk(s, &[Fact::Refused, Fact::SecretDeleted]);
        assert_eq!(s, at(H::Started, Step::WaitExit));
    }

    #[test]
    fn status_round_trip() {
        for s in RECORDED {
            assert_eq!(Handoff::from_status(s.to_status()), s);
        }
    }

    #[test]
    fn exec_id_is_stable() {
        assert_eq!(exec_id("abc"), exec_id("abc"));
        assert_eq!(exec_id("abc"), "impvm-abc-runner");
    }

    #[test]
    fn exit_outcomes() {
        assert_eq!(exit_outcome(Some(0), None, false), Ok(()));
        let (reason, msg) = exit_outcome(Some(3), None, false).unwrap_err();
        assert_eq!(reason, imp_api::names::reason::RUNNER_EXITED_NON_ZERO);
        assert!(msg.contains("code 3"));
        assert!(
            exit_outcome(None, Some(9), true)
                .unwrap_err()
                .1
                .contains("timeout")
        );
        assert!(
            exit_outcome(None, Some(15), false)
                .unwrap_err()
                .1
                .contains("signal 15")
        );
        assert!(exit_outcome(None, None, false).is_err());
    }
}
