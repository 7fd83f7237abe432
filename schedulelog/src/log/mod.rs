//! The public face of the engine: [`ScheduleLog`] opens a data dir, recovers it, runs the WAL writer and
//! the replayer, and answers appends, cancels, lookups, outcome records and retirement.
//!
//! ```text
//! data/
//!   LOCK          flock, held while the log is open
//!   meta          file header (magic b"DLYDMETA") holding segment_minutes
//!   wal/          wal.rs
//!   schedule/     segment.rs
//!   dispatch/     dispatch.rs
//!   checkpoint    checkpoint.rs
//!   raft/vote     vote.rs (cluster members only)
//! ```
//!
//! Failure states, as the service sees them:
//! - **Poisoned** ([`ScheduleLog::poisoned`]): a WAL write or any sync failed, or the replayer stopped on
//!   an error other than a full disk. The cause is the first failure's own message, with its file. Every
//!   later append and cancel fails; only a restart clears it.
//! - **Disk full** ([`ScheduleLog::disk_full`]): a writer is held up by a full disk and retrying: the
//!   replayer (a committed group, or a checkpoint; appends are still acknowledged while the WAL has room,
//!   and the replayer takes their groups into a backlog; past its bound new requests fail with
//!   [`AppendError::DiskFull`] rather than wait), or the WAL writer's rollover (requests
//!   that need a new WAL file fail with [`AppendError::DiskFull`]). It clears by itself once the held-up
//!   work succeeds. Nothing acknowledged is lost meanwhile: it is in the WAL, which is deleted only below
//!   a checkpoint.
//!
//! Here: the handle, the state its threads and callers share, the write side (appends and cancels go
//! to the WAL writer's queue, outcomes straight to the dispatch logs) and shutdown. The rest, by
//! concern: `open` (locking, recovery, starting the threads), `replayer` (the replayer thread), `read`
//! (single records and outcomes), `lookup` (a message's status by id), `scan` (whole buckets: the
//! loader's watch, rebuild scans), `retire` (retention) and `entries` (a replicated data dir's Raft
//! log: entries in, read back, cut off and applied), `snapshot` (its files linked for a snapshot) and
//! `schedules` (the schedule table, read).

mod entries;
mod lookup;
mod open;
mod read;
mod replayer;
mod retire;
mod scan;
mod schedules;
mod snapshot;

pub(crate) use lookup::state_of;
pub use lookup::{Attempt, MessageState, MessageStatus};
pub use scan::BucketSnapshot;
pub use snapshot::LinkedSchedule;

use crate::bucket::{Bucket, SegmentMinutes};
use crate::clock::{Clock, SystemClock};
use crate::commit::{Ack, Appended, CommittedGroup, FsyncPolicy, Request};
use crate::dispatch::DispatchLogs;
use crate::entry::{EntryLog, PlacedOutcome};
use crate::error::{AppendError, DiskFullReport, Error, Result};
use crate::id::Location;
use crate::proposals::Proposals;
use crate::record::{EncodedMessage, Outcome};
use crate::replay::Replay;
use crate::segment::RecordReader;
use crate::view::Views;
use crossbeam_channel::Sender;
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// How a data dir is opened.
#[derive(Debug, Clone)]
pub struct Options {
    /// Bucket width; must match what the data dir was created with.
    pub segment_minutes: SegmentMinutes,
    pub fsync: FsyncPolicy,
    /// Size of each preallocated WAL file.
    pub wal_segment_bytes: u64,
    /// How long a finished bucket stays queryable after it ended.
    pub retention: Duration,
    /// Replay checkpoints at least this often (and after `checkpoint_bytes` of WAL).
    pub checkpoint_interval: Duration,
    /// 1 GiB by default, so that below ~500 MB/s of WAL the interval decides. Each checkpoint makes the
    /// replayer write the last page of every segment it writes to again (twice with `syncfs`, which
    /// writes back in two passes): on the realistic mix, 1,442 files, 0.04 bytes per body byte for a
    /// checkpoint a second against 0.02 for one every 2 s. The price is the WAL a crash leaves to
    /// replay: up to ~1 GiB, a few seconds.
    pub checkpoint_bytes: u64,
    pub clock: Arc<dyn Clock>,
    /// The data dir is a cluster member's: its WAL is the Raft log (entries, not plain appends), and
    /// records are filed once their entries are applied. Fixed when the data dir is created.
    pub replicated: bool,
    /// Faults armed before the open (see fault.rs): what a test of recovery on a full disk needs.
    #[cfg(test)]
    pub(crate) faults: Option<Arc<crate::fault::Faults>>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            segment_minutes: SegmentMinutes::DEFAULT,
            fsync: FsyncPolicy::Always,
            wal_segment_bytes: 64 << 20,
            retention: Duration::from_secs(24 * 3600),
            checkpoint_interval: Duration::from_secs(2),
            checkpoint_bytes: 1 << 30,
            clock: Arc::new(SystemClock),
            replicated: false,
            #[cfg(test)]
            faults: None,
        }
    }
}

