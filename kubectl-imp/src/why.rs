//! `kubectl imp why JOB|VM`: how long a job waited in each SLO phase Imp records (`status.job` of the
//! VM that served it; the phases of `imp_runner_job_phase_seconds`), which phase took longest, and the
//! likely cause. A VM without a recorded job (an idle runner, or one still on its way) is explained
//! from its own step times: which step it is waiting for, and since when.

use imp_api::{ImpVM, ServedJobStatus, VmPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time};
use serde::Serialize;

use crate::output::columns;
use crate::time::human;

/// The job's steps in order, and the phase that ends at each (operator/src/runnerpool/slo.rs).
const STEPS: [(&str, &str); 7] = [
    ("vm_create", "VM created"),
    ("mint", "JIT config minted"),
    ("schedule", "scheduled onto a node"),
    ("boot", "guest booted"),
    ("runner_start", "runner online"),
    ("pickup", "job picked up"),
    ("run", "job completed"),
];

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PhaseWait {
    pub phase: &'static str,
    /// The step that ends the phase.
    pub until: &'static str,
    pub seconds: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Why {
    pub vm: String,
    pub namespace: String,
    pub pool: Option<String>,
    pub job_id: Option<i64>,
    pub repository: Option<String>,
    /// Queued -> picked up.
    pub waited_s: Option<f64>,
    pub phases: Vec<PhaseWait>,
    /// The longest of the waiting phases (`run` is the job itself, not a wait).
    pub slowest: Option<&'static str>,
    pub cause: String,
}

fn micro(t: &Option<MicroTime>) -> Option<f64> {
    t.as_ref().map(|t| t.0.as_nanosecond() as f64 / 1e9)
}

fn time(t: &Option<Time>) -> Option<f64> {
    t.as_ref().map(|t| t.0.as_nanosecond() as f64 / 1e9)
}

fn condition_true<'c>(conditions: &'c [Condition], kind: &str) -> Option<&'c Condition> {
    conditions
        .iter()
        .find(|c| c.type_ == kind && c.status == "True")
}

/// The per-phase wait of a served job: each step clamped to be no earlier than the queued time and
/// the steps before it (a step before the job was queued did not delay it), a missing step skipped.
pub fn phase_waits(job: &ServedJobStatus) -> Vec<PhaseWait> {
    let steps = [
        micro(&job.vm_created_time),
        micro(&job.minted_time),
        micro(&job.scheduled_time),
        micro(&job.booted_time),
        micro(&job.runner_started_time),
        micro(&job.picked_up_time),
        micro(&job.completed_time),
    ];
    let mut prev = micro(&job.queued_time);
    STEPS
        .iter()
        .zip(steps)
        .map(|(&(phase, until), t)| {
            let seconds = match (prev, t) {
                (Some(p), Some(t)) => Some((t.max(p) - p).max(0.0)),
                _ => None,
            };
            if let Some(t) = t {
                prev = Some(prev.map_or(t, |p| p.max(t)));
            }
            PhaseWait {
                phase,
                until,
                seconds,
            }
        })
        .collect()
}

/// The likely cause of a slow `phase`, sharpened by what the pool and the VM say.
fn cause(phase: &str, vm: &ImpVM, pool_conditions: &[Condition]) -> String {
    let reason = vm.status.as_ref().and_then(|s| s.reason.clone());
    let pool_says = |kind: &str| {
        condition_true(pool_conditions, kind).map(|c| format!(" (pool: {kind}: {})", c.message))
    };
    match phase {
        "vm_create" => format!(
            "no capacity: no warm runner was idle and the pool created a VM only after the job \
             was queued (minIdle, maxRunners, scaleUpStep){}",
            pool_says("AtCapacity")
                .or_else(|| pool_says("ScalingLimited"))
                .unwrap_or_default()
        ),
        "mint" => {
            let creds = pool_conditions
                .iter()
                .find(|c| c.type_ == "CredentialsValid" && c.status == "False")
                .map(|c| format!(" (pool: CredentialsValid=False: {})", c.message))
                .unwrap_or_default();
            format!("mint errors: GitHub was slow or failing to mint the JIT config{creds}")
        }
        "schedule" => "no node with room: scheduling waited for free vCPU/memory on a Ready node \
                       with a fresh heartbeat (kubectl imp status shows the nodes)"
            .to_owned(),
        "boot" => format!(
            "slow boot: a cold boot (rootfs built from the image, then the kernel) took longest{}",
            reason
                .map(|r| format!("; VM reason {r}"))
                .unwrap_or_default()
        ),
        "runner_start" => "runner never (or late) online: the guest booted but the runner took \
                           long to start and register (kubectl imp console VM shows its output)"
            .to_owned(),
        "pickup" => "GitHub took long to hand the job to an online runner (labels, runner group, \
                     or a warm runner was there and GitHub was slow)"
            .to_owned(),
        _ => String::new(),
    }
}

