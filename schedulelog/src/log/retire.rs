//! Retention: [`ScheduleLog::retire`] deletes the files of buckets that are finished and past their
//! retention.
//!
//! Invariants: a bucket is retired only once it ended more than `retention` ago and every record in it
//! has an outcome; nothing may be arriving in it: under the replayer's lock, just before its segment
//! goes (with its open record reader), it still has the records that were checked and no group is
//! applied part-way. A message retried from it keeps it while the message's current attempt is kept,
//! so an id always leads to that attempt. A failed sync while removing poisons the log.

use super::ScheduleLog;
use crate::bucket::Bucket;
use crate::error::Result;
use crate::header;
use crate::id::Location;
use crate::record::OutcomeKind;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

impl ScheduleLog {
    /// Deletes the files of every bucket that ended more than `retention` ago and whose records are all
    /// finished, and whose messages retried into later attempts have those finished and past their
    /// retention too (so that an id leads to its current attempt as long as that is kept). Returns the
    /// buckets retired.
    pub fn retire(&self) -> Result<Vec<Bucket>> {
        // What was acknowledged before this pass is filed first: a record not filed yet is not in its
        // segment, and its bucket could look finished without it (the replayer may be waiting up to
        // `LINGER` for more groups). Within `wait_replayed`'s limits: 10 s, and not while a full disk
        // holds the replayer up, for retiring is then how space comes back.
        let committed = self.shared.committed.load(Ordering::Acquire);
        if committed > 0 {
            self.wait_replayed(committed - 1);
        }
        let now = self.shared.clock.now_ms();
        let retention_ms = i64::try_from(self.shared.retention.as_millis()).unwrap_or(i64::MAX);
        let mut retired = Vec::new();
        for bucket in self.buckets() {
            if bucket
                .end_ms(self.shared.width)
                .saturating_add(retention_ms)
                > now
            {
                break; // buckets are sorted: the rest are younger
            }
            let Some(reader) = self.reader(bucket)? else {
                continue;
            };
            let outcomes = self.outcomes(bucket)?;
            let finished: HashSet<u64> = outcomes.iter().map(|o| o.seq).collect();
            let entries = reader.entries(0, reader.len())?;
            if entries.iter().any(|e| !finished.contains(&e.seq)) {
                continue;
            }
            // A message retried (or requeued) from here is found by its id through this bucket: kept
            // while its current attempt is kept (an error reading where that is keeps it too).
            let mut newest: HashMap<u64, (u16, Location)> = HashMap::new();
            for outcome in &outcomes {
                if let OutcomeKind::Retried { next, .. } = outcome.kind {
                    let slot = newest.entry(outcome.seq).or_insert((outcome.attempt, next));
                    if outcome.attempt > slot.0 {
                        *slot = (outcome.attempt, next);
                    }
                }
            }
            if newest
                .values()
                .any(|&(_, next)| self.current_attempt_kept(next, now).unwrap_or(true))
            {
                continue;
            }
            let mut replay = self.shared.replay();
            if replay.entries(bucket) != Some(reader.len()) || !replay.fully_replayed(bucket) {
                continue; // a record arrived meanwhile, or is being filed
            }
            let removed = replay.remove(bucket);
            self.shared.records().remove(&bucket);
            drop(replay);
            self.shared.poison_on_sync_failure(&removed);
            removed?;
            self.shared.dispatch.remove(bucket)?;
            self.shared.views.forget(bucket);
            let synced = header::sync_dir(&self.shared.data_dir.join("dispatch"));
            self.shared.poison_on_sync_failure(&synced);
            synced?;
            retired.push(bucket);
        }
        Ok(retired)
    }

    /// Whether the current attempt of a message, found from one of its later attempts `at` by its
    /// `retried` outcomes, is kept: written but not filed yet, pending, or finished in a bucket still
    /// within its retention (its status is answered that long). A chain of one message's attempts is
    /// followed, never another message's, so one slow message keeps only its own buckets.
    fn current_attempt_kept(&self, mut at: Location, now: i64) -> Result<bool> {
        let retention_ms = i64::try_from(self.shared.retention.as_millis()).unwrap_or(i64::MAX);
        // Each hop moves to a later attempt; attempts are u16, so this bounds a corrupt cycle.
        for _ in 0..=u16::MAX {
            if at.seq >= self.filed_below() {
                return Ok(true);
            }
            // (Every filed record's bucket has a segment until it is retired.)
            let retired = self.shared.replay().entries(at.bucket).is_none();
            let outcomes = if retired { None } else { self.outcomes_of(at)? };
            let Some(outcomes) = outcomes else {
                return Ok(false); // its bucket is retired
            };
            let retried = outcomes.iter().find_map(|o| match o.kind {
                OutcomeKind::Retried { next, .. } => Some(next),
                _ => None,
            });
            match retried {
                Some(next) if next != at => at = next,
                _ if outcomes.is_empty() => return Ok(true), // pending
                _ => {
                    let end = at.bucket.end_ms(self.shared.width);
                    return Ok(end.saturating_add(retention_ms) > now);
                }
            }
        }
        Ok(true)
    }
}
