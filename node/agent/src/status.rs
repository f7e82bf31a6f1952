//! ImpVM status writes: read-modify-write with the object's resourceVersion as precondition
//! (PUT /status, retried on 409), exactly like the operator (docs/vm-lifecycle.md "What the agent
//! must do and write", rule 1). The conditions list is atomic in the schema, so it is never merged.

use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{condition::READY, reason};
use imp_api::{ImpVM, ImpVMStatus, VmPhase};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, api::PostParams};

const MAX_CONFLICTS: usize = 20;

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

/// Outcome of [`update`].
#[derive(Debug)]
pub enum Written {
    /// Written (or nothing to change); the object as it is now.
    Done(Box<ImpVM>),
    /// The guard refused the current object (its state moved on), or it is gone.
    Refused,
}

/// Read-modify-write of `name`'s status. `edit` sees the current object and may refuse (return
/// false) when the state it was called for no longer holds; it is re-run on every conflict.
pub async fn update(
    api: &Api<ImpVM>,
    name: &str,
    mut edit: impl FnMut(&ImpVM, &mut ImpVMStatus) -> bool,
) -> Result<Written, kube::Error> {
    for _ in 0..MAX_CONFLICTS {
        let Some(mut vm) = api.get_opt(name).await? else {
            return Ok(Written::Refused);
        };
        let before = vm.status.clone().unwrap_or_default();
        let mut status = before.clone();
        if !edit(&vm, &mut status) {
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
