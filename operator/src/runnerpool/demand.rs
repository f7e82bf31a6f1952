//! In-memory demand of every pool: the workflow jobs learnt from webhooks and the queued-job sweep,
//! which pool each job is routed to, and the delivery-id de-duplication set. Nothing here is persisted:
//! after an operator restart the sweep rebuilds the queued jobs and in_progress webhooks rebuild the
//! busy runners (docs/runner-pool.md). Pure state transitions; the webhook receiver and the controller
//! hold it behind a mutex.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::github::RunnerScope;

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
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "queued" | "waiting" => Some(JobState::Queued),
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
}

/// One observation of a job (a webhook or a sweep entry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobUpdate {
    pub id: u64,
    pub state: JobState,
    pub repository: String,
    pub labels: Vec<String>,
    pub runner_name: Option<String>,
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
}

impl Default for DemandLimits {
    fn default() -> Self {
        DemandLimits {
            max_deliveries: 50_000,
            delivery_ttl: Duration::from_secs(6 * 3600),
            completed_ttl: Duration::from_secs(3600),
            job_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

/// The demand state of all pools.
#[derive(Debug)]
pub struct Demand {
    limits: DemandLimits,
    pools: BTreeMap<PoolKey, PoolRoute>,
    jobs: HashMap<u64, Job>,
    deliveries: HashSet<String>,
    delivery_order: VecDeque<(Instant, String)>,
    global_secret: Option<Vec<u8>>,
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

/// Every job label is one of the pool's (case-insensitive, as GitHub matches labels).
pub fn labels_match(job: &[String], pool: &[String]) -> bool {
    !job.is_empty()
        && job
            .iter()
            .all(|j| pool.iter().any(|p| p.eq_ignore_ascii_case(j)))
}

impl Demand {
    pub fn new(limits: DemandLimits) -> Self {
        Demand {
            limits,
            pools: BTreeMap::new(),
            jobs: HashMap::new(),
            deliveries: HashSet::new(),
            delivery_order: VecDeque::new(),
            global_secret: None,
        }
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
    }

    pub fn set_global_secret(&mut self, secret: Option<Vec<u8>>) {
        self.global_secret = secret;
    }

    /// Secrets a delivery may be signed with: the global one and every pool's own.
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

    /// The pool serving a job: scope covers the repository, labels contain the job's, and (when the
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
            .filter(|(_, r)| scope_covers(&r.scope, repository) && labels_match(labels, &r.labels))
            .filter(|(_, r)| match signed_with {
                None => true,
                Some(s) => match &r.webhook_secret {
                    Some(own) => own.as_slice() == s,
                    None => self.global_secret.as_deref() == Some(s),
                },
            })
            .min_by_key(|(k, r)| (r.labels.len(), (*k).clone()))
            .map(|(k, _)| k.clone())
    }

    /// Remembers a delivery id; false if it was seen within the TTL.
    pub fn first_delivery(&mut self, id: &str, now: Instant) -> bool {
        self.expire_deliveries(now);
        if self.deliveries.contains(id) {
            return false;
        }
        self.deliveries.insert(id.to_owned());
        self.delivery_order.push_back((now, id.to_owned()));
        while self.delivery_order.len() > self.limits.max_deliveries {
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
    /// `signed_with` restricts routing of a new job (see [`Demand::route`]).
    pub fn observe(
        &mut self,
        u: JobUpdate,
        signed_with: Option<&[u8]>,
        now: Instant,
    ) -> Option<PoolKey> {
        if let Some(job) = self.jobs.get_mut(&u.id) {
            if u.state < job.state || (u.state == job.state && u.runner_name == job.runner_name) {
                // Stale or repeated: keep what we know, but it is still alive.
                job.updated_at = now;
                return None;
            }
            job.state = u.state;
            if u.runner_name.is_some() {
                job.runner_name = u.runner_name;
            }
            job.updated_at = now;
            return job.pool.clone();
        }
        let pool = self.route(&u.repository, &u.labels, signed_with);
        if pool.is_none() && signed_with.is_some() {
            // A delivery no pool accepts is not kept: a later pool must not inherit a job whose
            // delivery it would have refused. The sweep finds such jobs once a pool serves them.
            return None;
        }
        self.jobs.insert(
            u.id,
            Job {
                id: u.id,
                state: u.state,
                repository: u.repository,
                labels: u.labels,
                runner_name: u.runner_name,
                pool: pool.clone(),
                learnt_at: now,
                updated_at: now,
                picked_up: false,
            },
        );
        pool
    }

    /// Applies a sweep: `queued` are the queued jobs listed for `repositories`, listing having begun
    /// at `started`. Queued jobs of those repositories that the listing no longer shows and that
    /// nothing updated since it began were picked up or cancelled while their webhooks were lost:
    /// they stop counting. Returns the pools whose demand changed.
    pub fn observe_sweep(
        &mut self,
        repositories: &[String],
        queued: Vec<JobUpdate>,
        started: Instant,
        now: Instant,
    ) -> HashSet<PoolKey> {
        let mut changed = HashSet::new();
        let listed: HashSet<u64> = queued.iter().map(|j| j.id).collect();
        for u in queued {
            let known = self.jobs.contains_key(&u.id);
            if let Some(p) = self.observe(u, None, now)
                && !known
            {
                changed.insert(p);
            }
        }
        let covered = |repo: &str| repositories.iter().any(|r| r.eq_ignore_ascii_case(repo));
        let gone: Vec<u64> = self
            .jobs
            .values()
            .filter(|j| {
                j.state == JobState::Queued
                    && !listed.contains(&j.id)
                    && j.updated_at < started
                    && covered(&j.repository)
            })
            .map(|j| j.id)
            .collect();
        for id in gone {
            if let Some(j) = self.jobs.remove(&id)
                && let Some(p) = j.pool
            {
                changed.insert(p);
            }
        }
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
        }
    }

    fn key(n: &str) -> PoolKey {
        PoolKey::new("ns", n)
    }

    #[test]
    fn labels_are_a_case_insensitive_subset() {
        assert!(labels_match(
            &s(&["self-hosted", "IMP"]),
            &s(&["self-hosted", "imp", "linux"])
        ));
        assert!(!labels_match(&s(&["imp", "gpu"]), &s(&["imp", "linux"])));
        assert!(!labels_match(&[], &s(&["imp"])));
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

    #[test]
    fn deliveries_are_deduplicated_with_bounded_memory_and_ttl() {
        let mut d = Demand::new(DemandLimits {
            max_deliveries: 2,
            delivery_ttl: Duration::from_secs(10),
            ..DemandLimits::default()
        });
        let t0 = Instant::now();
        assert!(d.first_delivery("a", t0));
        assert!(!d.first_delivery("a", t0));
        assert!(d.first_delivery("b", t0));
        assert!(d.first_delivery("c", t0));
        assert_eq!(d.delivery_count(), 2);
        // "a" was evicted by size.
        assert!(d.first_delivery("a", t0));
        // Everything expires after the TTL.
        assert!(d.first_delivery("c", t0 + Duration::from_secs(11)));
        assert_eq!(d.delivery_count(), 1);
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
    fn the_sweep_adds_lost_jobs_and_drops_vanished_ones() {
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
        assert!(d.job(1).is_none(), "vanished from the queue");
        assert!(d.job(2).is_some(), "found by the sweep");
        assert!(d.job(3).is_some(), "newer than the listing");
        assert_eq!(d.pool_demand(&key("p")).queued, 2);
        // Another repository's jobs are not judged by this listing.
        let mut other = queued(4, &["imp"]);
        other.repository = "acme/other".into();
        d.observe(other, None, t0);
        d.observe_sweep(
            &s(&["acme/app"]),
            vec![queued(2, &["imp"]), queued(3, &["imp"])],
            started + Duration::from_secs(1),
            started + Duration::from_secs(1),
        );
        assert!(d.job(4).is_some());
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
