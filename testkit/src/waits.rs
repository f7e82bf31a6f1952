//! Waits on the objects a test drives: poll until a predicate holds, and on timeout panic with the
//! last status seen plus the caller's context (log tails), so a failure says where the object
//! stopped.

use std::time::{Duration, Instant};

use imp_api::{ImpVM, VmPhase};
use kube::Api;

/// How often a wait reads the object again.
const POLL: Duration = Duration::from_millis(50);

/// Polls ImpVM `name` until `pred` holds and returns it; after `within` panics naming `what`, with
/// the last status seen and `context()` (e.g. the agent's log tail) appended.
pub async fn wait_vm(
    vms: &Api<ImpVM>,
    name: &str,
    what: &str,
    within: Duration,
    pred: impl Fn(&ImpVM) -> bool,
    context: impl FnOnce() -> String,
) -> ImpVM {
    let started = Instant::now();
    loop {
        let vm = vms.get(name).await.unwrap();
        if pred(&vm) {
            return vm;
        }
        if started.elapsed() > within {
            panic!(
                "{name}: not {what} after {within:?}; last status: {:#?}{}",
                vm.status,
                context()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The VM's phase, if its status has one.
pub fn phase_of(vm: &ImpVM) -> Option<VmPhase> {
    vm.status.as_ref().and_then(|s| s.phase)
}
