//! The intake's pure decisions: what a queue message changes in the ledger and which jobs to
//! acquire ([`plan_message`]), what an acquire answer confirms ([`confirm_acquired`]), how to
//! recover from a failed call ([`recovery`]), the capacity reported to GitHub ([`max_capacity`])
//! and the pool demand a ledger stands for ([`demand_updates`]).

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use super::client::{JobMessage, Message};
use super::error::{Call, ScaleSetError};
use super::ledger::{Ledger, LedgerEntry, LedgerState};
use crate::runnerpool::demand::{JobState, JobUpdate};
use crate::runnerpool::labels::pool_serves;

/// What to do with one queue message, in this order: write `ledger`, acquire `acquire`, then
/// delete the message. Writing first makes a redelivery (or a restart before the delete) find the
/// decision already taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagePlan {
    pub ledger: Vec<(i64, LedgerEntry)>,
    pub acquire: Vec<i64>,
    /// Available jobs the pool's labels do not serve (left to GitHub).
    pub not_served: Vec<i64>,
    pub ack: u64,
}

fn entry_from(base: &super::client::JobBase, state: LedgerState, now: i64) -> LedgerEntry {
    let repository = if base.owner_name.is_empty() {
        base.repository_name.clone()
    } else {
        format!("{}/{}", base.owner_name, base.repository_name)
    };
    LedgerEntry {
        state,
        job_id: base.job_id.clone(),
        repository,
        labels: base.request_labels.clone(),
        run_id: base.workflow_run_id,
        runner_name: None,
        result: None,
        queued_at: real_time(&base.queue_time),
        started_at: None,
        completed_at: None,
        updated: now,
    }
}

/// GitHub writes `0001-01-01T00:00:00Z` for a time that has not happened.
fn real_time(t: &Option<String>) -> Option<String> {
    t.clone().filter(|t| !t.starts_with("0001-"))
}

/// Folds one message into the ledger. `serves` are the labels the pool's runners carry (the pool's
/// labels and the scale set's name).
pub fn plan_message(ledger: &Ledger, msg: &Message, serves: &[String], now: i64) -> MessagePlan {
    // Later job messages of the same message see the earlier ones' effect.
    let mut view = ledger.clone();
    let mut changes: Vec<(i64, LedgerEntry)> = Vec::new();
    let mut acquire = Vec::new();
    let mut not_served = Vec::new();
    for job in &msg.jobs {
        let base = job.base();
        let id = base.runner_request_id;
        let current = view.get(id).cloned();
        let next = match job {
            JobMessage::JobAvailable { .. } => match &current {
                // New, or seen before the acquire's outcome was recorded: (re)acquire. GitHub
                // answers an acquire of a job already ours with nothing; JobAssigned confirms it.
                None
                | Some(LedgerEntry {
                    state: LedgerState::Available,
                    ..
                }) => {
                    if !pool_serves(&base.request_labels, serves) {
                        not_served.push(id);
                        continue;
                    }
                    acquire.push(id);
                    current.or_else(|| Some(entry_from(base, LedgerState::Available, now)))
                }
                Some(_) => None,
            },
            JobMessage::JobAssigned { .. } => advance(current, base, LedgerState::Acquired, now),
            JobMessage::JobStarted { runner_name, .. } => {
                advance(current, base, LedgerState::Started, now).map(|mut e| {
                    e.runner_name = Some(runner_name.clone());
                    e.started_at = real_time(&base.runner_assign_time);
                    e
                })
            }
            JobMessage::JobCompleted {
                result,
                runner_name,
                ..
            } => advance(current, base, LedgerState::Completed, now).map(|mut e| {
                if !runner_name.is_empty() {
                    e.runner_name = Some(runner_name.clone());
                }
                e.result = Some(result.clone());
                e.completed_at = real_time(&base.finish_time);
                e
            }),
        };
        if let Some(e) = next
            && view.get(id) != Some(&e)
        {
            view.apply(&[(id, e.clone())]);
            changes.retain(|(i, _)| *i != id);
            changes.push((id, e));
        }
    }
    acquire.dedup();
    MessagePlan {
        ledger: changes,
        acquire,
        not_served,
        ack: msg.id,
    }
}