/// Explains `vm` at `now` (Unix seconds).
pub fn explain(vm: &ImpVM, pool_conditions: &[Condition], now: f64) -> Why {
    let name = vm.metadata.name.clone().unwrap_or_default();
    let namespace = vm.metadata.namespace.clone().unwrap_or_default();
    let pool = vm
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(imp_api::names::LABEL_RUNNER_POOL).cloned());
    let status = vm.status.clone().unwrap_or_default();
    if let Some(job) = status.job.as_ref().filter(|j| j.queued_time.is_some()) {
        let phases = phase_waits(job);
        let slowest = phases
            .iter()
            .filter(|p| p.phase != "run")
            .filter_map(|p| p.seconds.map(|s| (p.phase, s)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(p, _)| p);
        let waited_s = match (micro(&job.queued_time), micro(&job.picked_up_time)) {
            (Some(q), Some(p)) => Some((p - q).max(0.0)),
            _ => None,
        };
        let cause = match (slowest, waited_s) {
            (_, None) => format!(
                "not picked up yet: waiting for {} since it was queued {} ago",
                phases
                    .iter()
                    .find(|p| p.seconds.is_none())
                    .map_or("the next step", |p| p.until),
                human(now - micro(&job.queued_time).unwrap_or(now))
            ),
            (Some(p), Some(_)) => cause(p, vm, pool_conditions),
            (None, Some(_)) => String::new(),
        };
        return Why {
            vm: name,
            namespace,
            pool,
            job_id: job.job_id,
            repository: job.repository.clone(),
            waited_s,
            phases,
            slowest,
            cause,
        };
    }
    // No job on record: the VM's own steps since it was created.
    let created = time(&vm.metadata.creation_timestamp);
    let runner = status.runner.clone().unwrap_or_default();
    let steps = [
        (
            "mint",
            "JIT config minted",
            vm.spec.runner_config_secret.as_ref().and(created),
        ),
        (
            "schedule",
            "scheduled onto a node",
            time(&status.scheduled_time),
        ),
        ("boot", "guest booted", time(&status.boot_complete_time)),
        ("runner_start", "runner online", time(&runner.started_time)),
    ];
    let mut prev = created;
    let phases: Vec<PhaseWait> = steps
        .iter()
        .map(|&(phase, until, t)| {
            let seconds = match (prev, t) {
                (Some(p), Some(t)) => Some((t - p).max(0.0)),
                _ => None,
            };
            prev = t.or(prev);
            PhaseWait {
                phase,
                until,
                seconds,
            }
        })
        .collect();
    let failed = matches!(
        status.phase,
        Some(VmPhase::Failed | VmPhase::RetryExhausted)
    );
    let waiting = phases.iter().find(|p| p.seconds.is_none());
    let cause = if failed {
        format!(
            "the VM failed: {} {}",
            status.reason.clone().unwrap_or_default(),
            status.message.clone().unwrap_or_default()
        )
    } else if let Some(w) = waiting {
        let since = human(now - prev.unwrap_or(now));
        format!(
            "no job recorded; waiting for {} for {since}: {}",
            w.until,
            cause(w.phase, vm, pool_conditions)
        )
    } else {
        "no job recorded: an idle runner, online and waiting for a job".to_owned()
    };
    let slowest = phases
        .iter()
        .filter_map(|p| p.seconds.map(|s| (p.phase, s)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(p, _)| p);
    Why {
        vm: name,
        namespace,
        pool,
        job_id: None,
        repository: None,
        waited_s: None,
        phases,
        slowest,
        cause,
    }
}

impl Why {
    pub fn table(&self) -> String {
        let mut out = format!(
            "VM {}/{}{}{}\n",
            self.namespace,
            self.vm,
            self.pool
                .as_ref()
                .map(|p| format!(" (pool {p})"))
                .unwrap_or_default(),
            self.job_id
                .map(|j| format!(
                    ", job {j}{}",
                    self.repository
                        .as_ref()
                        .map(|r| format!(" of {r}"))
                        .unwrap_or_default()
                ))
                .unwrap_or_default()
        );
        let mut rows = vec![[
            "PHASE".to_owned(),
            "UNTIL".to_owned(),
            "WAIT".to_owned(),
            String::new(),
        ]];
        for p in &self.phases {
            rows.push([
                p.phase.to_owned(),
                p.until.to_owned(),
                p.seconds.map_or("-".to_owned(), human),
                if Some(p.phase) == self.slowest {
                    "<- slowest".to_owned()
                } else {
                    String::new()
                },
            ]);
        }
        out.push_str(&columns(&rows));
        if let Some(w) = self.waited_s {
            out.push_str(&format!("waited (queued -> picked up): {}\n", human(w)));
        }
        if let Some(s) = self.slowest {
            out.push_str(&format!("slowest phase: {s}\n"));
        }
        out.push_str(&format!("likely cause: {}\n", self.cause));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(s: i64) -> Option<MicroTime> {
        Some(MicroTime(
            Timestamp::from_second(1_800_000_000 + s).unwrap(),
        ))
    }

    fn served(steps: [i64; 8]) -> ServedJobStatus {
        ServedJobStatus {
            job_id: Some(42),
            queued_time: at(steps[0]),
            vm_created_time: at(steps[1]),
            minted_time: at(steps[2]),
            scheduled_time: at(steps[3]),
            booted_time: at(steps[4]),
            runner_started_time: at(steps[5]),
            picked_up_time: at(steps[6]),
            completed_time: at(steps[7]),
            ..Default::default()
        }
    }

    fn vm_with(job: ServedJobStatus) -> ImpVM {
        let mut vm = ImpVM::new(
            "vm-1",
            serde_json::from_value(serde_json::json!({
            "classRef": {"name": "c"}, "image": "i", "lifecycle": "ephemeral"}))
            .unwrap(),
        );
        vm.metadata.namespace = Some("ns".into());
        vm.status = Some(imp_api::ImpVMStatus {
            job: Some(job),
            ..Default::default()
        });
        vm
    }

    #[test]
    fn a_cold_boot_is_the_slowest_phase_of_a_job_that_waited_for_it() {
        // Queued at 0; VM created 1 s later, minted, scheduled, 40 s of boot, runner at 45, pickup 47.
        let why = explain(&vm_with(served([0, 1, 2, 3, 43, 45, 47, 100])), &[], 0.0);
        assert_eq!(why.slowest, Some("boot"));
        assert_eq!(why.waited_s, Some(47.0));
        assert!(why.cause.starts_with("slow boot"), "{}", why.cause);
        let boot = why.phases.iter().find(|p| p.phase == "boot").unwrap();
        assert_eq!(boot.seconds, Some(40.0));
        assert!(why.table().contains("slowest phase: boot"));
    }

    #[test]
    fn steps_before_the_job_was_queued_did_not_delay_it() {
        // A warm runner: every VM step happened before the job was queued at 100.
        let why = explain(&vm_with(served([100, 1, 2, 3, 40, 45, 103, 150])), &[], 0.0);
        let secs: Vec<_> = why.phases.iter().map(|p| p.seconds).collect();
        assert_eq!(
            secs,
            [
                Some(0.0),
                Some(0.0),
                Some(0.0),
                Some(0.0),
                Some(0.0),
                Some(3.0),
                Some(47.0)
            ]
        );
        assert_eq!(why.slowest, Some("pickup"));
    }

    #[test]
    fn a_job_still_waiting_names_the_step_it_waits_for() {
        let mut job = served([0, 1, 2, 3, 0, 0, 0, 0]);
        job.booted_time = None;
        job.runner_started_time = None;
        job.picked_up_time = None;
        job.completed_time = None;
        let now = 1_800_000_000.0 + 90.0;
        let why = explain(&vm_with(job), &[], now);
        assert_eq!(why.waited_s, None);
        assert!(
            why.cause.contains("guest booted") && why.cause.contains("1m30s"),
            "{}",
            why.cause
        );
    }

    #[test]
    fn mint_waits_name_the_pools_credentials_condition() {
        let cond = Condition {
            type_: "CredentialsValid".into(),
            status: "False".into(),
            message: "401 Bad credentials".into(),
            reason: "GithubAuthFailed".into(),
            last_transition_time: Time(Timestamp::UNIX_EPOCH),
            observed_generation: None,
        };
        let why = explain(
            &vm_with(served([0, 1, 61, 62, 63, 64, 65, 70])),
            &[cond],
            0.0,
        );
        assert_eq!(why.slowest, Some("mint"));
        assert!(why.cause.contains("401 Bad credentials"), "{}", why.cause);
    }
}
