//! GitHub's runner scale-set protocol, as the simulator speaks it (docs/github.md, the simulator's scale-set section):
//! registration token -> `POST /actions/runner-registration` (`RemoteAuth`) -> the Actions service
//! URL and an admin token; scale sets (get by name, create), runner groups by name, one message
//! session per scale set (a second create while one is live answers 409), the long-polled message
//! queue (`X-ScaleSetMaxCapacity` recorded; a message is delivered again until deleted), acquire
//! jobs and `generatejitconfig`.
//!
//! [`ScaleSets`] is the state machine (pure, unit-tested below); the HTTP handlers are in
//! `server/scaleset.rs`, the state sits beside the model in `Shared` (locked after it).
//! Jobs enter it from the simulator's job model: [`ScaleSets::on_job`] is called for every job
//! change the model emits (queued, in_progress, completed) and turns a job whose `runs-on` labels a
//! scale set carries into that set's JobAvailable / JobStarted / JobCompleted messages; an acquire
//! emits JobAssigned. A runner registered through a scale set takes only jobs its set acquired, and
//! no other runner takes them ([`ScaleSets::runner_may_take`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Notify;

use super::jobs::{SimJob, random_token};
use super::model::{SimScope, labels_match};

/// GitHub's message type of a batch of job messages.
pub const MESSAGE_TYPE_JOB_MESSAGES: &str = "RunnerScaleSetJobMessages";
/// The header a listener reports its capacity in.
pub const HEADER_MAX_CAPACITY: &str = "x-scalesetmaxcapacity";
/// At most this many job messages go into one queue message (GitHub: 50).
pub const MAX_JOBS_PER_MESSAGE: usize = 50;

/// Where a scale-set job is. Moves forward only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum ScaleSetJobState {
    Available,
    Acquired,
    Started { runner_id: u64, runner_name: String },
    Completed { result: String },
}

/// A job routed to a scale set, keyed by its runner request id.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScaleSetJob {
    pub runner_request_id: i64,
    pub job_id: u64,
    pub scale_set_id: u64,
    pub state: ScaleSetJobState,
    /// How many acquire calls named it (a listener that acquires twice is visible here).
    pub acquire_calls: u32,
}

/// A live message session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScaleSetSession {
    pub id: String,
    pub owner: String,
    #[serde(skip_serializing)]
    pub queue_token: String,
    pub last_seen: DateTime<Utc>,
}

/// One queue message: a batch of job messages, kept until deleted.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueueMessage {
    pub id: u64,
    pub jobs: Vec<Value>,
    /// Times handed to a poll.
    pub deliveries: u32,
}

/// A runner scale set.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimScaleSet {
    pub id: u64,
    pub name: String,
    pub scope: SimScope,
    pub runner_group_id: u64,
    pub runner_group_name: String,
    /// Its labels (the name first).
    pub labels: Vec<String>,
    pub session: Option<ScaleSetSession>,
    /// Messages not yet deleted, oldest first.
    pub queue: VecDeque<QueueMessage>,
    /// Job messages not yet batched into a queue message.
    pub pending: Vec<Value>,
    /// The last `X-ScaleSetMaxCapacity` a poll carried.
    pub last_max_capacity: Option<u32>,
}

/// Counters a test can assert on.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScaleSetStats {
    pub registration_tokens: u64,
    pub admin_connections: u64,
    pub scale_sets_created: u64,
    pub sessions_created: u64,
    /// Session creates answered 409 (another session was live).
    pub session_conflicts: u64,
    pub sessions_deleted: u64,
    /// Sessions dropped because their holder stopped polling.
    pub sessions_expired: u64,
    pub polls: u64,
    /// Polls answered 202 (nothing within the poll timeout).
    pub empty_polls: u64,
    pub messages_delivered: u64,
    /// Deliveries of a message that had been delivered before (not yet deleted).
    pub redeliveries: u64,
    pub messages_deleted: u64,
    pub acquire_calls: u64,
    pub jobs_acquired: u64,
    pub jit_configs: u64,
    /// Sessions refreshed (`PATCH .../sessions/{id}`: a new queue token).
    pub sessions_refreshed: u64,
    /// Queue calls refused 401 (a token rotated away, a session gone).
    pub unauthorized: u64,
    /// Acks (message deletes) held open by [`ScaleSets::holding_acks`]: the listener had written
    /// its ledger and was waiting for GitHub's answer.
    pub acks_held: u64,
    /// Held acks whose listener went away (the connection closed or its session ended) before
    /// the answer: the message was not deleted and is delivered again.
    pub acks_discarded: u64,
}

