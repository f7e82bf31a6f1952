//! The one shape of Imp's Events, for every component that publishes them.

use kube::runtime::events::{Event, EventType};

/// An Event whose reason, and action, is `reason` (a constant of [`crate::names::reason`]).
pub fn event(warning: bool, reason: &str, note: String) -> Event {
    Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.to_owned(),
        note: Some(note),
        action: reason.to_owned(),
        secondary: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::reason;

    #[test]
    fn the_reason_is_also_the_action_and_warning_picks_the_type() {
        let e = event(true, reason::NODE_LOST, "gone".into());
        assert_eq!(
            (e.type_, e.reason.as_str(), e.action.as_str()),
            (EventType::Warning, reason::NODE_LOST, reason::NODE_LOST)
        );
        assert_eq!(e.note.as_deref(), Some("gone"));
        assert_eq!(
            event(false, reason::SCHEDULED, String::new()).type_,
            EventType::Normal
        );
    }
}
