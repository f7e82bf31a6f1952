//! The pool's decision: from the classified runner VMs, the demand and the scaling limits, how many
//! runners to create, which unminted VMs to mint, which idle runners to retire and which terminal VMs
//! to clean up. Pure; the controller executes the plan.

use imp_api::{Scaling, names::reason};

use super::classify::RunnerState;

/// One runner VM as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedVm {
    pub name: String,
    pub state: RunnerState,
    /// GitHub runner id recorded for the VM (None before minting).
    pub runner_id: Option<u64>,
    /// Creation time (Unix seconds); the newest idle runners are retired first.
    pub created: i64,
}

/// Why new runners cannot be minted right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MintBlock {
    /// The App credentials do not work; nothing will mint until they are fixed.
    CredentialsInvalid,
    /// A mint failed recently; wait out the backoff.
    Backoff,
    /// The pool's VMs keep failing before their runner starts (bad image, kernel, node): wait
    /// before creating the next one instead of minting a JIT config per doomed VM.
    StartFailing,
    /// GitHub refused a runner of the pool's current generation as deprecated: no runner of that
    /// version can take a job, so none is minted until the pool changes (no retry storm).
    RunnerVersionDeprecated,
}

/// Consecutive failures of one kind and the wait they impose: each failure restarts the wait,
/// `min(base * 2^(failures-1), max)` ([`imp_common::Backoff`]); a success resets it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    failures: u32,
    until: Option<std::time::Instant>,
}

impl Backoff {
    /// Counts a failure at `now`; returns the wait it imposes.
    pub fn fail(
        &mut self,
        now: std::time::Instant,
        base: std::time::Duration,
        max: std::time::Duration,
    ) -> std::time::Duration {
        self.failures = self.failures.saturating_add(1);
        let wait = imp_common::Backoff::new(base, max).delay(self.failures - 1);
        self.until = Some(now + wait);
        wait
    }

    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// Failures in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// When the wait ends (it may lie in the past).
    pub fn until(&self) -> Option<std::time::Instant> {
        self.until
    }

    pub fn active(&self, now: std::time::Instant) -> bool {
        self.until.is_some_and(|t| t > now)
    }
}

#[derive(Debug, Clone)]
pub struct Observed<'a> {
    pub vms: &'a [ObservedVm],
    pub scaling: &'a Scaling,
    /// Queued jobs routed to the pool and not yet running.
    pub queued: u32,
    pub mint_block: Option<MintBlock>,
    /// The pool is being deleted: tear everything down.
    pub deleting: bool,
    /// The demand is known: a sweep covered the pool since the operator started. Until then queued
    /// jobs may be missing from `queued`, so nothing is retired (growth and cleanup go on).
    pub demand_known: bool,
}

/// A VM to delete, deregistering its runner at GitHub first when it has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removal {
    pub name: String,
    pub runner_id: Option<u64>,
}

/// Counts of the pool's runner VMs by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub unminted: u32,
    pub booting: u32,
    pub idle: u32,
    pub busy: u32,
    pub terminal: u32,
}

impl Counts {
    /// Runners that exist for the pool's demand (not terminal, not being deleted).
    pub fn live(&self) -> u32 {
        self.unminted + self.booting + self.idle + self.busy
    }
    /// Every VM of the pool not being deleted.
    pub fn total(&self) -> u32 {
        self.live() + self.terminal
    }
}

/// Why the pool scaled less than it wanted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    ScaleUpStep,
    MaxRunners,
    CredentialsInvalid,
    MintBackoff,
    StartBackoff,
    RunnerVersionDeprecated,
}

