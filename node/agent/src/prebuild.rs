//! Pre-build (docs/rootfs.md): the agent asks its runtime (`POST /v1/images`) to build the base
//! image of every ImpVMRunnerPool this node can serve, when the agent starts and whenever a
//! pool's image, runner image, pull policy or pull Secrets change, so the pool's first VM here
//! finds its image cached instead of waiting for the pull and the build.
//!
//! observe (the pools, from a watch; this Node) -> [`plan`] (pure: what to build now, what to
//! forget) -> execute (read the pull Secret, call the runtime), one build at a time: builds
//! share the node's disk and network with running VMs. A failure is retried with backoff. The
//! runtime counts outcomes and in-progress builds (`imp_rootfs_prebuilds_total`,
//! `imp_rootfs_prebuilds_in_progress`, failures by reason in `imp_rootfs_build_failures_total`)
//! and applies its cache budget: a pre-built image is unreferenced, so it is the first kind of
//! image garbage collection may take, least recently used first.
//!
//! The same loop keeps the snapshot templates of the standby pools the node can serve
//! ([`super::standby`]), after the pre-builds (a template starts from the pool's image), and
//! looks again every [`TEMPLATE_POLL`] while one is being built so its Ready is published soon.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use imp_api::names::LABEL_NODE_ENABLED;
use imp_api::{ImpVMRunnerPool, PullPolicy, tolerates};
use imp_common::Backoff;
use k8s_openapi::api::core::v1::{Node, Secret, Taint, Toleration};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::time::Instant;

use super::capacity::CapacityConfig;
use super::config::AgentConfig;
use super::spec::{self, SpecError};
use super::standby::{self, StandbyPool};
use imp_runtime_api::client::{ClientError, RuntimeClient};
use imp_runtime_api::image::ImageSpec;

/// Retries of a failed pre-build: 30 s doubling to 30 min (a registry outage, a bad tag).
pub const RETRY: Backoff = Backoff::new(Duration::from_secs(30), Duration::from_secs(1800));
/// Upper bound between two passes without any pool change (a retry coming due, a Node relabel).
const TICK: Duration = Duration::from_secs(30);
/// Between two passes while a snapshot template is being built.
const TEMPLATE_POLL: Duration = Duration::from_secs(2);
/// How soon a template build deferred for want of room is looked at again (a VM that stops
/// frees room without any pool event).
const DEFERRED_POLL: Duration = Duration::from_secs(5);

/// What a pool's VMs are built from: a change of any of it is a new pre-build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageWanted {
    pub base: String,
    pub runner: Option<String>,
    pub pull_policy: Option<PullPolicy>,
    /// Names of the pool's image pull Secrets, in order (the first one is used, as for VMs).
    pub pull_secrets: Vec<String>,
}

/// One pool as the plan sees it.
#[derive(Debug, Clone)]
pub struct PoolImage {
    /// `namespace/name`.
    pub pool: String,
    pub namespace: String,
    pub image: ImageWanted,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
}

impl PoolImage {
    pub fn from_pool(p: &ImpVMRunnerPool) -> Self {
        let t = &p.spec.template.spec;
        let namespace = p.namespace().unwrap_or_default();
        PoolImage {
            pool: format!("{namespace}/{}", p.name_any()),
            namespace,
            image: ImageWanted {
                base: t.image.clone(),
                runner: t.runner_image.clone(),
                pull_policy: t.image_pull_policy,
                pull_secrets: t
                    .image_pull_secrets
                    .iter()
                    .map(|r| r.name.clone())
                    .collect(),
            },
            node_selector: t.node_selector.clone().unwrap_or_default(),
            tolerations: t.tolerations.clone().unwrap_or_default(),
        }
    }
}

/// The parts of this Node that decide which pools it may serve.
#[derive(Debug, Clone, Default)]
pub struct NodeFacts {
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
}

impl NodeFacts {
    pub fn from_node(node: &Node) -> Self {
        NodeFacts {
            labels: node.labels().clone(),
            taints: node
                .spec
                .as_ref()
                .and_then(|s| s.taints.clone())
                .unwrap_or_default(),
        }
    }
}

