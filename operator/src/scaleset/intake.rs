//! The executor of the scale-set intake. [`ScaleSets`] is the registry the pool controller writes
//! (which pools want an intake, with their App and scope) and mints through; [`run_intakes`]
//! keeps one task per wanted pool. A task connects, creates or adopts the scale set, opens the
//! session (a 409 backs off, surfaced as a pool Event, never a tight loop), loads the ledger and
//! then loops: long poll, [`decide::plan_message`], write the ledger, acquire, feed the pool's
//! demand, delete the message. On operator shutdown [`ScaleSets::close_sessions`] deletes the
//! sessions so a successor does not wait for them to expire.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use imp_api::ScaleSetSpec;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::events::Recorder;
use kube::{Api, Client};
use tracing::{info, warn};

use super::client::{AdminConnection, ScaleSetClient, Session};
use super::decide::{
    REASON_LISTENING, confirm_acquired, deaf_for, demand_updates, max_capacity, plan_message,
    recovery,
};
use super::error::ScaleSetError;
use super::ledger::Ledger;
use crate::github::{GithubApp, JitRunner, RunnerScope};
use crate::runnerpool::demand::{JobUpdate, PoolKey};

/// What the intakes need of the process that runs them (the pool controller's shared state,
/// which implements it): the registry, and the pool demand to feed. A trait so this module does
/// not import the state that holds it.
pub trait IntakeHost: Send + Sync + 'static {
    fn scale_sets(&self) -> &ScaleSets;
    /// Applies job updates to the pool's demand; wakes the pool when it changed.
    fn feed_demand(&self, key: &PoolKey, updates: Vec<JobUpdate>);
}

/// What a pool's intake needs; the pool controller hands it over every pass.
#[derive(Clone)]
pub struct IntakeSpec {
    pub key: PoolKey,
    pub app: GithubApp,
    pub scope: RunnerScope,
    pub scale_set: ScaleSetSpec,
    /// Labels the pool's runners serve ([`super::route_labels`]).
    pub labels: Vec<String>,
    pub max_runners: u32,
    /// VMs of the pool's class the nodes can host ([`super::decide::node_slots`]); None: unknown.
    pub node_slots: Option<u32>,
    /// The pool, for the ledger's owner reference and Events.
    pub owner: OwnerReference,
}

impl IntakeSpec {
    /// What restarts the intake when it changes (`maxRunners` and the node slots do not: they
    /// are read live).
    fn fingerprint(&self) -> String {
        format!(
            "{}/{}/{}/{:?}/{:?}/{}",
            self.app.app_id(),
            self.app.installation_id(),
            self.scope,
            self.scale_set,
            self.labels,
            self.owner.uid
        )
    }
}

/// An intake's health, for status and tests.
#[derive(Debug, Clone, Default)]
pub struct Health {
    /// [`super::decide`]'s reasons; `Listening` while polls succeed.
    pub reason: &'static str,
    pub message: String,
    pub last_poll: Option<Instant>,
    pub sessions_opened: u64,
    pub session_conflicts: u64,
    /// Sessions refreshed after the queue refused their token (401).
    pub session_refreshes: u64,
}