impl Limit {
    pub fn reason(self) -> &'static str {
        match self {
            Limit::ScaleUpStep => reason::SCALE_UP_STEP,
            Limit::MaxRunners => reason::MAX_RUNNERS,
            Limit::CredentialsInvalid => reason::CREDENTIALS_INVALID,
            Limit::MintBackoff => reason::MINT_BACKOFF,
            Limit::StartBackoff => reason::VM_START_FAILING,
            Limit::RunnerVersionDeprecated => reason::RUNNER_VERSION_DEPRECATED,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// min(maxRunners, busy + max(minIdle, queued)).
    pub desired: u32,
    pub counts: Counts,
    /// New runner VMs to create (and mint) this pass.
    pub create: u32,
    /// Existing VMs without a JIT config to mint for.
    pub mint: Vec<String>,
    /// Surplus runners to retire: deregister (a busy refusal keeps the VM), then delete.
    pub retire: Vec<Removal>,
    /// Terminal VMs (or, while the pool is deleted, every VM): deregister if still registered, delete.
    pub cleanup: Vec<Removal>,
    pub limited: Option<Limit>,
    /// Live runners reached maxRunners.
    pub at_capacity: bool,
}

pub fn plan(o: &Observed) -> Plan {
    let mut p = Plan::default();
    for vm in o.vms {
        match vm.state {
            RunnerState::Unminted => p.counts.unminted += 1,
            RunnerState::Booting => p.counts.booting += 1,
            RunnerState::Idle => p.counts.idle += 1,
            RunnerState::Busy => p.counts.busy += 1,
            RunnerState::Terminal => p.counts.terminal += 1,
            RunnerState::Deleting => {}
        }
    }
    let removal = |vm: &ObservedVm| Removal {
        name: vm.name.clone(),
        runner_id: vm.runner_id,
    };
    if o.deleting {
        p.cleanup = o
            .vms
            .iter()
            .filter(|v| v.state != RunnerState::Deleting)
            .map(removal)
            .collect();
        return p;
    }
    p.cleanup = o
        .vms
        .iter()
        .filter(|v| v.state == RunnerState::Terminal)
        .map(removal)
        .collect();

    let max = o.scaling.max_runners;
    let wanted = p.counts.busy + o.scaling.min_idle().max(o.queued);
    p.desired = wanted.min(max);
    let live = p.counts.live();
    p.at_capacity = live >= max;

    let mut unminted: Vec<&ObservedVm> = o
        .vms
        .iter()
        .filter(|v| v.state == RunnerState::Unminted)
        .collect();
    unminted.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));

    if live > p.desired && o.demand_known {
        // Cheapest first: VMs without a runner, then the newest idle runners. Booting and busy stay.
        let surplus = (live - p.desired) as usize;
        let mut idle: Vec<&ObservedVm> = o
            .vms
            .iter()
            .filter(|v| v.state == RunnerState::Idle)
            .collect();
        idle.sort_by(|a, b| (b.created, &b.name).cmp(&(a.created, &a.name)));
        for vm in unminted.iter().rev().chain(idle.iter()).take(surplus) {
            p.retire.push(removal(vm));
        }
        let retired: Vec<&str> = p.retire.iter().map(|r| r.name.as_str()).collect();
        unminted.retain(|v| !retired.contains(&v.name.as_str()));
    }

    match o.mint_block {
        Some(MintBlock::CredentialsInvalid) => {
            if p.desired > live || !unminted.is_empty() {
                p.limited = Some(Limit::CredentialsInvalid);
            }
            return p;
        }
        Some(
            block @ (MintBlock::Backoff
            | MintBlock::StartFailing
            | MintBlock::RunnerVersionDeprecated),
        ) => {
            if p.desired > live || !unminted.is_empty() {
                p.limited = Some(match block {
                    MintBlock::Backoff => Limit::MintBackoff,
                    MintBlock::StartFailing => Limit::StartBackoff,
                    _ => Limit::RunnerVersionDeprecated,
                });
            }
            return p;
        }
        None => {}
    }
    p.mint = unminted.iter().map(|v| v.name.clone()).collect();
    if wanted > max {
        p.limited = Some(Limit::MaxRunners);
    }
    if p.desired > live {
        let need = p.desired - live;
        p.create = need.min(o.scaling.scale_up_step());
        if p.create < need {
            p.limited = Some(Limit::ScaleUpStep);
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use RunnerState::*;

    fn scaling(min_idle: u32, max: u32, step: u32) -> Scaling {
        Scaling {
            min_idle: Some(min_idle),
            max_runners: max,
            scale_up_step: Some(step),
            standby: None,
        }
    }

    fn vms(states: &[RunnerState]) -> Vec<ObservedVm> {
        states
            .iter()
            .enumerate()
            .map(|(i, s)| ObservedVm {
                name: format!("vm-{i}"),
                state: *s,
                runner_id: (*s != Unminted).then_some(100 + i as u64),
                created: i as i64,
            })
            .collect()
    }

    fn run(states: &[RunnerState], sc: Scaling, queued: u32) -> Plan {
        let v = vms(states);
        plan(&Observed {
            vms: &v,
            scaling: &sc,
            queued,
            mint_block: None,
            deleting: false,
            demand_known: true,
        })
    }

    #[test]
    fn scales_from_zero_on_queued_jobs() {
        let p = run(&[], scaling(0, 10, 10), 3);
        assert_eq!((p.desired, p.create), (3, 3));
        assert_eq!(p.limited, None);
        let p = run(&[], scaling(0, 10, 10), 0);
        assert_eq!((p.desired, p.create), (0, 0));
    }

    #[test]
    fn keeps_min_idle_on_top_of_busy() {
        let p = run(&[Busy, Busy, Idle], scaling(2, 10, 10), 0);
        assert_eq!((p.desired, p.create), (4, 1));
        // Queued jobs beyond minIdle ask for more.
        let p = run(&[Busy, Idle, Idle], scaling(2, 10, 10), 5);
        assert_eq!((p.desired, p.create), (6, 3));
        // Booting runners count as on their way.
        let p = run(&[Booting, Booting], scaling(2, 10, 10), 0);
        assert_eq!((p.desired, p.create), (2, 0));
    }

    #[test]
    fn respects_max_runners_and_scale_up_step() {
        let p = run(&[], scaling(0, 3, 10), 5);
        assert_eq!((p.desired, p.create), (3, 3));
        assert_eq!(p.limited, Some(Limit::MaxRunners));
        let p = run(&[Busy, Busy, Busy], scaling(0, 3, 10), 2);
        assert_eq!((p.desired, p.create), (3, 0));
        assert!(p.at_capacity);
        let p = run(&[], scaling(0, 100, 4), 10);
        assert_eq!((p.desired, p.create), (10, 4));
        assert_eq!(p.limited, Some(Limit::ScaleUpStep));
        assert!(!p.at_capacity);
    }

    #[test]
    fn retires_newest_idle_surplus_never_busy_or_booting() {
        let p = run(&[Idle, Busy, Idle, Booting, Idle], scaling(1, 10, 10), 0);
        // desired = 1 busy + 1 idle = 2; live 5; retire 3 but only 3 idle exist -> newest first.
        assert_eq!(p.desired, 2);
        let names: Vec<&str> = p.retire.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, vec!["vm-4", "vm-2", "vm-0"]);
        assert!(p.retire.iter().all(|r| r.runner_id.is_some()));
        assert_eq!(p.create, 0);
        let p = run(&[Busy, Booting, Booting], scaling(0, 10, 10), 0);
        assert!(
            p.retire.is_empty(),
            "booting and busy VMs are never retired"
        );
    }

    #[test]
    fn nothing_is_retired_before_the_demand_is_known() {
        let v = vms(&[Idle, Idle, Idle]);
        let sc = scaling(0, 10, 10);
        let mut o = Observed {
            vms: &v,
            scaling: &sc,
            queued: 0,
            mint_block: None,
            deleting: false,
            demand_known: false,
        };
        assert!(plan(&o).retire.is_empty());
        o.demand_known = true;
        assert_eq!(plan(&o).retire.len(), 3);
    }

    #[test]
    fn unminted_surplus_goes_first_and_unminted_vms_are_minted_otherwise() {
        let p = run(&[Idle, Unminted], scaling(0, 10, 10), 0);
        let names: Vec<&str> = p.retire.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, vec!["vm-1", "vm-0"]);
        assert_eq!(p.retire[0].runner_id, None);
        assert!(p.mint.is_empty());
        let p = run(&[Idle, Unminted], scaling(2, 10, 10), 0);
        assert_eq!(p.mint, vec!["vm-1".to_string()]);
        assert!(p.retire.is_empty());
        assert_eq!(p.create, 0);
    }

    #[test]
    fn terminal_vms_are_cleaned_up_and_replaced() {
        let p = run(&[Terminal, Terminal, Idle], scaling(2, 10, 10), 0);
        let names: Vec<&str> = p.cleanup.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, vec!["vm-0", "vm-1"]);
        assert_eq!(p.create, 1);
        assert_eq!(p.counts.total(), 3);
        assert_eq!(p.counts.live(), 1);
    }

    #[test]
    fn deleting_vms_are_ignored() {
        let p = run(&[Deleting, Deleting], scaling(1, 2, 10), 0);
        assert_eq!((p.counts.total(), p.create), (0, 1));
        assert!(p.cleanup.is_empty() && p.retire.is_empty());
    }

    #[test]
    fn mint_blocks_stop_growth_but_not_cleanup() {
        let v = vms(&[Terminal, Unminted]);
        let sc = scaling(3, 10, 10);
        for (block, limit) in [
            (MintBlock::Backoff, Limit::MintBackoff),
            (MintBlock::StartFailing, Limit::StartBackoff),
            (
                MintBlock::RunnerVersionDeprecated,
                Limit::RunnerVersionDeprecated,
            ),
            (MintBlock::CredentialsInvalid, Limit::CredentialsInvalid),
        ] {
            let p = plan(&Observed {
                vms: &v,
                scaling: &sc,
                queued: 0,
                mint_block: Some(block),
                deleting: false,
                demand_known: true,
            });
            assert_eq!(p.create, 0);
            assert!(p.mint.is_empty());
            assert_eq!(p.cleanup.len(), 1);
            assert_eq!(p.limited, Some(limit));
            assert_eq!(p.desired, 3);
        }
    }

    #[test]
    fn backoff_state_counts_failures_in_a_row_and_resets() {
        use std::time::{Duration as D, Instant};
        let t0 = Instant::now();
        let mut b = Backoff::default();
        assert!(!b.active(t0));
        assert_eq!(
            b.fail(t0, D::from_secs(10), D::from_secs(300)),
            D::from_secs(10)
        );
        assert_eq!(
            b.fail(t0, D::from_secs(10), D::from_secs(300)),
            D::from_secs(20)
        );
        assert_eq!(b.failures(), 2);
        assert_eq!(b.until(), Some(t0 + D::from_secs(20)));
        assert!(b.active(t0 + D::from_secs(19)));
        assert!(!b.active(t0 + D::from_secs(20)));
        b.reset();
        assert_eq!((b.failures(), b.until()), (0, None));
        assert_eq!(
            b.fail(t0, D::from_secs(10), D::from_secs(300)),
            D::from_secs(10)
        );
        let waits: Vec<D> = (0..40)
            .map(|_| b.fail(t0, D::from_secs(10), D::from_secs(300)))
            .collect();
        assert_eq!(waits[..5], [20, 40, 80, 160, 300].map(D::from_secs));
        assert_eq!(waits[39], D::from_secs(300), "capped however many failures");
    }

    #[test]
    fn a_deleted_pool_removes_everything() {
        let v = vms(&[Idle, Busy, Booting, Unminted, Terminal, Deleting]);
        let sc = scaling(3, 10, 10);
        let p = plan(&Observed {
            vms: &v,
            scaling: &sc,
            queued: 4,
            mint_block: None,
            deleting: true,
            demand_known: true,
        });
        assert_eq!(p.cleanup.len(), 5);
        assert_eq!((p.create, p.desired), (0, 0));
        assert!(p.retire.is_empty() && p.mint.is_empty());
    }
}
