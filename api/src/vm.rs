//! ImpVM: one microVM, ephemeral (one CI job) or persistent (a service with a restart policy).

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::{
    api::core::v1::{LocalObjectReference, Toleration},
    apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time},
};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::{FieldError, KubeDuration, RestartPolicy};

/// Idle time before a ScaleToZero VM is suspended, when `idleTimeout` is unset.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Smallest accepted `idleTimeout` (also enforced by the CRD schema).
pub const MIN_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// One Firecracker microVM, scheduled onto a node by the operator and run there by the node agent.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpVM",
    namespaced,
    shortname = "impvm",
    category = "imp",
    status = "ImpVMStatus",
    doc = "One Imp microVM.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.nodeName"),
    printcolumn(name = "IP", type_ = "string", json_path = ".status.ip"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Class",
        type_ = "string",
        json_path = ".spec.classRef.name",
        priority = 1
    ),
    printcolumn(
        name = "Lifecycle",
        type_ = "string",
        json_path = ".spec.lifecycle",
        priority = 1
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.reason",
        priority = 1
    ),
    printcolumn(
        name = "Start",
        type_ = "string",
        json_path = ".status.start.from",
        priority = 1
    ),
    selectable = ".spec.nodeName"
)]
#[serde(rename_all = "camelCase")]
// The agent hands a JIT config only to the VM whose Secret it is (docs/agent.md "Binding rule"); a
// name that can be swapped after the check would undo that, so it is fixed once set.
#[x_kube(validation = kube::core::Rule::new("!has(oldSelf.runnerConfigSecret) || (has(self.runnerConfigSecret) && self.runnerConfigSecret == oldSelf.runnerConfigSecret)")
    .message("runnerConfigSecret cannot change or be removed once set").field_path(".runnerConfigSecret"))]
// A runner VM is frozen once its JIT config is minted (crate::frozen): re-pointing it at another
// image, class, network or pull credentials would hand the pool's registration to whatever boots.
// `has(oldSelf.runnerConfigSecret)` also covers the update that removes it (refused above).
#[x_kube(validation = kube::core::Rule::new("!has(oldSelf.runnerConfigSecret) || self.image == oldSelf.image")
    .message("image cannot change once runnerConfigSecret is set (the runner config was minted for this VM)").field_path(".image"))]
#[x_kube(validation = kube::core::Rule::new("!has(oldSelf.runnerConfigSecret) || (has(self.runnerImage) == has(oldSelf.runnerImage) && (!has(self.runnerImage) || self.runnerImage == oldSelf.runnerImage))")
    .message("runnerImage cannot change once runnerConfigSecret is set (the runner config was minted for this VM)").field_path(".runnerImage"))]
#[x_kube(validation = kube::core::Rule::new("!has(oldSelf.runnerConfigSecret) || self.classRef == oldSelf.classRef")
    .message("classRef cannot change once runnerConfigSecret is set (the runner config was minted for this VM)").field_path(".classRef"))]
#[x_kube(validation = kube::core::Rule::new("!has(oldSelf.runnerConfigSecret) || (has(self.networkRef) == has(oldSelf.networkRef) && (!has(self.networkRef) || self.networkRef == oldSelf.networkRef))")
    .message("networkRef cannot change once runnerConfigSecret is set (the runner config was minted for this VM)").field_path(".networkRef"))]
#[x_kube(validation = kube::core::Rule::new("!has(oldSelf.runnerConfigSecret) || (has(self.imagePullSecrets) == has(oldSelf.imagePullSecrets) && (!has(self.imagePullSecrets) || self.imagePullSecrets == oldSelf.imagePullSecrets))")
    .message("imagePullSecrets cannot change once runnerConfigSecret is set (the runner config was minted for this VM)").field_path(".imagePullSecrets"))]
#[x_kube(validation = kube::core::Rule::new("!has(oldSelf.runnerConfigSecret) || (has(self.runnerUser) == has(oldSelf.runnerUser) && (!has(self.runnerUser) || self.runnerUser == oldSelf.runnerUser))")
    .message("runnerUser cannot change once runnerConfigSecret is set (the runner config was minted for this VM)").field_path(".runnerUser"))]
// How a runner VM starts is chosen with its pool's standby setting when it is created; it stays
// what its runner config was minted with.
#[x_kube(validation = kube::core::Rule::new("!has(oldSelf.runnerConfigSecret) || (has(self.startFrom) == has(oldSelf.startFrom) && (!has(self.startFrom) || self.startFrom == oldSelf.startFrom))")
    .message("startFrom cannot change once runnerConfigSecret is set").field_path(".startFrom"))]