/// The entry moved forward to `to`, or None when it is there or beyond already.
fn advance(
    current: Option<LedgerEntry>,
    base: &super::client::JobBase,
    to: LedgerState,
    now: i64,
) -> Option<LedgerEntry> {
    match current {
        Some(e) if e.state >= to => None,
        Some(mut e) => {
            e.state = to;
            e.updated = now;
            Some(e)
        }
        None => Some(entry_from(base, to, now)),
    }
}

/// The entries an acquire answer confirms as ours (Available -> Acquired).
pub fn confirm_acquired(ledger: &Ledger, acquired: &[i64], now: i64) -> Vec<(i64, LedgerEntry)> {
    acquired
        .iter()
        .filter_map(|id| {
            let e = ledger.get(*id)?;
            (e.state == LedgerState::Available).then(|| {
                let mut e = e.clone();
                e.state = LedgerState::Acquired;
                e.updated = now;
                (*id, e)
            })
        })
        .collect()
}

/// How the intake goes on after a failed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    pub wait: Duration,
    /// Start over from the admin connection (a token was refused).
    pub reconnect: bool,
    /// Open a new session (the old one is gone or never opened).
    pub new_session: bool,
    /// Refresh the session (`PATCH`: a new queue token) before going on: the queue refused its
    /// token (401). Opening a new one instead would meet the old one's 409 until it expires.
    pub refresh_session: bool,
    /// The pool condition reason while this lasts.
    pub reason: &'static str,
}

/// Backoff for the `attempt`th consecutive failure (0-based): doubling from 1 s to 60 s. A session
/// conflict waits for the other session to expire, from 5 s up to 60 s, never a tight loop.
pub fn recovery(err: &ScaleSetError, attempt: u32) -> Recovery {
    let exp = |base: u64| Duration::from_secs((base << attempt.min(6)).min(60));
    match err {
        ScaleSetError::SessionConflict { .. } => Recovery {
            wait: exp(5),
            reconnect: false,
            new_session: true,
            refresh_session: false,
            reason: REASON_SESSION_CONFLICT,
        },
        // The queue token expired: refresh the session at once (a second 401 in a row waits).
        ScaleSetError::Unauthorized {
            call: Call::GetMessage | Call::DeleteMessage | Call::AcquireJobs,
        } => Recovery {
            wait: if attempt == 0 { Duration::ZERO } else { exp(1) },
            reconnect: false,
            new_session: false,
            refresh_session: true,
            reason: REASON_UNAUTHORIZED,
        },
        // The admin token was refused: a new one; the session (if any) is kept.
        ScaleSetError::Unauthorized { .. } => Recovery {
            wait: exp(1),
            reconnect: true,
            new_session: false,
            refresh_session: false,
            reason: REASON_UNAUTHORIZED,
        },
        ScaleSetError::RunnerVersionDeprecated { .. } => Recovery {
            wait: Duration::from_secs(300),
            reconnect: true,
            new_session: true,
            refresh_session: false,
            reason: REASON_RUNNER_VERSION_DEPRECATED,
        },
        ScaleSetError::NotFound { .. } => Recovery {
            wait: exp(2),
            reconnect: true,
            new_session: true,
            refresh_session: false,
            reason: REASON_NOT_FOUND,
        },
        ScaleSetError::Github(_) | ScaleSetError::InvalidRequest(_) => Recovery {
            wait: exp(5),
            reconnect: true,
            new_session: true,
            refresh_session: false,
            reason: REASON_GITHUB_ERROR,
        },
        ScaleSetError::Ledger(_) => Recovery {
            wait: exp(1),
            reconnect: false,
            new_session: false,
            refresh_session: false,
            reason: REASON_LEDGER,
        },
        _ => Recovery {
            wait: exp(1),
            reconnect: false,
            new_session: false,
            refresh_session: false,
            reason: REASON_GITHUB_ERROR,
        },
    }
}

