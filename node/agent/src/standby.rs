//! Snapshot standby (docs/runner-pool.md, "Snapshot standby"): for every standby pool
//! (`spec.scaling.standby`) this node can serve, the agent asks its runtime to keep a template
//! of the pool's VMs (`POST /v1/templates`: idempotent, answered at once, the build runs in the
//! runtime's background), and publishes on its Node the pools whose template is Ready
//! (`imp.dev/templates-ready`), which the operator's scheduler prefers for those pools'
//! `startFrom: Template` VMs. Templates no pool here wants any more (standby turned off, the
//! pool gone or changed, the node no longer serving it) are deleted.
//!
//! Called by the pre-build loop ([`super::prebuild`]) after its image pre-builds, with the
//! standby pools it found servable; [`ready_annotation`] and [`unwanted`] are the pure parts.

use std::collections::BTreeSet;

use imp_api::names::ANNOTATION_TEMPLATES_READY;
use imp_api::{ImpVMClass, ImpVMRunnerPool, RunnerVmTemplateSpec};
use imp_runtime_api::api::{TemplateState, TemplateStatus};
use imp_runtime_api::client::{ClientError, RuntimeClient};
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};

use super::spec::{self, SpecError};

/// A standby pool this node can serve.
#[derive(Debug, Clone)]
pub struct StandbyPool {
    /// `namespace/name`.
    pub pool: String,
    pub uid: String,
    pub namespace: String,
    pub template: RunnerVmTemplateSpec,
}

impl StandbyPool {
    /// The pool, if it asks for snapshot standby (and has a uid to be reported by).
    pub fn from_pool(p: &ImpVMRunnerPool) -> Option<Self> {
        if !p.spec.scaling.standby() {
            return None;
        }
        let namespace = p.namespace().unwrap_or_default();
        Some(StandbyPool {
            pool: format!("{namespace}/{}", p.name_any()),
            uid: p.uid()?,
            namespace,
            template: p.spec.template.spec.clone(),
        })
    }
}

/// The annotation's value for the pools (uids) whose template is Ready: sorted, comma-separated;
/// None (the annotation removed) when there are none.
pub fn ready_annotation(ready: &BTreeSet<String>) -> Option<String> {
    (!ready.is_empty()).then(|| ready.iter().cloned().collect::<Vec<_>>().join(","))
}

/// Template keys the runtime holds that no standby pool here wants.
pub fn unwanted(held: &[TemplateStatus], wanted: &BTreeSet<String>) -> Vec<String> {
    held.iter()
        .filter(|t| !wanted.contains(&t.key))
        .map(|t| t.key.clone())
        .collect()
}

#[derive(Debug, thiserror::Error)]
enum TemplateError {
    #[error("ImpVMClass {0} not found")]
    ClassMissing(String),
    #[error("image pull Secret {0} not found")]
    SecretMissing(String),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("imp-runtime: {0}")]
    Runtime(#[from] ClientError),
}

/// What one pass saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Some template is being built: look again soon (its Ready is worth publishing early).
    pub building: bool,
}