// A one-job VM has nothing to come back to: suspending it would only hold its node's memory and its
// runner's job. Runner VMs are ephemeral and carry runnerConfigSecret; either marks a VM as one.
#[x_kube(validation = kube::core::Rule::new("!has(self.desiredState) || !(self.desiredState in ['Suspended', 'ScaleToZero']) || (self.lifecycle == 'persistent' && !has(self.runnerConfigSecret))")
    .message("only persistent VMs without a runnerConfigSecret may be Suspended or ScaleToZero; ephemeral and runner VMs run to completion").field_path(".desiredState"))]
pub struct ImpVMSpec {
    /// The ImpVMClass giving size and behaviour.
    pub class_ref: ClassRef,
    /// OCI image of the root filesystem.
    #[schemars(length(min = 1, max = 512))]
    pub image: String,
    /// OCI image layered on top of `image` (the runner layer of runner VMs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub runner_image: Option<String>,
    /// Secrets in this namespace with registry credentials (kubernetes.io/dockerconfigjson).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// When the node asks the registry again for an image it has built (Kubernetes' meaning).
    /// Default as Kubernetes': `Always` for a `:latest` or untagged reference, `IfNotPresent`
    /// otherwise (digest references included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,
    /// The ImpNetwork the VM attaches to; without it the VM has no network interface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_ref: Option<NetworkRef>,
    /// `ephemeral` VMs run one job and are deleted; `persistent` VMs are restarted per restartPolicy.
    pub lifecycle: Lifecycle,
    /// The node running the VM; set by the operator's scheduler unless set by the user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Only nodes with all these labels are considered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Taints these tolerate do not keep the VM off a node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Restart behaviour of persistent VMs; inherited from the class when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<RestartPolicy>,
    /// Running (default), Suspended, or ScaleToZero (suspend after idleTimeout without traffic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_state: Option<DesiredState>,
    /// Idle time before a ScaleToZero VM is suspended; default 5m, at least 10s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("duration(self) >= duration('10s')").message("idleTimeout must be at least 10s"))]
    pub idle_timeout: Option<KubeDuration>,
    /// The VM is deleted this long after it first reached Running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("duration(self) > duration('0s')").message("expireAfter must be positive"))]
    pub expire_after: Option<KubeDuration>,
    /// Secret (same namespace) holding the one-time JIT runner config; set by the runner pool controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub runner_config_secret: Option<String>,
    /// Who the runner runs as in the guest (runner VMs only; set by the pool from its template).
    /// Unset: uid 1001 (the `runner` user), never root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_user: Option<RunnerUser>,
    /// `Boot` (default): a cold boot of kernel and image. `Template`: a clone restored from the
    /// node's snapshot template for this spec, when the node has one Ready; otherwise the node
    /// boots it cold and `status.start.fallbackReason` says why. Set by a runner pool with
    /// `scaling.standby` (docs/runner-pool.md, "Snapshot standby").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_from: Option<StartFrom>,
}

/// How a VM is asked to start (`spec.startFrom`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum StartFrom {
    /// A cold boot.
    #[default]
    Boot,
    /// A clone of the node's snapshot template, else a cold boot.
    Template,
}

/// How a VM was started (`status.start.from`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum StartedFrom {
    /// Booted cold.
    Boot,
    /// Restored from a snapshot template, then given an identity of its own.
    Clone,
}

/// How the node started the VM, as imp-runtime reported it (written by the agent once, with
/// Running or Failed).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StartStatus {
    pub from: StartedFrom,
    /// The template's content key, for a clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Asked `startFrom: Template` but booted: why (TemplateMissing, TemplateBuilding,
    /// TemplateStale, TemplateVmmMismatch, TemplateFailed, TemplateUnsupported, RestoreFailed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_message: Option<String>,
    /// A clone: from its fresh VMM's start to the restored guest agent's Hello.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_seconds: Option<f64>,
    /// A clone: the guest's `Reidentify` round trip (entropy, MAC, address, hostname, machine-id,
    /// clock), its evidence checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reidentify_seconds: Option<f64>,
}

/// The uid the runner runs as when `runnerUser.uid` is unset: the `runner` user of GitHub's hosted
/// images, actions-runner-controller's runner image and Imp's runner layer.
pub const DEFAULT_RUNNER_UID: u32 = 1001;