pub const REASON_SESSION_CONFLICT: &str = "SessionConflict";
pub const REASON_UNAUTHORIZED: &str = "Unauthorized";
pub const REASON_RUNNER_VERSION_DEPRECATED: &str =
    imp_api::names::reason::RUNNER_VERSION_DEPRECATED;
pub const REASON_NOT_FOUND: &str = "ScaleSetNotFound";
pub const REASON_GITHUB_ERROR: &str = "GitHubError";
pub const REASON_LEDGER: &str = "LedgerWriteFailed";
pub const REASON_LISTENING: &str = "Listening";

/// Beyond the poll window, how long a session may hear nothing before it counts as deaf.
pub const DEAF_GRACE: Duration = Duration::from_secs(15);

/// How long a session has been deaf, if it is: nothing heard (`last_heard`, the last answered
/// poll, else the intake's start) for longer than `bound`.
pub fn deaf_for(
    last_heard: Option<std::time::Instant>,
    started: std::time::Instant,
    now: std::time::Instant,
    bound: Duration,
) -> Option<Duration> {
    let silent = now.saturating_duration_since(last_heard.unwrap_or(started).max(started));
    (silent > bound).then_some(silent)
}

/// What GitHub may assign at most (`X-ScaleSetMaxCapacity`): `maxRunners`, lowered to the VMs of
/// the pool's class the nodes can host (`node_slots`, [`node_slots`]) when that is known.
pub fn max_capacity(max_runners: u32, node_slots: Option<u32>) -> u32 {
    node_slots.map_or(max_runners, |slots| max_runners.min(slots))
}

/// How many VMs of `req` (the pool's class, node selector and tolerations) the nodes can host,
/// from their published capacity (`imp.dev/capacity-*` annotations, else allocatable): per
/// eligible node (labelled `imp/enabled=true`, Ready, schedulable, matching the selector, every
/// NoSchedule/NoExecute taint tolerated) the VMs that fit its CPU, memory and disk, summed. None
/// when no node is Imp-enabled at all: nothing is published to judge by.
pub fn node_slots(
    nodes: &[crate::scheduler::NodeInfo],
    req: &crate::scheduler::VmRequest,
) -> Option<u32> {
    use imp_api::names::LABEL_NODE_ENABLED;
    let enabled: Vec<_> = nodes
        .iter()
        .filter(|n| n.labels.get(LABEL_NODE_ENABLED).map(String::as_str) == Some("true"))
        .collect();
    if enabled.is_empty() {
        return None;
    }
    let per = |have: u64, need: u64| have.checked_div(need).unwrap_or(u64::MAX);
    let total: u64 = enabled
        .iter()
        .filter(|n| n.ready && !n.unschedulable)
        .filter(|n| {
            req.node_selector
                .iter()
                .all(|(k, v)| n.labels.get(k) == Some(v))
        })
        .filter(|n| {
            n.taints
                .iter()
                .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
                .all(|t| req.tolerations.iter().any(|tol| imp_api::tolerates(tol, t)))
        })
        .filter_map(|n| n.capacity)
        .map(|c| {
            let cpu = per(c.millicpu, u64::from(req.vcpu) * 1000);
            let mem = per(c.memory_mib, req.memory_mib);
            let disk = c.disk_mib.map_or(u64::MAX, |d| per(d, req.disk_mib));
            cpu.min(mem).min(disk)
        })
        .fold(0u64, |a, b| a.saturating_add(b));
    Some(u32::try_from(total).unwrap_or(u32::MAX))
}

