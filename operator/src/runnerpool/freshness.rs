//! Runner freshness, pure: the pool's runner version (`spec.github.runnerVersion`) against GitHub's
//! newest release (the downloads API) and enforcement rules, and what a runner refused by GitHub
//! means for the pool. docs/runner-pool.md, "Runner freshness".
//!
//! GitHub's rules (docs/runner-pool.md, "Runner freshness"): a runner must register with at least
//! [`MINIMUM`] and install each new release within [`GRACE`]; a refused runner prints "Runner
//! version vX is deprecated and cannot receive messages." and exits with [`EXIT_DEPRECATED`] when
//! `ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE=1` (the runner layer sets it, and maps the
//! message to that code for runners too old to know the variable). A refusal of GitHub's newest
//! version is an outage at GitHub, not deprecation.

use std::fmt;
use std::time::Duration;

use imp_api::RunnerVersionStatus;
use imp_api::names::reason;
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

/// The runner's exit code for "this version is deprecated" (`RunnerVersionDeprecated`).
pub const EXIT_DEPRECATED: i32 = 7;
/// GitHub's minimum runner version.
pub const MINIMUM: RunnerVersion = RunnerVersion(2, 329, 0);
/// How long a superseded release keeps receiving jobs.
pub const GRACE: Duration = Duration::from_secs(30 * 86_400);
/// Within this much of the end of [`GRACE`] the pool is Expiring.
pub const WARN_WITHIN: Duration = Duration::from_secs(7 * 86_400);

/// A pass's freshness outcome, for the pool's status and the mint decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Freshness {
    pub status: RunnerVersionStatus,
    /// The `RunnerVersionSupported` condition ([`Verdict::condition`]).
    pub supported: (Option<bool>, &'static str, String),
    /// The `Degraded` condition ([`degraded`]).
    pub degraded: (bool, &'static str, String),
    /// [`minting_stopped`].
    pub minting_stopped: bool,
}

impl Default for Freshness {
    fn default() -> Self {
        Freshness {
            status: RunnerVersionStatus::default(),
            supported: (None, reason::RUNNER_VERSION_UNKNOWN, String::new()),
            degraded: (false, reason::NOT_DEGRADED, String::new()),
            minting_stopped: false,
        }
    }
}

/// An actions/runner version, `MAJOR.MINOR.PATCH`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunnerVersion(pub u32, pub u32, pub u32);

impl RunnerVersion {
    /// `2.329.0` or `v2.329.0`.
    pub fn parse(s: &str) -> Option<RunnerVersion> {
        let s = s.trim();
        let s = s.strip_prefix('v').unwrap_or(s);
        let mut it = s.split('.').map(|p| p.parse::<u32>().ok());
        let v = RunnerVersion(it.next()??, it.next()??, it.next()??);
        it.next().is_none().then_some(v)
    }

    /// The version in a release file name, `actions-runner-linux-x64-2.330.0.tar.gz`.
    pub fn from_filename(name: &str) -> Option<RunnerVersion> {
        let stem = name
            .strip_suffix(".tar.gz")
            .or_else(|| name.strip_suffix(".zip"))?;
        RunnerVersion::parse(stem.rsplit('-').next()?)
    }
}

impl fmt::Display for RunnerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// The verdict on a pool's runner version.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// No version to compare (the pool sets none, or GitHub's newest is not known yet).
    Unknown {
        why: String,
    },
    /// GitHub's newest, or superseded with more than [`WARN_WITHIN`] left.
    Current {
        days_left: Option<f64>,
    },
    Expiring {
        days_left: f64,
    },
    /// Below [`MINIMUM`], or superseded longer than [`GRACE`].
    Deprecated {
        why: String,
    },
}