/// Why a session or queue call is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScaleSetRefusal {
    NotFound,
    /// 409: another session is live.
    Conflict {
        owner: String,
    },
    /// 401: the queue token is not the live session's.
    Unauthorized,
}

/// What a poll finds.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivered {
    pub message_id: u64,
    pub jobs: Vec<Value>,
    pub statistics: Value,
}

/// The scale-set state of the simulator.
pub struct ScaleSets {
    pub sets: BTreeMap<u64, SimScaleSet>,
    next_set_id: u64,
    /// Registration tokens -> scope (GitHub: one hour).
    pub registration_tokens: HashMap<String, (SimScope, DateTime<Utc>)>,
    /// Admin tokens of the Actions service -> scope.
    pub admin_tokens: HashMap<String, (SimScope, DateTime<Utc>)>,
    pub jobs: BTreeMap<i64, ScaleSetJob>,
    by_job: HashMap<u64, i64>,
    next_request_id: i64,
    next_message_id: u64,
    /// Runners registered through a scale set -> its id.
    pub runners: HashMap<u64, u64>,
    /// A session not polled for this long expires (its holder died without deleting it).
    pub session_ttl: Duration,
    /// How long a poll waits for a message before answering 202 (GitHub: about 50 s).
    pub poll_timeout: Duration,
    pub stats: ScaleSetStats,
    /// The next this many message deletes answer 500 and delete nothing (an ack lost after the
    /// listener wrote its ledger).
    pub failing_acks: u32,
    /// The next this many deletes of a message carrying a JobAvailable are held open (no answer)
    /// until the listener goes away; then the delete is discarded, as GitHub drops a request
    /// whose client is gone. A test kills the listener while its ack is in flight.
    pub holding_acks: u32,
    /// Wakes long polls when a set gets a message.
    pub wake: Arc<Notify>,
    /// The broker stops answering polls (they hang until this is cleared): a listener that looks
    /// alive but hears nothing.
    pub deaf: bool,
}

impl Default for ScaleSets {
    fn default() -> Self {
        ScaleSets {
            sets: BTreeMap::new(),
            next_set_id: 1,
            registration_tokens: HashMap::new(),
            admin_tokens: HashMap::new(),
            jobs: BTreeMap::new(),
            by_job: HashMap::new(),
            next_request_id: 9_000_001,
            next_message_id: 1,
            runners: HashMap::new(),
            session_ttl: Duration::from_secs(120),
            poll_timeout: Duration::from_secs(50),
            stats: ScaleSetStats::default(),
            failing_acks: 0,
            holding_acks: 0,
            wake: Arc::new(Notify::new()),
            deaf: false,
        }
    }
}

fn repo_name(full: &str) -> (&str, &str) {
    full.split_once('/').unwrap_or(("", full))
}

fn in_scope(scope: &SimScope, repository: &str) -> bool {
    match scope {
        SimScope::Organization(o) => repo_name(repository).0.eq_ignore_ascii_case(o),
        SimScope::Repository(r) => repository.eq_ignore_ascii_case(r),
    }
}

fn ts(t: Option<DateTime<Utc>>) -> Value {
    t.map(|t| json!(t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)))
        .unwrap_or(json!("0001-01-01T00:00:00Z"))
}

/// GitHub's job result words for a workflow job's conclusion.
fn result_of(conclusion: Option<&str>) -> &'static str {
    match conclusion {
        Some("success") => "succeeded",
        Some("failure") => "failed",
        Some("skipped") => "skipped",
        _ => "canceled",
    }
}

impl ScaleSets {
    /// Creates a scale set; `None` if the name is taken in the scope.
    pub fn create(
        &mut self,
        scope: SimScope,
        name: &str,
        group: (u64, String),
        extra_labels: &[String],
    ) -> Option<&SimScaleSet> {
        if self.by_name(&scope, name).is_some() {
            return None;
        }
        let id = self.next_set_id;
        self.next_set_id += 1;
        let mut labels = vec![name.to_string()];
        for l in extra_labels {
            if !labels.iter().any(|x| x.eq_ignore_ascii_case(l)) {
                labels.push(l.clone());
            }
        }
        self.sets.insert(
            id,
            SimScaleSet {
                id,
                name: name.to_string(),
                scope,
                runner_group_id: group.0,
                runner_group_name: group.1,
                labels,
                session: None,
                queue: VecDeque::new(),
                pending: Vec::new(),
                last_max_capacity: None,
            },
        );
        self.stats.scale_sets_created += 1;
        self.sets.get(&id)
    }