struct Shared {
    data_dir: PathBuf,
    width: SegmentMinutes,
    retention: Duration,
    dispatch: DispatchLogs,
    /// Buckets' records in due order and outcomes by seq, for listings and lookups (view.rs).
    views: Views,
    replay: Mutex<Replay>,
    /// Open segment logs for [`ScheduleLog::read_record`], so that delivering reads records without the
    /// replayer's lock (held while it writes, for milliseconds on a slow disk). Filled, and emptied of a
    /// retired bucket, with that lock held, so a bucket in here has its segment (lock order: `replay`,
    /// then this).
    records: Mutex<HashMap<Bucket, Arc<RecordReader>>>,
    /// Signalled each time the replayer publishes a new `next_seq`.
    replayed: Condvar,
    /// Every seq below this is durable in the WAL (in a replicated data dir: applied).
    committed: Arc<AtomicU64>,
    /// Every seq below this is filed: replayed into its segment (a cancel, into its dispatch log).
    filed: AtomicU64,
    clock: Arc<dyn Clock>,
    /// The replayer's schedule table (its `schedules`), for readers.
    schedules: Arc<Mutex<crate::schedules::ScheduleTable>>,
    /// Why the log stopped accepting writes, once it has.
    poisoned: Arc<OnceLock<String>>,
    /// Which writers a full disk holds up.
    disk_full: Arc<DiskFullReport>,
    /// Set when the log shuts down: a replayer held up by a full disk gives up instead of retrying
    /// (its backlog may be full, with the writer waiting to hand it one more group).
    closing: std::sync::atomic::AtomicBool,
    /// Set by tests that simulate a crash: the replayer exits without its final checkpoint.
    #[cfg(test)]
    crashed: std::sync::atomic::AtomicBool,
    #[cfg(test)]
    faults: Arc<crate::fault::Faults>,
}

impl Shared {
    fn replay(&self) -> MutexGuard<'_, Replay> {
        self.replay.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn records(&self) -> MutexGuard<'_, HashMap<Bucket, Arc<RecordReader>>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Poisons the log after a failed sync met outside the writer and the replayer threads (a checkpoint
    /// or a retirement run by a caller). The writer reads the cause before its next request; the replayer
    /// stops at its next checkpoint, which the failed sync makes fail.
    fn poison_on_sync_failure<T>(&self, result: &Result<T>) {
        if let Err(e) = result {
            if e.is_sync_failure() {
                let _ = self.poisoned.set(e.to_string());
            }
        }
    }
}