/// Whether the operator may place `pool`'s VMs on this node: the node is enabled for Imp, every
/// label of the pool's node selector matches, and every NoSchedule/NoExecute taint is tolerated
/// (the scheduler's static rules; capacity and readiness change too fast to plan builds on).
pub fn servable(pool: &PoolImage, node: &NodeFacts) -> bool {
    node.labels.get(LABEL_NODE_ENABLED).map(String::as_str) == Some("true")
        && pool
            .node_selector
            .iter()
            .all(|(k, v)| node.labels.get(k) == Some(v))
        && node.taints.iter().all(|taint| {
            !matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
                || pool.tolerations.iter().any(|t| tolerates(t, taint))
        })
}

/// What happened to a pool's last pre-build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// Built (or found) for this image: nothing to do until the image changes.
    Done(ImageWanted),
    /// Failed `failures` times in a row for this image; the next try is not before `retry_at`.
    Failed {
        image: ImageWanted,
        failures: u32,
        retry_at: Instant,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Pools to pre-build now, in pool order.
    pub build: Vec<String>,
    /// Pools gone, or no longer servable here: their record goes (a comeback builds again).
    pub forget: Vec<String>,
}

/// Which pools to pre-build now: every servable pool whose image was never pre-built, changed
/// since, or failed and is due for a retry.
pub fn plan(
    pools: &[PoolImage],
    node: &NodeFacts,
    attempts: &BTreeMap<String, Attempt>,
    now: Instant,
) -> Plan {
    let mut out = Plan::default();
    let mut servable_pools = Vec::new();
    for p in pools {
        if !servable(p, node) {
            continue;
        }
        servable_pools.push(p.pool.as_str());
        let due = match attempts.get(&p.pool) {
            None => true,
            Some(Attempt::Done(image)) => *image != p.image,
            Some(Attempt::Failed {
                image, retry_at, ..
            }) => *image != p.image || *retry_at <= now,
        };
        if due {
            out.build.push(p.pool.clone());
        }
    }
    out.build.sort();
    out.forget = attempts
        .keys()
        .filter(|k| !servable_pools.contains(&k.as_str()))
        .cloned()
        .collect();
    out
}

/// The record after a pre-build of `image` ended (`ok`), given the one before.
pub fn record(previous: Option<&Attempt>, image: ImageWanted, ok: bool, now: Instant) -> Attempt {
    if ok {
        return Attempt::Done(image);
    }
    let failures = match previous {
        Some(Attempt::Failed {
            image: before,
            failures,
            ..
        }) if *before == image => failures.saturating_add(1),
        _ => 1,
    };
    Attempt::Failed {
        retry_at: now + RETRY.delay(failures - 1),
        image,
        failures,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PrebuildError {
    #[error("image pull Secret {namespace}/{name} not found")]
    SecretMissing { namespace: String, name: String },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("imp-runtime: {0}")]
    Runtime(#[from] ClientError),
}

/// Spawn the pre-build loop for as long as the returned handle lives (the agent's hook: it
/// aborts the loop when the agent stops).
pub fn spawn(client: Client, config: &AgentConfig) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(run(
        client,
        config.node_name.clone(),
        RuntimeClient::new(config.runtime_socket.clone()),
        config.capacity,
        config.template_warm_paths.clone(),
    )))
}

