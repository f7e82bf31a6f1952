//! The API budget of the queued-job sweep. An installation has one primary rate limit (5,000 to
//! 15,000 calls per hour) that JIT mints, deregistrations and the runner reaper need too; the sweep
//! may spend only its share of it, and stops while the rest is below the reserve left to the others.
//! GitHub also enforces a secondary limit on request rate (about 900 REST points per minute), which
//! 304 answers count against even though they are free on the primary limit, so the sweep also
//! caps its request rate. [`next_sweep_interval`] is the pure decision: how long until the next sweep,
//! given what the last one cost.

use std::time::Duration;

use super::conditional::CallCount;

/// How much of the API the sweep may use.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepBudget {
    /// Share of the installation's hourly primary limit the sweep may spend (the rest is for
    /// minting, deregistration and the reaper).
    pub share: f64,
    /// Requests per minute, 304s included (kept under GitHub's secondary limit).
    pub max_requests_per_minute: u32,
}

impl Default for SweepBudget {
    fn default() -> Self {
        SweepBudget {
            share: 0.5,
            max_requests_per_minute: 600,
        }
    }
}

/// The installation's primary rate limit, as the last answer's `x-ratelimit-*` headers said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateState {
    pub limit: u64,
    pub remaining: u64,
    /// Until the window resets.
    pub reset_in: Duration,
}

/// GitHub's default installation limit, assumed until an answer says otherwise.
pub const DEFAULT_RATE_LIMIT: u64 = 5_000;

impl SweepBudget {
    /// Charged calls per hour the sweep may spend under `limit`.
    pub fn charged_per_hour(&self, limit: u64) -> f64 {
        (limit as f64 * self.share.clamp(0.0, 1.0)).max(1.0)
    }

    /// Calls of the window reserved for everything but the sweep.
    pub fn reserve(&self, limit: u64) -> u64 {
        (limit as f64 * (1.0 - self.share.clamp(0.0, 1.0))).ceil() as u64
    }
}

/// Why the next sweep waits as long as it does (a gauge label and a log field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntervalCause {
    /// The configured minimum.
    Minimum,
    /// Spending the last sweep's charged calls at most at the sweep's share of the hourly limit.
    PrimaryShare,
    /// The request-rate cap (304s count).
    RequestRate,
    /// The window's remaining calls are down to the reserve: wait for the reset.
    Reserve,
}

impl IntervalCause {
    pub fn as_str(self) -> &'static str {
        match self {
            IntervalCause::Minimum => "minimum",
            IntervalCause::PrimaryShare => "primary_share",
            IntervalCause::RequestRate => "request_rate",
            IntervalCause::Reserve => "reserve",
        }
    }
}

