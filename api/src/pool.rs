//! ImpVMRunnerPool: a pool of ephemeral runner VMs serving GitHub Actions jobs.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::{LocalObjectReference, Toleration},
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::{ClassRef, KubeDuration, NetworkRef, PullPolicy, RunnerUser};

/// Keeps enough idle runner VMs registered at GitHub for the jobs whose labels it serves.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpVMRunnerPool",
    namespaced,
    shortname = "imprp",
    category = "imp",
    status = "ImpVMRunnerPoolStatus",
    doc = "A pool of ephemeral GitHub Actions runner microVMs.",
    printcolumn(name = "Desired", type_ = "integer", json_path = ".status.desired"),
    printcolumn(name = "Idle", type_ = "integer", json_path = ".status.idle"),
    printcolumn(name = "Busy", type_ = "integer", json_path = ".status.busy"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Booting",
        type_ = "integer",
        json_path = ".status.booting",
        priority = 1
    ),
    printcolumn(
        name = "Max",
        type_ = "integer",
        json_path = ".spec.scaling.maxRunners",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ImpVMRunnerPoolSpec {
    pub github: GithubRunnerSpec,
    /// What every runner VM of the pool looks like.
    pub template: RunnerVmTemplate,
    pub scaling: Scaling,
    /// Secret with the webhook HMAC secret for deliveries routed to this pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook_secret_ref: Option<SecretKeyRef>,
}

/// Where the runners register at GitHub and with which labels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct GithubRunnerSpec {
    /// Organization or repository the runners register with (exactly one).
    pub scope: GithubScope,
    /// Secret with the GitHub App credentials (keys app-id, installation-id, private-key).
    pub app_secret_ref: LocalObjectReference,
    /// Runner group name (organization scope); the default group when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub runner_group: Option<String>,
    /// Labels of every runner; a job is served when its labels are a subset of these.
    #[schemars(length(min = 1, max = 64), inner(length(min = 1, max = 256)))]
    pub labels: Vec<String>,
    /// Runner work folder inside the guest (default `_work`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub work_folder: Option<String>,
    /// Take demand from a runner scale set (GitHub's listener protocol) instead of only from
    /// webhooks: Imp creates or adopts the scale set, holds its message session and mints the
    /// runners through it, so `runs-on: <name>` routes jobs to this pool (docs/github.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_set: Option<ScaleSetSpec>,
    /// The actions/runner version the pool's runner layer (`template.spec.runnerImage`) carries,
    /// as images/runner/build.sh prints and labels it (`dev.imp.runner.version`), e.g. `2.329.0`.
    /// The operator compares it with GitHub's supported runner versions and reports the
    /// `RunnerVersionSupported` condition; unset, the condition is Unknown (docs/runner-pool.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self.matches('^v?[0-9]+[.][0-9]+[.][0-9]+$')").message("runnerVersion must be MAJOR.MINOR.PATCH, e.g. 2.329.0"))]
    #[schemars(length(min = 5, max = 32))]
    pub runner_version: Option<String>,
}

/// A runner scale set the pool serves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScaleSetSpec {
    /// The scale set's name: what workflows write in `runs-on` (GitHub allows 1-45 characters).
    #[x_kube(validation = kube::core::Rule::new("self.matches('^[A-Za-z0-9._-]+$')").message("scaleSet.name may hold letters, digits, '.', '_' and '-' only"))]
    #[schemars(length(min = 1, max = 45))]
    pub name: String,
    /// Runner group of the scale set (organization scope); the default group when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub runner_group: Option<String>,
}

/// Exactly one of `org` or `repo`. Enterprise scope is not offered: GitHub refuses App tokens there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("has(self.org) != has(self.repo)").message("exactly one of scope.org or scope.repo must be set"))]
pub struct GithubScope {
    /// Organization login, e.g. `acme`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 39))]
    pub org: Option<String>,
    /// Repository as `owner/name`, e.g. `acme/app`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self.matches('^[A-Za-z0-9-]+/[A-Za-z0-9._-]+$')").message("repo must be owner/name"))]
    #[schemars(length(min = 3, max = 140))]
    pub repo: Option<String>,
}