/// The pool demand the ledger stands for, as job updates keyed by the workflow job id (the sweep
/// and webhooks name the same job by it, so the demand counts it once). Available entries are not
/// demand yet: they are ours only once acquired.
pub fn demand_updates(ledger: &Ledger) -> Vec<JobUpdate> {
    ledger
        .entries
        .iter()
        .filter(|(_, e)| e.state != LedgerState::Available)
        .map(|(rid, e)| {
            let state = match e.state {
                LedgerState::Available | LedgerState::Acquired => JobState::Queued,
                LedgerState::Started => JobState::InProgress,
                LedgerState::Completed => JobState::Completed,
            };
            let parse = |t: &Option<String>| t.as_deref().and_then(|t| t.parse::<Timestamp>().ok());
            let since = match e.state {
                LedgerState::Started => parse(&e.started_at),
                LedgerState::Completed => parse(&e.completed_at),
                _ => parse(&e.queued_at),
            };
            JobUpdate {
                id: job_key(&e.job_id, *rid),
                state,
                repository: e.repository.clone(),
                labels: e.labels.clone(),
                runner_name: e.runner_name.clone(),
                run_id: e.run_id.and_then(|r| u64::try_from(r).ok()),
                since,
                created_at: parse(&e.queued_at),
            }
        })
        .collect()
}

