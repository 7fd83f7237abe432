//! Replay: copies committed WAL records into the schedule segment of their bucket, and checkpoints.
//!
//! The replayer runs on its own thread, fed committed groups by the WAL writer (and, on open, the records
//! recovery found in the WAL). It is the only writer of schedule segments and the checkpoint.
//!
//! Invariants:
//! - Records are applied in seq order; `next_seq` is the first seq not yet applied, published only after
//!   the group's segment writes reached the files, so a reader that waits for `next_seq > seq` finds seq.
//! - A message goes to the bucket of `max(deliver_at, created_at)`: a message due in the past is filed
//!   under the bucket current at its commit, never under one that may already be retired.
//! - Replay is idempotent: a record whose seq is not above its segment's last seq is skipped, and a
//!   segment's last seq only counts records written to it (segment.rs). So a group whose application
//!   failed part-way (a full disk) can be applied again from its start: what reached a segment is kept,
//!   the rest is written, nothing twice. Cancels are outcomes, facts that may be recorded twice.
//! - A record is reported to the tap (a report is a delivery to the wheel) only after the write that put
//!   it in its segment succeeded, and a record is written once: so it is reported once, however many
//!   tries its group took.
//! - Every later attempt of a message (a retry, attempt > 0) is also filed as a pointer under the message's
//!   first attempt: a `retried` outcome in the first attempt's dispatch log, for the first attempt's seq,
//!   whose `attempt` is the new attempt's number (greater than 0, which is how it differs from the
//!   `retried` outcome the dispatcher records for attempt 0 itself) and whose `next` is where the new
//!   attempt lives. Like cancels, pointers are facts written after the record is durable in the WAL and
//!   may be written twice. They let a lookup find the newest attempt without the chain of `retried`
//!   outcomes, which the dispatcher records only after the retry is durable and may fail to record.
//! - A checkpoint is written only after every segment written since the last one is synced and every
//!   segment created since is in a synced directory. After a failed sync no checkpoint is ever written
//!   again (the sync may have dropped data a later sync would then claim durable): `checkpoint` fails
//!   with the first failure's cause until the log is reopened, and the WAL stays for recovery.

use crate::bucket::{Bucket, SegmentMinutes};
use crate::checkpoint::Checkpoint;
use crate::dispatch::DispatchLogs;
use crate::error::{AppendError, Error, Result};
use crate::header::sync_dir;
use crate::id::Location;
use crate::record::{MessageHead, Outcome, OutcomeKind};
use crate::segment::{self, IndexEntry, SegmentMark, SegmentWriter};
use crate::wal::{self, WalRecord};
use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Segment files kept open for append at most; the least recently used is synced and closed past this.
#[cfg(not(test))]
const MAX_OPEN_SEGMENTS: usize = 256;
/// Tests keep two open, so that eviction and the checkpoint's sync of closed segments run constantly.
#[cfg(test)]
const MAX_OPEN_SEGMENTS: usize = 2;

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

/// The replayer's state, shared behind a mutex with readers that need published entry counts.
#[derive(Debug)]
pub(crate) struct Replay {
    schedule_dir: PathBuf,
    wal_dir: PathBuf,
    checkpoint_path: PathBuf,
    width: SegmentMinutes,
    segments: BTreeMap<Bucket, SegmentState>,
    /// First seq not applied yet.
    pub next_seq: u64,
    /// next_seq of the last checkpoint written.
    pub checkpointed_seq: u64,
    created_since_checkpoint: bool,
    use_counter: u64,
    open_writers: usize,
    /// Buckets whose new records and cancels are reported to `tap`.
    pub watched: HashSet<Bucket>,
    pub tap: Option<crossbeam_channel::Sender<Replayed>>,
    /// Why a sync failed, once one has: from then on no checkpoint is written.
    sync_failed: Option<String>,
    #[cfg(test)]
    pub faults: std::sync::Arc<crate::fault::Faults>,
}

impl Replay {
    /// Opens the segments of a data dir in the state the checkpoint describes: listed segments cut back to
    /// their marks, unlisted ones deleted.
    pub(crate) fn open(
        data_dir: &Path,
        width: SegmentMinutes,
        checkpoint: &Checkpoint,
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
        Ok(Replay {
            schedule_dir,
            wal_dir: data_dir.join("wal"),
            checkpoint_path: data_dir.join("checkpoint"),
            width,
            segments,
            next_seq: checkpoint.next_seq,
            checkpointed_seq: checkpoint.next_seq,
            created_since_checkpoint: false,
            use_counter: 0,
            open_writers: 0,
            watched: Default::default(),
            tap: None,
            sync_failed: None,
            #[cfg(test)]
            faults: Default::default(),
        })
    }

