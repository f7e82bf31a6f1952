//! The pool controller: watches ImpVMRunnerPools and the ImpVMs they own, and is woken by demand
//! changes from the webhook receiver and the sweep. Each pass lists the pool's VMs (a consistent read,
//! so the pass always sees its own earlier creations), classifies them, asks [`plan`] what to do, does
//! it, and writes status. One pass per pool at a time (kube-runtime guarantees it), so minting for a VM
//! cannot race with itself.
//!
//! Idempotency across restarts comes from the API objects: a VM's JIT Secret `impvm-<uid>-jit`, owned by
//! that VM, and the runner id/name annotations on the VM prove it was minted; a VM is never minted twice.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use imp_api::{
    ImpVM, ImpVMRunnerPool, ImpVMRunnerPoolStatus, ImpVMSpec, Lifecycle, conditions,
    names::{
        ANNOTATION_RUNNER_ID, ANNOTATION_RUNNER_NAME, FINALIZER_POOL_CLEANUP, LABEL_RUNNER_POOL,
        LABEL_SECRET_KIND, SECRET_KEY_JITCONFIG, SECRET_KIND_JIT, condition, jit_secret_name,
        reason,
    },
};
use imp_common::ExposeSecret;
use k8s_openapi::{
    ByteString,
    api::core::v1::Secret,
    apimachinery::pkg::apis::meta::v1::{OwnerReference, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams},
    runtime::{
        Controller,
        controller::{self, Action},
        events::{Event, EventType, Recorder, Reporter},
        reflector::ObjectRef,
        watcher,
    },
};
use serde_json::json;
use tracing::{debug, info, warn};

use super::{
    PoolControllerConfig, PoolShared,
    classify::{RunnerState, classify, runner_started, start_failure},
    demand::{JobState, JobUpdate, PoolKey, PoolRoute},
    plan::{Backoff, Limit, MintBlock, Observed, ObservedVm, Plan, Removal, plan},
};
use crate::github::{
    DeleteOutcome, ErrorClass, GithubApp, GithubError, JitRequest, RunnerScope, runner_name,
};
use crate::metrics::ReasonLabels;

/// Errors of one pass. Messages never carry a JIT config (its type is redacted).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("Kubernetes API request failed ({what}): {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("object is missing {0}")]
    MissingObjectKey(&'static str),
}

impl PoolError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            PoolError::Kube { .. } => "kube_api",
            PoolError::MissingObjectKey(_) => "missing_object_key",
        }
    }
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> PoolError {
    let what = what.into();
    move |source| PoolError::Kube { what, source }
}

type Result<T, E = PoolError> = std::result::Result<T, E>;

/// Whether the pool's App credentials were last seen working.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
enum Creds {
    #[default]
    Unknown,
    Valid,
    Invalid {
        reason: &'static str,
        message: String,
    },
}

/// Per-pool memory of the controller (lost on restart, rebuilt from the API objects).
#[derive(Debug, Default)]
struct PoolMemory {
    /// Consecutive failed mints, and the wait they impose.
    mint_backoff: Backoff,
    /// Consecutive VMs that failed before their runner started, and the wait they impose.
    start_backoff: Backoff,
    /// VMs (uid) already counted as start failures: each counts once.
    counted_start_failures: HashSet<String>,
    creds: Creds,
    /// App and scope, for the sweep.
    github: Option<(GithubApp, RunnerScope)>,
    /// A sweep covered this pool since the operator started (its demand is known).
    swept: bool,
}

struct Ctx {
    client: Client,
    config: PoolControllerConfig,
    shared: Arc<PoolShared>,
    recorder: Recorder,
    memory: Mutex<HashMap<PoolKey, PoolMemory>>,
    /// Wakes the sweep when a pool's App becomes known (first pass after start or a fix), so demand
    /// lost while the operator was down is rebuilt at once rather than one interval later.
    sweep_now: tokio::sync::Notify,
}

/// Runs the pool controller and the queued-job sweep until the watches end (or the task is dropped).
pub async fn run_runnerpool_controller(
    client: Client,
    config: PoolControllerConfig,
    shared: Arc<PoolShared>,
) {
    let (pools, vms): (Api<ImpVMRunnerPool>, Api<ImpVM>) = match &config.namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<PoolKey>();
    shared.set_notifier(tx);
    let trigger = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|k| (ObjectRef::new(&k.name).within(&k.namespace), rx))
    });
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: config.reporter.clone(),
            instance: None,
        },
    );
    let ctx = Arc::new(Ctx {
        client,
        shared,
        recorder,
        memory: Mutex::new(HashMap::new()),
        sweep_now: tokio::sync::Notify::new(),
        config,
    });
    let sweep = sweep_loop(ctx.clone());
    let controller = Controller::new(pools, watcher::Config::default())
        .owns(vms, watcher::Config::default().labels(LABEL_RUNNER_POOL))
        .reconcile_on(trigger)
        .with_config(controller::Config::default().debounce(ctx.config.timing.debounce))
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(pool = %obj, "reconciled"),
                Err(e) => debug!(error = %e, "pool reconcile failed"),
            }
        });
    tokio::select! {
        () = controller => {},
        () = sweep => {},
    }
}

fn error_policy(pool: Arc<ImpVMRunnerPool>, err: &PoolError, ctx: Arc<Ctx>) -> Action {
    warn!(pool = %pool.name_any(), namespace = pool.namespace().unwrap_or_default(), error = %err, "pool reconcile failed");
    Action::requeue(ctx.config.timing.retry.min(Duration::from_secs(5)))
}

