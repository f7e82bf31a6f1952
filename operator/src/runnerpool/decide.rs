//! The pool controller's decisions as pure functions: observed facts in (the pool's VMs, GitHub's runner
//! listing when one was taken, the demand, the controller's memory), a [`PoolPlan`] out. The controller
//! ([`super::controller`]) observes, calls [`decide`], and executes; nothing here does I/O.
//!
//! Besides the scaling [`plan`](super::plan), this module owns the policies the executor used to decide
//! inline: what blocks minting ([`mint_block`]), whether to list the pool's runners first
//! ([`listing_wanted`]), what to do about a VM's JIT Secret ([`mint_action`]), which GitHub errors mean
//! the credentials are bad ([`credentials_invalid`]), the pool's status and conditions ([`pool_status`]),
//! start-failure accounting ([`account_start_failures`]), the deadlines ([`overdue`]), the registration
//! reaper ([`orphans`]), and what a pass ends with once executed ([`settle`]: status, Events, requeue).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use imp_api::{
    ImpVMRunnerPoolStatus, Scaling, conditions,
    names::{condition, reason},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

use super::classify::RunnerState;
use super::plan::{Backoff, Limit, MintBlock, Observed, ObservedVm, Plan, Removal, plan};
use super::slo::{ServedFacts, ServedUpdate, VmTimes, served_updates};
use crate::github::{GithubError, Runner, runner_name};

/// Whether the pool's App credentials were last seen working.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Creds {
    #[default]
    Unknown,
    Valid,
    Invalid {
        reason: &'static str,
        message: String,
    },
}

/// GitHub errors that no retry fixes: the App's key, installation, permissions or the pool's scope or
/// runner group are wrong. The pool stops minting until its App Secret changes.
pub fn credentials_invalid(e: &GithubError) -> bool {
    matches!(
        e,
        GithubError::Credentials(_)
            | GithubError::Unauthorized { .. }
            | GithubError::Forbidden { .. }
            | GithubError::EnterpriseScopeUnsupported
            | GithubError::RunnerGroupNotFound { .. }
    )
}

/// What the API server holds at a VM's JIT Secret name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JitSecretFacts {
    /// The Secret's controller is this VM.
    pub owned_by_vm: bool,
    pub runner_id: Option<String>,
    pub runner_name: Option<String>,
}

/// What to do about a VM that needs its JIT config recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MintAction {
    /// The VM already owns a Secret (an earlier pass minted and stored it, then failed to record it):
    /// record that one.
    Adopt {
        runner_id: Option<String>,
        runner_name: Option<String>,
    },
    /// The name is taken by a Secret the VM does not own: the VM can never get a config; delete it.
    Conflict,
    /// The VM was minted before (it carries a runner id) and its Secret is gone: never mint twice;
    /// deregister that runner and replace the VM.
    Lost { runner_id: Option<u64> },
    /// Mint a new config.
    Mint,
}

/// The mint policy. `vm_runner_id` is the runner id annotation on the VM, if any.
pub fn mint_action(existing: Option<&JitSecretFacts>, vm_runner_id: Option<&str>) -> MintAction {
    match (existing, vm_runner_id) {
        (Some(s), _) if s.owned_by_vm => MintAction::Adopt {
            runner_id: s.runner_id.clone(),
            runner_name: s.runner_name.clone(),
        },
        (Some(_), _) => MintAction::Conflict,
        (None, Some(id)) => MintAction::Lost {
            runner_id: id.parse().ok(),
        },
        (None, None) => MintAction::Mint,
    }
}

/// Storing a freshly minted Secret answered 409: what is there now decides. A Secret the VM owns was
/// written by an earlier attempt: adopt it and deregister the registration just minted. Anything else
/// leaves the new registration without a home: deregister it and replace the VM.
pub fn after_store_conflict(existing: Option<&JitSecretFacts>) -> MintAction {
    match mint_action(existing, None) {
        adopt @ MintAction::Adopt { .. } => adopt,
        _ => MintAction::Conflict,
    }
}

/// What one pass changed (status is the observation at the start of the pass plus these).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Done {
    pub created: u32,
    pub retired: u32,
    pub cleaned: u32,
}

/// What the periodic sweep last learnt of the pool's scope (DemandListed).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Sweep {
    /// No sweep has covered the pool yet, or the last ones failed for passing reasons (a rate
    /// limit, an error): the condition keeps what it said.
    #[default]
    Unknown,
    /// Every repository of the scope was listed in full.
    Complete,
    /// These repositories have more active runs than the sweep reads (its page cap).
    PageCap(Vec<String>),
}

impl Sweep {
    /// The sweep's outcome for one pool: the repositories of `in_scope` among those whose
    /// listing hit the page cap; else Complete when the whole sweep was.
    pub fn of(capped: &[String], in_scope: impl Fn(&str) -> bool, complete: bool) -> Sweep {
        let mine: Vec<String> = capped.iter().filter(|r| in_scope(r)).cloned().collect();
        if !mine.is_empty() {
            Sweep::PageCap(mine)
        } else if complete {
            Sweep::Complete
        } else {
            Sweep::Unknown
        }
    }
}

/// Repositories named in a condition message; the rest are counted.
const NAMED_REPOSITORIES: usize = 5;

/// Inputs of [`pool_status`].
pub struct StatusInput<'a> {
    pub old: &'a ImpVMRunnerPoolStatus,
    pub plan: &'a Plan,
    pub done: Done,
    pub creds: &'a Creds,
    /// A mint failed this pass (the pool backs off even if the plan was not limited).
    pub mint_failed: bool,
    pub generation: Option<i64>,
    pub max_runners: u32,
    pub sweep: &'a Sweep,
    pub now: Timestamp,
    /// The runner version's verdict ([`super::freshness`]).
    pub freshness: &'a super::freshness::Freshness,
}

/// The pool's status after a pass: counts from the plan's observation adjusted by what the pass did,
/// and the CredentialsValid, Ready, AtCapacity, ScalingLimited and DemandListed conditions.
pub fn pool_status(i: &StatusInput) -> ImpVMRunnerPoolStatus {
    let (c, p) = (&i.plan.counts, i.plan);
    let Done {
        created,
        retired,
        cleaned,
    } = i.done;
    let (cv, cr, cm) = match i.creds {
        Creds::Valid => (
            Some(true),
            reason::MINTED,
            "A JIT runner config was minted with the App credentials".to_owned(),
        ),
        Creds::Unknown => (
            None,
            reason::NOT_YET_USED,
            "No JIT config minted yet".to_owned(),
        ),
        Creds::Invalid { reason, message } => (Some(false), *reason, message.clone()),
    };
    let ready = c.idle + c.busy >= p.desired && !matches!(i.creds, Creds::Invalid { .. });
    let limited = p.limited.or(i.mint_failed.then_some(Limit::MintBackoff));
    let mut conds = i.old.conditions.clone();
    let mut cond = |type_: &str, ok: Option<bool>, reason: &str, message: String| {
        conditions::set(
            &mut conds,
            type_,
            ok.into(),
            reason,
            message,
            i.generation,
            i.now,
        );
    };
    cond(condition::CREDENTIALS_VALID, cv, cr, cm);
    cond(
        condition::READY,
        Some(ready),
        if ready {
            reason::RUNNERS_AVAILABLE
        } else {
            reason::RUNNERS_PENDING
        },
        format!("{} idle + {} busy of {} desired", c.idle, c.busy, p.desired),
    );
    cond(
        condition::AT_CAPACITY,
        Some(p.at_capacity),
        if p.at_capacity {
            reason::MAX_RUNNERS_REACHED
        } else {
            reason::BELOW_MAX_RUNNERS
        },
        format!("{} of maxRunners {}", c.live(), i.max_runners),
    );
    cond(
        condition::SCALING_LIMITED,
        Some(limited.is_some()),
        limited.map_or(reason::NOT_LIMITED, Limit::reason),
        match limited {
            Some(l) => format!("scaling held back by {}", l.reason()),
            None => "scaling follows demand".to_owned(),
        },
    );
    match i.sweep {
        Sweep::Unknown => {}
        Sweep::Complete => cond(
            condition::DEMAND_LISTED,
            Some(true),
            reason::SWEEP_COMPLETE,
            "the last sweep listed every repository of the pool's scope in full".to_owned(),
        ),
        Sweep::PageCap(repos) => {
            let mut named = repos
                .iter()
                .take(NAMED_REPOSITORIES)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ");
            if repos.len() > NAMED_REPOSITORIES {
                named.push_str(&format!(" and {} more", repos.len() - NAMED_REPOSITORIES));
            }
            cond(
                condition::DEMAND_LISTED,
                Some(false),
                reason::SWEEP_PAGE_CAP,
                format!(
                    "{named}: more active runs than the sweep reads; their queued jobs are known from \
                     webhooks only, and a lost delivery is not recovered"
                ),
            )
        }
    }
    let f = i.freshness;
    cond(
        condition::RUNNER_VERSION_SUPPORTED,
        f.supported.0,
        f.supported.1,
        f.supported.2.clone(),
    );
    cond(
        condition::DEGRADED,
        Some(f.degraded.0),
        f.degraded.1,
        f.degraded.2.clone(),
    );
    ImpVMRunnerPoolStatus {
        runner_version: Some(f.status.clone()),
        observed_generation: i.generation,
        desired: p.desired,
        idle: c.idle.saturating_sub(retired),
        busy: c.busy,
        booting: c.booting + c.unminted + created,
        total: (c.total() + created).saturating_sub(retired + cleaned),
        last_scale_time: if created + retired + cleaned > 0 {
            Some(Time(i.now))
        } else {
            i.old.last_scale_time.clone()
        },
        conditions: conds,
    }
}