    /// Applies committed records in seq order. `bytes` holds the frames the records point into.
    pub(crate) fn apply(
        &mut self,
        bytes: &[u8],
        records: &[WalRecord],
        dispatch: &DispatchLogs,
    ) -> Result<()> {
        // Cancel outcomes (with their targets, for the tap) and pointers to later attempts.
        let mut cancels = Vec::new();
        let mut pointers = Vec::new();
        let mut messages = Vec::new();
        for record in records {
            if record.seq() < self.next_seq {
                continue; // already applied (recovery overlaps the checkpoint)
            }
            match record {
                WalRecord::Message { head, frame } => {
                    let bucket = placement(head, self.width);
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
                    messages.push((bucket, head, frame));
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
        // One bucket at a time (a stable sort keeps seq order within each): a group spread over more
        // buckets than there are open writers would otherwise reopen a segment for nearly every record.
        messages.sort_by_key(|(bucket, _, _)| *bucket);
        for run in messages.chunk_by(|a, b| a.0 == b.0) {
            let bucket = run[0].0;
            let tap = match self.watched.contains(&bucket) {
                true => self.tap.clone(),
                false => None,
            };
            let state = self.writer(bucket)?;
            let writer = state.writer.as_mut().expect("writer() opens it");
            let mut entries = Vec::new();
            for (_, head, frame) in run {
                if head.seq <= writer.last_seq() {
                    continue; // in the segment already (recovery, or an earlier try of this group)
                }
                entries.push(writer.append(&bytes[(*frame).clone()], head));
            }
            state.written = writer.flush()?;
            if let Some(tap) = &tap {
                for entry in entries {
                    let _ = tap.send(Replayed::Scheduled { bucket, entry });
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
        if let Some(last) = records.last() {
            self.next_seq = self.next_seq.max(last.seq() + 1);
        }
        Ok(())
    }

    /// The state of `bucket`'s segment with an open writer, creating the segment if needed.
    fn writer(&mut self, bucket: Bucket) -> Result<&mut SegmentState> {
        self.use_counter += 1;
        let needs_open = self
            .segments
            .get(&bucket)
            .is_none_or(|s| s.writer.is_none());
        if needs_open && self.open_writers >= MAX_OPEN_SEGMENTS {
            self.evict_one()?;
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
                self.created_since_checkpoint = true;
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

    /// Writes out and closes the least recently used open segment.
    fn evict_one(&mut self) -> Result<()> {
        let victim = self
            .segments
            .iter()
            .filter(|(_, s)| s.writer.is_some())
            .min_by_key(|(_, s)| s.last_used)
            .map(|(b, _)| *b);
        if let Some(bucket) = victim {
            let state = self.segments.get_mut(&bucket).expect("present");
            if let Some(writer) = state.writer.as_mut() {
                // No sync here: the next checkpoint syncs every segment written since the last one,
                // open or not. (Syncing on eviction cost two fsyncs per bucket per batch when batches
                // spread over many buckets.) Closed only once written: a writer dropped with a failed
                // write would forget where its file really ends.
                state.written = writer.flush()?;
                state.writer = None;
                self.open_writers -= 1;
            }
        }
        Ok(())
    }

    /// Syncs every written segment, stores a checkpoint at `next_seq`, and deletes the WAL files that are
    /// entirely below it.
    pub(crate) fn checkpoint(&mut self) -> Result<()> {
        if let Some(cause) = &self.sync_failed {
            return Err(Error::Append(AppendError::Poisoned(cause.clone())));
        }
        let result = self.sync_and_store();
        if let Err(e) = &result {
            if e.is_sync_failure() {
                self.sync_failed = Some(e.to_string());
            }
        }
        result
    }

    fn sync_and_store(&mut self) -> Result<()> {
        for (bucket, state) in &mut self.segments {
            if state.synced != state.written {
                #[cfg(test)]
                self.faults.sync_fails_at(
                    crate::fault::Point::SegmentSync,
                    &segment::log_path(&self.schedule_dir, *bucket),
                )?;
                // A watched bucket is being delivered from: its pages are read back soon.
                let drop_cache = !self.watched.contains(bucket);
                state.synced = match state.writer.as_mut() {
                    Some(writer) => writer.sync(drop_cache)?,
                    None => {
                        segment::sync_closed(
                            &self.schedule_dir,
                            *bucket,
                            state.written.log_len,
                            drop_cache,
                        )?;
                        state.written
                    }
                };
            }
        }
        if self.created_since_checkpoint {
            sync_dir(&self.schedule_dir)?;
            self.created_since_checkpoint = false;
        }
        let checkpoint = Checkpoint {
            next_seq: self.next_seq,
            segments: self.segments.iter().map(|(b, s)| (*b, s.synced)).collect(),
        };
        #[cfg(test)]
        self.faults.disk_full_at(
            crate::fault::Point::CheckpointWrite,
            &self.checkpoint_path.with_extension("tmp"),
        )?;
        checkpoint.store(&self.checkpoint_path, self.width)?;
        self.checkpointed_seq = self.next_seq;
        self.delete_replayed_wal()
    }

    /// Deletes the WAL files entirely below the last checkpoint (each but the newest).
    pub(crate) fn delete_replayed_wal(&self) -> Result<()> {
        let files = wal::list(&self.wal_dir)?;
        let mut deleted = false;
        for pair in files.windows(2) {
            let ((_, path), (next_first, _)) = (&pair[0], &pair[1]);
            if *next_first <= self.checkpointed_seq {
                fs::remove_file(path).map_err(Error::io(path))?;
                deleted = true;
            }
        }
        if deleted {
            sync_dir(&self.wal_dir)?;
        }
        Ok(())
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