/// One pool's live intake state.
pub struct Binding {
    pub spec: IntakeSpec,
    client: ScaleSetClient,
    conn: Mutex<Option<AdminConnection>>,
    set_id: Mutex<Option<u64>>,
    session: Mutex<Option<(u64, Session)>>,
    max_runners: AtomicU32,
    /// [`IntakeSpec::node_slots`], `u32::MAX` when unknown.
    node_slots: AtomicU32,
    health: Mutex<Health>,
    /// When the intake started: a session that never heard anything is deaf from here.
    started: Instant,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Binding {
    fn new(spec: IntakeSpec, poll_timeout: Duration) -> Self {
        let config = &spec.app.inner.config;
        let client = ScaleSetClient::new(
            spec.app.clone(),
            spec.scope.clone(),
            config.api_base_url.clone(),
            config.request_timeout,
            poll_timeout,
        );
        Binding {
            max_runners: AtomicU32::new(spec.max_runners),
            node_slots: AtomicU32::new(spec.node_slots.unwrap_or(u32::MAX)),
            spec,
            client,
            conn: Mutex::new(None),
            set_id: Mutex::new(None),
            session: Mutex::new(None),
            health: Mutex::new(Health::default()),
            started: Instant::now(),
        }
    }

    async fn connection(&self) -> Result<AdminConnection, ScaleSetError> {
        if let Some(c) = lock(&self.conn).clone() {
            return Ok(c);
        }
        let c = self.client.connect().await?;
        *lock(&self.conn) = Some(c.clone());
        Ok(c)
    }

    /// Adopts the scale set of that name, or creates it.
    async fn scale_set(&self, conn: &AdminConnection) -> Result<u64, ScaleSetError> {
        if let Some(id) = *lock(&self.set_id) {
            return Ok(id);
        }
        let s = &self.spec.scale_set;
        let group = self
            .client
            .runner_group_id(conn, s.runner_group.as_deref())
            .await?;
        let set = match self.client.get_scale_set(conn, &s.name, group).await? {
            Some(set) => {
                info!(pool = %self.spec.key, scale_set = %s.name, id = set.id, "adopting the runner scale set");
                set
            }
            None => {
                let set = self
                    .client
                    .create_scale_set(conn, &s.name, group, std::slice::from_ref(&s.name))
                    .await?;
                info!(pool = %self.spec.key, scale_set = %s.name, id = set.id, "created the runner scale set");
                set
            }
        };
        *lock(&self.set_id) = Some(set.id);
        Ok(set.id)
    }

    async fn session(
        &self,
        conn: &AdminConnection,
        set_id: u64,
        owner: &str,
    ) -> Result<Session, ScaleSetError> {
        if let Some((_, s)) = lock(&self.session).clone() {
            return Ok(s);
        }
        let result = self.client.create_session(conn, set_id, owner).await;
        let mut h = lock(&self.health);
        match result {
            Ok(s) => {
                h.sessions_opened += 1;
                drop(h);
                info!(pool = %self.spec.key, session = %s.id, "opened the scale set's message session");
                *lock(&self.session) = Some((set_id, s.clone()));
                Ok(s)
            }
            Err(e) => {
                if matches!(e, ScaleSetError::SessionConflict { .. }) {
                    h.session_conflicts += 1;
                }
                Err(e)
            }
        }
    }

    /// Refreshes the open session's queue token (after a 401 on the queue), with a new admin
    /// token when the old one is refused too. NotFound: the session is gone (open a new one).
    async fn refresh_session(&self) -> Result<(), ScaleSetError> {
        let Some((set_id, old)) = lock(&self.session).clone() else {
            return Ok(());
        };
        let conn = self.connection().await?;
        let fresh = match self.client.refresh_session(&conn, set_id, &old).await {
            Err(ScaleSetError::Unauthorized { .. }) => {
                *lock(&self.conn) = None;
                let conn = self.connection().await?;
                self.client.refresh_session(&conn, set_id, &old).await?
            }
            r => r?,
        };
        info!(pool = %self.spec.key, session = %fresh.id, "refreshed the message session's token");
        lock(&self.health).session_refreshes += 1;
        *lock(&self.session) = Some((set_id, fresh));
        Ok(())
    }

    /// Deletes the session, if one is open (best effort: an undeleted one expires at GitHub).
    async fn close_session(&self) {
        let Some((set_id, session)) = lock(&self.session).take() else {
            return;
        };
        let Some(conn) = lock(&self.conn).clone() else {
            return;
        };
        match self.client.delete_session(&conn, set_id, &session).await {
            Ok(()) => {
                info!(pool = %self.spec.key, session = %session.id, "deleted the message session")
            }
            Err(e) => {
                warn!(pool = %self.spec.key, error = %e, "deleting the message session failed")
            }
        }
    }

    pub fn health(&self) -> Health {
        lock(&self.health).clone()
    }

    /// Records the health; answers whether the reason changed (an Event is due).
    fn set_health(&self, reason: &'static str, message: String) -> bool {
        let mut h = lock(&self.health);
        let changed = h.reason != reason;
        h.reason = reason;
        h.message = message;
        changed
    }

    async fn mint(&self, runner_name: &str, work_folder: &str) -> Result<JitRunner, ScaleSetError> {
        let not_connected = || ScaleSetError::NotConnected(self.spec.scale_set.name.clone());
        let conn = lock(&self.conn).clone().ok_or_else(not_connected)?;
        let set_id = (*lock(&self.set_id)).ok_or_else(not_connected)?;
        let j = self
            .client
            .generate_jit_config(&conn, set_id, runner_name, work_folder)
            .await?;
        Ok(JitRunner {
            runner_id: j.runner_id,
            runner_name: j.runner_name,
            runner_group_id: 0,
            encoded_jit_config: j.encoded_jit_config,
        })
    }
}

/// The registry of scale-set intakes.
pub struct ScaleSets {
    /// The session owner name GitHub shows (this operator process).
    owner: String,
    /// How long a long poll may wait for GitHub (milliseconds; GitHub answers within ~50 s).
    poll_timeout_ms: AtomicU64,
    wants: Mutex<BTreeMap<PoolKey, IntakeSpec>>,
    bindings: Mutex<HashMap<PoolKey, Arc<Binding>>>,
    changed: tokio::sync::Notify,
}

impl Default for ScaleSets {
    fn default() -> Self {
        let owner = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| format!("imp-operator-{:08x}", rand::random::<u32>()));
        ScaleSets::new(owner, Duration::from_secs(50))
    }
}