/// One VM as start-failure accounting sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartFacts {
    pub uid: String,
    pub name: String,
    /// [`super::classify::start_failure`].
    pub failure: Option<String>,
    /// [`super::classify::runner_started`].
    pub runner_started: bool,
}

/// A VM newly counted as a start failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartFailure {
    pub vm: String,
    pub reason: String,
    /// The wait it imposes before the next VM.
    pub wait: Duration,
    /// Start failures in a row, this one included.
    pub consecutive: u32,
}

/// Counts VMs that failed before their runner started into `backoff`, each once (`counted` remembers
/// uids; VMs gone from `vms` are forgotten); any started runner resets the backoff first.
pub fn account_start_failures(
    counted: &mut HashSet<String>,
    backoff: &mut Backoff,
    vms: &[StartFacts],
    now: Instant,
    base: Duration,
    max: Duration,
) -> Vec<StartFailure> {
    let present: HashSet<&str> = vms.iter().map(|v| v.uid.as_str()).collect();
    counted.retain(|u| present.contains(u.as_str()));
    if vms.iter().any(|v| v.runner_started) {
        backoff.reset();
    }
    let mut fresh = Vec::new();
    for vm in vms {
        let Some(reason) = &vm.failure else { continue };
        if counted.insert(vm.uid.clone()) {
            let wait = backoff.fail(now, base, max);
            fresh.push(StartFailure {
                vm: vm.name.clone(),
                reason: reason.clone(),
                wait,
                consecutive: backoff.failures(),
            });
        }
    }
    fresh
}

/// How long a runner VM may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// From the VM's scheduling to its runner's handoff Started.
    pub boot: Duration,
    /// From the runner's Started to GitHub listing it online (or busy).
    pub online: Duration,
    /// From the completion of the runner's job to the agent recording its exit ([`awaiting_exit`]).
    pub exit: Duration,
}

/// Why a VM is replaced before its run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overdue {
    BootDeadlineExceeded,
    RunnerNeverOnline,
}

impl Overdue {
    pub fn reason(self) -> &'static str {
        match self {
            Overdue::BootDeadlineExceeded => reason::BOOT_DEADLINE_EXCEEDED,
            Overdue::RunnerNeverOnline => reason::RUNNER_NEVER_ONLINE,
        }
    }
    /// The `reason` label of `imp_runner_deadline_replacements_total`.
    pub fn metric_label(self) -> &'static str {
        self.reason()
    }
}

/// One runner VM as the decision sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmFacts {
    pub vm: ObservedVm,
    /// When the VM was bound to a node (`status.scheduledTime`).
    pub scheduled: Option<Timestamp>,
    /// The runner's handoff Started (`status.runner.startedTime`).
    pub runner_started: Option<Timestamp>,
    /// When the job the runner took completed: `status.job.completedTime` (so it survives an operator
    /// restart), else the demand's completion time when this pass learnt it first.
    pub job_completed: Option<Timestamp>,
    /// When the agent recorded the runner's exit with code 0 (`status.runner.exitedTime`): an
    /// ephemeral runner exits 0 only after it ran a job.
    pub exited_ok: Option<Timestamp>,
    /// The demand (or `status.job`) names the job this VM's runner took.
    pub attributed: bool,
}

/// A runner registration as GitHub lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerFacts {
    pub id: u64,
    pub name: String,
    pub online: bool,
    pub busy: bool,
    pub ephemeral: bool,
}

impl From<&Runner> for RunnerFacts {
    fn from(r: &Runner) -> Self {
        RunnerFacts {
            id: r.id,
            name: r.name.clone(),
            online: r.status.eq_ignore_ascii_case("online"),
            busy: r.busy,
            ephemeral: r.ephemeral,
        }
    }
}

fn elapsed(since: Timestamp, now: Timestamp) -> Duration {
    now.duration_since(since).try_into().unwrap_or_default()
}

/// A runner whose job completed and whose exit the node agent has not recorded yet (handoff still
/// Started, no job in progress on it): the time left of its exit grace, zero once it ran out. GitHub
/// drops an ephemeral runner as its job completes, but the runner process goes on for seconds
/// (reporting, uploading logs) before it exits, and its exit code is what the pool reads (freshness,
/// `RunnerExitedNonZero`): deleting the VM at once would kill it mid-shutdown and lose that code. The
/// grace counts from the job's completion (recorded on the VM's status, so a restarted operator keeps
/// the clock) and is bounded so a runner that never exits does not pin its slot.
pub fn awaiting_exit(v: &VmFacts, d: &Deadlines, now: Timestamp) -> Option<Duration> {
    if v.vm.state != RunnerState::Idle {
        return None;
    }
    v.job_completed
        .map(|t| d.exit.saturating_sub(elapsed(t, now)))
}

/// A runner that exited 0 (so it ran a job) while the demand does not know which job it ran: the
/// time left of its grace, zero once it ran out. Until the intake learns which job the runner took
/// (a scale-set session taken over after an operator restart reads its messages only once the old
/// session expired; a lost `in_progress` webhook), the job still counts as queued, and deleting the
/// VM would let the pool mint a second runner for a job already served. Kept (not counted live) and
/// taken off the queued demand instead, until the job is attributed or the grace (the exit grace,
/// from the exit) runs out; the VM is the durable record, so a restarted operator counts it too.
pub fn awaiting_attribution(v: &VmFacts, d: &Deadlines, now: Timestamp) -> Option<Duration> {
    if v.vm.state != RunnerState::Terminal || v.attributed {
        return None;
    }
    v.exited_ok.map(|t| d.exit.saturating_sub(elapsed(t, now)))
}

/// A started runner whose online deadline passed and that was never seen online: GitHub's listing is
/// needed to judge it.
pub fn online_suspect(
    v: &VmFacts,
    d: &Deadlines,
    confirmed: &HashSet<u64>,
    now: Timestamp,
) -> bool {
    v.vm.state == RunnerState::Idle
        // A runner that served a job was online.
        && v.job_completed.is_none()
        && v.vm.runner_id.is_some_and(|id| !confirmed.contains(&id))
        && v.runner_started
            .is_some_and(|t| elapsed(t, now) >= d.online)
}

/// Whether the VM is past a deadline. `listing` is GitHub's runners by id, when taken this pass; without
/// it no runner is judged never-online.
pub fn overdue(
    v: &VmFacts,
    d: &Deadlines,
    confirmed: &HashSet<u64>,
    listing: Option<&HashMap<u64, RunnerFacts>>,
    now: Timestamp,
) -> Option<Overdue> {
    match v.vm.state {
        // Minted and scheduled but the runner never started: the boot (or handoff) is stuck. A VM not
        // yet scheduled waits for capacity, which a replacement would not find either.
        RunnerState::Booting if v.scheduled.is_some_and(|t| elapsed(t, now) >= d.boot) => {
            Some(Overdue::BootDeadlineExceeded)
        }
        RunnerState::Idle if online_suspect(v, d, confirmed, now) => {
            let listing = listing?;
            let seen =
                v.vm.runner_id
                    .and_then(|id| listing.get(&id))
                    .is_some_and(|r| r.online || r.busy);
            (!seen).then_some(Overdue::RunnerNeverOnline)
        }
        _ => None,
    }
}

/// The earliest time from `now` at which a VM crosses a deadline (to requeue the pass then).
pub fn next_deadline(
    vms: &[VmFacts],
    d: &Deadlines,
    confirmed: &HashSet<u64>,
    now: Timestamp,
) -> Option<Duration> {
    vms.iter()
        .filter_map(|v| match v.vm.state {
            RunnerState::Booting => v.scheduled.map(|t| d.boot.saturating_sub(elapsed(t, now))),
            RunnerState::Idle if v.job_completed.is_some() => awaiting_exit(v, d, now),
            RunnerState::Terminal => awaiting_attribution(v, d, now),
            RunnerState::Idle if v.vm.runner_id.is_some_and(|id| !confirmed.contains(&id)) => v
                .runner_started
                .map(|t| d.online.saturating_sub(elapsed(t, now))),
            _ => None,
        })
        .filter(|w| !w.is_zero())
        .min()
}

/// Characters of the VM uid in the runner names the pool mints ([`runner_name`]).
const RUNNER_UID_CHARS: usize = 12;

