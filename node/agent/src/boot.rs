//! A VM's boot, as one per-VM task: Starting (+bootStartTime, Ready=False Booting), the
//! resolved spec PUT to imp-runtime (which answers once the guest agent said Hello), then Running
//! (+boot times, ip, Ready=True) or Failed with the runtime's reason. Failures found before the
//! PUT (address, class, pull Secret, network) fail the VM with their own reasons.

use imp_api::conditions::{self, ConditionStatus};
use imp_api::names::{self, condition, reason as api_reason};
use imp_api::{ImpNetwork, ImpVM, ImpVMClass, ImpVMClassSpec, VmPhase};
use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, ResourceExt};
use tracing::info;

use super::binding::{self, Unbound};
use super::capacity::{self, VmSize};
use super::context::{Context, Error, runtime_facts};
use super::decide::RuntimeFacts;
use super::spec;
use super::status::{self, Guard, Written};
use imp_runtime_api::api::VmState;
use imp_runtime_api::client::ClientError;

/// [`capacity::admit`] on what is true now: the capacity this node offers (its settings and
/// host) for what its Node publishes, the VMs bound here (but `uid`) that hold a share, sized by
/// their classes, and the template builds the runtime has in flight.
async fn admission(
    ctx: &Context,
    uid: &str,
    class: &ImpVMClassSpec,
) -> Result<Result<(), String>, Error> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let published = nodes
        .get_opt(&ctx.config.node_name)
        .await?
        .map(|n| n.annotations().clone())
        .unwrap_or_default();
    let h = capacity::holdings(
        &ctx.client,
        &ctx.runtime,
        &ctx.config.node_name,
        &published,
        &ctx.config.capacity,
        Some(uid),
    )
    .await
    .map_err(|e| match e {
        capacity::HoldingsError::Kube(e) => Error::from(e),
        capacity::HoldingsError::Runtime(e) => Error::from(e),
    })?;
    Ok(capacity::admit(
        &h.offered,
        &h.held,
        &h.builds,
        VmSize::of(class),
    ))
}

