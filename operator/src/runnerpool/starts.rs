//! How a pool's runner VMs were started (snapshot standby), as pure functions: each VM's
//! `status.start` (written by its node's agent from imp-runtime's report) counted once into
//! `imp_runner_vm_starts_total{from,fallback}`, and a clone's restore and reidentify for the
//! job SLO ([`super::slo::clone_phases`]).

use std::collections::HashSet;
use std::time::Duration;

use imp_api::{StartStatus, StartedFrom};

use super::slo::CloneTimes;

/// The `fallback` label of a start that needed none (a boot that was asked for, or a clone).
pub const NO_FALLBACK: &str = "none";

/// One start, as counted: `from` is `boot` or `clone`; `fallback` the reason a VM asked to
/// start from a template booted instead, else [`NO_FALLBACK`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    pub from: &'static str,
    pub fallback: String,
}

impl Start {
    pub fn of(s: &StartStatus) -> Start {
        Start {
            from: match s.from {
                StartedFrom::Boot => "boot",
                StartedFrom::Clone => "clone",
            },
            fallback: s
                .fallback_reason
                .clone()
                .unwrap_or_else(|| NO_FALLBACK.to_owned()),
        }
    }
}

/// A clone's restore and reidentify (None for a boot). A missing or unusable figure counts as
/// zero: its time stays in the `boot` phase.
pub fn clone_times(s: &StartStatus) -> Option<CloneTimes> {
    if s.from != StartedFrom::Clone {
        return None;
    }
    let secs = |v: Option<f64>| {
        v.filter(|v| v.is_finite() && *v >= 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or_default()
    };
    Some(CloneTimes {
        restore: secs(s.restore_seconds),
        reidentify: secs(s.reidentify_seconds),
    })
}

/// The starts to count this pass: each VM (uid) with a `status.start` once; `counted` remembers
/// the uids counted and forgets those no longer among `vms`.
pub fn account_starts(
    counted: &mut HashSet<String>,
    vms: &[(String, Option<&StartStatus>)],
) -> Vec<Start> {
    let present: HashSet<&str> = vms.iter().map(|(u, _)| u.as_str()).collect();
    counted.retain(|u| present.contains(u.as_str()));
    vms.iter()
        .filter_map(|(uid, start)| {
            let s = (*start)?;
            counted.insert(uid.clone()).then(|| Start::of(s))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_api::names::reason;

    fn clone() -> StartStatus {
        StartStatus {
            from: StartedFrom::Clone,
            template: Some("sha256:t".into()),
            fallback_reason: None,
            fallback_message: None,
            restore_seconds: Some(0.03),
            reidentify_seconds: Some(0.005),
        }
    }

    fn fell_back(reason: &str) -> StartStatus {
        StartStatus {
            from: StartedFrom::Boot,
            template: None,
            fallback_reason: Some(reason.into()),
            fallback_message: Some("no template for the spec on this node".into()),
            restore_seconds: None,
            reidentify_seconds: None,
        }
    }

    #[test]
    fn each_vm_s_start_counts_once_by_kind_and_fallback() {
        let mut counted = HashSet::new();
        let (c, f) = (clone(), fell_back(reason::TEMPLATE_MISSING));
        let vms = [
            ("a".to_string(), Some(&c)),
            ("b".to_string(), Some(&f)),
            ("c".to_string(), None),
        ];
        let got = account_starts(&mut counted, &vms);
        assert_eq!(
            got,
            vec![
                Start {
                    from: "clone",
                    fallback: NO_FALLBACK.into()
                },
                Start {
                    from: "boot",
                    fallback: reason::TEMPLATE_MISSING.into()
                },
            ]
        );
        assert!(account_starts(&mut counted, &vms).is_empty(), "once");
        // "c" starts later: counted then; "a" gone is forgotten.
        let vms = [("b".to_string(), Some(&f)), ("c".to_string(), Some(&c))];
        assert_eq!(account_starts(&mut counted, &vms).len(), 1);
        assert_eq!(counted, HashSet::from(["b".to_string(), "c".to_string()]));
    }

    #[test]
    fn only_a_clone_has_restore_and_reidentify() {
        assert_eq!(
            clone_times(&clone()),
            Some(CloneTimes {
                restore: Duration::from_millis(30),
                reidentify: Duration::from_millis(5)
            })
        );
        assert_eq!(clone_times(&fell_back(reason::TEMPLATE_BUILDING)), None);
        let odd = StartStatus {
            restore_seconds: Some(f64::NAN),
            reidentify_seconds: Some(-1.0),
            ..clone()
        };
        assert_eq!(clone_times(&odd), Some(CloneTimes::default()));
    }
}
