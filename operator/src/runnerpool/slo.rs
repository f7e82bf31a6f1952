//! The per-job SLO as pure functions: which job a runner VM served and how long that job waited for
//! each step, from being queued to completing. The pool hands a queued job to no VM in particular (any
//! idle runner with matching labels may take it), so a VM's job is known only once the `in_progress`
//! webhook (or the sweep) names its runner; [`served_updates`] then records the job and the step times
//! on the VM's status (`status.job`) and says which phase durations to observe.
//!
//! A step that happened before the job was queued did not delay it (a warm runner was waiting): every
//! step time is clamped to be no earlier than the steps before it and the queued time, so the phases of
//! a job are never negative and add up to its wait (queued -> picked up) plus its run.
//!
//! A VM cloned from a snapshot template (snapshot standby) reports how long its restore and its
//! `Reidentify` took (`status.start`): both are the last part of its boot step (imp-runtime reports
//! the clone Running only once reidentified), so they are taken off the end of `boot` as the phases
//! `restore` and `reidentify`; the sum stays the wait.

use std::time::Duration;

use imp_api::ServedJobStatus;
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::MicroTime, jiff::Timestamp};

use super::demand::ServedJob;

/// Values of the `phase` label of `imp_runner_job_phase_seconds`, in order; each names the step the
/// job waited for: queued -> VM created (`vm_create`) -> JIT minted (`mint`) -> scheduled (`schedule`)
/// -> guest booted (`boot`; for a clone, the node's work before the restore) -> clone restored
/// (`restore`) -> clone reidentified (`reidentify`) -> runner started (`runner_start`) -> job picked
/// up (`pickup`) -> completed (`run`).
pub const JOB_PHASES: [&str; 9] = [
    "vm_create",
    "mint",
    "schedule",
    "boot",
    "restore",
    "reidentify",
    "runner_start",
    "pickup",
    "run",
];

/// The phases measured from step times, one per step after the queued time: every served job has
/// them up to `pickup` (a step never seen is left out and its time falls to the next).
pub const STEP_PHASES: [&str; 6] = [
    "vm_create",
    "mint",
    "schedule",
    "boot",
    "runner_start",
    "pickup",
];

/// The phases a clone's boot step is split into (from its `status.start`).
pub const CLONE_PHASES: [&str; 2] = ["restore", "reidentify"];

/// A clone's restore and reidentify, as its node reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CloneTimes {
    pub restore: Duration,
    pub reidentify: Duration,
}

/// The timestamps of one runner VM's life, from its ImpVM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmTimes {
    pub created: Option<Timestamp>,
    pub scheduled: Option<Timestamp>,
    pub boot_complete: Option<Timestamp>,
    pub runner_started: Option<Timestamp>,
    pub runner_exited: Option<Timestamp>,
    /// A clone's restore and reidentify (`status.start`); None for a boot.
    pub clone_start: Option<CloneTimes>,
}

/// What a pass knows of one runner VM for its SLO record.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedFacts {
    pub vm: String,
    /// `status.job` as read.
    pub recorded: Option<ServedJobStatus>,
    /// The VM's own step times (creation, scheduled, booted, runner started).
    pub times: VmTimes,
    /// The job its runner took, if the demand knows it.
    pub job: Option<ServedJob>,
}

/// A VM's `status.job` to write, and what to observe once it is written.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedUpdate {
    pub vm: String,
    pub status: ServedJobStatus,
    /// Phases up to the pickup (`run` is observed from the demand: the VM may be gone by then).
    pub phases: Vec<(&'static str, Duration)>,
    /// Queued -> picked up.
    pub wait: Option<Duration>,
}

fn micro(t: Option<Timestamp>) -> Option<MicroTime> {
    t.map(MicroTime)
}

fn ts(t: &Option<MicroTime>) -> Option<Timestamp> {
    t.as_ref().map(|t| t.0)
}

