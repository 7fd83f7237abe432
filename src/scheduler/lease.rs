//! The delivery lease of a cluster member (DESIGN.md §10): only the leader delivers, and only while a
//! majority of the members has lately confirmed it leads. The cluster extends the lease each time a
//! round of heartbeats sent at `t` is acknowledged by a majority, to `t` plus less than the time in
//! which those members refuse to vote for anyone else; a lane hands a batch to its sink only while
//! the lease holds. So a leader cut off from the others stops delivering by itself, before another
//! member can be elected, even if nothing tells it that it lost.
//!
//! Invariants:
//! - The lease is real time (`Instant`), never the scheduler's [`crate::schedulelog::Clock`]: Raft's
//!   timers are real time, and a test's manual clock must not stretch it.
//! - It only moves forward while held ([`Lease::extend_to`] keeps the later end), and
//!   [`Lease::revoke`] ends it at once (leadership lost).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Until when this member may deliver. A new lease holds nothing.
#[derive(Debug)]
pub struct Lease {
    /// What `until_us` counts from.
    origin: Instant,
    /// The end of the lease, in microseconds after `origin`; 0: no lease.
    until_us: AtomicU64,
}

impl Default for Lease {
    fn default() -> Lease {
        Lease::new()
    }
}

impl Lease {
    pub fn new() -> Lease {
        Lease {
            origin: Instant::now(),
            until_us: AtomicU64::new(0),
        }
    }

    /// Whether the lease holds now.
    pub fn holds(&self) -> bool {
        self.micros(Instant::now()) < self.until_us.load(Ordering::SeqCst)
    }

    /// Makes the lease hold until `until`, unless it already holds longer.
    pub fn extend_to(&self, until: Instant) {
        self.until_us
            .fetch_max(self.micros(until), Ordering::SeqCst);
    }

    /// Ends the lease now.
    pub fn revoke(&self) {
        self.until_us.store(0, Ordering::SeqCst);
    }

    /// How long the lease still holds (zero when it does not).
    pub fn remaining(&self) -> Duration {
        let until = self.until_us.load(Ordering::SeqCst);
        Duration::from_micros(until.saturating_sub(self.micros(Instant::now())))
    }

    fn micros(&self, at: Instant) -> u64 {
        // +1: an instant at the origin is still after "no lease".
        u64::try_from(at.saturating_duration_since(self.origin).as_micros())
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_holds_until_its_end_and_only_moves_forward() {
        let lease = Lease::new();
        assert!(!lease.holds(), "a new lease holds nothing");
        let later = Instant::now() + Duration::from_secs(60);
        lease.extend_to(later);
        assert!(lease.holds());
        assert!(lease.remaining() > Duration::from_secs(59));
        // An older round's acknowledgement does not shorten it.
        lease.extend_to(Instant::now());
        assert!(lease.holds());
        lease.revoke();
        assert!(!lease.holds());
        assert_eq!(lease.remaining(), Duration::ZERO);
        // A lease whose end passed no longer holds.
        lease.extend_to(Instant::now());
        assert!(!lease.holds());
    }
}
