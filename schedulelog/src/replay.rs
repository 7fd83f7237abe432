//! Replay: copies committed WAL records into the schedule segment of their bucket, and checkpoints.
//!
//! The replayer runs on its own thread, fed committed groups by the WAL writer (and, on open, the records
//! recovery found in the WAL). It is the only writer of schedule segments and the checkpoint.
//!
//! Invariants:
//! - Records are applied in seq order; `next_seq` is the first seq not yet applied, published only after
//!   the group's segment writes reached the files, so a reader that waits for `next_seq > seq` finds seq.
//!   The messages of watched buckets may be filed ahead of their group ([`Replay::apply_watched`], while
//!   the replayer waits for more groups): each segment still gets its records in seq order, and the apply
//!   of the group skips them as filed.
//! - A message goes to the bucket of `max(deliver_at, created_at)`: a message due in the past is filed
//!   under the bucket current at its commit, never under one that may already be retired.
//! - Replay is idempotent: a record whose seq is not above its segment's last seq is skipped, and a
//!   segment's last seq only counts records written to it (segment.rs). So a group whose application
//!   failed part-way (a full disk) can be applied again from its start: what reached a segment is kept,
//!   the rest is written, nothing twice. Cancels are outcomes, facts that may be recorded twice.
//! - A record is reported to the tap (a report is a delivery to the wheel) only after the write that put
//!   it in its segment succeeded, and a record is written once: so it is reported once, however many
//!   tries its group took. Reports come in seq order within a bucket, a bucket at a time (so not in seq
//!   order across the buckets of one `apply`); the wheel needs no order.
//! - Every later attempt of a message (a retry, attempt > 0) is also filed as a pointer under the message's
//!   first attempt: a `retried` outcome in the first attempt's dispatch log, for the first attempt's seq,
//!   whose `attempt` is the new attempt's number (greater than 0, which is how it differs from the
//!   `retried` outcome the dispatcher records for attempt 0 itself) and whose `next` is where the new
//!   attempt lives. Like cancels, pointers are facts written after the record is durable in the WAL and
//!   may be written twice. They let a lookup find the newest attempt without the chain of `retried`
//!   outcomes, which the dispatcher records only after the retry is durable and may fail to record.
//! - A checkpoint is written only after every segment written since the last one is synced and every
//!   segment created since is in a synced directory: by an `fdatasync` per file, or, for many segments,
//!   by one `syncfs` of the file system through a descriptor open since the log was, where that reports
//!   every write-back error on the file system since the descriptor was opened and a failed journal
//!   commit (Linux 5.17 and later on ext4, XFS or tmpfs: `sys::file_system_sync_is_reliable`). After a
//!   failed sync no checkpoint is ever written again (the sync may have dropped data a later sync would then claim durable): `checkpoint` fails
//!   with the first failure's cause until the log is reopened, and the WAL stays for recovery.
//! - A checkpoint is made in two steps: [`Replay::start_checkpoint`] takes, under the replayer's lock, a
//!   [`CheckpointJob`]: the marks every segment has now (all its records below `next_seq` are written)
//!   and which segments need a sync. [`CheckpointJob::run`] syncs them and stores the checkpoint without
//!   the lock, so the replayer goes on applying groups meanwhile (on a checkpointer thread, see
//!   log/replayer.rs): syncing hundreds of segments takes long, and a replayer stopped for it stops the
//!   WAL writer behind it. A sync covers the bytes written before it, so a segment written after the marks were taken is
//!   still synced up to them. [`Replay::finish_checkpoint`] then records what became durable.
//! - Jobs are numbered in the order they were taken, and a job older than the last one stored stores
//!   nothing (nor syncs anything): a checkpoint never goes back, and a segment removed after a newer
//!   checkpoint stopped listing it is never listed again.