/// The `status.job` writes due this pass. A VM is recorded once its runner has Started (so the record
/// holds every step before the pickup) or its job completed; what was recorded before is kept (after an
/// operator restart the demand's times are younger), missing steps are filled in. The phases are
/// observed once, when the job is first recorded on the VM.
pub fn served_updates(facts: &[ServedFacts]) -> Vec<ServedUpdate> {
    let mut out = Vec::new();
    for f in facts {
        let Some(job) = &f.job else { continue };
        let old = f.recorded.clone().unwrap_or_default();
        let id = i64::try_from(job.id).ok();
        if old.job_id.is_some() && old.job_id != id {
            // An ephemeral runner serves one job; the first record stands.
            continue;
        }
        if f.times.runner_started.is_none() && job.completed_at.is_none() {
            continue;
        }
        let t = &f.times;
        let new = ServedJobStatus {
            job_id: id,
            run_id: old
                .run_id
                .or(job.run_id.and_then(|r| i64::try_from(r).ok())),
            repository: old.repository.clone().or(Some(job.repository.clone())),
            queued_time: old.queued_time.clone().or(micro(job.queued_at)),
            vm_created_time: old.vm_created_time.clone().or(micro(t.created)),
            minted_time: old.minted_time.clone(),
            scheduled_time: old.scheduled_time.clone().or(micro(t.scheduled)),
            booted_time: old.booted_time.clone().or(micro(t.boot_complete)),
            runner_started_time: old.runner_started_time.clone().or(micro(t.runner_started)),
            picked_up_time: old.picked_up_time.clone().or(micro(job.picked_up_at)),
            completed_time: old.completed_time.clone().or(micro(job.completed_at)),
        };
        if new == old {
            continue;
        }
        let first = old.job_id.is_none();
        let (phases, wait) = if first {
            let steps = [
                ts(&new.queued_time),
                ts(&new.vm_created_time),
                ts(&new.minted_time),
                ts(&new.scheduled_time),
                ts(&new.booted_time),
                ts(&new.runner_started_time),
                ts(&new.picked_up_time),
            ];
            let wait = match (steps[0], steps[6]) {
                (Some(q), Some(p)) => Some(span(q, p.max(q))),
                _ => None,
            };
            (clone_phases(job_phases(&steps), f.times.clone_start), wait)
        } else {
            (Vec::new(), None)
        };
        out.push(ServedUpdate {
            vm: f.vm.clone(),
            status: new,
            phases,
            wait,
        });
    }
    out
}

/// Phase durations from step times (`steps[0]` the queued time, then one per [`STEP_PHASES`] entry, as
/// many as given). Each step counts from the latest step before it (or the queued time), never earlier:
/// a step done before the job was queued took none of its time. A missing step is left out and its time
/// falls to the next phase; without a queued time nothing is measured.
pub fn job_phases(steps: &[Option<Timestamp>]) -> Vec<(&'static str, Duration)> {
    let Some(mut at) = steps.first().copied().flatten() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (phase, step) in STEP_PHASES.iter().zip(steps.iter().skip(1)) {
        if let Some(s) = step {
            let s = (*s).max(at);
            out.push((*phase, span(at, s)));
            at = s;
        }
    }
    out
}

