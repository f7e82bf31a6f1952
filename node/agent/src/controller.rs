//! The ImpVM watch (field selector `spec.nodeName=<node>`) and the execution of [`decide`]'s actions.
//!
//! A reconcile is short: it re-reads the ImpVM (uncached: the watch is only a trigger), asks
//! imp-runtime for the VM, decides, and acts. Long work (a boot, a handoff and the wait for the
//! runner's exit) runs in a per-VM task tracked in [`Context::tasks`], which `decide` sees as
//! "in flight". A periodic sweep releases runtime VMs whose ImpVM is no longer bound here.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{self, condition, reason as api_reason};
use imp_api::{ImpNetwork, ImpVM, ImpVMClass, Lifecycle, RunnerStatus, VmPhase};
use imp_common::{Backoff, SecretString};
use imp_guest::host::{HostClient, HostError};
use imp_guest::protocol::{ErrorCode, Exec, Exited};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::{Controller, controller::Action as Requeue, watcher};
use kube::{Api, ResourceExt, api::DeleteParams, api::ListParams};
use tracing::{debug, info, warn};

use super::binding::{self, Unbound};
use super::context::{Context, Error, connect, runtime_facts};
use super::decide::{self, Action, InFlight, RuntimeFacts, VmFacts};
use super::handoff::{self, Event as HandoffEvent, Handoff};
use super::monitor;
use super::spec;
use super::status::{self, Written};
use super::suspender;
use imp_runtime_api::api::VmState;
use imp_runtime_api::client::ClientError;

/// The env var actions/runner reads its JIT config from.
pub const JITCONFIG_ENV: &str = "ACTIONS_RUNNER_INPUT_JITCONFIG";
const EXEC_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Between attempts of a write that must not be given up (Started, the Secret delete).
const WRITE_RETRY: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));

/// Runs the controller and the sweep until the process ends.
pub async fn run(ctx: Arc<Context>) {
    let api: Api<ImpVM> = Api::all(ctx.client.clone());
    let selector = format!("spec.nodeName={}", ctx.config.node_name);
    let sweep = tokio::spawn(sweep_loop(ctx.clone()));
    let wakes = tokio::spawn(suspender::wake_loop(ctx.clone()));
    let kicks = ctx.take_kicks();
    info!(node = %ctx.config.node_name, scale_to_zero = ctx.config.scale_to_zero, "watching ImpVMs bound to this node");
    let mut controller = Controller::new(api, watcher::Config::default().fields(&selector));
    if let Some(kicks) = kicks {
        controller = controller.reconcile_all_on(kicks);
    }
    controller
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                debug!(error = %e, "reconcile failed");
            }
        })
        .await;
    sweep.abort();
    wakes.abort();
}

fn error_policy(_vm: Arc<ImpVM>, error: &Error, ctx: Arc<Context>) -> Requeue {
    ctx.metrics.reconcile_error(error.metric_label());
    warn!(error = %error, "reconcile failed; retrying");
    Requeue::requeue(ctx.config.poll_interval)
}

pub fn vm_facts(vm: &ImpVM, node: &str) -> VmFacts {
    let status = vm.status.as_ref();
    VmFacts {
        bound_here: vm.spec.node_name.as_deref() == Some(node),
        deleting: vm.metadata.deletion_timestamp.is_some(),
        phase: status.and_then(|s| s.phase),
        torn_down: status.is_some_and(|s| conditions::is_true(&s.conditions, condition::TORN_DOWN)),
        runner: vm.spec.runner_config_secret.is_some(),
        handoff: Handoff::from_status(
            status
                .and_then(|s| s.runner.as_ref())
                .and_then(|r| r.handoff),
        ),
    }
}