/// The user the guest starts the runner as. The guest refuses uid 0 unless `runAsRoot` is true.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerUser {
    /// Default 1001.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Default: the uid's primary group in the image's /etc/passwd, else the uid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// Allow the runner to run as root (uid 0). Default false: the guest refuses, and the VM
    /// fails with reason RunnerStartFailed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as_root: Option<bool>,
}

impl RunnerUser {
    /// `uid`, defaulted.
    pub fn uid(&self) -> u32 {
        self.uid.unwrap_or(DEFAULT_RUNNER_UID)
    }

    /// `runAsRoot`, defaulted.
    pub fn run_as_root(&self) -> bool {
        self.run_as_root.unwrap_or(false)
    }
}

impl ImpVMSpec {
    /// `idleTimeout`, defaulted.
    pub fn idle_timeout(&self) -> Result<Duration, FieldError> {
        match &self.idle_timeout {
            None => Ok(DEFAULT_IDLE_TIMEOUT),
            Some(d) => d
                .parse()
                .map_err(|e| FieldError::duration("spec.idleTimeout", e)),
        }
    }

    /// `expireAfter`, if set.
    pub fn expire_after(&self) -> Result<Option<Duration>, FieldError> {
        self.expire_after
            .as_ref()
            .map(|d| {
                d.parse()
                    .map_err(|e| FieldError::duration("spec.expireAfter", e))
            })
            .transpose()
    }

    /// `desiredState`, defaulted.
    pub fn desired_state(&self) -> DesiredState {
        self.desired_state.unwrap_or_default()
    }

    /// `startFrom`, defaulted.
    pub fn start_from(&self) -> StartFrom {
        self.start_from.unwrap_or_default()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ClassRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct NetworkRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Kubernetes' `imagePullPolicy`, for the rootfs cache (docs/rootfs.md). `Never` is not offered:
/// a node cannot be preloaded with images by hand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum PullPolicy {
    /// Resolve the references at the registry for every VM (a moved tag is rebuilt); an image
    /// built from the same layers is still a cache hit.
    Always,
    /// Use an image already built on the node from these exact references (and credentials that
    /// may read it) without asking the registry; resolve only when there is none.
    IfNotPresent,
}

impl PullPolicy {
    /// Kubernetes' default for `reference` when the field is unset: `Always` when the tag is
    /// `latest` or missing and no digest pins it, `IfNotPresent` otherwise.
    pub fn default_for(reference: &str) -> PullPolicy {
        if reference.contains('@') {
            return PullPolicy::IfNotPresent;
        }
        // The tag follows the last ':' after the last '/' (a ':' before it is a registry port).
        let name = reference.rsplit('/').next().unwrap_or(reference);
        match name.rsplit_once(':') {
            Some((_, tag)) if tag != "latest" => PullPolicy::IfNotPresent,
            _ => PullPolicy::Always,
        }
    }