/// How long until the next sweep: at least `min`; long enough that the last sweep's charged calls
/// stay within the share and its requests within the rate cap; until the reset while the remaining
/// calls are down to the reserve. First fetches (nothing to revalidate yet) are a one-time cost and
/// do not stretch the interval: the reserve rule (and the sweep stopping at the reserve) bounds them.
pub fn next_sweep_interval(
    budget: &SweepBudget,
    min: Duration,
    last: CallCount,
    rate: Option<RateState>,
) -> (Duration, IntervalCause) {
    let limit = rate.map_or(DEFAULT_RATE_LIMIT, |r| r.limit.max(1));
    let mut out = (min, IntervalCause::Minimum);
    let mut consider = |d: Duration, cause| {
        if d > out.0 {
            out = (d, cause);
        }
    };
    consider(
        Duration::from_secs_f64(
            last.charged.saturating_sub(last.first) as f64 * 3600.0
                / budget.charged_per_hour(limit),
        ),
        IntervalCause::PrimaryShare,
    );
    consider(
        Duration::from_secs_f64(
            last.total() as f64 * 60.0 / budget.max_requests_per_minute.max(1) as f64,
        ),
        IntervalCause::RequestRate,
    );
    if let Some(r) = rate
        && r.remaining <= budget.reserve(limit)
    {
        consider(r.reset_in, IntervalCause::Reserve);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn calls(charged: u64, revalidated: u64) -> CallCount {
        CallCount {
            charged,
            revalidated,
            first: 0,
        }
    }

    fn rate(limit: u64, remaining: u64, reset_secs: u64) -> Option<RateState> {
        Some(RateState {
            limit,
            remaining,
            reset_in: Duration::from_secs(reset_secs),
        })
    }

    #[test]
    fn a_cheap_sweep_runs_at_the_minimum_interval() {
        let b = SweepBudget::default();
        assert_eq!(
            next_sweep_interval(&b, MIN, calls(10, 50), rate(5000, 4000, 1800)),
            (MIN, IntervalCause::Minimum)
        );
        assert_eq!(
            next_sweep_interval(&b, MIN, CallCount::default(), None),
            (MIN, IntervalCause::Minimum)
        );
    }

    #[test]
    fn charged_calls_are_spread_over_the_share_of_the_hour() {
        let b = SweepBudget::default();
        // 500 charged calls, 2,500 per hour allowed: one sweep per 12 minutes.
        let (d, cause) = next_sweep_interval(&b, MIN, calls(500, 0), rate(5000, 4500, 3000));
        assert_eq!(
            (d, cause),
            (Duration::from_secs(720), IntervalCause::PrimaryShare)
        );
        // A 15k installation allows three times as many.
        let (d, _) = next_sweep_interval(&b, MIN, calls(500, 0), rate(15000, 14000, 3000));
        assert_eq!(d, Duration::from_secs(240));
        // Unknown limit: GitHub's default of 5,000 is assumed.
        let (d, _) = next_sweep_interval(&b, MIN, calls(500, 0), None);
        assert_eq!(d, Duration::from_secs(720));
    }

    #[test]
    fn a_cold_cache_is_a_one_time_cost() {
        let b = SweepBudget::default();
        // The first sweep of 1,000 repositories: 2,010 first fetches, 10 changed.
        let cold = CallCount {
            charged: 2020,
            revalidated: 0,
            first: 2010,
        };
        let (d, cause) = next_sweep_interval(&b, MIN, cold, rate(5000, 2900, 3000));
        assert_eq!(
            (d, cause),
            (Duration::from_secs(202), IntervalCause::RequestRate)
        );
    }

    #[test]
    fn free_revalidations_are_still_rate_capped() {
        let b = SweepBudget::default();
        // 1,000 repositories, two 304s each: 2,000 requests at 600/minute.
        let (d, cause) = next_sweep_interval(&b, MIN, calls(0, 2000), rate(5000, 5000, 3000));
        assert_eq!(
            (d, cause),
            (Duration::from_secs(200), IntervalCause::RequestRate)
        );
    }

    #[test]
    fn the_reserve_for_minting_stops_the_sweep_until_the_reset() {
        let b = SweepBudget::default();
        assert_eq!(b.reserve(5000), 2500);
        let (d, cause) = next_sweep_interval(&b, MIN, calls(1, 1), rate(5000, 2500, 1500));
        assert_eq!(
            (d, cause),
            (Duration::from_secs(1500), IntervalCause::Reserve)
        );
        // One call above the reserve: sweeping goes on.
        let (_, cause) = next_sweep_interval(&b, MIN, calls(1, 1), rate(5000, 2501, 1500));
        assert_eq!(cause, IntervalCause::Minimum);
        // The reset being close does not shorten a longer share-driven wait.
        let (d, cause) = next_sweep_interval(&b, MIN, calls(1000, 0), rate(5000, 100, 10));
        assert_eq!(
            (d, cause),
            (Duration::from_secs(1440), IntervalCause::PrimaryShare)
        );
    }

    #[test]
    fn shares_outside_zero_to_one_are_clamped() {
        let b = SweepBudget {
            share: 7.0,
            ..SweepBudget::default()
        };
        assert_eq!(b.charged_per_hour(5000), 5000.0);
        assert_eq!(b.reserve(5000), 0);
        let none = SweepBudget {
            share: -1.0,
            ..SweepBudget::default()
        };
        assert_eq!(none.charged_per_hour(5000), 1.0);
    }
}
