//! Snapshot standby (docs/runner-pool.md, "Snapshot standby"): for every standby pool
//! (`spec.scaling.standby`) this node can serve, the agent asks its runtime to keep a template
//! of the pool's VMs (`POST /v1/templates`: idempotent, answered at once, the build runs in the
//! runtime's background), and publishes on its Node the pools whose template is Ready
//! (`imp.dev/templates-ready`), which the operator's scheduler prefers for those pools'
//! `startFrom: Template` VMs. Templates no pool here wants any more (standby turned off, the
//! pool gone or changed, the node no longer serving it) are deleted.
//!
//! A build runs a VM of the pool's class: it is asked for only when that VM fits beside the
//! VMs holding a share and the builds in flight (the runtime's dry run says whether a request
//! would build; [`plan`] decides; docs/snapshots.md "Capacity"), else deferred to a later pass.
//!
//! Called by the pre-build loop ([`super::prebuild`]) after its image pre-builds, with the
//! standby pools it found servable; [`plan`], [`ready_annotation`] and [`unwanted`] are the pure
//! parts.

use std::collections::{BTreeMap, BTreeSet};

use imp_api::names::ANNOTATION_TEMPLATES_READY;
use imp_api::{ImpVMClass, ImpVMRunnerPool, RunnerVmTemplateSpec};
use imp_runtime_api::api::{TemplateDryRun, TemplateState, TemplateStatus, VmSpec};
use imp_runtime_api::client::{ClientError, RuntimeClient};
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};

use super::capacity::{self, CapacityConfig, VmSize};
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
    /// Pools (`namespace/name`) whose build waits for room on the node: look again soon.
    pub deferred: BTreeSet<String>,
}

/// What the pass does for one pool's template, from the runtime's dry run.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Nothing to ask: the template is as the dry run found it.
    Known(TemplateStatus),
    /// Ask for it (`POST /v1/templates`), which starts its build when `would_build`.
    Ask,
    /// Its build VM does not fit beside the VMs and builds the node holds: not asked (nothing
    /// starts), looked at again next pass. The message says what does not fit.
    Defer(String),
}

/// The pure decision of a pass: per pool (its build VM's size and the runtime's dry run, None
/// from a runtime without dry runs, which is asked as before), whether to ask. A build is
/// asked for only when its VM fits by the agent's admission rule ([`capacity::admit`]: the
/// offer minus the VMs holding a share minus the builds in flight, those asked for earlier in
/// this plan included), so a build never takes room the scheduler already gave a VM.
pub fn plan(
    pools: &[(VmSize, Option<&TemplateDryRun>)],
    offered: &BTreeMap<String, String>,
    held: &[VmSize],
    builds: &[VmSize],
) -> Vec<Step> {
    let mut builds = builds.to_vec();
    pools
        .iter()
        .map(|(size, dry)| match dry {
            None => Step::Ask,
            Some(d) if !d.would_build => d.template.clone().map_or(Step::Ask, Step::Known),
            Some(_) => match capacity::admit(offered, held, &builds, *size) {
                Ok(()) => {
                    builds.push(*size);
                    Step::Ask
                }
                Err(why) => Step::Defer(why),
            },
        })
        .collect()
}

