//! Reads over whole buckets: the bucket list, the loader's watch of a bucket (a snapshot of its
//! unfinished records, then reports of what is filed into it), and the scans a starting service rebuilds
//! its indexes and positions from.
//!
//! Invariants: a watch neither misses nor repeats a record between its snapshot and the reports (what
//! was filed after the bulk read is read under the replayer's lock that also starts the reports); the
//! scans see every record acknowledged before them, or fail with `NotFiledYet`; a corrupt record is
//! handed to the caller as its error and the scan goes on (an I/O error ends it).

use super::ScheduleLog;
use crate::bucket::Bucket;
use crate::error::{Blocked, Error, Result};
use crate::record::MessageMeta;
use crate::replay::Replayed;
use crate::segment::{IndexEntry, SegmentReader};
use crossbeam_channel::Sender;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A bucket's records as the loader sees them.
#[derive(Debug)]
pub struct BucketSnapshot {
    pub bucket: Bucket,
    /// Index entries of records not yet finished, in seq order.
    pub pending: Vec<IndexEntry>,
    /// How many records the bucket has in all.
    pub total: u64,
}

impl ScheduleLog {
    /// All buckets that have a schedule segment, oldest first.
    pub fn buckets(&self) -> Vec<Bucket> {
        self.shared.replay().buckets()
    }

    /// Every bucket with its number of records (finished or not), oldest first. Cheap: no I/O.
    pub fn entry_counts(&self) -> Vec<(Bucket, u64)> {
        let replay = self.shared.replay();
        replay
            .buckets()
            .into_iter()
            .map(|b| (b, replay.entries(b).unwrap_or(0)))
            .collect()
    }

    /// Reads a bucket's unfinished records and starts reporting every later record and cancel filed into
    /// it to the channel given to [`ScheduleLog::set_tap`]. Nothing is lost or reported twice between
    /// the snapshot and the reports: the bulk is read first, then, under the replayer's lock, what was
    /// filed meanwhile, and the bucket is watched. A failure leaves the bucket unwatched (nothing was
    /// reported), so that a later call neither misses nor repeats a record.
    pub fn watch(&self, bucket: Bucket) -> Result<BucketSnapshot> {
        // The snapshot then holds at least everything acknowledged before this call; in a replicated
        // log, also the outcomes of every entry applied before it (a member elected leader loads its
        // wheel right after it applied what the last leader committed: the outcomes of what that one
        // delivered must keep those messages out of the wheel).
        self.wait_replayed(0);
        if !self.wait_applied() {
            // A replayer that lags (catching up, a slow disk): a snapshot now could hold finished
            // messages. The caller tries again.
            return Err(Error::NotFiledYet { cause: None });
        }
        // The bulk, outside the lock: the replayer goes on filing meanwhile.
        let (mut pending, read) = match self.reader(bucket)? {
            Some(reader) => (reader.entries(0, reader.len())?, reader.len()),
            None => (Vec::new(), 0),
        };
        let (mut outcomes, outcomes_read) = self.shared.dispatch.read_sized(bucket)?;
        let total = {
            let mut replay = self.shared.replay();
            let total = replay.entries(bucket).unwrap_or(0);
            if total > read {
                let reader = SegmentReader::open(replay.schedule_dir(), bucket, total)?;
                pending.extend(reader.entries(read, total - read)?);
            }
            // Outcomes recorded meanwhile: above all tombstones, which the replayer files under this
            // lock and reports only once the bucket is watched.
            if self.shared.dispatch.size(bucket)? != outcomes_read {
                outcomes = self.shared.dispatch.read(bucket)?;
            }
            replay.watched.insert(bucket);
            total
        };
        let finished: HashSet<u64> = outcomes.iter().map(|o| o.seq).collect();
        pending.retain(|e| !finished.contains(&e.seq));
        Ok(BucketSnapshot {
            bucket,
            pending,
            total,
        })
    }

