//! Reads of single records and their outcomes: by location for lookups, by segment offset for
//! delivery, and through a bucket's view for listings; with the waits for the replayer they rely on.
//!
//! Invariants: a read by location first waits for the replayer to file what was committed before it
//! (read-your-writes), at most 10 s and not at all while a full disk holds the replayer up; a record
//! still not filed then is reported as `NotFiledYet`, never as missing. Readers cached for
//! [`ScheduleLog::read_record`] are added, and removed for a retired bucket, under the replayer's lock
//! (lock order: `replay`, then `records`), so a cached bucket has its segment; a failed read drops its
//! reader.

use super::ScheduleLog;
use crate::bucket::Bucket;
use crate::dispatch::DispatchLogs;
use crate::error::{Blocked, Error, Result};
use crate::id::Location;
use crate::record::{Message, Outcome};
use crate::replay::Replay;
use crate::segment::{IndexEntry, RecordReader, SegmentReader};
use crate::view::{self, View};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

/// Segment logs kept open for [`ScheduleLog::read_record`], at most: the buckets being delivered from
/// (one or two at a time, more after a backlog), each one file descriptor.
const OPEN_RECORD_READERS: usize = 16;

impl ScheduleLog {
    /// Every record with a seq below this is filed: a message in its segment, a cancel in its bucket's
    /// dispatch log. So a [`ScheduleLog::watch`] begun after this passed a tombstone's seq leaves the
    /// cancelled message out of its snapshot. Cheap (an atomic load).
    pub fn filed_below(&self) -> u64 {
        self.shared.filed.load(Ordering::Acquire)
    }

    /// Every outcome recorded for a bucket, oldest first.
    pub fn outcomes(&self, bucket: Bucket) -> Result<Vec<Outcome>> {
        self.shared.dispatch.read(bucket)
    }

    /// The outcomes recorded for one record, oldest first: read through the bucket's outcome index
    /// (view.rs), so a lookup reads its own outcomes, not the whole dispatch log.
    /// `None` when the bucket was retired meanwhile.
    pub fn outcomes_of(&self, location: Location) -> Result<Option<Vec<Outcome>>> {
        self.with_view(location.bucket, false, |view, _| {
            view.outcomes_of(&self.shared.dispatch, location.bucket, location.seq)
        })
    }

    /// Where each dispatch log open for append ends now: every outcome recorded after this call is at
    /// or past its bucket's mark, so [`ScheduleLog::outcomes_since`] that mark finds it. Cheap (no
    /// I/O), though it waits for an append being synced.
    pub fn dispatch_marks(&self) -> Vec<(Bucket, u64)> {
        self.shared.dispatch.marks()
    }

    /// The outcomes recorded for a bucket at or past `mark` in its dispatch log (a mark that
    /// [`ScheduleLog::dispatch_marks`] gave, or 0 for all of them), oldest first: a lookup of recent
    /// outcomes that reads only the log's tail. Empty when the bucket has no dispatch log.
    pub fn outcomes_since(&self, bucket: Bucket, mark: u64) -> Result<Vec<Outcome>> {
        let (found, _) = self.shared.dispatch.read_from(bucket, mark)?;
        Ok(found.into_iter().map(|(_, outcome)| outcome).collect())
    }

    /// How many records a bucket has filed now (0 without a segment).
    pub(crate) fn filed_records(&self, bucket: Bucket) -> u64 {
        self.shared.replay().entries(bucket).unwrap_or(0)
    }

    /// Runs `f` on a bucket's view, its outcomes caught up, and its records in due order too when
    /// `due_order` (then with a reader over its segment; `f` gets `None` for a bucket without one).
    pub(crate) fn with_view<T>(
        &self,
        bucket: Bucket,
        due_order: bool,
        f: impl FnOnce(&View, Option<&SegmentReader>) -> Result<T>,
    ) -> Result<T> {
        let slot = self.shared.views.get(bucket);
        let mut view = view::lock(&slot);
        view.catch_up_outcomes(&self.shared.dispatch, bucket)?;
        let reader = if due_order {
            let reader = self.reader(bucket)?;
            if let Some(reader) = &reader {
                view.catch_up_entries(reader, bucket)?;
            }
            reader
        } else {
            None
        };
        self.shared.views.sized(bucket, &view);
        f(&view, reader.as_ref())
    }

    /// The dispatch logs, for listing.rs (their sizes, and outcomes at the offsets a view holds).
    pub(crate) fn dispatch(&self) -> &DispatchLogs {
        &self.shared.dispatch
    }

