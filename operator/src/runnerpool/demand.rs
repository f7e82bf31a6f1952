//! In-memory demand of every pool: the workflow jobs learnt from webhooks and the queued-job sweep,
//! which pool each job is routed to, and the de-duplication set of deliveries (by id and by body
//! digest). Nothing here is persisted: after an operator restart the sweep rebuilds the queued jobs and
//! the busy runners (it lists every job of active runs) (docs/runner-pool.md). Pure state transitions;
//! the webhook receiver and the controller hold it behind a mutex.
//!
//! Tenants are kept apart: a delivery changes only jobs of pools that accept its signing secret, and the
//! sweep (GitHub's own view) re-routes a job whose recorded pool is not the one its listed labels route
//! to. Memory is bounded: at most `max_jobs` active and `max_completed` completed jobs are kept, and at
//! most `max_jobs_per_pool` active jobs of one pool (jobs routed to no pool count as one pool). A pool
//! over its cap loses its own oldest job; when the whole table is full, the pool holding the most
//! loses its oldest: one tenant's flood of validly signed deliveries evicts only its own demand
//! (issue 30). Evictions are counted in `imp_runner_demand_jobs_evicted_total`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::labels::pool_serves;
use crate::github::{RunnerScope, WorkflowJob};

/// `namespace/name` of an ImpVMRunnerPool.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey {
    pub namespace: String,
    pub name: String,
}

impl PoolKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        PoolKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl std::fmt::Display for PoolKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What routing needs to know of a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRoute {
    pub labels: Vec<String>,
    pub scope: RunnerScope,
    /// The pool's own webhook secret, if it has one; else deliveries must carry the global one.
    pub webhook_secret: Option<Vec<u8>>,
}

/// Where a job is in its life. Only ever moves forward, so reordered deliveries cannot resurrect it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum JobState {
    Queued,
    InProgress,
    Completed,
}

impl JobState {
    /// A webhook action or a job status. `waiting` (an environment approval), `pending` and
    /// `requested` are not demand: GitHub sends `queued` once the job can run, and a runner booted
    /// earlier would idle for as long as the approval takes (docs/github.md).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "queued" => Some(JobState::Queued),
            "in_progress" => Some(JobState::InProgress),
            "completed" => Some(JobState::Completed),
            _ => None,
        }
    }
}

/// A workflow job as the operator knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub id: u64,
    pub state: JobState,
    /// `owner/repo`.
    pub repository: String,
    pub labels: Vec<String>,
    pub runner_name: Option<String>,
    /// The pool serving it (None: no pool matched).
    pub pool: Option<PoolKey>,
    /// When the operator first learnt the job was queued (pickup latency starts here).
    pub learnt_at: Instant,
    /// Last change from a webhook or the sweep.
    pub updated_at: Instant,
    /// A Started runner was credited to this job (pickup latency observed).
    pub picked_up: bool,
    /// Consecutive complete sweeps of its repository that did not list it (while queued).
    pub misses: u8,
    /// The workflow run (for the served VM's status).
    pub run_id: Option<u64>,
    /// When it was queued, went in progress, completed (wall clock; see [`JobUpdate::since`]): the
    /// steps of the job's SLO that GitHub reports.
    pub queued_at: Option<Timestamp>,
    pub picked_up_at: Option<Timestamp>,
    pub completed_at: Option<Timestamp>,
    /// Its `run` phase (picked up -> completed) was observed.
    pub run_observed: bool,
}

/// A job a runner took, as the served VM's status needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedJob {
    pub id: u64,
    pub run_id: Option<u64>,
    pub repository: String,
    pub runner_name: String,
    pub queued_at: Option<Timestamp>,
    pub picked_up_at: Option<Timestamp>,
    pub completed_at: Option<Timestamp>,
}

/// One observation of a job (a webhook or a sweep entry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobUpdate {
    pub id: u64,
    pub state: JobState,
    pub repository: String,
    pub labels: Vec<String>,
    pub runner_name: Option<String>,
    pub run_id: Option<u64>,
    /// When GitHub says the job entered `state` (the sweep's `created_at`/`started_at`/
    /// `completed_at`); None for a webhook, whose arrival is the more precise time on our clock.
    pub since: Option<Timestamp>,
    /// GitHub's `created_at`: the queued time of a job first seen past `queued`.
    pub created_at: Option<Timestamp>,
}

/// How many runners a pool's jobs ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolDemand {
    /// Queued jobs routed to the pool.
    pub queued: u32,
    /// Runner names of the pool's jobs in progress.
    pub busy_runners: HashSet<String>,
}

/// Bounds of the in-memory state.
#[derive(Debug, Clone)]
pub struct DemandLimits {
    /// Delivery ids remembered (oldest forgotten first).
    pub max_deliveries: usize,
    /// Delivery ids are forgotten after this long (GitHub redelivers within hours at most on request).
    pub delivery_ttl: Duration,
    /// Completed jobs are remembered this long, so a late queued/in_progress delivery is ignored.
    pub completed_ttl: Duration,
    /// A job not updated for this long is dropped (a lost completed webhook must not pin demand).
    pub job_ttl: Duration,
    /// Queued and in-progress jobs kept; beyond, the oldest of the pool holding the most is evicted.
    pub max_jobs: usize,
    /// Queued and in-progress jobs kept per pool; beyond, the pool's own oldest is evicted.
    pub max_jobs_per_pool: usize,
    /// Completed jobs kept (they only guard against reordered deliveries); oldest evicted first.
    pub max_completed: usize,
    /// A queued job missing from this many consecutive complete sweeps is gone (one listing may
    /// lag behind GitHub's own state).
    pub sweep_misses_to_drop: u8,
}

impl Default for DemandLimits {
    fn default() -> Self {
        DemandLimits {
            max_deliveries: 50_000,
            delivery_ttl: Duration::from_secs(6 * 3600),
            completed_ttl: Duration::from_secs(3600),
            job_ttl: Duration::from_secs(24 * 3600),
            max_jobs: 20_000,
            max_jobs_per_pool: 5_000,
            max_completed: 20_000,
            sweep_misses_to_drop: 2,
        }
    }
}

/// Metrics of the demand state (registered by [`super::PoolMetrics`]). Clones share the series.
#[derive(Clone, Debug, Default)]
pub struct DemandMetrics {
    /// `imp_runner_demand_jobs_evicted_total`: jobs forgotten because the job map was full.
    pub evicted: Counter,
    /// `imp_runner_demand_jobs`: jobs held (all states).
    pub jobs: Gauge,
}

impl DemandMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "imp_runner_demand_jobs_evicted",
            "Workflow jobs forgotten because the bounded job map or a pool's share of it was full (that pool's oldest first)",
            self.evicted.clone(),
        );
        registry.register(
            "imp_runner_demand_jobs",
            "Workflow jobs held in the operator's demand state",
            self.jobs.clone(),
        );
    }
}

/// A delivery's identity for de-duplication: its id and the SHA-256 of its body (a replayed body
/// under a new id is still a duplicate).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum DeliveryKey {
    Id(String),
    Digest([u8; 32]),
}

/// The active jobs of one pool, for its cap.
#[derive(Debug, Default)]
struct PoolJobs {
    held: usize,
    order: VecDeque<u64>,
}