async fn reconcile(pool: Arc<ImpVMRunnerPool>, ctx: Arc<Ctx>) -> Result<Action> {
    let ns = pool
        .namespace()
        .ok_or(PoolError::MissingObjectKey(".metadata.namespace"))?;
    let key = PoolKey::new(ns, pool.name_any());
    if pool.metadata.deletion_timestamp.is_some() {
        return ctx.cleanup(&pool, &key).await;
    }
    if !pool
        .finalizers()
        .iter()
        .any(|f| f == FINALIZER_POOL_CLEANUP)
    {
        let mut finalizers = pool.finalizers().to_vec();
        finalizers.push(FINALIZER_POOL_CLEANUP.to_owned());
        let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": pool.resource_version()}});
        ctx.pools(&key)
            .patch(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_err(format!("add finalizer to pool {key}")))?;
        // The patch comes back through the watch and triggers the real pass.
        return Ok(Action::await_change());
    }
    ctx.apply(&pool, &key).await
}

/// What one pass changed (status is the observation at the start of the pass plus these).
#[derive(Clone, Copy)]
struct Done {
    created: u32,
    retired: u32,
    cleaned: u32,
}

/// What happened to one removal.
enum Removed {
    Done,
    /// Still registered (busy, or GitHub failed): try again later.
    Pending,
}