/// The parts of an ImpVM spec a runner VM takes from its pool. Lifecycle is always ephemeral and the
/// runner config Secret is the pool's to set, so neither can be written here.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerVmTemplate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMetadata>,
    pub spec: RunnerVmTemplateSpec,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateMetadata {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerVmTemplateSpec {
    pub class_ref: ClassRef,
    /// Base OCI image of the runner's root filesystem.
    #[schemars(length(min = 1, max = 512))]
    pub image: String,
    /// OCI image with the actions/runner layer, applied on top of `image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub runner_image: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// Kubernetes' `imagePullPolicy` for the runner VMs' images (see ImpVM `imagePullPolicy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_ref: Option<NetworkRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Upper bound on one runner VM's life (a stuck job is cut off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("duration(self) > duration('0s')").message("expireAfter must be positive"))]
    pub expire_after: Option<KubeDuration>,
    /// Who the runner runs as in the guest; unset: uid 1001, never root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_user: Option<RunnerUser>,
}

/// Pool size limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("!has(self.minIdle) || self.minIdle <= self.maxRunners").message("minIdle must not exceed maxRunners").field_path(".minIdle"))]
pub struct Scaling {
    /// Idle runners kept registered and waiting (default 0: scale from zero on demand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10000))]
    pub min_idle: Option<u32>,
    /// Upper bound on runner VMs of the pool, busy or not.
    #[schemars(range(min = 1, max = 10000))]
    pub max_runners: u32,
    /// Most runner VMs created in one reconcile pass (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub scale_up_step: Option<u32>,
    /// Snapshot standby, in addition to `minIdle` (default false): the pool's runner VMs start
    /// from a snapshot template (`startFrom: Template`) that each node able to serve the pool
    /// keeps ready, so a job that finds no idle runner gets a clone restored in milliseconds
    /// instead of a cold boot. A node without a Ready template boots the VM cold and says why
    /// (`status.start.fallbackReason`; docs/runner-pool.md, "Snapshot standby").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby: Option<bool>,
}

/// Default number of runners created per reconcile pass.
pub const DEFAULT_SCALE_UP_STEP: u32 = 10;

impl Scaling {
    pub fn min_idle(&self) -> u32 {
        self.min_idle.unwrap_or(0)
    }
    pub fn scale_up_step(&self) -> u32 {
        self.scale_up_step.unwrap_or(DEFAULT_SCALE_UP_STEP)
    }
    /// `standby`, defaulted.
    pub fn standby(&self) -> bool {
        self.standby.unwrap_or(false)
    }
}

/// A key of a Secret in the pool's namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key inside the Secret (default `webhook-secret`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub key: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImpVMRunnerPoolStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Runner VMs the pool wants right now.
    #[serde(default)]
    pub desired: u32,
    /// Registered and waiting for a job.
    #[serde(default)]
    pub idle: u32,
    /// Running a job.
    #[serde(default)]
    pub busy: u32,
    /// Created but not yet registered and waiting (scheduling, booting, handoff).
    #[serde(default)]
    pub booting: u32,
    /// All runner VMs of the pool.
    #[serde(default)]
    pub total: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The runner layer's version against GitHub's supported versions (docs/runner-pool.md,
    /// "Runner freshness").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_version: Option<RunnerVersionStatus>,
}

/// What the operator knows of the pool's runner version. Persisted here so a restarted operator
/// keeps the clock of the 30 days GitHub gives a superseded runner.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerVersionStatus {
    /// `spec.github.runnerVersion` when it was last judged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The newest runner release GitHub offers (`GET .../actions/runners/downloads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest: Option<String>,
    /// When the operator first saw a release newer than `version`: GitHub's 30 days to upgrade
    /// count from here (at the latest; the release may be older than the first sighting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superseded_time: Option<Time>,
    /// The pool generation whose runner GitHub refused as deprecated (exit code 7): no runner
    /// is minted while the pool is at this generation. Changing the pool (a new runner image or
    /// version) bumps the generation and lets minting resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_generation: Option<i64>,
    /// The VM whose runner was refused, and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_vm: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_time: Option<Time>,
}