impl ScaleSets {
    pub fn new(owner: String, poll_timeout: Duration) -> Self {
        ScaleSets {
            owner,
            poll_timeout_ms: AtomicU64::new(poll_timeout.as_millis() as u64),
            wants: Mutex::new(BTreeMap::new()),
            bindings: Mutex::new(HashMap::new()),
            changed: tokio::sync::Notify::new(),
        }
    }

    /// The long-poll window (`--scale-set-poll-timeout`); intakes started later use it.
    pub fn set_poll_timeout(&self, d: Duration) {
        self.poll_timeout_ms
            .store(d.as_millis() as u64, Ordering::Relaxed);
    }

    pub fn poll_timeout(&self) -> Duration {
        Duration::from_millis(self.poll_timeout_ms.load(Ordering::Relaxed))
    }

    /// How long a session may hear nothing before the operator is not Ready: a broker that
    /// answers at all answers every poll within the poll window (202 when empty).
    pub fn deaf_after(&self) -> Duration {
        self.poll_timeout() + super::decide::DEAF_GRACE
    }

    /// The intakes holding a session that heard nothing (no poll answered) for longer than
    /// [`ScaleSets::deaf_after`], with how long: "running but deaf" (readiness).
    pub fn deaf(&self) -> Vec<(PoolKey, Duration)> {
        let bound = self.deaf_after();
        let now = Instant::now();
        let mut out: Vec<(PoolKey, Duration)> = lock(&self.bindings)
            .iter()
            .filter(|(_, b)| lock(&b.session).is_some())
            .filter_map(|(k, b)| {
                let heard = lock(&b.health).last_poll;
                deaf_for(heard, b.started, now, bound).map(|d| (k.clone(), d))
            })
            .collect();
        out.sort();
        out
    }

    /// The pool wants an intake with `spec` (the pool controller, every pass).
    pub fn want(&self, spec: IntakeSpec) {
        let mut wants = lock(&self.wants);
        let changed = wants
            .get(&spec.key)
            .is_none_or(|w| w.fingerprint() != spec.fingerprint());
        if let Some(b) = lock(&self.bindings).get(&spec.key) {
            b.max_runners.store(spec.max_runners, Ordering::Relaxed);
            b.node_slots
                .store(spec.node_slots.unwrap_or(u32::MAX), Ordering::Relaxed);
        }
        wants.insert(spec.key.clone(), spec);
        if changed {
            self.changed.notify_one();
        }
    }

    /// The pool has no intake (deleted, or `scaleSet` removed).
    pub fn forget(&self, key: &PoolKey) {
        if lock(&self.wants).remove(key).is_some() {
            self.changed.notify_one();
        }
    }

    pub fn health(&self, key: &PoolKey) -> Option<Health> {
        lock(&self.bindings).get(key).map(|b| b.health())
    }

    /// Mints a runner of the pool's scale set.
    pub async fn mint(
        &self,
        key: &PoolKey,
        runner_name: &str,
        work_folder: &str,
    ) -> Result<JitRunner, ScaleSetError> {
        let b = lock(&self.bindings)
            .get(key)
            .cloned()
            .ok_or_else(|| ScaleSetError::NotConnected(key.to_string()))?;
        b.mint(runner_name, work_folder).await
    }