/// Ensures the templates of `pools` where the node has room for their builds, deletes those no
/// longer wanted, and publishes the Ready ones on Node `node_name` (whose annotations are
/// `annotations`). `offer` is the node's capacity settings; `deferred` the pools the previous
/// pass deferred (said once, at info); `warm_paths` go into every template spec.
#[allow(clippy::too_many_arguments)]
pub async fn pass(
    client: &Client,
    runtime: &RuntimeClient,
    node_name: &str,
    annotations: &BTreeMap<String, String>,
    pools: &[StandbyPool],
    offer: &CapacityConfig,
    deferred: &BTreeSet<String>,
    warm_paths: &[String],
) -> Outcome {
    let published = annotations
        .get(ANNOTATION_TEMPLATES_READY)
        .map(String::as_str);
    let mut out = Outcome::default();
    let mut ready = BTreeSet::new();
    let mut wanted = BTreeSet::new();
    let mut complete = true;
    // Observe: each pool's template spec and the runtime's dry run of it.
    let mut seen = Vec::new();
    for p in pools {
        match observe(client, runtime, p, warm_paths).await {
            Ok(o) => seen.push((p, o)),
            Err(e) => {
                note_error(p, &e);
                complete = false;
            }
        }
    }
    // The node's holdings are read only when some build is wanted.
    let wants_build = seen
        .iter()
        .any(|(_, (_, d))| d.as_ref().is_some_and(|d| d.would_build));
    let holdings = if wants_build {
        capacity::holdings(client, runtime, node_name, annotations, offer, None)
            .await
            .map_err(|e| e.to_string())
    } else {
        Ok(Default::default())
    };
    let input: Vec<(VmSize, Option<&TemplateDryRun>)> = seen
        .iter()
        .map(|(_, (spec, d))| {
            (
                VmSize {
                    vcpu: spec.vcpu,
                    memory_mib: spec.memory_mib,
                },
                d.as_ref(),
            )
        })
        .collect();
    let steps = match &holdings {
        Ok(h) => plan(&input, &h.offered, &h.held, &h.builds),
        // Unknown room: no build starts; the rest is as seen.
        Err(why) => plan(&input, &BTreeMap::new(), &[], &[])
            .into_iter()
            .zip(&input)
            .map(|(step, (_, d))| match d {
                Some(d) if d.would_build => Step::Defer(why.clone()),
                _ => step,
            })
            .collect(),
    };
    // Execute.
    for ((p, (spec, dry)), step) in seen.iter().zip(steps) {
        if let Some(d) = dry {
            wanted.insert(d.key.clone());
        }
        let status = match step {
            Step::Known(t) => Ok(t),
            Step::Ask => runtime
                .ensure_template(spec)
                .await
                .map_err(TemplateError::from),
            Step::Defer(why) => {
                if deferred.contains(&p.pool) {
                    tracing::debug!(pool = %p.pool, why, "the pool's snapshot template still waits for room on the node");
                } else {
                    tracing::info!(pool = %p.pool, why, "the pool's snapshot template waits for room on the node: its build VM would not fit; retried on the next pass");
                }
                out.deferred.insert(p.pool.clone());
                continue;
            }
        };
        match status {
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
            Err(e) => {
                note_error(p, &e);
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

fn note_error(p: &StandbyPool, e: &TemplateError) {
    match e {
        TemplateError::Runtime(ClientError::Api { status, .. })
            if *status == http::StatusCode::NOT_FOUND =>
        {
            // A runtime without templates: the pool's VMs boot cold here (and say so).
            tracing::debug!(pool = %p.pool, "imp-runtime keeps no templates");
        }
        e => {
            tracing::warn!(pool = %p.pool, error = %e, "asking for the pool's snapshot template failed; retried on the next pass")
        }
    }
}

/// The pool's template spec on this node (its class, its first pull Secret, the agent's warm
/// paths) and the runtime's dry run of asking for it (None: a runtime without dry runs, 404 or 405).
async fn observe(
    client: &Client,
    runtime: &RuntimeClient,
    p: &StandbyPool,
    warm_paths: &[String],
) -> Result<(VmSpec, Option<TemplateDryRun>), TemplateError> {
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
    match runtime.template_dry_run(&spec).await {
        Ok(d) => Ok((spec, Some(d))),
        Err(ClientError::Api { status, .. })
            if status == http::StatusCode::NOT_FOUND
                || status == http::StatusCode::METHOD_NOT_ALLOWED =>
        {
            Ok((spec, None))
        }
        Err(e) => Err(e.into()),
    }
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

    fn dry(key: &str, template: Option<TemplateStatus>, would_build: bool) -> TemplateDryRun {
        TemplateDryRun {
            key: key.into(),
            template,
            would_build,
        }
    }

    fn size(vcpu: u32, memory_mib: u64) -> VmSize {
        VmSize { vcpu, memory_mib }
    }

    fn offer(vcpu: u32, memory_mib: u64) -> BTreeMap<String, String> {
        BTreeMap::from([
            (
                imp_api::names::ANNOTATION_CAPACITY_VCPU.to_owned(),
                vcpu.to_string(),
            ),
            (
                imp_api::names::ANNOTATION_CAPACITY_MEMORY_MIB.to_owned(),
                memory_mib.to_string(),
            ),
        ])
    }

    #[test]
    fn a_build_is_asked_for_only_when_its_vm_fits_beside_vms_and_builds() {
        let missing = dry("k1", None, true);
        // Room: asked.
        assert_eq!(
            plan(
                &[(size(2, 2048), Some(&missing))],
                &offer(4, 4096),
                &[],
                &[]
            ),
            [Step::Ask]
        );
        // The VMs hold the node: deferred, saying what does not fit.
        let steps = plan(
            &[(size(2, 2048), Some(&missing))],
            &offer(4, 4096),
            &[size(2, 3000)],
            &[],
        );
        assert_eq!(
            steps,
            [Step::Defer(
                "the VM's 2048 MiB do not fit: the node publishes 4096 MiB \
                 (imp.dev/capacity-memory-mib), 3000 MiB held by 1 other VM"
                    .into()
            )]
        );
        // Another build in flight counts like a VM.
        assert!(matches!(
            plan(
                &[(size(2, 2048), Some(&missing))],
                &offer(4, 4096),
                &[],
                &[size(3, 1024)]
            )[..],
            [Step::Defer(_)]
        ));
    }

    #[test]
    fn builds_asked_in_one_plan_count_against_the_next() {
        let a = dry("ka", None, true);
        let b = dry("kb", None, true);
        let steps = plan(
            &[(size(2, 2048), Some(&a)), (size(2, 2048), Some(&b))],
            &offer(3, 8192),
            &[],
            &[],
        );
        assert_eq!(steps[0], Step::Ask);
        assert!(matches!(&steps[1], Step::Defer(m) if m.contains("1 template build")));
    }

    #[test]
    fn what_starts_no_build_is_never_deferred() {
        let ready = dry("k1", Some(template("k1")), false);
        let mut b = template("k2");
        b.state = TemplateState::Building;
        let building = dry("k2", Some(b.clone()), false);
        let full = offer(0, 0);
        assert_eq!(
            plan(
                &[(size(1, 1), Some(&ready)), (size(1, 1), Some(&building))],
                &full,
                &[],
                &[]
            ),
            [Step::Known(template("k1")), Step::Known(b)]
        );
        // A runtime without dry runs is asked as before; a dry run without a template (a
        // backend without templates) is asked for its answer.
        assert_eq!(
            plan(
                &[
                    (size(1, 1), None),
                    (size(1, 1), Some(&dry("k3", None, false)))
                ],
                &full,
                &[],
                &[]
            ),
            [Step::Ask, Step::Ask]
        );
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
