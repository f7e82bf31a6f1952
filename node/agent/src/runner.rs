//! The executor of [`handoff`]'s steps: one task per runner VM, from the handoff recorded in
//! status to the runner's exit. [`run`] is a loop: perform the state's step, report what it found
//! out, let [`handoff::next`] choose the next step. Which step follows which is nowhere here.
//!
//! I/O errors (Kubernetes, imp-runtime, a guest connection before the config left the host) end
//! the task; the next reconcile starts a new one from the recorded state. A guest that breaks its
//! contract (floods the connection, or stops answering) fails the VM with its own reason.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{self, condition, reason as api_reason};
use imp_api::{ImpVM, Lifecycle, RunnerStatus, VmPhase};
use imp_common::{Backoff, SecretString};
use imp_guest::host::{HostClient, HostError};
use imp_guest::protocol::{ErrorCode, Exec};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, ResourceExt, api::DeleteParams};
use tracing::{debug, info, warn};

use super::binding;
use super::context::{Context, Error, connect, runtime_facts};
use super::decide::RuntimeFacts;
use super::handoff::{self, Exit, Fact, Handoff, Step};
use super::status::{self, Guard, Written};

/// The env var actions/runner reads its JIT config from.
pub const JITCONFIG_ENV: &str = "ACTIONS_RUNNER_INPUT_JITCONFIG";
const EXEC_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Between attempts of a write that must not be given up (Started, the Secret delete).
const WRITE_RETRY: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
/// Before a broken wait for the runner's exit asks the runtime whether the VM still runs.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);

/// Runs `vm`'s handoff from the state its status records until the run is over.
pub async fn run(ctx: &Context, api: &Api<ImpVM>, vm: ImpVM) -> Result<(), Error> {
    let name = vm.name_any();
    match drive(ctx, api, vm).await {
        Err(e) if let Some(reason) = guest_breach(&e) => {
            let msg = e.to_string();
            ctx.fail(api, &name, reason, &msg, Guard::RUNNING).await?;
            Ok(())
        }
        r => r,
    }
}

async fn drive(ctx: &Context, api: &Api<ImpVM>, vm: ImpVM) -> Result<(), Error> {
    let recorded = vm
        .status
        .as_ref()
        .and_then(|s| s.runner.as_ref())
        .and_then(|r| r.handoff);
    let mut run = Run::new(ctx, api, vm)?;
    let mut state = handoff::start(Handoff::from_status(recorded));
    while let Some(fact) = run.perform(&state.step).await? {
        state = handoff::next(&state, &fact)?;
    }
    Ok(())
}

/// A guest that broke its contract (flooded the connection, or stopped answering): Failed with
/// the guest's reason. `None` for errors that are no such breach.
fn guest_breach(e: &Error) -> Option<&'static str> {
    match e {
        Error::Guest(HostError::BudgetExceeded { .. }) => Some(api_reason::GUEST_BUDGET_EXCEEDED),
        Error::Guest(HostError::NoAnswer { .. }) => Some(api_reason::GUEST_UNRESPONSIVE),
        _ => None,
    }
}

/// What one run holds between its steps.
struct Run<'a> {
    ctx: &'a Context,
    api: &'a Api<ImpVM>,
    vm: ImpVM,
    name: String,
    uid: String,
    secret_name: String,
    exec_id: String,
    client: Option<HostClient>,
    /// The config, from the Secret read until the Exec takes it.
    config: Option<SecretString>,
    /// The Secret's annotations (GitHub runner id and name), recorded with Sent.
    annotations: BTreeMap<String, String>,
    /// When the Secret was read: the handoff's duration runs from here to Started.
    read_at: Option<Instant>,
    /// The object as the last status write left it (the Events name it).
    written: Option<ImpVM>,
}

impl<'a> Run<'a> {
    fn new(ctx: &'a Context, api: &'a Api<ImpVM>, vm: ImpVM) -> Result<Self, Error> {
        let uid = vm.uid().ok_or(Error::Missing(".metadata.uid"))?;
        let secret_name = vm
            .spec
            .runner_config_secret
            .clone()
            .ok_or(Error::Missing("spec.runnerConfigSecret"))?;
        Ok(Self {
            ctx,
            api,
            name: vm.name_any(),
            exec_id: handoff::exec_id(&uid),
            uid,
            secret_name,
            vm,
            client: None,
            config: None,
            annotations: BTreeMap::new(),
            read_at: None,
            written: None,
        })
    }

