//! Status conditions with Kubernetes semantics (those of apimachinery's `meta.SetStatusCondition`):
//! one condition per type; `lastTransitionTime` moves only when the status changes; reason, message
//! and observedGeneration always take the latest write. Every Imp status writer goes through here, so
//! "since when" means the same on every object.

use std::{fmt, str::FromStr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// A condition's `status`, spelled as Kubernetes spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

impl ConditionStatus {
    pub const fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        }
    }
}

impl From<bool> for ConditionStatus {
    fn from(ok: bool) -> Self {
        if ok {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        }
    }
}

/// `None` (not known yet) is `Unknown`.
impl From<Option<bool>> for ConditionStatus {
    fn from(ok: Option<bool>) -> Self {
        ok.map_or(ConditionStatus::Unknown, Self::from)
    }
}

impl fmt::Display for ConditionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `status` that is not one of Kubernetes' three values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("condition status {0:?} is not True, False or Unknown")]
pub struct InvalidConditionStatus(pub String);

impl FromStr for ConditionStatus {
    type Err = InvalidConditionStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "True" => Ok(ConditionStatus::True),
            "False" => Ok(ConditionStatus::False),
            "Unknown" => Ok(ConditionStatus::Unknown),
            other => Err(InvalidConditionStatus(other.to_owned())),
        }
    }
}

/// Sets condition `type_`, adding it at the end when absent. lastTransitionTime becomes `now` only
/// when the condition is new or its status changes. Returns whether anything in `conditions` changed,
/// so a writer can skip a no-op status write.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    now: Timestamp,
) -> bool {
    let message = message.into();
    let status = status.as_str();
    let Some(c) = conditions.iter_mut().find(|c| c.type_ == type_) else {
        conditions.push(Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message,
            observed_generation,
            last_transition_time: Time(now),
        });
        return true;
    };
    let mut changed = false;
    if c.status != status {
        c.status = status.to_owned();
        c.last_transition_time = Time(now);
        changed = true;
    }
    if c.reason != reason {
        c.reason = reason.to_owned();
        changed = true;
    }
    if c.message != message {
        c.message = message;
        changed = true;
    }
    if c.observed_generation != observed_generation {
        c.observed_generation = observed_generation;
        changed = true;
    }
    changed
}

/// The condition of type `type_`, if present.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// The status of condition `type_`; `None` when absent or not one of the three values.
pub fn status(conditions: &[Condition], type_: &str) -> Option<ConditionStatus> {
    find(conditions, type_).and_then(|c| c.status.parse().ok())
}

/// Condition `type_` is present with status True.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    status(conditions, type_) == Some(ConditionStatus::True)
}

/// Removes condition `type_`; returns whether it was present.
pub fn remove(conditions: &mut Vec<Condition>, type_: &str) -> bool {
    let before = conditions.len();
    conditions.retain(|c| c.type_ != type_);
    conditions.len() != before
}

#[cfg(test)]
mod tests {
    use super::ConditionStatus::{False, True, Unknown};
    use super::*;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    #[test]
    fn status_serialises_as_kubernetes_spells_it() {
        for (s, text) in [(True, "True"), (False, "False"), (Unknown, "Unknown")] {
            assert_eq!(serde_json::to_value(s).unwrap(), text);
            assert_eq!(
                serde_json::from_value::<ConditionStatus>(text.into()).unwrap(),
                s
            );
            assert_eq!(s.as_str(), text);
            assert_eq!(s.to_string(), text);
            assert_eq!(text.parse::<ConditionStatus>(), Ok(s));
        }
        assert_eq!(
            "true".parse::<ConditionStatus>(),
            Err(InvalidConditionStatus("true".into()))
        );
        assert!(serde_json::from_value::<ConditionStatus>("yes".into()).is_err());
    }

    #[test]
    fn status_from_bool_and_option() {
        assert_eq!(ConditionStatus::from(true), True);
        assert_eq!(ConditionStatus::from(false), False);
        assert_eq!(ConditionStatus::from(Some(true)), True);
        assert_eq!(ConditionStatus::from(Some(false)), False);
        assert_eq!(ConditionStatus::from(None), Unknown);
    }

    #[test]
    fn set_adds_a_new_condition_stamped_now() {
        let mut cs = Vec::new();
        assert!(set(&mut cs, "Ready", True, "Up", "up", Some(3), t(1)));
        assert_eq!(
            cs,
            vec![Condition {
                type_: "Ready".into(),
                status: "True".into(),
                reason: "Up".into(),
                message: "up".into(),
                observed_generation: Some(3),
                last_transition_time: Time(t(1)),
            }]
        );
    }