impl Ctx {
    fn pools(&self, key: &PoolKey) -> Api<ImpVMRunnerPool> {
        Api::namespaced(self.client.clone(), &key.namespace)
    }
    fn vms(&self, key: &PoolKey) -> Api<ImpVM> {
        Api::namespaced(self.client.clone(), &key.namespace)
    }
    fn secrets(&self, key: &PoolKey) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &key.namespace)
    }

    fn memory<T>(&self, key: &PoolKey, f: impl FnOnce(&mut PoolMemory) -> T) -> T {
        let mut m = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        f(m.entry(key.clone()).or_default())
    }

    async fn event(&self, pool: &ImpVMRunnerPool, warning: bool, reason: &str, note: String) {
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.to_owned(),
            note: Some(note),
            action: reason.to_owned(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &pool.object_ref(&())).await {
            warn!(pool = %pool.name_any(), reason, error = %e, "publishing Event failed");
        }
    }

    /// The pool's GitHub App client, or why there is none.
    async fn app(&self, pool: &ImpVMRunnerPool, key: &PoolKey) -> Result<GithubApp, Creds> {
        let name = &pool.spec.github.app_secret_ref.name;
        let secret = match self.secrets(key).get_opt(name).await {
            Ok(Some(s)) => s,
            Ok(None) => {
                return Err(Creds::Invalid {
                    reason: reason::SECRET_NOT_FOUND,
                    message: format!("App Secret `{name}` not found"),
                });
            }
            Err(e) => {
                return Err(Creds::Invalid {
                    reason: reason::SECRET_UNREADABLE,
                    message: format!("reading App Secret `{name}` failed: {e}"),
                });
            }
        };
        self.shared
            .apps
            .for_secret(&secret)
            .map_err(|e| Creds::Invalid {
                reason: reason::CREDENTIALS_INVALID,
                message: e.to_string(),
            })
    }

    async fn webhook_secret(&self, pool: &ImpVMRunnerPool, key: &PoolKey) -> Option<Vec<u8>> {
        let r = pool.spec.webhook_secret_ref.as_ref()?;
        let k = r
            .key
            .as_deref()
            .unwrap_or(super::DEFAULT_WEBHOOK_SECRET_KEY);
        let found = match self.secrets(key).get_opt(&r.name).await {
            Ok(s) => s
                .and_then(|s| s.data)
                .and_then(|mut d| d.remove(k))
                .map(|b| b.0)
                .filter(|b| !b.is_empty()),
            Err(e) => {
                warn!(pool = %key, error = %e, "reading the webhook Secret failed");
                None
            }
        };
        // Unreadable: a random secret nobody has, so no delivery can be routed here with the global
        // secret instead (the sweep still serves the pool).
        Some(found.unwrap_or_else(|| {
            warn!(pool = %key, secret = %r.name, "webhook secret missing; only the sweep serves this pool");
            rand::random::<[u8; 32]>().to_vec()
        }))
    }

    async fn list_vms(&self, pool: &ImpVMRunnerPool, key: &PoolKey) -> Result<Vec<ImpVM>> {
        let uid = pool
            .uid()
            .ok_or(PoolError::MissingObjectKey(".metadata.uid"))?;
        let lp = ListParams::default().labels(&format!("{LABEL_RUNNER_POOL}={}", key.name));
        let list = self
            .vms(key)
            .list(&lp)
            .await
            .map_err(kube_err(format!("list VMs of pool {key}")))?;
        // Only VMs this pool object controls (not leftovers of an earlier pool of the same name).
        Ok(list
            .items
            .into_iter()
            .filter(|vm| {
                vm.owner_references()
                    .iter()
                    .any(|o| o.controller == Some(true) && o.uid == uid)
            })
            .collect())
    }

    async fn apply(&self, pool: &ImpVMRunnerPool, key: &PoolKey) -> Result<Action> {
        let timing = &self.config.timing;
        let app = self.app(pool, key).await;
        let scope = scope_of(pool);
        match &app {
            Ok(a) => {
                let first = self.memory(key, |m| {
                    let first = m.github.is_none();
                    m.github = scope.clone().map(|s| (a.clone(), s));
                    if matches!(m.creds, Creds::Invalid { .. }) {
                        m.creds = Creds::Unknown;
                    }
                    first && m.github.is_some()
                });
                if first {
                    self.sweep_now.notify_one();
                }
            }
            Err(c) => self.memory(key, |m| {
                m.github = None;
                m.creds = c.clone();
            }),
        }
        if let Some(scope) = scope.clone() {
            let route = PoolRoute {
                labels: pool.spec.github.labels.clone(),
                scope,
                webhook_secret: self.webhook_secret(pool, key).await,
            };
            self.shared.demand().upsert_pool(key.clone(), route);
        }

        let vms = self.list_vms(pool, key).await?;
        let demand = self.shared.demand().pool_demand(key);
        let now = Instant::now();
        let wall = Timestamp::now();
        let mut observed = Vec::with_capacity(vms.len());
        let mut started_runners = Vec::new();
        for vm in &vms {
            let ann = vm.annotations();
            let name = ann.get(ANNOTATION_RUNNER_NAME).map(String::as_str);
            let state = classify(vm, name, &demand.busy_runners);
            if let Some(name) = name
                && let Some(t) = vm
                    .status
                    .as_ref()
                    .and_then(|s| s.runner.as_ref())
                    .and_then(|r| r.started_time.as_ref())
            {
                started_runners.push((name.to_owned(), t.0));
            }
            observed.push(ObservedVm {
                name: vm.name_any(),
                state,
                runner_id: ann.get(ANNOTATION_RUNNER_ID).and_then(|v| v.parse().ok()),
                created: vm
                    .creation_timestamp()
                    .map(|t| t.0.as_second())
                    .unwrap_or_default(),
            });
        }
        self.credit_pickups(key, started_runners, now, wall);
        self.note_start_failures(pool, key, &vms).await;

        let demand_known = self.memory(key, |m| m.swept);
        let (mint_block, creds) = self.memory(key, |m| {
            let block = match (&m.creds, &app) {
                (Creds::Invalid { .. }, _) | (_, Err(_)) => Some(MintBlock::CredentialsInvalid),
                _ if m.mint_backoff.active(now) => Some(MintBlock::Backoff),
                _ if m.start_backoff.active(now) => Some(MintBlock::StartFailing),
                _ => None,
            };
            (block, m.creds.clone())
        });
        let mint_block = if scope.is_none() {
            Some(MintBlock::CredentialsInvalid)
        } else {
            mint_block
        };
        let p = plan(&Observed {
            vms: &observed,
            scaling: &pool.spec.scaling,
            queued: demand.queued,
            mint_block,
            deleting: false,
            demand_known,
        });
        debug!(pool = %key, ?p.counts, desired = p.desired, create = p.create, retire = p.retire.len(), cleanup = p.cleanup.len(), "plan");

        let app = app.ok();
        let by_name: HashMap<&str, &ImpVM> = vms.iter().map(|v| (v.name_any_ref(), v)).collect();
        let mut pending = false;
        let mut cleaned = 0u32;
        for r in &p.cleanup {
            match self.remove(key, app.as_ref(), scope.as_ref(), r).await {
                Removed::Done => cleaned += 1,
                Removed::Pending => pending = true,
            }
        }
        let mut retired = 0u32;
        for r in &p.retire {
            match self.remove(key, app.as_ref(), scope.as_ref(), r).await {
                Removed::Done => retired += 1,
                Removed::Pending => pending = true,
            }
        }
        let mut created = 0u32;
        let mut mint_failed = false;
        if let (Some(app), Some(scope)) = (app.as_ref(), scope.as_ref()) {
            for name in &p.mint {
                if let Some(vm) = by_name.get(name.as_str())
                    && self.mint(pool, key, app, scope, vm).await.is_err()
                {
                    mint_failed = true;
                    break;
                }
            }
            if !mint_failed && p.create > 0 {
                let results: Vec<bool> = futures::stream::iter(0..p.create)
                    .map(|_| self.create_runner(pool, key, app, scope))
                    .buffer_unordered(self.config.create_concurrency.max(1))
                    .collect()
                    .await;
                created = results.iter().filter(|ok| **ok).count() as u32;
                mint_failed = results.iter().any(|ok| !ok);
            }
        }
        if created > 0 {
            info!(pool = %key, created, desired = p.desired, "scaled up");
            self.event(
                pool,
                false,
                reason::SCALED_UP,
                format!("Created {created} runner VM(s); desired {}", p.desired),
            )
            .await;
        }
        if retired > 0 {
            info!(pool = %key, retired, desired = p.desired, "scaled down");
            self.event(
                pool,
                false,
                reason::SCALED_DOWN,
                format!("Retired {retired} idle runner(s); desired {}", p.desired),
            )
            .await;
        }
        if cleaned > 0 {
            self.event(
                pool,
                false,
                reason::RUNNERS_CLEANED_UP,
                format!("Deleted {cleaned} finished runner VM(s)"),
            )
            .await;
        }

        let creds_now = self.memory(key, |m| m.creds.clone());
        if creds_now != creds
            && let Creds::Invalid { reason, message } = &creds_now
        {
            self.event(pool, true, reason, message.clone()).await;
        }
        let done = Done {
            created,
            retired,
            cleaned,
        };
        self.write_status(pool, key, &p, &done, &creds_now, mint_failed)
            .await?;

        let backoffs = self.memory(key, |m| [m.mint_backoff.until(), m.start_backoff.until()]);
        let mut next = timing.resync;
        if pending {
            next = next.min(timing.retry);
        }
        for t in backoffs
            .into_iter()
            .flatten()
            .filter(|t| *t > Instant::now())
        {
            next = next.min(t - Instant::now() + Duration::from_millis(10));
        }
        if p.limited == Some(Limit::ScaleUpStep)
            || (created > 0 && p.desired > p.counts.live() + created)
        {
            next = next.min(timing.scaling_requeue);
        }
        Ok(Action::requeue(next))
    }

    /// Pickup latency of every job whose runner is known and Started: from learning of the job to that
    /// runner's Started (zero when a warm runner was already waiting).
    fn credit_pickups(
        &self,
        key: &PoolKey,
        started: Vec<(String, Timestamp)>,
        now: Instant,
        wall: Timestamp,
    ) {
        let mut d = self.shared.demand();
        for (runner, t) in started {
            if let Some(learnt) = d.take_pickup(key, &runner) {
                let ago = wall.duration_since(t).unsigned_abs();
                let at = now.checked_sub(ago).unwrap_or(now);
                let latency = at.saturating_duration_since(learnt);
                self.shared
                    .metrics
                    .job_pickup_latency
                    .observe(latency.as_secs_f64());
            }
        }
    }

    /// Deregisters the VM's runner if it has one (a busy runner keeps its VM), then deletes the VM.
    async fn remove(
        &self,
        key: &PoolKey,
        app: Option<&GithubApp>,
        scope: Option<&RunnerScope>,
        r: &Removal,
    ) -> Removed {
        if let Some(id) = r.runner_id {
            let (Some(app), Some(scope)) = (app, scope) else {
                return Removed::Pending;
            };
            match app.delete_runner(scope, id).await {
                Ok(DeleteOutcome::Deleted) => self.shared.metrics.deregistration("deleted"),
                Ok(DeleteOutcome::AlreadyGone) => {
                    self.shared.metrics.deregistration("already_gone")
                }
                Err(e) if e.class() == ErrorClass::Busy => {
                    self.shared.metrics.deregistration("busy");
                    debug!(pool = %key, vm = %r.name, runner_id = id, "runner busy; kept");
                    return Removed::Pending;
                }
                Err(e) => {
                    self.shared.metrics.deregistration("error");
                    warn!(pool = %key, vm = %r.name, runner_id = id, error = %e, "deregistering runner failed");
                    return Removed::Pending;
                }
            }
        }
        match self
            .vms(key)
            .delete(&r.name, &DeleteParams::background())
            .await
        {
            Ok(_) => {
                info!(pool = %key, vm = %r.name, runner_id = ?r.runner_id, "runner VM deleted");
                Removed::Done
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Removed::Done,
            Err(e) => {
                warn!(pool = %key, vm = %r.name, error = %e, "deleting runner VM failed");
                Removed::Pending
            }
        }
    }

    async fn deregister_only(
        &self,
        key: &PoolKey,
        app: &GithubApp,
        scope: &RunnerScope,
        r: &Removal,
    ) {
        if let Some(id) = r.runner_id
            && let Err(e) = app.delete_runner(scope, id).await
        {
            warn!(pool = %key, runner_id = id, error = %e, "deregistering surplus runner failed");
        }
    }

    /// Creates one runner VM and mints its config; false if either failed.
    async fn create_runner(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        app: &GithubApp,
        scope: &RunnerScope,
    ) -> bool {
        let vm = match runner_vm(pool) {
            Ok(vm) => vm,
            Err(e) => {
                warn!(pool = %key, error = %e, "building runner VM failed");
                return false;
            }
        };
        match self.vms(key).create(&PostParams::default(), &vm).await {
            Ok(created) => self.mint(pool, key, app, scope, &created).await.is_ok(),
            Err(e) => {
                warn!(pool = %key, error = %e, "creating runner VM failed");
                false
            }
        }
    }

    /// Gives `vm` its JIT config: adopts a Secret this VM already owns, else mints one. On failure the
    /// VM is deleted (it could never run a job) and the pool backs off.
    async fn mint(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        app: &GithubApp,
        scope: &RunnerScope,
        vm: &ImpVM,
    ) -> Result<(), ()> {
        let vm_name = vm.name_any();
        let Some(uid) = vm.uid() else { return Err(()) };
        let secret_name = jit_secret_name(&uid);
        let secrets = self.secrets(key);
        match secrets.get_opt(&secret_name).await {
            Ok(Some(existing)) => {
                if owned_by(&existing, &uid) {
                    let ann = existing.annotations();
                    let (id, name) = (
                        ann.get(ANNOTATION_RUNNER_ID).cloned(),
                        ann.get(ANNOTATION_RUNNER_NAME).cloned(),
                    );
                    info!(pool = %key, vm = %vm_name, "adopting the JIT Secret this VM already owns");
                    return self
                        .attach(key, &vm_name, &secret_name, id.as_deref(), name.as_deref())
                        .await
                        .map_err(|_| ());
                }
                self.event(pool, true, reason::SECRET_CONFLICT, format!("Secret {secret_name} exists and is not owned by VM {vm_name}; deleting the VM")).await;
                let _ = self
                    .vms(key)
                    .delete(&vm_name, &DeleteParams::background())
                    .await;
                return Err(());
            }
            Ok(None) => {}
            Err(e) => {
                warn!(pool = %key, vm = %vm_name, error = %e, "reading JIT Secret failed");
                return Err(());
            }
        }
        if vm.annotations().contains_key(ANNOTATION_RUNNER_ID) {
            // Minted before and its Secret is gone: never mint twice for one VM. Replace the VM.
            let id = vm.annotations()[ANNOTATION_RUNNER_ID].parse().ok();
            self.event(
                pool,
                true,
                reason::JIT_CONFIG_LOST,
                format!("VM {vm_name} was minted but its JIT Secret is gone; replacing the VM"),
            )
            .await;
            let r = Removal {
                name: vm_name,
                runner_id: id,
            };
            self.remove(key, Some(app), Some(scope), &r).await;
            return Err(());
        }

        let runner = runner_name(&key.name, &uid);
        let started = Instant::now();
        let req = JitRequest {
            scope: scope.clone(),
            runner_name: runner.clone(),
            labels: pool.spec.github.labels.clone(),
            runner_group: pool.spec.github.runner_group.clone(),
            work_folder: pool
                .spec
                .github
                .work_folder
                .clone()
                .unwrap_or_else(|| "_work".into()),
        };
        let minted = match app.generate_jit_config(&req).await {
            Ok(m) => m,
            Err(e) => {
                self.mint_failed(pool, key, &vm_name, &e).await;
                return Err(());
            }
        };
        self.shared
            .metrics
            .jit_mint_duration
            .observe(started.elapsed().as_secs_f64());
        self.memory(key, |m| {
            m.mint_backoff.reset();
            m.creds = Creds::Valid;
        });
        let runner_id = minted.runner_id.to_string();
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(secret_name.clone()),
                namespace: Some(key.namespace.clone()),
                labels: Some(BTreeMap::from([
                    (LABEL_SECRET_KIND.to_owned(), SECRET_KIND_JIT.to_owned()),
                    (LABEL_RUNNER_POOL.to_owned(), key.name.clone()),
                ])),
                annotations: Some(BTreeMap::from([
                    (ANNOTATION_RUNNER_ID.to_owned(), runner_id.clone()),
                    (
                        ANNOTATION_RUNNER_NAME.to_owned(),
                        minted.runner_name.clone(),
                    ),
                ])),
                owner_references: Some(vec![OwnerReference {
                    api_version: "imp.dev/v1alpha1".into(),
                    kind: "ImpVM".into(),
                    name: vm_name.clone(),
                    uid: uid.clone(),
                    controller: Some(true),
                    block_owner_deletion: Some(true),
                }]),
                ..ObjectMeta::default()
            },
            type_: Some("Opaque".into()),
            data: Some(BTreeMap::from([(
                SECRET_KEY_JITCONFIG.to_owned(),
                ByteString(
                    minted
                        .encoded_jit_config
                        .expose_secret()
                        .as_bytes()
                        .to_vec(),
                ),
            )])),
            ..Secret::default()
        };
        let stored = match secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => true,
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // Written meanwhile by someone else. Reuse it only if this VM owns it; either way
                // the registration just minted is surplus.
                let r = Removal {
                    name: vm_name.clone(),
                    runner_id: Some(minted.runner_id),
                };
                if let Ok(Some(existing)) = secrets.get_opt(&secret_name).await
                    && owned_by(&existing, &uid)
                {
                    self.deregister_only(key, app, scope, &r).await;
                    let ann = existing.annotations();
                    return self
                        .attach(
                            key,
                            &vm_name,
                            &secret_name,
                            ann.get(ANNOTATION_RUNNER_ID).map(String::as_str),
                            ann.get(ANNOTATION_RUNNER_NAME).map(String::as_str),
                        )
                        .await
                        .map_err(|_| ());
                }
                false
            }
            Err(e) => {
                warn!(pool = %key, vm = %vm_name, error = %e, "storing JIT Secret failed");
                false
            }
        };
        if !stored {
            // The minted registration has no home: deregister it and replace the VM.
            let r = Removal {
                name: vm_name,
                runner_id: Some(minted.runner_id),
            };
            self.remove(key, Some(app), Some(scope), &r).await;
            return Err(());
        }
        match self
            .attach(
                key,
                &vm_name,
                &secret_name,
                Some(&runner_id),
                Some(&minted.runner_name),
            )
            .await
        {
            Ok(()) => {
                debug!(pool = %key, vm = %vm_name, runner_id = minted.runner_id, runner_name = %minted.runner_name, "runner minted");
                Ok(())
            }
            Err(e) => {
                warn!(pool = %key, vm = %vm_name, error = %e, "recording the JIT Secret on the VM failed");
                // The Secret (owned by the VM) proves the mint: the next pass adopts it, or the
                // garbage collector removes it with the VM.
                Err(())
            }
        }
    }

    async fn attach(
        &self,
        key: &PoolKey,
        vm: &str,
        secret: &str,
        runner_id: Option<&str>,
        runner: Option<&str>,
    ) -> Result<()> {
        let patch = json!({
            "metadata": {"annotations": {ANNOTATION_RUNNER_ID: runner_id, ANNOTATION_RUNNER_NAME: runner}},
            "spec": {"runnerConfigSecret": secret},
        });
        match self
            .vms(key)
            .patch(vm, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => Err(PoolError::Kube {
                what: format!("record JIT Secret on VM {vm}"),
                source: e,
            }),
        }
    }

    /// Counts VMs that failed before their runner started (once each) into the start backoff,
    /// with an Event naming the VM and its reason; a runner that starts resets it.
    async fn note_start_failures(&self, pool: &ImpVMRunnerPool, key: &PoolKey, vms: &[ImpVM]) {
        let timing = &self.config.timing;
        let present: HashSet<String> = vms.iter().filter_map(|v| v.uid()).collect();
        let mut fresh = Vec::new();
        self.memory(key, |m| {
            m.counted_start_failures.retain(|u| present.contains(u));
            if vms.iter().any(runner_started) {
                m.start_backoff.reset();
            }
            for vm in vms {
                let (Some(uid), Some(reason)) = (vm.uid(), start_failure(vm)) else {
                    continue;
                };
                if m.counted_start_failures.insert(uid) {
                    let wait = m.start_backoff.fail(
                        Instant::now(),
                        timing.start_backoff,
                        timing.start_backoff_max,
                    );
                    fresh.push((vm.name_any(), reason, wait, m.start_backoff.failures()));
                }
            }
        });
        for (vm, reason, wait, n) in fresh {
            warn!(pool = %key, vm, reason, consecutive = n, backoff = ?wait, "runner VM failed before its runner started; delaying the next VM");
            self.shared
                .metrics
                .vm_start_failures
                .get_or_create(&ReasonLabels {
                    reason: reason.clone(),
                })
                .inc();
            self.event(
                pool,
                true,
                reason::VM_START_FAILED,
                format!("Runner VM {vm} failed before its runner started ({reason}; {n} in a row); the next VM is created in {wait:?}"),
            )
            .await;
        }
    }

    async fn mint_failed(&self, pool: &ImpVMRunnerPool, key: &PoolKey, vm: &str, e: &GithubError) {
        self.shared
            .metrics
            .jit_mint_errors
            .get_or_create(&ReasonLabels {
                reason: e.metric_label().to_owned(),
            })
            .inc();
        let timing = &self.config.timing;
        let wait = self.memory(key, |m| {
            let wait =
                m.mint_backoff
                    .fail(Instant::now(), timing.mint_backoff, timing.mint_backoff_max);
            if matches!(
                e.metric_label(),
                "credentials"
                    | "unauthorized"
                    | "forbidden"
                    | "enterprise_scope_unsupported"
                    | "runner_group_not_found"
            ) {
                m.creds = Creds::Invalid {
                    reason: reason::CREDENTIALS_INVALID,
                    message: e.to_string(),
                };
            }
            wait
        });
        warn!(pool = %key, vm, error = %e, backoff = ?wait, "minting JIT config failed; deleting the VM");
        if let Err(err) = self.vms(key).delete(vm, &DeleteParams::background()).await
            && !matches!(&err, kube::Error::Api(s) if s.code == 404)
        {
            warn!(pool = %key, vm, error = %err, "deleting VM after failed mint failed");
        }
        self.event(
            pool,
            true,
            reason::MINT_FAILED,
            format!("Minting a JIT runner config for VM {vm} failed ({}); VM deleted, retrying in {wait:?}: {e}", e.metric_label()),
        )
        .await;
    }

    async fn write_status(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        p: &Plan,
        done: &Done,
        creds: &Creds,
        mint_failed: bool,
    ) -> Result<()> {
        let c = &p.counts;
        let Done {
            created,
            retired,
            cleaned,
        } = *done;
        let scaled = created + retired + cleaned > 0;
        let old = pool.status.clone().unwrap_or_default();
        let now = Time(Timestamp::now());
        let gen_ = pool.metadata.generation;
        let idle = c.idle.saturating_sub(retired);
        let booting = c.booting + c.unminted + created;
        let total = (c.total() + created).saturating_sub(retired + cleaned);
        let (cv, cr, cm) = match creds {
            Creds::Valid => (
                Some(true),
                reason::MINTED,
                "A JIT runner config was minted with the App credentials".to_owned(),
            ),
            Creds::Unknown => (
                None,
                reason::NOT_YET_USED,
                "No JIT config minted yet".to_owned(),
            ),
            Creds::Invalid { reason, message } => (Some(false), *reason, message.clone()),
        };
        let ready = c.idle + c.busy >= p.desired && !matches!(creds, Creds::Invalid { .. });
        let limited = p.limited.or(mint_failed.then_some(Limit::MintBackoff));
        let mut conditions = old.conditions.clone();
        let mut cond = |type_: &str, ok: Option<bool>, reason: &str, message: String| {
            conditions::set(
                &mut conditions,
                type_,
                ok.into(),
                reason,
                message,
                gen_,
                now.0,
            );
        };
        cond(condition::CREDENTIALS_VALID, cv, cr, cm);
        cond(
            condition::READY,
            Some(ready),
            if ready {
                reason::RUNNERS_AVAILABLE
            } else {
                reason::RUNNERS_PENDING
            },
            format!("{} idle + {} busy of {} desired", c.idle, c.busy, p.desired),
        );
        cond(
            condition::AT_CAPACITY,
            Some(p.at_capacity),
            if p.at_capacity {
                reason::MAX_RUNNERS_REACHED
            } else {
                reason::BELOW_MAX_RUNNERS
            },
            format!(
                "{} of maxRunners {}",
                c.live(),
                pool.spec.scaling.max_runners
            ),
        );
        cond(
            condition::SCALING_LIMITED,
            Some(limited.is_some()),
            limited.map_or(reason::NOT_LIMITED, Limit::reason),
            match limited {
                Some(l) => format!("scaling held back by {}", l.reason()),
                None => "scaling follows demand".to_owned(),
            },
        );
        let status = ImpVMRunnerPoolStatus {
            observed_generation: gen_,
            desired: p.desired,
            idle,
            busy: c.busy,
            booting,
            total,
            last_scale_time: if scaled {
                Some(now)
            } else {
                old.last_scale_time.clone()
            },
            conditions,
        };
        let m = &self.shared.metrics;
        let label = key.to_string();
        for (state, v) in [
            ("desired", status.desired),
            ("idle", status.idle),
            ("busy", status.busy),
            ("booting", status.booting),
            ("total", status.total),
        ] {
            m.set_pool(&label, state, v);
        }
        if status == old {
            return Ok(());
        }
        let patch = json!({"status": status});
        self.pools(key)
            .patch_status(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_err(format!("write status of pool {key}")))?;
        Ok(())
    }

    /// The pool is being deleted: deregister every runner and delete every VM, then let it go.
    async fn cleanup(&self, pool: &ImpVMRunnerPool, key: &PoolKey) -> Result<Action> {
        if !pool
            .finalizers()
            .iter()
            .any(|f| f == FINALIZER_POOL_CLEANUP)
        {
            self.forget(key);
            return Ok(Action::await_change());
        }
        let app = self.app(pool, key).await.ok();
        let scope = scope_of(pool);
        let vms = self.list_vms(pool, key).await?;
        let observed: Vec<ObservedVm> = vms
            .iter()
            .map(|vm| ObservedVm {
                name: vm.name_any(),
                state: if vm.metadata.deletion_timestamp.is_some() {
                    RunnerState::Deleting
                } else {
                    RunnerState::Booting
                },
                runner_id: vm
                    .annotations()
                    .get(ANNOTATION_RUNNER_ID)
                    .and_then(|v| v.parse().ok()),
                created: 0,
            })
            .collect();
        let p = plan(&Observed {
            vms: &observed,
            scaling: &pool.spec.scaling,
            queued: 0,
            mint_block: None,
            deleting: true,
            demand_known: true,
        });
        let mut pending = 0;
        for r in &p.cleanup {
            if let Removed::Pending = self.remove(key, app.as_ref(), scope.as_ref(), r).await {
                pending += 1;
            }
        }
        let deleted_for = pool
            .metadata
            .deletion_timestamp
            .as_ref()
            .map(|t| Timestamp::now().duration_since(t.0).unsigned_abs())
            .unwrap_or_default();
        if pending > 0 && deleted_for < self.config.timing.deletion_timeout {
            info!(pool = %key, pending, "pool deletion waits for runners to deregister");
            return Ok(Action::requeue(self.config.timing.retry));
        }
        if pending > 0 {
            self.event(pool, true, reason::CLEANUP_TIMED_OUT, format!("{pending} runner(s) could not be deregistered within {:?}; their VMs are deleted, the registrations may remain at GitHub", self.config.timing.deletion_timeout)).await;
            for r in &p.cleanup {
                let _ = self
                    .vms(key)
                    .delete(&r.name, &DeleteParams::background())
                    .await;
            }
        }
        let finalizers: Vec<String> = pool
            .finalizers()
            .iter()
            .filter(|f| *f != FINALIZER_POOL_CLEANUP)
            .cloned()
            .collect();
        let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": pool.resource_version()}});
        match self
            .pools(key)
            .patch(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(kube_err(format!("remove finalizer of pool {key}"))(e)),
        }
        info!(pool = %key, "pool cleaned up");
        self.forget(key);
        Ok(Action::await_change())
    }

    fn forget(&self, key: &PoolKey) {
        self.shared.demand().remove_pool(key);
        self.shared.metrics.remove_pool(&key.to_string());
        self.memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }
}

