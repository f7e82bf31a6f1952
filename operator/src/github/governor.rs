//! The JIT mint governor: a token bucket per App (default 150 mints per minute) that paces bursts
//! instead of failing them. Reservations may drive the bucket negative, so waiters are served in
//! order and none is lost.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A pure token bucket; time is passed in.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    capacity: f64,
    per_sec: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// `capacity` tokens (burst), refilled at `per_minute`; starts full.
    pub fn new(capacity: u32, per_minute: u32, now: Instant) -> Self {
        let capacity = capacity.max(1) as f64;
        TokenBucket {
            capacity,
            per_sec: per_minute.max(1) as f64 / 60.0,
            tokens: capacity,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.per_sec).min(self.capacity);
        self.last = self.last.max(now);
    }

    /// Takes one token and returns how long the caller must wait before using it (zero when one
    /// was available).
    pub fn reserve(&mut self, now: Instant) -> Duration {
        self.refill(now);
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.per_sec)
        }
    }

    /// Tokens available now (negative while reservations are queued).
    pub fn available(&mut self, now: Instant) -> f64 {
        self.refill(now);
        self.tokens
    }
}

/// The async governor around a [`TokenBucket`].
#[derive(Debug)]
pub struct MintGovernor {
    bucket: Mutex<TokenBucket>,
}

impl MintGovernor {
    pub fn new(per_minute: u32, burst: u32) -> Self {
        MintGovernor {
            bucket: Mutex::new(TokenBucket::new(burst, per_minute, Instant::now())),
        }
    }

    /// Waits for a mint slot; returns how long it waited.
    pub async fn acquire(&self) -> Duration {
        let wait = self
            .bucket
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reserve(Instant::now());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_paced_then_refills_to_capacity() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(3, 60, t0); // 1 per second
        for _ in 0..3 {
            assert_eq!(b.reserve(t0), Duration::ZERO);
        }
        assert_eq!(b.reserve(t0), Duration::from_secs(1));
        assert_eq!(b.reserve(t0), Duration::from_secs(2));
        // 2.5 s later: the two reservations are paid, half a token accrued.
        let t1 = t0 + Duration::from_millis(2500);
        assert!((b.available(t1) - 0.5).abs() < 1e-9);
        assert_eq!(b.reserve(t1), Duration::from_millis(500));
        // Long idle: capped at capacity, not more.
        let t2 = t0 + Duration::from_secs(100);
        assert!((b.available(t2) - 3.0).abs() < 1e-9);
    }

    #[test]
    fn default_rate_is_150_per_minute() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1, 150, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        assert_eq!(b.reserve(t0), Duration::from_millis(400));
        assert_eq!(b.reserve(t0), Duration::from_millis(800));
    }

    #[test]
    fn time_going_backwards_is_harmless() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut b = TokenBucket::new(1, 60, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        let earlier = t0 - Duration::from_secs(5);
        assert_eq!(b.reserve(earlier), Duration::from_secs(1));
    }
}