    /// The policy in force for a VM whose image references are `references`: the field, or the
    /// strictest default over them (one `latest` reference makes the VM `Always`).
    pub fn effective<'a>(
        set: Option<PullPolicy>,
        references: impl IntoIterator<Item = &'a str>,
    ) -> PullPolicy {
        set.unwrap_or_else(|| {
            if references
                .into_iter()
                .any(|r| PullPolicy::default_for(r) == PullPolicy::Always)
            {
                PullPolicy::Always
            } else {
                PullPolicy::IfNotPresent
            }
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Lifecycle {
    Ephemeral,
    Persistent,
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum DesiredState {
    #[default]
    Running,
    Suspended,
    ScaleToZero,
}

/// Where an ImpVM is in its life. Writers: see docs/architecture.md (operator vs agent).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum VmPhase {
    Pending,
    Scheduled,
    Starting,
    Running,
    Succeeded,
    Failed,
    Terminating,
    RetryExhausted,
    /// Reserved for scale-to-zero.
    Suspending,
    /// Reserved for scale-to-zero.
    Suspended,
    /// Reserved for scale-to-zero.
    Resuming,
}

impl VmPhase {
    /// Succeeded and Failed are final for the VM's current run.
    pub fn is_terminal(self) -> bool {
        matches!(self, VmPhase::Succeeded | VmPhase::Failed)
    }
}

/// Observed state of an ImpVM.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImpVMStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<VmPhase>,
    /// Machine-readable reason of the current phase, e.g. NodeLost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Human-readable detail for `reason`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Guest address on the VM's ImpNetwork.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// When the scheduler bound the VM to a node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_time: Option<Time>,
    /// When the node agent asked imp-runtime to start the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_start_time: Option<Time>,
    /// When the guest agent first answered Hello (boot complete).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_complete_time: Option<Time>,
    /// First time the VM reached Running; expireAfter counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_running_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarts: Option<RestartStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner: Option<RunnerStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<GuestStatus>,
    /// Runner pool VMs: the workflow job this VM served and when each step of serving it happened
    /// (written by the pool controller; docs/runner-pool.md, "Why did my job wait").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<ServedJobStatus>,
    /// How the node started the VM: booted, or cloned from a snapshot template (and if a clone
    /// was asked for but the VM booted, why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartStatus>,
}

/// The workflow job a runner VM served, and the time of each step from the job being queued to its
/// completion. The pool hands a queued job to no VM in particular (any idle runner with matching labels
/// may take it), so the job fields are set once GitHub's `in_progress` webhook (or the sweep) names
/// this VM's runner; `vmCreatedTime` and `mintedTime` are set when the VM is minted. The step times
/// are copied from the rest of the status when the job is recorded, so one object answers "why did my
/// job wait": steps before `queuedTime` did not delay it (a warm runner).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServedJobStatus {
    /// GitHub's workflow job id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<i64>,
    /// The workflow run the job belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<i64>,
    /// `owner/repo`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    /// When the job was queued: its `queued` webhook's arrival, or GitHub's `created_at` when only the
    /// sweep saw it queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_time: Option<MicroTime>,
    /// When the pool created this VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_created_time: Option<MicroTime>,
    /// When its JIT runner config was minted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minted_time: Option<MicroTime>,
    /// This status's `scheduledTime` when the job was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_time: Option<MicroTime>,
    /// This status's `bootCompleteTime` when the job was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub booted_time: Option<MicroTime>,
    /// This status's `runner.startedTime` when the job was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_started_time: Option<MicroTime>,
    /// When the job went in progress on this VM's runner (its `in_progress` webhook's arrival).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub picked_up_time: Option<MicroTime>,
    /// When it completed (its `completed` webhook's arrival), if the VM was still there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_time: Option<MicroTime>,
}

/// Restart bookkeeping of a persistent VM.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestartStatus {
    /// Restarts spent from the current budget.
    pub count: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_restart_time: Option<Time>,
    /// Earliest time of the next restart (backoff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_restart_time: Option<Time>,
    /// When the budget ran out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exhausted_time: Option<Time>,
}

/// The one-time runner handoff of a runner VM (ARCHITECTURE §2, step 6).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff: Option<HandoffState>,
    /// Exec id used for the runner process (the guest's idempotency key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_id: Option<String>,
    /// GitHub runner id registered by the JIT config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_id: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exited_time: Option<Time>,
}

/// Handoff states. `Sent` is recorded before the config leaves the host; `Sent` without `Started`
/// after a lost connection is ambiguous and never replayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum HandoffState {
    Sent,
    Started,
    Exited,
    Ambiguous,
}

/// Latest guest metrics reported by the node agent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GuestStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_used_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_used_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_time: Option<Time>,
}

#[cfg(test)]
mod tests {
    use super::PullPolicy::{self, Always, IfNotPresent};

    #[test]
    fn pull_policy_defaults_as_kubernetes() {
        for (reference, want) in [
            ("ubuntu", Always),
            ("ubuntu:latest", Always),
            ("registry.example:5000/ci/ubuntu", Always),
            ("registry.example:5000/ci/ubuntu:latest", Always),
            ("registry.example:5000/ci/ubuntu:24.04", IfNotPresent),
            ("ubuntu:24.04", IfNotPresent),
            (
                "registry.example:5000/ci/ubuntu@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                IfNotPresent,
            ),
            (
                "ubuntu:latest@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                IfNotPresent,
            ),
        ] {
            assert_eq!(PullPolicy::default_for(reference), want, "{reference}");
        }
    }

    #[test]
    fn effective_policy_is_the_field_or_the_strictest_default() {
        assert_eq!(PullPolicy::effective(None, ["a:1", "b:2"]), IfNotPresent);
        assert_eq!(PullPolicy::effective(None, ["a:1", "b"]), Always);
        assert_eq!(
            PullPolicy::effective(Some(IfNotPresent), ["b"]),
            IfNotPresent
        );
        assert_eq!(PullPolicy::effective(Some(Always), ["a:1"]), Always);
    }
}
