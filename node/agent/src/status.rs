//! ImpVM status writes: read-modify-write with the object's resourceVersion as precondition
//! (PUT /status, retried on 409), exactly like the operator (docs/vm-lifecycle.md "What the agent
//! must do and write", rule 1). The conditions list is atomic in the schema, so it is never merged.
//!
//! Every write names its [`Guard`]: the phases it is for, whether it still applies while the VM
//! is being deleted, and for handoff writes the recorded handoff state it moves on from. The
//! guard is checked here, against the object as it is now, on every attempt.

use VmPhase::{Resuming, Running, Scheduled, Starting, Suspended, Suspending};
use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{condition::READY, reason};
use imp_api::{ImpVM, ImpVMStatus, StartStatus, StartedFrom, VmPhase};
use imp_runtime_api::api::{StartKind, StartReport};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, api::PostParams};

use super::handoff::Handoff;

const MAX_CONFLICTS: usize = 20;

/// Which objects a status write applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Guard {
    /// `None`: any phase.
    phases: Option<&'static [VmPhase]>,
    /// Also while `deletionTimestamp` is set.
    deleting: bool,
    /// Only while `status.runner.handoff` records this state (a compare-and-set).
    handoff: Option<Handoff>,
}

impl Guard {
    /// Any phase, not while deleting.
    pub const ANY: Guard = Guard {
        phases: None,
        deleting: false,
        handoff: None,
    };
    /// Booting: the VM's first write (Starting) and the PUT's retries.
    pub const BOOTING: Guard = Guard::phases(&[Scheduled, Starting]);
    pub const STARTING: Guard = Guard::phases(&[Starting]);
    pub const RUNNING: Guard = Guard::phases(&[Running]);
    /// The phases the agent owns while the VM lives: a failure found in any of them is written.
    pub const LIVE: Guard = Guard::phases(&[Starting, Running, Suspending, Suspended, Resuming]);

    /// Only in `phases`, not while deleting.
    pub const fn phases(phases: &'static [VmPhase]) -> Guard {
        Guard {
            phases: Some(phases),
            ..Guard::ANY
        }
    }

    /// Also while the VM is being deleted (a record of what happened on the host).
    pub const fn even_deleting(self) -> Guard {
        Guard {
            deleting: true,
            ..self
        }
    }

    /// Only while the recorded handoff is `from` (it moves on from there, once).
    pub const fn handoff(self, from: Handoff) -> Guard {
        Guard {
            handoff: Some(from),
            ..self
        }
    }

    /// Whether a write may change `vm`, whose status is `status`.
    pub fn admits(&self, vm: &ImpVM, status: &ImpVMStatus) -> bool {
        (self.deleting || vm.metadata.deletion_timestamp.is_none())
            && self
                .phases
                .is_none_or(|p| status.phase.is_some_and(|ph| p.contains(&ph)))
            && self.handoff.is_none_or(|h| {
                Handoff::from_status(status.runner.as_ref().and_then(|r| r.handoff)) == h
            })
    }
}

/// Phase Failed with `reason` and `message`, and Ready=False (VmStopped): how every agent-side
/// failure reads, whichever path found it.
pub fn mark_failed(
    status: &mut ImpVMStatus,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    status.phase = Some(VmPhase::Failed);
    status.reason = Some(reason.to_owned());
    status.message = Some(message.to_owned());
    conditions::set(
        &mut status.conditions,
        READY,
        ConditionStatus::False,
        reason::VM_STOPPED,
        "",
        generation,
        now,
    );
}

/// `status.start` from imp-runtime's report of how it started the VM. The fallback's message may
/// carry what a guest said (a failed restore's detail): bounded and stripped like any guest text.
pub fn start_status(r: &StartReport) -> StartStatus {
    StartStatus {
        from: match r.from {
            StartKind::Boot => StartedFrom::Boot,
            StartKind::Clone => StartedFrom::Clone,
        },
        template: r.template.clone(),
        fallback_reason: r.fallback.as_ref().map(|f| f.reason.clone()),
        fallback_message: r
            .fallback
            .as_ref()
            .map(|f| imp_api::untrusted::guest_text(&f.message)),
        restore_seconds: r.restore_seconds,
        reidentify_seconds: r.reidentify_seconds,
    }
}

/// Outcome of [`update`].
#[derive(Debug)]
pub enum Written {
    /// Written (or nothing to change); the object as it is now.
    Done(Box<ImpVM>),
    /// The guard refused the current object (its state moved on), or it is gone.
    Refused,
}