    #[test]
    fn same_status_keeps_transition_time_but_takes_reason_message_generation() {
        let mut cs = Vec::new();
        set(&mut cs, "X", True, "A", "m1", Some(1), t(1));
        assert!(set(&mut cs, "X", True, "B", "m2", Some(2), t(2)));
        let c = find(&cs, "X").unwrap();
        assert_eq!(c.last_transition_time, Time(t(1)));
        assert_eq!(
            (c.reason.as_str(), c.message.as_str(), c.observed_generation),
            ("B", "m2", Some(2))
        );
    }

    #[test]
    fn status_change_moves_transition_time() {
        let mut cs = Vec::new();
        set(&mut cs, "X", True, "A", "", None, t(1));
        assert!(set(&mut cs, "X", False, "A", "", None, t(5)));
        assert_eq!(find(&cs, "X").unwrap().last_transition_time, Time(t(5)));
        assert!(set(&mut cs, "X", Unknown, "A", "", None, t(9)));
        let c = find(&cs, "X").unwrap();
        assert_eq!(
            (c.status.as_str(), &c.last_transition_time),
            ("Unknown", &Time(t(9)))
        );
    }

    #[test]
    fn identical_write_reports_no_change_and_touches_nothing() {
        let mut cs = Vec::new();
        set(&mut cs, "X", False, "A", "m", Some(4), t(1));
        let before = cs.clone();
        assert!(!set(&mut cs, "X", False, "A", "m", Some(4), t(7)));
        assert_eq!(cs, before);
    }

    #[test]
    fn each_field_alone_counts_as_a_change() {
        let base = |cs: &mut Vec<Condition>| set(cs, "X", True, "A", "m", Some(1), t(1));
        for (status, reason, message, generation) in [
            (False, "A", "m", Some(1)),
            (True, "B", "m", Some(1)),
            (True, "A", "n", Some(1)),
            (True, "A", "m", Some(2)),
            (True, "A", "m", None),
        ] {
            let mut cs = Vec::new();
            base(&mut cs);
            assert!(
                set(&mut cs, "X", status, reason, message, generation, t(2)),
                "{status} {reason} {message} {generation:?}"
            );
            assert_eq!(cs.len(), 1);
        }
    }

    #[test]
    fn set_keeps_other_conditions_and_their_order() {
        let mut cs = Vec::new();
        set(&mut cs, "A", True, "R", "", None, t(1));
        set(&mut cs, "B", True, "R", "", None, t(1));
        set(&mut cs, "C", True, "R", "", None, t(1));
        set(&mut cs, "A", False, "R", "", None, t(2));
        let types: Vec<&str> = cs.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["A", "B", "C"]);
        assert_eq!(find(&cs, "B").unwrap().last_transition_time, Time(t(1)));
    }

    #[test]
    fn find_status_and_is_true() {
        let mut cs = Vec::new();
        assert!(find(&cs, "X").is_none());
        assert_eq!(status(&cs, "X"), None);
        assert!(!is_true(&cs, "X"));
        set(&mut cs, "X", True, "R", "", None, t(1));
        set(&mut cs, "Y", False, "R", "", None, t(1));
        set(&mut cs, "Z", Unknown, "R", "", None, t(1));
        assert!(is_true(&cs, "X"));
        assert!(!is_true(&cs, "Y"));
        assert!(!is_true(&cs, "Z"));
        assert_eq!(status(&cs, "Y"), Some(False));
        assert_eq!(status(&cs, "Z"), Some(Unknown));
        assert_eq!(find(&cs, "Y").unwrap().type_, "Y");
    }

    #[test]
    fn a_status_written_by_hand_in_another_spelling_is_not_true() {
        let mut cs = Vec::new();
        set(&mut cs, "X", True, "R", "", None, t(1));
        cs[0].status = "true".into();
        assert_eq!(status(&cs, "X"), None);
        assert!(!is_true(&cs, "X"));
        // Writing True again repairs it and counts as a transition.
        assert!(set(&mut cs, "X", True, "R", "", None, t(2)));
        assert_eq!(cs[0].last_transition_time, Time(t(2)));
    }

    #[test]
    fn remove_reports_whether_present() {
        let mut cs = Vec::new();
        set(&mut cs, "X", True, "R", "", None, t(1));
        set(&mut cs, "Y", True, "R", "", None, t(1));
        assert!(remove(&mut cs, "X"));
        assert!(!remove(&mut cs, "X"));
        assert!(find(&cs, "X").is_none());
        assert!(is_true(&cs, "Y"));
    }
}
