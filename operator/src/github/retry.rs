//! Retry policy: exponential backoff with jitter for transient errors, and GitHub's requested wait
//! (`Retry-After`, `x-ratelimit-reset`) for rate limits.

use std::time::Duration;

use super::errors::GithubError;

#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Total attempts per call, including the first.
    pub max_attempts: u32,
    /// Backoff before the first retry (doubled each retry).
    pub base_delay: Duration,
    /// Cap on one backoff.
    pub max_delay: Duration,
    /// Longest rate-limit wait done in place; longer ones are returned to the caller.
    pub max_rate_limit_wait: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 4,
            base_delay: Duration::from_millis(250),
            max_delay: Duration::from_secs(10),
            max_rate_limit_wait: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// "Equal jitter" backoff for retry number `retry` (0 = first retry): half of
    /// `min(max, base * 2^retry)` fixed, half scaled by `jitter` in [0, 1).
    pub fn backoff(&self, retry: u32, jitter: f64) -> Duration {
        imp_common::Backoff::new(self.base_delay, self.max_delay).jittered(retry, jitter)
    }

    /// How long to wait before retrying after `err` (retry number `retry`), or `None` to give up.
    pub fn delay_for(&self, err: &GithubError, retry: u32, jitter: f64) -> Option<Duration> {
        if retry + 1 >= self.max_attempts || !err.is_retryable() {
            return None;
        }
        match err {
            GithubError::RateLimited { retry_after, .. } => {
                if *retry_after > self.max_rate_limit_wait {
                    None
                } else {
                    // GitHub's wait is a floor; jitter spreads callers released at the same instant.
                    Some(*retry_after + self.backoff(retry, jitter).min(Duration::from_secs(1)))
                }
            }
            _ => Some(self.backoff(retry, jitter)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::github::errors::{Operation, RateLimitKind};

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_millis(1000),
            max_rate_limit_wait: Duration::from_secs(30),
        }
    }

    #[test]
    fn backoff_grows_exponentially_within_jitter_bounds_and_caps() {
        let p = policy();
        for retry in 0..8u32 {
            let full = Duration::from_millis((100u64 << retry).min(1000));
            let lo = p.backoff(retry, 0.0);
            let hi = p.backoff(retry, 0.999_999);
            assert_eq!(lo, full / 2, "retry {retry}");
            assert!(
                hi <= full && hi > full.mul_f64(0.99),
                "retry {retry}: {hi:?}"
            );
        }
        assert_eq!(p.backoff(50, 1.0), Duration::from_millis(1000));
    }

    #[test]
    fn delay_for_follows_the_error_class() {
        let p = policy();
        let server = GithubError::Server {
            operation: Operation::GetRunner,
            status: 502,
        };
        assert_eq!(
            p.delay_for(&server, 0, 0.0),
            Some(Duration::from_millis(50))
        );
        assert_eq!(p.delay_for(&server, 4, 0.0), None, "attempts exhausted");
        let rl = |secs| GithubError::RateLimited {
            operation: Operation::GenerateJitConfig,
            kind: RateLimitKind::TooManyRequests,
            retry_after: Duration::from_secs(secs),
        };
        let d = p.delay_for(&rl(2), 0, 0.5).unwrap();
        assert!(
            d >= Duration::from_secs(2) && d < Duration::from_secs(3),
            "{d:?}"
        );
        assert_eq!(
            p.delay_for(&rl(120), 0, 0.5),
            None,
            "too long to wait in place"
        );
        let nf = GithubError::NotFound {
            operation: Operation::GetRunner,
            hint: String::new(),
        };
        assert_eq!(p.delay_for(&nf, 0, 0.5), None);
        assert_eq!(
            p.delay_for(&GithubError::RunnerBusy { runner_id: 3 }, 0, 0.5),
            None
        );
    }
}