/// Webhooks (`X-GitHub-Hook-ID`) whose verifying secret is remembered.
const MAX_HOOKS: usize = 4096;

/// The demand state of all pools.
#[derive(Debug)]
pub struct Demand {
    limits: DemandLimits,
    pools: BTreeMap<PoolKey, PoolRoute>,
    jobs: HashMap<u64, Job>,
    /// Active jobs per pool (`None`: routed to no pool): how many, and in which order they were
    /// learnt or routed there (ids may be stale: checked on eviction).
    active: HashMap<Option<PoolKey>, PoolJobs>,
    /// Completion order of completed jobs (ids may be stale: checked on eviction).
    completed_order: VecDeque<u64>,
    /// Jobs held per tier: (active, completed).
    held: (usize, usize),
    deliveries: HashSet<DeliveryKey>,
    delivery_order: VecDeque<(Instant, DeliveryKey)>,
    global_secret: Option<Vec<u8>>,
    /// The secret that last verified a delivery of each webhook (`X-GitHub-Hook-ID`) on the shared
    /// path: tried first, so a known hook's delivery costs one HMAC, not one per secret. Only a
    /// verified delivery teaches it, and a wrong entry only costs that hook the full search.
    hook_secrets: HashMap<u64, Vec<u8>>,
    metrics: DemandMetrics,
    /// Maps the monotonic clock of observations onto wall time (job step times).
    epoch: (Instant, Timestamp),
}

impl Default for Demand {
    fn default() -> Self {
        Self::new(DemandLimits::default())
    }
}

/// Does `scope` cover jobs of `repository` (`owner/repo`)?
pub fn scope_covers(scope: &RunnerScope, repository: &str) -> bool {
    match scope {
        RunnerScope::Organization { org } => repository
            .split_once('/')
            .is_some_and(|(owner, _)| owner.eq_ignore_ascii_case(org)),
        RunnerScope::Repository { owner, repo } => {
            repository.eq_ignore_ascii_case(&format!("{owner}/{repo}"))
        }
        RunnerScope::Enterprise { .. } => false,
    }
}

impl Demand {
    pub fn new(limits: DemandLimits) -> Self {
        Demand {
            limits,
            pools: BTreeMap::new(),
            jobs: HashMap::new(),
            active: HashMap::new(),
            completed_order: VecDeque::new(),
            held: (0, 0),
            deliveries: HashSet::new(),
            delivery_order: VecDeque::new(),
            global_secret: None,
            hook_secrets: HashMap::new(),
            metrics: DemandMetrics::default(),
            epoch: (Instant::now(), Timestamp::now()),
        }
    }

    /// Wall time of a monotonic instant.
    pub fn wall(&self, at: Instant) -> Timestamp {
        let (i0, t0) = self.epoch;
        let d = if at >= i0 {
            SignedDuration::try_from(at - i0).unwrap_or(SignedDuration::ZERO)
        } else {
            -SignedDuration::try_from(i0 - at).unwrap_or(SignedDuration::ZERO)
        };
        t0.checked_add(d).unwrap_or(t0)
    }