    /// Performs `step`; `None` once the run is over.
    async fn perform(&mut self, step: &Step) -> Result<Option<Fact>, Error> {
        let fact = match step {
            Step::VerifyBinding => match binding::check_vm(&self.vm) {
                Ok(()) => Fact::Bound,
                Err(e) => unbound(&e),
            },
            Step::Connect => {
                self.client = Some(connect(self.ctx, &self.uid).await?);
                Fact::Connected
            }
            Step::ReadSecret => self.read_secret().await?,
            Step::RecordSent => self.record_sent().await?,
            Step::Exec => self.exec().await?,
            Step::RecordStarted { pid } => self.record_started(*pid).await?,
            Step::DeleteSecret { .. } => {
                delete_bound_secret(self.ctx, &self.vm).await;
                Fact::SecretDeleted
            }
            Step::AnnounceHandedOff { pid } => {
                let note = format!("runner started in the guest (pid {pid}); JIT Secret deleted");
                let vm = self.written.as_ref().unwrap_or(&self.vm);
                (self.ctx)
                    .event(vm, false, api_reason::HANDED_OFF, note)
                    .await;
                Fact::Announced
            }
            Step::Requery => {
                // Same boot (a guest reboot ends the VMM): the id is known to the guest, so this
                // re-queries the runner and never spawns. No config is sent.
                let exec = runner_exec(
                    &self.ctx.config.runner_command,
                    &self.vm,
                    &self.uid,
                    BTreeMap::new(),
                );
                let started = self.client()?.exec(exec).await?;
                info!(vm = %self.name, pid = started.pid, "reattached to the runner");
                Fact::Started { pid: started.pid }
            }
            Step::WaitExit => {
                let exec_id = self.exec_id.clone();
                match self.client()?.wait_exited(&exec_id).await {
                    Ok(e) => Fact::Exited(Exit {
                        code: e.code,
                        signal: e.signal,
                        timed_out: e.timed_out,
                    }),
                    // A guest that floods the connection is not reconnected to.
                    Err(e @ HostError::BudgetExceeded { .. }) => return Err(e.into()),
                    Err(e) => {
                        debug!(uid = %self.uid, error = %e, "lost the guest connection while waiting for the runner");
                        self.client = None;
                        Fact::ConnectionLost
                    }
                }
            }
            Step::Reconnect => {
                tokio::time::sleep(RECONNECT_PAUSE).await;
                let rt = runtime_facts(self.ctx.runtime.inspect(&self.uid).await)?;
                match rt {
                    RuntimeFacts::Running => Fact::VmRunning,
                    _ => Fact::VmEnded,
                }
            }
            Step::RecordExited(exit) => self.record_exited(*exit).await?,
            Step::DeclareAmbiguous => self.declare_ambiguous().await?,
            Step::Fail {
                reason,
                message,
                outcome,
            } => {
                self.ctx.metrics.handoff(outcome);
                let api = self.api;
                let failed = self
                    .ctx
                    .fail(api, &self.name, reason, message, Guard::RUNNING)
                    .await?;
                recorded(failed)
            }
            Step::Done => return Ok(None),
        };
        Ok(Some(fact))
    }

    fn client(&mut self) -> Result<&mut HostClient, Error> {
        self.client
            .as_mut()
            .ok_or(Error::Missing("guest connection (opened before this step)"))
    }

