//! What every part of the agent's VM loop shares, one floor below the modules that use it: the
//! [`Context`] (clients, settings, metrics, Event recorder, the per-VM tasks), the crate's
//! [`Error`], the guest connection ([`connect`]), the runtime's answer as decision facts
//! ([`runtime_facts`]) and the one failure write every path uses ([`Context::fail`]). It starts
//! nothing itself: the controller spawns the tasks and hands their handles here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use imp_api::ImpVM;
use imp_api::names::{self, reason as api_reason};
use imp_guest::host::{self, HostClient, HostError};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::task::JoinHandle;
use tracing::warn;

use super::config::AgentConfig;
use super::decide::{InFlight, RuntimeFacts};
use super::handoff;
use super::metrics::AgentMetrics;
use super::status::{self, Guard, Written};
use super::suspend;
use imp_runtime_api::api::VmState;
use imp_runtime_api::client::{ClientError, RuntimeClient};

const GUEST_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// The agent's one error type. Variants say which boundary failed; [`Error::metric_label`] gives
/// each a stable label for `imp_agent_reconcile_errors_total{error}`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("imp-runtime: {0}")]
    Runtime(#[from] ClientError),
    #[error("guest: {0}")]
    Guest(#[from] HostError),
    #[error("object has no {0}")]
    Missing(&'static str),
    /// The runner task met a step answer the handoff machine does not know (a bug, not a state).
    #[error(transparent)]
    Handoff(#[from] handoff::InvalidTransition),
}

impl Error {
    /// A short, stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube_api",
            Error::Runtime(_) => "runtime_api",
            Error::Guest(_) => "guest",
            Error::Missing(_) => "missing_object_key",
            Error::Handoff(_) => "handoff",
        }
    }
}

pub struct Context {
    pub client: Client,
    pub config: AgentConfig,
    pub runtime: RuntimeClient,
    pub metrics: AgentMetrics,
    recorder: Recorder,
    tasks: Mutex<HashMap<String, (InFlight, JoinHandle<()>)>>,
    /// Per Running VM: probes and guest metrics (the monitor task), beside the runner task.
    monitors: Mutex<HashMap<String, JoinHandle<()>>>,
    /// ScaleToZero's idle clocks and wake counters.
    pub sleep: Mutex<suspend::Memory>,
    /// Reconciles every bound VM when sent to (a wake was seen, a suspend or resume finished).
    kick: futures::channel::mpsc::UnboundedSender<()>,
    kicks: Mutex<Option<futures::channel::mpsc::UnboundedReceiver<()>>>,
}

impl Context {
    pub fn new(client: Client, config: AgentConfig, metrics: AgentMetrics) -> Arc<Self> {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: names::MANAGER_AGENT.into(),
                instance: Some(config.node_name.clone()),
            },
        );
        let (kick, kicks) = futures::channel::mpsc::unbounded();
        Arc::new(Self {
            sleep: Mutex::new(suspend::Memory::default()),
            kick,
            kicks: Mutex::new(Some(kicks)),
            runtime: RuntimeClient::new(&config.runtime_socket),
            recorder,
            client,
            config,
            metrics,
            tasks: Mutex::new(HashMap::new()),
            monitors: Mutex::new(HashMap::new()),
        })
    }

    /// An Event on `vm`. Best effort: a lost Event never fails the lifecycle it reports.
    pub async fn event(&self, vm: &ImpVM, warning: bool, reason: &str, note: String) {
        let ev = imp_api::events::event(warning, reason, note);
        if let Err(e) = self.recorder.publish(&ev, &vm.object_ref(&())).await {
            warn!(vm = %vm.name_any(), reason, error = %e, "publishing Event failed");
        }
    }

    /// The work this agent has in flight for `uid` (a finished task is forgotten).
    pub fn in_flight(&self, uid: &str) -> Option<InFlight> {
        let mut tasks = self.tasks.lock().unwrap();
        match tasks.get(uid) {
            Some((_, h)) if h.is_finished() => {
                tasks.remove(uid);
                None
            }
            Some((kind, _)) => Some(*kind),
            None => None,
        }
    }

    /// Asks for a reconcile of every bound VM soon.
    pub fn kick(&self) {
        let _ = self.kick.unbounded_send(());
    }

    /// The receiving end of [`Context::kick`], once (the controller's trigger stream).
    pub fn take_kicks(&self) -> Option<futures::channel::mpsc::UnboundedReceiver<()>> {
        self.kicks.lock().unwrap().take()
    }

    /// Ends `uid`'s monitor (a suspended guest answers no probes); the next Running restarts it.
    pub fn stop_monitor(&self, uid: &str) {
        if let Some(h) = self.monitors.lock().unwrap().remove(uid) {
            h.abort();
        }
    }

    /// Aborts `uid`'s task and monitor.
    pub fn abort(&self, uid: &str) {
        if let Some((_, h)) = self.tasks.lock().unwrap().remove(uid) {
            h.abort();
        }
        self.stop_monitor(uid);
    }

    /// Keeps `uid`'s monitor running: `start` is called (and its task kept) unless one runs.
    pub fn ensure_monitor(&self, uid: &str, start: impl FnOnce() -> JoinHandle<()>) {
        let mut monitors = self.monitors.lock().unwrap();
        if monitors.get(uid).is_some_and(|h| !h.is_finished()) {
            return;
        }
        monitors.insert(uid.to_owned(), start());
    }

    /// Runs `fut` as `uid`'s task of kind `kind` ([`Context::in_flight`] reports it meanwhile).
    pub fn spawn(
        &self,
        uid: &str,
        kind: InFlight,
        fut: impl Future<Output = Result<(), Error>> + Send + 'static,
    ) {
        let uid_owned = uid.to_owned();
        let handle = tokio::spawn(async move {
            if let Err(e) = fut.await {
                warn!(uid = %uid_owned, error = %e, "{kind:?} task failed; the next reconcile retries");
            }
        });
        self.tasks
            .lock()
            .unwrap()
            .insert(uid.to_owned(), (kind, handle));
    }

    /// Phase Failed with `reason`, if `guard` admits the VM; counted and announced (Warning
    /// Event `VmFailed`) when written.
    pub async fn fail(
        &self,
        api: &Api<ImpVM>,
        name: &str,
        reason: &str,
        message: &str,
        guard: Guard,
    ) -> Result<bool, Error> {
        let written = status::update(api, name, guard, |vm, s| {
            status::mark_failed(s, reason, message, vm.metadata.generation, Timestamp::now());
            true
        })
        .await?;
        let Written::Done(vm) = written else {
            return Ok(false);
        };
        self.metrics.vm_failed(reason);
        warn!(vm = %name, reason, message, "VM failed");
        let note = format!("{reason}: {message}");
        self.event(&vm, true, api_reason::VM_FAILED, note).await;
        Ok(true)
    }
}