    /// Reports into shared `metrics`.
    pub fn with_metrics(mut self, metrics: DemandMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Registers or updates a pool (the controller does this every pass). Jobs waiting without a pool
    /// are routed again, so a job queued before its pool existed is still served.
    pub fn upsert_pool(&mut self, key: PoolKey, route: PoolRoute) -> bool {
        let changed = self.pools.get(&key) != Some(&route);
        self.pools.insert(key, route);
        if changed {
            let unrouted: Vec<u64> = self
                .jobs
                .values()
                .filter(|j| j.pool.is_none() && j.state != JobState::Completed)
                .map(|j| j.id)
                .collect();
            for id in unrouted {
                let pool = {
                    let j = &self.jobs[&id];
                    self.route(&j.repository, &j.labels, None)
                };
                if let Some(j) = self.jobs.get_mut(&id) {
                    j.pool = pool;
                }
            }
            self.recount();
            self.bound_jobs();
        }
        changed
    }

    /// Forgets a deleted pool and its jobs' routing.
    pub fn remove_pool(&mut self, key: &PoolKey) {
        self.pools.remove(key);
        for j in self.jobs.values_mut() {
            if j.pool.as_ref() == Some(key) {
                j.pool = None;
            }
        }
        self.recount();
        self.bound_jobs();
    }

    pub fn set_global_secret(&mut self, secret: Option<Vec<u8>>) {
        self.global_secret = secret;
    }

    /// Secrets a delivery may be signed with: the global one and every pool's own.
    /// [`Self::candidate_secrets`] with the secret that last verified webhook `hook` first.
    pub fn candidate_secrets_for(&self, hook: Option<u64>) -> Vec<Vec<u8>> {
        let mut out = self.candidate_secrets();
        if let Some(known) = hook.and_then(|h| self.hook_secrets.get(&h))
            && let Some(i) = out.iter().position(|s| s == known)
        {
            let s = out.remove(i);
            out.insert(0, s);
        }
        out
    }

    /// Remember that `secret` verified a delivery of webhook `hook` (bounded: GitHub sends one id
    /// per configured webhook, so a full table means ids nobody configured; they are not learnt).
    pub fn learn_hook(&mut self, hook: u64, secret: &[u8]) {
        if self.hook_secrets.len() >= MAX_HOOKS && !self.hook_secrets.contains_key(&hook) {
            return;
        }
        if self.hook_secrets.get(&hook).map(Vec::as_slice) != Some(secret) {
            self.hook_secrets.insert(hook, secret.to_vec());
        }
    }

    pub fn candidate_secrets(&self) -> Vec<Vec<u8>> {
        let mut out: Vec<Vec<u8>> = self.global_secret.iter().cloned().collect();
        for r in self.pools.values() {
            if let Some(s) = &r.webhook_secret
                && !out.contains(s)
            {
                out.push(s.clone());
            }
        }
        out
    }

    /// The pool serving a job: scope covers the repository, its runners' labels cover the job's
    /// ([`pool_serves`]: the pool's labels plus GitHub's defaults), and (when the
    /// delivery's signing secret is given) the delivery was signed with that pool's secret or, for a
    /// pool without its own, with the global one. Among several, the pool with the fewest labels (the
    /// most specific match), then by namespace/name.
    pub fn route(
        &self,
        repository: &str,
        labels: &[String],
        signed_with: Option<&[u8]>,
    ) -> Option<PoolKey> {
        self.pools
            .iter()
            .filter(|(_, r)| scope_covers(&r.scope, repository) && pool_serves(labels, &r.labels))
            .filter(|(_, r)| signed_with.is_none_or(|s| self.route_accepts(r, s)))
            .min_by_key(|(k, r)| (r.labels.len(), (*k).clone()))
            .map(|(k, _)| k.clone())
    }

    /// Does a delivery signed with `secret` speak for the pool: its own secret, or the global one
    /// for a pool without its own.
    fn route_accepts(&self, route: &PoolRoute, secret: &[u8]) -> bool {
        match &route.webhook_secret {
            Some(own) => own.as_slice() == secret,
            None => self.global_secret.as_deref() == Some(secret),
        }
    }

    /// The one secret a delivery addressed to `pool` (its own path) may be signed with: the
    /// pool's own, else the global one; `None` for an unknown pool or one with neither.
    pub fn secret_for(&self, pool: &PoolKey) -> Option<Vec<u8>> {
        let route = self.pools.get(pool)?;
        route
            .webhook_secret
            .clone()
            .or_else(|| self.global_secret.clone())
    }

    /// Does the pool accept deliveries signed with `secret`? (An unknown pool accepts none.)
    pub fn accepts(&self, pool: &PoolKey, secret: &[u8]) -> bool {
        self.pools
            .get(pool)
            .is_some_and(|r| self.route_accepts(r, secret))
    }

    /// Remembers a delivery by id and body digest; false if either was seen within the TTL.
    pub fn first_delivery(&mut self, id: &str, body_digest: [u8; 32], now: Instant) -> bool {
        self.expire_deliveries(now);
        let keys = [
            DeliveryKey::Id(id.to_owned()),
            DeliveryKey::Digest(body_digest),
        ];
        if keys.iter().any(|k| self.deliveries.contains(k)) {
            return false;
        }
        for k in keys {
            self.deliveries.insert(k.clone());
            self.delivery_order.push_back((now, k));
        }
        while self.delivery_order.len() > self.limits.max_deliveries.saturating_mul(2) {
            if let Some((_, old)) = self.delivery_order.pop_front() {
                self.deliveries.remove(&old);
            }
        }
        true
    }

    fn expire_deliveries(&mut self, now: Instant) {
        while let Some((t, _)) = self.delivery_order.front() {
            if now.duration_since(*t) < self.limits.delivery_ttl {
                break;
            }
            if let Some((_, old)) = self.delivery_order.pop_front() {
                self.deliveries.remove(&old);
            }
        }
    }

    /// Applies a job observation; returns the pool whose demand changed (to reconcile it).
    /// `signed_with` is the secret that verified a delivery (None for the sweep): it restricts the
    /// routing of a new job (see [`Demand::route`]), and a known job changes only if its pool accepts
    /// that secret, so one tenant's deliveries cannot touch another's jobs.
    pub fn observe(
        &mut self,
        u: JobUpdate,
        signed_with: Option<&[u8]>,
        now: Instant,
    ) -> Option<PoolKey> {
        let id = u.id;
        let before = self.jobs.get(&id).map(Job::tier);
        let pool = self.observe_in_place(u, signed_with, now);
        // A known job may have moved between pools or tiers; a new one was counted by insert.
        if let Some(before) = before
            && let Some(after) = self.jobs.get(&id).map(Job::tier)
            && before != after
        {
            self.untally(&before);
            self.tally(id, &after);
        }
        self.bound_jobs();
        pool
    }

    fn observe_in_place(
        &mut self,
        u: JobUpdate,
        signed_with: Option<&[u8]>,
        now: Instant,
    ) -> Option<PoolKey> {
        if let Some(job) = self.jobs.get(&u.id) {
            let allowed = match (signed_with, &job.pool) {
                (None, _) => true,
                (Some(s), Some(p)) => self.accepts(p, s),
                // Known without a pool (the sweep found it first): the delivery may route it.
                (Some(s), None) => self.route(&job.repository, &job.labels, Some(s)).is_some(),
            };
            if !allowed {
                return None;
            }
            let reroute = job.pool.is_none();
            let pool = if reroute {
                self.route(&job.repository, &job.labels, signed_with)
            } else {
                job.pool.clone()
            };
            let at = since(&u, self.wall(now));
            let job = self.jobs.get_mut(&u.id).expect("checked above");
            job.updated_at = now;
            if u.state == JobState::Queued || u.state == JobState::InProgress {
                job.misses = 0;
            }
            let was_routed = !reroute || pool.is_none();
            job.pool = pool;
            if u.state < job.state || (u.state == job.state && u.runner_name == job.runner_name) {
                // Stale or repeated: keep what we know, but it is still alive.
                return if was_routed { None } else { job.pool.clone() };
            }
            let completed = u.state == JobState::Completed && job.state != JobState::Completed;
            job.state = u.state;
            if u.runner_name.is_some() {
                job.runner_name = u.runner_name;
            }
            job.run_id = job.run_id.or(u.run_id);
            job.record_step(u.state, at, u.created_at);
            let pool = job.pool.clone();
            if completed {
                self.completed_order.push_back(u.id);
                self.held.0 = self.held.0.saturating_sub(1);
                self.held.1 += 1;
            }
            return pool;
        }
        let pool = self.route(&u.repository, &u.labels, signed_with);
        if pool.is_none() && signed_with.is_some() {
            // A delivery no pool accepts is not kept: a later pool must not inherit a job whose
            // delivery it would have refused. The sweep finds such jobs once a pool serves them.
            return None;
        }
        let at = since(&u, self.wall(now));
        let mut job = Job {
            id: u.id,
            state: u.state,
            repository: u.repository,
            labels: u.labels,
            runner_name: u.runner_name,
            pool: pool.clone(),
            learnt_at: now,
            updated_at: now,
            picked_up: false,
            misses: 0,
            run_id: u.run_id,
            queued_at: None,
            picked_up_at: None,
            completed_at: None,
            run_observed: false,
        };
        job.record_step(u.state, at, u.created_at);
        self.insert(job);
        pool
    }

    fn insert(&mut self, job: Job) {
        if job.state == JobState::Completed {
            self.completed_order.push_back(job.id);
            self.held.1 += 1;
        } else {
            self.held.0 += 1;
            self.tally(job.id, &job.tier());
        }
        if let Some(old) = self.jobs.insert(job.id, job) {
            // Replaced (not reached by observe, which updates known jobs): count it once.
            self.uncount(&old);
        }
    }

    fn uncount(&mut self, job: &Job) {
        if job.state == JobState::Completed {
            self.held.1 = self.held.1.saturating_sub(1);
        } else {
            self.held.0 = self.held.0.saturating_sub(1);
            self.untally(&job.tier());
        }
    }

    /// Counts job `id` as active in its pool (tier `(true, pool)`); completed jobs are not.
    fn tally(&mut self, id: u64, (active, pool): &(bool, Option<PoolKey>)) {
        if *active {
            let p = self.active.entry(pool.clone()).or_default();
            p.held += 1;
            p.order.push_back(id);
        }
    }

    fn untally(&mut self, (active, pool): &(bool, Option<PoolKey>)) {
        if *active && let Some(p) = self.active.get_mut(pool) {
            p.held = p.held.saturating_sub(1);
        }
    }

    fn remove_job(&mut self, id: u64) -> Option<Job> {
        let job = self.jobs.remove(&id)?;
        self.uncount(&job);
        Some(job)
    }

    /// Evicts the oldest jobs beyond the limits and drops stale entries of the order queues:
    /// completed ones by completion order; active ones from a pool over `max_jobs_per_pool`, else
    /// (the table over `max_jobs`) from the pool holding the most, oldest of that pool first.
    /// Amortised O(pools) per insert.
    fn bound_jobs(&mut self) {
        let jobs = &mut self.jobs;
        let evicted = &self.metrics.evicted;
        let max = self.limits.max_completed;
        let order = &mut self.completed_order;
        let done = |j: Option<&Job>| j.is_some_and(|j| j.state == JobState::Completed);
        // Entries of jobs that left this tier (expired, evicted) are stale.
        if order.len() > max.saturating_mul(2).max(64) {
            order.retain(|id| done(jobs.get(id)));
        }
        while self.held.1 > max {
            let Some(id) = order.pop_front() else { break };
            if done(jobs.get(&id)) {
                jobs.remove(&id);
                evicted.inc();
                self.held.1 -= 1;
            }
        }
        while let Some(pool) = self.pool_to_trim() {
            let (jobs, evicted) = (&mut self.jobs, &self.metrics.evicted);
            let p = self.active.get_mut(&pool).expect("chosen among the held");
            let member = |j: Option<&Job>| {
                j.is_some_and(|j| j.state != JobState::Completed && j.pool == pool)
            };
            if p.order.len() > p.held.saturating_mul(2).max(64) {
                p.order.retain(|id| member(jobs.get(id)));
            }
            let Some(id) = p.order.pop_front() else {
                // Counted but not in the order: only a bug could do it; recount, never spin.
                p.held = 0;
                continue;
            };
            if member(jobs.get(&id)) {
                jobs.remove(&id);
                evicted.inc();
                p.held -= 1;
                self.held.0 = self.held.0.saturating_sub(1);
            }
        }
        self.active.retain(|_, p| p.held > 0 || !p.order.is_empty());
        self.metrics.jobs.set(self.jobs.len() as i64);
    }

    /// The pool whose oldest active job goes next, if any must: one over its own cap, else (the
    /// table full) the one holding the most; ties to the smaller key, for determinism.
    fn pool_to_trim(&self) -> Option<Option<PoolKey>> {
        let heaviest = self
            .active
            .iter()
            .filter(|(_, p)| p.held > 0)
            .max_by(|a, b| a.1.held.cmp(&b.1.held).then_with(|| b.0.cmp(a.0)))?;
        (heaviest.1.held > self.limits.max_jobs_per_pool || self.held.0 > self.limits.max_jobs)
            .then(|| heaviest.0.clone())
    }

    fn recount(&mut self) {
        let completed = self
            .jobs
            .values()
            .filter(|j| j.state == JobState::Completed)
            .count();
        self.held = (self.jobs.len() - completed, completed);
        // Each pool's order rebuilt oldest first (learnt), so eviction keeps its meaning.
        let mut active: Vec<&Job> = self
            .jobs
            .values()
            .filter(|j| j.state != JobState::Completed)
            .collect();
        active.sort_by_key(|j| (j.learnt_at, j.id));
        self.active.clear();
        for j in active {
            let p = self.active.entry(j.pool.clone()).or_default();
            p.held += 1;
            p.order.push_back(j.id);
        }
    }

    /// Applies a sweep: `observed` are the jobs listed for `repositories` (every job of their active
    /// runs, any state), listing having begun at `started`. Each listed job is observed; one whose
    /// recorded pool is not the pool its listed labels route to was routed by a delivery GitHub
    /// contradicts and is routed again. A queued job of those repositories that the listing does
    /// not show and that nothing updated since it began is missed; after `sweep_misses_to_drop`
    /// consecutive misses it is gone (picked up or cancelled while its webhooks were lost).
    /// Returns the pools whose demand changed.
    pub fn observe_sweep(
        &mut self,
        repositories: &[String],
        observed: Vec<JobUpdate>,
        started: Instant,
        now: Instant,
    ) -> HashSet<PoolKey> {
        let mut changed = HashSet::new();
        let listed: HashSet<u64> = observed.iter().map(|j| j.id).collect();
        for u in observed {
            let routed = self.route(&u.repository, &u.labels, None);
            match self.jobs.get(&u.id) {
                None if u.state == JobState::Completed => continue,
                Some(j) if routed.is_some() && j.pool != routed => {
                    if let Some(old) = self.remove_job(u.id).and_then(|j| j.pool) {
                        changed.insert(old);
                    }
                }
                _ => {}
            }
            let before = self.jobs.get(&u.id).map(|j| (j.state, j.pool.clone()));
            let pool = self.observe(u.clone(), None, now);
            let after = self.jobs.get(&u.id).map(|j| (j.state, j.pool.clone()));
            if let Some(p) = pool
                && before != after
            {
                changed.insert(p);
            }
        }
        let covered = |repo: &str| repositories.iter().any(|r| r.eq_ignore_ascii_case(repo));
        let limit = self.limits.sweep_misses_to_drop.max(1);
        let mut gone = Vec::new();
        for j in self.jobs.values_mut().filter(|j| {
            j.state == JobState::Queued
                && !listed.contains(&j.id)
                && j.updated_at < started
                && covered(&j.repository)
        }) {
            j.misses = j.misses.saturating_add(1);
            if j.misses >= limit {
                gone.push(j.id);
            }
        }
        for id in gone {
            if let Some(j) = self.remove_job(id)
                && let Some(p) = j.pool
            {
                changed.insert(p);
            }
        }
        self.bound_jobs();
        changed
    }

    /// Drops completed jobs after `completed_ttl` and any job not updated for `job_ttl`.
    pub fn expire_jobs(&mut self, now: Instant) {
        let limits = &self.limits;
        self.jobs.retain(|_, j| {
            let age = now.duration_since(j.updated_at);
            match j.state {
                JobState::Completed => age < limits.completed_ttl,
                _ => age < limits.job_ttl,
            }
        });
        self.recount();
        self.bound_jobs();
    }

    /// The demand of one pool.
    pub fn pool_demand(&self, key: &PoolKey) -> PoolDemand {
        let mut d = PoolDemand::default();
        for j in self.jobs.values().filter(|j| j.pool.as_ref() == Some(key)) {
            match j.state {
                JobState::Queued => d.queued += 1,
                JobState::InProgress => {
                    if let Some(r) = &j.runner_name {
                        d.busy_runners.insert(r.clone());
                    }
                }
                JobState::Completed => {}
            }
        }
        d
    }

    /// The job a runner of the pool took (in progress or done), the first time it is asked: its pickup
    /// latency is then measured from when the job was learnt to when that runner reached Started.
    pub fn take_pickup(&mut self, key: &PoolKey, runner_name: &str) -> Option<Instant> {
        let job = self.jobs.values_mut().find(|j| {
            j.pool.as_ref() == Some(key)
                && !j.picked_up
                && j.state != JobState::Queued
                && j.runner_name.as_deref() == Some(runner_name)
        })?;
        job.picked_up = true;
        Some(job.learnt_at)
    }

    /// The job the pool's runner `runner_name` took, if known.
    pub fn served_by(&self, key: &PoolKey, runner_name: &str) -> Option<ServedJob> {
        self.jobs
            .values()
            .filter(|j| {
                j.pool.as_ref() == Some(key)
                    && j.state != JobState::Queued
                    && j.runner_name.as_deref() == Some(runner_name)
            })
            .max_by_key(|j| j.learnt_at)
            .map(|j| ServedJob {
                id: j.id,
                run_id: j.run_id,
                repository: j.repository.clone(),
                runner_name: runner_name.to_owned(),
                queued_at: j.queued_at,
                picked_up_at: j.picked_up_at,
                completed_at: j.completed_at,
            })
    }

    /// Completed jobs of the pool whose pickup and completion this process saw and whose `run`
    /// phase was not observed yet, once each: (picked up, completed).
    pub fn take_completed_runs(&mut self, key: &PoolKey) -> Vec<(Timestamp, Timestamp)> {
        self.jobs
            .values_mut()
            .filter(|j| j.pool.as_ref() == Some(key) && !j.run_observed)
            .filter_map(|j| {
                let span = (j.picked_up_at?, j.completed_at?);
                j.run_observed = true;
                Some(span)
            })
            .collect()
    }

    /// Routing entries of every pool (the sweep groups them by App).
    pub fn pools(&self) -> impl Iterator<Item = (&PoolKey, &PoolRoute)> {
        self.pools.iter()
    }

    pub fn job(&self, id: u64) -> Option<&Job> {
        self.jobs.get(&id)
    }

    pub fn job_count(&self) -> usize {
        self.jobs.len()
    }

    pub fn delivery_count(&self) -> usize {
        self.deliveries.len()
    }
}

/// When the step `u` reports began: GitHub's time for it when given and not in our future, else the
/// observation (`now`, on the wall clock).
fn since(u: &JobUpdate, now: Timestamp) -> Timestamp {
    u.since.filter(|t| *t <= now).unwrap_or(now)
}

impl Job {
    /// Whether it counts against its pool's cap (active), and that pool.
    fn tier(&self) -> (bool, Option<PoolKey>) {
        (self.state != JobState::Completed, self.pool.clone())
    }