/// Ensures the templates of `pools`, deletes those no longer wanted, and publishes the Ready ones
/// on Node `node_name` (whose current annotation value is `published`).
pub async fn pass(
    client: &Client,
    runtime: &RuntimeClient,
    node_name: &str,
    published: Option<&str>,
    pools: &[StandbyPool],
    warm_paths: &[String],
) -> Outcome {
    let mut out = Outcome::default();
    let mut ready = BTreeSet::new();
    let mut wanted = BTreeSet::new();
    let mut complete = true;
    for p in pools {
        match ensure(client, runtime, p, warm_paths).await {
            Ok(t) => {
                wanted.insert(t.key.clone());
                match t.state {
                    TemplateState::Ready => {
                        ready.insert(p.uid.clone());
                    }
                    TemplateState::Building => out.building = true,
                    TemplateState::Failed => {
                        let f = t.failure.as_ref();
                        let reason = f.map(|f| f.reason.as_str());
                        let message = f.map(|f| f.message.as_str());
                        if reason == Some(imp_api::names::reason::TEMPLATE_UNSUPPORTED) {
                            // Asked every pass; the VMs' status.start says it for each VM.
                            tracing::debug!(pool = %p.pool, ?message, "this node keeps no snapshot templates; the pool's VMs boot cold here");
                        } else {
                            tracing::warn!(pool = %p.pool, key = %t.key, ?reason, ?message, "the pool's snapshot template failed to build; its VMs boot cold here until a retry succeeds");
                        }
                    }
                }
            }
            Err(TemplateError::Runtime(ClientError::Api { status, .. }))
                if status == http::StatusCode::NOT_FOUND =>
            {
                // A runtime without templates: the pool's VMs boot cold here (and say so).
                tracing::debug!(pool = %p.pool, "imp-runtime keeps no templates");
                complete = false;
            }
            Err(e) => {
                tracing::warn!(pool = %p.pool, error = %e, "asking for the pool's snapshot template failed; retried on the next pass");
                complete = false;
            }
        }
    }
    // Only when every pool's key is known: a passing error must not cost a pool its template.
    if complete {
        match runtime.templates().await {
            Ok(held) => {
                for key in unwanted(&held, &wanted) {
                    match runtime.delete_template(&key).await {
                        Ok(()) => tracing::info!(
                            key,
                            "deleted a snapshot template no standby pool here wants"
                        ),
                        Err(e) => {
                            tracing::warn!(key, error = %e, "deleting an unwanted snapshot template failed")
                        }
                    }
                }
            }
            Err(ClientError::Api { status, .. }) if status == http::StatusCode::NOT_FOUND => {}
            Err(e) => tracing::debug!(error = %e, "listing the runtime's templates"),
        }
    }
    let value = ready_annotation(&ready);
    if value.as_deref() != published {
        let nodes: Api<Node> = Api::all(client.clone());
        let patch =
            serde_json::json!({"metadata": {"annotations": {ANNOTATION_TEMPLATES_READY: value}}});
        match nodes
            .patch(node_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => tracing::info!(ready = ?value, "published the Ready snapshot templates"),
            Err(e) => tracing::warn!(error = %e, "publishing the Ready snapshot templates"),
        }
    }
    out
}

/// The pool's template spec on this node (its class, its first pull Secret, the agent's warm
/// paths), asked for.
async fn ensure(
    client: &Client,
    runtime: &RuntimeClient,
    p: &StandbyPool,
    warm_paths: &[String],
) -> Result<TemplateStatus, TemplateError> {
    let classes: Api<ImpVMClass> = Api::all(client.clone());
    let class_name = &p.template.class_ref.name;
    let class = classes
        .get_opt(class_name)
        .await?
        .ok_or_else(|| TemplateError::ClassMissing(class_name.clone()))?;
    let mut pull = Vec::new();
    if let Some(r) = p.template.image_pull_secrets.first() {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &p.namespace);
        let s = secrets
            .get_opt(&r.name)
            .await?
            .ok_or_else(|| TemplateError::SecretMissing(format!("{}/{}", p.namespace, r.name)))?;
        pull.push(s);
    }
    let spec = spec::template_spec(&p.template, &class.spec, &pull, warm_paths)?;
    Ok(runtime.ensure_template(&spec).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(key: &str) -> TemplateStatus {
        TemplateStatus {
            key: key.into(),
            state: TemplateState::Ready,
            bytes: 0,
            vmm: "firecracker v1.12".into(),
            build_seconds: None,
            clones: 0,
            failure: None,
            warm: None,
        }
    }

    #[test]
    fn the_annotation_lists_ready_pools_sorted_or_goes() {
        assert_eq!(ready_annotation(&BTreeSet::new()), None);
        let ready: BTreeSet<String> = ["b-uid".into(), "a-uid".into()].into();
        assert_eq!(ready_annotation(&ready).as_deref(), Some("a-uid,b-uid"));
    }

    #[test]
    fn templates_no_pool_wants_are_unwanted() {
        let held = [template("k1"), template("k2"), template("k3")];
        let wanted: BTreeSet<String> = ["k2".into()].into();
        assert_eq!(unwanted(&held, &wanted), ["k1", "k3"]);
        assert!(unwanted(&held[1..2], &wanted).is_empty());
    }

    #[test]
    fn only_standby_pools_with_a_uid_count() {
        let mut p = imp_testkit::fixtures::pool("p").namespace("ns").build();
        p.metadata.uid = Some("pool-uid".into());
        assert!(StandbyPool::from_pool(&p).is_none());
        p.spec.scaling.standby = Some(true);
        let s = StandbyPool::from_pool(&p).unwrap();
        assert_eq!((s.pool.as_str(), s.uid.as_str()), ("ns/p", "pool-uid"));
        p.metadata.uid = None;
        assert!(StandbyPool::from_pool(&p).is_none());
    }
}