/// Read-modify-write of `name`'s status, if `guard` admits the object as it is now. `edit` may
/// still refuse (return false) for a reason of its own (the record is there already); both are
/// re-checked on every conflict.
pub async fn update(
    api: &Api<ImpVM>,
    name: &str,
    guard: Guard,
    mut edit: impl FnMut(&ImpVM, &mut ImpVMStatus) -> bool,
) -> Result<Written, kube::Error> {
    for _ in 0..MAX_CONFLICTS {
        let Some(mut vm) = api.get_opt(name).await? else {
            return Ok(Written::Refused);
        };
        let before = vm.status.clone().unwrap_or_default();
        let mut status = before.clone();
        if !guard.admits(&vm, &status) || !edit(&vm, &mut status) {
            return Ok(Written::Refused);
        }
        if status == before {
            return Ok(Written::Done(Box::new(vm)));
        }
        vm.status = Some(status);
        match api.replace_status(name, &PostParams::default(), &vm).await {
            Ok(vm) => return Ok(Written::Done(Box::new(vm))),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Written::Refused),
            Err(e) => return Err(e),
        }
    }
    Err(kube::Error::Service(
        format!("status of impvm {name} kept conflicting").into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_api::names::condition;
    use imp_api::{HandoffState, RunnerStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn vm(deleting: bool) -> ImpVM {
        let mut vm: ImpVM = serde_json::from_value(serde_json::json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM", "metadata": {"name": "v"},
            "spec": {"classRef": {"name": "c"}, "image": "i", "lifecycle": "ephemeral"}}))
        .unwrap();
        if deleting {
            vm.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        }
        vm
    }

    fn status(phase: Option<VmPhase>, handoff: Option<HandoffState>) -> ImpVMStatus {
        ImpVMStatus {
            phase,
            runner: handoff.map(|h| RunnerStatus {
                handoff: Some(h),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn guards_check_deletion_phase_and_recorded_handoff() {
        let running = status(Some(Running), None);
        assert!(Guard::ANY.admits(&vm(false), &running));
        assert!(Guard::ANY.admits(&vm(false), &status(None, None)));
        assert!(!Guard::ANY.admits(&vm(true), &running));
        assert!(Guard::ANY.even_deleting().admits(&vm(true), &running));
        assert!(Guard::RUNNING.admits(&vm(false), &running));
        assert!(!Guard::RUNNING.admits(&vm(true), &running));
        assert!(!Guard::RUNNING.admits(&vm(false), &status(Some(Starting), None)));
        assert!(!Guard::RUNNING.admits(&vm(false), &status(None, None)));
        for p in [Scheduled, Starting] {
            assert!(Guard::BOOTING.admits(&vm(false), &status(Some(p), None)));
        }
        assert!(!Guard::BOOTING.admits(&vm(false), &running));
        for p in [Starting, Running, Suspending, Suspended, Resuming] {
            assert!(
                Guard::LIVE.admits(&vm(false), &status(Some(p), None)),
                "{p:?}"
            );
        }
        for p in [
            VmPhase::Pending,
            Scheduled,
            VmPhase::Terminating,
            VmPhase::Failed,
        ] {
            assert!(
                !Guard::LIVE.admits(&vm(false), &status(Some(p), None)),
                "{p:?}"
            );
        }
        let sent = status(Some(Running), Some(HandoffState::Sent));
        let g = Guard::RUNNING.handoff(Handoff::Sent);
        assert!(g.admits(&vm(false), &sent));
        assert!(
            !g.admits(&vm(false), &running),
            "nothing recorded is not Sent"
        );
        assert!(
            Guard::RUNNING
                .handoff(Handoff::NotStarted)
                .admits(&vm(false), &running)
        );
        let started = status(Some(Running), Some(HandoffState::Started));
        assert!(!g.admits(&vm(false), &started), "Started never goes back");
        let g = Guard::ANY.even_deleting().handoff(Handoff::Sent);
        assert!(g.admits(
            &vm(true),
            &status(Some(VmPhase::Terminating), Some(HandoffState::Sent))
        ));
    }

    #[test]
    fn the_runtime_s_start_report_becomes_status_start() {
        use imp_runtime_api::api::Failure;
        let clone = StartReport {
            from: StartKind::Clone,
            template: Some("sha256:abc".into()),
            fallback: None,
            restore_seconds: Some(0.031),
            reidentify_seconds: Some(0.004),
        };
        let s = start_status(&clone);
        assert_eq!(s.from, StartedFrom::Clone);
        assert_eq!(s.template.as_deref(), Some("sha256:abc"));
        assert_eq!(
            (s.restore_seconds, s.reidentify_seconds),
            (Some(0.031), Some(0.004))
        );
        assert!(s.fallback_reason.is_none() && s.fallback_message.is_none());
        let fell_back = StartReport {
            from: StartKind::Boot,
            template: None,
            fallback: Some(Failure {
                reason: reason::TEMPLATE_BUILDING.into(),
                message: "template sha256:abc is being built\n\x1b[2Jfake line".into(),
            }),
            restore_seconds: None,
            reidentify_seconds: None,
        };
        let s = start_status(&fell_back);
        assert_eq!(s.from, StartedFrom::Boot);
        assert_eq!(
            s.fallback_reason.as_deref(),
            Some(reason::TEMPLATE_BUILDING)
        );
        let msg = s.fallback_message.unwrap();
        assert!(!msg.contains('\n') && !msg.contains('\x1b'), "{msg:?}");
    }

    #[test]
    fn mark_failed_sets_phase_reason_message_and_ready_false() {
        let mut s = ImpVMStatus::default();
        let now = Timestamp::now();
        conditions::set(
            &mut s.conditions,
            READY,
            ConditionStatus::True,
            reason::GUEST_READY,
            "",
            Some(1),
            now,
        );
        mark_failed(
            &mut s,
            reason::RUNNER_START_FAILED,
            "exec refused",
            Some(2),
            now,
        );
        assert_eq!(s.phase, Some(VmPhase::Failed));
        assert_eq!(s.reason.as_deref(), Some(reason::RUNNER_START_FAILED));
        assert_eq!(s.message.as_deref(), Some("exec refused"));
        assert_eq!(s.conditions.len(), 1);
        let ready = &s.conditions[0];
        assert_eq!(
            (
                ready.type_.as_str(),
                ready.status.as_str(),
                ready.reason.as_str()
            ),
            (condition::READY, "False", reason::VM_STOPPED)
        );
        assert_eq!(ready.observed_generation, Some(2));
    }
}