/// What imp-runtime's answer for a VM means to the decisions (404 = absent).
pub fn runtime_facts(
    r: Result<imp_runtime_api::api::VmStatus, ClientError>,
) -> Result<RuntimeFacts, Error> {
    match r {
        Ok(s) => Ok(match s.state {
            VmState::Creating | VmState::Booting => RuntimeFacts::Booting,
            VmState::Running => RuntimeFacts::Running,
            VmState::Suspending => RuntimeFacts::Suspending,
            VmState::Suspended => RuntimeFacts::Suspended,
            VmState::Resuming => RuntimeFacts::Resuming,
            VmState::Exited => RuntimeFacts::Exited,
            VmState::Failed => {
                let f = s.failure.unwrap_or(imp_runtime_api::api::Failure {
                    reason: api_reason::FIRECRACKER_START_FAILED.into(),
                    message: "imp-runtime recorded a failure without a reason".into(),
                });
                RuntimeFacts::Failed {
                    reason: f.reason,
                    message: f.message,
                }
            }
        }),
        Err(ClientError::Api { status, .. }) if status == http::StatusCode::NOT_FOUND => {
            Ok(RuntimeFacts::Absent)
        }
        Err(e) => Err(e.into()),
    }
}

/// A connection to `uid`'s guest agent (Hello exchanged), with the configured answer timeout.
pub async fn connect(ctx: &Context, uid: &str) -> Result<HostClient, Error> {
    let info = ctx.runtime.vsock(uid).await?;
    let deadline = tokio::time::Instant::now() + GUEST_CONNECT_TIMEOUT;
    let mut client = host::connect(&info.path, info.guest_agent_port, deadline).await?;
    client.set_answer_timeout(ctx.config.guest_answer_timeout);
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_labels_are_stable() {
        let kube = Error::Kube(kube::Error::Service("down".into()));
        assert_eq!(kube.metric_label(), "kube_api");
        assert_eq!(
            Error::Missing(".metadata.uid").metric_label(),
            "missing_object_key"
        );
        let guest = Error::Guest(HostError::NoAnswer {
            request: "exec",
            after: Duration::from_secs(1),
        });
        assert_eq!(guest.metric_label(), "guest");
        let runtime = Error::Runtime(ClientError::Connect {
            path: "/run/imp/runtime.sock".into(),
            source: std::io::ErrorKind::NotFound.into(),
        });
        assert_eq!(runtime.metric_label(), "runtime_api");
    }
}
