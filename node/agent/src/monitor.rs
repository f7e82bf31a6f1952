//! While a VM runs: the class's readiness probe (HttpProbe over vsock every `periodSeconds`,
//! Ready=False after `failureThreshold` consecutive failures, True again on the next pass) and
//! the guest's metrics (every `guest_metrics_interval`), on a connection of its own beside the
//! runner's. [`Readiness`] is the pure part; [`run`] the executor, one task per Running VM.

use std::time::Duration;

use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{condition, reason};
use imp_api::{ImpVM, ImpVMClass, Probe, VmPhase};
use imp_guest::host::HostClient;
use imp_guest::protocol::{HttpProbe, ProbeResult};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, ResourceExt};
use tracing::{debug, info};

use super::context::{Context, connect};
use super::metrics::GuestLabels;
use super::status::{self, Guard, Written};

/// Whether a probe answer passes: an HTTP status 2xx or 3xx.
pub fn passed(r: &ProbeResult) -> bool {
    r.status.is_some_and(|s| (200..400).contains(&s))
}

/// What a probe outcome changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    None,
    /// Ready turns True again.
    Ready,
    /// Ready turns False after this many consecutive failures.
    Unready {
        failures: u32,
    },
}

/// Consecutive-failure counting over probe outcomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    threshold: u32,
    failures: u32,
    ready: bool,
}

impl Readiness {
    /// Starting from the Ready condition as it stands (`ready`).
    pub fn new(threshold: u32, ready: bool) -> Self {
        Self {
            threshold: threshold.max(1),
            failures: 0,
            ready,
        }
    }

    pub fn observe(&mut self, ok: bool) -> Change {
        if ok {
            self.failures = 0;
            if self.ready {
                return Change::None;
            }
            self.ready = true;
            return Change::Ready;
        }
        self.failures = self.failures.saturating_add(1);
        if self.ready && self.failures >= self.threshold {
            self.ready = false;
            return Change::Unready {
                failures: self.failures,
            };
        }
        Change::None
    }
}

/// Removes the VM's guest series when the monitor ends, however it ends (aborted included).
struct Series<'a> {
    ctx: &'a Context,
    labels: GuestLabels,
}

impl Drop for Series<'_> {
    fn drop(&mut self) {
        self.ctx.metrics.forget_guest(&self.labels);
    }
}

fn still_running(vm: Option<&ImpVM>, uid: &str) -> bool {
    vm.is_some_and(|vm| {
        vm.uid().as_deref() == Some(uid)
            && vm.metadata.deletion_timestamp.is_none()
            && vm.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Running)
    })
}

/// Monitors `vm` until it leaves Running (or is gone).
pub async fn run(ctx: &Context, api: &Api<ImpVM>, vm: ImpVM) {
    let name = vm.name_any();
    let Some(uid) = vm.uid() else { return };
    let classes: Api<ImpVMClass> = Api::all(ctx.client.clone());
    let probe: Option<Probe> = match classes.get_opt(&vm.spec.class_ref.name).await {
        Ok(c) => c
            .and_then(|c| c.spec.probes)
            .and_then(|p| p.readiness_probe),
        Err(e) => {
            debug!(vm = %name, error = %e, "reading the class failed; the next reconcile retries");
            return;
        }
    };
    let ready_now = vm
        .status
        .as_ref()
        .is_some_and(|s| conditions::is_true(&s.conditions, condition::READY));
    let mut readiness = probe
        .as_ref()
        .map(|p| Readiness::new(p.failure_threshold(), ready_now));
    let series = Series {
        ctx,
        labels: GuestLabels {
            vm: name.clone(),
            namespace: vm.namespace().unwrap_or_default(),
            node: ctx.config.node_name.clone(),
        },
    };
    let period = probe
        .as_ref()
        .map(|p| Duration::from_secs(u64::from(p.period_seconds())));
    let metrics_every = ctx.config.guest_metrics_interval;
    let start = tokio::time::Instant::now();
    let (mut next_probe, mut next_metrics) = (start, start);
    let mut client: Option<HostClient> = None;
    loop {
        let due = match period {
            Some(_) => next_probe.min(next_metrics),
            None => next_metrics,
        };
        tokio::time::sleep_until(due).await;
        match api.get_opt(&name).await {
            Ok(now) if still_running(now.as_ref(), &uid) => {}
            Ok(_) => return,
            Err(e) => {
                debug!(vm = %name, error = %e, "re-reading the VM failed");
                continue;
            }
        }
        if client.is_none() {
            client = connect(ctx, &uid).await.ok();
        }
        let now = tokio::time::Instant::now();
        if now >= next_metrics {
            next_metrics = now + metrics_every;
            if let Some(c) = client.as_mut() {
                match c.metrics().await {
                    Ok(m) => {
                        ctx.metrics
                            .guest(&series.labels, m.memory_used_bytes, m.disk_used_bytes)
                    }
                    Err(e) => {
                        debug!(vm = %name, error = %e, "guest metrics failed; reconnecting");
                        client = None;
                    }
                }
            }
        }
        let (Some(p), Some(period), Some(r)) = (&probe, period, readiness.as_mut()) else {
            continue;
        };
        if now < next_probe {
            continue;
        }
        next_probe = now + period;
        let req = HttpProbe {
            path: p.http.path.clone(),
            port: p.http.port,
            timeout_ms: u64::from(p.timeout_seconds()) * 1000,
        };
        let (ok, detail) = match client.as_mut() {
            None => (false, "no connection to the guest agent".to_owned()),
            Some(c) => match c.probe(req).await {
                Ok(res) => {
                    let detail = match (res.status, &res.error) {
                        (Some(s), _) => format!("HTTP {s}"),
                        (None, Some(e)) => imp_api::untrusted::guest_text(e),
                        (None, None) => "no answer".into(),
                    };
                    (passed(&res), detail)
                }
                Err(e) => {
                    client = None;
                    (false, imp_api::untrusted::guest_text(&e.to_string()))
                }
            },
        };
        let change = r.observe(ok);
        if change != Change::None {
            write_ready(ctx, api, &name, change, &p.http.path, &detail).await;
        }
    }
}

