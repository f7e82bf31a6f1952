//! What a runner VM is doing, from its ImpVM alone plus the pool's busy runner names (jobs in
//! progress). Pure; see docs/runner-pool.md for the table.

use std::collections::HashSet;

use imp_api::{HandoffState, ImpVM, VmPhase};

/// The state of one runner VM of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunnerState {
    /// No JIT config yet (`spec.runnerConfigSecret` unset): the pool has to mint one.
    Unminted,
    /// Minted, not yet registered and waiting: scheduling, booting, handoff in flight.
    Booting,
    /// The runner process started (handoff Started) and no job of the pool runs on it.
    Idle,
    /// A job in progress names this runner.
    Busy,
    /// The VM's run is over (Succeeded/Failed/RetryExhausted, or the runner exited / the handoff
    /// was ambiguous): clean it up.
    Terminal,
    /// Deletion requested; not counted.
    Deleting,
}

impl RunnerState {
    pub fn as_str(self) -> &'static str {
        match self {
            RunnerState::Unminted => "unminted",
            RunnerState::Booting => "booting",
            RunnerState::Idle => "idle",
            RunnerState::Busy => "busy",
            RunnerState::Terminal => "terminal",
            RunnerState::Deleting => "deleting",
        }
    }
}

/// Classifies a runner VM. `runner_name` is the GitHub runner name recorded for the VM (if minted).
pub fn classify(
    vm: &ImpVM,
    runner_name: Option<&str>,
    busy_runners: &HashSet<String>,
) -> RunnerState {
    if vm.metadata.deletion_timestamp.is_some() {
        return RunnerState::Deleting;
    }
    let status = vm.status.as_ref();
    let phase = status.and_then(|s| s.phase);
    if matches!(
        phase,
        Some(VmPhase::Succeeded | VmPhase::Failed | VmPhase::RetryExhausted)
    ) {
        return RunnerState::Terminal;
    }
    let handoff = status
        .and_then(|s| s.runner.as_ref())
        .and_then(|r| r.handoff);
    match handoff {
        Some(HandoffState::Exited | HandoffState::Ambiguous) => return RunnerState::Terminal,
        Some(HandoffState::Started) => {
            // Busy wins even if the phase lags (the job's webhook may beat the status write).
            return if runner_name.is_some_and(|n| busy_runners.contains(n)) {
                RunnerState::Busy
            } else {
                RunnerState::Idle
            };
        }
        Some(HandoffState::Sent) | None => {}
    }
    if runner_name.is_some_and(|n| busy_runners.contains(n)) {
        // GitHub says the runner took a job before the agent recorded Started.
        return RunnerState::Busy;
    }
    if vm.spec.runner_config_secret.is_none() {
        return RunnerState::Unminted;
    }
    RunnerState::Booting
}

/// The VM failed before its runner ever started (no handoff recorded): the image, the kernel or
/// the node is broken, and a replacement would likely fail the same way. Returns the failure
/// reason. A VM whose handoff began (Sent, Ambiguous) or whose runner ran is not a start failure.
pub fn start_failure(vm: &ImpVM) -> Option<String> {
    let status = vm.status.as_ref()?;
    let failed = matches!(
        status.phase,
        Some(VmPhase::Failed | VmPhase::RetryExhausted)
    );
    let handed_off = status.runner.as_ref().and_then(|r| r.handoff).is_some();
    (failed && !handed_off).then(|| status.reason.clone().unwrap_or_else(|| "Unknown".into()))
}

/// The runner process started on this VM: the pool's VMs can start.
pub fn runner_started(vm: &ImpVM) -> bool {
    matches!(
        vm.status
            .as_ref()
            .and_then(|s| s.runner.as_ref())
            .and_then(|r| r.handoff),
        Some(HandoffState::Started | HandoffState::Exited)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_api::{ImpVMStatus, RunnerStatus, names::reason};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::json;

    fn vm(secret: bool, phase: Option<VmPhase>, handoff: Option<HandoffState>) -> ImpVM {
        let mut vm: ImpVM = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "p-x", "namespace": "ns", "uid": "u"},
            "spec": {"classRef": {"name": "c"}, "image": "i", "lifecycle": "ephemeral"}
        }))
        .unwrap();
        if secret {
            vm.spec.runner_config_secret = Some("impvm-u-jit".into());
        }
        vm.status = Some(ImpVMStatus {
            phase,
            runner: handoff.map(|h| RunnerStatus {
                handoff: Some(h),
                ..Default::default()
            }),
            ..Default::default()
        });
        vm
    }

    fn busy(names: &[&str]) -> HashSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn table() {
        use HandoffState::*;
        use RunnerState as R;
        use VmPhase::*;
        let none = busy(&[]);
        let mine = busy(&["p-u"]);
        let cases: Vec<(ImpVM, &HashSet<String>, R)> = vec![
            (vm(false, None, None), &none, R::Unminted),
            (vm(false, Some(Pending), None), &none, R::Unminted),
            (vm(true, Some(Scheduled), None), &none, R::Booting),
            (vm(true, Some(Starting), None), &none, R::Booting),
            (vm(true, Some(Running), None), &none, R::Booting),
            (vm(true, Some(Running), Some(Sent)), &none, R::Booting),
            (vm(true, Some(Running), Some(Started)), &none, R::Idle),
            (vm(true, Some(Running), Some(Started)), &mine, R::Busy),
            (vm(true, Some(Starting), Some(Sent)), &mine, R::Busy),
            (vm(true, Some(Running), Some(Exited)), &none, R::Terminal),
            (vm(true, Some(Running), Some(Ambiguous)), &none, R::Terminal),
            (vm(true, Some(Succeeded), Some(Exited)), &mine, R::Terminal),
            (vm(true, Some(Failed), None), &none, R::Terminal),
            (vm(false, Some(RetryExhausted), None), &none, R::Terminal),
        ];
        for (i, (v, b, want)) in cases.into_iter().enumerate() {
            assert_eq!(classify(&v, Some("p-u"), b), want, "case {i}");
        }
        let mut deleting = vm(true, Some(Running), Some(Started));
        deleting.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        assert_eq!(classify(&deleting, Some("p-u"), &mine), R::Deleting);
        // Start failures: failed before any handoff.
        let mut failed = vm(true, Some(Failed), None);
        failed.status.as_mut().unwrap().reason = Some(reason::ROOTFS_REJECTED.into());
        assert_eq!(
            start_failure(&failed).as_deref(),
            Some(reason::ROOTFS_REJECTED)
        );
        assert_eq!(
            start_failure(&vm(false, Some(RetryExhausted), None)).as_deref(),
            Some("Unknown")
        );
        for not in [
            vm(true, Some(Failed), Some(Ambiguous)),
            vm(true, Some(Failed), Some(Exited)),
            vm(true, Some(Succeeded), Some(Exited)),
            vm(true, Some(Running), None),
            vm(true, None, None),
        ] {
            assert_eq!(start_failure(&not), None);
        }
        assert!(runner_started(&vm(true, Some(Running), Some(Started))));
        assert!(runner_started(&vm(true, Some(Succeeded), Some(Exited))));
        assert!(!runner_started(&vm(true, Some(Running), Some(Sent))));
        assert!(!runner_started(&failed));
        // Without a recorded runner name a VM can only be idle, never busy.
        assert_eq!(
            classify(&vm(true, Some(Running), Some(Started)), None, &mine),
            R::Idle
        );
    }
}