use crate::bucket::{Bucket, SegmentMinutes};
use crate::checkpoint::{AppliedState, Checkpoint};
use crate::dispatch::DispatchLogs;
use crate::entry::{EntryLog, LogId};
use crate::error::{AppendError, Error, Result};
use crate::frame;
use crate::header::sync_dir;
use crate::id::Location;
use crate::record::{schedule_mark, MessageHead, Outcome, OutcomeKind, ScheduleMark};
use crate::schedules::{ScheduleTable, TableFiles};
use crate::segment::{self, IndexEntry, SegmentMark, SegmentWriter};
use crate::wal::{self, WalRecord};
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Segments kept open for append at most, two descriptors each: an eighth of the open-file limit in all,
/// the rest being for connections, readers, the broker and webhook calls (delayd raises the limit to its
/// hard one first, commonly 524,288: then 1,024 segments, 42 days of hourly buckets, so that a batch
/// spread over weeks finds every segment open). Past it, the least recently used quarter is closed.
#[cfg(not(test))]
fn max_open_segments() -> usize {
    let limit = crate::sys::open_file_limit().unwrap_or(1024);
    usize::try_from(limit / 16)
        .unwrap_or(usize::MAX)
        .clamp(16, 1024)
}
/// Tests keep two open, so that eviction and the checkpoint's sync of closed segments run constantly.
#[cfg(test)]
fn max_open_segments() -> usize {
    2
}

/// From how many segments to sync on a checkpoint makes one `syncfs` of the file system instead of an
/// `fdatasync` per file. Each `fdatasync` of a grown file commits the file system's journal and flushes
/// the disk: on the realistic mix (a batch spread over a month of hourly buckets, ~720 segments per
/// checkpoint, 1,440 files) that made a checkpoint take 1-6 s, so WAL files were retired late and the WAL
/// grew past its spares into new, zero-filled files. One `syncfs` writes the same pages back and commits
/// the journal once. It also writes back whatever else on the file system is dirty (the data dir should
/// have a file system of its own; operations.md says so), so a checkpoint of a few segments keeps the
/// per-file syncs.
#[cfg(not(test))]
const SYNC_FILE_SYSTEM_FROM: usize = 16;
/// Tests reach it with a few buckets, so that both ways run.
#[cfg(test)]
const SYNC_FILE_SYSTEM_FROM: usize = 3;

/// The records of `groups` from `next_seq` on, each with the bytes of its group (those below were
/// applied already: recovery overlaps the checkpoint).
fn unapplied<'a>(
    groups: &'a [(&'a [u8], &'a [WalRecord])],
    next_seq: u64,
) -> impl Iterator<Item = (&'a [u8], &'a WalRecord)> {
    groups
        .iter()
        .flat_map(|(bytes, records)| records.iter().map(move |r| (*bytes, r)))
        .filter(move |(_, r)| r.seq() >= next_seq)
}

/// A message to file: its bucket, head, the bytes of its WAL group and where its frame is in them.
type Filed<'a> = (Bucket, &'a MessageHead, &'a [u8], Range<usize>);

/// The bucket a message is filed under.
pub(crate) fn placement(head: &MessageHead, width: SegmentMinutes) -> Bucket {
    Bucket::of(head.deliver_at_ms.max(head.created_at_ms), width)
}

#[derive(Debug)]
struct SegmentState {
    /// What has been written (not necessarily synced).
    written: SegmentMark,
    /// What is known durable.
    synced: SegmentMark,
    writer: Option<SegmentWriter>,
    last_used: u64,
}

/// Something a replayed record did that a watcher of a bucket must know (see `ScheduleLog::watch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replayed {
    /// A message was filed into a watched bucket.
    Scheduled { bucket: Bucket, entry: IndexEntry },
    /// A message of a watched bucket was cancelled, by the tombstone with this seq.
    Cancelled { target: Location, seq: u64 },
}

/// A checkpoint to make: the marks to record, and the segments to sync before (see the module's
/// invariants).
#[derive(Debug)]
pub(crate) struct CheckpointJob {
    number: u64,
    stored: Arc<Mutex<Stored>>,
    checkpoint: Checkpoint,
    /// Segments written since their last sync: the mark to sync up to, and whether to drop the `.log`'s
    /// pages from the cache after (not for a bucket being delivered from).
    sync: Vec<(Bucket, SegmentMark, bool)>,
    schedule_dir: PathBuf,
    /// The schedule directory, open since the log was, for `syncfs` (see `SYNC_FILE_SYSTEM_FROM`);
    /// `None` where `syncfs` cannot stand in for the files' own syncs (`file_system_sync_is_reliable`).
    file_system: Option<Arc<File>>,
    checkpoint_path: PathBuf,
    width: SegmentMinutes,
    /// The schedule table's files that changed since last stored, written before the checkpoint.
    table_files: TableFiles,
    #[cfg(test)]
    faults: Arc<crate::fault::Faults>,
}