async fn write_ready(
    ctx: &Context,
    api: &Api<ImpVM>,
    name: &str,
    change: Change,
    path: &str,
    detail: &str,
) {
    let (status_, why, msg) = match change {
        Change::None => return,
        Change::Ready => (
            ConditionStatus::True,
            reason::READINESS_PROBE_PASSED,
            format!("readiness probe {path} passed ({detail})"),
        ),
        Change::Unready { failures } => (
            ConditionStatus::False,
            reason::READINESS_PROBE_FAILED,
            format!("readiness probe {path} failed {failures} times in a row (last: {detail})"),
        ),
    };
    let written = status::update(api, name, Guard::RUNNING, |vm, s| {
        conditions::set(
            &mut s.conditions,
            condition::READY,
            status_,
            why,
            &msg,
            vm.metadata.generation,
            Timestamp::now(),
        );
        true
    })
    .await;
    match written {
        Ok(Written::Done(vm)) => {
            info!(vm = %name, reason = why, "{msg}");
            let warning = status_ == ConditionStatus::False;
            ctx.event(&vm, warning, why, msg).await;
        }
        Ok(Written::Refused) => {}
        Err(e) => debug!(vm = %name, error = %e, "writing Ready failed; the next probe retries"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flips_after_threshold_consecutive_failures_and_back_on_success() {
        let mut r = Readiness::new(3, true);
        assert_eq!(r.observe(false), Change::None);
        assert_eq!(r.observe(false), Change::None);
        assert_eq!(r.observe(false), Change::Unready { failures: 3 });
        assert_eq!(
            r.observe(false),
            Change::None,
            "only the transition is reported"
        );
        assert_eq!(r.observe(true), Change::Ready);
        assert_eq!(r.observe(true), Change::None);
    }

    #[test]
    fn a_success_resets_the_count() {
        let mut r = Readiness::new(2, true);
        assert_eq!(r.observe(false), Change::None);
        assert_eq!(r.observe(true), Change::None);
        assert_eq!(r.observe(false), Change::None);
        assert_eq!(r.observe(false), Change::Unready { failures: 2 });
    }

    #[test]
    fn starting_unready_the_first_pass_is_a_change_and_zero_threshold_means_one() {
        let mut r = Readiness::new(0, false);
        assert_eq!(r.observe(true), Change::Ready);
        assert_eq!(r.observe(false), Change::Unready { failures: 1 });
    }

    #[test]
    fn pass_is_2xx_or_3xx() {
        let res = |status: Option<u16>| ProbeResult {
            status,
            error: None,
        };
        assert!(passed(&res(Some(200))) && passed(&res(Some(302))));
        assert!(!passed(&res(Some(500))) && !passed(&res(Some(404))) && !passed(&res(None)));
    }
}