    pub fn by_name(&self, scope: &SimScope, name: &str) -> Option<&SimScaleSet> {
        self.sets
            .values()
            .find(|s| &s.scope == scope && s.name.eq_ignore_ascii_case(name))
    }

    /// Drops sessions whose holder has not polled within the TTL.
    fn expire_sessions(&mut self, now: DateTime<Utc>) {
        let ttl = chrono::Duration::from_std(self.session_ttl).unwrap_or_default();
        for set in self.sets.values_mut() {
            if set
                .session
                .as_ref()
                .is_some_and(|s| s.last_seen + ttl < now)
            {
                set.session = None;
                self.stats.sessions_expired += 1;
            }
        }
    }

    /// Opens the set's message session; 409 while another is live.
    pub fn create_session(
        &mut self,
        set_id: u64,
        owner: &str,
        now: DateTime<Utc>,
    ) -> Result<ScaleSetSession, ScaleSetRefusal> {
        self.expire_sessions(now);
        let set = self
            .sets
            .get_mut(&set_id)
            .ok_or(ScaleSetRefusal::NotFound)?;
        if let Some(s) = &set.session {
            self.stats.session_conflicts += 1;
            return Err(ScaleSetRefusal::Conflict {
                owner: s.owner.clone(),
            });
        }
        let session = ScaleSetSession {
            id: uuid::Uuid::new_v4().to_string(),
            owner: owner.to_string(),
            queue_token: random_token(48),
            last_seen: now,
        };
        set.session = Some(session.clone());
        self.stats.sessions_created += 1;
        Ok(session)
    }

    /// Ends the session; false if it is not the live one.
    pub fn delete_session(&mut self, set_id: u64, session_id: &str) -> bool {
        let Some(set) = self.sets.get_mut(&set_id) else {
            return false;
        };
        if set.session.as_ref().is_some_and(|s| s.id == session_id) {
            set.session = None;
            self.stats.sessions_deleted += 1;
            true
        } else {
            false
        }
    }

    /// Gives the live session a new queue token (`PATCH .../sessions/{id}`, what a listener does
    /// after a 401); the old token is refused from then on.
    pub fn refresh_session(
        &mut self,
        set_id: u64,
        session_id: &str,
        now: DateTime<Utc>,
    ) -> Result<ScaleSetSession, ScaleSetRefusal> {
        self.expire_sessions(now);
        let set = self
            .sets
            .get_mut(&set_id)
            .ok_or(ScaleSetRefusal::NotFound)?;
        match &mut set.session {
            Some(s) if s.id == session_id => {
                s.queue_token = random_token(48);
                s.last_seen = now;
                self.stats.sessions_refreshed += 1;
                Ok(s.clone())
            }
            _ => Err(ScaleSetRefusal::NotFound),
        }
    }

    /// Every live session's queue token expires now: queue calls answer 401 until the listener
    /// refreshes its session.
    pub fn expire_queue_tokens(&mut self) {
        for set in self.sets.values_mut() {
            if let Some(s) = &mut set.session {
                s.queue_token = random_token(48);
            }
        }
    }

    /// The set whose live session holds `queue_token`; touches the session.
    fn session_set(
        &mut self,
        set_id: u64,
        queue_token: &str,
        now: DateTime<Utc>,
    ) -> Result<&mut SimScaleSet, ScaleSetRefusal> {
        self.expire_sessions(now);
        let set = self
            .sets
            .get_mut(&set_id)
            .ok_or(ScaleSetRefusal::NotFound)?;
        match &mut set.session {
            Some(s) if s.queue_token == queue_token => {
                s.last_seen = now;
                Ok(set)
            }
            _ => {
                self.stats.unauthorized += 1;
                Err(ScaleSetRefusal::Unauthorized)
            }
        }
    }