    /// Deletes every open session (operator shutdown, after the intakes stopped).
    pub async fn close_sessions(&self) {
        let bindings: Vec<Arc<Binding>> = lock(&self.bindings).values().cloned().collect();
        for b in bindings {
            b.close_session().await;
        }
    }
}

/// Aborts a task when dropped: the intakes stop with the controller that runs them.
struct Task(tokio::task::JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Keeps one intake task per pool that wants one. Runs inside the pool controller (leader only);
/// dropping it stops every intake.
pub async fn run_intakes<H: IntakeHost>(client: Client, shared: Arc<H>, recorder: Recorder) {
    let mut running: HashMap<PoolKey, (String, Task)> = HashMap::new();
    loop {
        let wants = lock(&shared.scale_sets().wants).clone();
        let stale: Vec<PoolKey> = running
            .iter()
            .filter(|(k, (fp, _))| wants.get(*k).is_none_or(|w| &w.fingerprint() != fp))
            .map(|(k, _)| k.clone())
            .collect();
        for key in stale {
            running.remove(&key);
            let old = lock(&shared.scale_sets().bindings).remove(&key);
            if let Some(b) = old {
                b.close_session().await;
            }
            info!(pool = %key, "stopped the scale-set intake");
        }
        for (key, spec) in wants {
            if running.contains_key(&key) {
                continue;
            }
            let binding = Arc::new(Binding::new(
                spec.clone(),
                shared.scale_sets().poll_timeout(),
            ));
            lock(&shared.scale_sets().bindings).insert(key.clone(), binding.clone());
            let task = tokio::spawn(intake_loop(
                binding,
                client.clone(),
                shared.clone(),
                recorder.clone(),
            ));
            info!(pool = %key, scale_set = %spec.scale_set.name, "started the scale-set intake");
            running.insert(key, (spec.fingerprint(), Task(task)));
        }
        tokio::select! {
            () = shared.scale_sets().changed.notified() => {}
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

async fn intake_loop<H: IntakeHost>(
    b: Arc<Binding>,
    client: Client,
    shared: Arc<H>,
    recorder: Recorder,
) {
    let mut attempt = 0u32;
    loop {
        let Err(err) = serve(&b, &client, &*shared, &recorder, &mut attempt).await;
        let r = recovery(&err, attempt);
        if r.refresh_session {
            match b.refresh_session().await {
                Ok(()) => {}
                // Gone at GitHub (expired): open a new one.
                Err(ScaleSetError::NotFound { .. }) => *lock(&b.session) = None,
                Err(e) => {
                    warn!(pool = %b.spec.key, error = %e, "refreshing the message session failed")
                }
            }
        }
        // Errors that do not end the session (a failed ack or ledger write) keep it.
        if r.new_session {
            b.close_session().await;
        }
        if r.reconnect {
            *lock(&b.conn) = None;
            *lock(&b.set_id) = None;
        }
        let message = err.to_string();
        warn!(pool = %b.spec.key, reason = r.reason, error = %message, wait = ?r.wait, attempt, "scale-set intake failed; backing off");
        if b.set_health(r.reason, message.clone()) {
            publish(
                &recorder,
                &b,
                true,
                r.reason,
                format!("{message}; retrying in {:?}", r.wait),
            )
            .await;
        }
        tokio::time::sleep(r.wait).await;
        attempt = attempt.saturating_add(1);
    }
}

async fn publish(recorder: &Recorder, b: &Binding, warning: bool, reason: &str, note: String) {
    let reference = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some(b.spec.owner.api_version.clone()),
        kind: Some(b.spec.owner.kind.clone()),
        name: Some(b.spec.owner.name.clone()),
        namespace: Some(b.spec.key.namespace.clone()),
        uid: Some(b.spec.owner.uid.clone()),
        ..Default::default()
    };
    let ev = imp_api::events::event(warning, &format!("ScaleSet{reason}"), note);
    if let Err(e) = recorder.publish(&ev, &reference).await {
        warn!(pool = %b.spec.key, error = %e, "publishing Event failed");
    }
}

/// The ledger ConfigMap of a pool.
pub fn ledger_name(pool: &str) -> String {
    let pool: String = pool.chars().take(220).collect();
    format!("{pool}-scaleset-ledger")
}

async fn load_ledger(
    api: &Api<ConfigMap>,
    name: &str,
) -> Result<(Ledger, Option<String>), ScaleSetError> {
    let cm = api
        .get_opt(name)
        .await
        .map_err(|e| ScaleSetError::Ledger(format!("reading ConfigMap {name}: {e}")))?;
    let Some(cm) = cm else {
        return Ok((Ledger::default(), None));
    };
    let ledger = Ledger::from_data(&cm.data.unwrap_or_default())
        .map_err(|e| ScaleSetError::Ledger(format!("ConfigMap {name}: {e}")))?;
    Ok((ledger, cm.metadata.resource_version))
}

/// Writes the whole ledger, guarded by the resourceVersion read: a second writer fails the write
/// instead of overwriting it.
async fn write_ledger(
    api: &Api<ConfigMap>,
    name: &str,
    ledger: &Ledger,
    rv: &mut Option<String>,
    owner: &OwnerReference,
) -> Result<(), ScaleSetError> {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            resource_version: rv.clone(),
            owner_references: Some(vec![owner.clone()]),
            labels: Some(BTreeMap::from([(
                imp_api::names::LABEL_RUNNER_POOL.to_string(),
                owner.name.clone(),
            )])),
            ..Default::default()
        },
        data: Some(ledger.to_data()),
        ..Default::default()
    };
    let written = match rv {
        Some(_) => api.replace(name, &PostParams::default(), &cm).await,
        None => api.create(&PostParams::default(), &cm).await,
    }
    .map_err(|e| ScaleSetError::Ledger(format!("writing ConfigMap {name}: {e}")))?;
    *rv = written.metadata.resource_version;
    Ok(())
}

/// Feeds the ledger's jobs into the pool's demand (idempotent: the demand keys jobs by id).
fn sync_demand(shared: &dyn IntakeHost, key: &PoolKey, ledger: &Ledger) {
    shared.feed_demand(key, demand_updates(ledger));
}

/// Serves the pool until a call fails; resets `attempt` once a poll succeeds.
async fn serve(
    b: &Binding,
    client: &Client,
    shared: &dyn IntakeHost,
    recorder: &Recorder,
    attempt: &mut u32,
) -> Result<Infallible, ScaleSetError> {
    let conn = b.connection().await?;
    let set_id = b.scale_set(&conn).await?;
    let session = b.session(&conn, set_id, &shared.scale_sets().owner).await?;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &b.spec.key.namespace);
    let name = ledger_name(&b.spec.key.name);
    let (mut ledger, mut rv) = load_ledger(&api, &name).await?;
    sync_demand(shared, &b.spec.key, &ledger);
    let mut last = 0u64;
    loop {
        let slots = b.node_slots.load(Ordering::Relaxed);
        let capacity = max_capacity(
            b.max_runners.load(Ordering::Relaxed),
            (slots != u32::MAX).then_some(slots),
        );
        let msg = b.client.get_message(&session, last, capacity).await?;
        *attempt = 0;
        lock(&b.health).last_poll = Some(Instant::now());
        if b.set_health(REASON_LISTENING, format!("listening on scale set {set_id}")) {
            publish(
                recorder,
                b,
                false,
                REASON_LISTENING,
                format!(
                    "holding the message session of scale set `{}` (id {set_id})",
                    b.spec.scale_set.name
                ),
            )
            .await;
        }
        let Some(msg) = msg else {
            continue;
        };
        let now = chrono::Utc::now().timestamp();
        let plan = plan_message(&ledger, &msg, &b.spec.labels, now);
        // The ledger first: a redelivery or a successor must find this decision.
        if ledger.apply(&plan.ledger) | ledger.prune(now) {
            write_ledger(&api, &name, &ledger, &mut rv, &b.spec.owner).await?;
        }
        if !plan.acquire.is_empty() {
            let got = b
                .client
                .acquire_jobs(&conn, &session, set_id, &plan.acquire)
                .await?;
            if ledger.apply(&confirm_acquired(&ledger, &got, now)) {
                write_ledger(&api, &name, &ledger, &mut rv, &b.spec.owner).await?;
            }
        }
        sync_demand(shared, &b.spec.key, &ledger);
        b.client.delete_message(&session, msg.id).await?;
        last = msg.id;
    }
}