/// `phases` (from [`job_phases`]) with a clone's restore and reidentify taken off the end of its
/// `boot` phase, reidentify first (it is the very end): a part that lies before the boot phase's
/// start (the job was queued later) did not delay the job and is not counted. The sum stays the
/// same; without `clone` (a boot) the phases are returned as they are.
pub fn clone_phases(
    phases: Vec<(&'static str, Duration)>,
    clone: Option<CloneTimes>,
) -> Vec<(&'static str, Duration)> {
    let Some(c) = clone else {
        return phases;
    };
    let mut out = Vec::with_capacity(phases.len() + 2);
    for (phase, d) in phases {
        if phase != "boot" {
            out.push((phase, d));
            continue;
        }
        let reidentify = c.reidentify.min(d);
        let restore = c.restore.min(d - reidentify);
        out.push(("boot", d - reidentify - restore));
        out.push(("restore", restore));
        out.push(("reidentify", reidentify));
    }
    out
}

/// The `run` phase of a job: picked up -> completed.
pub fn run_phase(picked_up: Timestamp, completed: Timestamp) -> Duration {
    span(picked_up, completed.max(picked_up))
}

fn span(from: Timestamp, to: Timestamp) -> Duration {
    Duration::try_from(to.duration_since(from)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: i64) -> Timestamp {
        Timestamp::from_millisecond(1_700_000_000_000 + ms).unwrap()
    }

    fn job(queued: i64, picked: Option<i64>, done: Option<i64>) -> ServedJob {
        ServedJob {
            id: 42,
            run_id: Some(7),
            repository: "acme/app".into(),
            runner_name: "p-uid".into(),
            queued_at: Some(t(queued)),
            picked_up_at: picked.map(t),
            completed_at: done.map(t),
        }
    }

    fn times(created: i64, started: Option<i64>) -> VmTimes {
        VmTimes {
            created: Some(t(created)),
            scheduled: Some(t(created + 100)),
            boot_complete: Some(t(created + 2_100)),
            runner_started: started.map(t),
            runner_exited: None,
            clone_start: None,
        }
    }

    fn minted(created: i64, minted: i64) -> ServedJobStatus {
        ServedJobStatus {
            vm_created_time: Some(MicroTime(t(created))),
            minted_time: Some(MicroTime(t(minted))),
            ..Default::default()
        }
    }

    fn ms(v: &[(&'static str, Duration)]) -> Vec<(&'static str, u128)> {
        v.iter().map(|(p, d)| (*p, d.as_millis())).collect()
    }

    #[test]
    fn a_cold_start_is_split_into_its_steps_and_adds_up_to_the_wait() {
        // Queued at 0; VM created at 50, minted at 300, scheduled 150, booted 2150, runner 2500,
        // picked up 4000.
        let f = ServedFacts {
            vm: "p-1".into(),
            recorded: Some(minted(50, 300)),
            times: times(50, Some(2_500)),
            job: Some(job(0, Some(4_000), None)),
        };
        let u = served_updates(&[f]);
        assert_eq!(u.len(), 1);
        let u = &u[0];
        assert_eq!(u.vm, "p-1");
        assert_eq!(u.status.job_id, Some(42));
        assert_eq!(u.status.run_id, Some(7));
        assert_eq!(u.status.repository.as_deref(), Some("acme/app"));
        assert_eq!(u.status.minted_time, Some(MicroTime(t(300))));
        assert_eq!(u.status.picked_up_time, Some(MicroTime(t(4_000))));
        // Scheduling finished before the mint: it took none of the job's time beyond the mint.
        assert_eq!(
            ms(&u.phases),
            vec![
                ("vm_create", 50),
                ("mint", 250),
                ("schedule", 0),
                ("boot", 1_850),
                ("runner_start", 350),
                ("pickup", 1_500),
            ]
        );
        let sum: Duration = u.phases.iter().map(|(_, d)| *d).sum();
        assert_eq!(u.wait, Some(Duration::from_millis(4_000)));
        assert_eq!(sum, u.wait.unwrap());
    }

    #[test]
    fn a_clone_s_restore_and_reidentify_are_taken_off_the_end_of_its_boot() {
        // Queued at 0, created 50, minted 300, scheduled 150, booted 2150 (of which the clone's
        // restore took 30 ms and its reidentify 5 ms), runner 2500, picked up 4000.
        let mut times = times(50, Some(2_500));
        times.clone_start = Some(CloneTimes {
            restore: Duration::from_millis(30),
            reidentify: Duration::from_millis(5),
        });
        let f = ServedFacts {
            vm: "p-1".into(),
            recorded: Some(minted(50, 300)),
            times,
            job: Some(job(0, Some(4_000), None)),
        };
        let u = &served_updates(&[f])[0];
        assert_eq!(
            ms(&u.phases),
            vec![
                ("vm_create", 50),
                ("mint", 250),
                ("schedule", 0),
                ("boot", 1_815),
                ("restore", 30),
                ("reidentify", 5),
                ("runner_start", 350),
                ("pickup", 1_500),
            ]
        );
        let sum: Duration = u.phases.iter().map(|(_, d)| *d).sum();
        assert_eq!(sum, u.wait.unwrap());
        // In JOB_PHASES order.
        let order: Vec<usize> = u
            .phases
            .iter()
            .map(|(p, _)| JOB_PHASES.iter().position(|q| q == p).unwrap())
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
    }

    #[test]
    fn a_clone_s_phases_count_only_what_the_job_waited_for() {
        let c = Some(CloneTimes {
            restore: Duration::from_millis(30),
            reidentify: Duration::from_millis(5),
        });
        let d = Duration::from_millis;
        // The job was queued 20 ms before the clone was Running: 5 ms reidentify, 15 of restore.
        assert_eq!(
            ms(&clone_phases(vec![("boot", d(20)), ("pickup", d(7))], c)),
            vec![
                ("boot", 0),
                ("restore", 15),
                ("reidentify", 5),
                ("pickup", 7)
            ]
        );
        // A warm clone: its boot took none of the job's time, nor do its parts.
        assert_eq!(
            ms(&clone_phases(vec![("boot", d(0))], c)),
            vec![("boot", 0), ("restore", 0), ("reidentify", 0)]
        );
        // A boot is left as it is.
        assert_eq!(
            ms(&clone_phases(vec![("boot", d(20))], None)),
            vec![("boot", 20)]
        );
    }

    #[test]
    fn a_warm_runner_makes_the_whole_wait_pickup() {
        let f = ServedFacts {
            vm: "p-1".into(),
            recorded: Some(minted(-60_000, -59_000)),
            times: times(-60_000, Some(-50_000)),
            job: Some(job(0, Some(800), None)),
        };
        let u = served_updates(&[f]);
        let p = ms(&u[0].phases);
        assert!(p.iter().all(|(phase, d)| *d == 0 || *phase == "pickup"));
        assert!(p.contains(&("pickup", 800)));
        assert_eq!(u[0].wait, Some(Duration::from_millis(800)));
    }

    #[test]
    fn nothing_is_recorded_before_the_runner_started_or_without_a_job() {
        let waiting = ServedFacts {
            vm: "p-1".into(),
            recorded: Some(minted(0, 10)),
            times: times(0, None),
            job: Some(job(0, Some(900), None)),
        };
        let idle = ServedFacts {
            job: None,
            times: times(0, Some(500)),
            ..waiting.clone()
        };
        assert!(served_updates(&[waiting.clone(), idle]).is_empty());
        // A job that completed is recorded even if the runner's start was never seen.
        let done = ServedFacts {
            job: Some(job(0, Some(900), Some(5_000))),
            ..waiting
        };
        let u = served_updates(&[done]);
        assert_eq!(u[0].status.completed_time, Some(MicroTime(t(5_000))));
        // The runner step is missing: its time falls to the pickup.
        assert!(!u[0].phases.iter().any(|(p, _)| *p == "runner_start"));
    }

    #[test]
    fn a_recorded_job_is_kept_filled_in_and_observed_once() {
        let first = ServedFacts {
            vm: "p-1".into(),
            recorded: Some(minted(0, 10)),
            times: times(0, Some(2_500)),
            job: Some(job(0, Some(3_000), None)),
        };
        let u = served_updates(std::slice::from_ref(&first));
        let recorded = u[0].status.clone();
        // Written: the next pass has nothing to do.
        let again = ServedFacts {
            recorded: Some(recorded.clone()),
            ..first.clone()
        };
        assert!(served_updates(std::slice::from_ref(&again)).is_empty());
        // Completion arrives: filled in, no phase observed again.
        let done = ServedFacts {
            job: Some(job(0, Some(3_000), Some(9_000))),
            ..again.clone()
        };
        let u = served_updates(&[done]);
        assert_eq!(u[0].status.completed_time, Some(MicroTime(t(9_000))));
        assert!(u[0].phases.is_empty() && u[0].wait.is_none());
        // After a restart the demand's times are younger: the record keeps the first ones.
        let restarted = ServedFacts {
            job: Some(job(60_000, Some(61_000), None)),
            ..again
        };
        assert!(served_updates(&[restarted]).is_empty());
        // Another job id never replaces the VM's record.
        let other = ServedFacts {
            job: Some(ServedJob {
                id: 43,
                ..job(0, Some(3_000), None)
            }),
            recorded: Some(recorded),
            ..first
        };
        assert!(served_updates(&[other]).is_empty());
    }

    #[test]
    fn phases_need_a_queued_time_and_skip_missing_steps() {
        assert!(job_phases(&[None, Some(t(5))]).is_empty());
        let p = job_phases(&[Some(t(0)), None, Some(t(100)), Some(t(50))]);
        assert_eq!(ms(&p), vec![("mint", 100), ("schedule", 0)]);
        assert_eq!(run_phase(t(10), t(5)), Duration::ZERO);
        assert_eq!(run_phase(t(10), t(1_010)), Duration::from_secs(1));
    }
}