impl Verdict {
    /// The `RunnerVersionSupported` condition: status, reason, message.
    pub fn condition(
        &self,
        version: Option<RunnerVersion>,
        latest: Option<RunnerVersion>,
    ) -> (Option<bool>, &'static str, String) {
        let v = version.map_or_else(|| "unset".to_owned(), |v| v.to_string());
        let l = latest.map_or_else(|| "unknown".to_owned(), |v| v.to_string());
        match self {
            Verdict::Unknown { why } => (None, reason::RUNNER_VERSION_UNKNOWN, why.clone()),
            Verdict::Current { days_left: None } => (
                Some(true),
                reason::RUNNER_VERSION_CURRENT,
                format!("runner {v} is GitHub's newest release"),
            ),
            Verdict::Current { days_left: Some(d) } => (
                Some(true),
                reason::RUNNER_VERSION_CURRENT,
                format!(
                    "runner {v} is superseded by {l}; {} days left to upgrade",
                    days(*d)
                ),
            ),
            Verdict::Expiring { days_left } => (
                Some(true),
                reason::RUNNER_VERSION_EXPIRING,
                format!(
                    "runner {v} is superseded by {l}; GitHub stops giving it jobs in {} days: rebuild the runner layer with {l} and set spec.github.runnerVersion",
                    days(*days_left)
                ),
            ),
            Verdict::Deprecated { why } => {
                (Some(false), reason::RUNNER_VERSION_DEPRECATED, why.clone())
            }
        }
    }

    /// Days left of GitHub's grace (the gauge): None when unknown or not superseded.
    pub fn days_left(&self) -> Option<f64> {
        match self {
            Verdict::Unknown { .. } | Verdict::Current { days_left: None } => None,
            Verdict::Current { days_left: Some(d) } | Verdict::Expiring { days_left: d } => {
                Some(*d)
            }
            Verdict::Deprecated { .. } => Some(0.0),
        }
    }
}

/// Whole days, rounded down (6.9 days left is "6").
fn days(d: f64) -> u64 {
    d.max(0.0).floor() as u64
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Judges the pool's version against GitHub's newest and records the supersession clock.
/// `version_text` is `spec.github.runnerVersion` as written; `old` the pool's last status.
pub fn judge(
    version_text: Option<&str>,
    latest: Option<RunnerVersion>,
    old: Option<&RunnerVersionStatus>,
    now: Timestamp,
) -> (RunnerVersionStatus, Verdict) {
    let version = version_text.and_then(RunnerVersion::parse);
    let mut status = RunnerVersionStatus {
        version: version.map(|v| v.to_string()),
        // GitHub's answer may be missing this pass (a failed call): keep the last one known.
        latest: latest
            .map(|v| v.to_string())
            .or_else(|| old.and_then(|o| o.latest.clone())),
        superseded_time: None,
        refused_generation: old.and_then(|o| o.refused_generation),
        refused_vm: old.and_then(|o| o.refused_vm.clone()),
        refused_time: old.and_then(|o| o.refused_time.clone()),
    };
    let latest = status.latest.as_deref().and_then(RunnerVersion::parse);
    let Some(version) = version else {
        let why = match version_text {
            Some(t) => format!("spec.github.runnerVersion `{t}` is not MAJOR.MINOR.PATCH"),
            None => "spec.github.runnerVersion is not set: set it to the runner layer's version (images/runner/build.sh prints it)".to_owned(),
        };
        return (status, Verdict::Unknown { why });
    };
    if version < MINIMUM {
        let why = format!(
            "runner {version} is below GitHub's minimum {MINIMUM}: GitHub refuses it; rebuild the runner layer with {} and set spec.github.runnerVersion",
            latest.unwrap_or(MINIMUM)
        );
        return (status, Verdict::Deprecated { why });
    }
    let Some(latest) = latest else {
        let why = format!("runner {version}: GitHub's supported runner versions were not read yet");
        return (status, Verdict::Unknown { why });
    };
    if version >= latest {
        return (status, Verdict::Current { days_left: None });
    }
    // Superseded: the clock runs from the first sighting of a newer release, kept while the
    // pool's version stays the same.
    let since = old
        .filter(|o| o.version.as_deref() == Some(&version.to_string()))
        .and_then(|o| o.superseded_time.clone())
        .map_or(now, |t| t.0);
    status.superseded_time = Some(Time(since));
    let gone = secs(now.duration_since(since).try_into().unwrap_or_default());
    let left = secs(GRACE) - gone;
    let verdict = if left <= 0.0 {
        Verdict::Deprecated {
            why: format!(
                "runner {version} was superseded by {latest} more than 30 days ago: GitHub refuses it; rebuild the runner layer with {latest} and set spec.github.runnerVersion"
            ),
        }
    } else if left <= secs(WARN_WITHIN) {
        Verdict::Expiring {
            days_left: left / 86_400.0,
        }
    } else {
        Verdict::Current {
            days_left: Some(left / 86_400.0),
        }
    };
    (status, verdict)
}

/// A runner VM of the pool that GitHub refused (exit code [`EXIT_DEPRECATED`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedExit {
    pub vm: String,
    /// The VM's spec is the pool's current template (an older template's refusal says nothing
    /// about the runner layer the pool uses now).
    pub current_template: bool,
}