/// The demand key of a job: its workflow job id when numeric; else the request id moved into the
/// top half of the id space, apart from GitHub's job ids.
pub fn job_key(job_id: &str, runner_request_id: i64) -> u64 {
    job_id
        .parse::<u64>()
        .unwrap_or((1 << 63) | (runner_request_id as u64 & ((1 << 63) - 1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scaleset::client::{JobBase, Statistics};

    fn base(rid: i64, labels: &[&str]) -> JobBase {
        JobBase {
            runner_request_id: rid,
            repository_name: "repo".into(),
            owner_name: "octo".into(),
            job_id: format!("{}", rid + 100),
            workflow_run_id: Some(9),
            request_labels: labels.iter().map(|s| s.to_string()).collect(),
            queue_time: Some("2026-12-03T10:00:00Z".into()),
            runner_assign_time: Some("0001-01-01T00:00:00Z".into()),
            finish_time: None,
        }
    }

    fn avail(rid: i64) -> JobMessage {
        JobMessage::JobAvailable {
            base: base(rid, &["set"]),
        }
    }

    fn msg(id: u64, jobs: Vec<JobMessage>) -> Message {
        Message {
            id,
            statistics: Statistics::default(),
            jobs,
        }
    }

    fn serves() -> Vec<String> {
        vec!["set".into()]
    }

    fn applied(ledger: &mut Ledger, p: &MessagePlan) {
        ledger.apply(&p.ledger);
    }

    #[test]
    fn a_new_available_job_is_written_then_acquired() {
        let l = Ledger::default();
        let p = plan_message(&l, &msg(1, vec![avail(7)]), &serves(), 10);
        assert_eq!(p.acquire, [7]);
        assert_eq!(p.ack, 1);
        assert_eq!(p.ledger.len(), 1);
        assert_eq!(p.ledger[0].1.state, LedgerState::Available);
        assert_eq!(p.ledger[0].1.repository, "octo/repo");
    }

    #[test]
    fn a_redelivered_available_is_acquired_again_only_while_unconfirmed() {
        let mut l = Ledger::default();
        let first = plan_message(&l, &msg(1, vec![avail(7)]), &serves(), 10);
        applied(&mut l, &first);
        // Killed after the write, before the ack: the same message again.
        let again = plan_message(&l, &msg(1, vec![avail(7)]), &serves(), 11);
        assert_eq!(again.acquire, [7], "acquire is idempotent at GitHub");
        assert!(again.ledger.is_empty(), "nothing new to write");
        l.apply(&confirm_acquired(&l, &[7], 12));
        assert_eq!(l.get(7).unwrap().state, LedgerState::Acquired);
        let third = plan_message(&l, &msg(1, vec![avail(7)]), &serves(), 13);
        assert!(third.acquire.is_empty() && third.ledger.is_empty());
    }

    #[test]
    fn jobs_the_pool_does_not_serve_are_neither_acquired_nor_written() {
        let j = JobMessage::JobAvailable {
            base: base(3, &["gpu"]),
        };
        let p = plan_message(&Ledger::default(), &msg(1, vec![j]), &serves(), 0);
        assert!(p.acquire.is_empty() && p.ledger.is_empty());
        assert_eq!(p.not_served, [3]);
    }

    #[test]
    fn states_only_move_forward_and_started_binds_the_runner() {
        let mut l = Ledger::default();
        let started = JobMessage::JobStarted {
            base: base(7, &["set"]),
            runner_name: "pool-abc".into(),
        };
        let assigned = JobMessage::JobAssigned {
            base: base(7, &["set"]),
        };
        let done = JobMessage::JobCompleted {
            base: base(7, &["set"]),
            result: "succeeded".into(),
            runner_name: "pool-abc".into(),
        };
        let p = plan_message(
            &l,
            &msg(2, vec![avail(7), assigned.clone(), started.clone()]),
            &serves(),
            5,
        );
        assert_eq!(p.ledger.len(), 1, "one entry per job, its last state");
        applied(&mut l, &p);
        let e = l.get(7).unwrap();
        assert_eq!(e.state, LedgerState::Started);
        assert_eq!(e.runner_name.as_deref(), Some("pool-abc"));
        assert_eq!(e.started_at, None, "GitHub's zero time is no time");
        // A late JobAssigned (reordered redelivery) does not move it back.
        let late = plan_message(&l, &msg(3, vec![assigned, avail(7)]), &serves(), 6);
        assert!(late.ledger.is_empty() && late.acquire.is_empty());
        let p = plan_message(&l, &msg(4, vec![done]), &serves(), 7);
        applied(&mut l, &p);
        assert_eq!(l.get(7).unwrap().state, LedgerState::Completed);
        assert_eq!(l.get(7).unwrap().result.as_deref(), Some("succeeded"));
    }

    #[test]
    fn a_job_first_seen_started_is_recorded_without_an_acquire() {
        // Its JobAvailable was acknowledged by an earlier holder whose ledger write we read.
        let started = JobMessage::JobStarted {
            base: base(8, &["set"]),
            runner_name: "r".into(),
        };
        let p = plan_message(&Ledger::default(), &msg(1, vec![started]), &serves(), 0);
        assert!(p.acquire.is_empty());
        assert_eq!(p.ledger[0].1.state, LedgerState::Started);
    }

    #[test]
    fn conflicts_back_off_and_never_spin() {
        let c = ScaleSetError::SessionConflict {
            message: "active session".into(),
        };
        let waits: Vec<u64> = (0..8).map(|a| recovery(&c, a).wait.as_secs()).collect();
        assert_eq!(waits, [5, 10, 20, 40, 60, 60, 60, 60]);
        assert!(recovery(&c, 0).new_session && !recovery(&c, 0).reconnect);
        // A 401 on the queue refreshes the session in place (no new session: it would conflict
        // with the old one), at once the first time.
        let u = ScaleSetError::Unauthorized {
            call: Call::GetMessage,
        };
        let r = recovery(&u, 0);
        assert!(r.refresh_session && !r.new_session && !r.reconnect, "{r:?}");
        assert_eq!((r.wait, r.reason), (Duration::ZERO, REASON_UNAUTHORIZED));
        assert_eq!(recovery(&u, 1).wait, Duration::from_secs(2));
        // A 401 on an admin call: a new admin token, the session kept.
        let a = recovery(
            &ScaleSetError::Unauthorized {
                call: Call::CreateSession,
            },
            0,
        );
        assert!(a.reconnect && !a.new_session && !a.refresh_session, "{a:?}");
    }

    #[test]
    fn a_session_is_deaf_once_it_heard_nothing_for_longer_than_the_bound() {
        use std::time::Instant;
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let bound = Duration::from_secs(65);
        assert_eq!(deaf_for(None, t0, at(65), bound), None, "not yet");
        assert_eq!(
            deaf_for(None, t0, at(66), bound),
            Some(Duration::from_secs(66)),
            "never heard since the start"
        );
        assert_eq!(deaf_for(Some(at(100)), t0, at(160), bound), None);
        assert_eq!(
            deaf_for(Some(at(100)), t0, at(170), bound),
            Some(Duration::from_secs(70))
        );
        // A poll answered again: heard.
        assert_eq!(deaf_for(Some(at(169)), t0, at(170), bound), None);
    }

    #[test]
    fn capacity_is_bounded_by_the_pool_and_by_the_nodes() {
        assert_eq!(max_capacity(10, None), 10);
        assert_eq!(max_capacity(10, Some(3)), 3);
        assert_eq!(max_capacity(4, Some(30)), 4);
        assert_eq!(max_capacity(4, Some(0)), 0);
    }

    fn node(name: &str, cpu: u64, mem: u64, disk: Option<u64>) -> crate::scheduler::NodeInfo {
        crate::scheduler::NodeInfo {
            name: name.into(),
            labels: [("imp/enabled".to_string(), "true".to_string())].into(),
            ready: true,
            unschedulable: false,
            pressures: vec![],
            taints: vec![],
            heartbeat: crate::scheduler::Heartbeat::Fresh,
            capacity: Some(crate::scheduler::Capacity {
                millicpu: cpu * 1000,
                memory_mib: mem,
                disk_mib: disk,
            }),
            templates_ready: Default::default(),
        }
    }

    #[test]
    fn node_slots_sum_what_each_eligible_node_can_host_of_the_class() {
        use k8s_openapi::api::core::v1::{Taint, Toleration};
        let req = crate::scheduler::VmRequest {
            vcpu: 2,
            memory_mib: 2048,
            disk_mib: 4096,
            ..Default::default()
        };
        // 8 CPU / 8 GiB: 4 by CPU, 4 by memory; 16 CPU / 6 GiB: 3 by memory; disk 8 GiB: 2.
        let mut nodes = vec![
            node("a", 8, 8192, None),
            node("b", 16, 6144, None),
            node("c", 16, 16384, Some(8192)),
        ];
        assert_eq!(node_slots(&nodes, &req), Some(4 + 3 + 2));
        // Not Ready, cordoned, other selector, untolerated taint, unknown capacity: none.
        nodes[0].ready = false;
        nodes[1].unschedulable = true;
        assert_eq!(node_slots(&nodes, &req), Some(2));
        nodes[2].taints = vec![Taint {
            key: "gpu".into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        }];
        assert_eq!(node_slots(&nodes, &req), Some(0), "nothing can host it: 0");
        let tolerant = crate::scheduler::VmRequest {
            tolerations: vec![Toleration {
                key: Some("gpu".into()),
                operator: Some("Exists".into()),
                ..Default::default()
            }],
            ..req.clone()
        };
        assert_eq!(node_slots(&nodes, &tolerant), Some(2));
        let picky = crate::scheduler::VmRequest {
            node_selector: [("zone".to_string(), "x".to_string())].into(),
            ..tolerant
        };
        assert_eq!(node_slots(&nodes, &picky), Some(0));
        nodes[2].capacity = None;
        assert_eq!(node_slots(&nodes, &req), Some(0));
        // No Imp node at all: nothing published, the pool's maxRunners stands.
        for n in &mut nodes {
            n.labels.clear();
        }
        assert_eq!(node_slots(&nodes, &req), None);
    }

    #[test]
    fn the_ledger_becomes_demand_keyed_by_job_id() {
        let mut l = Ledger::default();
        let p = plan_message(&l, &msg(1, vec![avail(7), avail(8)]), &serves(), 0);
        applied(&mut l, &p);
        assert!(demand_updates(&l).is_empty(), "available is not ours yet");
        l.apply(&confirm_acquired(&l, &[7], 1));
        let d = demand_updates(&l);
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].id, d[0].state), (107, JobState::Queued));
        assert_eq!(job_key("not-a-number", 5), (1 << 63) | 5);
    }
}