    /// One poll: the oldest undeleted message after `last_message_id`, else a new message from the
    /// pending job messages, else None (the handler waits and polls again).
    pub fn poll(
        &mut self,
        set_id: u64,
        queue_token: &str,
        last_message_id: u64,
        max_capacity: Option<u32>,
        now: DateTime<Utc>,
    ) -> Result<Option<Delivered>, ScaleSetRefusal> {
        let next_id = self.next_message_id;
        let set = self.session_set(set_id, queue_token, now)?;
        if max_capacity.is_some() {
            set.last_max_capacity = max_capacity;
        }
        let mut created = false;
        if !set.queue.iter().any(|m| m.id > last_message_id) && !set.pending.is_empty() {
            let take = set.pending.len().min(MAX_JOBS_PER_MESSAGE);
            let jobs: Vec<Value> = set.pending.drain(..take).collect();
            set.queue.push_back(QueueMessage {
                id: next_id,
                jobs,
                deliveries: 0,
            });
            created = true;
        }
        let Some(msg) = set.queue.iter_mut().find(|m| m.id > last_message_id) else {
            return Ok(None);
        };
        msg.deliveries += 1;
        let redelivery = msg.deliveries > 1;
        let delivered = (msg.id, msg.jobs.clone());
        if created {
            self.next_message_id += 1;
        }
        self.stats.messages_delivered += 1;
        if redelivery {
            self.stats.redeliveries += 1;
        }
        Ok(Some(Delivered {
            message_id: delivered.0,
            jobs: delivered.1,
            statistics: self.statistics(set_id),
        }))
    }

    /// Deletes (acknowledges) a message.
    pub fn delete_message(
        &mut self,
        set_id: u64,
        queue_token: &str,
        message_id: u64,
        now: DateTime<Utc>,
    ) -> Result<bool, ScaleSetRefusal> {
        let set = self.session_set(set_id, queue_token, now)?;
        let before = set.queue.len();
        set.queue.retain(|m| m.id != message_id);
        let deleted = set.queue.len() < before;
        if deleted {
            self.stats.messages_deleted += 1;
        }
        Ok(deleted)
    }

    /// Whether the delete of `message_id` is to be held open ([`ScaleSets::holding_acks`]); counts
    /// it held.
    pub fn hold_ack(&mut self, set_id: u64, message_id: u64) -> bool {
        if self.holding_acks == 0 {
            return false;
        }
        let offers_a_job = self.sets.get(&set_id).is_some_and(|s| {
            s.queue.iter().any(|m| {
                m.id == message_id
                    && m.jobs
                        .iter()
                        .any(|j| j["messageType"] == json!("JobAvailable"))
            })
        });
        if offers_a_job {
            self.holding_acks -= 1;
            self.stats.acks_held += 1;
        }
        offers_a_job
    }

    /// Whether `queue_token` is still the live session's (a held ack waits while it is).
    pub fn session_live(&mut self, set_id: u64, queue_token: &str, now: DateTime<Utc>) -> bool {
        self.expire_sessions(now);
        self.sets
            .get(&set_id)
            .and_then(|s| s.session.as_ref())
            .is_some_and(|s| s.queue_token == queue_token)
    }

    /// Acquires the named jobs that are Available in this set; answers the ids acquired now.
    pub fn acquire(
        &mut self,
        set_id: u64,
        queue_token: &str,
        ids: &[i64],
        jobs: &BTreeMap<u64, SimJob>,
        now: DateTime<Utc>,
    ) -> Result<Vec<i64>, ScaleSetRefusal> {
        self.session_set(set_id, queue_token, now)?;
        self.stats.acquire_calls += 1;
        let mut acquired = Vec::new();
        for id in ids {
            let Some(j) = self.jobs.get_mut(id).filter(|j| j.scale_set_id == set_id) else {
                continue;
            };
            j.acquire_calls += 1;
            if j.state != ScaleSetJobState::Available {
                continue;
            }
            j.state = ScaleSetJobState::Acquired;
            acquired.push(*id);
            let (rid, job_id) = (j.runner_request_id, j.job_id);
            if let Some(job) = jobs.get(&job_id) {
                let msg = job_message("JobAssigned", rid, job, json!({}));
                self.push(set_id, msg);
            }
        }
        self.stats.jobs_acquired += acquired.len() as u64;
        Ok(acquired)
    }

    fn push(&mut self, set_id: u64, msg: Value) {
        if let Some(set) = self.sets.get_mut(&set_id) {
            set.pending.push(msg);
            self.wake.notify_waiters();
        }
    }

