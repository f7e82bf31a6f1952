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
/// Finalizer on every ImpVMRunnerPool: its GitHub runners are deregistered before the pool goes.
pub const FINALIZER_POOL_CLEANUP: &str = "imp.dev/runner-pool-cleanup";

/// Label on runner ImpVMs naming the ImpVMRunnerPool that owns them.
pub const LABEL_RUNNER_POOL: &str = "imp.dev/runner-pool";
/// Label on Secrets that hold a one-time JIT runner config.
pub const LABEL_SECRET_KIND: &str = "imp.dev/secret-kind";
/// Value of [`LABEL_SECRET_KIND`] for JIT runner config Secrets.
pub const SECRET_KIND_JIT: &str = "jitconfig";
/// Node label that makes a node eligible for ImpVMs (seed: `imp/enabled=true`).
pub const LABEL_NODE_ENABLED: &str = "imp/enabled";
/// Node annotation with which the agent may publish the vCPUs it offers to VMs (overrides allocatable cpu).
pub const ANNOTATION_CAPACITY_VCPU: &str = "imp.dev/capacity-vcpu";
/// Node annotation with which the agent may publish the MiB it offers to VMs (overrides allocatable memory).
pub const ANNOTATION_CAPACITY_MEMORY_MIB: &str = "imp.dev/capacity-memory-mib";
/// Node annotation with which the agent publishes imp-runtime's writable-drive budget, MiB (the
/// scheduler rejects a VM whose `diskGiB` does not fit beside the VMs already there).
pub const ANNOTATION_CAPACITY_DISK_MIB: &str = "imp.dev/capacity-disk-mib";
/// Annotation that resets an exhausted restart budget when set (onExhaustion: manual-reset).
pub const ANNOTATION_RESET_RESTARTS: &str = "imp.dev/reset-restarts";
/// Annotation on a JIT Secret: the GitHub runner id the config registers.
pub const ANNOTATION_RUNNER_ID: &str = "imp.dev/github-runner-id";
/// Annotation on a JIT Secret: the GitHub runner name the config registers.
pub const ANNOTATION_RUNNER_NAME: &str = "imp.dev/github-runner-name";
/// Annotation on a runner ImpVM: the pool's `spec.github.runnerVersion` when the VM was created, so
/// a runner GitHub refuses is judged against the runner layer it ran, not a later one.
pub const ANNOTATION_RUNNER_VERSION: &str = "imp.dev/runner-version";
/// Annotation on a JIT Secret: the [`boot_digest`](crate::frozen::boot_digest) of the VM spec the
/// config was minted for; the agent hands the config only to a VM whose spec still has it.
pub const ANNOTATION_BOOT_DIGEST: &str = "imp.dev/boot-digest";
/// Annotation on an ImpVM: its built-in IPAM address `ADDR/PREFIX`, written by the operator together
/// with the binding (spec.nodeName); the agent starts a VM with a networkRef only once it is there.
pub const ANNOTATION_IP_ALLOCATION: &str = "imp.dev/ip-allocation";
/// Annotation on an ImpVM the memory-pressure lifecycle suspended: when it set `spec.desiredState:
/// Suspended` (RFC 3339), written in the same patch. It marks the suspend as the lifecycle's (not a
/// user's) and is removed once the VM is resumed (docs/architecture.md, pressureLifecycle).
pub const ANNOTATION_PRESSURE_SUSPENDED_AT: &str = "imp.dev/pressure-suspended-at";
/// Annotation on a Node, written by its agent: the uids of the standby pools (`spec.scaling.standby`)
/// whose snapshot template is Ready on the node, comma-separated and sorted. The scheduler prefers
/// these nodes for the pools' `startFrom: Template` VMs (docs/runner-pool.md, "Snapshot standby").
pub const ANNOTATION_TEMPLATES_READY: &str = "imp.dev/templates-ready";
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

const LEASE_PREFIX: &str = "imp-node-";

/// Name of the heartbeat Lease the agent on `node` renews (in the operator's namespace): `imp-node-<node>`.
pub fn lease_name(node: &str) -> String {
    format!("{LEASE_PREFIX}{node}")
}