/// If `name` is a runner name this pool mints ([`runner_name`]: the pool name, shortened to fit, a dash
/// and 12 alphanumerics of the VM uid), the uid part. Hand-made names like `<pool>-1` never match.
fn pool_runner_suffix<'a>(pool: &str, name: &'a str) -> Option<&'a str> {
    let (_, suffix) = name.rsplit_once('-')?;
    (suffix.len() == RUNNER_UID_CHARS
        && suffix.chars().all(|c| c.is_ascii_alphanumeric())
        && runner_name(pool, suffix) == name)
        .then_some(suffix)
}

/// Registrations to delete, from the reaper.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reap {
    /// (runner id, name) of registrations without a VM.
    pub delete: Vec<(u64, String)>,
    /// Registrations without a VM that are running a job: left alone (GitHub refuses anyway).
    pub busy: u32,
}

/// The reaper's rule: an ephemeral registration whose name is one this pool mints and that no VM holds
/// (`held`: the runner names of every existing ImpVM of same-named pools, which the caller reads after
/// GitHub's listing so a registration minted meanwhile has its VM in it) is an orphan. Busy orphans
/// are kept. Persistent runners and other names are never touched.
pub fn orphans(pool: &str, runners: &[RunnerFacts], held: &HashSet<String>) -> Reap {
    let mut reap = Reap::default();
    for r in runners {
        if !r.ephemeral || pool_runner_suffix(pool, &r.name).is_none() || held.contains(&r.name) {
            continue;
        }
        if r.busy {
            reap.busy += 1;
        } else {
            reap.delete.push((r.id, r.name.clone()));
        }
    }
    reap
}

/// Whether this pass should list the pool's runners at GitHub: the reaper is due, or a started runner
/// needs its online deadline judged.
pub fn needs_listing(
    vms: &[VmFacts],
    d: &Deadlines,
    confirmed: &HashSet<u64>,
    reap_due: bool,
    now: Timestamp,
) -> bool {
    reap_due || vms.iter().any(|v| online_suspect(v, d, confirmed, now))
}

/// What gates minting, as the pass observed it ([`mint_block`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MintGates {
    /// The App cannot be used (its Secret is missing or bad), or a mint found its credentials invalid.
    pub creds_invalid: bool,
    /// The pool names no scope (repository, organization, enterprise) to register runners in.
    pub no_scope: bool,
    /// The mint backoff ([`Backoff`]) is running.
    pub mint_backoff: bool,
    /// The start-failure backoff is running.
    pub start_backoff: bool,
    /// Freshness stopped minting: GitHub refused the pool's runner version as deprecated.
    pub version_deprecated: bool,
}

/// Why the pass may not mint, most lasting first: without credentials (or a scope) nothing mints,
/// whatever else holds; a deprecated version stops minting until the pool changes, which outlasts a
/// backoff; a failed mint waits before a VM that failed to start.
pub fn mint_block(g: &MintGates) -> Option<MintBlock> {
    if g.creds_invalid || g.no_scope {
        Some(MintBlock::CredentialsInvalid)
    } else if g.version_deprecated {
        Some(MintBlock::RunnerVersionDeprecated)
    } else if g.mint_backoff {
        Some(MintBlock::Backoff)
    } else if g.start_backoff {
        Some(MintBlock::StartFailing)
    } else {
        None
    }
}

/// Whether to list the pool's runners at GitHub before deciding: `Some(fresh)` when the reaper is due
/// (no listing yet, or the last one `reap_interval` ago) or a started runner's online deadline needs
/// judging; `fresh` when it is the latter, which needs GitHub's current view rather than another
/// pool's recent listing of the scope.
pub fn listing_wanted(
    vms: &[VmFacts],
    d: &Deadlines,
    confirmed: &HashSet<u64>,
    since_listing: Option<Duration>,
    reap_interval: Duration,
    now: Timestamp,
) -> Option<bool> {
    let reap_due = since_listing.is_none_or(|t| t >= reap_interval);
    needs_listing(vms, d, confirmed, reap_due, now)
        .then(|| vms.iter().any(|v| online_suspect(v, d, confirmed, now)))
}

/// Values of the `phase` label of `imp_runner_vm_phase_seconds`, in life order.
pub const VM_PHASES: [&str; 4] = ["scheduling", "booting", "handoff", "job"];

/// How long a finished runner VM spent in each phase it went through: created -> scheduled
/// (`scheduling`), scheduled -> guest booted (`booting`), booted -> runner Started (`handoff`), Started
/// -> runner exited (`job`). A phase whose end (or start) was never recorded is left out, as is one whose
/// clock ran backwards (clock skew between operator and node).
pub fn phase_spans(t: &VmTimes) -> Vec<(&'static str, Duration)> {
    let points = [
        t.created,
        t.scheduled,
        t.boot_complete,
        t.runner_started,
        t.runner_exited,
    ];
    VM_PHASES
        .iter()
        .zip(points.windows(2))
        .filter_map(|(phase, w)| {
            let (from, to) = (w[0]?, w[1]?);
            (to >= from).then(|| (*phase, elapsed(from, to)))
        })
        .collect()
}

/// Everything one pass of a live pool depends on.
pub struct Input<'a> {
    pub vms: &'a [VmFacts],
    pub scaling: &'a Scaling,
    pub queued: u32,
    pub gates: MintGates,
    pub demand_known: bool,
    pub deadlines: Deadlines,
    /// Runner ids GitHub has listed online or busy before.
    pub confirmed_online: &'a HashSet<u64>,
    /// GitHub's listing of the pool's scope, when taken this pass, with the runner names held by VMs.
    pub listing: Option<(&'a [RunnerFacts], &'a HashSet<String>)>,
    pub pool_name: &'a str,
    pub now: Timestamp,
    /// The runner VMs' SLO records and the jobs their runners took ([`super::slo`]).
    pub served: &'a [ServedFacts],
    pub status: StatusBasis,
    pub timing: RequeueTiming,
}

/// What one pass of a live pool should do.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolPlan {
    /// Scaling: creates, mints, retirements, cleanup of finished VMs.
    pub plan: Plan,
    /// VMs past a deadline: deregister, delete (the plan already counts them as gone and replaces them).
    pub replace: Vec<(Removal, Overdue)>,
    /// Orphan registrations to delete.
    pub reap: Reap,
    /// Runner ids newly seen online or busy (remembered so they are never judged again).
    pub seen_online: Vec<u64>,
    /// Runner VMs whose job completed, kept within their exit grace for the agent to record the
    /// runner's exit ([`awaiting_exit`]).
    pub awaiting_exit: Vec<String>,
    /// Runner VMs that exited 0 with their job not yet attributed, kept and taken off the queued
    /// demand ([`awaiting_attribution`]).
    pub awaiting_attribution: Vec<String>,
    /// Requeue by then to judge the next deadline (or the end of an exit grace).
    pub next_deadline: Option<Duration>,
    /// `status.job` writes of VMs whose served job is newly known or changed.
    pub served: Vec<ServedUpdate>,
    /// The pool's status once every step succeeds ([`settle`] with [`Outcome::planned`]).
    pub status: ImpVMRunnerPoolStatus,
    /// What the status is decided from besides the plan, for [`settle`].
    pub basis: StatusBasis,
    pub timing: RequeueTiming,
}

pub fn decide(i: &Input) -> PoolPlan {
    let by_id: Option<HashMap<u64, RunnerFacts>> = i
        .listing
        .map(|(rs, _)| rs.iter().map(|r| (r.id, r.clone())).collect());
    let mut out = PoolPlan::default();
    let mut observed = Vec::with_capacity(i.vms.len());
    for v in i.vms {
        let mut vm = v.vm.clone();
        if awaiting_attribution(v, &i.deadlines, i.now).is_some_and(|left| !left.is_zero()) {
            // It served one of the queued jobs, not yet known which: neither cleaned up nor live.
            out.awaiting_attribution.push(vm.name.clone());
            continue;
        }
        if let Some(left) = awaiting_exit(v, &i.deadlines, i.now) {
            // Still finishing its job: counted busy (it holds its slot, is never retired, and a
            // replacement is not made for it) until the agent records the exit, which makes it
            // terminal; past the grace it is finished as if it had exited.
            vm.state = if left.is_zero() {
                RunnerState::Terminal
            } else {
                out.awaiting_exit.push(vm.name.clone());
                RunnerState::Busy
            };
        } else if let Some(why) =
            overdue(v, &i.deadlines, i.confirmed_online, by_id.as_ref(), i.now)
        {
            out.replace.push((
                Removal {
                    name: vm.name.clone(),
                    runner_id: vm.runner_id,
                },
                why,
            ));
            // Counted as finished so the plan creates its replacement in the same pass.
            vm.state = RunnerState::Terminal;
        } else if let (Some(id), Some(by_id)) = (vm.runner_id, by_id.as_ref())
            && !i.confirmed_online.contains(&id)
            && by_id.get(&id).is_some_and(|r| r.online || r.busy)
        {
            out.seen_online.push(id);
        }
        observed.push(vm);
    }
    out.plan = plan(&Observed {
        vms: &observed,
        scaling: i.scaling,
        queued: i
            .queued
            .saturating_sub(out.awaiting_attribution.len() as u32),
        mint_block: mint_block(&i.gates),
        deleting: false,
        demand_known: i.demand_known,
    });
    out.plan
        .cleanup
        .retain(|c| !out.replace.iter().any(|(r, _)| r.name == c.name));
    if let Some((runners, held)) = i.listing {
        out.reap = orphans(i.pool_name, runners, held);
    }
    let mut confirmed = i.confirmed_online.clone();
    confirmed.extend(out.seen_online.iter().copied());
    out.next_deadline = next_deadline(i.vms, &i.deadlines, &confirmed, i.now);
    out.served = served_updates(i.served);
    out.basis = i.status.clone();
    out.timing = i.timing;
    out.status = settle(&out, &Outcome::planned(&out), i.now).status;
    out
}