/// What a refusal means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The pool's runner is deprecated: stop minting until the pool changes.
    Deprecated { vm: String },
    /// GitHub refused its newest version too: an outage, keep minting with backoff.
    Outage { vm: String },
}

/// The verdict on this pass's refused exits. Deprecation wins over an outage only when GitHub is
/// known to offer something newer than the pool's version; a pool at the newest version (or whose
/// version is unknown while GitHub's newest is known to be it) is refused by an outage. With the
/// pool's version or GitHub's newest unknown, the refusal is taken at its word: deprecated.
pub fn refusal(
    exits: &[RefusedExit],
    version: Option<RunnerVersion>,
    latest: Option<RunnerVersion>,
) -> Option<Refusal> {
    let vm = exits
        .iter()
        .find(|e| e.current_template)
        .map(|e| e.vm.clone())?;
    match (version, latest) {
        (Some(v), Some(l)) if v >= l && v >= MINIMUM => Some(Refusal::Outage { vm }),
        _ => Some(Refusal::Deprecated { vm }),
    }
}

/// Records a deprecated refusal in the status (once per generation: the first refused VM is
/// the one named).
pub fn record_refusal(
    status: &mut RunnerVersionStatus,
    refusal: Option<&Refusal>,
    generation: Option<i64>,
    now: Timestamp,
) -> bool {
    let Some(Refusal::Deprecated { vm }) = refusal else {
        return false;
    };
    if generation.is_some() && status.refused_generation == generation {
        return false;
    }
    status.refused_generation = generation;
    status.refused_vm = Some(vm.clone());
    status.refused_time = Some(Time(now));
    true
}

/// Whether minting is stopped: a runner of this generation was refused as deprecated.
pub fn minting_stopped(status: &RunnerVersionStatus, generation: Option<i64>) -> bool {
    generation.is_some() && status.refused_generation == generation
}