    /// Reads the message frame of `frame_len` bytes at `offset` in `bucket`'s segment: a record the
    /// replayer reported (a wheel entry's). `None` when the bucket has no segment (retired).
    ///
    /// The segment's log stays open for the next read (up to 16 buckets), so the replayer's lock is
    /// taken once per bucket, not once per read. A read that fails closes it: the next one opens the
    /// file afresh (a restored file is read then, not the old one).
    pub fn read_record(
        &self,
        bucket: Bucket,
        offset: u64,
        frame_len: u32,
    ) -> Result<Option<Message>> {
        let cached = self.shared.records().get(&bucket).cloned();
        let reader = match cached {
            Some(reader) => reader,
            None => {
                let replay = self.shared.replay();
                if replay.entries(bucket).is_none() {
                    return Ok(None);
                }
                let reader = Arc::new(RecordReader::open(replay.schedule_dir(), bucket)?);
                let mut records = self.shared.records();
                if records.len() >= OPEN_RECORD_READERS {
                    // Any one: due buckets change once an hour or so, so the one read now is seldom
                    // among the others.
                    if let Some(other) = records.keys().next().copied() {
                        records.remove(&other);
                    }
                }
                records.insert(bucket, reader.clone());
                reader
            }
        };
        let read = reader.read_at(offset, frame_len);
        if read.is_err() {
            let mut records = self.shared.records();
            if records
                .get(&bucket)
                .is_some_and(|r| Arc::ptr_eq(r, &reader))
            {
                records.remove(&bucket);
            }
        }
        read.map(Some)
    }

    /// A reader over the part of `bucket`'s segment that has been replayed so far; `None` without one.
    pub fn reader(&self, bucket: Bucket) -> Result<Option<SegmentReader>> {
        let replay = self.shared.replay();
        match replay.entries(bucket) {
            Some(entries) => SegmentReader::open(replay.schedule_dir(), bucket, entries).map(Some),
            None => Ok(None),
        }
    }

    /// Reads the record at `location`, waiting (briefly) for the replayer if the seq is committed but
    /// not yet replayed. `None` if there is no such record.
    pub fn read(&self, location: Location) -> Result<Option<Message>> {
        Ok(self.find(location)?.map(|(message, _)| message))
    }

    pub(super) fn find(&self, location: Location) -> Result<Option<(Message, IndexEntry)>> {
        if location.seq >= self.shared.committed.load(Ordering::Acquire) {
            return Ok(None); // never committed
        }
        if !self.wait_replayed(location.seq) {
            return Err(Error::NotFiledYet {
                cause: self.disk_full(),
            });
        }
        let Some(reader) = self.reader(location.bucket)? else {
            return Ok(None);
        };
        match reader.find(location.seq)? {
            Some(entry) => Ok(Some((reader.read(&entry)?, entry))),
            None => Ok(None),
        }
    }

    /// Waits until everything committed so far is replayed, so that a lookup sees every append and cancel
    /// acknowledged before it (read-your-writes); at most 10 s, and not at all while the replayer is
    /// held up by a full disk (it could be for hours). Returns whether `seq` is replayed (false if it was
    /// never committed).
    pub(crate) fn wait_replayed(&self, seq: u64) -> bool {
        let committed = self.shared.committed.load(Ordering::Acquire);
        if seq >= committed {
            return false;
        }
        let held_up = || self.shared.disk_full.held_up(Blocked::Replayer);
        let replay = self.wait_for_replayer(|r| r.next_seq >= committed, held_up);
        replay.next_seq > seq
    }

    /// Waits, at most 10 s, until `done` holds of the replayer's state or `give_up` says to stop
    /// looking; the state, locked, as it was last seen.
    pub(crate) fn wait_for_replayer(
        &self,
        done: impl Fn(&Replay) -> bool,
        give_up: impl Fn() -> bool,
    ) -> MutexGuard<'_, Replay> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut replay = self.shared.replay();
        while !done(&replay) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || give_up() {
                break;
            }
            // Woken by each replayed group; what `give_up` watches has no signal of its own, so look
            // again every 50 ms.
            replay = self
                .shared
                .replayed
                .wait_timeout(replay, left.min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        replay
    }

    /// Waits (at most 10 s, as a lookup) until everything committed so far is filed; `NotFiledYet`
    /// when it is not (the replayer is held up by a full disk, or behind): what a listing must see
    /// (a purge must not miss an acknowledged message).
    pub(crate) fn caught_up(&self) -> Result<()> {
        let committed = self.shared.committed.load(Ordering::Acquire);
        if committed == 0 || self.wait_replayed(committed - 1) {
            return Ok(());
        }
        Err(Error::NotFiledYet {
            cause: self.disk_full(),
        })
    }
}