/// What the pool's status is decided from besides the plan, observed at the start of the pass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StatusBasis {
    pub old: ImpVMRunnerPoolStatus,
    pub generation: Option<i64>,
    pub max_runners: u32,
    /// What the last sweeps learnt of the pool's scope.
    pub sweep: Sweep,
    /// The runner version's verdict ([`super::freshness`]).
    pub freshness: super::freshness::Freshness,
    /// The credentials as the pass found them.
    pub creds: Creds,
}

/// The controller's timing that sets when the next pass runs ([`requeue_after`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequeueTiming {
    pub resync: Duration,
    pub retry: Duration,
    pub scaling_requeue: Duration,
    pub reap_interval: Duration,
}

/// What executing a [`PoolPlan`] came to. Every step is a call GitHub or the API server may refuse,
/// which no plan can know beforehand; [`settle`] turns this into the status, Events and requeue.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub done: Done,
    /// A mint or creation failed (the executor stops minting at the first failure).
    pub mint_failed: bool,
    /// A removal or deregistration is left to retry.
    pub pending: bool,
    /// Names of the orphan registrations deleted.
    pub reaped: Vec<String>,
    /// The credentials as the pass left them (a failed mint may have found them invalid).
    pub creds: Creds,
    /// Time left on the mint and start backoffs (a failed mint restarts its backoff).
    pub backoffs: Vec<Duration>,
    /// Time since the pool's last runner listing (this pass's, if it took one).
    pub since_listing: Option<Duration>,
}

impl Outcome {
    /// Every step of `pp` succeeded: the outcome [`PoolPlan::status`] is decided for.
    pub fn planned(pp: &PoolPlan) -> Outcome {
        let p = &pp.plan;
        Outcome {
            done: Done {
                created: p.create,
                retired: p.retire.len() as u32,
                cleaned: (p.cleanup.len() + pp.replace.len()) as u32,
            },
            mint_failed: false,
            pending: false,
            reaped: pp.reap.delete.iter().map(|(_, n)| n.clone()).collect(),
            creds: pp.basis.creds.clone(),
            backoffs: Vec::new(),
            since_listing: None,
        }
    }
}

/// An Event a pass posts on its pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

/// What a pass ends with, from its plan and what executing it came to.
#[derive(Debug, Clone, PartialEq)]
pub struct Settled {
    pub status: ImpVMRunnerPoolStatus,
    /// In the order they are posted, before the status is written.
    pub events: Vec<Note>,
    pub requeue: Duration,
}

/// The status, Events and requeue a pass ends with. A separate step after execution, because each of
/// them depends on which calls succeeded: the counts on the VMs actually created, retired and cleaned
/// up; ScalingLimited on a failed mint; CredentialsValid and Ready on credentials a mint found invalid;
/// the requeue on what is left to retry and the backoffs a failure started. With the planned outcome
/// ([`Outcome::planned`]) it gives the status [`decide`] returns.
pub fn settle(pp: &PoolPlan, o: &Outcome, now: Timestamp) -> Settled {
    let (p, b, t) = (&pp.plan, &pp.basis, &pp.timing);
    let status = pool_status(&StatusInput {
        old: &b.old,
        plan: p,
        done: o.done,
        creds: &o.creds,
        mint_failed: o.mint_failed,
        generation: b.generation,
        max_runners: b.max_runners,
        sweep: &b.sweep,
        now,
        freshness: &b.freshness,
    });
    let mut events = Vec::new();
    let mut note = |warning: bool, reason: &'static str, message: String| {
        events.push(Note {
            warning,
            reason,
            message,
        })
    };
    if !o.reaped.is_empty() {
        note(
            false,
            reason::ORPHAN_RUNNERS_DELETED,
            format!(
                "Deleted {} runner registration(s) without a VM: {}",
                o.reaped.len(),
                o.reaped.join(", ")
            ),
        );
    }
    let Done {
        created,
        retired,
        cleaned,
    } = o.done;
    if created > 0 {
        note(
            false,
            reason::SCALED_UP,
            format!("Created {created} runner VM(s); desired {}", p.desired),
        );
    }
    if retired > 0 {
        note(
            false,
            reason::SCALED_DOWN,
            format!("Retired {retired} idle runner(s); desired {}", p.desired),
        );
    }
    // The replaced VMs had their own Event when removed.
    let finished = cleaned - cleaned.min(pp.replace.len() as u32);
    if finished > 0 {
        note(
            false,
            reason::RUNNERS_CLEANED_UP,
            format!("Deleted {finished} finished runner VM(s)"),
        );
    }
    if o.creds != b.creds
        && let Creds::Invalid { reason, message } = &o.creds
    {
        note(true, reason, message.clone());
    }
    let requeue = requeue_after(&RequeueInput {
        resync: t.resync,
        retry: t.retry,
        scaling_requeue: t.scaling_requeue,
        pending: o.pending,
        backoffs: o.backoffs.clone(),
        scaling_pending: p.limited == Some(Limit::ScaleUpStep)
            || (created > 0 && p.desired > p.counts.live() + created),
        next_deadline: pp.next_deadline,
        next_reap: o
            .since_listing
            .map_or(Duration::ZERO, |s| t.reap_interval.saturating_sub(s)),
    });
    Settled {
        status,
        events,
        requeue,
    }
}

/// When the next pass should run, from what this one left: retries, backoffs, a scale-up still held
/// back, the next deadline and the reaper.
pub struct RequeueInput {
    pub resync: Duration,
    pub retry: Duration,
    pub scaling_requeue: Duration,
    /// A removal or call failed and should be retried.
    pub pending: bool,
    /// Time left on the mint and start backoffs.
    pub backoffs: Vec<Duration>,
    /// Scaling is held back by scaleUpStep, or creations fell short of desired.
    pub scaling_pending: bool,
    pub next_deadline: Option<Duration>,
    pub next_reap: Duration,
}

