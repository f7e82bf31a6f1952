//! The pool controller: watches ImpVMRunnerPools and the ImpVMs they own, and is woken by demand
//! changes from the webhook receiver and the sweep. Each pass observes (the pool's VMs through a
//! consistent read, so it always sees its own earlier creations; its App; its demand; and GitHub's
//! runner listing when the reaper is due or a deadline needs judging), asks [`decide`] for a
//! [`PoolPlan`], and executes it: deregistrations and VM deletions, mints and creations, Events,
//! counters, the status write and the requeue. One pass per pool at a time (kube-runtime guarantees
//! it), so minting for a VM cannot race with itself.
//!
//! Idempotency across restarts comes from the API objects: a VM's JIT Secret `impvm-<uid>-jit`, owned by
//! that VM, and the runner id/name annotations on the VM prove it was minted; a VM is never minted twice
//! ([`mint_action`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use imp_api::{
    HandoffState, ImpVM, ImpVMClass, ImpVMRunnerPool, ImpVMSpec, Lifecycle, ServedJobStatus,
    names::{
        self, ANNOTATION_BOOT_DIGEST, ANNOTATION_RUNNER_ID, ANNOTATION_RUNNER_NAME,
        FINALIZER_POOL_CLEANUP, LABEL_RUNNER_POOL, LABEL_SECRET_KIND, SECRET_KEY_JITCONFIG,
        SECRET_KIND_JIT, jit_secret_name, reason,
    },
};
use imp_common::ExposeSecret;
use k8s_openapi::{
    ByteString,
    api::core::v1::{Node, Secret},
    apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference},
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams},
    runtime::{
        Controller,
        controller::{self, Action},
        events::{Recorder, Reporter},
        reflector::{ObjectRef, Store},
        watcher,
    },
};
use serde_json::json;
use tracing::{debug, info, warn};

use super::{
    classify::{RunnerState, classify, runner_started, start_failure},
    config::{DEFAULT_WEBHOOK_SECRET_KEY, PoolControllerConfig},
    decide::{
        Creds, Deadlines, Done, Input, JitSecretFacts, MintAction, MintGates, Outcome, PoolPlan,
        RequeueTiming, RunnerFacts, StartFacts, StatusBasis, Sweep, VmFacts,
        account_start_failures, after_store_conflict, credentials_invalid, decide, listing_wanted,
        mint_action, orphans, phase_spans, settle,
    },
    demand::{PoolKey, PoolRoute, ServedJob, sweep_updates},
    freshness::{self, Freshness, Refusal, RefusedExit, RunnerVersion},
    plan::{Backoff, Observed, ObservedVm, Removal, plan},
    shared::PoolShared,
    slo::{ServedFacts, VmTimes, run_phase},
};
use crate::error::{Error, Result};
use crate::github::{
    DeleteOutcome, ErrorClass, GithubApp, GithubError, JitRequest, RunnerScope, runner_name,
};
use crate::index::Index;
use crate::metrics::ReasonLabels;

/// How often a scale-set pool's node capacity is recomputed (a list of the Imp nodes).
const NODE_SLOTS_EVERY: Duration = Duration::from_secs(30);

/// The `controller` label of the reconcile metrics.
pub const CONTROLLER: &str = "impvmrunnerpool";

/// Per-pool memory of the controller (lost on restart, rebuilt from the API objects and GitHub).
#[derive(Debug, Default)]
struct PoolMemory {
    /// Consecutive failed mints, and the wait they impose.
    mint_backoff: Backoff,
    /// Consecutive VMs that failed before their runner started, and the wait they impose.
    start_backoff: Backoff,
    /// VMs (uid) already counted as start failures: each counts once.
    counted_start_failures: HashSet<String>,
    /// VMs (uid) whose `status.start` was counted (`imp_runner_vm_starts_total`): each once.
    counted_starts: HashSet<String>,
    creds: Creds,
    /// App and scope, for the sweep.
    github: Option<(GithubApp, RunnerScope)>,
    /// A sweep covered this pool since the operator started (its demand is known).
    swept: bool,
    /// What the last sweeps learnt of the pool's scope (the DemandListed condition).
    sweep: Sweep,
    /// Runner ids of the pool's VMs GitHub listed online or busy: their online deadline is met.
    confirmed_online: HashSet<u64>,
    /// Last GitHub runner listing of the pool (the reaper's clock).
    last_listing: Option<Instant>,
    /// GitHub refused a runner of the pool's newest version (an outage): shown as Degraded until
    /// a runner of the pool takes a job again.
    outage: Option<Refusal>,
    /// VMs of the pool's class the nodes can host (scale-set pools' `X-ScaleSetMaxCapacity`), and
    /// when that was computed.
    node_slots: Option<(Instant, Option<u32>)>,
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
    /// The last runner listing of each (App installation, scope), shared by the pools of that scope so
    /// the reaper costs about two paginated listings per scope and `reap_interval`, not one per pool. Held
    /// across the call (single flight): pools due at the same moment wait for one listing.
    listings: tokio::sync::Mutex<HashMap<ListingKey, (Instant, Runners)>>,
    /// GitHub's newest runner version per GitHub instance (API base URL), shared by every pool:
    /// one downloads call per `versions_refresh` (single flight, like the listings).
    versions: tokio::sync::Mutex<HashMap<String, (Instant, Option<RunnerVersion>)>>,
    /// The index's Nodes and ImpVMClasses (a scale-set pool's node capacity).
    nodes: Store<Node>,
    classes: Store<ImpVMClass>,
}

/// One listing of a scope's runners, shared between pools.
type Runners = Arc<Vec<RunnerFacts>>;

/// (App id, installation id, scope).
type ListingKey = (u64, u64, RunnerScope);

/// Runs the pool controller and the queued-job sweep until the watches end (or the task is dropped).
/// The pools' ImpVMs, Nodes and ImpVMClasses come from `index`.
pub async fn run_runnerpool_controller(
    client: Client,
    index: Index,
    config: PoolControllerConfig,
    shared: Arc<PoolShared>,
) {
    let pools: Api<ImpVMRunnerPool> = match &config.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    // The index watches every ImpVM; the pool's own are those with the pool label (the selector the
    // controller's own watch of them used).
    let owned = index
        .vms
        .subscribe()
        .filter(|vm| std::future::ready(vm.labels().contains_key(LABEL_RUNNER_POOL)));
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
        listings: tokio::sync::Mutex::new(HashMap::new()),
        versions: tokio::sync::Mutex::new(HashMap::new()),
        nodes: index.nodes.store(),
        classes: index.classes.store(),
        config,
    });
    // Deliveries are answered 503 until every pool's secret is known (a new leader's first moments).
    // The node capacity of scale-set pools is read from the index, so passes wait for it to fill.
    tokio::join!(ctx.load_routes(&pools), index.ready());
    let sweep = sweep_loop(ctx.clone());
    let controller = Controller::new(pools, watcher::Config::default())
        .owns_shared_stream(owned)
        .reconcile_on(trigger)
        .with_config(controller::Config::default().debounce(ctx.config.timing.debounce))
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(pool = %obj, "reconciled"),
                Err(e) => debug!(error = %e, "pool reconcile failed"),
            }
        });
    let intakes =
        crate::scaleset::run_intakes(ctx.client.clone(), ctx.shared.clone(), ctx.recorder.clone());
    tokio::select! {
        () = controller => {},
        () = sweep => {},
        () = intakes => {},
    }
}