    /// Uncached GET of the Secret; the binding rule, Secret side.
    async fn read_secret(&mut self) -> Result<Fact, Error> {
        let ns = self.vm.namespace().unwrap_or_default();
        let secrets: Api<Secret> = Api::namespaced(self.ctx.client.clone(), &ns);
        self.read_at = Some(Instant::now());
        let secret = secrets.get_opt(&self.secret_name).await?;
        if let Some(s) = &secret
            && let Err(e) = binding::check_secret(&s.metadata, &self.uid)
                .and_then(|()| binding::check_boot(&self.vm, &self.secret_name, s.annotations()))
        {
            return Ok(unbound(&e));
        }
        self.annotations = secret
            .as_ref()
            .map(|s| s.annotations().clone())
            .unwrap_or_default();
        self.config = secret
            .and_then(|s| s.data)
            .and_then(|mut d| d.remove(names::SECRET_KEY_JITCONFIG))
            .and_then(|b| String::from_utf8(b.0).ok())
            .filter(|c| !c.is_empty())
            .map(SecretString::from);
        Ok(match self.config {
            Some(_) => Fact::ConfigRead,
            None => Fact::ConfigMissing {
                message: format!(
                    "JIT config Secret {} is missing or has no jitconfig key",
                    self.secret_name
                ),
            },
        })
    }

    /// Sent, before the config leaves the host.
    async fn record_sent(&mut self) -> Result<Fact, Error> {
        let guard = Guard::RUNNING.handoff(Handoff::NotStarted);
        let (exec_id, annotations) = (&self.exec_id, &self.annotations);
        let written = status::update(self.api, &self.name, guard, |_, s| {
            let r = runner_status(s);
            r.handoff = Handoff::Sent.to_status();
            r.exec_id = Some(exec_id.clone());
            r.sent_time = Some(Time(Timestamp::now()));
            r.runner_id = annotations
                .get(names::ANNOTATION_RUNNER_ID)
                .and_then(|v| v.parse().ok());
            r.runner_name = annotations.get(names::ANNOTATION_RUNNER_NAME).cloned();
            true
        })
        .await?;
        if matches!(written, Written::Done(_)) {
            info!(vm = %self.name, exec_id = %self.exec_id, "handoff Sent recorded; sending the Exec");
        }
        Ok(self.remember(written))
    }

    /// The Exec with the config. Only a spawn failure is a definite "not started"; a broken
    /// connection or no answer in time leaves it unknown.
    async fn exec(&mut self) -> Result<Fact, Error> {
        let config = self
            .config
            .take()
            .ok_or(Error::Missing("JIT config (read before the Exec)"))?;
        let env = BTreeMap::from([(JITCONFIG_ENV.to_owned(), config)]);
        let exec = runner_exec(&self.ctx.config.runner_command, &self.vm, &self.uid, env);
        let answer = tokio::time::timeout(EXEC_ANSWER_TIMEOUT, self.client()?.exec(exec)).await;
        Ok(match answer {
            Ok(Ok(started)) => Fact::Started { pid: started.pid },
            Ok(Err(HostError::Guest(e))) if e.code == ErrorCode::SpawnFailed => Fact::SpawnFailed {
                message: imp_api::untrusted::guest_text(&e.message),
            },
            Ok(Err(e)) => {
                warn!(vm = %self.name, error = %e, "guest connection lost after Sent: the handoff is ambiguous");
                Fact::ConnectionLost
            }
            Err(_) => {
                warn!(vm = %self.name, "no answer to the Exec within {EXEC_ANSWER_TIMEOUT:?}: the handoff is ambiguous");
                Fact::ConnectionLost
            }
        })
    }

    /// Started: retried until written, since the runner runs.
    async fn record_started(&mut self, pid: u32) -> Result<Fact, Error> {
        let (api, name) = (self.api, self.name.as_str());
        let guard = Guard::ANY.even_deleting().handoff(Handoff::Sent);
        let written = until_ok("recording Started", name, || async {
            let w = status::update(api, name, guard, |_, s| {
                let r = runner_status(s);
                r.handoff = Handoff::Started.to_status();
                r.pid = Some(i64::from(pid));
                r.started_time = Some(Time(Timestamp::now()));
                true
            })
            .await?;
            Ok::<_, Error>(w)
        })
        .await;
        self.ctx.metrics.handoff("started");
        if let Some(at) = self.read_at {
            self.ctx
                .metrics
                .handoff_duration(at.elapsed().as_secs_f64());
        }
        info!(vm = %self.name, pid, "runner Started recorded");
        Ok(self.remember(written))
    }