/// What the checkpoint jobs of a log share (behind the lock a running job holds).
#[derive(Debug, Default)]
struct Stored {
    /// The number of the last job stored.
    number: u64,
    /// Why a sync failed, once one has: from then on no job stores anything (the failed sync may have
    /// dropped pages that a later sync, through another handle, would then claim durable).
    sync_failed: Option<String>,
}

impl CheckpointJob {
    /// Syncs the segments and the schedule directory, then stores the checkpoint: `Ok(true)`. Does
    /// nothing when a newer job was stored first: `Ok(false)`. Needs no lock but its own, which it holds
    /// throughout, so jobs never interleave.
    pub(crate) fn run(&self) -> Result<bool> {
        #[cfg(test)]
        self.faults.checkpoint_gate.pass();
        let result = self.sync_and_store();
        #[cfg(test)]
        self.faults
            .checkpoint_gate
            .finished
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        result
    }

    fn sync_and_store(&self) -> Result<bool> {
        let mut stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cause) = &stored.sync_failed {
            return Err(Error::Append(AppendError::Poisoned(cause.clone())));
        }
        if stored.number >= self.number {
            return Ok(false);
        }
        let result = self.sync_and_store_locked();
        match &result {
            Ok(()) => stored.number = self.number,
            Err(e) if e.is_sync_failure() => stored.sync_failed = Some(e.to_string()),
            Err(_) => {}
        }
        result.map(|()| true)
    }

    fn sync_and_store_locked(&self) -> Result<()> {
        let started = std::time::Instant::now();
        #[cfg(test)]
        for &(bucket, ..) in &self.sync {
            self.faults.sync_fails_at(
                crate::fault::Point::SegmentSync,
                &segment::log_path(&self.schedule_dir, bucket),
            )?;
        }
        match &self.file_system {
            // Kept open since the log was opened, so that a write-back error of any time since is
            // reported here, whoever else calls `syncfs` meanwhile.
            Some(dir) if self.sync.len() >= SYNC_FILE_SYSTEM_FROM => {
                crate::slow_disk::sync();
                crate::sys::sync_file_system(dir).map_err(Error::sync(&self.schedule_dir))?;
                for &(bucket, mark, drop_cache) in &self.sync {
                    if drop_cache {
                        segment::drop_cached_log(&self.schedule_dir, bucket, mark.log_len);
                    }
                }
            }
            _ => {
                for &(bucket, mark, drop_cache) in &self.sync {
                    segment::sync_files(&self.schedule_dir, bucket, mark.log_len, drop_cache)?;
                }
            }
        }
        // Every time, rather than after creations only: a job skipped above may have been the one to
        // sync the creations a newer job lists.
        sync_dir(&self.schedule_dir)?;
        // The schedule table's files first: a checkpoint never covers records they lack.
        self.table_files.store()?;
        #[cfg(test)]
        self.faults.disk_full_at(
            crate::fault::Point::CheckpointWrite,
            &crate::header::temp_path(&self.checkpoint_path),
        )?;
        self.checkpoint.store(&self.checkpoint_path, self.width)?;
        metrics::histogram!("delayd_sync_seconds", "file" => "checkpoint")
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// The replayer's state, shared behind a mutex with readers that need published entry counts.
#[derive(Debug)]
pub(crate) struct Replay {
    data_dir: PathBuf,
    schedule_dir: PathBuf,
    /// For checkpoint jobs (`CheckpointJob::file_system`).
    file_system: Option<Arc<File>>,
    wal_dir: PathBuf,
    /// How many retired WAL files are kept for reuse at most (wal.rs).
    wal_spares: usize,
    checkpoint_path: PathBuf,
    width: SegmentMinutes,
    segments: BTreeMap<Bucket, SegmentState>,
    /// First seq not applied yet.
    pub next_seq: u64,
    /// next_seq of the last checkpoint written.
    pub checkpointed_seq: u64,
    /// A replicated data dir's last Raft entry applied (through the groups applied), and what of it the
    /// last checkpoint written holds.
    pub applied: Option<AppliedState>,
    pub checkpointed_applied: Option<AppliedState>,
    /// A replicated data dir's entries, purged with their WAL files.
    pub entry_log: Option<Arc<EntryLog>>,
    /// The number of the last checkpoint job taken.
    jobs_taken: u64,
    /// What the jobs share: the last one stored, a failed sync (held while one runs).
    jobs_stored: Arc<Mutex<Stored>>,
    use_counter: u64,
    open_writers: usize,
    max_open_writers: usize,
    /// Buckets whose new records and cancels are reported to `tap`.
    pub watched: HashSet<Bucket>,
    pub tap: Option<crossbeam_channel::Sender<Replayed>>,
    /// Why a sync failed, once one has: from then on no checkpoint is written.
    sync_failed: Option<String>,
    /// How many segments the last `apply` wrote to.
    spread: usize,
    /// Recurring schedules, kept from the ops and firings applied (schedules.rs); readers lock it
    /// after this (lock order: the replayer's, then this).
    pub schedules: Arc<Mutex<ScheduleTable>>,
    #[cfg(test)]
    pub faults: Arc<crate::fault::Faults>,
}

impl Replay {
    /// Opens the segments of a data dir in the state the checkpoint describes: listed segments cut back to
    /// their marks, unlisted ones deleted.
    pub(crate) fn open(
        data_dir: &Path,
        width: SegmentMinutes,
        checkpoint: &Checkpoint,
        wal_spares: usize,
    ) -> Result<Replay> {
        let schedule_dir = data_dir.join("schedule");
        let mut deleted = false;
        for bucket in segment::list(&schedule_dir)? {
            if !checkpoint.segments.contains_key(&bucket) {
                segment::remove(&schedule_dir, bucket)?;
                deleted = true;
            }
        }
        if deleted {
            sync_dir(&schedule_dir)?;
        }
        let mut segments = BTreeMap::new();
        for (&bucket, &mark) in &checkpoint.segments {
            // Opening cuts anything past the mark; the handle is dropped again to keep few files open.
            SegmentWriter::open(&schedule_dir, bucket, width, mark)?;
            segments.insert(
                bucket,
                SegmentState {
                    written: mark,
                    synced: mark,
                    writer: None,
                    last_used: 0,
                },
            );
        }
        let dir = File::open(&schedule_dir).map_err(Error::io(&schedule_dir))?;
        let file_system = match crate::sys::file_system_sync_is_reliable(&dir) {
            // A write-back error from before this open (another program's, or one already reported
            // through a file's own fdatasync) would fail the first checkpoint's syncfs: one syncfs now,
            // before this open writes anything, takes it. Nothing below the checkpoint's marks can be
            // concerned: those were synced before the checkpoint was stored.
            // (Not in test builds, which open logs thousands of times on a file system the whole machine
            // shares.)
            true => {
                #[cfg(not(test))]
                let _ = crate::sys::sync_file_system(&dir);
                Some(Arc::new(dir))
            }
            false => None,
        };
        let schedules = Arc::new(Mutex::new(ScheduleTable::load(data_dir)?));
        Ok(Replay {
            data_dir: data_dir.to_path_buf(),
            schedule_dir,
            file_system,
            wal_dir: data_dir.join("wal"),
            wal_spares,
            checkpoint_path: data_dir.join("checkpoint"),
            width,
            segments,
            next_seq: checkpoint.next_seq,
            checkpointed_seq: checkpoint.next_seq,
            applied: checkpoint.applied.clone(),
            checkpointed_applied: checkpoint.applied.clone(),
            entry_log: None,
            jobs_taken: 0,
            jobs_stored: Arc::default(),
            use_counter: 0,
            open_writers: 0,
            max_open_writers: max_open_segments(),
            watched: Default::default(),
            tap: None,
            sync_failed: None,
            spread: 0,
            schedules,
            #[cfg(test)]
            faults: Default::default(),
        })
    }

    /// Applies committed records in seq order: one or more groups, each the bytes holding the frames and
    /// the records pointing into them, in seq order. Several groups at once cost one write per segment
    /// (and its index) for all of them, where a group each would cost one per group: a batch spread over
    /// a month touches hundreds of segments with a few records each.
    pub(crate) fn apply(
        &mut self,
        groups: &[(&[u8], &[WalRecord])],
        dispatch: &DispatchLogs,
    ) -> Result<()> {
        // Cancel outcomes (with their targets, for the tap) and pointers to later attempts.
        let mut cancels = Vec::new();
        let mut pointers = Vec::new();
        let mut messages = Vec::new();
        // Schedule ops and firings, applied to the table once the messages are filed.
        let mut marks = Vec::new();
        for (bytes, record) in unapplied(groups, self.next_seq) {
            match record {
                WalRecord::Message { head, frame } => {
                    let bucket = placement(head, self.width);
                    if let Some(mark) =
                        schedule_mark(&bytes[frame.start + frame::HEADER_LEN..frame.end])
                    {
                        marks.push((head, bucket, mark));
                        if matches!(mark, ScheduleMark::Op { .. }) {
                            continue;
                        }
                    }
                    if let Some((id, attempt)) = head.retry {
                        let kind = OutcomeKind::Retried {
                            next: Location {
                                bucket,
                                seq: head.seq,
                            },
                            reason: String::new(),
                        };
                        let pointer = Outcome {
                            seq: id.first.seq,
                            at_ms: head.created_at_ms,
                            attempt,
                            kind,
                        };
                        pointers.push((id.first.bucket, pointer));
                    }
                    messages.push((bucket, head, bytes, frame.clone()));
                }
                WalRecord::Cancel(cancel) => {
                    let outcome = Outcome {
                        seq: cancel.target.seq,
                        at_ms: cancel.created_at_ms,
                        attempt: 0,
                        kind: OutcomeKind::Cancelled,
                    };
                    cancels.push((cancel.target.bucket, outcome, cancel.target, cancel.seq));
                }
            }
        }
        self.spread = self.file(messages)?;
        if !marks.is_empty() {
            let mut table = self.schedules.lock().unwrap_or_else(|p| p.into_inner());
            for (head, bucket, mark) in marks {
                match mark {
                    ScheduleMark::Op { id, op, definition } => {
                        table.apply_op(head.seq, head.created_at_ms, id, op, definition)
                    }
                    ScheduleMark::Firing { id, fire_at } => {
                        let message = crate::MessageId::new(Location {
                            bucket,
                            seq: head.seq,
                        });
                        table.apply_firing(head.seq, id, fire_at, message)
                    }
                }
            }
        }
        // Checked only now: in recovery a cancel may come in the same call as its message, whose
        // bucket then exists only once the messages above are applied. (A first attempt's bucket that
        // is gone was retired: the message can no longer be looked up, and needs no pointer.)
        cancels.retain(|(bucket, ..)| self.segments.contains_key(bucket));
        pointers.retain(|(bucket, _)| self.segments.contains_key(bucket));
        if !cancels.is_empty() || !pointers.is_empty() {
            let mut outcomes: Vec<_> = cancels.iter().map(|(b, o, ..)| (*b, o.clone())).collect();
            outcomes.extend(pointers);
            dispatch.append(&outcomes)?;
            for &(bucket, _, target, seq) in &cancels {
                if self.watched.contains(&bucket) {
                    if let Some(tap) = &self.tap {
                        let _ = tap.send(Replayed::Cancelled { target, seq });
                    }
                }
            }
        }
        if let Some(last) = groups.iter().rev().find_map(|(_, records)| records.last()) {
            self.next_seq = self.next_seq.max(last.seq() + 1);
        }
        Ok(())
    }

    /// Files the messages of watched buckets among `groups` now, ahead of the others (which wait for
    /// [`Replay::apply`] of the same groups): a watched bucket is being delivered from, and its messages
    /// reach the wheel only once filed. `next_seq` does not move. Returns whether a group cancels a
    /// message of a watched bucket, which must not wait for the rest either.
    ///
    /// Called with the groups not yet applied, oldest first: all of them whenever the watched buckets
    /// changed since the last call, since a bucket that became watched must get its earlier records
    /// before its later ones (a record not above a segment's last seq counts as filed); otherwise only
    /// those that came since.
    pub(crate) fn apply_watched(&mut self, groups: &[(&[u8], &[WalRecord])]) -> Result<bool> {
        let mut urgent = false;
        let mut messages = Vec::new();
        for (bytes, record) in unapplied(groups, self.next_seq) {
            match record {
                WalRecord::Message { head, frame } => {
                    let bucket = placement(head, self.width);
                    let payload = &bytes[frame.start + frame::HEADER_LEN..frame.end];
                    let op = || matches!(schedule_mark(payload), Some(ScheduleMark::Op { .. }));
                    if self.watched.contains(&bucket) && !op() {
                        messages.push((bucket, head, bytes, frame.clone()));
                    }
                }
                WalRecord::Cancel(cancel) => {
                    urgent |= self.watched.contains(&cancel.target.bucket);
                }
            }
        }
        self.file(messages)?;
        Ok(urgent)
    }

    /// Writes messages (in seq order) to their segments, skipping those a segment has already, and
    /// reports those of watched buckets to the tap. Returns how many segments it wrote to.
    fn file(&mut self, mut messages: Vec<Filed<'_>>) -> Result<usize> {
        // One bucket at a time (a stable sort keeps seq order within each): a group spread over more
        // buckets than there are open writers would otherwise reopen a segment for nearly every record.
        messages.sort_by_key(|(bucket, ..)| *bucket);
        let mut written = 0;
        for run in messages.chunk_by(|a, b| a.0 == b.0) {
            let bucket = run[0].0;
            let tap = match self.watched.contains(&bucket) {
                true => self.tap.clone(),
                false => None,
            };
            let state = self.writer(bucket)?;
            let writer = state.writer.as_mut().expect("writer() opens it");
            let last_seq = writer.last_seq();
            let mut frames = Vec::with_capacity(run.len());
            // The frames' bytes, those next to each other in a group's bytes as one slice (a bucket's
            // frames mostly are when a group's messages fall due close together).
            let mut log: Vec<&[u8]> = Vec::new();
            let mut pending: Option<(&[u8], Range<usize>)> = None;
            // Those at or below it are in the segment already (recovery, an earlier try of this group,
            // or filed ahead as a watched bucket's).
            for (_, head, bytes, frame) in run.iter().filter(|(_, head, ..)| head.seq > last_seq) {
                frames.push((*head, frame.len()));
                match &mut pending {
                    Some((group, range))
                        if std::ptr::eq(*group, *bytes) && range.end == frame.start =>
                    {
                        range.end = frame.end;
                    }
                    _ => {
                        if let Some((group, range)) = pending.replace((bytes, frame.clone())) {
                            log.push(&group[range]);
                        }
                    }
                }
            }
            let Some((group, range)) = pending else {
                continue;
            };
            log.push(&group[range]);
            let (entries, mark) = writer.write_frames(&frames, &log)?;
            state.written = mark;
            written += 1;
            if let Some(tap) = &tap {
                for entry in entries {
                    let _ = tap.send(Replayed::Scheduled { bucket, entry });
                }
            }
        }
        Ok(written)
    }

    /// How many segments the last [`Replay::apply`] wrote to.
    pub(crate) fn spread(&self) -> usize {
        self.spread
    }

    /// The state of `bucket`'s segment with an open writer, creating the segment if needed.
    fn writer(&mut self, bucket: Bucket) -> Result<&mut SegmentState> {
        self.use_counter += 1;
        let needs_open = self
            .segments
            .get(&bucket)
            .is_none_or(|s| s.writer.is_none());
        if needs_open && self.open_writers >= self.max_open_writers {
            self.evict();
        }
        let (dir, width, now) = (self.schedule_dir.clone(), self.width, self.use_counter);
        match self.segments.get_mut(&bucket) {
            Some(state) => {
                if state.writer.is_none() {
                    state.writer = Some(SegmentWriter::open(&dir, bucket, width, state.written)?);
                    self.open_writers += 1;
                }
                state.last_used = now;
            }
            None => {
                #[cfg(test)]
                self.faults.disk_full_at(
                    crate::fault::Point::SegmentWrite,
                    &segment::log_path(&dir, bucket),
                )?;
                let writer = SegmentWriter::create(&dir, bucket, width)?;
                self.open_writers += 1;
                let mark = writer.mark();
                self.segments.insert(
                    bucket,
                    SegmentState {
                        written: mark,
                        synced: SegmentMark::default(),
                        writer: Some(writer),
                        last_used: now,
                    },
                );
            }
        }
        let state = self.segments.get_mut(&bucket).expect("present");
        #[cfg(test)]
        if let Some(writer) = state.writer.as_mut() {
            writer.faults = self.faults.clone();
        }
        Ok(state)
    }

    /// Closes the least recently used quarter of the open segments (at least one): one pass over them
    /// per quarter, not per segment closed.
    fn evict(&mut self) {
        let mut open: Vec<(u64, Bucket)> = self
            .segments
            .iter()
            .filter(|(_, s)| s.writer.is_some())
            .map(|(b, s)| (s.last_used, *b))
            .collect();
        let count = (open.len() / 4).max(1).min(open.len());
        if count < open.len() {
            open.select_nth_unstable(count);
        }
        for &(_, bucket) in &open[..count] {
            let state = self.segments.get_mut(&bucket).expect("present");
            // No sync here: the next checkpoint syncs every segment written since the last one, open
            // or not. (Syncing on eviction cost two fsyncs per bucket per batch when batches spread
            // over many buckets.) A writer holds nothing unwritten: `written` is where its files end.
            if state.writer.take().is_some() {
                self.open_writers -= 1;
            }
        }
    }

    /// Syncs every written segment, stores a checkpoint at `next_seq`, and retires the WAL files that
    /// are entirely below it: all at once, under the replayer's lock.
    pub(crate) fn checkpoint(&mut self) -> Result<()> {
        let job = self.start_checkpoint()?;
        let stored = job.run();
        self.finish_checkpoint(&job, stored)
    }

    /// Takes the next checkpoint job (see the module's invariants). Fails once a sync has failed.
    pub(crate) fn start_checkpoint(&mut self) -> Result<CheckpointJob> {
        if let Some(cause) = &self.sync_failed {
            return Err(Error::Append(AppendError::Poisoned(cause.clone())));
        }
        self.jobs_taken += 1;
        let sync = self
            .segments
            .iter()
            .filter(|(_, s)| s.synced != s.written)
            // A watched bucket is being delivered from: its pages are read back soon.
            .map(|(bucket, s)| (*bucket, s.written, !self.watched.contains(bucket)))
            .collect();
        Ok(CheckpointJob {
            number: self.jobs_taken,
            stored: self.jobs_stored.clone(),
            checkpoint: Checkpoint {
                next_seq: self.next_seq,
                segments: self.segments.iter().map(|(b, s)| (*b, s.written)).collect(),
                applied: self.applied.clone(),
            },
            sync,
            schedule_dir: self.schedule_dir.clone(),
            file_system: self.file_system.clone(),
            checkpoint_path: self.checkpoint_path.clone(),
            width: self.width,
            table_files: self
                .schedules
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .files(&self.data_dir),
            #[cfg(test)]
            faults: self.faults.clone(),
        })
    }

    /// Records what a job made durable (`Ok(true)`: it stored its checkpoint; `Ok(false)`: a newer one
    /// was stored first, and it did nothing) and retires the WAL files below the checkpoint. After a
    /// failed sync no checkpoint is ever stored again.
    pub(crate) fn finish_checkpoint(
        &mut self,
        job: &CheckpointJob,
        stored: Result<bool>,
    ) -> Result<()> {
        match stored {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => {
                if e.is_sync_failure() {
                    self.sync_failed.get_or_insert_with(|| e.to_string());
                }
                return Err(e);
            }
        }
        for (bucket, mark, _) in &job.sync {
            if let Some(state) = self.segments.get_mut(bucket) {
                if mark.log_len > state.synced.log_len {
                    state.synced = *mark;
                }
            }
        }
        self.checkpointed_seq = self.checkpointed_seq.max(job.checkpoint.next_seq);
        (self.schedules.lock().unwrap_or_else(|p| p.into_inner())).stored(&job.table_files);
        // Jobs are stored in order (an older one finds a newer stored and does nothing).
        if job.checkpoint.applied.is_some() {
            self.checkpointed_applied = job.checkpoint.applied.clone();
        }
        self.delete_replayed_wal()
    }

    /// The Raft entry `log_id` is applied (its records, if any, are): with `membership`, the member
    /// set it holds.
    pub(crate) fn entry_applied(&mut self, log_id: LogId, membership: Option<Vec<u8>>) {
        let before = self.applied.take();
        let purged = before.as_ref().and_then(|a| a.purged);
        let membership = match membership {
            Some(bytes) => Some((log_id, bytes)),
            None => before.and_then(|a| a.membership),
        };
        self.applied = Some(AppliedState {
            log_id,
            purged,
            membership,
        });
    }

    /// Whether a checkpoint now would store nothing new.
    pub(crate) fn checkpointed_all(&self) -> bool {
        self.checkpointed_seq == self.next_seq && self.checkpointed_applied == self.applied
    }

    /// Retires the WAL files entirely below the last checkpoint (each but the newest): keeps them for
    /// reuse, or deletes them (wal.rs).
    pub(crate) fn delete_replayed_wal(&mut self) -> Result<()> {
        let files = wal::list(&self.wal_dir)?;
        let mut deleted = false;
        for pair in files.windows(2) {
            let ((first_seq, path), (next_first, _)) = (&pair[0], &pair[1]);
            if *next_first > self.checkpointed_seq {
                continue;
            }
            if let Some(log) = &self.entry_log {
                // A replicated WAL file goes once every entry in it is applied and checkpointed (an
                // entry without records may follow the last record), the Raft layer let them go
                // (`ScheduleLog::purge_entries`), and a checkpoint has said that the log starts after
                // its last entry: recovery must know the last purged entry.
                let checkpointed = self.checkpointed_applied.as_ref();
                let applied = checkpointed.map(|a| a.log_id.index);
                let purged = checkpointed.and_then(|a| a.purged).map(|p| p.index);
                let entries = log.in_file(*first_seq);
                if entries
                    .iter()
                    .any(|e| applied.is_none_or(|a| e.log_id.index > a))
                {
                    continue;
                }
                let last = entries.last().map(|e| e.log_id);
                if last.is_some_and(|l| log.purgeable().is_none_or(|p| l.index > p)) {
                    continue; // the Raft layer may still send these entries to a member behind
                }
                if let Some(last) = last.filter(|l| purged.is_none_or(|p| l.index > p)) {
                    // Said first, by the next checkpoint; the file goes after it.
                    if let Some(applied) = &mut self.applied {
                        if applied.purged.is_none_or(|p| p.index < last.index) {
                            applied.purged = Some(last);
                        }
                    }
                    continue;
                }
                // Out of the log's map before the file goes: a read that located one of its entries
                // before this and finds the file gone sees it no longer placed (read_located).
                log.purge_file(*first_seq);
                wal::retire(&self.wal_dir, path, *first_seq, self.wal_spares)?;
            } else {
                wal::retire(&self.wal_dir, path, *first_seq, self.wal_spares)?;
            }
            deleted = true;
        }
        if deleted {
            sync_dir(&self.wal_dir)?;
        }
        Ok(())
    }

    /// Deletes one WAL spare, if there is one: for an idle node (nothing new to checkpoint for a
    /// checkpoint interval), so that the space spares take (up to `wal_spares` files) goes back a file
    /// at a time while no load needs it.
    pub(crate) fn shed_spare(&self) -> Result<()> {
        if wal::shed_spare(&self.wal_dir)? {
            sync_dir(&self.wal_dir)?;
        }
        Ok(())
    }

    /// The highest seq any segment holds (0 for none). A checkpoint taken while messages of a watched
    /// bucket were filed ahead of their group (`apply_watched`) holds segments with seqs at or above its
    /// `next_seq`: recovery must not hand those seqs out again should the WAL's tail be lost.
    pub(crate) fn highest_seq(&self) -> u64 {
        self.segments
            .values()
            .map(|s| s.written.last_seq)
            .max()
            .unwrap_or(0)
    }

    /// Published entry count of a bucket's segment, `None` if it has none.
    pub(crate) fn entries(&self, bucket: Bucket) -> Option<u64> {
        self.segments.get(&bucket).map(|s| s.written.entries)
    }

    /// Whether every record in `bucket`'s segment is below `next_seq`. Not so while a group is applied
    /// part-way: a segment may then hold some of its records, which would be filed again (into a new
    /// segment) if this one were removed now.
    pub(crate) fn fully_replayed(&self, bucket: Bucket) -> bool {
        self.segments
            .get(&bucket)
            .is_none_or(|s| s.written.last_seq < self.next_seq)
    }

    /// Every segment's written mark (what a checkpoint taken now would list, synced or not).
    pub(crate) fn written_marks(&self) -> BTreeMap<Bucket, SegmentMark> {
        self.segments.iter().map(|(b, s)| (*b, s.written)).collect()
    }

    /// All buckets that have a segment.
    pub(crate) fn buckets(&self) -> Vec<Bucket> {
        self.segments.keys().copied().collect()
    }

    /// Forgets a segment and deletes its files, after a checkpoint that no longer lists it.
    pub(crate) fn remove(&mut self, bucket: Bucket) -> Result<()> {
        if let Some(state) = self.segments.remove(&bucket) {
            if state.writer.is_some() {
                self.open_writers -= 1;
            }
            self.checkpoint()?;
            segment::remove(&self.schedule_dir, bucket)?;
            sync_dir(&self.schedule_dir)?;
        }
        Ok(())
    }

    pub(crate) fn schedule_dir(&self) -> &Path {
        &self.schedule_dir
    }
}
