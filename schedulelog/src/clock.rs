//! Time, as the engine and the scheduler see it.
//!
//! Everything that needs "now" asks a [`Clock`]; nothing reads the system time directly. Production uses
//! [`SystemClock`]; tests drive a [`ManualClock`] and run hours of simulated time in milliseconds.
//!
//! A thread that waits for a moment asks the clock how long to wait in real time ([`Clock::real_wait`])
//! and also listens to [`Clock::changes`]: a manual clock never passes by itself, so it signals every
//! time a test moves it.

use crossbeam_channel::{Receiver, Sender};
use std::fmt::Debug;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of unix time in milliseconds.
pub trait Clock: Send + Sync + Debug {
    fn now_ms(&self) -> i64;

    /// How long to wait in real time until `deadline_ms` may have come; `None` when only a signal on
    /// [`Clock::changes`] can bring it.
    fn real_wait(&self, deadline_ms: i64) -> Option<Duration>;

    /// A channel signalled whenever the clock is moved by hand. The system clock never signals.
    fn changes(&self) -> Receiver<()>;
}

/// The machine's real-time clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
    }

    fn real_wait(&self, deadline_ms: i64) -> Option<Duration> {
        let now_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros();
        let deadline_us = u128::try_from(deadline_ms.max(0)).unwrap_or(0) * 1000;
        let wait_us = deadline_us.saturating_sub(now_us);
        Some(Duration::from_micros(
            u64::try_from(wait_us).unwrap_or(u64::MAX),
        ))
    }

    fn changes(&self) -> Receiver<()> {
        crossbeam_channel::never()
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ms: AtomicI64,
    watchers: Mutex<Vec<Sender<()>>>,
}

impl ManualClock {
    pub fn new(now_ms: i64) -> ManualClock {
        ManualClock {
            now_ms: AtomicI64::new(now_ms),
            watchers: Mutex::default(),
        }
    }

    pub fn set(&self, now_ms: i64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
        self.notify();
    }

    pub fn advance(&self, by_ms: i64) {
        self.now_ms.fetch_add(by_ms, Ordering::SeqCst);
        self.notify();
    }

    fn notify(&self) {
        let mut watchers = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        // A full channel already holds a signal; a disconnected one has no reader left.
        watchers.retain(|w| {
            !matches!(
                w.try_send(()),
                Err(crossbeam_channel::TrySendError::Disconnected(_))
            )
        });
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.now_ms.load(Ordering::SeqCst)
    }

    fn real_wait(&self, _deadline_ms: i64) -> Option<Duration> {
        None
    }

    fn changes(&self) -> Receiver<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(tx);
        rx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_signals_each_watcher() {
        let clock = ManualClock::new(5);
        let (a, b) = (clock.changes(), clock.changes());
        assert!(a.try_recv().is_err());
        clock.advance(10);
        clock.set(100); // coalesces with the first signal
        assert_eq!(clock.now_ms(), 100);
        assert!(a.try_recv().is_ok() && b.try_recv().is_ok());
        assert!(a.try_recv().is_err());
        drop(b);
        clock.advance(1);
        assert!(a.try_recv().is_ok());
        assert_eq!(clock.real_wait(1_000), None);
    }

    #[test]
    fn system_clock_waits_for_the_deadline() {
        let clock = SystemClock;
        let now = clock.now_ms();
        assert_eq!(clock.real_wait(now - 1), Some(Duration::ZERO));
        let wait = clock.real_wait(now + 1_000).unwrap();
        assert!(wait > Duration::from_millis(990) && wait <= Duration::from_millis(1_000));
    }
}
