//! Every label, annotation, finalizer and condition name Imp puts on Kubernetes objects, in one place,
//! so the operator, the agent, the chart and the tests cannot drift apart.

/// API group of all Imp custom resources.
pub const GROUP: &str = "imp.dev";
/// Served and stored version of all Imp custom resources.
pub const VERSION: &str = "v1alpha1";
/// kubectl category: `kubectl get imp` lists every Imp object.
pub const CATEGORY: &str = "imp";

/// Finalizer the operator puts on every ImpVM; removed only after the node reported teardown.
pub const FINALIZER_VM_CLEANUP: &str = "imp.dev/vm-cleanup";

/// Label on runner ImpVMs naming the ImpVMRunnerPool that owns them.
pub const LABEL_RUNNER_POOL: &str = "imp.dev/runner-pool";
/// Label on Secrets that hold a one-time JIT runner config.
pub const LABEL_SECRET_KIND: &str = "imp.dev/secret-kind";
/// Value of [`LABEL_SECRET_KIND`] for JIT runner config Secrets.
pub const SECRET_KIND_JIT: &str = "jitconfig";
/// Node label that makes a node eligible for ImpVMs (seed: `imp/enabled=true`).
pub const LABEL_NODE_ENABLED: &str = "imp/enabled";
/// Annotation that resets an exhausted restart budget when set (onExhaustion: manual-reset).
pub const ANNOTATION_RESET_RESTARTS: &str = "imp.dev/reset-restarts";
/// Annotation on a JIT Secret: the GitHub runner id the config registers.
pub const ANNOTATION_RUNNER_ID: &str = "imp.dev/github-runner-id";
/// Annotation on a JIT Secret: the GitHub runner name the config registers.
pub const ANNOTATION_RUNNER_NAME: &str = "imp.dev/github-runner-name";
/// Key inside a JIT Secret holding the encoded runner config.
pub const SECRET_KEY_JITCONFIG: &str = "jitconfig";
/// Field manager used by the operator for server-side apply and status patches.
pub const MANAGER_OPERATOR: &str = "imp-operator";
/// Field manager used by the node agent.
pub const MANAGER_AGENT: &str = "imp-agent";

/// Name of the JIT config Secret of a runner VM: `impvm-<vm-uid>-jit`.
pub fn jit_secret_name(vm_uid: &str) -> String {
    format!("impvm-{vm_uid}-jit")
}

/// Condition types used in Imp statuses.
pub mod condition {
    /// ImpVM: a node was chosen.
    pub const SCHEDULED: &str = "Scheduled";
    /// ImpVM: guest answered and readiness probe passes; pool: enough runners.
    pub const READY: &str = "Ready";
    /// ImpVM: the node hosting the VM is healthy (Ready, agent heartbeat fresh).
    pub const NODE_HEALTHY: &str = "NodeHealthy";
    /// ImpVM: the node agent finished teardown (process, TAP, IP, per-VM disk released).
    pub const TORN_DOWN: &str = "TornDown";
    /// Pool: the GitHub App credentials work.
    pub const CREDENTIALS_VALID: &str = "CredentialsValid";
    /// Pool: maxRunners reached.
    pub const AT_CAPACITY: &str = "AtCapacity";
    /// Pool: scaling held back (scaleUpStep, governor, backoff).
    pub const SCALING_LIMITED: &str = "ScalingLimited";
    /// ImpNetwork: subnet accepted and IPAM ready.
    pub const NETWORK_READY: &str = "Ready";
}

/// Failure and condition reasons. Precise and stable: alerts and runbooks key on them.
pub mod reason {
    pub const SPEC_INVALID: &str = "SpecInvalid";
    pub const CLASS_NOT_FOUND: &str = "ClassNotFound";
    pub const UNSCHEDULABLE: &str = "Unschedulable";
    /// The registry refused, lacks the tag, or cannot be reached.
    pub const ROOTFS_PULL_FAILED: &str = "RootfsPullFailed";
    /// The image broke an integrity or safety rule (digests, media types, hostile layers, caps).
    pub const ROOTFS_REJECTED: &str = "RootfsRejected";
    /// The node could not build the image (disk, mkfs, index).
    pub const ROOTFS_BUILD_FAILED: &str = "RootfsBuildFailed";
    pub const KERNEL_MISSING: &str = "KernelMissing";
    pub const FIRECRACKER_START_FAILED: &str = "FirecrackerStartFailed";
    pub const GUEST_PANICKED: &str = "GuestPanicked";
    pub const GUEST_AGENT_TIMEOUT: &str = "GuestAgentTimeout";
    pub const NETWORK_SETUP_FAILED: &str = "NetworkSetupFailed";
    pub const HANDOFF_AMBIGUOUS: &str = "HandoffAmbiguous";
    pub const RUNNER_EXITED_NON_ZERO: &str = "RunnerExitedNonZero";
    pub const NODE_LOST: &str = "NodeLost";
    pub const EXPIRED: &str = "Expired";
    pub const RETRY_EXHAUSTED: &str = "RetryExhausted";
    /// ImpVM stays Pending / ImpNetwork not Ready: the built-in IPAM has no free address left.
    pub const NETWORK_EXHAUSTED: &str = "NetworkExhausted";
    /// ImpNetwork Ready: the built-in IPAM has free addresses.
    pub const ADDRESSES_AVAILABLE: &str = "AddressesAvailable";
}
