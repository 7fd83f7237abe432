//! A token bucket on the scheduler's clock: `rate` tokens per second, at most `burst` saved up.
//!
//! Time is passed in, so a manual clock drives it exactly: after a long outage the backlog drains at the
//! configured rate instead of all at once.

#[derive(Debug, Clone)]
pub struct TokenBucket {
    per_ms: f64,
    burst: f64,
    tokens: f64,
    last_ms: i64,
}

impl TokenBucket {
    pub fn new(rate_per_sec: f64, burst: u32, now_ms: i64) -> TokenBucket {
        let burst = f64::from(burst.max(1));
        TokenBucket {
            per_ms: rate_per_sec / 1000.0,
            burst,
            tokens: burst,
            last_ms: now_ms,
        }
    }

    fn refill(&mut self, now_ms: i64) {
        if now_ms > self.last_ms {
            let earned = (now_ms - self.last_ms) as f64 * self.per_ms;
            self.tokens = (self.tokens + earned).min(self.burst);
            self.last_ms = now_ms;
        }
    }

    /// Takes one token if there is one.
    pub fn try_take(&mut self, now_ms: i64) -> bool {
        self.refill(now_ms);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Gives back a token taken for something that could not go out after all.
    pub fn refund(&mut self) {
        self.tokens = (self.tokens + 1.0).min(self.burst);
    }

    /// When the next token will be there.
    pub fn next_token_ms(&self) -> i64 {
        if self.tokens >= 1.0 {
            return self.last_ms;
        }
        let wait = ((1.0 - self.tokens) / self.per_ms).ceil();
        self.last_ms + wait as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drains_at_the_rate_after_the_burst() {
        let mut bucket = TokenBucket::new(10.0, 5, 0);
        let burst = (0..100).take_while(|_| bucket.try_take(0)).count();
        assert_eq!(burst, 5);
        assert_eq!(bucket.next_token_ms(), 100);
        assert!(!bucket.try_take(99));
        assert!(bucket.try_take(100));
        // One second later: ten more, no matter how often it is asked.
        let mut taken = 0;
        for ms in 101..=1_100 {
            while bucket.try_take(ms) {
                taken += 1;
            }
        }
        assert_eq!(taken, 10);
        bucket.refund();
        assert!(bucket.try_take(1_100));
    }
}
