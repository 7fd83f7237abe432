//! Test-only fault injection: the failures a test can ask the engine to pretend, at the points where the
//! real ones would happen, so that the failure paths run the same code as in production.
//!
//! [`Fault::Sync`] and [`Fault::DiskFullAtRoll`] are handed to the WAL writer through its request channel
//! (so they take effect in order with the requests around them). The others arm counters in [`Faults`],
//! shared by the replayer, the segment writers and the dispatch logs of one [`crate::ScheduleLog`]: each
//! armed count makes that many of the next operations at its point fail, then the point works again.

use crate::error::{Error, Result};
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Condvar, Mutex};

/// An I/O failure a test asks the engine to pretend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The WAL writer's next fdatasync fails.
    Sync,
    /// The WAL writer's next rollover finds no space for the new file.
    DiskFullAtRoll,
    /// The next `n` segment writes (creating a segment, or writing records, which then half reach the
    /// files) fail with `ENOSPC`; 0 disarms.
    SegmentWritesFull(u32),
    /// The next `n` checkpoint writes fail with `ENOSPC`; 0 disarms.
    CheckpointWritesFull(u32),
    /// The next `n` dispatch log appends write half their bytes, then fail with `ENOSPC`; 0 disarms.
    DispatchAppendsFull(u32),
    /// The next segment fsync fails with `EIO`.
    SegmentSyncFails,
    /// The next dispatch log fsync fails with `EIO`.
    DispatchSyncFails,
}

/// Where an armed fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Point {
    SegmentWrite,
    CheckpointWrite,
    DispatchAppend,
    SegmentSync,
    DispatchSync,
}

/// Armed counts, one per [`Point`], and the gate checkpoint jobs pass.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    armed: [AtomicU32; 5],
    pub checkpoint_gate: Gate,
}

/// Where the next checkpoint job waits when a test asks (before it syncs or stores anything) until the
/// test lets it go, so that a test can see what goes on while a checkpoint is slow.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    /// (the next job is to be held, a job is held)
    state: Mutex<(bool, bool)>,
    changed: Condvar,
    /// Jobs that reached the gate.
    pub reached: AtomicU32,
    /// Jobs that finished (stored, skipped or failed).
    pub finished: AtomicU32,
}

impl Gate {
    /// Holds the next job that comes (`true`), or lets a held one go (`false`).
    pub(crate) fn hold_next(&self, hold: bool) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        *state = match hold {
            true => (true, state.1),
            false => (false, false),
        };
        self.changed.notify_all();
    }

    pub(crate) fn pass(&self) {
        self.reached.fetch_add(1, Ordering::SeqCst);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if std::mem::take(&mut state.0) {
            state.1 = true;
            drop(self.changed.wait_while(state, |state| state.1));
        }
    }
}

impl Faults {
    /// Arms (or with a count of 0, disarms) a fault that strikes outside the WAL writer.
    pub(crate) fn arm(&self, fault: Fault) {
        let (point, count) = match fault {
            Fault::SegmentWritesFull(n) => (Point::SegmentWrite, n),
            Fault::CheckpointWritesFull(n) => (Point::CheckpointWrite, n),
            Fault::DispatchAppendsFull(n) => (Point::DispatchAppend, n),
            Fault::SegmentSyncFails => (Point::SegmentSync, 1),
            Fault::DispatchSyncFails => (Point::DispatchSync, 1),
            Fault::Sync | Fault::DiskFullAtRoll => unreachable!("the WAL writer takes {fault:?}"),
        };
        self.armed[point as usize].store(count, Ordering::SeqCst);
    }

    /// Whether the operation at `point` must fail now (using up one armed count).
    pub(crate) fn strikes(&self, point: Point) -> bool {
        self.armed[point as usize]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// `Err(ENOSPC on path)` when a disk-full fault at `point` strikes.
    pub(crate) fn disk_full_at(&self, point: Point, path: &Path) -> Result<()> {
        match self.strikes(point) {
            true => Err(Error::io(path)(no_space())),
            false => Ok(()),
        }
    }

    /// `Err(EIO syncing path)` when a sync fault at `point` strikes.
    pub(crate) fn sync_fails_at(&self, point: Point, path: &Path) -> Result<()> {
        match self.strikes(point) {
            true => Err(Error::sync(path)(io::Error::from_raw_os_error(libc::EIO))),
            false => Ok(()),
        }
    }
}

/// What the kernel answers a write that finds no space.
pub(crate) fn no_space() -> io::Error {
    io::Error::from_raw_os_error(libc::ENOSPC)
}