    /// Hands `f` every unfinished message that carries an idempotency key, without its body: what an
    /// idempotency index is rebuilt from at a start. Reads each bucket's index and outcomes, and only
    /// the start of the flagged records ([`SegmentReader::read_meta`]), one at a time.
    ///
    /// Waits until everything committed is filed; `NotFiledYet` while the replayer is held up by a full
    /// disk (the caller tries again later: a record not filed yet would be missed). A record whose start
    /// is corrupt is handed over as its [`Error::Corrupt`] (naming the file and offset), and the rest are
    /// read all the same: it can be neither delivered nor known, and must not hide the others.
    pub fn pending_keyed(&self, mut f: impl FnMut(Result<MessageMeta>)) -> Result<()> {
        self.replayed_all()?;
        for bucket in self.buckets() {
            let Some(reader) = self.reader(bucket)? else {
                continue;
            };
            let mut flagged = Vec::new();
            reader.scan(0, reader.len(), |_, entry| {
                if entry.dedup {
                    flagged.push(*entry);
                }
            })?;
            if flagged.is_empty() {
                continue;
            }
            let finished: HashSet<u64> = self.outcomes(bucket)?.iter().map(|o| o.seq).collect();
            for entry in flagged.iter().filter(|e| !finished.contains(&e.seq)) {
                f(corrupt_apart(reader.read_meta(entry))?);
            }
        }
        Ok(())
    }

    /// Hands `f` every kept record of the sink `sink` with a seq of `seq` or more (messages and
    /// retries alike), without its body, bucket by bucket: what an MQ source rebuilds the positions of
    /// the requests it wrote since it last saved its state from. Each bucket's index is searched for
    /// its first entry at `seq` or above (entries are in seq order); from there, only the records whose
    /// index entry has the sink's tag are read, and only their start.
    ///
    /// Waits until everything committed is filed; `NotFiledYet` while the replayer is held up by a full
    /// disk. A corrupt record is handed over as its error, as by [`ScheduleLog::pending_keyed`].
    pub fn records_since(
        &self,
        seq: u64,
        sink: &str,
        mut f: impl FnMut(Result<MessageMeta>),
    ) -> Result<()> {
        self.replayed_all()?;
        let tag = crate::record::sink_tag(sink);
        for bucket in self.buckets() {
            let Some(reader) = self.reader(bucket)? else {
                continue;
            };
            let (mut lo, mut hi) = (0u64, reader.len());
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                match reader.entries(mid, 1)?.first() {
                    Some(entry) if entry.seq < seq => lo = mid + 1,
                    _ => hi = mid,
                }
            }
            let mut tagged = Vec::new();
            reader.scan(lo, reader.len() - lo, |_, entry| {
                if entry.sink_tag == tag {
                    tagged.push(*entry);
                }
            })?;
            for entry in &tagged {
                match corrupt_apart(reader.read_meta(entry))? {
                    // Two sink names may share a tag.
                    Ok(meta) if meta.sink != sink => {}
                    read => f(read),
                }
            }
        }
        Ok(())
    }

    /// The seq the next appended record will have, at least.
    pub fn next_seq(&self) -> Result<u64> {
        self.replayed_all()?;
        Ok(self.filed_below())
    }

    /// Waits, however long it takes, until everything committed so far is filed; fails at once while
    /// the replayer is held up by a full disk (`NotFiledYet`). What must not miss a record (an MQ
    /// source rebuilding what it wrote) waits here, not in [`Self::wait_replayed`], which gives up.
    fn replayed_all(&self) -> Result<()> {
        let committed = self.shared.committed.load(Ordering::Acquire);
        let mut replay = self.shared.replay();
        while replay.next_seq < committed {
            if self.shared.disk_full.held_up(Blocked::Replayer) {
                return Err(Error::NotFiledYet {
                    cause: self.shared.disk_full.cause(),
                });
            }
            // A replayer stopped by an error files nothing more.
            if let Some(cause) = self.poisoned() {
                return Err(Error::NotFiledYet { cause: Some(cause) });
            }
            replay = self
                .shared
                .replayed
                .wait_timeout(replay, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    /// Stops reporting a bucket.
    pub fn unwatch(&self, bucket: Bucket) {
        self.shared.replay().watched.remove(&bucket);
    }

    /// Where reports about watched buckets go. A new tap starts with no bucket watched: the scheduler
    /// it belongs to watches what it needs, and takes each bucket's snapshot as it does (a scheduler
    /// started again on the same log, as a cluster member's is on each promotion, would otherwise get
    /// the records filed between this call and its snapshots twice).
    pub fn set_tap(&self, tap: Sender<Replayed>) {
        let mut replay = self.shared.replay();
        replay.watched.clear();
        replay.tap = Some(tap);
    }
}

/// A record's read with a corrupt record set apart: `Ok(Err(corrupt))` for the caller to report and
/// pass over, `Err` for an error that ends the whole read (I/O).
fn corrupt_apart<T>(read: Result<T>) -> Result<Result<T>> {
    match read {
        Err(e @ Error::Corrupt { .. }) => Ok(Err(e)),
        Err(e) => Err(e),
        Ok(value) => Ok(Ok(value)),
    }
}