/// An open data dir. Dropping it shuts the writer and replayer down cleanly (pending groups are committed
/// and a final checkpoint is written); [`ScheduleLog::close`] does the same and reports errors.
pub struct ScheduleLog {
    shared: Arc<Shared>,
    /// A replicated data dir's Raft entries (log/entries.rs).
    entry_log: Option<Arc<EntryLog>>,
    /// Where applied entries go to the replayer (a replicated data dir).
    apply: Option<Sender<CommittedGroup>>,
    /// Where a replicated log's appends, cancels and outcomes go, for its proposer, and their queue
    /// until the proposer takes it.
    propose: Option<Sender<Request>>,
    proposals: Mutex<Option<Proposals>>,
    submit: Option<Sender<Request>>,
    writer: Option<JoinHandle<()>>,
    replayer: Option<JoinHandle<Result<()>>>,
    _lock: File,
}

impl std::fmt::Debug for ScheduleLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScheduleLog")
            .field("data_dir", &self.shared.data_dir)
            .finish_non_exhaustive()
    }
}

impl ScheduleLog {
    /// Why the log refuses writes, if it does: a WAL write or any sync failed, or the replayer stopped
    /// on an error other than a full disk (the cause names the file). Only a restart clears it.
    pub fn poisoned(&self) -> Option<String> {
        self.shared.poisoned.get().cloned()
    }

    /// Why a writer of the engine is held up by a full disk, if one is: the replayer retrying a
    /// committed group or a checkpoint, or the WAL writer unable to start a new file. Names the file and
    /// the OS error. `None` again once the held-up work succeeded; no restart is needed. Cheap enough to
    /// poll.
    pub fn disk_full(&self) -> Option<String> {
        self.shared.disk_full.cause()
    }

    /// Arms a pretended failure (see fault.rs).
    #[cfg(test)]
    pub(crate) fn inject_fault(&self, fault: crate::fault::Fault) {
        use crate::fault::Fault;
        match fault {
            Fault::Sync | Fault::DiskFullAtRoll => self.submit(Request::InjectFault(fault)),
            _ => self.shared.faults.arm(fault),
        }
    }

    /// The gate checkpoint jobs pass (see fault.rs).
    #[cfg(test)]
    pub(crate) fn checkpoint_gate(&self) -> &crate::fault::Gate {
        &self.shared.faults.checkpoint_gate
    }

    /// The bucket width of this data dir.
    pub fn segment_minutes(&self) -> SegmentMinutes {
        self.shared.width
    }

    /// Submits messages; they become durable together, in one group commit.
    pub fn append(&self, messages: Vec<EncodedMessage>) -> Ack<Vec<Appended>> {
        let (request, ack) = Request::append(messages);
        self.submit(request);
        ack
    }

    /// Submits a tombstone for the attempt at `target`. Resolves to the tombstone's seq once durable.
    /// It takes effect for [`ScheduleLog::watch`] once filed (see [`ScheduleLog::filed_below`]).
    pub fn cancel(&self, target: Location) -> Ack<u64> {
        let (request, ack) = Request::cancel(target);
        self.submit(request);
        ack
    }

    /// Queues a request for the writer without blocking: a full queue (4096 requests waiting for the
    /// disk) answers [`AppendError::Overloaded`], so that callers shed load instead of piling up.
    fn submit(&self, request: Request) {
        let queue = match &self.propose {
            Some(propose) if request.is_proposal() => Some(propose),
            _ => self.submit.as_ref(),
        };
        let sent = match queue {
            Some(queue) => queue.try_send(request),
            None => Err(crossbeam_channel::TrySendError::Disconnected(request)),
        };
        match sent {
            Ok(()) => {}
            Err(crossbeam_channel::TrySendError::Full(request)) => {
                request.fail(AppendError::Overloaded)
            }
            Err(crossbeam_channel::TrySendError::Disconnected(request)) => {
                request.fail(AppendError::Closed)
            }
        }
    }