    /// Records when the job reached `state` (the first report of each step wins; reordered or repeated
    /// deliveries do not move it). A job first seen past `queued` takes GitHub's `created_at` as its
    /// queued time.
    fn record_step(&mut self, state: JobState, at: Timestamp, created_at: Option<Timestamp>) {
        match state {
            JobState::Queued => {
                self.queued_at.get_or_insert(at);
            }
            JobState::InProgress => {
                self.picked_up_at.get_or_insert(at);
            }
            JobState::Completed => {
                self.completed_at.get_or_insert(at);
            }
        }
        if state != JobState::Queued && self.queued_at.is_none() {
            self.queued_at = created_at.filter(|c| *c <= at);
        }
    }
}

/// The sweep's listing as job observations: statuses that are not demand (`waiting`, `pending`,
/// `requested`) are left out.
pub fn sweep_updates(jobs: Vec<(String, WorkflowJob)>) -> Vec<JobUpdate> {
    jobs.into_iter()
        .filter_map(|(repository, j)| {
            let state = JobState::parse(&j.status)?;
            let time = |t: &Option<String>| t.as_deref().and_then(|t| t.parse::<Timestamp>().ok());
            let since = match state {
                JobState::Queued => time(&j.created_at),
                JobState::InProgress => time(&j.started_at),
                JobState::Completed => time(&j.completed_at),
            };
            Some(JobUpdate {
                id: j.id,
                state,
                repository,
                labels: j.labels,
                runner_name: j.runner_name.filter(|n| !n.is_empty()),
                run_id: Some(j.run_id),
                since,
                created_at: time(&j.created_at),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    fn route(labels: &[&str], secret: Option<&str>) -> PoolRoute {
        PoolRoute {
            labels: s(labels),
            scope: RunnerScope::org("acme"),
            webhook_secret: secret.map(|x| x.as_bytes().to_vec()),
        }
    }

    fn queued(id: u64, labels: &[&str]) -> JobUpdate {
        JobUpdate {
            id,
            state: JobState::Queued,
            repository: "acme/app".into(),
            labels: s(labels),
            runner_name: None,
            run_id: None,
            since: None,
            created_at: None,
        }
    }

    fn key(n: &str) -> PoolKey {
        PoolKey::new("ns", n)
    }

    #[test]
    fn a_known_hook_is_checked_against_its_secret_first() {
        let mut d = Demand::default();
        d.set_global_secret(Some(b"g".to_vec()));
        d.upsert_pool(key("a"), route(&["self-hosted"], Some("a")));
        d.upsert_pool(key("b"), route(&["self-hosted"], Some("b")));
        let order = |d: &Demand, hook| d.candidate_secrets_for(hook);
        assert_eq!(
            order(&d, Some(7)),
            d.candidate_secrets(),
            "unknown hook: every secret"
        );
        d.learn_hook(7, b"b");
        assert_eq!(order(&d, Some(7))[0], b"b".to_vec());
        assert_eq!(order(&d, Some(7)).len(), 3, "the others stay, after it");
        assert_eq!(order(&d, Some(8)), d.candidate_secrets());
        assert_eq!(order(&d, None), d.candidate_secrets());
        // A hook learnt with a secret no pool has any more: the plain order.
        d.learn_hook(9, b"gone");
        assert_eq!(order(&d, Some(9)), d.candidate_secrets());
        // Relearnt when another secret verifies it.
        d.learn_hook(7, b"a");
        assert_eq!(order(&d, Some(7))[0], b"a".to_vec());
    }

    #[test]
    fn hooks_learnt_are_bounded() {
        let mut d = Demand::default();
        d.upsert_pool(key("a"), route(&["self-hosted"], Some("a")));
        for hook in 0..(MAX_HOOKS as u64 + 100) {
            d.learn_hook(hook, b"a");
        }
        assert_eq!(d.hook_secrets.len(), MAX_HOOKS);
        assert_eq!(
            d.candidate_secrets_for(Some(MAX_HOOKS as u64 + 1))[0],
            b"a".to_vec()
        );
        // A known hook is still relearnt when full.
        d.learn_hook(0, b"b");
        assert_eq!(d.hook_secrets[&0], b"b".to_vec());
    }

    #[test]
    fn scopes_cover_their_repositories() {
        assert!(scope_covers(&RunnerScope::org("Acme"), "acme/app"));
        assert!(!scope_covers(&RunnerScope::org("acme"), "other/app"));
        assert!(scope_covers(&RunnerScope::repo("acme", "app"), "acme/app"));
        assert!(!scope_covers(
            &RunnerScope::repo("acme", "app"),
            "acme/other"
        ));
    }

    #[test]
    fn the_most_specific_pool_wins_and_secrets_restrict_routing() {
        let mut d = Demand::default();
        d.upsert_pool(
            key("wide"),
            route(&["self-hosted", "imp", "linux", "x64"], None),
        );
        d.upsert_pool(key("narrow"), route(&["self-hosted", "imp"], Some("n")));
        d.set_global_secret(Some(b"g".to_vec()));
        let job = s(&["self-hosted", "imp"]);
        assert_eq!(d.route("acme/app", &job, None), Some(key("narrow")));
        assert_eq!(d.route("acme/app", &job, Some(b"n")), Some(key("narrow")));
        // Signed with the global secret: only pools without their own secret.
        assert_eq!(d.route("acme/app", &job, Some(b"g")), Some(key("wide")));
        assert_eq!(d.route("acme/app", &job, Some(b"zzz")), None);
        // A delivery no pool accepts is not kept for later pools.
        let mut u = queued(5, &["self-hosted", "imp"]);
        u.labels = job.clone();
        assert_eq!(d.observe(u, Some(b"zzz"), Instant::now()), None);
        assert!(d.job(5).is_none());
        assert_eq!(d.route("acme/app", &s(&["gpu"]), None), None);
        assert_eq!(d.route("else/app", &job, None), None);
        let mut secrets = d.candidate_secrets();
        secrets.sort();
        assert_eq!(secrets, vec![b"g".to_vec(), b"n".to_vec()]);
    }

    #[test]
    fn job_states_only_move_forward() {
        let mut d = Demand::default();
        d.upsert_pool(key("p"), route(&["imp"], None));
        let now = Instant::now();
        assert_eq!(d.observe(queued(1, &["imp"]), None, now), Some(key("p")));
        assert_eq!(d.pool_demand(&key("p")).queued, 1);
        let mut started = queued(1, &["imp"]);
        started.state = JobState::InProgress;
        started.runner_name = Some("p-abc".into());
        assert_eq!(d.observe(started.clone(), None, now), Some(key("p")));
        let pd = d.pool_demand(&key("p"));
        assert_eq!(pd.queued, 0);
        assert!(pd.busy_runners.contains("p-abc"));
        // A late (reordered) queued delivery changes nothing.
        assert_eq!(d.observe(queued(1, &["imp"]), None, now), None);
        assert_eq!(d.job(1).unwrap().state, JobState::InProgress);
        let mut done = started;
        done.state = JobState::Completed;
        assert_eq!(d.observe(done, None, now), Some(key("p")));
        assert_eq!(d.pool_demand(&key("p")), PoolDemand::default());
    }

    #[test]
    fn completed_before_queued_never_counts() {
        let mut d = Demand::default();
        d.upsert_pool(key("p"), route(&["imp"], None));
        let now = Instant::now();
        let mut done = queued(7, &["imp"]);
        done.state = JobState::Completed;
        d.observe(done, None, now);
        d.observe(queued(7, &["imp"]), None, now);
        assert_eq!(d.pool_demand(&key("p")).queued, 0);
    }

    fn digest(n: u8) -> [u8; 32] {
        [n; 32]
    }

    #[test]
    fn deliveries_are_deduplicated_with_bounded_memory_and_ttl() {
        let mut d = Demand::new(DemandLimits {
            max_deliveries: 2,
            delivery_ttl: Duration::from_secs(10),
            ..DemandLimits::default()
        });
        let t0 = Instant::now();
        assert!(d.first_delivery("a", digest(1), t0));
        assert!(!d.first_delivery("a", digest(1), t0));
        assert!(d.first_delivery("b", digest(2), t0));
        assert!(d.first_delivery("c", digest(3), t0));
        assert_eq!(d.delivery_count(), 4, "two deliveries, id and digest each");
        // "a" was evicted by size.
        assert!(d.first_delivery("a", digest(1), t0));
        // Everything expires after the TTL.
        assert!(d.first_delivery("c", digest(3), t0 + Duration::from_secs(11)));
        assert_eq!(d.delivery_count(), 2);
    }

    #[test]
    fn a_replayed_body_under_a_new_id_is_a_duplicate() {
        let mut d = Demand::default();
        let t0 = Instant::now();
        assert!(d.first_delivery("a", digest(1), t0));
        assert!(!d.first_delivery("fresh-id", digest(1), t0), "same body");
        assert!(!d.first_delivery("a", digest(9), t0), "same id");
        assert!(d.first_delivery("b", digest(2), t0));
    }

    fn two_tenants() -> Demand {
        let mut d = Demand::default();
        d.upsert_pool(key("a"), route(&["imp", "a"], Some("A")));
        d.upsert_pool(key("b"), route(&["imp", "b"], Some("B")));
        d
    }

    fn with_state(mut u: JobUpdate, state: JobState, runner: Option<&str>) -> JobUpdate {
        u.state = state;
        u.runner_name = runner.map(str::to_owned);
        u
    }

    #[test]
    fn a_delivery_changes_only_jobs_of_pools_accepting_its_secret() {
        let mut d = two_tenants();
        let t0 = Instant::now();
        assert_eq!(
            d.observe(queued(1, &["imp", "b"]), Some(b"B"), t0),
            Some(key("b"))
        );
        assert!(!d.accepts(&key("b"), b"A") && d.accepts(&key("b"), b"B"));
        assert!(!d.accepts(&key("gone"), b"B"));
        // A's secret cannot complete, start or re-queue B's job.
        for (state, runner) in [
            (JobState::Completed, None),
            (JobState::InProgress, Some("a-x")),
        ] {
            let u = with_state(queued(1, &["imp", "b"]), state, runner);
            assert_eq!(d.observe(u, Some(b"A"), t0), None);
            assert_eq!(d.job(1).unwrap().state, JobState::Queued);
        }
        assert_eq!(d.pool_demand(&key("b")).queued, 1);
        // B's own secret can.
        let done = with_state(queued(1, &["imp", "b"]), JobState::Completed, None);
        assert_eq!(d.observe(done, Some(b"B"), t0), Some(key("b")));
        assert_eq!(d.pool_demand(&key("b")).queued, 0);
    }

    #[test]
    fn a_job_the_sweep_found_first_is_routed_by_an_accepted_delivery_only() {
        let mut d = two_tenants();
        let t0 = Instant::now();
        // The sweep found a job no pool serves yet: a delivery no pool accepts cannot claim it.
        d.observe(queued(1, &["imp", "c"]), None, t0);
        assert_eq!(d.job(1).unwrap().pool, None);
        let start = with_state(queued(1, &["imp", "c"]), JobState::InProgress, Some("x"));
        assert_eq!(d.observe(start, Some(b"A"), t0), None);
        assert_eq!(d.job(1).unwrap().state, JobState::Queued);
    }

    #[test]
    fn a_forged_record_is_rerouted_by_the_sweep() {
        let mut d = two_tenants();
        let t0 = Instant::now();
        // Pool A's signer pre-sends a `completed` for a future job id with A's labels.
        let forged = with_state(queued(7, &["imp", "a"]), JobState::Completed, None);
        assert_eq!(d.observe(forged, Some(b"A"), t0), Some(key("a")));
        // The real job is B's: B's delivery is refused (the record is A's) ...
        let real = queued(7, &["imp", "b"]);
        assert_eq!(d.observe(real.clone(), Some(b"B"), t0), None);
        assert_eq!(d.pool_demand(&key("b")).queued, 0);
        // ... but GitHub's own listing routes it to B: the record is replaced.
        let t1 = t0 + Duration::from_secs(1);
        let changed = d.observe_sweep(&s(&["acme/app"]), vec![real], t1, t1);
        assert_eq!(changed, HashSet::from([key("a"), key("b")]));
        assert_eq!(d.job(7).unwrap().pool, Some(key("b")));
        assert_eq!(d.pool_demand(&key("b")).queued, 1);
    }

    #[test]
    fn forged_future_jobs_leave_memory_bounded_and_count_evictions() {
        let metrics = DemandMetrics::default();
        let mut d = Demand::new(DemandLimits {
            max_jobs: 100,
            max_completed: 50,
            ..DemandLimits::default()
        })
        .with_metrics(metrics.clone());
        d.upsert_pool(key("a"), route(&["imp"], Some("A")));
        let t0 = Instant::now();
        d.observe(queued(1, &["imp"]), Some(b"A"), t0);
        for id in 1_000..101_000u64 {
            let u = with_state(queued(id, &["imp"]), JobState::Completed, None);
            d.observe(u, Some(b"A"), t0);
        }
        assert_eq!(d.job_count(), 51, "the active job and 50 completed");
        assert!(d.completed_order.len() <= 128, "order queue bounded too");
        assert_eq!(metrics.evicted.get(), 100_000 - 50);
        assert_eq!(metrics.jobs.get(), 51);
        // The active tier is bounded on its own: completed floods never evict queued demand.
        assert_eq!(d.pool_demand(&key("a")).queued, 1);
        for id in 200_000..200_150u64 {
            d.observe(queued(id, &["imp"]), Some(b"A"), t0);
        }
        assert_eq!(d.pool_demand(&key("a")).queued, 100);
        assert!(d.job(1).is_none(), "the oldest active job went first");
        // Completing jobs moves them between tiers without losing count.
        for id in 200_100..200_150u64 {
            let u = with_state(queued(id, &["imp"]), JobState::Completed, None);
            d.observe(u, Some(b"A"), t0);
        }
        assert_eq!(d.pool_demand(&key("a")).queued, 50);
        assert_eq!(d.job_count(), 100);
    }

    #[test]
    fn one_pools_flood_of_signed_queued_jobs_evicts_only_its_own() {
        // Issue 30: tenant A floods 100k validly signed `queued` deliveries for repositories the
        // sweep never lists; tenant B's queued job must stay.
        let metrics = DemandMetrics::default();
        let mut d = Demand::default().with_metrics(metrics.clone());
        d.upsert_pool(key("a"), route(&["a"], Some("A")));
        d.upsert_pool(key("b"), route(&["b"], Some("B")));
        let t0 = Instant::now();
        assert_eq!(d.observe(queued(1, &["b"]), Some(b"B"), t0), Some(key("b")));
        for id in 1_000..101_000u64 {
            d.observe(queued(id, &["a"]), Some(b"A"), t0);
        }
        assert_eq!(d.pool_demand(&key("b")).queued, 1);
        let cap = d.limits.max_jobs_per_pool;
        assert_eq!(d.pool_demand(&key("a")).queued as usize, cap);
        assert_eq!(metrics.evicted.get(), (100_000 - cap) as u64);
        // A's own oldest went first; its newest are held.
        assert!(d.job(1_000).is_none() && d.job(100_999).is_some());
        assert!(d.active[&Some(key("a"))].order.len() <= 2 * cap + 64);
    }

    #[test]
    fn a_full_table_evicts_from_the_pool_holding_the_most() {
        let mut d = Demand::new(DemandLimits {
            max_jobs: 6,
            max_jobs_per_pool: 4,
            ..DemandLimits::default()
        });
        for (p, l) in [("a", "A"), ("b", "B"), ("c", "C")] {
            d.upsert_pool(key(p), route(&[p], Some(l)));
        }
        let t0 = Instant::now();
        let mut next = 0u64;
        let mut add = |d: &mut Demand, pool: &str, secret: &[u8], n: usize| {
            for _ in 0..n {
                next += 1;
                d.observe(queued(next, &[pool]), Some(secret), t0);
            }
        };
        add(&mut d, "b", b"B", 2);
        add(&mut d, "a", b"A", 6);
        // A is capped at 4 on its own (its first two went), B untouched.
        let held = |d: &Demand| ["a", "b", "c"].map(|p| d.pool_demand(&key(p)).queued);
        assert_eq!(held(&d), [4, 2, 0]);
        assert!(d.job(3).is_none() && d.job(4).is_none() && d.job(1).is_some());
        // The table (6) is full: C's job evicts from A, the pool holding the most.
        add(&mut d, "c", b"C", 1);
        assert_eq!(held(&d), [3, 2, 1]);
        assert!(d.job(5).is_none(), "A's oldest");
        // Equal holdings: the tie goes to the smaller key, deterministically.
        add(&mut d, "b", b"B", 1);
        assert_eq!(held(&d), [2, 3, 1]);
        // Completing and rerouting keep the counts: B's jobs done free B's share.
        for id in [1, 2] {
            let u = with_state(queued(id, &["b"]), JobState::Completed, None);
            d.observe(u, Some(b"B"), t0);
        }
        assert_eq!(held(&d), [2, 1, 1]);
        d.remove_pool(&key("c"));
        assert_eq!(d.active[&None].held, 1, "C's job is unrouted now");
        add(&mut d, "a", b"A", 2);
        assert_eq!(held(&d), [4, 1, 0]);
        assert_eq!(d.held.0, 6);
    }

    #[test]
    fn a_job_queued_before_its_pool_is_routed_when_the_pool_appears() {
        let mut d = Demand::default();
        let now = Instant::now();
        assert_eq!(d.observe(queued(1, &["imp"]), None, now), None);
        assert!(d.upsert_pool(key("p"), route(&["imp"], None)));
        assert_eq!(d.pool_demand(&key("p")).queued, 1);
        // Unchanged registration: no re-routing work.
        assert!(!d.upsert_pool(key("p"), route(&["imp"], None)));
        d.remove_pool(&key("p"));
        assert_eq!(d.pool_demand(&key("p")).queued, 0);
    }

    #[test]
    fn the_sweep_adds_lost_jobs_and_drops_vanished_ones_after_two_misses() {
        let mut d = Demand::default();
        d.upsert_pool(key("p"), route(&["imp"], None));
        let t0 = Instant::now();
        d.observe(queued(1, &["imp"]), None, t0);
        let started = t0 + Duration::from_millis(10);
        // Job 3 arrives by webhook while the sweep is listing: it must survive.
        d.observe(
            queued(3, &["imp"]),
            None,
            started + Duration::from_millis(1),
        );
        let changed = d.observe_sweep(
            &s(&["acme/app"]),
            vec![queued(2, &["imp"])],
            started,
            started + Duration::from_millis(5),
        );
        assert_eq!(changed, HashSet::from([key("p")]));
        assert_eq!(d.job(1).unwrap().misses, 1, "missed once: still demand");
        assert!(d.job(2).is_some(), "found by the sweep");
        assert!(d.job(3).is_some(), "newer than the listing");
        assert_eq!(d.pool_demand(&key("p")).queued, 3);
        // Another repository's jobs are not judged by this listing.
        let mut other = queued(4, &["imp"]);
        other.repository = "acme/other".into();
        d.observe(other, None, t0);
        let t1 = started + Duration::from_secs(1);
        let changed = d.observe_sweep(
            &s(&["acme/app"]),
            vec![queued(2, &["imp"]), queued(3, &["imp"])],
            t1,
            t1,
        );
        assert_eq!(changed, HashSet::from([key("p")]));
        assert!(d.job(1).is_none(), "missed twice: gone");
        assert!(d.job(4).is_some());
        assert_eq!(d.pool_demand(&key("p")).queued, 3);
        // An unchanged listing changes nothing.
        let t2 = t1 + Duration::from_secs(1);
        let changed = d.observe_sweep(
            &s(&["acme/app"]),
            vec![queued(2, &["imp"]), queued(3, &["imp"])],
            t2,
            t2,
        );
        assert!(changed.is_empty());
    }

    #[test]
    fn a_listing_showing_the_job_again_resets_its_misses() {
        let mut d = Demand::default();
        d.upsert_pool(key("p"), route(&["imp"], None));
        let t0 = Instant::now();
        d.observe(queued(1, &["imp"]), None, t0);
        let repos = s(&["acme/app"]);
        let at = |n| t0 + Duration::from_secs(n);
        d.observe_sweep(&repos, vec![], at(1), at(1));
        d.observe_sweep(&repos, vec![queued(1, &["imp"])], at(2), at(2));
        d.observe_sweep(&repos, vec![], at(3), at(3));
        assert_eq!(d.job(1).unwrap().misses, 1);
    }

    #[test]
    fn queued_jobs_of_in_progress_runs_stay_demand() {
        // One run: job 1 in progress on some runner, 2 and 3 queued. The listing of the
        // in-progress run shows all three; the pool still wants 2.
        let mut d = Demand::default();
        d.upsert_pool(key("p"), route(&["imp"], None));
        let t0 = Instant::now();
        let listing = || {
            vec![
                with_state(queued(1, &["imp"]), JobState::InProgress, Some("p-1")),
                queued(2, &["imp"]),
                queued(3, &["imp"]),
            ]
        };
        for n in 1..4 {
            let t = t0 + Duration::from_secs(n);
            d.observe_sweep(&s(&["acme/app"]), listing(), t, t);
        }
        let pd = d.pool_demand(&key("p"));
        assert_eq!(pd.queued, 2);
        assert_eq!(pd.busy_runners, HashSet::from(["p-1".to_string()]));
        // A completed job of the run is evidence too: it stops counting at once.
        let t = t0 + Duration::from_secs(9);
        let mut l = listing();
        l[1].state = JobState::Completed;
        d.observe_sweep(&s(&["acme/app"]), l, t, t);
        assert_eq!(d.pool_demand(&key("p")).queued, 1);
    }

    #[test]
    fn sweep_updates_leave_out_jobs_that_are_not_demand() {
        let job = |id, status: &str, runner: Option<&str>| {
            (
                "acme/app".to_string(),
                WorkflowJob {
                    id,
                    run_id: 1,
                    name: "build".into(),
                    status: status.into(),
                    labels: s(&["imp"]),
                    created_at: None,
                    started_at: None,
                    completed_at: None,
                    runner_name: runner.map(str::to_owned),
                },
            )
        };
        let u = sweep_updates(vec![
            job(1, "queued", Some("")),
            job(2, "waiting", None),
            job(3, "in_progress", Some("r")),
            job(4, "pending", None),
            job(5, "completed", Some("r")),
        ]);
        let got: Vec<(u64, JobState, Option<String>)> = u
            .into_iter()
            .map(|u| (u.id, u.state, u.runner_name))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, JobState::Queued, None),
                (3, JobState::InProgress, Some("r".into())),
                (5, JobState::Completed, Some("r".into())),
            ]
        );
        assert_eq!(JobState::parse("waiting"), None);
    }

    #[test]
    fn each_step_of_a_job_is_timed_once_and_the_served_job_is_found_by_runner() {
        let mut d = Demand::default();
        d.upsert_pool(key("p"), route(&["imp"], None));
        let t0 = Instant::now();
        let wall0 = d.wall(t0);
        d.observe(queued(1, &["imp"]), None, t0);
        assert_eq!(d.served_by(&key("p"), "p-a"), None, "still queued");
        let mut started = with_state(queued(1, &["imp"]), JobState::InProgress, Some("p-a"));
        started.run_id = Some(77);
        d.observe(started.clone(), None, t0 + Duration::from_secs(3));
        // A repeated in_progress later does not move the pickup.
        d.observe(started, None, t0 + Duration::from_secs(9));
        let s = d.served_by(&key("p"), "p-a").unwrap();
        assert_eq!((s.id, s.run_id), (1, Some(77)));
        assert_eq!(s.queued_at, Some(wall0));
        let secs = |t: Option<Timestamp>| t.map(|t| t.duration_since(wall0).as_secs());
        assert_eq!(secs(s.picked_up_at), Some(3));
        assert_eq!(s.completed_at, None);
        assert!(d.take_completed_runs(&key("p")).is_empty());
        d.observe(
            with_state(queued(1, &["imp"]), JobState::Completed, Some("p-a")),
            None,
            t0 + Duration::from_secs(20),
        );
        let runs = d.take_completed_runs(&key("p"));
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].1.duration_since(runs[0].0).as_secs(), 17);
        assert!(d.take_completed_runs(&key("p")).is_empty(), "once");
        assert_eq!(
            secs(d.served_by(&key("p"), "p-a").unwrap().completed_at),
            Some(20)
        );
    }