    /// Exited, and the phase the exit means.
    async fn record_exited(&mut self, exit: Exit) -> Result<Fact, Error> {
        let outcome = handoff::exit_outcome(exit.code, exit.signal, exit.timed_out);
        let guard = Guard::RUNNING.handoff(Handoff::Started);
        let written = status::update(self.api, &self.name, guard, |vm, s| {
            let r = runner_status(s);
            r.handoff = Handoff::Exited.to_status();
            r.exit_code = exit.code;
            r.exited_time = Some(Time(Timestamp::now()));
            match &outcome {
                Ok(()) => {
                    s.phase = Some(VmPhase::Succeeded);
                    s.reason = None;
                    s.message = Some("runner exited with code 0".into());
                }
                Err((reason, message)) => {
                    s.phase = Some(VmPhase::Failed);
                    s.reason = Some((*reason).to_owned());
                    s.message = Some(message.clone());
                }
            }
            conditions::set(
                &mut s.conditions,
                condition::READY,
                ConditionStatus::False,
                api_reason::RUNNER_EXITED,
                "",
                vm.metadata.generation,
                Timestamp::now(),
            );
            true
        })
        .await?;
        if let Written::Done(now) = &written {
            let note = match &outcome {
                Ok(()) => {
                    self.ctx.metrics.runner_exit("succeeded");
                    "runner exited with code 0".to_owned()
                }
                Err((reason, message)) => {
                    self.ctx.metrics.runner_exit("failed");
                    self.ctx.metrics.vm_failed(reason);
                    format!("{reason}: {message}")
                }
            };
            info!(vm = %self.name, code = ?exit.code, signal = ?exit.signal, "runner exited");
            (self.ctx)
                .event(now, outcome.is_err(), api_reason::RUNNER_FINISHED, note)
                .await;
        }
        Ok(self.remember(written))
    }

    /// `Sent` without `Started`: Failed HandoffAmbiguous, never replayed. The terminal phase then
    /// releases the runtime instance, which stops any runner the config may have reached.
    async fn declare_ambiguous(&mut self) -> Result<Fact, Error> {
        let guard = Guard::ANY.handoff(Handoff::Sent);
        let written = status::update(self.api, &self.name, guard, |vm, s| {
            runner_status(s).handoff = Handoff::Ambiguous.to_status();
            if !s.phase.is_some_and(|p| p.is_terminal()) {
                status::mark_failed(
                    s,
                    api_reason::HANDOFF_AMBIGUOUS,
                    "the runner config was sent but its start was never confirmed; it is not replayed",
                    vm.metadata.generation,
                    Timestamp::now(),
                );
            }
            true
        })
        .await?;
        if let Written::Done(now) = &written {
            self.ctx.metrics.handoff("ambiguous");
            self.ctx.metrics.vm_failed(api_reason::HANDOFF_AMBIGUOUS);
            warn!(vm = %self.name, "handoff ambiguous: VM failed, config not replayed");
            let note = format!(
                "{}: the runner config was sent but its start was never confirmed",
                api_reason::HANDOFF_AMBIGUOUS
            );
            (self.ctx)
                .event(now, true, api_reason::VM_FAILED, note)
                .await;
        }
        Ok(self.remember(written))
    }

    /// The write's outcome as a fact; the written object is kept for the Events that follow.
    fn remember(&mut self, written: Written) -> Fact {
        match written {
            Written::Done(vm) => {
                self.written = Some(*vm);
                Fact::Recorded
            }
            Written::Refused => Fact::Refused,
        }
    }
}

fn unbound(e: &binding::Unbound) -> Fact {
    Fact::Unbound {
        reason: e.reason(),
        message: e.to_string(),
    }
}

fn recorded(written: bool) -> Fact {
    if written {
        Fact::Recorded
    } else {
        Fact::Refused
    }
}

fn runner_status(s: &mut imp_api::ImpVMStatus) -> &mut RunnerStatus {
    s.runner.get_or_insert_with(Default::default)
}