async fn reconcile(obj: Arc<ImpVM>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let ns = obj
        .namespace()
        .ok_or(Error::Missing(".metadata.namespace"))?;
    let name = obj.name_any();
    let uid = obj.uid().ok_or(Error::Missing(".metadata.uid"))?;
    let api: Api<ImpVM> = Api::namespaced(ctx.client.clone(), &ns);
    // The cache can lag behind our own writes; decide on the object as it is now.
    let Some(vm) = api.get_opt(&name).await? else {
        return Ok(Requeue::await_change());
    };
    if vm.uid().as_deref() != Some(uid.as_str()) {
        return Ok(Requeue::await_change());
    }
    let rt = runtime_facts(ctx.runtime.inspect(&uid).await)?;
    let facts = vm_facts(&vm, &ctx.config.node_name);
    let in_flight = ctx.in_flight(&uid);
    let action = decide::decide(&facts, &rt, in_flight);
    if action != Action::Nothing {
        info!(vm = %format!("{ns}/{name}"), phase = ?facts.phase, runtime = ?rt, ?in_flight, ?action, "acting");
    }
    let suspending = matches!(in_flight, Some(InFlight::Suspend | InFlight::Resume));
    if facts.phase == Some(VmPhase::Running)
        && !facts.deleting
        && rt == RuntimeFacts::Running
        && !suspending
    {
        let (ctx2, api2, vm2) = (ctx.clone(), api.clone(), vm.clone());
        ctx.ensure_monitor(&uid, move || {
            tokio::spawn(async move { monitor::run(&ctx2, &api2, vm2).await })
        });
    }
    if action == Action::Nothing
        && facts.bound_here
        && !facts.deleting
        && let Some(phase) = facts.phase.filter(|p| suspender::handles(*p))
    {
        suspender::reconcile(&ctx, &api, vm, &uid, phase, &rt, in_flight).await?;
        return Ok(Requeue::requeue(ctx.config.poll_interval));
    }
    execute(&ctx, &api, vm, &uid, action).await?;
    Ok(Requeue::requeue(ctx.config.poll_interval))
}

async fn execute(
    ctx: &Arc<Context>,
    api: &Api<ImpVM>,
    vm: ImpVM,
    uid: &str,
    action: Action,
) -> Result<(), Error> {
    let name = vm.name_any();
    match action {
        Action::Nothing => {}
        Action::Teardown => {
            ctx.abort(uid);
            ctx.runtime.delete(uid).await?;
            info!(vm = %name, "torn down in imp-runtime");
            record_torn_down(ctx, api, &name).await?;
        }
        Action::RecordTornDown => record_torn_down(ctx, api, &name).await?,
        Action::Release => {
            ctx.abort(uid);
            ctx.runtime.delete(uid).await?;
            info!(vm = %name, "released the VM's instance in imp-runtime");
        }
        Action::Boot => {
            let (ctx2, api2) = (ctx.clone(), api.clone());
            ctx.spawn(
                uid,
                InFlight::Boot,
                async move { boot(&ctx2, &api2, vm).await },
            );
        }
        Action::Restart => {
            ctx.abort(uid);
            ctx.runtime.delete(uid).await?;
            info!(vm = %name, "released the previous instance for an in-place restart");
            let (ctx2, api2) = (ctx.clone(), api.clone());
            ctx.spawn(
                uid,
                InFlight::Boot,
                async move { boot(&ctx2, &api2, vm).await },
            );
        }
        Action::Handoff | Action::Reattach => {
            let resume = action == Action::Reattach;
            let (ctx2, api2) = (ctx.clone(), api.clone());
            ctx.spawn(uid, InFlight::Runner, async move {
                runner(&ctx2, &api2, vm, resume).await
            });
        }
        Action::DeclareAmbiguous => declare_ambiguous(ctx, api, &vm).await?,
        Action::Fail { reason, message } => {
            ctx.fail(api, &name, &reason, &message, |p| {
                matches!(p, Some(VmPhase::Starting | VmPhase::Running))
            })
            .await?;
        }
    }
    Ok(())
}