fn error_policy(pool: Arc<ImpVMRunnerPool>, err: &Error, ctx: Arc<Ctx>) -> Action {
    warn!(pool = %pool.name_any(), namespace = pool.namespace().unwrap_or_default(), error = %err, "pool reconcile failed");
    ctx.shared.metrics.reconcile_failed(CONTROLLER, err);
    Action::requeue(ctx.config.timing.retry.min(Duration::from_secs(5)))
}

async fn reconcile(pool: Arc<ImpVMRunnerPool>, ctx: Arc<Ctx>) -> Result<Action> {
    let started = Instant::now();
    let result = reconcile_pool(&pool, &ctx).await;
    ctx.shared
        .metrics
        .reconcile_took(CONTROLLER, started.elapsed());
    result
}

async fn reconcile_pool(pool: &ImpVMRunnerPool, ctx: &Ctx) -> Result<Action> {
    let ns = pool
        .namespace()
        .ok_or(Error::MissingObjectKey(".metadata.namespace"))?;
    let key = PoolKey::new(ns, pool.name_any());
    if pool.metadata.deletion_timestamp.is_some() {
        return ctx.cleanup(pool, &key).await;
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
            .map_err(Error::kube(format!("add finalizer to pool {key}")))?;
        // The patch comes back through the watch and triggers the real pass.
        return Ok(Action::await_change());
    }
    ctx.apply(pool, &key).await
}

/// What happened to one removal.
enum Removed {
    Done,
    /// Still registered (busy, or GitHub failed): try again later.
    Pending,
}

/// GitHub's runners of the pool's scope and the runner names existing VMs hold (read after the listing).
type Listing = (Runners, HashSet<String>);

/// What the pass observed of one VM, for the decision. `served`: the job the demand knows the VM's
/// runner took, if any.
fn vm_facts(vm: &ImpVM, busy_runners: &HashSet<String>, served: Option<&ServedJob>) -> VmFacts {
    let ann = vm.annotations();
    let name = ann.get(ANNOTATION_RUNNER_NAME).map(String::as_str);
    let status = vm.status.as_ref();
    VmFacts {
        vm: ObservedVm {
            name: vm.name_any(),
            state: classify(vm, name, busy_runners),
            runner_id: ann.get(ANNOTATION_RUNNER_ID).and_then(|v| v.parse().ok()),
            created: vm
                .creation_timestamp()
                .map(|t| t.0.as_second())
                .unwrap_or_default(),
        },
        scheduled: status.and_then(|s| s.scheduled_time.as_ref()).map(|t| t.0),
        runner_started: status
            .and_then(|s| s.runner.as_ref())
            .and_then(|r| r.started_time.as_ref())
            .map(|t| t.0),
        // The recorded completion first: it survives an operator restart, which empties the demand.
        job_completed: status
            .and_then(|s| s.job.as_ref())
            .and_then(|j| j.completed_time.as_ref())
            .map(|t| t.0)
            .or(served.and_then(|j| j.completed_at)),
        exited_ok: status
            .and_then(|s| s.runner.as_ref())
            .filter(|r| r.handoff == Some(HandoffState::Exited) && r.exit_code == Some(0))
            .and_then(|r| r.exited_time.as_ref())
            .map(|t| t.0),
        attributed: served.is_some() || status.is_some_and(|s| s.job.is_some()),
    }
}

fn vm_times(vm: &ImpVM) -> VmTimes {
    let status = vm.status.as_ref();
    let runner = status.and_then(|s| s.runner.as_ref());
    VmTimes {
        created: vm.creation_timestamp().map(|t| t.0),
        scheduled: status.and_then(|s| s.scheduled_time.as_ref()).map(|t| t.0),
        boot_complete: status
            .and_then(|s| s.boot_complete_time.as_ref())
            .map(|t| t.0),
        runner_started: runner.and_then(|r| r.started_time.as_ref()).map(|t| t.0),
        runner_exited: runner.and_then(|r| r.exited_time.as_ref()).map(|t| t.0),
        clone_start: status
            .and_then(|s| s.start.as_ref())
            .and_then(super::starts::clone_times),
    }
}