/// Aborts its task when dropped.
pub struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Watch the pools; after each change (and every [`TICK`]) plan and pre-build. Never returns.
pub async fn run(
    client: Client,
    node_name: String,
    runtime: RuntimeClient,
    offer: CapacityConfig,
    warm_paths: Vec<String>,
) {
    let pools: Api<ImpVMRunnerPool> = Api::all(client.clone());
    let (reader, writer) = reflector::store();
    let changed = Arc::new(tokio::sync::Notify::new());
    let notify = changed.clone();
    let watch = reflector(writer, watcher(pools, watcher::Config::default()))
        .default_backoff()
        .touched_objects()
        .for_each(move |event| {
            if let Err(e) = event {
                tracing::debug!(error = %e, "pool watch for pre-builds");
            }
            notify.notify_one();
            futures::future::ready(())
        });
    let passes = async {
        let nodes: Api<Node> = Api::all(client.clone());
        let mut attempts: BTreeMap<String, Attempt> = BTreeMap::new();
        // Standby pools whose template build waits for room (said once).
        let mut deferred = BTreeSet::new();
        if reader.wait_until_ready().await.is_err() {
            return;
        }
        loop {
            let mut wait = TICK;
            match nodes.get_opt(&node_name).await {
                Ok(Some(node)) => {
                    let state = reader.state();
                    let pools: Vec<PoolImage> =
                        state.iter().map(|p| PoolImage::from_pool(p)).collect();
                    let facts = NodeFacts::from_node(&node);
                    pass(&client, &runtime, &pools, &facts, &mut attempts).await;
                    let standby: Vec<StandbyPool> = state
                        .iter()
                        .zip(&pools)
                        .filter(|(_, image)| servable(image, &facts))
                        .filter_map(|(p, _)| StandbyPool::from_pool(p))
                        .collect();
                    let seen = standby::pass(
                        &client,
                        &runtime,
                        &node_name,
                        node.annotations(),
                        &standby,
                        &offer,
                        &deferred,
                        &warm_paths,
                    )
                    .await;
                    if seen.building {
                        wait = TEMPLATE_POLL;
                    } else if !seen.deferred.is_empty() {
                        wait = DEFERRED_POLL;
                    }
                    deferred = seen.deferred;
                }
                Ok(None) => tracing::debug!(node = %node_name, "Node not found; no pre-builds"),
                Err(e) => tracing::warn!(error = %e, "reading the Node for pre-builds"),
            }
            tokio::select! {
                () = changed.notified() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    };
    tokio::select! {
        () = watch => {}
        () = passes => {}
    }
}

/// One plan, executed: each due pool's image pre-built in turn.
async fn pass(
    client: &Client,
    runtime: &RuntimeClient,
    pools: &[PoolImage],
    node: &NodeFacts,
    attempts: &mut BTreeMap<String, Attempt>,
) {
    let plan = plan(pools, node, attempts, Instant::now());
    for gone in &plan.forget {
        attempts.remove(gone);
    }
    for name in &plan.build {
        let Some(pool) = pools.iter().find(|p| &p.pool == name) else {
            continue;
        };
        let started = Instant::now();
        let result = prebuild(client, runtime, pool).await;
        let ok = match &result {
            Ok(s) => {
                tracing::info!(pool = %pool.pool, base = %pool.image.base, key = %s.key, hit = s.hit, resolved = s.resolved, cached = s.cached, seconds = started.elapsed().as_secs_f64(), "pre-built the pool's base image");
                true
            }
            Err(e) => {
                tracing::warn!(pool = %pool.pool, base = %pool.image.base, error = %e, "pre-build failed; retrying with backoff");
                false
            }
        };
        let next = record(
            attempts.get(&pool.pool),
            pool.image.clone(),
            ok,
            Instant::now(),
        );
        attempts.insert(pool.pool.clone(), next);
    }
}

async fn prebuild(
    client: &Client,
    runtime: &RuntimeClient,
    pool: &PoolImage,
) -> Result<imp_runtime_api::api::PrebuildStatus, PrebuildError> {
    let mut credentials = None;
    if let Some(name) = pool.image.pull_secrets.first() {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &pool.namespace);
        let secret = secrets
            .get_opt(name)
            .await?
            .ok_or_else(|| PrebuildError::SecretMissing {
                namespace: pool.namespace.clone(),
                name: name.clone(),
            })?;
        credentials = Some(spec::credentials(&secret)?);
    }
    let image = ImageSpec {
        base: pool.image.base.clone(),
        runner: pool.image.runner.clone(),
        credentials,
        pull_policy: pool.image.pull_policy,
    };
    Ok(runtime.prebuild(&image).await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Toleration;

    fn pool(name: &str, base: &str) -> PoolImage {
        PoolImage {
            pool: format!("ns/{name}"),
            namespace: "ns".into(),
            image: ImageWanted {
                base: base.into(),
                runner: None,
                pull_policy: None,
                pull_secrets: Vec::new(),
            },
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
        }
    }

    fn node(labels: &[(&str, &str)], taints: &[(&str, &str)]) -> NodeFacts {
        NodeFacts {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            taints: taints
                .iter()
                .map(|(k, effect)| Taint {
                    key: k.to_string(),
                    effect: effect.to_string(),
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn enabled() -> NodeFacts {
        node(&[(LABEL_NODE_ENABLED, "true")], &[])
    }

    #[test]
    fn only_pools_the_scheduler_could_place_here_are_servable() {
        let p = pool("a", "r/x:1");
        assert!(servable(&p, &enabled()));
        assert!(!servable(&p, &node(&[], &[])), "node not enabled");
        assert!(!servable(&p, &node(&[(LABEL_NODE_ENABLED, "false")], &[])));
        let picky = PoolImage {
            node_selector: [("disk".to_string(), "ssd".to_string())].into(),
            ..p.clone()
        };
        assert!(!servable(&picky, &enabled()));
        assert!(servable(
            &picky,
            &node(&[(LABEL_NODE_ENABLED, "true"), ("disk", "ssd")], &[])
        ));
        let tainted = node(&[(LABEL_NODE_ENABLED, "true")], &[("gpu", "NoSchedule")]);
        assert!(!servable(&p, &tainted));
        let tolerant = PoolImage {
            tolerations: vec![Toleration {
                key: Some("gpu".into()),
                operator: Some("Exists".into()),
                ..Default::default()
            }],
            ..p.clone()
        };
        assert!(servable(&tolerant, &tainted));
        // PreferNoSchedule does not keep VMs off a node.
        assert!(servable(
            &p,
            &node(
                &[(LABEL_NODE_ENABLED, "true")],
                &[("gpu", "PreferNoSchedule")]
            )
        ));
    }

    #[test]
    fn a_pool_is_built_at_start_and_again_only_when_its_image_changes() {
        let now = Instant::now();
        let pools = [pool("b", "r/x:1"), pool("a", "r/y:1")];
        let mut attempts = BTreeMap::new();
        let first = plan(&pools, &enabled(), &attempts, now);
        assert_eq!(first.build, ["ns/a", "ns/b"]);
        assert!(first.forget.is_empty());
        for p in &pools {
            attempts.insert(p.pool.clone(), record(None, p.image.clone(), true, now));
        }
        assert_eq!(plan(&pools, &enabled(), &attempts, now), Plan::default());
        // A rolled image, a new runner image, a new policy or new pull Secrets: built again.
        for change in [
            |i: &mut ImageWanted| i.base = "r/x:2".into(),
            |i: &mut ImageWanted| i.runner = Some("r/runner:1".into()),
            |i: &mut ImageWanted| i.pull_policy = Some(PullPolicy::Always),
            |i: &mut ImageWanted| i.pull_secrets = vec!["pull".into()],
        ] {
            let mut rolled = pools.clone();
            change(&mut rolled[0].image);
            assert_eq!(
                plan(&rolled, &enabled(), &attempts, now).build,
                ["ns/b"],
                "{:?}",
                rolled[0].image
            );
        }
    }

    #[test]
    fn pools_gone_or_no_longer_servable_are_forgotten() {
        let now = Instant::now();
        let pools = [pool("a", "r/x:1"), pool("b", "r/x:1")];
        let mut attempts = BTreeMap::new();
        for p in &pools {
            attempts.insert(p.pool.clone(), record(None, p.image.clone(), true, now));
        }
        let p = plan(&pools[..1], &enabled(), &attempts, now);
        assert_eq!(p.forget, ["ns/b"]);
        let p = plan(&pools, &node(&[], &[]), &attempts, now);
        assert_eq!(p.forget, ["ns/a", "ns/b"]);
        assert!(p.build.is_empty());
    }

    #[test]
    fn failures_retry_with_backoff_and_a_new_image_retries_at_once() {
        let now = Instant::now();
        let pools = [pool("a", "r/x:1")];
        let img = pools[0].image.clone();
        let mut attempts = BTreeMap::new();
        let one = record(None, img.clone(), false, now);
        assert_eq!(
            one,
            Attempt::Failed {
                image: img.clone(),
                failures: 1,
                retry_at: now + RETRY.initial
            }
        );
        attempts.insert("ns/a".to_string(), one.clone());
        assert!(plan(&pools, &enabled(), &attempts, now).build.is_empty());
        let due = now + RETRY.initial;
        assert_eq!(plan(&pools, &enabled(), &attempts, due).build, ["ns/a"]);
        let two = record(Some(&one), img.clone(), false, due);
        assert!(
            matches!(two, Attempt::Failed { failures: 2, retry_at, .. } if retry_at == due + RETRY.initial * 2)
        );
        attempts.insert("ns/a".to_string(), two.clone());
        let mut rolled = pools.clone();
        rolled[0].image.base = "r/x:2".into();
        assert_eq!(plan(&rolled, &enabled(), &attempts, due).build, ["ns/a"]);
        // The count restarts for a new image, and a success clears it.
        assert!(matches!(
            record(Some(&two), rolled[0].image.clone(), false, due),
            Attempt::Failed { failures: 1, .. }
        ));
        assert_eq!(
            record(Some(&two), img.clone(), true, due),
            Attempt::Done(img)
        );
    }
}