    /// Records a runner registered through the set.
    pub fn register_runner(&mut self, set_id: u64, runner_id: u64) {
        self.stats.jit_configs += 1;
        self.runners.insert(runner_id, set_id);
    }

    /// Whether `runner_id` may take job `job_id`: a scale set's job goes only to a runner of that
    /// set, and only once acquired; a scale set's runner takes only its set's jobs.
    pub fn runner_may_take(&self, runner_id: u64, job_id: u64) -> bool {
        let runner_set = self.runners.get(&runner_id);
        match self.by_job.get(&job_id).and_then(|r| self.jobs.get(r)) {
            Some(j) => runner_set == Some(&j.scale_set_id) && j.state == ScaleSetJobState::Acquired,
            None => runner_set.is_none(),
        }
    }

    /// A change of a job in the simulator's model (`action`: queued, in_progress, completed).
    pub fn on_job(&mut self, job: &SimJob, action: &str) {
        match action {
            "queued" => {
                if self.by_job.contains_key(&job.id) || job.labels.is_empty() {
                    return;
                }
                let Some(set_id) = self
                    .sets
                    .values()
                    .find(|s| {
                        in_scope(&s.scope, &job.repository) && labels_match(&job.labels, &s.labels)
                    })
                    .map(|s| s.id)
                else {
                    return;
                };
                let rid = self.next_request_id;
                self.next_request_id += 1;
                self.jobs.insert(
                    rid,
                    ScaleSetJob {
                        runner_request_id: rid,
                        job_id: job.id,
                        scale_set_id: set_id,
                        state: ScaleSetJobState::Available,
                        acquire_calls: 0,
                    },
                );
                self.by_job.insert(job.id, rid);
                let extra = json!({ "acquireJobUrl": format!("acquirejobs/{rid}") });
                self.push(set_id, job_message("JobAvailable", rid, job, extra));
            }
            "in_progress" | "completed" => {
                let Some(&rid) = self.by_job.get(&job.id) else {
                    return;
                };
                let Some(j) = self.jobs.get_mut(&rid) else {
                    return;
                };
                let runner_id = job.runner_id.unwrap_or(0);
                let runner_name = job.runner_name.clone().unwrap_or_default();
                let (kind, extra) = if action == "in_progress" {
                    j.state = ScaleSetJobState::Started {
                        runner_id,
                        runner_name: runner_name.clone(),
                    };
                    (
                        "JobStarted",
                        json!({ "runnerId": runner_id, "runnerName": runner_name }),
                    )
                } else {
                    let result = result_of(job.conclusion.as_deref());
                    j.state = ScaleSetJobState::Completed {
                        result: result.into(),
                    };
                    (
                        "JobCompleted",
                        json!({ "result": result, "runnerId": runner_id,
                                "runnerName": runner_name }),
                    )
                };
                let set_id = j.scale_set_id;
                self.push(set_id, job_message(kind, rid, job, extra));
            }
            _ => {}
        }
    }

    /// GitHub's statistics block for a set.
    pub fn statistics(&self, set_id: u64) -> Value {
        let (mut available, mut acquired, mut running) = (0, 0, 0);
        for j in self.jobs.values().filter(|j| j.scale_set_id == set_id) {
            match j.state {
                ScaleSetJobState::Available => available += 1,
                ScaleSetJobState::Acquired => acquired += 1,
                ScaleSetJobState::Started { .. } => running += 1,
                ScaleSetJobState::Completed { .. } => {}
            }
        }
        let registered = self.runners.values().filter(|s| **s == set_id).count();
        json!({
            "totalAvailableJobs": available,
            "totalAcquiredJobs": acquired,
            "totalAssignedJobs": acquired + running,
            "totalRunningJobs": running,
            "totalRegisteredRunners": registered,
            "totalBusyRunners": running,
            "totalIdleRunners": registered.saturating_sub(running),
        })
    }

    /// Forgets a runner that went away (ephemeral runners leave with their job).
    pub fn runner_removed(&mut self, runner_id: u64) {
        self.runners.remove(&runner_id);
    }
}

