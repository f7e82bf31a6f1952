//! The runner handoff state machine (ARCHITECTURE §2 step 6 and the ambiguity rule), pure.
//!
//! `NotStarted -> Sent -> Started -> Exited`, or `Sent -> Ambiguous`. `Sent` is recorded in the
//! ImpVM status *before* the JIT config leaves the host. Once `Sent` is recorded without `Started`,
//! the outcome of the Exec is unknowable after a lost connection or an agent restart, and the
//! one-time config is never replayed: the VM fails with `HandoffAmbiguous`.

use imp_api::HandoffState;

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

/// What happened during (or around) a handoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// `Sent` was durably recorded in status; the Exec may now be sent.
    SentRecorded,
    /// The guest answered `Started{pid}`.
    Started,
    /// The guest answered that the Exec could not spawn: the config was not used.
    SpawnFailed,
    /// The guest connection broke (or timed out) with no answer.
    ConnectionLost,
    /// The guest reported `Exited`.
    Exited,
    /// The agent (re)started and found this state in status, with no handoff of its own in flight.
    AgentRestarted,
}

/// Result of a step: the next state, or `None` when the handoff ended without a runner
/// (spawn failed: the VM fails with `RunnerStartFailed`).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("handoff event {event:?} is not valid in state {state:?}")]
pub struct InvalidTransition {
    pub state: Handoff,
    pub event: Event,
}

/// The transition function. Restart rules: `Sent` without `Started` is ambiguous (never replayed);
/// `Started` is resumed by asking the guest again with the same exec id (ids are idempotency keys:
/// a repeat never spawns a second process).
pub fn step(state: Handoff, event: Event) -> Result<Handoff, InvalidTransition> {
    use Event as E;
    use Handoff as H;
    let next = match (state, event) {
        (H::NotStarted, E::SentRecorded) => H::Sent,
        (H::NotStarted, E::AgentRestarted) => H::NotStarted,
        (H::Sent, E::Started) => H::Started,
        // The process did not start; the state stays Sent and the VM fails (RunnerStartFailed).
        (H::Sent, E::SpawnFailed) => H::Sent,
        (H::Sent, E::ConnectionLost | E::AgentRestarted) => H::Ambiguous,
        (H::Started, E::ConnectionLost | E::AgentRestarted) => H::Started,
        (H::Started, E::Exited) => H::Exited,
        (H::Exited, E::AgentRestarted) => H::Exited,
        (H::Ambiguous, E::AgentRestarted) => H::Ambiguous,
        (state, event) => return Err(InvalidTransition { state, event }),
    };
    Ok(next)
}

/// What an agent that finds `state` in status (and has no handoff in flight) must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// Nothing was sent: read the Secret, record Sent, send the Exec.
    Begin,
    /// `Sent` without `Started`: mark HandoffAmbiguous, delete the Secret, never Exec again.
    DeclareAmbiguous,
    /// The runner started: reconnect and wait for its `Exited` (repeat the Exec id, no config).
    Reattach,
    /// The handoff is over.
    Done,
}

pub fn resume(state: Handoff) -> Resume {
    match state {
        Handoff::NotStarted => Resume::Begin,
        Handoff::Sent => Resume::DeclareAmbiguous,
        Handoff::Started => Resume::Reattach,
        Handoff::Exited | Handoff::Ambiguous => Resume::Done,
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
    use Event as E;
    use Handoff as H;

    #[test]
    fn happy_path() {
        let s = step(H::NotStarted, E::SentRecorded).unwrap();
        assert_eq!(s, H::Sent);
        let s = step(s, E::Started).unwrap();
        assert_eq!(s, H::Started);
        assert_eq!(step(s, E::Exited).unwrap(), H::Exited);
    }

    #[test]
    fn connection_lost_after_sent_is_ambiguous() {
        assert_eq!(step(H::Sent, E::ConnectionLost).unwrap(), H::Ambiguous);
    }

    #[test]
    fn restart_finding_sent_is_ambiguous_and_never_replayed() {
        assert_eq!(step(H::Sent, E::AgentRestarted).unwrap(), H::Ambiguous);
        assert_eq!(resume(H::Sent), Resume::DeclareAmbiguous);
        // No path leads from Sent or Ambiguous back to sending.
        for s in [H::Sent, H::Ambiguous, H::Started, H::Exited] {
            assert!(step(s, E::SentRecorded).is_err(), "{s:?} must not re-send");
        }
    }

    #[test]
    fn started_survives_lost_connections_and_restarts() {
        assert_eq!(step(H::Started, E::ConnectionLost).unwrap(), H::Started);
        assert_eq!(step(H::Started, E::AgentRestarted).unwrap(), H::Started);
        assert_eq!(resume(H::Started), Resume::Reattach);
    }

    #[test]
    fn spawn_failure_is_not_ambiguous() {
        assert_eq!(step(H::Sent, E::SpawnFailed).unwrap(), H::Sent);
    }

    #[test]
    fn terminal_states_accept_only_restart() {
        for s in [H::Exited, H::Ambiguous] {
            assert_eq!(step(s, E::AgentRestarted).unwrap(), s);
            assert_eq!(resume(s), Resume::Done);
            for e in [E::Started, E::Exited, E::ConnectionLost, E::SpawnFailed] {
                assert!(step(s, e).is_err(), "{s:?} + {e:?}");
            }
        }
    }

    #[test]
    fn invalid_transitions_are_errors() {
        assert!(step(H::NotStarted, E::Started).is_err());
        assert!(step(H::NotStarted, E::Exited).is_err());
        assert!(step(H::Sent, E::Exited).is_err());
        assert!(step(H::Started, E::Started).is_err());
    }

    #[test]
    fn status_round_trip() {
        for s in [H::NotStarted, H::Sent, H::Started, H::Exited, H::Ambiguous] {
            assert_eq!(Handoff::from_status(s.to_status()), s);
        }
        assert_eq!(resume(H::NotStarted), Resume::Begin);
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
