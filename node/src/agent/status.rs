//! ImpVM status writes: read-modify-write with the object's resourceVersion as precondition
//! (PUT /status, retried on 409), exactly like the operator (docs/vm-lifecycle.md "What the agent
//! must do and write", rule 1). The conditions list is atomic in the schema, so it is never merged.

use imp_api::names::condition::READY;
use imp_api::{ImpVM, ImpVMStatus, VmPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, api::PostParams};

const MAX_CONFLICTS: usize = 20;

/// Sets condition `type_` (keeping lastTransitionTime when the status does not change).
pub fn set_condition(
    status: &mut ImpVMStatus,
    type_: &str,
    value: &str,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    let last_transition_time = status
        .conditions
        .iter()
        .find(|c| c.type_ == type_ && c.status == value)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    status.conditions.retain(|c| c.type_ != type_);
    status.conditions.push(Condition {
        type_: type_.to_owned(),
        status: value.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: generation,
        last_transition_time,
    });
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
    set_condition(status, READY, "False", "VmStopped", "", generation, now);
}

pub fn remove_condition(status: &mut ImpVMStatus, type_: &str) {
    status.conditions.retain(|c| c.type_ != type_);
}

pub fn condition_true(status: Option<&ImpVMStatus>, type_: &str) -> bool {
    status.is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == type_ && c.status == "True")
    })
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

    #[test]
    fn condition_transition_time_kept_while_status_unchanged() {
        let mut s = ImpVMStatus::default();
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let t1: Timestamp = "2026-01-01T00:01:00Z".parse().unwrap();
        set_condition(&mut s, "Ready", "True", "GuestReady", "", Some(1), t0);
        set_condition(&mut s, "Ready", "True", "GuestReady", "again", Some(2), t1);
        assert_eq!(s.conditions.len(), 1);
        assert_eq!(s.conditions[0].last_transition_time, Time(t0));
        assert_eq!(s.conditions[0].message, "again");
        set_condition(&mut s, "Ready", "False", "VmStopped", "", Some(2), t1);
        assert_eq!(s.conditions[0].last_transition_time, Time(t1));
        assert!(!condition_true(Some(&s), "Ready"));
        set_condition(&mut s, "TornDown", "True", "TeardownComplete", "", None, t1);
        assert!(condition_true(Some(&s), "TornDown"));
        remove_condition(&mut s, "TornDown");
        assert!(!condition_true(Some(&s), "TornDown"));
    }

    #[test]
    fn mark_failed_sets_phase_reason_message_and_ready_false() {
        let mut s = ImpVMStatus::default();
        let now = Timestamp::now();
        set_condition(&mut s, "Ready", "True", "GuestReady", "", Some(1), now);
        mark_failed(&mut s, "RunnerStartFailed", "exec refused", Some(2), now);
        assert_eq!(s.phase, Some(VmPhase::Failed));
        assert_eq!(s.reason.as_deref(), Some("RunnerStartFailed"));
        assert_eq!(s.message.as_deref(), Some("exec refused"));
        assert_eq!(s.conditions.len(), 1);
        let ready = &s.conditions[0];
        assert_eq!(
            (
                ready.type_.as_str(),
                ready.status.as_str(),
                ready.reason.as_str()
            ),
            ("Ready", "False", "VmStopped")
        );
        assert_eq!(ready.observed_generation, Some(2));
    }

    #[test]
    fn other_writers_conditions_are_kept() {
        let mut s = ImpVMStatus::default();
        let now = Timestamp::now();
        set_condition(&mut s, "Scheduled", "True", "NodeAssigned", "", None, now);
        set_condition(&mut s, "Ready", "True", "GuestReady", "", None, now);
        assert_eq!(s.conditions.len(), 2);
        assert!(condition_true(Some(&s), "Scheduled"));
    }
}