pub fn requeue_after(r: &RequeueInput) -> Duration {
    let mut next = r.resync.min(r.next_reap);
    if r.pending {
        next = next.min(r.retry);
    }
    for b in &r.backoffs {
        next = next.min(*b + Duration::from_millis(10));
    }
    if let Some(d) = r.next_deadline {
        next = next.min(d + Duration::from_millis(10));
    }
    if r.scaling_pending {
        next = next.min(r.scaling_requeue);
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;
    use RunnerState::*;

    const D: Deadlines = Deadlines {
        boot: Duration::from_secs(600),
        online: Duration::from_secs(300),
        exit: Duration::from_secs(60),
    };

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn facts(name: &str, state: RunnerState, id: Option<u64>) -> VmFacts {
        VmFacts {
            vm: ObservedVm {
                name: name.into(),
                state,
                runner_id: id,
                created: 0,
            },
            scheduled: None,
            runner_started: None,
            job_completed: None,
            exited_ok: None,
            attributed: false,
        }
    }

    fn runner(id: u64, name: &str, online: bool, busy: bool) -> RunnerFacts {
        RunnerFacts {
            id,
            name: name.into(),
            online,
            busy,
            ephemeral: true,
        }
    }

    fn secret(owned: bool) -> JitSecretFacts {
        JitSecretFacts {
            owned_by_vm: owned,
            runner_id: Some("7".into()),
            runner_name: Some("p-abc".into()),
        }
    }

    #[test]
    fn mint_policy_adopts_refuses_replaces_or_mints() {
        let adopt = MintAction::Adopt {
            runner_id: Some("7".into()),
            runner_name: Some("p-abc".into()),
        };
        assert_eq!(mint_action(Some(&secret(true)), None), adopt);
        // An owned Secret wins even when the VM was annotated: it is the proof of the mint.
        assert_eq!(mint_action(Some(&secret(true)), Some("7")), adopt);
        assert_eq!(
            mint_action(Some(&secret(false)), None),
            MintAction::Conflict
        );
        assert_eq!(
            mint_action(Some(&secret(false)), Some("7")),
            MintAction::Conflict
        );
        assert_eq!(
            mint_action(None, Some("42")),
            MintAction::Lost {
                runner_id: Some(42)
            }
        );
        assert_eq!(
            mint_action(None, Some("junk")),
            MintAction::Lost { runner_id: None }
        );
        assert_eq!(mint_action(None, None), MintAction::Mint);
        assert_eq!(after_store_conflict(Some(&secret(true))), adopt);
        assert_eq!(
            after_store_conflict(Some(&secret(false))),
            MintAction::Conflict
        );
        assert_eq!(after_store_conflict(None), MintAction::Conflict);
    }

    #[test]
    fn only_configuration_errors_invalidate_credentials() {
        use crate::github::errors::Operation;
        let op = Operation::GenerateJitConfig;
        let invalid = [
            GithubError::Unauthorized {
                operation: op,
                message: "m".into(),
                hint: "h".into(),
            },
            GithubError::Forbidden {
                operation: op,
                message: "m".into(),
                hint: "h".into(),
            },
            GithubError::EnterpriseScopeUnsupported,
            GithubError::RunnerGroupNotFound {
                org: "o".into(),
                name: "g".into(),
            },
        ];
        for e in &invalid {
            assert!(credentials_invalid(e), "{e}");
        }
        let transient = [
            GithubError::Server {
                operation: op,
                status: 502,
            },
            GithubError::Timeout {
                operation: op,
                after: Duration::from_secs(1),
            },
            GithubError::Conflict {
                operation: op,
                message: "exists".into(),
            },
            GithubError::RunnerBusy { runner_id: 1 },
        ];
        for e in &transient {
            assert!(!credentials_invalid(e), "{e}");
        }
    }

    fn status_of(
        plan: &Plan,
        done: Done,
        creds: &Creds,
        mint_failed: bool,
    ) -> ImpVMRunnerPoolStatus {
        pool_status(&StatusInput {
            old: &ImpVMRunnerPoolStatus::default(),
            plan,
            done,
            creds,
            mint_failed,
            generation: Some(3),
            max_runners: 4,
            sweep: &Sweep::Unknown,
            now: t(0),
            freshness: &Default::default(),
        })
    }

    #[test]
    fn freshness_becomes_the_runner_version_and_degraded_conditions() {
        use super::super::freshness::Freshness;
        let f = Freshness {
            status: imp_api::RunnerVersionStatus {
                version: Some("2.329.0".into()),
                latest: Some("2.330.0".into()),
                refused_generation: Some(1),
                ..Default::default()
            },
            supported: (
                Some(false),
                reason::RUNNER_VERSION_DEPRECATED,
                "superseded".into(),
            ),
            degraded: (true, reason::RUNNER_VERSION_DEPRECATED, "refused".into()),
            minting_stopped: true,
        };
        let st = pool_status(&StatusInput {
            old: &ImpVMRunnerPoolStatus::default(),
            plan: &Plan::default(),
            done: Done::default(),
            creds: &Creds::Unknown,
            mint_failed: false,
            generation: Some(1),
            max_runners: 4,
            sweep: &Sweep::Unknown,
            now: t(0),
            freshness: &f,
        });
        let c = cond(&st, condition::RUNNER_VERSION_SUPPORTED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", reason::RUNNER_VERSION_DEPRECATED)
        );
        let d = cond(&st, condition::DEGRADED);
        assert_eq!(
            (d.status.as_str(), d.reason.as_str(), d.message.as_str()),
            ("True", reason::RUNNER_VERSION_DEPRECATED, "refused")
        );
        assert_eq!(st.runner_version.as_ref(), Some(&f.status));
        // Unknown freshness (no version set) is an Unknown condition, not a False one.
        let st = status_of(&Plan::default(), Done::default(), &Creds::Unknown, false);
        assert_eq!(
            cond(&st, condition::RUNNER_VERSION_SUPPORTED).status,
            "Unknown"
        );
        assert_eq!(cond(&st, condition::DEGRADED).status, "False");
    }

    #[test]
    fn the_sweep_s_page_cap_is_a_condition_naming_the_pool_s_repositories() {
        let capped = ["acme/big".to_owned(), "other/big".to_owned()];
        let acme = |r: &str| r.starts_with("acme/");
        assert_eq!(
            Sweep::of(&capped, acme, true),
            Sweep::PageCap(vec!["acme/big".into()])
        );
        assert_eq!(
            Sweep::of(&capped, |r| r == "acme/app", true),
            Sweep::Complete,
            "another scope's capped repository is not the pool's"
        );
        assert_eq!(Sweep::of(&[], acme, false), Sweep::Unknown);
        let status = |old: &ImpVMRunnerPoolStatus, sweep: &Sweep| {
            pool_status(&StatusInput {
                old,
                plan: &Plan::default(),
                done: Done::default(),
                creds: &Creds::Unknown,
                mint_failed: false,
                generation: Some(1),
                max_runners: 4,
                sweep,
                now: t(0),
                freshness: &Default::default(),
            })
        };
        let none = status(&ImpVMRunnerPoolStatus::default(), &Sweep::Unknown);
        assert!(conditions::find(&none.conditions, condition::DEMAND_LISTED).is_none());
        let many: Vec<String> = (0..7).map(|i| format!("acme/r{i}")).collect();
        let capped = status(&none, &Sweep::PageCap(many));
        let c = cond(&capped, condition::DEMAND_LISTED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", reason::SWEEP_PAGE_CAP)
        );
        assert!(
            c.message
                .starts_with("acme/r0, acme/r1, acme/r2, acme/r3, acme/r4 and 2 more:"),
            "{}",
            c.message
        );
        let kept = status(&capped, &Sweep::Unknown);
        assert_eq!(
            cond(&kept, condition::DEMAND_LISTED).reason,
            reason::SWEEP_PAGE_CAP,
            "a sweep that learnt nothing keeps the condition"
        );
        let listed = status(&kept, &Sweep::Complete);
        let c = cond(&listed, condition::DEMAND_LISTED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", reason::SWEEP_COMPLETE)
        );
    }

    fn cond<'a>(
        s: &'a ImpVMRunnerPoolStatus,
        type_: &str,
    ) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        conditions::find(&s.conditions, type_).expect(type_)
    }

    #[test]
    fn status_counts_what_the_pass_did_and_derives_conditions() {
        let mut p = Plan {
            desired: 3,
            ..Plan::default()
        };
        p.counts.idle = 2;
        p.counts.busy = 1;
        p.counts.unminted = 1;
        p.counts.terminal = 2;
        let s = status_of(
            &p,
            Done {
                created: 1,
                retired: 1,
                cleaned: 2,
            },
            &Creds::Valid,
            false,
        );
        // total: 4 live + 2 terminal + 1 created - 1 retired - 2 cleaned.
        assert_eq!(
            (s.desired, s.idle, s.busy, s.booting, s.total),
            (3, 1, 1, 2, 4)
        );
        assert_eq!(s.observed_generation, Some(3));
        assert!(s.last_scale_time.is_some());
        assert_eq!(cond(&s, condition::READY).reason, reason::RUNNERS_AVAILABLE);
        assert_eq!(
            cond(&s, condition::CREDENTIALS_VALID).reason,
            reason::MINTED
        );
        assert_eq!(
            cond(&s, condition::SCALING_LIMITED).reason,
            reason::NOT_LIMITED
        );
        assert_eq!(
            cond(&s, condition::AT_CAPACITY).reason,
            reason::BELOW_MAX_RUNNERS
        );

        let invalid = Creds::Invalid {
            reason: reason::SECRET_NOT_FOUND,
            message: "App Secret `a` not found".into(),
        };
        let s = status_of(&p, Done::default(), &invalid, false);
        assert_eq!(s.last_scale_time, None, "nothing changed");
        assert_eq!(
            cond(&s, condition::READY).reason,
            reason::RUNNERS_PENDING,
            "bad credentials are never ready"
        );
        let c = cond(&s, condition::CREDENTIALS_VALID);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", reason::SECRET_NOT_FOUND)
        );

        let s = status_of(&p, Done::default(), &Creds::Unknown, true);
        assert_eq!(cond(&s, condition::CREDENTIALS_VALID).status, "Unknown");
        assert_eq!(
            cond(&s, condition::SCALING_LIMITED).reason,
            reason::MINT_BACKOFF
        );
        p.limited = Some(Limit::MaxRunners);
        p.at_capacity = true;
        let s = status_of(&p, Done::default(), &Creds::Valid, true);
        assert_eq!(
            cond(&s, condition::SCALING_LIMITED).reason,
            reason::MAX_RUNNERS,
            "the plan's limit wins"
        );
        assert_eq!(
            cond(&s, condition::AT_CAPACITY).reason,
            reason::MAX_RUNNERS_REACHED
        );
    }

    #[test]
    fn start_failures_count_once_and_a_started_runner_resets() {
        let now = Instant::now();
        let (base, max) = (Duration::from_secs(10), Duration::from_secs(300));
        let fail = |uid: &str| StartFacts {
            uid: uid.into(),
            name: format!("vm-{uid}"),
            failure: Some(reason::ROOTFS_REJECTED.into()),
            runner_started: false,
        };
        let (mut counted, mut b) = (HashSet::new(), Backoff::default());
        let fresh = account_start_failures(
            &mut counted,
            &mut b,
            &[fail("a"), fail("b")],
            now,
            base,
            max,
        );
        assert_eq!(fresh.len(), 2);
        assert_eq!(
            (fresh[1].consecutive, fresh[1].wait),
            (2, Duration::from_secs(20))
        );
        assert_eq!(fresh[0].reason, reason::ROOTFS_REJECTED);
        // Seen again: not counted again.
        assert!(
            account_start_failures(
                &mut counted,
                &mut b,
                &[fail("a"), fail("b")],
                now,
                base,
                max
            )
            .is_empty()
        );
        assert_eq!(b.failures(), 2);
        // "a" is gone (forgotten); a runner started on "c": the backoff resets before "d" counts.
        let ok = StartFacts {
            uid: "c".into(),
            name: "vm-c".into(),
            failure: None,
            runner_started: true,
        };
        let fresh = account_start_failures(
            &mut counted,
            &mut b,
            &[fail("b"), ok, fail("d")],
            now,
            base,
            max,
        );
        assert_eq!(fresh.len(), 1);
        assert_eq!((fresh[0].vm.as_str(), fresh[0].consecutive), ("vm-d", 1));
        assert!(!counted.contains("a"));
    }

    #[test]
    fn boot_deadline_counts_from_scheduling() {
        let none = HashSet::new();
        let mut v = facts("a", Booting, Some(1));
        assert_eq!(
            overdue(&v, &D, &none, None, t(10_000)),
            None,
            "never scheduled: waits for capacity"
        );
        v.scheduled = Some(t(0));
        assert_eq!(overdue(&v, &D, &none, None, t(599)), None);
        assert_eq!(
            overdue(&v, &D, &none, None, t(600)),
            Some(Overdue::BootDeadlineExceeded)
        );
        assert_eq!(
            next_deadline(std::slice::from_ref(&v), &D, &none, t(590)),
            Some(Duration::from_secs(10))
        );
        for state in [Unminted, Busy, Terminal, Deleting] {
            v.vm.state = state;
            assert_eq!(overdue(&v, &D, &none, None, t(10_000)), None, "{state:?}");
        }
    }

    #[test]
    fn never_online_needs_githubs_listing_and_spares_seen_runners() {
        let mut v = facts("a", Idle, Some(1));
        v.runner_started = Some(t(0));
        let none = HashSet::new();
        let offline: HashMap<u64, RunnerFacts> = [(1, runner(1, "p-a", false, false))].into();
        let online: HashMap<u64, RunnerFacts> = [(1, runner(1, "p-a", true, false))].into();
        let busy: HashMap<u64, RunnerFacts> = [(1, runner(1, "p-a", false, true))].into();
        let gone = HashMap::new();
        assert_eq!(
            overdue(&v, &D, &none, Some(&offline), t(299)),
            None,
            "before the deadline"
        );
        assert!(!online_suspect(&v, &D, &none, t(299)));
        assert!(online_suspect(&v, &D, &none, t(300)));
        assert_eq!(
            overdue(&v, &D, &none, None, t(300)),
            None,
            "no listing, no verdict"
        );
        assert_eq!(
            overdue(&v, &D, &none, Some(&offline), t(300)),
            Some(Overdue::RunnerNeverOnline)
        );
        assert_eq!(
            overdue(&v, &D, &none, Some(&gone), t(300)),
            Some(Overdue::RunnerNeverOnline)
        );
        assert_eq!(overdue(&v, &D, &none, Some(&online), t(300)), None);
        assert_eq!(overdue(&v, &D, &none, Some(&busy), t(300)), None);
        let seen: HashSet<u64> = [1].into();
        assert_eq!(
            overdue(&v, &D, &seen, Some(&offline), t(300)),
            None,
            "seen online once: never judged again"
        );
        assert!(!online_suspect(&v, &D, &seen, t(300)));
        assert_eq!(
            next_deadline(std::slice::from_ref(&v), &D, &seen, t(0)),
            None
        );
        assert_eq!(
            next_deadline(std::slice::from_ref(&v), &D, &none, t(100)),
            Some(Duration::from_secs(200))
        );
    }

    #[test]
    fn the_reaper_deletes_only_this_pools_idle_ephemeral_orphans() {
        let uid = "0123456789ab";
        let mine = runner_name("p", uid);
        let held_name = runner_name("p", "ffffffffffff");
        let held: HashSet<String> = [held_name.clone()].into();
        let mut persistent = runner(5, &runner_name("p", "aaaaaaaaaaaa"), false, false);
        persistent.ephemeral = false;
        let runners = vec![
            runner(1, &mine, false, false),
            runner(2, &held_name, false, false),
            runner(3, &runner_name("other", uid), false, false),
            runner(4, &runner_name("p", "bbbbbbbbbbbb"), true, true),
            persistent,
            runner(6, "p-", false, false),
            runner(7, "p-handmade-runner", false, false),
            runner(8, &runner_name("p", "cccccccccccc"), true, false),
        ];
        let reap = orphans("p", &runners, &held);
        let ids: Vec<u64> = reap.delete.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, vec![1, 8], "an idle online orphan goes too");
        assert_eq!(reap.busy, 1);
        // A pool named like another's prefix does not claim its runners.
        assert!(orphans("p-x", &runners, &HashSet::new()).delete.is_empty());
        // Long pool names are shortened in runner names; the rule follows.
        let long = "a".repeat(70);
        let n = runner_name(&long, uid);
        assert_eq!(
            orphans(&long, &[runner(9, &n, false, false)], &HashSet::new())
                .delete
                .len(),
            1
        );
    }

    #[test]
    fn listing_is_taken_when_the_reaper_is_due_or_a_deadline_needs_it() {
        let none = HashSet::new();
        let mut v = facts("a", Idle, Some(1));
        v.runner_started = Some(t(0));
        let vms = [v];
        assert!(needs_listing(&vms, &D, &none, true, t(0)));
        assert!(!needs_listing(&vms, &D, &none, false, t(10)));
        assert!(needs_listing(&vms, &D, &none, false, t(300)));
        assert!(!needs_listing(&vms, &D, &[1].into(), false, t(300)));
    }

    fn scaling(min_idle: u32, max: u32) -> Scaling {
        Scaling {
            min_idle: Some(min_idle),
            max_runners: max,
            scale_up_step: Some(10),
            standby: None,
        }
    }

    #[test]
    fn an_overdue_vm_is_replaced_in_the_same_pass() {
        let mut stuck = facts("stuck", Idle, Some(1));
        stuck.runner_started = Some(t(0));
        let mut ok = facts("ok", Idle, Some(2));
        ok.runner_started = Some(t(0));
        let vms = [stuck, ok];
        let runners = vec![
            runner(1, "p-1", false, false),
            runner(2, "p-2", true, false),
        ];
        let held = HashSet::new();
        let sc = scaling(0, 2);
        let none = HashSet::new();
        let p = decide(&Input {
            vms: &vms,
            scaling: &sc,
            queued: 2,
            gates: MintGates::default(),
            demand_known: true,
            deadlines: D,
            confirmed_online: &none,
            listing: Some((&runners, &held)),
            pool_name: "p",
            served: &[],
            now: t(301),
            status: StatusBasis::default(),
            timing: RequeueTiming::default(),
        });
        assert_eq!(p.replace.len(), 1);
        assert_eq!(
            p.replace[0].0,
            Removal {
                name: "stuck".into(),
                runner_id: Some(1)
            }
        );
        assert_eq!(p.replace[0].1.reason(), reason::RUNNER_NEVER_ONLINE);
        assert!(p.plan.cleanup.is_empty(), "replaced, not cleaned up twice");
        assert_eq!((p.plan.desired, p.plan.create), (2, 1));
        assert_eq!(p.seen_online, vec![2]);
        assert_eq!(p.next_deadline, None);
        assert!(
            p.reap.delete.is_empty(),
            "p-1 / p-2 are not names this pool mints"
        );
        // Without a listing, the stuck runner waits for one and the next deadline is now.
        let p = decide(&Input {
            vms: &vms,
            scaling: &sc,
            queued: 2,
            gates: MintGates::default(),
            demand_known: true,
            deadlines: D,
            confirmed_online: &none,
            listing: None,
            pool_name: "p",
            served: &[],
            now: t(301),
            status: StatusBasis::default(),
            timing: RequeueTiming::default(),
        });
        assert!(p.replace.is_empty() && p.seen_online.is_empty());
        assert_eq!(p.plan.create, 0);
    }

    /// One pass over `vms` at `now` with minIdle 0, no demand and the demand known (so any idle runner
    /// is surplus and would be retired), and a listing in which none of the runners exists any more.
    fn pass(vms: &[VmFacts], now: Timestamp) -> PoolPlan {
        pass_queued(vms, 0, now)
    }

    /// [`pass`] with `queued` jobs waiting.
    fn pass_queued(vms: &[VmFacts], queued: u32, now: Timestamp) -> PoolPlan {
        let sc = scaling(0, 5);
        let (none, held) = (HashSet::new(), HashSet::new());
        decide(&Input {
            vms,
            scaling: &sc,
            queued,
            gates: MintGates::default(),
            demand_known: true,
            deadlines: D,
            confirmed_online: &none,
            listing: Some((&[], &held)),
            pool_name: "p",
            served: &[],
            now,
            status: StatusBasis::default(),
            timing: RequeueTiming {
                resync: Duration::from_secs(300),
                retry: Duration::from_secs(10),
                scaling_requeue: Duration::from_millis(200),
                reap_interval: Duration::from_secs(120),
            },
        })
    }

    fn removed(p: &PoolPlan) -> Vec<&str> {
        let plan = &p.plan;
        plan.cleanup
            .iter()
            .chain(&plan.retire)
            .chain(p.replace.iter().map(|(r, _)| r))
            .map(|r| r.name.as_str())
            .collect()
    }

    #[test]
    fn a_runner_whose_job_completed_is_kept_for_its_exit_within_the_grace() {
        // Handoff Started, its job completed at t(100), GitHub has dropped it: the agent has not
        // recorded the exit yet. Started long ago and never confirmed online: not judged by the online
        // deadline either (it served a job).
        let mut v = facts("done", Idle, Some(1));
        v.runner_started = Some(t(0));
        v.job_completed = Some(t(100));
        let vms = [v];
        let p = pass(&vms, t(101));
        assert!(removed(&p).is_empty(), "{p:?}");
        assert_eq!(p.awaiting_exit, vec!["done".to_string()]);
        assert_eq!(
            (p.plan.counts.busy, p.plan.counts.idle, p.plan.create),
            (1, 0, 0),
            "holds its slot as busy; no replacement, never retired"
        );
        assert_eq!(p.next_deadline, Some(Duration::from_secs(59)));
        let listed_now = Outcome {
            since_listing: Some(Duration::ZERO),
            ..Outcome::planned(&p)
        };
        assert_eq!(
            settle(&p, &listed_now, t(101)).requeue,
            Duration::from_secs(59) + Duration::from_millis(10),
            "the pass comes back when the grace ends"
        );
        assert_eq!(p.status.busy, 1);
        // Still within at t(159).
        assert!(removed(&pass(&vms, t(159))).is_empty());

        // Past the grace: finished as if it had exited (deregistered, deleted).
        let p = pass(&vms, t(160));
        assert_eq!(removed(&p), vec!["done"]);
        assert_eq!(
            p.plan.cleanup.len(),
            1,
            "cleaned up, not retired or replaced"
        );
        assert!(p.awaiting_exit.is_empty());
        assert_eq!(p.next_deadline, None);
    }

    #[test]
    fn an_exited_runner_or_one_without_a_completed_job_is_handled_as_before() {
        // The agent recorded the exit (classified terminal): deleted at once, whatever the grace.
        let mut exited = facts("exited", Terminal, Some(1));
        exited.runner_started = Some(t(0));
        exited.job_completed = Some(t(100));
        let p = pass(&[exited], t(100));
        assert_eq!(removed(&p), vec!["exited"]);
        assert!(p.awaiting_exit.is_empty());
        assert_eq!(p.next_deadline, None);

        // Idle without a completed job: surplus, retired as before.
        let mut idle = facts("idle", Idle, Some(2));
        idle.runner_started = Some(t(0));
        let p = pass(std::slice::from_ref(&idle), t(10));
        assert_eq!(p.plan.retire.len(), 1);
        assert!(p.awaiting_exit.is_empty());

        // Never handed off (booting, or never minted): the grace does not apply, even with a job
        // completion known; the boot deadline still does.
        for (state, id) in [(Booting, Some(3)), (Unminted, None)] {
            let mut v = facts("boot", state, id);
            v.scheduled = Some(t(0));
            v.job_completed = Some(t(5));
            let p = pass(std::slice::from_ref(&v), t(10));
            assert!(p.awaiting_exit.is_empty(), "{state:?}");
            assert_eq!(
                awaiting_exit(&v, &D, t(10)),
                None,
                "{state:?} is not awaiting an exit"
            );
        }
        let mut booting = facts("boot", Booting, Some(3));
        booting.scheduled = Some(t(0));
        booting.job_completed = Some(t(5));
        let p = pass(&[booting], t(600));
        assert_eq!(p.replace.len(), 1, "the boot deadline still replaces it");

        // A busy runner (its job in progress) is untouched by the grace.
        let mut busy = facts("busy", Busy, Some(4));
        busy.runner_started = Some(t(0));
        busy.job_completed = Some(t(5));
        let p = pass(&[busy], t(10));
        assert!(removed(&p).is_empty() && p.awaiting_exit.is_empty());
    }

    /// A runner that exited 0 (it ran a job) whose job the demand cannot name yet.
    fn served_unknown(name: &str, exited: i64) -> VmFacts {
        let mut v = facts(name, Terminal, Some(9));
        v.runner_started = Some(t(0));
        v.exited_ok = Some(t(exited));
        v
    }

    #[test]
    fn a_runner_that_ran_an_unattributed_job_stands_for_it_until_attributed_or_its_grace_ends() {
        // Three jobs queued as the demand sees it (a scale set's ledger not read since a restart);
        // two runners already ran two of them and exited 0: one VM is made, not three, and the two
        // are neither deleted nor counted live.
        let vms = [served_unknown("a", 100), served_unknown("b", 110)];
        let p = pass_queued(&vms, 3, t(120));
        assert_eq!(p.plan.create, 1, "{p:?}");
        assert!(removed(&p).is_empty(), "{p:?}");
        assert_eq!(
            p.awaiting_attribution,
            vec!["a".to_string(), "b".to_string()]
        );
        assert_eq!(p.plan.counts.terminal, 0);
        assert_eq!(
            p.next_deadline,
            Some(Duration::from_secs(40)),
            "a's grace ends first"
        );
        // More runners served than jobs seen queued: nothing made, nothing retired.
        let p = pass_queued(&vms, 1, t(120));
        assert_eq!((p.plan.create, removed(&p).len()), (0, 0));

        // Attributed (the intake named its job): cleaned up at once, and it no longer stands for a
        // queued job.
        let mut known = served_unknown("a", 100);
        known.attributed = true;
        let p = pass_queued(&[known], 3, t(101));
        assert_eq!(removed(&p), vec!["a"]);
        assert_eq!(p.plan.create, 3);
        assert!(p.awaiting_attribution.is_empty());

        // Past the grace (60 s from its exit): cleaned up, the queued job gets its runner again.
        let p = pass_queued(&[served_unknown("a", 100)], 1, t(160));
        assert_eq!(removed(&p), vec!["a"]);
        assert_eq!(p.plan.create, 1);
        assert_eq!(p.next_deadline, None);

        // A runner that failed (no exit 0 recorded: non-zero, ambiguous, or the VM failed) ran no
        // job we can count on: cleaned up and replaced as before.
        let mut failed = facts("f", Terminal, Some(9));
        failed.runner_started = Some(t(0));
        let p = pass_queued(std::slice::from_ref(&failed), 1, t(101));
        assert_eq!((removed(&p), p.plan.create), (vec!["f"], 1));
        assert_eq!(awaiting_attribution(&failed, &D, t(101)), None);
        // Only terminal VMs: a live runner is counted by its state.
        let mut idle = served_unknown("i", 100);
        idle.vm.state = Idle;
        assert_eq!(awaiting_attribution(&idle, &D, t(101)), None);
    }

    #[test]
    fn phase_spans_follow_the_vms_life_and_skip_what_is_missing() {
        let all = VmTimes {
            created: Some(t(0)),
            scheduled: Some(t(1)),
            boot_complete: Some(t(4)),
            runner_started: Some(t(5)),
            runner_exited: Some(t(65)),
            clone_start: None,
        };
        let secs = |v: Vec<(&'static str, Duration)>| -> Vec<(&'static str, u64)> {
            v.into_iter().map(|(p, d)| (p, d.as_secs())).collect()
        };
        assert_eq!(
            secs(phase_spans(&all)),
            vec![
                ("scheduling", 1),
                ("booting", 3),
                ("handoff", 1),
                ("job", 60)
            ]
        );
        // Failed while booting: no handoff, no job.
        let failed = VmTimes {
            runner_started: None,
            runner_exited: None,
            ..all
        };
        assert_eq!(
            secs(phase_spans(&failed)),
            vec![("scheduling", 1), ("booting", 3)]
        );
        // No boot record (older agent): neither neighbour of it is measured.
        let no_boot = VmTimes {
            boot_complete: None,
            ..all
        };
        assert_eq!(
            secs(phase_spans(&no_boot)),
            vec![("scheduling", 1), ("job", 60)]
        );
        // Skewed clocks: a negative span is dropped, not clamped to zero.
        let skewed = VmTimes {
            scheduled: Some(t(-5)),
            ..all
        };
        assert_eq!(
            secs(phase_spans(&skewed)),
            vec![("booting", 9), ("handoff", 1), ("job", 60)]
        );
        assert!(phase_spans(&VmTimes::default()).is_empty());
    }

    #[test]
    fn requeue_takes_the_soonest_need() {
        let base = RequeueInput {
            resync: Duration::from_secs(300),
            retry: Duration::from_secs(10),
            scaling_requeue: Duration::from_millis(200),
            pending: false,
            backoffs: vec![],
            scaling_pending: false,
            next_deadline: None,
            next_reap: Duration::from_secs(120),
        };
        assert_eq!(requeue_after(&base), Duration::from_secs(120));
        let r = RequeueInput {
            pending: true,
            ..base
        };
        assert_eq!(requeue_after(&r), Duration::from_secs(10));
        let r = RequeueInput {
            backoffs: vec![Duration::from_secs(3)],
            next_deadline: Some(Duration::from_secs(5)),
            ..r
        };
        assert_eq!(requeue_after(&r), Duration::from_millis(3010));
        let r = RequeueInput {
            scaling_pending: true,
            ..r
        };
        assert_eq!(requeue_after(&r), Duration::from_millis(200));
    }

    #[test]
    fn minting_is_blocked_by_the_most_lasting_gate() {
        let open = MintGates::default();
        assert_eq!(mint_block(&open), None);
        let all = MintGates {
            creds_invalid: false,
            no_scope: false,
            mint_backoff: true,
            start_backoff: true,
            version_deprecated: true,
        };
        assert_eq!(
            mint_block(&all),
            Some(MintBlock::RunnerVersionDeprecated),
            "a deprecated version outlasts any backoff"
        );
        for g in [
            MintGates {
                creds_invalid: true,
                ..all
            },
            MintGates {
                no_scope: true,
                ..all
            },
        ] {
            assert_eq!(mint_block(&g), Some(MintBlock::CredentialsInvalid));
        }
        let backoffs = MintGates {
            version_deprecated: false,
            ..all
        };
        assert_eq!(mint_block(&backoffs), Some(MintBlock::Backoff));
        let starts = MintGates {
            start_backoff: true,
            ..open
        };
        assert_eq!(mint_block(&starts), Some(MintBlock::StartFailing));
    }

    #[test]
    fn the_runners_are_listed_when_the_reaper_is_due_or_a_deadline_needs_judging() {
        let none = HashSet::new();
        let every = Duration::from_secs(60);
        let mut v = facts("a", Idle, Some(1));
        v.runner_started = Some(t(0));
        let vms = [v];
        // Never listed, or listed an interval ago: the reaper's listing may be shared.
        assert_eq!(
            listing_wanted(&vms, &D, &none, None, every, t(10)),
            Some(false)
        );
        assert_eq!(
            listing_wanted(&vms, &D, &none, Some(every), every, t(10)),
            Some(false)
        );
        assert_eq!(
            listing_wanted(&vms, &D, &none, Some(Duration::from_secs(5)), every, t(10)),
            None
        );
        // Past the online deadline and never seen online: a fresh listing, whatever the reaper.
        let recent = Some(Duration::from_secs(5));
        assert_eq!(
            listing_wanted(&vms, &D, &none, recent, every, t(300)),
            Some(true)
        );
        assert_eq!(
            listing_wanted(&vms, &D, &[1].into(), recent, every, t(300)),
            None
        );
    }

    /// A pool of desired 3 with one idle runner, one finished VM, one replaced, one to retire.
    fn settled_plan() -> PoolPlan {
        let plan = Plan {
            desired: 3,
            counts: crate::runnerpool::plan::Counts {
                idle: 2,
                ..Default::default()
            },
            create: 2,
            retire: vec![Removal {
                name: "surplus".into(),
                runner_id: Some(5),
            }],
            cleanup: vec![Removal {
                name: "done".into(),
                runner_id: None,
            }],
            ..Default::default()
        };
        let mut pp = PoolPlan {
            plan,
            replace: vec![(
                Removal {
                    name: "stuck".into(),
                    runner_id: Some(9),
                },
                Overdue::BootDeadlineExceeded,
            )],
            reap: Reap {
                delete: vec![(7, "p-orphan".into())],
                busy: 0,
            },
            basis: StatusBasis {
                generation: Some(2),
                max_runners: 4,
                creds: Creds::Valid,
                ..Default::default()
            },
            timing: RequeueTiming {
                resync: Duration::from_secs(300),
                retry: Duration::from_secs(5),
                scaling_requeue: Duration::from_secs(2),
                reap_interval: Duration::from_secs(60),
            },
            ..Default::default()
        };
        pp.status = settle(&pp, &Outcome::planned(&pp), t(0)).status;
        pp
    }

    #[test]
    fn decide_returns_the_status_of_the_plan_carried_out() {
        let sc = scaling(1, 4);
        let vms = [facts("a", Idle, Some(1))];
        let none = HashSet::new();
        let pp = decide(&Input {
            vms: &vms,
            scaling: &sc,
            queued: 2,
            gates: MintGates::default(),
            demand_known: true,
            deadlines: D,
            confirmed_online: &none,
            listing: None,
            pool_name: "p",
            served: &[],
            now: t(0),
            status: StatusBasis {
                max_runners: 4,
                creds: Creds::Valid,
                ..Default::default()
            },
            timing: RequeueTiming::default(),
        });
        assert_eq!((pp.plan.desired, pp.plan.create), (2, 1));
        assert_eq!(pp.status, settle(&pp, &Outcome::planned(&pp), t(0)).status);
        assert_eq!(
            (pp.status.desired, pp.status.total, pp.status.booting),
            (2, 2, 1)
        );
        // Gates become the plan's block: nothing is created without credentials.
        let pp = decide(&Input {
            vms: &vms,
            scaling: &sc,
            queued: 2,
            gates: MintGates {
                creds_invalid: true,
                ..Default::default()
            },
            demand_known: true,
            deadlines: D,
            confirmed_online: &none,
            listing: None,
            pool_name: "p",
            served: &[],
            now: t(0),
            status: StatusBasis::default(),
            timing: RequeueTiming::default(),
        });
        assert_eq!(pp.plan.create, 0);
        assert_eq!(pp.plan.limited, Some(Limit::CredentialsInvalid));
    }

    #[test]
    fn settling_the_planned_outcome_posts_one_event_per_kind_of_change() {
        let pp = settled_plan();
        let s = settle(&pp, &Outcome::planned(&pp), t(0));
        assert_eq!(s.status, pp.status);
        let reasons: Vec<&str> = s.events.iter().map(|n| n.reason).collect();
        assert_eq!(
            reasons,
            [
                reason::ORPHAN_RUNNERS_DELETED,
                reason::SCALED_UP,
                reason::SCALED_DOWN,
                reason::RUNNERS_CLEANED_UP
            ]
        );
        assert_eq!(
            s.events[3].message, "Deleted 1 finished runner VM(s)",
            "the replaced VM is not counted"
        );
        assert!(s.events.iter().all(|n| !n.warning));
        // 2 idle - 1 retired + 2 created, the finished and the replaced VM gone.
        assert_eq!((s.status.idle, s.status.booting, s.status.total), (1, 2, 1));
        // Nothing left to retry, no listing yet: the reaper is due at once.
        assert_eq!(s.requeue, Duration::ZERO);
    }

    #[test]
    fn settling_a_failed_mint_says_so_in_the_status_the_events_and_the_requeue() {
        let pp = settled_plan();
        let o = Outcome {
            done: Done {
                created: 0,
                retired: 1,
                cleaned: 2,
            },
            mint_failed: true,
            pending: true,
            reaped: vec![],
            creds: Creds::Invalid {
                reason: reason::CREDENTIALS_INVALID,
                message: "bad key".into(),
            },
            backoffs: vec![Duration::from_secs(1)],
            since_listing: Some(Duration::from_secs(10)),
        };
        let s = settle(&pp, &o, t(0));
        let c = cond(&s.status, condition::SCALING_LIMITED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", Limit::MintBackoff.reason())
        );
        let c = cond(&s.status, condition::CREDENTIALS_VALID);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", reason::CREDENTIALS_INVALID)
        );
        assert_eq!(cond(&s.status, condition::READY).status, "False");
        assert_eq!((s.status.booting, s.status.total), (0, 0));
        let last = s.events.last().unwrap();
        assert_eq!(
            (last.warning, last.reason, last.message.as_str()),
            (true, reason::CREDENTIALS_INVALID, "bad key")
        );
        assert!(!s.events.iter().any(|n| n.reason == reason::SCALED_UP));
        // The backoff (plus its margin) comes before the retry.
        assert_eq!(s.requeue, Duration::from_millis(1010));
        // Credentials already known bad: no second Event.
        let again = PoolPlan {
            basis: StatusBasis {
                creds: o.creds.clone(),
                ..pp.basis.clone()
            },
            ..pp.clone()
        };
        assert!(
            !settle(&again, &o, t(0))
                .events
                .iter()
                .any(|n| n.reason == reason::CREDENTIALS_INVALID)
        );
    }
}