fn secret_facts(secret: &Secret, uid: &str) -> JitSecretFacts {
    let ann = secret.annotations();
    JitSecretFacts {
        owned_by_vm: owned_by(secret, uid),
        runner_id: ann.get(ANNOTATION_RUNNER_ID).cloned(),
        runner_name: ann.get(ANNOTATION_RUNNER_NAME).cloned(),
    }
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

    fn deadlines(&self) -> Deadlines {
        Deadlines {
            boot: self.config.timing.boot_deadline,
            online: self.config.timing.runner_online_deadline,
            exit: self.config.timing.runner_exit_grace,
        }
    }

    async fn event(&self, pool: &ImpVMRunnerPool, warning: bool, reason: &str, note: String) {
        let ev = imp_api::events::event(warning, reason, note);
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
        let k = r.key.as_deref().unwrap_or(DEFAULT_WEBHOOK_SECRET_KEY);
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
        let uid = pool.uid().ok_or(Error::MissingObjectKey(".metadata.uid"))?;
        let lp = ListParams::default().labels(&format!("{LABEL_RUNNER_POOL}={}", key.name));
        let list = self
            .vms(key)
            .list(&lp)
            .await
            .map_err(Error::kube(format!("list VMs of pool {key}")))?;
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

    /// GitHub's runners of the scope, then the runner names held by every ImpVM of a pool of this name
    /// in the managed namespaces (same-named pools elsewhere share the name pattern), except VMs
    /// controlled by `except_owner`. Listing GitHub first means a registration minted meanwhile has its
    /// VM (created before any mint) in the second read; that holds for any listing taken before the read,
    /// so another pool's listing of the scope younger than half a `reap_interval` is reused unless `fresh`
    /// (judging a deadline needs GitHub's current view). None if either read failed.
    async fn observe_runners(
        &self,
        key: &PoolKey,
        app: &GithubApp,
        scope: &RunnerScope,
        except_owner: Option<&str>,
        fresh: bool,
    ) -> Option<Listing> {
        let lkey: ListingKey = (app.app_id(), app.installation_id(), scope.clone());
        // Half an interval: a pool reaping with a listing that old still removes every orphan within
        // 1.5 intervals of its orphaning, and a scope is listed at most about twice per interval.
        let reuse_within = self.config.timing.reap_interval / 2;
        let runners = {
            let mut l = self.listings.lock().await;
            l.retain(|_, (at, _)| at.elapsed() < reuse_within);
            match l.get(&lkey).filter(|_| !fresh) {
                Some((_, r)) => r.clone(),
                None => match app.list_runners(scope).await {
                    Ok(r) => {
                        let r: Runners = Arc::new(r.iter().map(RunnerFacts::from).collect());
                        l.insert(lkey, (Instant::now(), r.clone()));
                        r
                    }
                    Err(e) => {
                        warn!(pool = %key, error = %e, "listing the pool's runners at GitHub failed");
                        return None;
                    }
                },
            }
        };
        let vms: Api<ImpVM> = match &self.config.namespace {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        };
        let lp = ListParams::default().labels(&format!("{LABEL_RUNNER_POOL}={}", key.name));
        let list = match vms.list(&lp).await {
            Ok(l) => l,
            Err(e) => {
                warn!(pool = %key, error = %e, "listing runner VMs for the reaper failed");
                return None;
            }
        };
        let held = list
            .items
            .iter()
            .filter(|vm| {
                except_owner.is_none_or(|owner| {
                    !vm.owner_references()
                        .iter()
                        .any(|o| o.controller == Some(true) && o.uid == owner)
                })
            })
            .flat_map(|vm| {
                let by_uid = vm.uid().map(|uid| runner_name(&key.name, &uid));
                let recorded = vm.annotations().get(ANNOTATION_RUNNER_NAME).cloned();
                by_uid.into_iter().chain(recorded)
            })
            .collect();
        Some((runners, held))
    }

    /// GitHub's newest runner version (Linux x64), read through the pool's App at most once per
    /// `versions_refresh` per GitHub instance; a failed read keeps the last version known and is
    /// retried after a tenth of the interval.
    async fn newest_runner(&self, app: &GithubApp, scope: &RunnerScope) -> Option<RunnerVersion> {
        let key = app.inner.config.api_base_url.clone();
        let refresh = self.config.timing.versions_refresh;
        let mut cache = self.versions.lock().await;
        if let Some((at, latest)) = cache.get(&key)
            && at.elapsed() < refresh
        {
            return *latest;
        }
        let previous = cache.get(&key).and_then(|(_, v)| *v);
        let (at, latest) = match app.runner_downloads(scope).await {
            Ok(d) => {
                let latest =
                    crate::github::newest_linux_x64(&d).and_then(|v| RunnerVersion::parse(&v));
                if latest.is_none() {
                    warn!(%scope, "GitHub's runner downloads list no linux x64 release");
                }
                (Instant::now(), latest.or(previous))
            }
            Err(e) => {
                warn!(%scope, error = %e, "reading GitHub's supported runner versions failed");
                let retry_in = refresh / 10;
                let at = Instant::now()
                    .checked_sub(refresh.saturating_sub(retry_in))
                    .unwrap_or_else(Instant::now);
                (at, previous)
            }
        };
        cache.insert(key, (at, latest));
        latest
    }

    /// Reads every pool's routing (labels, scope, webhook secret) and the global webhook secret, then
    /// lets the receiver judge deliveries; retried until the reads succeed.
    async fn load_routes(&self, pools: &Api<ImpVMRunnerPool>) {
        loop {
            match pools.list(&ListParams::default()).await {
                Ok(list) => {
                    for pool in &list.items {
                        let (Some(ns), Some(scope)) = (pool.namespace(), scope_of(pool)) else {
                            continue;
                        };
                        if pool.metadata.deletion_timestamp.is_some() {
                            continue;
                        }
                        let key = PoolKey::new(ns, pool.name_any());
                        let route = PoolRoute {
                            labels: crate::scaleset::route_labels(&pool.spec.github),
                            scope,
                            webhook_secret: self.webhook_secret(pool, &key).await,
                        };
                        self.shared.demand().upsert_pool(key, route);
                    }
                    if self.refresh_global_secret().await {
                        info!(
                            pools = list.items.len(),
                            "pool webhook secrets read; accepting deliveries"
                        );
                        self.shared.mark_routes_loaded();
                        return;
                    }
                }
                Err(e) => warn!(error = %e, "listing pools to read their webhook secrets failed"),
            }
            tokio::time::sleep(self.config.timing.retry).await;
        }
    }

    /// Records the App (for the sweep) or why there is none; wakes the sweep when the App is new.
    fn remember_app(
        &self,
        key: &PoolKey,
        app: &Result<GithubApp, Creds>,
        scope: &Option<RunnerScope>,
    ) {
        match app {
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
    }

    /// VMs of the pool's class its nodes can host ([`crate::scaleset::decide::node_slots`]), from
    /// the index's Nodes and the ImpVMClass, recomputed at most every
    /// [`NODE_SLOTS_EVERY`]; None when unknown (no class, no Imp node).
    async fn node_slots(&self, pool: &ImpVMRunnerPool, key: &PoolKey) -> Option<u32> {
        if let Some((at, slots)) = self.memory(key, |m| m.node_slots)
            && at.elapsed() < NODE_SLOTS_EVERY
        {
            return slots;
        }
        let t = &pool.spec.template.spec;
        let slots = self
            .classes
            .get(&ObjectRef::new(&t.class_ref.name))
            .and_then(|class| {
                let req = crate::scheduler::VmRequest {
                    vcpu: class.spec.vcpu,
                    memory_mib: u64::from(class.spec.memory_mib),
                    disk_mib: u64::from(class.spec.disk_gib()) * 1024,
                    node_selector: t.node_selector.clone().unwrap_or_default(),
                    tolerations: t.tolerations.clone().unwrap_or_default(),
                    template_of: None,
                };
                let infos: Vec<_> = self
                    .nodes
                    .state()
                    .iter()
                    .map(|n| {
                        crate::scheduler::NodeInfo::from_node(n, crate::scheduler::Heartbeat::Fresh)
                    })
                    .collect();
                crate::scaleset::decide::node_slots(&infos, &req)
            });
        self.memory(key, |m| m.node_slots = Some((Instant::now(), slots)));
        slots
    }

    /// Hands a pool with `spec.github.scaleSet` (and a usable App) to the scale-set intake.
    fn want_scale_set(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        app: &std::result::Result<GithubApp, Creds>,
        scope: &Option<RunnerScope>,
        node_slots: Option<u32>,
    ) {
        let (Some(set), Ok(app), Some(scope), Some(owner)) = (
            &pool.spec.github.scale_set,
            app,
            scope,
            pool.controller_owner_ref(&()),
        ) else {
            self.shared.scale_sets.forget(key);
            return;
        };
        self.shared.scale_sets.want(crate::scaleset::IntakeSpec {
            key: key.clone(),
            app: app.clone(),
            scope: scope.clone(),
            scale_set: set.clone(),
            labels: crate::scaleset::route_labels(&pool.spec.github),
            max_runners: pool.spec.scaling.max_runners,
            node_slots,
            owner,
        });
    }

    async fn apply(&self, pool: &ImpVMRunnerPool, key: &PoolKey) -> Result<Action> {
        let timing = &self.config.timing;
        // Observe.
        let app = self.app(pool, key).await;
        let scope = scope_of(pool);
        self.remember_app(key, &app, &scope);
        let node_slots = match pool.spec.github.scale_set {
            Some(_) => self.node_slots(pool, key).await,
            None => None,
        };
        self.want_scale_set(pool, key, &app, &scope, node_slots);
        if let Some(scope) = scope.clone() {
            let route = PoolRoute {
                labels: crate::scaleset::route_labels(&pool.spec.github),
                scope,
                webhook_secret: self.webhook_secret(pool, key).await,
            };
            self.shared.demand().upsert_pool(key.clone(), route);
        }
        let vms = self.list_vms(pool, key).await?;
        let demand = self.shared.demand().pool_demand(key);
        let now = Instant::now();
        let wall = Timestamp::now();
        let facts: Vec<VmFacts> = {
            let d = self.shared.demand();
            vms.iter()
                .map(|vm| {
                    let served = vm
                        .annotations()
                        .get(ANNOTATION_RUNNER_NAME)
                        .and_then(|r| d.served_by(key, r));
                    vm_facts(vm, &demand.busy_runners, served.as_ref())
                })
                .collect()
        };
        let started_runners = vms
            .iter()
            .filter_map(|vm| {
                let name = vm.annotations().get(ANNOTATION_RUNNER_NAME)?;
                let t = vm.status.as_ref()?.runner.as_ref()?.started_time.as_ref()?;
                Some((name.clone(), t.0))
            })
            .collect();
        self.credit_pickups(key, started_runners, now, wall);
        let refused = self.note_start_failures(pool, key, &vms).await;
        self.note_starts(key, &vms);
        let served: Vec<ServedFacts> = {
            let d = self.shared.demand();
            vms.iter()
                .filter(|vm| vm.metadata.deletion_timestamp.is_none())
                .filter_map(|vm| {
                    let runner = vm.annotations().get(ANNOTATION_RUNNER_NAME)?;
                    Some(ServedFacts {
                        vm: vm.name_any(),
                        recorded: vm.status.as_ref().and_then(|s| s.job.clone()),
                        times: vm_times(vm),
                        job: d.served_by(key, runner),
                    })
                })
                .collect()
        };

        // Runner freshness: the pool's runner version against GitHub's newest, and what this
        // pass's refused runners (exit code 7) mean.
        let newest = match (&app, &scope) {
            (Ok(app), Some(scope)) => self.newest_runner(app, scope).await,
            _ => None,
        };
        // A runner of the pool took a job (busy now, or exited 0 after one): GitHub accepts it.
        let any_busy = facts.iter().any(|f| f.vm.state == RunnerState::Busy)
            || vms.iter().any(|vm| {
                vm.status
                    .as_ref()
                    .and_then(|s| s.runner.as_ref())
                    .is_some_and(|r| r.exit_code == Some(0))
            });
        let freshness = self
            .freshness(pool, key, newest, &refused, any_busy, wall)
            .await;

        let deadlines = self.deadlines();
        let live_ids: HashSet<u64> = facts.iter().filter_map(|f| f.vm.runner_id).collect();
        let (creds, confirmed, backoffs, since_listing, demand_known, sweep) =
            self.memory(key, |m| {
                m.confirmed_online.retain(|id| live_ids.contains(id));
                (
                    m.creds.clone(),
                    m.confirmed_online.clone(),
                    (m.mint_backoff.active(now), m.start_backoff.active(now)),
                    m.last_listing.map(|t| now.duration_since(t)),
                    m.swept,
                    m.sweep.clone(),
                )
            });
        let gates = MintGates {
            creds_invalid: matches!(creds, Creds::Invalid { .. }) || app.is_err(),
            no_scope: scope.is_none(),
            mint_backoff: backoffs.0,
            start_backoff: backoffs.1,
            version_deprecated: freshness.minting_stopped,
        };
        let app = app.ok();
        let wanted = listing_wanted(
            &facts,
            &deadlines,
            &confirmed,
            since_listing,
            timing.reap_interval,
            wall,
        );
        let listing = match (&app, &scope, wanted) {
            (Some(app), Some(scope), Some(fresh)) => {
                self.observe_runners(key, app, scope, None, fresh).await
            }
            _ => None,
        };

        // Decide.
        let pp = decide(&Input {
            vms: &facts,
            scaling: &pool.spec.scaling,
            queued: demand.queued,
            gates,
            demand_known,
            deadlines,
            confirmed_online: &confirmed,
            listing: listing.as_ref().map(|(r, h)| (r.as_slice(), h)),
            pool_name: &key.name,
            now: wall,
            served: &served,
            status: StatusBasis {
                old: pool.status.clone().unwrap_or_default(),
                generation: pool.metadata.generation,
                max_runners: pool.spec.scaling.max_runners,
                sweep,
                freshness,
                creds,
            },
            timing: RequeueTiming {
                resync: timing.resync,
                retry: timing.retry,
                scaling_requeue: timing.scaling_requeue,
                reap_interval: timing.reap_interval,
            },
        });
        let p = &pp.plan;
        debug!(pool = %key, ?p.counts, desired = p.desired, create = p.create, retire = p.retire.len(), cleanup = p.cleanup.len(), replace = pp.replace.len(), reap = pp.reap.delete.len(), "plan");
        self.memory(key, |m| {
            m.confirmed_online.extend(pp.seen_online.iter().copied());
            if listing.is_some() {
                m.last_listing = Some(now);
            }
        });

        // Execute, then settle what it came to (see `settle` for why that is a step of its own).
        let mut outcome = self
            .execute(pool, key, app.as_ref(), scope.as_ref(), &vms, &pp)
            .await;
        self.record_served(key, &pp).await;
        let after = Instant::now();
        self.memory(key, |m| {
            outcome.creds = m.creds.clone();
            outcome.backoffs = [m.mint_backoff.until(), m.start_backoff.until()]
                .into_iter()
                .flatten()
                .filter(|t| *t > after)
                .map(|t| t - after)
                .collect();
            outcome.since_listing = m.last_listing.map(|t| after.duration_since(t));
        });
        let settled = settle(&pp, &outcome, Timestamp::now());
        for n in settled.events {
            info!(pool = %key, reason = n.reason, "{}", n.message);
            self.event(pool, n.warning, n.reason, n.message).await;
        }
        self.write_status(key, &pp.basis.old, settled.status)
            .await?;
        Ok(Action::requeue(settled.requeue))
    }

    /// Walks a live pool's plan in its order (removals, the reaper, mints, creations) and says what came
    /// of it; the credentials, backoffs and listing age are the caller's to add.
    async fn execute(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        app: Option<&GithubApp>,
        scope: Option<&RunnerScope>,
        vms: &[ImpVM],
        pp: &PoolPlan,
    ) -> Outcome {
        let p = &pp.plan;
        let mut pending = false;
        let mut done = Done::default();
        let mut reaped = Vec::new();
        let by_name: HashMap<&str, &ImpVM> = vms.iter().map(|v| (v.name_any_ref(), v)).collect();
        for r in &p.cleanup {
            match self.remove(key, app, scope, r).await {
                Removed::Done => {
                    done.cleaned += 1;
                    // Each finished VM is cleaned up once: its phases are observed then.
                    if let Some(vm) = by_name.get(r.name.as_str()) {
                        for (phase, d) in phase_spans(&vm_times(vm)) {
                            self.shared.metrics.vm_phase(phase, d);
                        }
                    }
                }
                Removed::Pending => pending = true,
            }
        }
        for (r, why) in &pp.replace {
            match self.remove(key, app, scope, r).await {
                Removed::Done => {
                    done.cleaned += 1;
                    self.shared.metrics.deadline_replacement(why.metric_label());
                    let d = self.deadlines();
                    let within = match why {
                        super::decide::Overdue::BootDeadlineExceeded => d.boot,
                        super::decide::Overdue::RunnerNeverOnline => d.online,
                    };
                    warn!(pool = %key, vm = %r.name, reason = why.reason(), "runner VM past its deadline; replaced");
                    self.event(pool, true, why.reason(), format!("Runner VM {} missed its deadline ({within:?}); its registration was deleted and the VM replaced", r.name)).await;
                }
                Removed::Pending => pending = true,
            }
        }
        for r in &p.retire {
            match self.remove(key, app, scope, r).await {
                Removed::Done => done.retired += 1,
                Removed::Pending => pending = true,
            }
        }
        if let (Some(app), Some(scope)) = (app, scope) {
            if pp.reap.busy > 0 {
                debug!(pool = %key, busy = pp.reap.busy, "orphan registrations running a job are left alone");
            }
            for (id, name) in &pp.reap.delete {
                if self.deregister(key, app, scope, *id).await {
                    self.shared.metrics.orphan_reaped();
                    reaped.push(name.clone());
                } else {
                    pending = true;
                }
            }
        }
        // The first failed mint or creation ends minting for this pass: the backoff it started holds
        // the rest, and `settle` reports it.
        let mut mint_failed = false;
        if let (Some(app), Some(scope)) = (app, scope) {
            for name in &p.mint {
                if let Some(vm) = by_name.get(name.as_str())
                    && let Err(e) = self.mint(pool, key, app, scope, vm, None).await
                {
                    debug!(pool = %key, vm = %name, error = %e, "mint failed");
                    mint_failed = true;
                    break;
                }
            }
            if !mint_failed && p.create > 0 {
                let results: Vec<Result<()>> = futures::stream::iter(0..p.create)
                    .map(|_| self.create_runner(pool, key, app, scope))
                    .buffer_unordered(self.config.create_concurrency.max(1))
                    .collect()
                    .await;
                done.created = results.iter().filter(|r| r.is_ok()).count() as u32;
                if let Some(e) = results.iter().find_map(|r| r.as_ref().err()) {
                    debug!(pool = %key, error = %e, "creating a runner failed");
                    mint_failed = true;
                }
            }
        }
        Outcome {
            done,
            mint_failed,
            pending,
            reaped,
            ..Outcome::default()
        }
    }

    /// Writes the served jobs' records on their VMs and observes their phases once written; observes the
    /// `run` phase of the pool's jobs that completed (their VMs may be gone already).
    async fn record_served(&self, key: &PoolKey, pp: &PoolPlan) {
        for u in &pp.served {
            let patch = json!({"status": {"job": u.status}});
            let recorded = match self
                .vms(key)
                .patch_status(&u.vm, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => true,
                // Gone, this pass's removals among the likely (a job done within one pass: its
                // runner already exited when its pickup was first learnt): no later pass sees
                // it, so its phases are observed now, once, or never.
                Err(kube::Error::Api(s)) if s.code == 404 => true,
                Err(e) => {
                    warn!(pool = %key, vm = %u.vm, error = %e, "recording the served job on the VM failed");
                    false
                }
            };
            if recorded {
                for (phase, d) in &u.phases {
                    self.shared.metrics.job_phase(phase, *d);
                }
                if let Some(w) = u.wait {
                    self.shared.metrics.job_wait.observe(w.as_secs_f64());
                }
                if !u.phases.is_empty() {
                    info!(pool = %key, vm = %u.vm, job_id = ?u.status.job_id, wait = ?u.wait, "served job recorded");
                }
            }
        }
        let runs = self.shared.demand().take_completed_runs(key);
        for (picked_up, completed) in runs {
            self.shared
                .metrics
                .job_phase("run", run_phase(picked_up, completed));
        }
    }

    /// Records when the VM was created and minted (`status.job`, the first steps of the SLO of whichever
    /// job it serves).
    async fn record_minted(&self, key: &PoolKey, vm: &ImpVM, created: Option<Timestamp>) {
        let created = created.or(vm.creation_timestamp().map(|t| t.0));
        let job = ServedJobStatus {
            vm_created_time: created.map(MicroTime),
            minted_time: Some(MicroTime(Timestamp::now())),
            ..ServedJobStatus::default()
        };
        let patch = json!({"status": {"job": job}});
        if let Err(e) = self
            .vms(key)
            .patch_status(
                &vm.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            debug!(pool = %key, vm = %vm.name_any(), error = %e, "recording the mint time failed");
        }
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

    /// Deregisters one runner, counting the result; true when it is gone at GitHub.
    async fn deregister(
        &self,
        key: &PoolKey,
        app: &GithubApp,
        scope: &RunnerScope,
        id: u64,
    ) -> bool {
        match app.delete_runner(scope, id).await {
            Ok(DeleteOutcome::Deleted) => {
                self.shared.metrics.deregistration("deleted");
                true
            }
            Ok(DeleteOutcome::AlreadyGone) => {
                self.shared.metrics.deregistration("already_gone");
                true
            }
            Err(e) if e.class() == ErrorClass::Busy => {
                self.shared.metrics.deregistration("busy");
                debug!(pool = %key, runner_id = id, "runner busy; kept");
                false
            }
            Err(e) => {
                self.shared.metrics.deregistration("error");
                warn!(pool = %key, runner_id = id, error = %e, "deregistering runner failed");
                false
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
            if !self.deregister(key, app, scope, id).await {
                return Removed::Pending;
            }
        }
        self.delete_vm(key, &r.name).await
    }

    async fn delete_vm(&self, key: &PoolKey, name: &str) -> Removed {
        match self
            .vms(key)
            .delete(name, &DeleteParams::background())
            .await
        {
            Ok(_) => {
                info!(pool = %key, vm = %name, "runner VM deleted");
                Removed::Done
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Removed::Done,
            Err(e) => {
                warn!(pool = %key, vm = %name, error = %e, "deleting runner VM failed");
                Removed::Pending
            }
        }
    }

    /// Creates one runner VM and mints its config.
    async fn create_runner(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        app: &GithubApp,
        scope: &RunnerScope,
    ) -> Result<()> {
        let vm = runner_vm(pool)?;
        let created = self
            .vms(key)
            .create(&PostParams::default(), &vm)
            .await
            .map_err(Error::kube(format!("create a runner VM of pool {key}")))?;
        self.mint(pool, key, app, scope, &created, Some(Timestamp::now()))
            .await
    }

    /// Gives `vm` its JIT config as [`mint_action`] says: adopts a Secret this VM already owns, else
    /// mints one. A VM that can never get a config (conflict, lost config, failed mint) is deleted and
    /// its registration, if any, removed. `created`: when this pass created the VM (else its
    /// creationTimestamp counts).
    async fn mint(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        app: &GithubApp,
        scope: &RunnerScope,
        vm: &ImpVM,
        created: Option<Timestamp>,
    ) -> Result<()> {
        let vm_name = vm.name_any();
        let uid = vm.uid().ok_or(Error::MissingObjectKey(".metadata.uid"))?;
        if !from_template(pool, vm) {
            // A VM anyone with ImpVM RBAC made to look like ours (label, owner reference): never
            // hand it a registration of this pool (issue 15).
            let err = Error::ForeignRunnerVm {
                vm: vm_name.clone(),
            };
            self.event(
                pool,
                true,
                reason::FOREIGN_RUNNER_VM,
                format!("{err}; deleting it"),
            )
            .await;
            self.delete_vm(key, &vm_name).await;
            return Err(err);
        }
        let secret_name = jit_secret_name(&uid);
        let secrets = self.secrets(key);
        let existing = secrets
            .get_opt(&secret_name)
            .await
            .map_err(Error::kube(format!("read JIT Secret {secret_name}")))?;
        let action = mint_action(
            existing.as_ref().map(|s| secret_facts(s, &uid)).as_ref(),
            vm.annotations()
                .get(ANNOTATION_RUNNER_ID)
                .map(String::as_str),
        );
        match action {
            MintAction::Adopt {
                runner_id,
                runner_name,
            } => {
                info!(pool = %key, vm = %vm_name, "adopting the JIT Secret this VM already owns");
                return self
                    .attach(key, &vm_name, &secret_name, &runner_id, &runner_name)
                    .await;
            }
            MintAction::Conflict => {
                let err = Error::JitSecretConflict {
                    secret: secret_name,
                    vm: vm_name.clone(),
                };
                self.event(
                    pool,
                    true,
                    reason::SECRET_CONFLICT,
                    format!("{err}; deleting the VM"),
                )
                .await;
                self.delete_vm(key, &vm_name).await;
                return Err(err);
            }
            MintAction::Lost { runner_id } => {
                let err = Error::JitConfigLost {
                    vm: vm_name.clone(),
                };
                self.event(
                    pool,
                    true,
                    reason::JIT_CONFIG_LOST,
                    format!("{err}; replacing the VM"),
                )
                .await;
                let r = Removal {
                    name: vm_name,
                    runner_id,
                };
                self.remove(key, Some(app), Some(scope), &r).await;
                return Err(err);
            }
            MintAction::Mint => {}
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
        let minted = if pool.spec.github.scale_set.is_some() {
            // Bound to the scale set: GitHub hands this runner the scale set's jobs only.
            match self
                .shared
                .scale_sets
                .mint(key, &req.runner_name, &req.work_folder)
                .await
            {
                Ok(m) => m,
                Err(e) => {
                    self.mint_failed(pool, key, &vm_name, e.metric_label(), false, &e)
                        .await;
                    return Err(Error::ScaleSetMint {
                        vm: vm_name,
                        source: e,
                    });
                }
            }
        } else {
            match app.generate_jit_config(&req).await {
                Ok(m) => m,
                Err(e) => {
                    let invalid = credentials_invalid(&e);
                    self.mint_failed(pool, key, &vm_name, e.metric_label(), invalid, &e)
                        .await;
                    return Err(Error::Mint {
                        vm: vm_name,
                        source: e,
                    });
                }
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
        // The VM passed from_template above: its boot digest is the template's (crate docs of
        // imp_api::frozen; the agent refuses a VM whose spec no longer has it).
        let boot = imp_api::frozen::boot_digest(&vm.spec);
        let secret = jit_secret(key, &secret_name, &vm_name, &uid, &minted, boot);
        let lost = Removal {
            name: vm_name.clone(),
            runner_id: Some(minted.runner_id),
        };
        match secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // Written meanwhile by an earlier attempt or someone else: what is there decides;
                // either way the registration just minted is surplus.
                let now_there = secrets.get_opt(&secret_name).await.ok().flatten();
                match after_store_conflict(
                    now_there.as_ref().map(|s| secret_facts(s, &uid)).as_ref(),
                ) {
                    MintAction::Adopt {
                        runner_id,
                        runner_name,
                    } => {
                        self.deregister(key, app, scope, minted.runner_id).await;
                        return self
                            .attach(key, &vm_name, &secret_name, &runner_id, &runner_name)
                            .await;
                    }
                    _ => {
                        self.remove(key, Some(app), Some(scope), &lost).await;
                        return Err(Error::JitSecretConflict {
                            secret: secret_name,
                            vm: vm_name,
                        });
                    }
                }
            }
            Err(e) => {
                // The minted registration has no home: deregister it and replace the VM.
                warn!(pool = %key, vm = %vm_name, error = %e, "storing JIT Secret failed");
                self.remove(key, Some(app), Some(scope), &lost).await;
                return Err(Error::from_kube(
                    &format!("store JIT Secret {secret_name}"),
                    e,
                ));
            }
        }
        // On failure the Secret (owned by the VM) proves the mint: the next pass adopts it, or the
        // garbage collector removes it with the VM.
        self.attach(
            key,
            &vm_name,
            &secret_name,
            &Some(runner_id),
            &Some(minted.runner_name.clone()),
        )
        .await?;
        self.record_minted(key, vm, created).await;
        debug!(pool = %key, vm = %vm_name, runner_id = minted.runner_id, runner_name = %minted.runner_name, "runner minted");
        Ok(())
    }

    async fn attach(
        &self,
        key: &PoolKey,
        vm: &str,
        secret: &str,
        runner_id: &Option<String>,
        runner: &Option<String>,
    ) -> Result<()> {
        let patch = json!({
            "metadata": {"annotations": {ANNOTATION_RUNNER_ID: runner_id, ANNOTATION_RUNNER_NAME: runner}},
            "spec": {"runnerConfigSecret": secret},
        });
        self.vms(key)
            .patch(vm, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(Error::kube(format!("record JIT Secret on VM {vm}")))?;
        Ok(())
    }

    /// Counts each VM's start (booted or cloned, and a clone's fallback) once.
    fn note_starts(&self, key: &PoolKey, vms: &[ImpVM]) {
        let facts: Vec<_> = vms
            .iter()
            .filter_map(|vm| Some((vm.uid()?, vm.status.as_ref()?.start.as_ref())))
            .collect();
        let fresh = self.memory(key, |m| {
            super::starts::account_starts(&mut m.counted_starts, &facts)
        });
        for s in &fresh {
            debug!(pool = %key, from = s.from, fallback = %s.fallback, "runner VM started");
            self.shared.metrics.vm_started(s);
        }
    }

    /// Counts VMs that failed before their runner started ([`account_start_failures`]), with an Event
    /// naming the VM and its reason. A runner GitHub refused (exit code 7) never took a job either:
    /// it counts the same way (so even an outage at GitHub cannot cause a retry storm), and is
    /// returned, once, for the freshness verdict instead of getting a VmStartFailed Event.
    async fn note_start_failures(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        vms: &[ImpVM],
    ) -> Vec<RefusedExit> {
        let timing = &self.config.timing;
        let facts: Vec<StartFacts> = vms
            .iter()
            .filter_map(|vm| {
                let refused = refused_by_github(vm);
                Some(StartFacts {
                    uid: vm.uid()?,
                    name: vm.name_any(),
                    failure: if refused {
                        Some(reason::RUNNER_VERSION_DEPRECATED.to_owned())
                    } else {
                        start_failure(vm)
                    },
                    runner_started: runner_started(vm) && !refused,
                })
            })
            .collect();
        let fresh = self.memory(key, |m| {
            account_start_failures(
                &mut m.counted_start_failures,
                &mut m.start_backoff,
                &facts,
                Instant::now(),
                timing.start_backoff,
                timing.start_backoff_max,
            )
        });
        let mut refused = Vec::new();
        for f in fresh {
            let (vm, reason, wait, n) = (f.vm, f.reason, f.wait, f.consecutive);
            if let Some(v) = vms
                .iter()
                .find(|v| v.name_any() == vm)
                .filter(|v| refused_by_github(v))
            {
                info!(pool = %key, vm, backoff = ?wait, "GitHub refused the runner's version (exit code 7)");
                // Of the pool's current runner layer: the same template and runner version.
                let same_version = v.annotations().get(names::ANNOTATION_RUNNER_VERSION)
                    == pool.spec.github.runner_version.as_ref();
                refused.push(RefusedExit {
                    vm,
                    current_template: same_version && from_template(pool, v),
                });
                continue;
            }
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
        refused
    }

    /// The freshness verdict of a pass ([`freshness`]): judges the pool's runner version, records
    /// a deprecated refusal (Event, counter) and remembers an outage.
    async fn freshness(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        newest: Option<RunnerVersion>,
        refused: &[RefusedExit],
        any_busy: bool,
        now: Timestamp,
    ) -> Freshness {
        let generation = pool.metadata.generation;
        let old = pool.status.as_ref().and_then(|s| s.runner_version.as_ref());
        let spec_version = pool.spec.github.runner_version.as_deref();
        let (mut status, verdict) = freshness::judge(spec_version, newest, old, now);
        let known = status.latest.as_deref().and_then(RunnerVersion::parse);
        let version = spec_version.and_then(RunnerVersion::parse);
        let refusal = freshness::refusal(refused, version, known);
        let label = key.to_string();
        if freshness::record_refusal(&mut status, refusal.as_ref(), generation, now) {
            self.shared.metrics.version_refused(&label, "deprecated");
            let (_, _, message) = freshness::degraded(&status, generation, None);
            warn!(pool = %key, "{message}");
            self.event(pool, true, reason::RUNNER_VERSION_DEPRECATED, message)
                .await;
        }
        let outage = self.memory(key, |m| {
            if any_busy {
                m.outage = None;
            }
            if let Some(o @ Refusal::Outage { .. }) = &refusal {
                m.outage = Some(o.clone());
            }
            m.outage.clone()
        });
        if let Some(Refusal::Outage { vm }) = &refusal {
            self.shared.metrics.version_refused(&label, "outage");
            let (_, _, message) = freshness::degraded(&status, generation, outage.as_ref());
            warn!(pool = %key, vm, "{message}");
            self.event(pool, true, reason::RUNNER_REFUSED_CURRENT_VERSION, message)
                .await;
        }
        let stopped = freshness::minting_stopped(&status, generation);
        self.shared
            .metrics
            .set_freshness(&label, verdict.days_left(), stopped);
        Freshness {
            supported: verdict.condition(version, known),
            degraded: freshness::degraded(&status, generation, outage.as_ref()),
            minting_stopped: stopped,
            status,
        }
    }

    /// `label` is the error's metric label; `invalid`: it says the App's credentials are bad.
    async fn mint_failed(
        &self,
        pool: &ImpVMRunnerPool,
        key: &PoolKey,
        vm: &str,
        label: &str,
        invalid: bool,
        e: &(dyn std::fmt::Display + Sync),
    ) {
        self.shared
            .metrics
            .jit_mint_errors
            .get_or_create(&ReasonLabels {
                reason: label.to_owned(),
            })
            .inc();
        let timing = &self.config.timing;
        let wait = self.memory(key, |m| {
            let wait =
                m.mint_backoff
                    .fail(Instant::now(), timing.mint_backoff, timing.mint_backoff_max);
            if invalid {
                m.creds = Creds::Invalid {
                    reason: reason::CREDENTIALS_INVALID,
                    message: e.to_string(),
                };
            }
            wait
        });
        warn!(pool = %key, vm, error = %e, backoff = ?wait, "minting JIT config failed; deleting the VM");
        self.delete_vm(key, vm).await;
        self.event(
            pool,
            true,
            reason::MINT_FAILED,
            format!("Minting a JIT runner config for VM {vm} failed ({label}); VM deleted, retrying in {wait:?}: {e}"),
        )
        .await;
    }

    /// Exports the pool's counts and writes its status when it changed.
    async fn write_status(
        &self,
        key: &PoolKey,
        old: &imp_api::ImpVMRunnerPoolStatus,
        status: imp_api::ImpVMRunnerPoolStatus,
    ) -> Result<()> {
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
        if status == *old {
            return Ok(());
        }
        let patch = json!({"status": status});
        self.pools(key)
            .patch_status(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(Error::kube(format!("write status of pool {key}")))?;
        Ok(())
    }

    /// The pool is being deleted: deregister every runner (those of its VMs, then any registration of
    /// the pool left without a VM), delete every VM, then let it go. Without its App Secret nothing can
    /// be deregistered: an Event names what stays at GitHub and the pool goes at once.
    async fn cleanup(&self, pool: &ImpVMRunnerPool, key: &PoolKey) -> Result<Action> {
        if !pool
            .finalizers()
            .iter()
            .any(|f| f == FINALIZER_POOL_CLEANUP)
        {
            self.forget(key);
            return Ok(Action::await_change());
        }
        let app = self.app(pool, key).await;
        let scope = scope_of(pool);
        let vms = self.list_vms(pool, key).await?;
        if let Err(Creds::Invalid {
            reason: why,
            message,
        }) = &app
            && *why == reason::SECRET_NOT_FOUND
        {
            let stranded: Vec<&str> = vms
                .iter()
                .filter_map(|vm| {
                    vm.annotations()
                        .get(ANNOTATION_RUNNER_NAME)
                        .map(String::as_str)
                })
                .collect();
            self.event(pool, true, reason::REGISTRATIONS_ABANDONED, format!("{message}: the pool's runner registrations cannot be deleted and stay at GitHub until removed by hand (known: {}; registrations without a VM are not known)", if stranded.is_empty() { "none".to_owned() } else { stranded.join(", ") })).await;
            for vm in &vms {
                if vm.metadata.deletion_timestamp.is_none() {
                    self.delete_vm(key, &vm.name_any()).await;
                }
            }
            return self.release(pool, key).await;
        }
        let app = app.ok();
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
        if let (Some(app), Some(scope)) = (app.as_ref(), scope.as_ref()) {
            // Registrations without a VM (failed mints, VMs deleted by hand) go before the finalizer.
            match self
                .observe_runners(key, app, scope, pool.uid().as_deref(), true)
                .await
            {
                Some((runners, held)) => {
                    let reap = orphans(&key.name, &runners, &held);
                    pending += reap.busy;
                    for (id, _) in &reap.delete {
                        if self.deregister(key, app, scope, *id).await {
                            self.shared.metrics.orphan_reaped();
                        } else {
                            pending += 1;
                        }
                    }
                }
                None => pending += 1,
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
                self.delete_vm(key, &r.name).await;
            }
        }
        self.release(pool, key).await
    }

    /// Removes the pool's finalizer and forgets it.
    async fn release(&self, pool: &ImpVMRunnerPool, key: &PoolKey) -> Result<Action> {
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
            Err(e) => {
                return Err(Error::from_kube(
                    &format!("remove finalizer of pool {key}"),
                    e,
                ));
            }
        }
        info!(pool = %key, "pool cleaned up");
        self.forget(key);
        Ok(Action::await_change())
    }

    fn forget(&self, key: &PoolKey) {
        self.shared.demand().remove_pool(key);
        self.shared.scale_sets.forget(key);
        self.shared.metrics.remove_pool(&key.to_string());
        self.memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }
}

/// The JIT Secret of a VM: owned by the VM (deleted with it), labelled for the pool, carrying the runner
/// id and name and the boot digest of the spec it was minted for.
fn jit_secret(
    key: &PoolKey,
    secret_name: &str,
    vm_name: &str,
    uid: &str,
    minted: &crate::github::JitRunner,
    boot_digest: String,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name.to_owned()),
            namespace: Some(key.namespace.clone()),
            labels: Some(BTreeMap::from([
                (LABEL_SECRET_KIND.to_owned(), SECRET_KIND_JIT.to_owned()),
                (LABEL_RUNNER_POOL.to_owned(), key.name.clone()),
            ])),
            annotations: Some(BTreeMap::from([
                (
                    ANNOTATION_RUNNER_ID.to_owned(),
                    minted.runner_id.to_string(),
                ),
                (
                    ANNOTATION_RUNNER_NAME.to_owned(),
                    minted.runner_name.clone(),
                ),
                (ANNOTATION_BOOT_DIGEST.to_owned(), boot_digest),
            ])),
            owner_references: Some(vec![OwnerReference {
                api_version: "imp.dev/v1alpha1".into(),
                kind: "ImpVM".into(),
                name: vm_name.to_owned(),
                uid: uid.to_owned(),
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

/// Whether `vm`'s spec is what [`runner_vm`] makes of `pool` (scheduling and the mint's own field aside).
/// The VM's runner exited with [`freshness::EXIT_DEPRECATED`]: GitHub refused its version (the
/// runner layer maps the deprecation message to that code too). The node agent records the code in
/// `status.runner.exitCode` with handoff Exited.
fn refused_by_github(vm: &ImpVM) -> bool {
    vm.status
        .as_ref()
        .and_then(|s| s.runner.as_ref())
        .is_some_and(|r| {
            r.handoff == Some(imp_api::HandoffState::Exited)
                && r.exit_code == Some(freshness::EXIT_DEPRECATED)
        })
}

fn from_template(pool: &ImpVMRunnerPool, vm: &ImpVM) -> bool {
    let mut have = vm.spec.clone();
    have.node_name = None;
    have.runner_config_secret = None;
    // How it starts (snapshot standby toggled since) does not change what runs.
    runner_vm(pool).is_ok_and(|want| {
        have.start_from = want.spec.start_from;
        want.spec == have
    })
}

/// A new runner VM of `pool`: generateName `<pool>-`, ephemeral, labelled, controlled by the pool.
pub fn runner_vm(pool: &ImpVMRunnerPool) -> Result<ImpVM> {
    let name = pool.name_any();
    let owner = pool
        .controller_owner_ref(&())
        .ok_or(Error::MissingObjectKey(".metadata.uid"))?;
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
            runner_user: s.runner_user.clone(),
            // Snapshot standby: the node clones the VM from its template when it has one Ready.
            start_from: pool
                .spec
                .scaling
                .standby()
                .then_some(imp_api::StartFrom::Template),
        },
    );
    let mut annotations = meta.annotations;
    if let Some(v) = &pool.spec.github.runner_version {
        annotations.insert(names::ANNOTATION_RUNNER_VERSION.to_owned(), v.clone());
    }
    vm.metadata = ObjectMeta {
        generate_name: Some(format!("{name}-")),
        namespace: pool.namespace(),
        labels: Some(labels),
        annotations: (!annotations.is_empty()).then_some(annotations),
        owner_references: Some(vec![owner]),
        ..ObjectMeta::default()
    };
    Ok(vm)
}

/// One App's sweep: its client, the organizations and the repositories its pools serve, the pools.
type AppSweep = (
    GithubApp,
    HashSet<String>,
    HashSet<String>,
    Vec<(PoolKey, RunnerScope)>,
);

/// Whether repository `full_name` (`owner/name`) is in a pool's scope, as the sweep lists it. An
/// enterprise scope has no repositories of its own to sweep.
fn in_scope(scope: &RunnerScope, full_name: &str) -> bool {
    match scope {
        RunnerScope::Organization { org } => full_name
            .split_once('/')
            .is_some_and(|(owner, _)| owner.eq_ignore_ascii_case(org)),
        RunnerScope::Repository { owner, repo } => {
            full_name.eq_ignore_ascii_case(&format!("{owner}/{repo}"))
        }
        RunnerScope::Enterprise { .. } => false,
    }
}

/// Periodically lists queued jobs through the REST API (per App, once per repository), so jobs whose
/// webhooks were lost raise demand within one interval; also expires old jobs and refreshes the global
/// webhook secret.
async fn sweep_loop(ctx: Arc<Ctx>) {
    // The first sweep runs at once; later ones as the API budget allows (github::budget).
    let mut next = Duration::ZERO;
    loop {
        tokio::select! {
            () = tokio::time::sleep(next) => {}
            () = ctx.sweep_now.notified() => {}
        }
        ctx.refresh_global_secret().await;
        next = ctx.sweep_once().await;
    }
}

impl Ctx {
    /// Re-reads the global webhook secret; false if the read failed (a missing Secret is a result).
    async fn refresh_global_secret(&self) -> bool {
        let Some(sel) = &self.config.global_webhook_secret else {
            return true;
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
                true
            }
            Err(e) => {
                warn!(secret = %sel.name, error = %e, "reading the global webhook secret failed");
                false
            }
        }
    }

    /// One sweep over every App the pools use; returns the wait before the next one (the longest
    /// any App's budget asks for).
    pub(crate) async fn sweep_once(&self) -> Duration {
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
            e.3.push((key, scope.clone()));
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
        let min = self.config.timing.sweep_interval;
        let mut next = min;
        for (_, (app, orgs, repos, keys)) in by_app {
            let started = Instant::now();
            let listing = match app.sweep_jobs(&orgs, &repos).await {
                Ok(l) => l,
                Err(e) => {
                    warn!(app_id = app.app_id(), error = %e, "sweep: listing repositories failed");
                    continue;
                }
            };
            for (repo, e) in &listing.failed {
                warn!(repository = %repo, error = %e, "sweep: listing active jobs failed");
            }
            if !listing.deferred.is_empty() {
                warn!(
                    app_id = app.app_id(),
                    deferred = listing.deferred.len(),
                    "sweep: rate limit down to the reserve left to minting; repositories deferred"
                );
            }
            let complete = listing.failed.is_empty() && listing.deferred.is_empty();
            let capped: Vec<String> = listing
                .failed
                .iter()
                .filter(|(_, e)| matches!(e, GithubError::TooManyPages { .. }))
                .map(|(repo, _)| repo.clone())
                .collect();
            next = next.max(app.record_sweep(listing.calls, min));
            let changed = {
                let mut d = self.shared.demand();
                let now = Instant::now();
                let changed = d.observe_sweep(
                    &listing.repositories,
                    sweep_updates(listing.jobs),
                    started,
                    now,
                );
                d.expire_jobs(now);
                changed
            };
            for key in changed {
                debug!(pool = %key, "sweep changed demand");
                self.shared.notify(key);
            }
            for (key, scope) in keys {
                let outcome = match scope {
                    RunnerScope::Enterprise { .. } => Sweep::Unknown,
                    _ => Sweep::of(&capped, |r| in_scope(&scope, r), complete),
                };
                let changed = outcome != Sweep::Unknown
                    && self.memory(&key, |m| std::mem::replace(&mut m.sweep, outcome.clone()))
                        != outcome;
                // Its demand is known now: surplus may be retired.
                let first =
                    complete && !self.memory(&key, |m| std::mem::replace(&mut m.swept, true));
                if changed || first {
                    self.shared.notify(key);
                }
            }
        }
        next
    }
}

#[cfg(test)]
mod from_template_tests {
    use super::*;

    #[test]
    fn only_a_vm_of_the_pools_template_is_minted_for() {
        let mut pool = imp_testkit::fixtures::pool("p").build();
        pool.metadata.uid = Some("pool-uid".into());
        let mut vm = runner_vm(&pool).unwrap();
        assert!(from_template(&pool, &vm));
        vm.spec.node_name = Some("n".into());
        vm.spec.runner_config_secret = Some("s".into());
        assert!(
            from_template(&pool, &vm),
            "scheduling and the mint do not count"
        );
        vm.spec.image = "registry.example/mine:1".into();
        assert!(
            !from_template(&pool, &vm),
            "another image is not the pool's runner"
        );
    }

    #[test]
    fn a_standby_pool_s_vms_start_from_its_template_and_a_toggle_keeps_them_its_own() {
        let mut pool = imp_testkit::fixtures::pool("p").build();
        pool.metadata.uid = Some("pool-uid".into());
        let boot = runner_vm(&pool).unwrap();
        assert_eq!(boot.spec.start_from, None);
        pool.spec.scaling.standby = Some(true);
        let clone = runner_vm(&pool).unwrap();
        assert_eq!(clone.spec.start_from, Some(imp_api::StartFrom::Template));
        // Turning standby on or off changes how new VMs start, not what runs in them.
        assert!(from_template(&pool, &boot));
        pool.spec.scaling.standby = Some(false);
        assert!(from_template(&pool, &clone));
    }
}

#[cfg(test)]
mod sweep_scope_tests {
    use super::*;

    #[test]
    fn a_repository_is_in_the_scope_the_sweep_listed_it_for() {
        let org = RunnerScope::Organization { org: "Acme".into() };
        assert!(in_scope(&org, "acme/app"));
        assert!(!in_scope(&org, "acmeco/app"));
        assert!(!in_scope(&org, "other/acme"));
        let repo = RunnerScope::Repository {
            owner: "acme".into(),
            repo: "app".into(),
        };
        assert!(in_scope(&repo, "Acme/App"));
        assert!(!in_scope(&repo, "acme/app2"));
        let ent = RunnerScope::Enterprise {
            enterprise: "e".into(),
        };
        assert!(!in_scope(&ent, "acme/app"));
    }
}