trait NameRef {
    fn name_any_ref(&self) -> &str;
}

impl NameRef for ImpVM {
    fn name_any_ref(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }
}

fn owned_by(secret: &Secret, uid: &str) -> bool {
    secret
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.uid == uid && o.kind == "ImpVM")
}

/// The pool's runner scope, if its spec names exactly one.
fn scope_of(pool: &ImpVMRunnerPool) -> Option<RunnerScope> {
    let s = &pool.spec.github.scope;
    match (&s.org, &s.repo) {
        (Some(org), None) => Some(RunnerScope::org(org)),
        (None, Some(repo)) => repo
            .split_once('/')
            .map(|(owner, name)| RunnerScope::repo(owner, name)),
        _ => None,
    }
}

/// A new runner VM of `pool`: generateName `<pool>-`, ephemeral, labelled, controlled by the pool.
pub fn runner_vm(pool: &ImpVMRunnerPool) -> Result<ImpVM, PoolError> {
    let name = pool.name_any();
    let owner = pool
        .controller_owner_ref(&())
        .ok_or(PoolError::MissingObjectKey(".metadata.uid"))?;
    let t = &pool.spec.template;
    let meta = t.metadata.clone().unwrap_or_default();
    let mut labels = meta.labels;
    labels.insert(LABEL_RUNNER_POOL.to_owned(), name.clone());
    let s = &t.spec;
    let mut vm = ImpVM::new(
        "",
        ImpVMSpec {
            class_ref: s.class_ref.clone(),
            image: s.image.clone(),
            runner_image: s.runner_image.clone(),
            image_pull_secrets: s.image_pull_secrets.clone(),
            image_pull_policy: s.image_pull_policy,
            network_ref: s.network_ref.clone(),
            lifecycle: Lifecycle::Ephemeral,
            node_name: None,
            node_selector: s.node_selector.clone(),
            tolerations: s.tolerations.clone(),
            restart_policy: None,
            desired_state: None,
            idle_timeout: None,
            expire_after: s.expire_after.clone(),
            runner_config_secret: None,
        },
    );
    vm.metadata = ObjectMeta {
        generate_name: Some(format!("{name}-")),
        namespace: pool.namespace(),
        labels: Some(labels),
        annotations: (!meta.annotations.is_empty()).then_some(meta.annotations),
        owner_references: Some(vec![owner]),
        ..ObjectMeta::default()
    };
    Ok(vm)
}

