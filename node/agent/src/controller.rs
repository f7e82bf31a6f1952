//! The ImpVM watch (field selector `spec.nodeName=<node>`): observe, [`decide`], execute.
//!
//! A reconcile is short: it re-reads the ImpVM (uncached: the watch is only a trigger), asks
//! imp-runtime for the VM, observes what suspend and ScaleToZero need ([`suspender::observe`]),
//! asks [`decide::decide`] for the one next action and executes it here ([`execute`]: the agent's
//! one executor). Long work (a boot, a runner's handoff and exit, a suspend or resume) runs in a
//! per-VM task the [`Context`] tracks, which `decide` sees as "in flight". A periodic sweep
//! releases runtime VMs whose ImpVM is no longer bound here.

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt;
use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{condition, reason as api_reason};
use imp_api::{ImpVM, VmPhase};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::{Controller, controller::Action as Requeue, watcher};
use kube::{Api, ResourceExt, api::ListParams};
use tracing::{debug, info, warn};

use super::boot;
use super::context::{Context, Error, runtime_facts};
use super::decide::{self, Action, InFlight, VmFacts};
use super::handoff::Handoff;
use super::monitor;
use super::runner;
use super::status::{self, Guard, Written};
use super::suspender;

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
    let sleep = suspender::observe(&ctx, &vm, &uid, &facts, &rt, in_flight).await;
    let action = decide::decide(&facts, &rt, in_flight, sleep.as_ref());
    if action != Action::Nothing {
        info!(vm = %format!("{ns}/{name}"), phase = ?facts.phase, runtime = ?rt, ?in_flight, ?sleep, ?action, "acting");
    }
    if decide::monitored(&facts, &rt, in_flight) {
        let (ctx2, api2, vm2) = (ctx.clone(), api.clone(), vm.clone());
        ctx.ensure_monitor(&uid, move || {
            tokio::spawn(async move { monitor::run(&ctx2, &api2, vm2).await })
        });
    }
    execute(&ctx, &api, vm, &uid, action).await?;
    Ok(Requeue::requeue(ctx.config.poll_interval))
}

/// The one executor of a VM's actions: short ones inline, long ones as the VM's task.
async fn execute(
    ctx: &Arc<Context>,
    api: &Api<ImpVM>,
    vm: ImpVM,
    uid: &str,
    action: Action,
) -> Result<(), Error> {
    let name = vm.name_any();
    let (ctx2, api2, uid2) = (ctx.clone(), api.clone(), uid.to_owned());
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
            ctx.spawn(uid, InFlight::Boot, async move {
                boot::run(&ctx2, &api2, vm).await
            });
        }
        Action::Restart => {
            ctx.abort(uid);
            ctx.runtime.delete(uid).await?;
            info!(vm = %name, "released the previous instance for an in-place restart");
            ctx.spawn(uid, InFlight::Boot, async move {
                boot::run(&ctx2, &api2, vm).await
            });
        }
        // Short, so inline: the release its Failed write brings about must not abort the task
        // before the Secret is deleted.
        Action::DeclareAmbiguous => runner::run(ctx, api, vm).await?,
        // The runner task goes on from the handoff the VM's status records.
        Action::Handoff | Action::Reattach => {
            ctx.spawn(uid, InFlight::Runner, async move {
                runner::run(&ctx2, &api2, vm).await
            });
        }
        Action::Fail { reason, message } => {
            ctx.fail(api, &name, &reason, &message, Guard::LIVE).await?;
        }
        Action::Suspend(t) => {
            ctx.spawn(uid, InFlight::Suspend, async move {
                suspender::suspend(&ctx2, &api2, vm, &uid2, t).await
            });
        }
        Action::Resume(t) => {
            ctx.spawn(uid, InFlight::Resume, async move {
                suspender::resume(&ctx2, &api2, vm, &uid2, t).await
            });
        }
        Action::MarkSuspended => suspender::mark_suspended(ctx, api, &name, None).await?,
        Action::MarkRunning => suspender::mark_running(ctx, api, &name, uid, None).await?,
        Action::RefuseSuspend(t) => suspender::refuse(ctx, api, &vm, t).await?,
        Action::ClearSuspendRefusal => suspender::clear_refusal(api, &name).await?,
    }
    Ok(())
}

async fn record_torn_down(ctx: &Context, api: &Api<ImpVM>, name: &str) -> Result<(), Error> {
    let written = status::update(api, name, Guard::ANY.even_deleting(), |vm, s| {
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
