//! Disk space: whether new messages are refused for want of it, and why.
//!
//! A full disk is a state, not a death. Two things make it:
//! - **The reserve.** While the data dir's file system has less than `limits.min_free_disk_bytes` free,
//!   new messages are refused (507 `disk_full`), so that what is already accepted can still be worked
//!   off: deliveries into the broker, retries and cancels through the WAL, outcomes in the dispatch logs
//!   all write into the reserve (RocketMQ refuses new messages at a disk-usage ratio and keeps consuming
//!   the same way).
//! - **A writer that met ENOSPC** (the WAL could not roll, the replayer or the broker could not write):
//!   each one reports its cause until its next write succeeds, and retries on its own.
//!
//! [`DiskWatch::check`] runs once a second: it logs each change (with the file and the OS error the
//! writer saw), sets `delayd_disk_full` and `delayd_disk_free_bytes`, and is what `/readyz` reads.
//! Between two checks the ingest routes draw on a budget, the free space above the reserve at the last
//! check, at twice each request's size (a message takes that much: its copy in a schedule segment and
//! its copy in the broker; the WAL's files are preallocated): a burst cannot run through the reserve in
//! the second before the next check. Nothing here blocks a writer: they meet the disk as it is.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;

/// The disk's state, as the last check saw it.
#[derive(Debug)]
pub struct DiskWatch {
    data_dir: PathBuf,
    reserve_bytes: u64,
    state: Mutex<State>,
    /// Bytes new messages may still take before the reserve is reached (see the module doc).
    budget: AtomicI64,
}

#[derive(Debug, Default)]
struct State {
    /// Why new messages are refused (free space below the reserve).
    refusing: Option<String>,
    /// What each writer reported (`None`: fine), in the order [`DiskWatch::check`] is given them.
    blocked: Vec<Option<String>>,
}

impl DiskWatch {
    pub fn new(data_dir: PathBuf, reserve_bytes: u64) -> DiskWatch {
        DiskWatch {
            data_dir,
            reserve_bytes,
            state: Mutex::default(),
            budget: AtomicI64::new(i64::MAX),
        }
    }

    /// Takes room for a request of `bytes` of new messages: `Err(why)` if the reserve is reached or
    /// would be before the next check (nothing taken then).
    pub fn admit(&self, bytes: usize) -> Result<(), String> {
        if let Some(why) = self.refusing() {
            return Err(why);
        }
        if self.reserve_bytes == 0 {
            return Ok(());
        }
        let cost = i64::try_from(bytes)
            .unwrap_or(i64::MAX / 2)
            .saturating_mul(2);
        let left = self
            .budget
            .fetch_sub(cost, Ordering::SeqCst)
            .saturating_sub(cost);
        if left < 0 {
            self.budget.fetch_add(cost, Ordering::SeqCst);
            return Err(format!(
                "the free space above limits.min_free_disk_bytes ({}) is taken: new messages are refused",
                mib(self.reserve_bytes)
            ));
        }
        Ok(())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why new messages are refused now, if they are.
    pub fn refusing(&self) -> Option<String> {
        self.state().refusing.clone()
    }

    /// Why the node is short of disk (refusing new messages, or a writer blocked), if it is.
    pub fn full(&self) -> Option<String> {
        let state = self.state();
        state
            .refusing
            .iter()
            .chain(state.blocked.iter().flatten())
            .cloned()
            .reduce(|a, b| format!("{a}; {b}"))
    }

    /// Reads the free space and takes the writers' reports (`None` for a writer that is fine); logs what
    /// changed and sets the gauges.
    pub fn check(&self, writers: &[Option<String>]) {
        let free = match schedulelog::available_bytes(&self.data_dir) {
            Ok(free) => Some(free),
            Err(error) => {
                tracing::debug!(%error, dir = %self.data_dir.display(), "reading the free space failed");
                None
            }
        };
        if let Some(free) = free {
            metrics::gauge!("delayd_disk_free_bytes").set(free as f64);
            let room = i64::try_from(free.saturating_sub(self.reserve_bytes)).unwrap_or(i64::MAX);
            self.budget.store(room, Ordering::SeqCst);
        }
        let refusing = free.filter(|&free| free < self.reserve_bytes).map(|free| {
            format!(
                "{} free on the file system of {}, below limits.min_free_disk_bytes ({}): new messages are refused",
                mib(free),
                self.data_dir.display(),
                mib(self.reserve_bytes)
            )
        });
        let mut state = self.state();
        match (&state.refusing, &refusing) {
            (None, Some(why)) => {
                tracing::error!(cause = %why, "disk full: new messages are refused until space is freed")
            }
            (Some(_), None) => {
                tracing::info!(free = ?free, "disk space is back above the reserve: new messages are accepted again")
            }
            _ => {}
        }
        // Once per writer as it gets held up and as it writes again; a cause whose text changes while
        // it lasts (the free space in it) is not news.
        state.blocked.resize(writers.len(), None);
        for (was, now) in state.blocked.iter().zip(writers) {
            match (was, now) {
                (None, Some(cause)) => {
                    tracing::error!(%cause, "disk full: a write failed for want of space; it is retried, and the node heals once space is freed")
                }
                (Some(cause), None) => {
                    tracing::info!(was = %cause, "a write held up by the full disk went through: healed")
                }
                _ => {}
            }
        }
        let full = refusing.is_some() || writers.iter().any(Option::is_some);
        metrics::gauge!("delayd_disk_full").set(if full { 1.0 } else { 0.0 });
        *state = State {
            refusing,
            blocked: writers.to_vec(),
        };
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}