/// One job message as GitHub's broker writes it.
fn job_message(kind: &str, rid: i64, job: &SimJob, extra: Value) -> Value {
    let (owner, repo) = repo_name(&job.repository);
    let mut v = json!({
        "messageType": kind,
        "runnerRequestId": rid,
        "repositoryName": repo,
        "ownerName": owner,
        "jobId": job.id.to_string(),
        "jobWorkflowRef": format!("{}/.github/workflows/ci.yml@refs/heads/{}",
                                  job.repository, job.head_branch),
        "jobDisplayName": job.name,
        "workflowRunId": job.run_id,
        "eventName": "push",
        "requestLabels": job.labels,
        "queueTime": ts(Some(job.created_at)),
        "scaleSetAssignTime": ts(None),
        "runnerAssignTime": ts(job.started_at),
        "finishTime": ts(job.completed_at),
    });
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::github::jobs::{JobSpec, JobStatus};

    fn org() -> SimScope {
        SimScope::Organization("octo-org".into())
    }

    fn job(id: u64, labels: &[&str]) -> SimJob {
        SimJob::queued(
            id,
            JobSpec {
                labels: labels.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
            "octo-org/octo-repo",
        )
    }

    fn with_set() -> (ScaleSets, u64) {
        let mut s = ScaleSets::default();
        let id = s
            .create(org(), "imp-set", (1, "Default".into()), &[])
            .expect("created")
            .id;
        (s, id)
    }

    fn kinds(d: &Delivered) -> Vec<String> {
        d.jobs
            .iter()
            .map(|j| j["messageType"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    #[test]
    fn a_second_session_conflicts_until_the_first_is_deleted_or_expires() {
        let (mut s, id) = with_set();
        let now = Utc::now();
        let first = s.create_session(id, "op-a", now).expect("first");
        assert_eq!(
            s.create_session(id, "op-b", now).unwrap_err(),
            ScaleSetRefusal::Conflict {
                owner: "op-a".into()
            }
        );
        assert!(s.delete_session(id, &first.id));
        let second = s.create_session(id, "op-b", now).expect("after delete");
        // The holder dies without deleting: the session lives until the TTL, then a new one opens.
        let soon = now + chrono::Duration::seconds(5);
        assert!(s.create_session(id, "op-c", soon).is_err());
        let late =
            now + chrono::Duration::from_std(s.session_ttl).unwrap() + chrono::Duration::seconds(1);
        let third = s.create_session(id, "op-c", late).expect("after expiry");
        assert_ne!(second.id, third.id);
        assert_eq!(s.stats.session_conflicts, 2);
        assert_eq!(s.stats.sessions_expired, 1);
    }

    #[test]
    fn a_message_is_delivered_again_until_deleted_and_capacity_is_recorded() {
        let (mut s, id) = with_set();
        let now = Utc::now();
        let sess = s.create_session(id, "op", now).unwrap();
        s.on_job(&job(1, &["imp-set"]), "queued");
        let d = s
            .poll(id, &sess.queue_token, 0, Some(7), now)
            .unwrap()
            .expect("a message");
        assert_eq!(kinds(&d), ["JobAvailable"]);
        assert_eq!(s.sets[&id].last_max_capacity, Some(7));
        assert_eq!(d.statistics["totalAvailableJobs"], 1);
        // Not deleted: a poll from scratch (a restarted listener) gets it again.
        let again = s
            .poll(id, &sess.queue_token, 0, None, now)
            .unwrap()
            .unwrap();
        assert_eq!(again.message_id, d.message_id);
        assert_eq!(s.stats.redeliveries, 1);
        // Past it by id: nothing new.
        assert!(
            s.poll(id, &sess.queue_token, d.message_id, None, now)
                .unwrap()
                .is_none()
        );
        assert!(
            s.delete_message(id, &sess.queue_token, d.message_id, now)
                .unwrap()
        );
        assert!(
            s.poll(id, &sess.queue_token, 0, None, now)
                .unwrap()
                .is_none()
        );
        assert_eq!(
            s.poll(id, "wrong", 0, None, now).unwrap_err(),
            ScaleSetRefusal::Unauthorized
        );
    }

    #[test]
    fn jobs_move_available_acquired_started_completed_with_one_message_each() {
        let (mut s, id) = with_set();
        let now = Utc::now();
        let sess = s.create_session(id, "op", now).unwrap();
        let mut j = job(5, &["imp-set"]);
        s.on_job(&j, "queued");
        s.on_job(&job(6, &["gpu"]), "queued"); // not this set's
        let rid = *s.jobs.keys().next().unwrap();
        assert_eq!(s.jobs.len(), 1);
        let mut jobs = BTreeMap::from([(5, j.clone())]);
        assert_eq!(
            s.acquire(id, &sess.queue_token, &[rid, 42], &jobs, now)
                .unwrap(),
            [rid]
        );
        // A second acquire of the same job acquires nothing.
        assert!(
            s.acquire(id, &sess.queue_token, &[rid], &jobs, now)
                .unwrap()
                .is_empty()
        );
        assert_eq!(s.jobs[&rid].acquire_calls, 2);
        // Only a runner of this set takes it, and only now that it is acquired.
        s.register_runner(id, 77);
        assert!(s.runner_may_take(77, 5));
        assert!(!s.runner_may_take(78, 5));
        j.status = JobStatus::InProgress;
        j.runner_id = Some(77);
        j.runner_name = Some("imp-r1".into());
        s.on_job(&j, "in_progress");
        j.status = JobStatus::Completed;
        j.conclusion = Some("success".into());
        s.on_job(&j, "completed");
        jobs.insert(5, j);
        let d = s
            .poll(id, &sess.queue_token, 0, None, now)
            .unwrap()
            .unwrap();
        assert_eq!(
            kinds(&d),
            ["JobAvailable", "JobAssigned", "JobStarted", "JobCompleted"]
        );
        assert_eq!(d.jobs[2]["runnerName"], "imp-r1");
        assert_eq!(d.jobs[3]["result"], "succeeded");
        assert_eq!(d.jobs[0]["runnerRequestId"], rid);
        assert_eq!(d.jobs[0]["jobId"], "5");
        assert!(matches!(
            s.jobs[&rid].state,
            ScaleSetJobState::Completed { .. }
        ));
    }

    #[test]
    fn an_expired_queue_token_is_refused_until_the_session_is_refreshed() {
        let (mut s, id) = with_set();
        let now = Utc::now();
        let sess = s.create_session(id, "op", now).unwrap();
        s.expire_queue_tokens();
        assert_eq!(
            s.poll(id, &sess.queue_token, 0, None, now).unwrap_err(),
            ScaleSetRefusal::Unauthorized
        );
        assert_eq!(
            s.refresh_session(id, "not-the-session", now).unwrap_err(),
            ScaleSetRefusal::NotFound
        );
        let fresh = s.refresh_session(id, &sess.id, now).unwrap();
        assert_eq!(fresh.id, sess.id, "the same session, a new token");
        assert!(
            s.poll(id, &fresh.queue_token, 0, None, now)
                .unwrap()
                .is_none()
        );
        assert_eq!((s.stats.unauthorized, s.stats.sessions_refreshed), (1, 1));
    }

    #[test]
    fn a_runner_of_no_set_never_takes_a_set_job_and_a_set_runner_takes_no_other_job() {
        let (mut s, id) = with_set();
        s.on_job(&job(5, &["imp-set"]), "queued");
        s.register_runner(id, 1);
        assert!(!s.runner_may_take(2, 5), "outside runner, set job");
        assert!(!s.runner_may_take(1, 5), "set runner, job not acquired yet");
        assert!(!s.runner_may_take(1, 9), "set runner, job of no set");
        assert!(s.runner_may_take(2, 9), "outside runner, job of no set");
    }

    #[test]
    fn at_most_fifty_job_messages_per_message() {
        let (mut s, id) = with_set();
        let now = Utc::now();
        let sess = s.create_session(id, "op", now).unwrap();
        for i in 0..60 {
            s.on_job(&job(i, &["imp-set"]), "queued");
        }
        let a = s
            .poll(id, &sess.queue_token, 0, None, now)
            .unwrap()
            .unwrap();
        assert_eq!(a.jobs.len(), MAX_JOBS_PER_MESSAGE);
        let b = s
            .poll(id, &sess.queue_token, a.message_id, None, now)
            .unwrap()
            .unwrap();
        assert_eq!(b.jobs.len(), 10);
        assert!(b.message_id > a.message_id);
    }

    #[test]
    fn a_name_is_taken_once_per_scope_and_jobs_route_only_within_scope() {
        let (mut s, _) = with_set();
        assert!(
            s.create(org(), "IMP-SET", (1, "Default".into()), &[])
                .is_none()
        );
        let other = SimScope::Repository("else/where".into());
        assert!(
            s.create(other, "imp-set", (1, "Default".into()), &[])
                .is_some()
        );
        let mut foreign = job(3, &["imp-set"]);
        foreign.repository = "stranger/repo".into();
        s.on_job(&foreign, "queued");
        assert!(s.jobs.is_empty());
    }
}