async fn record_torn_down(ctx: &Context, api: &Api<ImpVM>, name: &str) -> Result<(), Error> {
    let written = status::update(api, name, |vm, s| {
        if conditions::is_true(&s.conditions, condition::TORN_DOWN) {
            return false;
        }
        let msg = "process, TAP, IP and per-VM disk released by imp-runtime";
        conditions::set(
            &mut s.conditions,
            condition::TORN_DOWN,
            ConditionStatus::True,
            api_reason::TEARDOWN_COMPLETE,
            msg,
            vm.metadata.generation,
            Timestamp::now(),
        );
        conditions::set(
            &mut s.conditions,
            condition::READY,
            ConditionStatus::False,
            api_reason::TORN_DOWN,
            "",
            vm.metadata.generation,
            Timestamp::now(),
        );
        true
    })
    .await?;
    if let Written::Done(vm) = written {
        ctx.metrics.teardown();
        info!(vm = %name, "recorded TornDown=True");
        let note = "process, TAP, address and per-VM disk released on this node".into();
        ctx.event(&vm, false, api_reason::TORN_DOWN_ON_NODE, note)
            .await;
    }
    Ok(())
}

/// Starting (+bootStartTime), PUT the spec, then Running (+times, Ready) or Failed.
async fn boot(ctx: &Context, api: &Api<ImpVM>, vm: ImpVM) -> Result<(), Error> {
    let name = vm.name_any();
    let ns = vm.namespace().unwrap_or_default();
    let uid = vm.uid().ok_or(Error::Missing(".metadata.uid"))?;
    let address = match spec::allocation(&vm) {
        Ok(spec::Allocation::Pending) => {
            // The operator writes the annotation once IPAM allocated; that change is a watch
            // event, which brings the VM back here.
            info!(vm = %name, "waiting for the VM's address (annotation {})", names::ANNOTATION_IP_ALLOCATION);
            return Ok(());
        }
        Ok(spec::Allocation::NoNetwork) => None,
        Ok(spec::Allocation::Allocated(a)) => Some(a),
        Err(e) => {
            ctx.fail(
                api,
                &name,
                api_reason::NETWORK_SETUP_FAILED,
                &e.to_string(),
                |p| matches!(p, Some(VmPhase::Scheduled | VmPhase::Starting)),
            )
            .await?;
            return Ok(());
        }
    };
    let starting = status::update(api, &name, |vm, s| {
        if vm.metadata.deletion_timestamp.is_some()
            || !matches!(s.phase, Some(VmPhase::Scheduled | VmPhase::Starting))
        {
            return false;
        }
        if s.phase == Some(VmPhase::Scheduled) {
            s.boot_start_time = Some(Time(Timestamp::now()));
            s.boot_complete_time = None;
        }
        s.boot_start_time.get_or_insert(Time(Timestamp::now()));
        s.phase = Some(VmPhase::Starting);
        s.reason = None;
        s.message = None;
        conditions::remove(&mut s.conditions, condition::TORN_DOWN);
        conditions::set(
            &mut s.conditions,
            condition::READY,
            ConditionStatus::False,
            api_reason::BOOTING,
            "",
            vm.metadata.generation,
            Timestamp::now(),
        );
        true
    })
    .await?;
    let Written::Done(starting) = starting else {
        return Ok(());
    };
    let starting_only = |p: Option<VmPhase>| p == Some(VmPhase::Starting);
    let classes: Api<ImpVMClass> = Api::all(ctx.client.clone());
    let Some(class) = classes.get_opt(&vm.spec.class_ref.name).await? else {
        let msg = format!("ImpVMClass {} not found", vm.spec.class_ref.name);
        ctx.fail(api, &name, api_reason::SPEC_INVALID, &msg, starting_only)
            .await?;
        return Ok(());
    };
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let mut pull = Vec::new();
    for r in &vm.spec.image_pull_secrets {
        match secrets.get_opt(&r.name).await? {
            Some(s) => pull.push(s),
            None => {
                let msg = format!("image pull Secret {} not found", r.name);
                ctx.fail(
                    api,
                    &name,
                    api_reason::ROOTFS_PULL_FAILED,
                    &msg,
                    starting_only,
                )
                .await?;
                return Ok(());
            }
        }
    }
    let mut attachment = None;
    if let (Some(address), Some(r)) = (address, &vm.spec.network_ref) {
        let networks: Api<ImpNetwork> = Api::namespaced(ctx.client.clone(), &ns);
        let found = match networks.get_opt(&r.name).await? {
            None => Err(format!("ImpNetwork {ns}/{} not found", r.name)),
            Some(net) => spec::attachment(&net, address).map_err(|e| e.to_string()),
        };
        match found {
            Ok(a) => attachment = Some(a),
            Err(msg) => {
                ctx.fail(
                    api,
                    &name,
                    api_reason::NETWORK_SETUP_FAILED,
                    &msg,
                    starting_only,
                )
                .await?;
                return Ok(());
            }
        }
    }
    let spec = match spec::vm_spec(&vm, &class.spec, &pull, attachment) {
        Ok(s) => s,
        Err(e) => {
            ctx.fail(
                api,
                &name,
                api_reason::ROOTFS_PULL_FAILED,
                &e.to_string(),
                starting_only,
            )
            .await?;
            return Ok(());
        }
    };
    info!(vm = %name, image = %vm.spec.image, "asking imp-runtime to start the VM");
    let note = format!("booting {} on node {}", vm.spec.image, ctx.config.node_name);
    ctx.event(&starting, false, api_reason::BOOT_REQUESTED, note)
        .await;
    match ctx.runtime.ensure_running(&uid, &spec).await {
        Ok((_, st)) if st.state == VmState::Running => {
            let written = status::update(api, &name, |vm, s| {
                if vm.metadata.deletion_timestamp.is_some() || s.phase != Some(VmPhase::Starting) {
                    return false;
                }
                let now = Timestamp::now();
                s.phase = Some(VmPhase::Running);
                // ARCHITECTURE §3: the agent reports the guest's address once it runs.
                s.ip = address.map(|a| a.addr().to_string());
                s.boot_complete_time = Some(Time(now));
                s.first_running_time.get_or_insert(Time(now));
                conditions::set(
                    &mut s.conditions,
                    condition::READY,
                    ConditionStatus::True,
                    api_reason::GUEST_READY,
                    "the guest agent answered",
                    vm.metadata.generation,
                    now,
                );
                true
            })
            .await?;
            if let Written::Done(running) = written {
                if let Some(b) = st.boot_seconds {
                    ctx.metrics.boot(b);
                }
                info!(vm = %name, boot_seconds = ?st.boot_seconds, "VM running");
                let note = match st.boot_seconds {
                    Some(b) => format!("the guest agent answered after {b:.2}s"),
                    None => "the guest agent answered".into(),
                };
                ctx.event(&running, false, api_reason::VM_RUNNING, note)
                    .await;
            }
        }
        Ok((_, st)) => {
            if let RuntimeFacts::Failed { reason, message } = runtime_facts(Ok(st))? {
                ctx.fail(api, &name, &reason, &message, starting_only)
                    .await?;
            }
        }
        Err(ClientError::Api { status, body }) if status.is_client_error() => {
            let reason = match body.error.as_str() {
                api_reason::INVALID_SPEC | api_reason::INVALID_BODY | api_reason::SPEC_CONFLICT => {
                    api_reason::SPEC_INVALID
                }
                r => r,
            };
            ctx.fail(api, &name, reason, &body.message, starting_only)
                .await?;
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

fn runner_exec(ctx: &Context, vm: &ImpVM, uid: &str, env: BTreeMap<String, SecretString>) -> Exec {
    Exec {
        id: handoff::exec_id(uid),
        argv: vec![ctx.config.runner_command.clone()],
        env,
        cwd: None,
        uid: None,
        gid: None,
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

/// Deletes `vm`'s JIT Secret if it is bound to `vm` (the binding rule: never another VM's), with
/// the uid it was checked at as precondition. Retried until it succeeds; a Secret already gone
/// or not bound is left as it is.
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
        if let Err(e) = binding::check_secret(&found, &uid) {
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

fn runner_status(s: &mut imp_api::ImpVMStatus) -> &mut RunnerStatus {
    s.runner.get_or_insert_with(Default::default)
}

/// The handoff state recorded in `s`, moved by `event` when the state machine allows it to
/// `to`; `false` (the write is refused) otherwise. Every handoff write goes through here.
fn transition(s: &mut imp_api::ImpVMStatus, event: HandoffEvent, to: Handoff) -> bool {
    let r = runner_status(s);
    match handoff::step(Handoff::from_status(r.handoff), event) {
        Ok(next) if next == to => {
            r.handoff = next.to_status();
            true
        }
        _ => false,
    }
}

/// Refuses the handoff to a VM the config was not minted for: Failed with the binding rule's
/// reason, an Event, and the Secret left exactly as it is.
async fn refuse(ctx: &Context, api: &Api<ImpVM>, vm: &ImpVM, e: &Unbound) -> Result<(), Error> {
    ctx.metrics.handoff("unbound");
    let msg = e.to_string();
    ctx.fail(api, &vm.name_any(), e.reason(), &msg, |p| {
        p == Some(VmPhase::Running)
    })
    .await?;
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

/// The handoff (unless `resume`) and the wait for the runner's exit. A guest that breaks its
/// contract fails the VM with its own reason (the VM is then released: terminal phase).
async fn runner(ctx: &Context, api: &Api<ImpVM>, vm: ImpVM, resume: bool) -> Result<(), Error> {
    match runner_inner(ctx, api, &vm, resume).await {
        Err(e) if let Some(reason) = guest_breach(&e) => {
            let msg = e.to_string();
            ctx.fail(api, &vm.name_any(), reason, &msg, |p| {
                p == Some(VmPhase::Running)
            })
            .await?;
            Ok(())
        }
        r => r,
    }
}

async fn runner_inner(
    ctx: &Context,
    api: &Api<ImpVM>,
    vm: &ImpVM,
    resume: bool,
) -> Result<(), Error> {
    let name = vm.name_any();
    let ns = vm.namespace().unwrap_or_default();
    let uid = vm.uid().ok_or(Error::Missing(".metadata.uid"))?;
    let secret_name = vm
        .spec
        .runner_config_secret
        .clone()
        .ok_or(Error::Missing("spec.runnerConfigSecret"))?;
    let exec_id = handoff::exec_id(&uid);
    if !resume && let Err(e) = binding::check_vm(vm) {
        return refuse(ctx, api, vm, &e).await;
    }
    let mut client = connect(ctx, &uid).await?;
    if resume {
        // Same boot (a guest reboot ends the Firecracker process): the id is known to the guest,
        // so this re-queries the runner and never spawns. No config is sent.
        let started = client
            .exec(runner_exec(ctx, vm, &uid, BTreeMap::new()))
            .await?;
        info!(vm = %name, pid = started.pid, "reattached to the runner");
        // A previous agent may have died between Started and the delete.
        delete_bound_secret(ctx, vm).await;
    } else {
        let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
        let read_at = Instant::now();
        let secret = secrets.get_opt(&secret_name).await?;
        if let Some(s) = &secret
            && let Err(e) = binding::check_secret(s, &uid)
        {
            return refuse(ctx, api, vm, &e).await;
        }
        let annotations = secret
            .as_ref()
            .map(|s| s.annotations().clone())
            .unwrap_or_default();
        let config = secret
            .and_then(|s| s.data)
            .and_then(|mut d| d.remove(names::SECRET_KEY_JITCONFIG))
            .and_then(|b| String::from_utf8(b.0).ok())
            .filter(|c| !c.is_empty())
            .map(SecretString::from);
        let Some(config) = config else {
            ctx.metrics.handoff("config_missing");
            let msg = format!("JIT config Secret {secret_name} is missing or has no jitconfig key");
            ctx.fail(api, &name, api_reason::RUNNER_CONFIG_MISSING, &msg, |p| {
                p == Some(VmPhase::Running)
            })
            .await?;
            return Ok(());
        };
        // Record Sent before the config leaves the host.
        let sent = status::update(api, &name, |vm, s| {
            if vm.metadata.deletion_timestamp.is_some() || s.phase != Some(VmPhase::Running) {
                return false;
            }
            if !transition(s, HandoffEvent::SentRecorded, Handoff::Sent) {
                return false;
            }
            let r = runner_status(s);
            r.exec_id = Some(exec_id.clone());
            r.sent_time = Some(Time(Timestamp::now()));
            r.runner_id = annotations
                .get(names::ANNOTATION_RUNNER_ID)
                .and_then(|v| v.parse().ok());
            r.runner_name = annotations.get(names::ANNOTATION_RUNNER_NAME).cloned();
            true
        })
        .await?;
        if matches!(sent, Written::Refused) {
            return Ok(());
        }
        info!(vm = %name, exec_id = %exec_id, "handoff Sent recorded; sending the Exec");
        let env = BTreeMap::from([(JITCONFIG_ENV.to_owned(), config)]);
        let answer = tokio::time::timeout(
            EXEC_ANSWER_TIMEOUT,
            client.exec(runner_exec(ctx, vm, &uid, env)),
        )
        .await;
        match answer {
            Ok(Ok(started)) => {
                // The runner runs: this write must not be lost to a passing API error, or the
                // next reconcile would find Sent and declare a running job ambiguous.
                let pid = i64::from(started.pid);
                let written = until_ok("recording Started", &name, || async {
                    let w = status::update(api, &name, |_, s| {
                        if !transition(s, HandoffEvent::Started, Handoff::Started) {
                            return false;
                        }
                        let r = runner_status(s);
                        r.pid = Some(pid);
                        r.started_time = Some(Time(Timestamp::now()));
                        true
                    })
                    .await?;
                    Ok::<_, Error>(w)
                })
                .await;
                ctx.metrics.handoff("started");
                ctx.metrics
                    .handoff_duration(read_at.elapsed().as_secs_f64());
                info!(vm = %name, pid = started.pid, "runner Started recorded");
                if let Written::Done(now) = &written {
                    let note =
                        format!("runner started in the guest (pid {pid}); JIT Secret deleted");
                    delete_bound_secret(ctx, vm).await;
                    ctx.event(now, false, api_reason::HANDED_OFF, note).await;
                } else {
                    delete_bound_secret(ctx, vm).await;
                }
            }
            Ok(Err(HostError::Guest(e))) if e.code == ErrorCode::SpawnFailed => {
                // Definitely not started: the config was not used.
                ctx.metrics.handoff("spawn_failed");
                ctx.fail(
                    api,
                    &name,
                    api_reason::RUNNER_START_FAILED,
                    &e.message,
                    |p| p == Some(VmPhase::Running),
                )
                .await?;
                delete_bound_secret(ctx, vm).await;
                return Ok(());
            }
            Ok(Err(e)) => {
                warn!(vm = %name, error = %e, "guest connection lost after Sent: the handoff is ambiguous");
                declare_ambiguous(ctx, api, vm).await?;
                return Ok(());
            }
            Err(_) => {
                warn!(vm = %name, "no answer to the Exec within {EXEC_ANSWER_TIMEOUT:?}: the handoff is ambiguous");
                declare_ambiguous(ctx, api, vm).await?;
                return Ok(());
            }
        }
    }
    let exited = wait_exited(ctx, vm, &uid, &exec_id, client).await?;
    let Some(exited) = exited else {
        return Ok(()); // the VM ended without reporting; the next reconcile decides.
    };
    let outcome = handoff::exit_outcome(exited.code, exited.signal, exited.timed_out);
    let written = status::update(api, &name, |vm, s| {
        if vm.metadata.deletion_timestamp.is_some() || s.phase != Some(VmPhase::Running) {
            return false;
        }
        if !transition(s, HandoffEvent::Exited, Handoff::Exited) {
            return false;
        }
        let r = runner_status(s);
        r.exit_code = exited.code;
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
    if let Written::Done(now) = written {
        let note = match &outcome {
            Ok(()) => {
                ctx.metrics.runner_exit("succeeded");
                "runner exited with code 0".to_owned()
            }
            Err((reason, message)) => {
                ctx.metrics.runner_exit("failed");
                ctx.metrics.vm_failed(reason);
                format!("{reason}: {message}")
            }
        };
        info!(vm = %name, code = ?exited.code, signal = ?exited.signal, "runner exited");
        ctx.event(&now, outcome.is_err(), api_reason::RUNNER_FINISHED, note)
            .await;
    }
    Ok(())
}

/// Waits for the runner's `Exited`, reconnecting (and re-asking with the same id, which never
/// spawns) when the connection breaks. `None` when the VM ended without reporting. A guest that
/// floods the connection is not reconnected to: its budget error ends the wait.
async fn wait_exited(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    exec_id: &str,
    mut client: HostClient,
) -> Result<Option<Exited>, Error> {
    loop {
        match client.wait_exited(exec_id).await {
            Ok(e) => return Ok(Some(e)),
            Err(e @ HostError::BudgetExceeded { .. }) => return Err(e.into()),
            Err(e) => {
                debug!(uid, error = %e, "lost the guest connection while waiting for the runner");
                tokio::time::sleep(Duration::from_millis(500)).await;
                if runtime_facts(ctx.runtime.inspect(uid).await)? != RuntimeFacts::Running {
                    return Ok(None);
                }
                client = connect(ctx, uid).await?;
                client
                    .exec(runner_exec(ctx, vm, uid, BTreeMap::new()))
                    .await?;
            }
        }
    }
}

/// `Sent` without `Started`: Failed HandoffAmbiguous, Secret deleted, never replayed. The runtime
/// instance is then released (terminal phase), which stops any runner the config may have reached.
async fn declare_ambiguous(ctx: &Context, api: &Api<ImpVM>, vm: &ImpVM) -> Result<(), Error> {
    let name = vm.name_any();
    let written = status::update(api, &name, |vm, s| {
        if vm.metadata.deletion_timestamp.is_some()
            || !transition(s, HandoffEvent::ConnectionLost, Handoff::Ambiguous)
        {
            return false;
        }
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
    if let Written::Done(now) = written {
        ctx.metrics.handoff("ambiguous");
        ctx.metrics.vm_failed(api_reason::HANDOFF_AMBIGUOUS);
        warn!(vm = %name, "handoff ambiguous: VM failed, config not replayed");
        let note = format!(
            "{}: the runner config was sent but its start was never confirmed",
            api_reason::HANDOFF_AMBIGUOUS
        );
        ctx.event(&now, true, api_reason::VM_FAILED, note).await;
    }
    // Only a Secret bound to this VM: a forged status (Sent on a VM naming another VM's
    // Secret) must not make the agent delete the victim's config.
    delete_bound_secret(ctx, vm).await;
    Ok(())
}

/// Releases runtime VMs whose ImpVM is no longer bound to this node (rescheduled or gone), and
/// refreshes the backlog gauge.
async fn sweep_loop(ctx: Arc<Context>) {
    let api: Api<ImpVM> = Api::all(ctx.client.clone());
    let lp = ListParams::default().fields(&format!("spec.nodeName={}", ctx.config.node_name));
    loop {
        tokio::time::sleep(ctx.config.sweep_interval).await;
        if let Err(e) = sweep_once(&ctx, &api, &lp).await {
            warn!(error = %e, "sweep failed");
        }
    }
}

async fn sweep_once(ctx: &Context, api: &Api<ImpVM>, lp: &ListParams) -> Result<(), Error> {
    // The runtime list first: a VM created after it was read is bound (we only start bound VMs).
    let local = ctx.runtime.list().await?;
    let bound = api.list(lp).await?;
    let backlog = bound
        .items
        .iter()
        .filter(|vm| {
            matches!(
                vm.status.as_ref().and_then(|s| s.phase),
                Some(VmPhase::Scheduled | VmPhase::Starting)
            )
        })
        .count();
    ctx.metrics.backlog(backlog as i64);
    let uids: HashSet<String> = bound.items.iter().filter_map(|vm| vm.uid()).collect();
    for vm in local {
        if !uids.contains(&vm.uid) {
            ctx.abort(&vm.uid);
            ctx.runtime.delete(&vm.uid).await?;
            info!(uid = %vm.uid, "released a VM no longer bound to this node");
        }
    }
    Ok(())
}