/// Starting (+bootStartTime), PUT the spec, then Running (+times, Ready) or Failed.
pub async fn run(ctx: &Context, api: &Api<ImpVM>, vm: ImpVM) -> Result<(), Error> {
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
                Guard::BOOTING,
            )
            .await?;
            return Ok(());
        }
    };
    let starting = status::update(api, &name, Guard::BOOTING, |vm, s| {
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
    let classes: Api<ImpVMClass> = Api::all(ctx.client.clone());
    let Some(class) = classes.get_opt(&vm.spec.class_ref.name).await? else {
        let msg = format!("ImpVMClass {} not found", vm.spec.class_ref.name);
        ctx.fail(api, &name, api_reason::SPEC_INVALID, &msg, Guard::STARTING)
            .await?;
        return Ok(());
    };
    // A VM bound here past the scheduler (a user-set nodeName or phase) is checked here too.
    if vm.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Scheduled)
        && let Err(msg) = admission(ctx, &uid, &class.spec).await?
    {
        ctx.fail(
            api,
            &name,
            api_reason::NODE_CAPACITY_EXCEEDED,
            &msg,
            Guard::STARTING,
        )
        .await?;
        return Ok(());
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    if let Some(changed) = changed_since_mint(&secrets, &vm, &uid).await? {
        let msg = changed.to_string();
        ctx.fail(api, &name, changed.reason(), &msg, Guard::STARTING)
            .await?;
        return Ok(());
    }
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
                    Guard::STARTING,
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
                    Guard::STARTING,
                )
                .await?;
                return Ok(());
            }
        }
    }
    let spec = match spec::vm_spec(
        &vm,
        &class.spec,
        &pull,
        attachment,
        &ctx.config.template_warm_paths,
    ) {
        Ok(s) => s,
        Err(e) => {
            ctx.fail(
                api,
                &name,
                api_reason::ROOTFS_PULL_FAILED,
                &e.to_string(),
                Guard::STARTING,
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
            let start = st.start.as_ref().map(status::start_status);
            let written = status::update(api, &name, Guard::STARTING, |vm, s| {
                let now = Timestamp::now();
                s.phase = Some(VmPhase::Running);
                // How it started (a clone, or a boot and why), from the runtime's report.
                s.start = start.clone();
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
                info!(vm = %name, boot_seconds = ?st.boot_seconds, start = ?start, "VM running");
                let note = match (st.boot_seconds, &start) {
                    (_, Some(s)) if s.from == imp_api::StartedFrom::Clone => format!(
                        "cloned from template {}: restored in {:.3}s, reidentified in {:.3}s",
                        s.template.as_deref().unwrap_or("?"),
                        s.restore_seconds.unwrap_or_default(),
                        s.reidentify_seconds.unwrap_or_default()
                    ),
                    (Some(b), Some(s)) if s.fallback_reason.is_some() => format!(
                        "the guest agent answered after {b:.2}s (booted: {})",
                        s.fallback_reason.as_deref().unwrap_or_default()
                    ),
                    (Some(b), _) => format!("the guest agent answered after {b:.2}s"),
                    (None, _) => "the guest agent answered".into(),
                };
                ctx.event(&running, false, api_reason::VM_RUNNING, note)
                    .await;
            }
        }
        Ok((_, st)) => {
            if let Some(start) = st.start.as_ref().map(status::start_status) {
                // A clone that failed (ReidentifyFailed) says so before its Failed: never Running,
                // so its runner handoff never begins and its JIT Secret is never read.
                status::update(api, &name, Guard::STARTING, |_, s| {
                    s.start = Some(start.clone());
                    true
                })
                .await?;
            }
            if let RuntimeFacts::Failed { reason, message } = runtime_facts(Ok(st))? {
                ctx.fail(api, &name, &reason, &message, Guard::STARTING)
                    .await?;
            }
        }
        Err(ClientError::Api { status, body }) if status.is_client_error() => {
            // A clone that failed its Reidentify is answered 422; the runtime's record says how
            // it was started: kept with the failure (best effort, the failure is what matters).
            if let Ok(st) = ctx.runtime.inspect(&uid).await
                && let Some(start) = st.start.as_ref().map(status::start_status)
            {
                status::update(api, &name, Guard::STARTING, |_, s| {
                    s.start = Some(start.clone());
                    true
                })
                .await?;
            }
            let reason = match body.error.as_str() {
                api_reason::INVALID_SPEC | api_reason::INVALID_BODY | api_reason::SPEC_CONFLICT => {
                    api_reason::SPEC_INVALID
                }
                r => r,
            };
            ctx.fail(api, &name, reason, &body.message, Guard::STARTING)
                .await?;
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// A runner VM whose frozen fields moved since its pool minted its config (the binding rule's
/// boot digest) is never booted: booting a re-pointed image and patching the spec back before
/// the handoff would otherwise pass the handoff's own check. Reads the JIT Secret's metadata
/// only (never its data); a VM without a runner config, not pooled, or whose Secret is missing
/// or not its own is left to the handoff, which refuses it with its own reason.
async fn changed_since_mint(
    secrets: &Api<Secret>,
    vm: &ImpVM,
    uid: &str,
) -> Result<Option<Unbound>, Error> {
    let Some(name) = vm.spec.runner_config_secret.as_deref() else {
        return Ok(None);
    };
    if binding::check_vm(vm).is_err() {
        return Ok(None);
    }
    let Some(meta) = secrets.get_metadata_opt(name).await? else {
        return Ok(None);
    };
    if binding::check_secret(&meta.metadata, uid).is_err() {
        return Ok(None);
    }
    Ok(binding::check_boot(vm, name, meta.annotations()).err())
}