/// The node a heartbeat Lease belongs to, if its name follows [`lease_name`].
pub fn lease_node(lease_name: &str) -> Option<&str> {
    lease_name
        .strip_prefix(LEASE_PREFIX)
        .filter(|n| !n.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_round_trip() {
        assert_eq!(lease_name("worker-1"), "imp-node-worker-1");
        assert_eq!(lease_node(&lease_name("worker-1")), Some("worker-1"));
        assert_eq!(lease_node("imp-node-"), None);
        assert_eq!(lease_node("kube-node-lease"), None);
    }
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
    /// ImpVM: the operator's memory-pressure lifecycle suspended the VM (True until someone sets
    /// `spec.desiredState` back to Running; the message says how).
    pub const PRESSURE_SUSPENDED: &str = "PressureSuspended";
    /// ImpVM: whether the agent holds the VM suspended (True from Suspending to Suspended),
    /// and why; False with the reason it was resumed or why a suspend was refused.
    pub const SUSPENDED: &str = "Suspended";
    /// Pool: the GitHub App credentials work.
    pub const CREDENTIALS_VALID: &str = "CredentialsValid";
    /// Pool: maxRunners reached.
    pub const AT_CAPACITY: &str = "AtCapacity";
    /// Pool: scaling held back (scaleUpStep, governor, backoff).
    pub const SCALING_LIMITED: &str = "ScalingLimited";
    /// Pool: the periodic sweep listed every repository of the pool's scope in full (False: some
    /// repository's active runs are beyond what the sweep reads; its jobs come from webhooks only).
    pub const DEMAND_LISTED: &str = "DemandListed";
    /// Pool: GitHub still gives jobs to the pool's runner version (`spec.github.runnerVersion`
    /// against the supported versions): True Current or Expiring (days left in the message),
    /// False Deprecated, Unknown when the version or GitHub's answer is not known.
    pub const RUNNER_VERSION_SUPPORTED: &str = "RunnerVersionSupported";
    /// Pool: GitHub refused one of the pool's runners (exit code 7, the deprecation message);
    /// the reason says whether minting stopped (deprecated) or goes on with backoff (an outage).
    pub const DEGRADED: &str = "Degraded";
    /// ImpNetwork: subnet accepted and IPAM ready.
    pub const NETWORK_READY: &str = "Ready";
}

/// Every reason Imp writes: ImpVM `status.reason`, condition reasons, Event reasons, imp-runtime API
/// errors. Precise and stable: alerts and runbooks key on them. One list ([`reason::ALL`]) generates
/// both the constants and docs/reasons.md (`make reasons`), so the two cannot drift.
pub mod reason {
    use super::condition;

    /// Where a reason appears.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Site {
        /// ImpVM `status.reason` (the phase says Failed, or Pending when no node fits).
        VmStatus,
        /// ImpVM `status.start.fallbackReason`: why a VM asked to start from a template booted.
        VmStart,
        /// The reason of an ImpVM condition of this type.
        VmCondition(&'static str),
        /// The reason of an ImpVMRunnerPool condition of this type.
        PoolCondition(&'static str),
        /// The reason of an ImpNetwork condition of this type.
        NetworkCondition(&'static str),
        /// A Kubernetes Event about an ImpVM.
        VmEvent,
        /// A Kubernetes Event about an ImpVMRunnerPool.
        PoolEvent,
        /// The `error` of an imp-runtime API answer (docs/runtime.md) and its inventory record.
        Runtime,
        /// imp-runtime's verdict on one image layer; surfaces as RootfsRejected or RootfsBuildFailed.
        RootfsLayer,
    }

    impl Site {
        /// How docs/reasons.md names the site.
        pub fn describe(self) -> String {
            match self {
                Site::VmStatus => "ImpVM `status.reason`".into(),
                Site::VmStart => "ImpVM `status.start.fallbackReason`".into(),
                Site::VmCondition(t) => format!("ImpVM condition `{t}`"),
                Site::PoolCondition(t) => format!("ImpVMRunnerPool condition `{t}`"),
                Site::NetworkCondition(t) => format!("ImpNetwork condition `{t}`"),
                Site::VmEvent => "Event on an ImpVM".into(),
                Site::PoolEvent => "Event on an ImpVMRunnerPool".into(),
                Site::Runtime => "imp-runtime API error".into(),
                Site::RootfsLayer => "imp-runtime layer verdict".into(),
            }
        }
    }

    /// One reason as listed in [`ALL`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct ReasonDoc {
        /// The constant's name in this module.
        pub name: &'static str,
        /// The string Imp writes.
        pub value: &'static str,
        pub sites: &'static [Site],
        /// When it is used (the constant's doc comment).
        pub doc: &'static str,
    }

    /// `/// doc` `NAME = "Value" in [sites];` per reason: a documented constant each, and [`ALL`].
    macro_rules! reasons {
        ($( #[doc = $doc:literal] $name:ident = $value:literal in [$($site:expr),+ $(,)?]; )*) => {
            $( #[doc = $doc] pub const $name: &str = $value; )*
            /// Every reason in this module, in declaration order: the source of docs/reasons.md.
            pub const ALL: &[ReasonDoc] = &[$(
                ReasonDoc { name: stringify!($name), value: $value, sites: &[$($site),+], doc: $doc.trim_ascii() },
            )*];
        };
    }

    use Site::*;
    use condition::{
        AT_CAPACITY, CREDENTIALS_VALID, DEGRADED, DEMAND_LISTED, NETWORK_READY, NODE_HEALTHY,
        READY, RUNNER_VERSION_SUPPORTED, SCALING_LIMITED, SCHEDULED as SCHEDULED_C,
        TORN_DOWN as TORN_DOWN_C,
    };

    reasons! {
        // ImpVM spec and scheduling (operator).
        /// The ImpVM's spec cannot be used (e.g. its restart policy does not resolve); the VM fails.
        SPEC_INVALID = "SpecInvalid" in [VmStatus, VmEvent];
        /// The ImpVMClass the VM names does not exist (yet); the VM stays Pending.
        CLASS_NOT_FOUND = "ClassNotFound" in [VmCondition(SCHEDULED_C)];
        /// No node fits the VM (filters in kube-scheduler style in the message); it stays Pending.
        UNSCHEDULABLE = "Unschedulable" in [VmStatus, VmCondition(SCHEDULED_C)];
        /// A node was chosen (or spec.nodeName was set by the user).
        NODE_ASSIGNED = "NodeAssigned" in [VmCondition(SCHEDULED_C)];
        /// A restart cleared the node binding; the VM is scheduled again.
        RESCHEDULING = "Rescheduling" in [VmCondition(SCHEDULED_C)];
        /// Warning: no node fits the VM (emitted when the verdict changes).
        FAILED_SCHEDULING = "FailedScheduling" in [VmEvent];
        /// The VM was bound to a node.
        SCHEDULED = "Scheduled" in [VmEvent];

        // Node health (operator).
        /// The node is Ready and its agent's heartbeat Lease is fresh.
        NODE_READY = "NodeReady" in [VmCondition(NODE_HEALTHY)];
        /// The node's Ready condition is not True.
        NODE_NOT_READY = "NodeNotReady" in [VmCondition(NODE_HEALTHY)];
        /// The node object is gone.
        NODE_DELETED = "NodeDeleted" in [VmCondition(NODE_HEALTHY)];
        /// The agent's heartbeat Lease was not renewed within the grace period.
        AGENT_HEARTBEAT_STALE = "AgentHeartbeatStale" in [VmCondition(NODE_HEALTHY)];
        /// The node has no heartbeat Lease (its agent never started or the Lease was deleted).
        AGENT_HEARTBEAT_MISSING = "AgentHeartbeatMissing" in [VmCondition(NODE_HEALTHY)];
        /// The VM's node stayed unhealthy past the grace period; the VM fails (and may restart elsewhere).
        NODE_LOST = "NodeLost" in [VmStatus, VmEvent];

        // Lifetime and restarts (operator).
        /// The VM outlived spec.expireAfter.
        EXPIRED = "Expired" in [VmStatus, VmEvent];
        /// A persistent VM used up its restart budget; it stays Failed.
        RETRY_EXHAUSTED = "RetryExhausted" in [VmStatus, VmEvent];
        /// A persistent VM waits out its restart backoff.
        BACK_OFF = "BackOff" in [VmEvent];
        /// A persistent VM restarts.
        RESTARTING = "Restarting" in [VmEvent];
        /// The restart budget was reset; the message starts with CoolDownElapsed or ManualReset.
        RESTART_BUDGET_RESET = "RestartBudgetReset" in [VmEvent];
        /// RestartBudgetReset because the cool-down passed without a failure.
        COOL_DOWN_ELAPSED = "CoolDownElapsed" in [VmEvent];
        /// RestartBudgetReset because the reset annotation was set (onExhaustion: manual-reset).
        MANUAL_RESET = "ManualReset" in [VmEvent];

        // Deletion (operator).
        /// Deletion waits for the node agent's teardown.
        TERMINATING = "Terminating" in [VmEvent];
        /// The agent confirmed teardown and the finalizer was removed; also Ready=False after teardown.
        TORN_DOWN = "TornDown" in [VmEvent, VmCondition(READY)];
        /// Warning: the finalizer was removed without a teardown record (the node is gone).
        FINALIZER_FORCED = "FinalizerForced" in [VmEvent];

        // The VM on its node (agent).
        /// The agent asked imp-runtime to start the VM and waits for the guest.
        BOOTING = "Booting" in [VmCondition(READY)];
        /// The guest agent answered: the VM runs.
        GUEST_READY = "GuestReady" in [VmCondition(READY)];
        /// The runner's process ended (its exit code is in status.runner).
        RUNNER_EXITED = "RunnerExited" in [VmCondition(READY)];
        /// The VM failed or stopped before its runner ended.
        VM_STOPPED = "VmStopped" in [VmCondition(READY)];
        /// imp-runtime released the process, TAP, IP and per-VM disk.
        TEARDOWN_COMPLETE = "TeardownComplete" in [VmCondition(TORN_DOWN_C)];
        /// The VM's process ended while the VM was Running, with no runner exit code to report.
        GUEST_EXITED = "GuestExited" in [VmStatus, Runtime];
        /// imp-runtime has no record of a VM that status says is Starting or Running.
        VM_LOST = "VmLost" in [VmStatus];
        /// The runner had started, but the VM ended before its exit code was collected.
        RUNNER_EXIT_UNKNOWN = "RunnerExitUnknown" in [VmStatus];
        /// The runner exited with a non-zero code or was killed by a signal.
        RUNNER_EXITED_NON_ZERO = "RunnerExitedNonZero" in [VmStatus];
        /// The VM's JIT config Secret is missing or has no jitconfig key; the runner cannot start.
        RUNNER_CONFIG_MISSING = "RunnerConfigMissing" in [VmStatus];
        /// The guest refused to spawn the runner (the config was not used).
        RUNNER_START_FAILED = "RunnerStartFailed" in [VmStatus];
        /// The guest connection was lost after the config was sent: the runner may or may not run.
        HANDOFF_AMBIGUOUS = "HandoffAmbiguous" in [VmStatus];
        /// The agent refused to boot the VM: with the node's other VMs it exceeds the capacity the node publishes.
        NODE_CAPACITY_EXCEEDED = "NodeCapacityExceeded" in [VmStatus];

        // Starting a VM (imp-runtime; the agent copies them into the ImpVM status).
        /// The registry refused, lacks the tag, or cannot be reached.
        ROOTFS_PULL_FAILED = "RootfsPullFailed" in [VmStatus, Runtime];
        /// The image broke an integrity or safety rule (digests, media types, hostile layers, caps).
        ROOTFS_REJECTED = "RootfsRejected" in [VmStatus, Runtime];
        /// Pulling the image needed a connection to the node's own, loopback or link-local addresses, which pulls may not reach unless the registry is allowed on the node.
        ROOTFS_PULL_REFUSED = "RootfsPullRefused" in [VmStatus, Runtime];
        /// The node could not build the image (disk, mkfs, index).
        ROOTFS_BUILD_FAILED = "RootfsBuildFailed" in [VmStatus, Runtime];
        /// The kernel image the class names is not on the node.
        KERNEL_MISSING = "KernelMissing" in [VmStatus, Runtime];
        /// Firecracker did not start or refused the VM's configuration.
        FIRECRACKER_START_FAILED = "FirecrackerStartFailed" in [VmStatus, Runtime];
        /// Firecracker's API did not answer after an imp-runtime restart; the VM was killed.
        FIRECRACKER_UNRESPONSIVE = "FirecrackerUnresponsive" in [VmStatus, Runtime];
        /// The guest kernel panicked.
        GUEST_PANICKED = "GuestPanicked" in [VmStatus, Runtime];
        /// The guest agent did not say Hello in time.
        GUEST_AGENT_TIMEOUT = "GuestAgentTimeout" in [VmStatus, Runtime];
        /// The guest agent refused the host's connection (protocol mismatch).
        GUEST_PROTOCOL_ERROR = "GuestProtocolError" in [VmStatus, Runtime];
        /// The VM's TAP device or addresses could not be set up.
        NETWORK_SETUP_FAILED = "NetworkSetupFailed" in [VmStatus, Runtime];
        /// The VM's writable drive could not be created.
        DISK_SETUP_FAILED = "DiskSetupFailed" in [VmStatus, Runtime];

        // Snapshot standby (imp-runtime; docs/runner-pool.md "Snapshot standby").
        /// Asked to start from a template, the node had none for the VM's spec: booted cold.
        TEMPLATE_MISSING = "TemplateMissing" in [VmStart, Runtime];
        /// Asked to start from a template, the node's template for the spec was still being built: booted cold.
        TEMPLATE_BUILDING = "TemplateBuilding" in [VmStart, Runtime];
        /// The node's template was taken from inputs that changed since (kernel, image, guest agent): booted cold.
        TEMPLATE_STALE = "TemplateStale" in [VmStart, Runtime];
        /// The template's snapshot was taken with another VMM or version than the node runs now: booted cold.
        TEMPLATE_VMM_MISMATCH = "TemplateVmmMismatch" in [VmStart, Runtime];
        /// The node's last build of the template failed: booted cold.
        TEMPLATE_FAILED = "TemplateFailed" in [VmStart, Runtime];
        /// The node's VMM backend keeps no templates: booted cold.
        TEMPLATE_UNSUPPORTED = "TemplateUnsupported" in [VmStart, Runtime];
        /// Restoring the clone from the template's snapshot failed: booted cold.
        RESTORE_FAILED = "RestoreFailed" in [VmStart, Runtime];
        /// A clone restored from a template did not take an identity of its own (the guest's `Reidentify` failed or its evidence did not match): the VM fails, never Running, and its runner config is never read.
        REIDENTIFY_FAILED = "ReidentifyFailed" in [VmStatus, Runtime];

        // imp-runtime API errors (the agent maps the spec ones to SpecInvalid).
        /// The VM uid in the path is not a valid uid.
        INVALID_UID = "InvalidUid" in [Runtime];
        /// The request body is not valid JSON of the expected shape.
        INVALID_BODY = "InvalidBody" in [Runtime];
        /// The VM spec is valid JSON but cannot be run (e.g. zero vCPUs).
        INVALID_SPEC = "InvalidSpec" in [Runtime];
        /// A VM with this uid exists with a different spec.
        SPEC_CONFLICT = "SpecConflict" in [Runtime];
        /// imp-runtime has no VM with this uid.
        NOT_FOUND = "NotFound" in [Runtime];
        /// The VM exists but is not running (e.g. a guest call to a stopped VM).
        NOT_RUNNING = "NotRunning" in [Runtime];
        /// The VM has no network interface (link statistics asked of a VM without one).
        NO_NETWORK = "NoNetwork" in [Runtime];
        /// The TAP's link statistics could not be read.
        LINK_STATS_UNAVAILABLE = "LinkStatsUnavailable" in [Runtime];
        /// Pausing, snapshotting or resuming the VM failed.
        SNAPSHOT_FAILED = "SnapshotFailed" in [Runtime];
        /// imp-runtime's SQLite inventory failed.
        INVENTORY_ERROR = "InventoryError" in [Runtime];
        /// imp-runtime's state directory (rootfs store, writable templates) cannot be used.
        STATE_DIR_UNUSABLE = "StateDirUnusable" in [Runtime];
        /// No API route matches the request's method and path.
        NO_SUCH_ROUTE = "NoSuchRoute" in [Runtime];

        // One image layer (imp-runtime).
        /// The layer breaks a safety rule (path traversal, escaping links, devices, bad whiteouts).
        LAYER_REJECTED = "LayerRejected" in [RootfsLayer];
        /// The layer exceeds a size or entry-count cap.
        LAYER_TOO_LARGE = "LayerTooLarge" in [RootfsLayer];
        /// The layer cannot be decompressed or is not a valid tar.
        LAYER_UNREADABLE = "LayerUnreadable" in [RootfsLayer];
        /// The work directory a build starts from is not empty.
        WORK_DIR_NOT_EMPTY = "WorkDirNotEmpty" in [RootfsLayer];
        /// This host's filesystem failed while a layer was applied (not the image's fault).
        HOST_IO_FAILED = "HostIoFailed" in [RootfsLayer];

        // Runner pools (operator).
        /// The pool's GitHub App Secret does not exist.
        SECRET_NOT_FOUND = "SecretNotFound" in [PoolCondition(CREDENTIALS_VALID)];
        /// Reading the pool's GitHub App Secret failed.
        SECRET_UNREADABLE = "SecretUnreadable" in [PoolCondition(CREDENTIALS_VALID)];
        /// GitHub refused the App credentials (or the Secret's contents are not usable); scaling stops.
        CREDENTIALS_INVALID = "CredentialsInvalid" in [PoolCondition(CREDENTIALS_VALID), PoolCondition(SCALING_LIMITED)];
        /// A JIT runner config was minted with the App credentials.
        MINTED = "Minted" in [PoolCondition(CREDENTIALS_VALID)];
        /// No JIT config was minted yet, so the credentials are untested.
        NOT_YET_USED = "NotYetUsed" in [PoolCondition(CREDENTIALS_VALID)];
        /// Idle plus busy runners reach the desired count.
        RUNNERS_AVAILABLE = "RunnersAvailable" in [PoolCondition(READY)];
        /// Fewer runners than desired are idle or busy.
        RUNNERS_PENDING = "RunnersPending" in [PoolCondition(READY)];
        /// The pool has maxRunners live runners.
        MAX_RUNNERS_REACHED = "MaxRunnersReached" in [PoolCondition(AT_CAPACITY)];
        /// The pool has fewer than maxRunners live runners.
        BELOW_MAX_RUNNERS = "BelowMaxRunners" in [PoolCondition(AT_CAPACITY)];
        /// Scaling follows demand.
        NOT_LIMITED = "NotLimited" in [PoolCondition(SCALING_LIMITED)];
        /// Scale-up was capped by spec.scaling.scaleUpStep.
        SCALE_UP_STEP = "ScaleUpStep" in [PoolCondition(SCALING_LIMITED)];
        /// Scale-up was capped by spec.scaling.maxRunners.
        MAX_RUNNERS = "MaxRunners" in [PoolCondition(SCALING_LIMITED)];
        /// Minting waits out its backoff after a failed mint.
        MINT_BACKOFF = "MintBackoff" in [PoolCondition(SCALING_LIMITED)];
        /// Runner VMs keep failing before their runner starts; new VMs wait out a backoff.
        VM_START_FAILING = "VmStartFailing" in [PoolCondition(SCALING_LIMITED)];
        /// The last sweep listed every repository of the pool's scope in full.
        SWEEP_COMPLETE = "SweepComplete" in [PoolCondition(DEMAND_LISTED)];
        /// A repository of the pool's scope has more active runs than the sweep reads (its page cap): its queued jobs are known from webhooks only, and a lost delivery is not recovered.
        SWEEP_PAGE_CAP = "SweepPageCap" in [PoolCondition(DEMAND_LISTED)];
        // Runner freshness (issue 33): the runner layer's version against GitHub's.
        /// The pool's runner version is GitHub's newest, or superseded with more than 7 of its 30 days left.
        RUNNER_VERSION_CURRENT = "RunnerVersionCurrent" in [PoolCondition(RUNNER_VERSION_SUPPORTED)];
        /// A newer runner release exists and the pool's runner version has 7 days or fewer of GitHub's 30 left (the message counts them): rebuild the runner layer.
        RUNNER_VERSION_EXPIRING = "RunnerVersionExpiring" in [PoolCondition(RUNNER_VERSION_SUPPORTED)];
        /// The pool's runner version is below GitHub's minimum (2.329.0) or its 30 days are over; GitHub refuses its runners. As a Degraded reason and Event (Warning): a runner of the pool exited with code 7 (the deprecation message) while a newer version exists; minting stops until the pool's runner image or version changes. Also ScalingLimited's reason while minting is stopped.
        RUNNER_VERSION_DEPRECATED = "RunnerVersionDeprecated" in [PoolCondition(RUNNER_VERSION_SUPPORTED), PoolCondition(DEGRADED), PoolCondition(SCALING_LIMITED), PoolEvent];
        /// The pool sets no spec.github.runnerVersion, or GitHub's supported versions were not read yet: nothing to compare.
        RUNNER_VERSION_UNKNOWN = "RunnerVersionUnknown" in [PoolCondition(RUNNER_VERSION_SUPPORTED)];
        /// Warning: GitHub refused a runner of the pool as deprecated although it runs GitHub's newest version: an outage or rollback at GitHub, not deprecation. Minting goes on with the start backoff.
        RUNNER_REFUSED_CURRENT_VERSION = "RunnerRefusedCurrentVersion" in [PoolCondition(DEGRADED), PoolEvent];
        /// No runner of the pool was refused by GitHub.
        NOT_DEGRADED = "NotDegraded" in [PoolCondition(DEGRADED)];
        /// Runner VMs were created.
        SCALED_UP = "ScaledUp" in [PoolEvent];
        /// Idle runners were retired.
        SCALED_DOWN = "ScaledDown" in [PoolEvent];
        /// Finished runner VMs were deleted.
        RUNNERS_CLEANED_UP = "RunnersCleanedUp" in [PoolEvent];
        /// Warning: minting a JIT config failed; the VM was deleted and minting backs off.
        MINT_FAILED = "MintFailed" in [PoolEvent];
        /// Warning: a runner VM failed before its runner started (the message names its reason).
        VM_START_FAILED = "VmStartFailed" in [PoolEvent];
        /// Warning: the VM's JIT Secret name is taken by a Secret the VM does not own; the VM is deleted.
        SECRET_CONFLICT = "SecretConflict" in [PoolEvent];
        /// Warning: a minted VM's JIT Secret is gone; the VM is replaced (never minted twice).
        JIT_CONFIG_LOST = "JitConfigLost" in [PoolEvent];
        /// Warning: deleting the pool could not deregister every runner in time; their VMs are deleted anyway.
        CLEANUP_TIMED_OUT = "CleanupTimedOut" in [PoolEvent];
        /// imp-runtime refused a writable drive past the node's writable-drive budget.
        DISK_BUDGET_EXCEEDED = "DiskBudgetExceeded" in [VmStatus, Runtime];
        /// imp-runtime's bring-up of a VM ended without an outcome (cancelled by a DELETE).
        START_CANCELLED = "StartCancelled" in [Runtime];
        /// imp-runtime could not create or enter a VM's memory cgroup.
        CGROUP_SETUP_FAILED = "CgroupSetupFailed" in [VmStatus, Runtime];
        /// imp-runtime's QEMU backend could not start QEMU or its vhost-device-vsock.
        QEMU_START_FAILED = "QemuStartFailed" in [VmStatus, Runtime];
        /// imp-runtime could not give a VM its own uid from the configured range (all held, or its directory unusable).
        VMM_CONFINEMENT_FAILED = "VmmConfinementFailed" in [VmStatus, Runtime];
        /// A snapshot, suspend or resume was asked of a VM whose backend cannot do it.
        SNAPSHOT_UNSUPPORTED = "SnapshotUnsupported" in [Runtime];
        /// A resume was asked of a VM that is not Suspended.
        NOT_SUSPENDED = "NotSuspended" in [Runtime];
        /// imp-runtime could not load a suspended VM's snapshot into a fresh VMM (the VM stays Suspended, its snapshot kept).
        RESUME_FAILED = "ResumeFailed" in [Runtime];
        /// imp-runtime refused a request body larger than its limit.
        BODY_TOO_LARGE = "BodyTooLarge" in [Runtime];
        /// ImpVM stays Pending / ImpNetwork not Ready: the built-in IPAM has no free address left.
        NETWORK_EXHAUSTED = "NetworkExhausted" in [VmStatus, VmCondition(SCHEDULED_C), VmEvent, NetworkCondition(NETWORK_READY)];
        /// ImpNetwork Ready: the built-in IPAM has free addresses.
        ADDRESSES_AVAILABLE = "AddressesAvailable" in [NetworkCondition(NETWORK_READY)];
        /// ImpVM stays Pending: the ImpNetwork its spec.networkRef names does not exist (yet).
        NETWORK_NOT_FOUND = "NetworkNotFound" in [VmStatus, VmCondition(SCHEDULED_C), VmEvent];
        /// ImpVM stays Pending: its ImpNetwork's subnet or gateway is unusable for the built-in IPAM.
        NETWORK_INVALID = "NetworkInvalid" in [VmStatus, VmCondition(SCHEDULED_C), VmEvent];
        // runner pool (issue 16a): deadlines and the registration reaper.
        /// Warning: a runner VM's runner started but GitHub never saw it online within the deadline; the VM is replaced and its registration deleted.
        RUNNER_NEVER_ONLINE = "RunnerNeverOnline" in [PoolEvent];
        /// Warning: a runner VM was scheduled but its runner did not start within the boot deadline; the VM is replaced and its registration deleted.
        BOOT_DEADLINE_EXCEEDED = "BootDeadlineExceeded" in [PoolEvent];
        /// GitHub runner registrations of the pool without a VM (a failed mint, a VM deleted by hand) were deleted by the reaper.
        ORPHAN_RUNNERS_DELETED = "OrphanRunnersDeleted" in [PoolEvent];
        /// Warning: the pool is deleted after its App Secret: its runner registrations cannot be deleted and stay at GitHub until removed by hand.
        REGISTRATIONS_ABANDONED = "RegistrationsAbandoned" in [PoolEvent];
        // agent (issue 15): the handoff's binding rule, guest containment, lifecycle Events.
        /// The Secret spec.runnerConfigSecret names is not controlled by this VM (owner reference uid); it is left untouched.
        RUNNER_CONFIG_NOT_OWNED = "RunnerConfigNotOwned" in [VmStatus, VmEvent];
        /// The Secret spec.runnerConfigSecret names lacks Imp's JIT label; it is left untouched.
        RUNNER_CONFIG_NOT_JIT = "RunnerConfigNotJit" in [VmStatus, VmEvent];
        /// A VM naming a runnerConfigSecret is not controlled by an ImpVMRunnerPool; no config is handed to it.
        RUNNER_VM_NOT_POOLED = "RunnerVmNotPooled" in [VmStatus, VmEvent];
        /// The VM's image, runnerImage, classRef, networkRef or imagePullSecrets differ from what its JIT config was minted for (the Secret's boot digest); no config is handed to it.
        RUNNER_VM_CHANGED = "RunnerVmChanged" in [VmStatus, VmEvent];
        /// The guest sent more unsolicited frames than a connection allows; the agent disconnected it.
        GUEST_BUDGET_EXCEEDED = "GuestBudgetExceeded" in [VmStatus, VmEvent];
        /// The guest did not answer a re-query of its runner within the answer timeout.
        GUEST_UNRESPONSIVE = "GuestUnresponsive" in [VmStatus, VmEvent];
        /// imp-agent asked imp-runtime to boot the VM.
        BOOT_REQUESTED = "BootRequested" in [VmEvent];
        /// The VM runs and its guest agent answered.
        VM_RUNNING = "VmRunning" in [VmEvent];
        /// The runner config was handed to the guest and the runner started; the JIT Secret is deleted.
        HANDED_OFF = "HandedOff" in [VmEvent];
        /// Warning: the VM failed on this node (the message names its reason).
        VM_FAILED = "VmFailed" in [VmEvent];
        /// The runner exited (the message has its exit code).
        RUNNER_FINISHED = "RunnerFinished" in [VmEvent];
        /// imp-agent released the VM's process, TAP, address and disk in imp-runtime.
        TORN_DOWN_ON_NODE = "TornDownOnNode" in [VmEvent];
        // agent (issue 19): suspend, resume and ScaleToZero (docs/suspend.md).
        /// desiredState is Suspended: the agent suspends the VM (snapshot, VMM stopped, disks and address kept).
        SUSPEND_REQUESTED = "SuspendRequested" in [VmCondition(condition::SUSPENDED), VmEvent];
        /// ScaleToZero: the VM's TAP byte counters did not move for idleTimeout; the agent suspends it.
        IDLE_TIMEOUT = "IdleTimeout" in [VmCondition(condition::SUSPENDED), VmEvent];
        /// imp-runtime reports the VM suspended (phase Suspended); Ready=False until it is resumed.
        VM_SUSPENDED = "VmSuspended" in [VmCondition(READY), VmEvent];
        /// desiredState is Running again: the agent resumes the suspended VM.
        RESUME_REQUESTED = "ResumeRequested" in [VmCondition(condition::SUSPENDED), VmEvent];
        /// ScaleToZero: packets were sent to the suspended VM's address; the agent resumes it (the sender retransmits).
        WOKEN_BY_TRAFFIC = "WokenByTraffic" in [VmCondition(condition::SUSPENDED), VmEvent];
        /// The suspended VM runs again (phase Running); the message has the time the resume took.
        VM_RESUMED = "VmResumed" in [VmEvent];
        /// Warning: an ephemeral or runner VM asked for Suspended or ScaleToZero; it is never suspended and keeps running.
        SUSPEND_NOT_ALLOWED = "SuspendNotAllowed" in [VmCondition(condition::SUSPENDED), VmEvent];
        /// Warning: the VM asks for ScaleToZero but its node's agent runs without IMP_SCALE_TO_ZERO=true; it keeps running.
        SCALE_TO_ZERO_DISABLED = "ScaleToZeroDisabled" in [VmCondition(condition::SUSPENDED), VmEvent];
        /// Warning: imp-runtime refused or failed a suspend or resume call (the message has its error); a VM whose suspend failed runs on, and the agent retries with a backoff.
        SUSPEND_CALL_FAILED = "SuspendCallFailed" in [VmCondition(condition::SUSPENDED), VmEvent];
        /// Ready=False: the class's readiness probe failed failureThreshold times in a row inside the guest.
        READINESS_PROBE_FAILED = "ReadinessProbeFailed" in [VmCondition(READY), VmEvent];
        /// Ready=True again: the class's readiness probe passed after failing.
        READINESS_PROBE_PASSED = "ReadinessProbePassed" in [VmCondition(READY), VmEvent];
        /// Warning: a VM claims the pool (label, owner reference) but its spec is not the pool's template; deleted, never minted for.
        FOREIGN_RUNNER_VM = "ForeignRunnerVm" in [PoolEvent];
        // operator (issue 19): the memory-pressure lifecycle (pressureLifecycle.enabled).
        /// The VM's node reports MemoryPressure: the operator set spec.desiredState to Suspended (largest resident VM first); it is never resumed automatically.
        SUSPENDED_FOR_MEMORY_PRESSURE = "SuspendedForMemoryPressure" in [VmCondition(condition::PRESSURE_SUSPENDED), VmEvent];
        /// Warning: a VM suspended for memory pressure did not reach Suspended in time; the lifecycle moves on to the next VM on the node.
        PRESSURE_SUSPEND_STALLED = "PressureSuspendStalled" in [VmCondition(condition::PRESSURE_SUSPENDED), VmEvent];
        /// spec.desiredState is no longer Suspended after a memory-pressure suspend (someone resumed the VM); it is not suspended again while that pressure lasts.
        PRESSURE_SUSPEND_LIFTED = "PressureSuspendLifted" in [VmCondition(condition::PRESSURE_SUSPENDED), VmEvent];
    }

    /// docs/reasons.md: one table row per reason, in [`ALL`]'s order.
    pub fn markdown() -> String {
        let mut out = String::from(
            "# Reasons\n\n\
             <!-- Generated by `make reasons` (`cargo run -p imp-api --bin reasondoc`) from \
             api/src/names.rs; do not edit. -->\n\n\
             Every reason Imp writes: ImpVM `status.reason`, condition reasons, Kubernetes Event reasons and \
             imp-runtime API errors. They are stable: alerts and runbooks key on them. In code each is a \
             constant in `imp_api::names::reason`.\n\n\
             | Reason | Where it appears | When it is used |\n\
             |---|---|---|\n",
        );
        for r in ALL {
            let sites: Vec<String> = r.sites.iter().map(|s| s.describe()).collect();
            out.push_str(&format!(
                "| `{}` | {} | {} |\n",
                r.value,
                sites.join("; "),
                r.doc
            ));
        }
        out
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::collections::BTreeSet;

        fn screaming_snake(camel: &str) -> String {
            let mut out = String::new();
            for (i, ch) in camel.chars().enumerate() {
                if ch.is_ascii_uppercase() && i > 0 {
                    out.push('_');
                }
                out.push(ch.to_ascii_uppercase());
            }
            out
        }

        #[test]
        fn each_constant_is_named_after_its_value() {
            for r in ALL {
                assert_eq!(r.name, screaming_snake(r.value), "{r:?}");
            }
            assert_eq!(screaming_snake("VmStartFailed"), "VM_START_FAILED");
        }

        #[test]
        fn values_are_unique_camel_case_and_documented() {
            let mut seen = BTreeSet::new();
            for r in ALL {
                assert!(seen.insert(r.value), "{} listed twice", r.value);
                assert!(
                    r.value.starts_with(|c: char| c.is_ascii_uppercase()),
                    "{r:?}"
                );
                assert!(r.value.chars().all(|c| c.is_ascii_alphanumeric()), "{r:?}");
                assert!(!r.doc.is_empty() && !r.doc.contains('\n'), "{r:?}");
                assert!(!r.sites.is_empty(), "{r:?}");
            }
        }

        #[test]
        fn the_table_carries_the_constants_and_their_docs() {
            let r = ALL.iter().find(|r| r.value == ROOTFS_REJECTED).unwrap();
            assert_eq!(r.name, "ROOTFS_REJECTED");
            assert!(r.doc.starts_with("The image broke"), "{}", r.doc);
            assert_eq!(r.sites, &[Site::VmStatus, Site::Runtime]);
            assert_eq!(
                ALL.iter().find(|r| r.value == MINTED).unwrap().sites,
                &[Site::PoolCondition(condition::CREDENTIALS_VALID)]
            );
        }

        #[test]
        fn markdown_has_a_row_per_reason() {
            let md = markdown();
            let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| `")).collect();
            assert_eq!(rows.len(), ALL.len());
            assert!(
                rows.contains(&"| `Minted` | ImpVMRunnerPool condition `CredentialsValid` | A JIT runner config was minted with the App credentials. |"),
                "{md}"
            );
            assert!(
                rows.contains(&"| `GuestExited` | ImpVM `status.reason`; imp-runtime API error | The VM's process ended while the VM was Running, with no runner exit code to report. |"),
                "{md}"
            );
        }

        #[test]
        fn sites_describe_themselves() {
            assert_eq!(
                Site::VmCondition(condition::READY).describe(),
                "ImpVM condition `Ready`"
            );
            assert_eq!(
                Site::PoolCondition(condition::AT_CAPACITY).describe(),
                "ImpVMRunnerPool condition `AtCapacity`"
            );
            assert_eq!(Site::VmStatus.describe(), "ImpVM `status.reason`");
        }
    }
}