    #[test]
    fn the_sweep_times_steps_by_githubs_clock_and_a_late_job_by_its_creation() {
        let mut d = Demand::default();
        d.upsert_pool(key("p"), route(&["imp"], None));
        let t0 = Instant::now();
        let wall0 = d.wall(t0);
        let ago = |s: i64| wall0.checked_sub(SignedDuration::from_secs(s)).unwrap();
        // Seen first in progress (its webhooks lost): queued at its creation, picked up when
        // GitHub says it started.
        let mut u = with_state(queued(5, &["imp"]), JobState::InProgress, Some("p-b"));
        u.created_at = Some(ago(50));
        u.since = Some(ago(20));
        d.observe(u, None, t0);
        let s = d.served_by(&key("p"), "p-b").unwrap();
        assert_eq!(
            (s.queued_at, s.picked_up_at),
            (Some(ago(50)), Some(ago(20)))
        );
        // A GitHub time in our future is not believed.
        let mut q = queued(6, &["imp"]);
        q.since = wall0.checked_add(SignedDuration::from_secs(3600)).ok();
        d.observe(q, None, t0);
        assert_eq!(d.job(6).unwrap().queued_at, Some(wall0));
    }

    #[test]
    fn a_pickup_is_taken_once_per_job_from_its_runner() {
        let mut d = Demand::default();
        d.upsert_pool(key("p"), route(&["imp"], None));
        let t0 = Instant::now();
        d.observe(queued(1, &["imp"]), None, t0);
        assert_eq!(d.take_pickup(&key("p"), "p-a"), None, "still queued");
        let mut started = queued(1, &["imp"]);
        started.state = JobState::InProgress;
        started.runner_name = Some("p-a".into());
        d.observe(started, None, t0 + Duration::from_secs(3));
        assert_eq!(d.take_pickup(&key("p"), "p-b"), None);
        assert_eq!(d.take_pickup(&key("p"), "p-a"), Some(t0));
        assert_eq!(d.take_pickup(&key("p"), "p-a"), None);
    }

    #[test]
    fn old_jobs_expire() {
        let mut d = Demand::new(DemandLimits {
            completed_ttl: Duration::from_secs(1),
            job_ttl: Duration::from_secs(10),
            ..DemandLimits::default()
        });
        let t0 = Instant::now();
        d.observe(queued(1, &["imp"]), None, t0);
        let mut done = queued(2, &["imp"]);
        done.state = JobState::Completed;
        d.observe(done, None, t0);
        d.expire_jobs(t0 + Duration::from_secs(2));
        assert!(d.job(1).is_some() && d.job(2).is_none());
        d.expire_jobs(t0 + Duration::from_secs(11));
        assert_eq!(d.job_count(), 0);
    }
}