    /// Records outcomes in the dispatch logs of their buckets, durably. A failed sync poisons the log
    /// (never retried: the kernel may have dropped the pages); a full disk may be retried. In a
    /// replicated log they are proposed, as records of an entry ([`Proposals`]), and this returns once
    /// that entry is applied here and its outcomes are in the dispatch logs (`NotFiledYet` when they
    /// are committed but not filed within 10 s).
    pub fn record_outcomes(&self, outcomes: &[(Bucket, Outcome)]) -> Result<()> {
        if self.entry_log.is_some() {
            // Every member's dispatch logs must match: a cluster records outcomes in entries.
            let (request, ack) = Request::outcomes(outcomes.to_vec());
            self.submit(request);
            ack.wait().map_err(Error::Append)?;
            // Applied means handed to the replayer: wait for it to reach the dispatch logs, as a
            // single node's outcomes have when this returns.
            return match self.wait_applied() {
                true => Ok(()),
                false => Err(Error::NotFiledYet {
                    cause: self.disk_full(),
                }),
            };
        }
        let result = self.shared.dispatch.append(outcomes);
        self.shared.poison_on_sync_failure(&result);
        result
    }

    /// Proposes `payload` for the application, in the next entry this member's proposer forms (with
    /// the appends, cancels and outcomes queued beside it), and returns once that entry is committed
    /// and applied here: the cluster layer hands an entry's payloads (`crate::app_payloads`) to the
    /// application before it applies the entry, so the application's own effect of it is done on this
    /// member too. The engine itself passes them over. Errors: the proposer's (`NotLeader`,
    /// `Uncertain`, `Closed`, ...); `Refused` on a single node's log, and for a payload larger than
    /// one entry may carry ([`MAX_APP_PAYLOAD_BYTES`](crate::MAX_APP_PAYLOAD_BYTES)). Blocks.
    pub fn propose_app(&self, payload: Vec<u8>) -> std::result::Result<(), AppendError> {
        self.propose_app_with(payload, Vec::new())
    }

    /// [`ScheduleLog::propose_app`] with outcomes in the same entry: the application's change and
    /// the outcomes it makes true are committed, and applied on every member, together (the broker's
    /// deliveries and their `delivered` outcomes, say), so no crash or failover separates them.
    pub fn propose_app_with(
        &self,
        payload: Vec<u8>,
        outcomes: Vec<PlacedOutcome>,
    ) -> std::result::Result<(), AppendError> {
        if self.entry_log.is_none() {
            return Err(AppendError::Refused(
                "a single node's log proposes nothing: application payloads need a cluster".into(),
            ));
        }
        if payload.len() > crate::MAX_APP_PAYLOAD_BYTES {
            return Err(AppendError::Refused(format!(
                "an application payload of {} bytes is larger than one Raft entry may carry ({})",
                payload.len(),
                crate::MAX_APP_PAYLOAD_BYTES
            )));
        }
        let (request, ack) = Request::app(payload, outcomes);
        self.submit(request);
        ack.wait()
    }

    /// Replays everything acknowledged so far, syncs the segments and writes a checkpoint now. A failed
    /// sync poisons the log.
    pub fn checkpoint(&self) -> Result<()> {
        self.wait_replayed(0);
        // (A checkpoint taken before the replayer caught up is only older, never wrong.)
        let _ = self.wait_applied();
        let result = self.shared.replay().checkpoint();
        self.shared.poison_on_sync_failure(&result);
        result
    }

    /// Shuts down: commits pending groups, replays them, writes a final checkpoint.
    pub fn close(mut self) -> Result<()> {
        self.shutdown()
    }

    /// Stops like a killed process would leave things: acknowledged groups are in the WAL, segments hold
    /// whatever was replayed, and no checkpoint is written after the last one.
    #[cfg(test)]
    pub(crate) fn crash(mut self) {
        self.shared.crashed.store(true, Ordering::SeqCst);
        let _ = self.shutdown();
    }

    fn shutdown(&mut self) -> Result<()> {
        self.shared.closing.store(true, Ordering::SeqCst);
        self.submit = None;
        self.apply = None;
        self.propose = None;
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
        match self.replayer.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(Error::io("replayer")(io::Error::other(
                "replayer thread panicked",
            ))),
            None => Ok(()),
        }
    }
}

impl Drop for ScheduleLog {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