/// The runner's Exec: `command` as the pool's runner user, powering off after an ephemeral run.
fn runner_exec(command: &str, vm: &ImpVM, uid: &str, env: BTreeMap<String, SecretString>) -> Exec {
    let user = vm.spec.runner_user.clone().unwrap_or_default();
    Exec {
        id: handoff::exec_id(uid),
        argv: vec![command.to_owned()],
        env,
        cwd: None,
        // The pool's runner user (default 1001); the guest refuses uid 0 unless allowed.
        uid: Some(user.uid()),
        gid: user.gid,
        refuse_root: !user.run_as_root(),
        timeout_s: None,
        stream_output: false,
        poweroff_on_exit: vm.spec.lifecycle == Lifecycle::Ephemeral,
    }
}

/// Retries `op` with a capped backoff until it succeeds. Only where giving up is worse than
/// waiting: the Started write after the Exec (else a running job turns ambiguous) and the JIT
/// Secret's delete (else a used one-time config stays readable).
async fn until_ok<T, Fut>(what: &str, vm: &str, mut op: impl FnMut() -> Fut) -> T
where
    Fut: Future<Output = Result<T, Error>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Ok(t) => return t,
            Err(e) => {
                let delay = WRITE_RETRY.delay(attempt);
                warn!(vm, error = %e, ?delay, "{what} failed; retrying");
                tokio::time::sleep(delay).await;
                attempt = attempt.saturating_add(1);
            }
        }
    }
}

/// Deletes `vm`'s JIT Secret if it is bound to `vm` (the binding rule: never another VM's; a
/// forged status naming another VM's Secret must not make the agent delete the victim's
/// config), with the uid it was checked at as precondition. Retried until it succeeds; a Secret
/// already gone or not bound is left as it is.
async fn delete_bound_secret(ctx: &Context, vm: &ImpVM) {
    let (Some(secret), Some(uid)) = (vm.spec.runner_config_secret.clone(), vm.uid()) else {
        return;
    };
    let ns = vm.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let vm_name = vm.name_any();
    until_ok("deleting the JIT config Secret", &vm_name, || async {
        let Some(found) = secrets.get_opt(&secret).await? else {
            return Ok(());
        };
        if let Err(e) = binding::check_secret(&found.metadata, &uid) {
            warn!(vm = %vm_name, error = %e, "not deleting a Secret this VM is not bound to");
            return Ok(());
        }
        let dp = DeleteParams {
            preconditions: found.uid().map(|u| kube::api::Preconditions {
                uid: Some(u),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match secrets.delete(&secret, &dp).await {
            Ok(_) => info!(secret = %format!("{ns}/{secret}"), "deleted the JIT config Secret"),
            // Gone, or replaced by another object of that name since it was checked.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        Ok(())
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_api::{ImpVMSpec, RunnerUser};

    fn vm(user: Option<RunnerUser>) -> ImpVM {
        let mut spec: ImpVMSpec = serde_json::from_value(serde_json::json!({
            "classRef": {"name": "c"}, "image": "i", "lifecycle": "ephemeral",
        }))
        .unwrap();
        spec.runner_user = user;
        ImpVM::new("vm", spec)
    }

    #[test]
    fn the_runner_runs_as_1001_and_never_as_root_by_default() {
        let e = runner_exec("/usr/local/bin/imp-runner", &vm(None), "u", BTreeMap::new());
        assert_eq!((e.uid, e.gid, e.refuse_root), (Some(1001), None, true));
        assert_eq!(e.argv, ["/usr/local/bin/imp-runner"]);
        assert!(e.poweroff_on_exit);
    }

    #[test]
    fn the_pool_user_is_carried_and_root_only_when_allowed() {
        let user = |uid, run_as_root| RunnerUser {
            uid: Some(uid),
            gid: Some(121),
            run_as_root,
        };
        let e = runner_exec("r", &vm(Some(user(2000, None))), "u", BTreeMap::new());
        assert_eq!((e.uid, e.gid, e.refuse_root), (Some(2000), Some(121), true));
        // uid 0 without runAsRoot: still refused (by the guest, which reports why).
        let e = runner_exec("r", &vm(Some(user(0, Some(false)))), "u", BTreeMap::new());
        assert_eq!((e.uid, e.refuse_root), (Some(0), true));
        let e = runner_exec("r", &vm(Some(user(0, Some(true)))), "u", BTreeMap::new());
        assert_eq!((e.uid, e.refuse_root), (Some(0), false));
    }
}