/// One App's sweep: its client, the organizations and the repositories its pools serve, the pools.
type AppSweep = (GithubApp, HashSet<String>, HashSet<String>, Vec<PoolKey>);

/// Periodically lists queued jobs through the REST API (per App, once per repository), so jobs whose
/// webhooks were lost raise demand within one interval; also expires old jobs and refreshes the global
/// webhook secret.
async fn sweep_loop(ctx: Arc<Ctx>) {
    let mut tick = tokio::time::interval(ctx.config.timing.sweep_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = ctx.sweep_now.notified() => {}
        }
        ctx.refresh_global_secret().await;
        ctx.sweep_once().await;
    }
}

impl Ctx {
    async fn refresh_global_secret(&self) {
        let Some(sel) = &self.config.global_webhook_secret else {
            return;
        };
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &sel.namespace);
        match api.get_opt(&sel.name).await {
            Ok(s) => {
                let v = s
                    .and_then(|s| s.data)
                    .and_then(|mut d| d.remove(&sel.key))
                    .map(|b| b.0)
                    .filter(|b| !b.is_empty());
                if v.is_none() {
                    warn!(secret = %sel.name, key = %sel.key, "global webhook secret missing");
                }
                self.shared.demand().set_global_secret(v);
            }
            Err(e) => {
                warn!(secret = %sel.name, error = %e, "reading the global webhook secret failed")
            }
        }
    }

    /// One sweep over every App the pools use.
    pub(crate) async fn sweep_once(&self) {
        let pools: Vec<(PoolKey, GithubApp, RunnerScope)> = {
            let m = self.memory.lock().unwrap_or_else(|e| e.into_inner());
            m.iter()
                .filter_map(|(k, p)| p.github.clone().map(|(a, s)| (k.clone(), a, s)))
                .collect()
        };
        // (app id, installation id) -> (client, orgs, repos, pools)
        let mut by_app: BTreeMap<(u64, u64), AppSweep> = BTreeMap::new();
        for (key, app, scope) in pools {
            let e = by_app
                .entry((app.app_id(), app.installation_id()))
                .or_insert_with(|| (app.clone(), HashSet::new(), HashSet::new(), Vec::new()));
            e.3.push(key);
            match scope {
                RunnerScope::Organization { org } => {
                    e.1.insert(org.to_ascii_lowercase());
                }
                RunnerScope::Repository { owner, repo } => {
                    e.2.insert(format!("{owner}/{repo}"));
                }
                RunnerScope::Enterprise { .. } => {}
            }
        }
        for (_, (app, orgs, mut repos, keys)) in by_app {
            let started = Instant::now();
            if !orgs.is_empty() {
                match app.list_installation_repositories().await {
                    Ok(all) => repos.extend(all.into_iter().filter(|r| {
                        r.split_once('/')
                            .is_some_and(|(o, _)| orgs.contains(&o.to_ascii_lowercase()))
                    })),
                    Err(e) => {
                        warn!(app_id = app.app_id(), error = %e, "sweep: listing repositories failed");
                        continue;
                    }
                }
            }
            let mut listed = Vec::new();
            let mut queued = Vec::new();
            let mut complete = true;
            for repo in repos {
                let Some((owner, name)) = repo.split_once('/') else {
                    continue;
                };
                match app.list_queued_jobs(owner, name).await {
                    Ok(jobs) => {
                        queued.extend(jobs.into_iter().map(|j| JobUpdate {
                            id: j.id,
                            state: JobState::parse(&j.status).unwrap_or(JobState::Queued),
                            repository: repo.clone(),
                            labels: j.labels,
                            runner_name: j.runner_name,
                        }));
                        listed.push(repo);
                    }
                    Err(e) => {
                        complete = false;
                        warn!(repository = %repo, error = %e, "sweep: listing queued jobs failed")
                    }
                }
            }
            let changed = {
                let mut d = self.shared.demand();
                let changed = d.observe_sweep(&listed, queued, started, Instant::now());
                d.expire_jobs(Instant::now());
                changed
            };
            for key in changed {
                debug!(pool = %key, "sweep changed demand");
                self.shared.notify(key);
            }
            if complete {
                for key in keys {
                    if !self.memory(&key, |m| std::mem::replace(&mut m.swept, true)) {
                        // Its demand is known now: surplus may be retired.
                        self.shared.notify(key);
                    }
                }
            }
        }
    }
}
