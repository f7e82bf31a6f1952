//! Exponential backoff with a cap: the one formula behind VM restarts, runner-pool mint and
//! start-failure waits, and GitHub API retries. Pure: the caller keeps the attempt count and, for
//! jitter, supplies the random fraction (so tests pin it).

use std::time::Duration;

/// `min(initial * 2^attempt, max)`, optionally jittered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay of attempt 0.
    pub initial: Duration,
    /// Cap on any one delay.
    pub max: Duration,
}

impl Backoff {
    pub const fn new(initial: Duration, max: Duration) -> Self {
        Backoff { initial, max }
    }

    /// `min(initial * 2^attempt, max)` (attempt 0 = `initial`, capped too). Exact in nanoseconds and
    /// saturating: any attempt number, however large, yields `max` rather than overflowing.
    pub fn delay(&self, attempt: u32) -> Duration {
        let cap = self.max.as_nanos();
        let initial = self.initial.as_nanos();
        let nanos = if initial == 0 {
            0
        } else {
            // initial < 2^94 (Duration::MAX), so an attempt past 127 overflows u128 anyway.
            1u128
                .checked_shl(attempt)
                .and_then(|factor| initial.checked_mul(factor))
                .map_or(cap, |n| n.min(cap))
        };
        from_nanos(nanos.min(cap))
    }

    /// "Equal jitter": half of [`delay`](Self::delay) fixed, the other half scaled by `fraction`
    /// (clamped to [0, 1]; NaN counts as 0). Callers pass a uniform random number in [0, 1), so
    /// the wait lies in `[delay/2, delay]` and callers failing together spread out.
    pub fn jittered(&self, attempt: u32, fraction: f64) -> Duration {
        let full = self.delay(attempt);
        let half = full / 2;
        let fraction = if fraction.is_nan() {
            0.0
        } else {
            fraction.clamp(0.0, 1.0)
        };
        half + (full - half).mul_f64(fraction)
    }
}

/// `Duration` from a nanosecond count that is known to fit (it is at most some `Duration`).
fn from_nanos(nanos: u128) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    Duration::new(
        u64::try_from(nanos / NANOS_PER_SEC).unwrap_or(u64::MAX),
        (nanos % NANOS_PER_SEC) as u32,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;
    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn doubles_from_initial_up_to_the_cap() {
        let b = Backoff::new(S(10), S(300));
        let got: Vec<Duration> = (0..8).map(|n| b.delay(n)).collect();
        assert_eq!(got, [10, 20, 40, 80, 160, 300, 300, 300].map(S));
    }

    #[test]
    fn sub_second_values_are_exact() {
        let b = Backoff::new(MS(250), S(1));
        assert_eq!(
            [b.delay(0), b.delay(1), b.delay(2)],
            [MS(250), MS(500), S(1)]
        );
        let ns = Backoff::new(Duration::from_nanos(3), Duration::from_nanos(100));
        assert_eq!(ns.delay(4), Duration::from_nanos(48));
        assert_eq!(ns.delay(6), Duration::from_nanos(100));
    }

    #[test]
    fn large_attempts_saturate_at_the_cap() {
        for b in [
            Backoff::new(S(10), S(60)),
            Backoff::new(Duration::from_nanos(1), S(3600)),
            Backoff::new(Duration::MAX, Duration::MAX),
            Backoff::new(S(1), Duration::MAX),
        ] {
            for attempt in [64, 93, 94, 95, 127, 128, 1000, u32::MAX] {
                assert_eq!(b.delay(attempt), b.max, "{b:?} attempt {attempt}");
                assert_eq!(b.jittered(attempt, 1.0), b.max, "{b:?} attempt {attempt}");
            }
        }
    }

    #[test]
    fn one_nanosecond_still_reaches_the_cap_past_thirty_two_doublings() {
        // 2^32 ns is 4.29 s: a u32 factor that saturates at u32::MAX would stop there.
        let b = Backoff::new(Duration::from_nanos(1), S(3600));
        assert_eq!(b.delay(40), Duration::from_nanos(1 << 40));
        assert_eq!(b.delay(42), S(3600));
    }

    #[test]
    fn the_cap_applies_to_attempt_zero_and_zero_stays_zero() {
        assert_eq!(Backoff::new(S(30), S(10)).delay(0), S(10));
        assert_eq!(
            Backoff::new(Duration::ZERO, S(10)).delay(u32::MAX),
            Duration::ZERO
        );
        assert_eq!(Backoff::new(S(1), Duration::ZERO).delay(3), Duration::ZERO);
    }

    #[test]
    fn jitter_spans_the_upper_half_of_the_delay() {
        let b = Backoff::new(MS(100), MS(1000));
        for attempt in 0..8u32 {
            let full = b.delay(attempt);
            assert_eq!(b.jittered(attempt, 0.0), full / 2, "attempt {attempt}");
            assert_eq!(b.jittered(attempt, 1.0), full, "attempt {attempt}");
            let mid = b.jittered(attempt, 0.5);
            assert!(mid > full / 2 && mid < full, "attempt {attempt}: {mid:?}");
            let hi = b.jittered(attempt, 0.999_999);
            assert!(
                hi <= full && hi > full.mul_f64(0.99),
                "attempt {attempt}: {hi:?}"
            );
        }
    }

    #[test]
    fn jitter_fraction_outside_the_unit_interval_is_clamped() {
        let b = Backoff::new(S(2), S(2));
        assert_eq!(b.jittered(0, -3.0), S(1));
        assert_eq!(b.jittered(0, 7.0), S(2));
        assert_eq!(b.jittered(0, f64::INFINITY), S(2));
        assert_eq!(b.jittered(0, f64::NEG_INFINITY), S(1));
        assert_eq!(b.jittered(0, f64::NAN), S(1));
    }

    #[test]
    fn odd_nanosecond_delays_keep_the_full_upper_bound() {
        let b = Backoff::new(Duration::from_nanos(7), Duration::from_nanos(7));
        assert_eq!(b.jittered(0, 0.0), Duration::from_nanos(3));
        assert_eq!(b.jittered(0, 1.0), Duration::from_nanos(7));
    }
}