/// The Degraded condition: status, reason, message.
pub fn degraded(
    status: &RunnerVersionStatus,
    generation: Option<i64>,
    outage: Option<&Refusal>,
) -> (bool, &'static str, String) {
    if minting_stopped(status, generation) {
        let vm = status.refused_vm.as_deref().unwrap_or("a runner VM");
        let v = status.version.as_deref().unwrap_or("unknown");
        let l = status.latest.as_deref().unwrap_or("unknown");
        return (
            true,
            reason::RUNNER_VERSION_DEPRECATED,
            format!(
                "GitHub refused runner {vm} as deprecated (exit code {EXIT_DEPRECATED}; runner version {v}, GitHub's newest {l}): no runner is minted until the pool's runner image or spec.github.runnerVersion changes"
            ),
        );
    }
    if let Some(Refusal::Outage { vm }) = outage {
        let v = status.version.as_deref().unwrap_or("unknown");
        return (
            true,
            reason::RUNNER_REFUSED_CURRENT_VERSION,
            format!(
                "GitHub refused runner {vm} as deprecated although {v} is its newest release: an outage at GitHub, not deprecation; minting goes on with backoff"
            ),
        );
    }
    (
        false,
        reason::NOT_DEGRADED,
        "no runner of the pool was refused by GitHub".to_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(days: f64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + (days * 86_400.0) as i64).unwrap()
    }

    fn v(s: &str) -> RunnerVersion {
        RunnerVersion::parse(s).unwrap()
    }

    #[test]
    fn versions_parse_from_specs_and_release_file_names() {
        assert_eq!(
            RunnerVersion::parse("2.329.0"),
            Some(RunnerVersion(2, 329, 0))
        );
        assert_eq!(
            RunnerVersion::parse("v2.330.1"),
            Some(RunnerVersion(2, 330, 1))
        );
        for bad in ["", "2.329", "2.329.0.1", "2.x.0", "latest"] {
            assert_eq!(RunnerVersion::parse(bad), None, "{bad}");
        }
        assert_eq!(
            RunnerVersion::from_filename("actions-runner-linux-x64-2.330.0.tar.gz"),
            Some(RunnerVersion(2, 330, 0))
        );
        assert_eq!(
            RunnerVersion::from_filename("actions-runner-win-x64-2.330.0.zip"),
            Some(RunnerVersion(2, 330, 0))
        );
        assert_eq!(RunnerVersion::from_filename("actions-runner.tar.gz"), None);
        assert!(v("2.330.0") > v("2.329.9") && v("2.329.10") > v("2.329.9"));
        assert_eq!(v("2.329.0").to_string(), "2.329.0");
    }

    #[test]
    fn the_newest_version_is_current_without_a_clock() {
        let (s, verdict) = judge(Some("2.330.0"), Some(v("2.330.0")), None, t(0.0));
        assert_eq!(verdict, Verdict::Current { days_left: None });
        assert_eq!(s.superseded_time, None);
        assert_eq!(s.latest.as_deref(), Some("2.330.0"));
        assert_eq!(verdict.condition(Some(v("2.330.0")), None).0, Some(true));
        // Newer than GitHub's newest (a pre-release build): current too.
        let (_, verdict) = judge(Some("2.331.0"), Some(v("2.330.0")), None, t(0.0));
        assert_eq!(verdict, Verdict::Current { days_left: None });
    }

    #[test]
    fn below_the_minimum_is_deprecated_even_before_github_answers() {
        let (_, verdict) = judge(Some("2.328.9"), None, None, t(0.0));
        assert!(matches!(verdict, Verdict::Deprecated { .. }), "{verdict:?}");
        let (ok, why, msg) = verdict.condition(Some(v("2.328.9")), None);
        assert_eq!((ok, why), (Some(false), reason::RUNNER_VERSION_DEPRECATED));
        assert!(msg.contains("2.329.0"), "{msg}");
        assert_eq!(verdict.days_left(), Some(0.0));
    }

    #[test]
    fn unset_unparsable_or_unanswered_is_unknown() {
        for (text, latest) in [
            (None, Some(v("2.330.0"))),
            (Some("banana"), Some(v("2.330.0"))),
            (Some("2.330.0"), None),
        ] {
            let (_, verdict) = judge(text, latest, None, t(0.0));
            assert!(matches!(verdict, Verdict::Unknown { .. }), "{text:?}");
            assert_eq!(verdict.condition(None, latest).0, None);
            assert_eq!(verdict.days_left(), None);
        }
    }

    #[test]
    fn a_superseded_version_counts_thirty_days_from_the_first_sighting() {
        let (s0, verdict) = judge(Some("2.329.0"), Some(v("2.330.0")), None, t(0.0));
        assert_eq!(s0.superseded_time, Some(Time(t(0.0))));
        assert!(
            matches!(verdict, Verdict::Current { days_left: Some(d) } if (d - 30.0).abs() < 1e-6)
        );
        // 23 days later (the clock kept in status, e.g. across an operator restart): 7 left.
        let (s1, verdict) = judge(Some("2.329.0"), Some(v("2.330.0")), Some(&s0), t(23.0));
        assert_eq!(s1.superseded_time, s0.superseded_time, "the clock is kept");
        assert!(
            matches!(verdict, Verdict::Expiring { days_left } if (days_left - 7.0).abs() < 1e-6)
        );
        let (_, why, msg) = verdict.condition(Some(v("2.329.0")), Some(v("2.330.0")));
        assert_eq!(why, reason::RUNNER_VERSION_EXPIRING);
        assert!(
            msg.contains("in 7 days") && msg.contains("2.330.0"),
            "{msg}"
        );
        // A third release meanwhile does not restart the clock.
        let (s2, verdict) = judge(Some("2.329.0"), Some(v("2.331.0")), Some(&s1), t(29.5));
        assert_eq!(s2.superseded_time, s0.superseded_time);
        assert!(matches!(verdict, Verdict::Expiring { days_left } if days_left < 1.0));
        let (_, verdict) = judge(Some("2.329.0"), Some(v("2.331.0")), Some(&s2), t(30.0));
        assert!(matches!(verdict, Verdict::Deprecated { .. }), "{verdict:?}");
    }

    #[test]
    fn upgrading_the_pool_resets_the_clock() {
        let (s0, _) = judge(Some("2.329.0"), Some(v("2.330.0")), None, t(0.0));
        let (s1, verdict) = judge(Some("2.330.0"), Some(v("2.331.0")), Some(&s0), t(25.0));
        assert_eq!(
            s1.superseded_time,
            Some(Time(t(25.0))),
            "a new version, a new clock"
        );
        assert!(matches!(verdict, Verdict::Current { days_left: Some(_) }));
        let (s2, verdict) = judge(Some("2.331.0"), Some(v("2.331.0")), Some(&s1), t(26.0));
        assert_eq!(
            (s2.superseded_time, verdict),
            (None, Verdict::Current { days_left: None })
        );
    }

    #[test]
    fn a_failed_downloads_call_keeps_the_last_known_newest() {
        let (s0, _) = judge(Some("2.329.0"), Some(v("2.330.0")), None, t(0.0));
        let (s1, verdict) = judge(Some("2.329.0"), None, Some(&s0), t(24.0));
        assert_eq!(s1.latest.as_deref(), Some("2.330.0"));
        assert!(matches!(verdict, Verdict::Expiring { .. }), "{verdict:?}");
    }

    fn exit(vm: &str, current: bool) -> RefusedExit {
        RefusedExit {
            vm: vm.into(),
            current_template: current,
        }
    }

    #[test]
    fn a_refusal_below_the_newest_is_deprecation_and_of_the_newest_an_outage() {
        let exits = [exit("old-template", false), exit("vm-1", true)];
        assert_eq!(
            refusal(&exits, Some(v("2.329.0")), Some(v("2.330.0"))),
            Some(Refusal::Deprecated { vm: "vm-1".into() })
        );
        assert_eq!(
            refusal(&exits, Some(v("2.330.0")), Some(v("2.330.0"))),
            Some(Refusal::Outage { vm: "vm-1".into() })
        );
        // Unknown either side: taken at its word.
        assert_eq!(
            refusal(&exits, None, Some(v("2.330.0"))),
            Some(Refusal::Deprecated { vm: "vm-1".into() })
        );
        assert_eq!(
            refusal(&exits, Some(v("2.330.0")), None),
            Some(Refusal::Deprecated { vm: "vm-1".into() })
        );
        // Only VMs of an older template: nothing about the current runner layer.
        assert_eq!(refusal(&exits[..1], None, None), None);
        assert_eq!(refusal(&[], Some(v("2.329.0")), None), None);
    }

    #[test]
    fn a_deprecated_refusal_stops_minting_for_its_generation_only() {
        let mut s = RunnerVersionStatus {
            version: Some("2.329.0".into()),
            latest: Some("2.330.0".into()),
            ..Default::default()
        };
        assert!(!minting_stopped(&s, Some(3)));
        let d = Refusal::Deprecated { vm: "vm-1".into() };
        assert!(record_refusal(&mut s, Some(&d), Some(3), t(0.0)));
        assert!(minting_stopped(&s, Some(3)));
        // The next refused VM of the same generation changes nothing (the first is named).
        let d2 = Refusal::Deprecated { vm: "vm-2".into() };
        assert!(!record_refusal(&mut s, Some(&d2), Some(3), t(1.0)));
        assert_eq!(s.refused_vm.as_deref(), Some("vm-1"));
        let (on, why, msg) = degraded(&s, Some(3), None);
        assert!(on && why == reason::RUNNER_VERSION_DEPRECATED);
        assert!(
            msg.contains("vm-1") && msg.contains("exit code 7") && msg.contains("2.330.0"),
            "{msg}"
        );
        // The pool changed (a new runner image or version): minting resumes.
        assert!(!minting_stopped(&s, Some(4)));
        assert_eq!(degraded(&s, Some(4), None).1, reason::NOT_DEGRADED);
        // An outage never stops minting.
        let o = Refusal::Outage { vm: "vm-3".into() };
        assert!(!record_refusal(&mut s, Some(&o), Some(4), t(2.0)));
        assert!(!minting_stopped(&s, Some(4)));
        let (on, why, _) = degraded(&s, Some(4), Some(&o));
        assert!(on && why == reason::RUNNER_REFUSED_CURRENT_VERSION);
    }
}
