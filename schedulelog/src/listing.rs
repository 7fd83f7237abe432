//! Listing messages by due time, status and topic, and counting what is pending in each bucket.
//!
//! A listing walks the buckets in the range, oldest first, and in each its records in due order (ties in
//! seq order) through the bucket's view (view.rs): only the index entries and the records it looks at
//! are read. Each record is one attempt; an attempt a later one replaced (`retried`) is never listed,
//! so a message appears once, as its current attempt.
//! - Pending records are found in due order and checked against the outcome index: no record is read
//!   until its status matches.
//! - Finished ones (delivered, dead, cancelled, discarded) are found from the outcome index, then put in
//!   due order by their index entries: a listing of dead letters does not look at the pending records.
//!   Where a bucket has more of them than a page may look at, they are found by the walk in due order
//!   instead, like pending ones. Both give the same order, so a cursor works across either.
//!
//! A page ends after `limit` messages, or after `scan_limit` records were looked at (a topic filter
//! reads each record to see its topic); either way [`ListPage::next`] says where the next page starts.
//! So a page may hold fewer than `limit` messages and still have a next one.
//!
//! ```text
//! cursor text: 32 hex digits, bucket start minute (8), due ms from the bucket start (8), index position (16)
//! ```

use crate::bucket::Bucket;
use crate::error::Result;
use crate::id::Location;
use crate::log::{state_of, MessageState, ScheduleLog};
use crate::record::Message;
use crate::segment::SegmentReader;
use crate::view::{due_key, Effect, View};
use std::fmt;
use std::str::FromStr;

/// Which messages a listing wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusFilter {
    /// Waiting for their time (a first attempt or a retry).
    Pending,
    /// Waiting for their time, first attempt.
    Scheduled,
    /// Waiting for their time, a retry.
    Retrying,
    Delivered,
    Dead,
    Cancelled,
    Discarded,
    /// All of them.
    Any,
}

impl StatusFilter {
    /// The effect finished records must have (`None` for pending and any).
    fn finished(self) -> Option<Effect> {
        match self {
            StatusFilter::Delivered => Some(Effect::Delivered),
            StatusFilter::Dead => Some(Effect::Dead),
            StatusFilter::Cancelled => Some(Effect::Cancelled),
            StatusFilter::Discarded => Some(Effect::Discarded),
            StatusFilter::Pending
            | StatusFilter::Scheduled
            | StatusFilter::Retrying
            | StatusFilter::Any => None,
        }
    }

    /// Whether only pending messages are wanted (some or all of them).
    fn pending(self) -> bool {
        matches!(
            self,
            StatusFilter::Pending | StatusFilter::Scheduled | StatusFilter::Retrying
        )
    }
}

/// Where a listing goes on from: just after this record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListCursor {
    bucket: Bucket,
    due_ms: u32,
    position: u64,
}

impl fmt::Display for ListCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:08x}{:08x}{:016x}",
            self.bucket.start_minute(),
            self.due_ms,
            self.position
        )
    }
}

/// The text is not a cursor a listing gave.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a listing cursor: expected the 32 hex digits of a next_cursor")]
pub struct InvalidCursor;

impl FromStr for ListCursor {
    type Err = InvalidCursor;

    fn from_str(text: &str) -> Result<ListCursor, InvalidCursor> {
        let hex = |range: std::ops::Range<usize>| {
            text.get(range)
                .filter(|t| t.bytes().all(|b| b.is_ascii_hexdigit()))
                .and_then(|t| u64::from_str_radix(t, 16).ok())
                .ok_or(InvalidCursor)
        };
        if text.len() != 32 {
            return Err(InvalidCursor);
        }
        Ok(ListCursor {
            bucket: Bucket::from_start_minute(
                u32::try_from(hex(0..8)?).map_err(|_| InvalidCursor)?,
            ),
            due_ms: u32::try_from(hex(8..16)?).map_err(|_| InvalidCursor)?,
            // Positions are below 2^32 (view.rs): a larger one is not a cursor a listing gave.
            position: u64::from(u32::try_from(hex(16..32)?).map_err(|_| InvalidCursor)?),
        })
    }
}

/// What to list.
#[derive(Debug, Clone)]
pub struct ListQuery {
    /// Due at or after this (unix ms).
    pub from_ms: i64,
    /// Due before this (unix ms).
    pub to_ms: i64,
    pub status: StatusFilter,
    pub topic: Option<String>,
    /// At most this many messages.
    pub limit: usize,
    /// At most this many records looked at.
    pub scan_limit: usize,
    /// Go on after this record (a previous page's [`ListPage::next`]).
    pub after: Option<ListCursor>,
}

/// One message of a listing: its current attempt.
#[derive(Debug, Clone)]
pub struct Listed {
    pub location: Location,
    pub message: Message,
    pub state: MessageState,
}

/// A page of a listing.
#[derive(Debug, Clone, Default)]
pub struct ListPage {
    pub messages: Vec<Listed>,
    /// Where the next page starts; `None` when the range holds no more.
    pub next: Option<ListCursor>,
}

/// A bucket's records, and how many of them are pending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketCount {
    pub bucket: Bucket,
    pub total: u64,
    pub pending: u64,
}

/// A listing in progress.
struct Walk<'q> {
    log: &'q ScheduleLog,
    query: &'q ListQuery,
    page: ListPage,
    scanned: usize,
    /// The walk passed the end of the range.
    done: bool,
}

impl Walk<'_> {
    /// Looks at one record (`position` in `bucket`'s index, due `due` ms after the bucket start);
    /// `false` once the page is done.
    fn visit(
        &mut self,
        bucket: Bucket,
        view: &View,
        reader: &SegmentReader,
        (due, position): (u32, u64),
    ) -> Result<bool> {
        if bucket.start_ms() + i64::from(due) >= self.query.to_ms {
            self.done = true;
            return Ok(false);
        }
        let here = ListCursor {
            bucket,
            due_ms: due,
            position,
        };
        if self.scanned >= self.query.scan_limit {
            return Ok(false); // `next` is the last record looked at
        }
        self.scanned += 1;
        self.page.next = Some(here);
        let Some(entry) = reader.entries(position, 1)?.pop() else {
            return Ok(true);
        };
        // A record stored after its time is due at its bucket's start in the order, but listed by
        // its own time.
        if entry.deliver_at_ms < self.query.from_ms {
            return Ok(true);
        }
        let wanted = match (self.query.status, view.effect(entry.seq)) {
            (_, Some(Effect::Retried)) => false,
            (status, effect) if status.pending() => effect.is_none(),
            (StatusFilter::Any, _) => true,
            (status, effect) => effect.is_some() && effect == status.finished(),
        };
        if !wanted {
            return Ok(true);
        }
        let message = reader.read(&entry)?;
        let attempt_wanted = match self.query.status {
            StatusFilter::Scheduled => message.attempt == 0,
            StatusFilter::Retrying => message.attempt > 0,
            _ => true,
        };
        if !attempt_wanted
            || self
                .query
                .topic
                .as_ref()
                .is_some_and(|t| *t != message.topic)
        {
            return Ok(true);
        }
        let location = Location {
            bucket,
            seq: entry.seq,
        };
        let Some(outcomes) = view.outcomes_of(self.log.dispatch(), bucket, entry.seq)? else {
            return Ok(true); // retired meanwhile
        };
        self.page.messages.push(Listed {
            location,
            message,
            state: state_of(&outcomes),
        });
        Ok(self.page.messages.len() < self.query.limit)
    }
}

impl ScheduleLog {
    /// Lists messages due in `[from_ms, to_ms)` by status and topic, oldest due first, a page at a
    /// time (see the module doc). Sees every append and cancel acknowledged before the call.
    pub fn list(&self, query: &ListQuery) -> Result<ListPage> {
        self.caught_up()?;
        let width = self.segment_minutes();
        let mut walk = Walk {
            log: self,
            query,
            page: ListPage::default(),
            scanned: 0,
            done: false,
        };
        let mut more = query.limit > 0;
        for bucket in self.buckets() {
            if !more || bucket.start_ms() >= query.to_ms {
                break;
            }
            if bucket.end_ms(width) <= query.from_ms
                || query.after.is_some_and(|c| bucket < c.bucket)
            {
                continue;
            }
            let after = query
                .after
                .filter(|c| c.bucket == bucket)
                .map(|c| (c.due_ms, c.position));
            let from = u32::try_from(query.from_ms.saturating_sub(bucket.start_ms())).unwrap_or(0);
            // A bucket without a dispatch log has no finished records; one whose records are all
            // finished has no pending ones: neither is read (nor kept in a view) for those.
            let has_outcomes = self.dispatch().size(bucket)? > 0;
            if query.status.finished().is_some() && !has_outcomes {
                continue;
            }
            // (The count of records is taken after the outcomes are read: every record with an
            // outcome is filed by then, so the count is never short of them.)
            if query.status.pending()
                && has_outcomes
                && self.with_view(bucket, false, |view, _| {
                    Ok(view.finished() >= self.filed_records(bucket))
                })?
            {
                continue;
            }
            // Finished records are found from the outcome index when there are few of them (`few`),
            // and by the walk in due order otherwise (their index entries would all be searched for
            // first).
            let few = match query.status.finished() {
                Some(effect) => {
                    let seqs =
                        self.with_view(bucket, false, |view, _| Ok(view.seqs_with(effect)))?;
                    Some(seqs).filter(|seqs| seqs.len() <= query.scan_limit)
                }
                None => None,
            };
            more = self.with_view(bucket, few.is_none(), |view, reader| {
                let opened;
                let reader = match reader {
                    Some(reader) => reader,
                    None => {
                        opened = self.reader(bucket)?;
                        match &opened {
                            Some(reader) => reader,
                            None => return Ok(true),
                        }
                    }
                };
                match &few {
                    None => {
                        for item in view.due_from(from, after) {
                            if !walk.visit(bucket, view, reader, item)? {
                                return Ok(false);
                            }
                        }
                    }
                    Some(seqs) => {
                        let mut found = Vec::new();
                        for &seq in seqs {
                            if let Some((position, entry)) = reader.position(seq)? {
                                found.push((due_key(entry.deliver_at_ms, bucket), position));
                            }
                        }
                        found.sort_unstable();
                        for item in found.into_iter().filter(|&item| {
                            item.0 >= from && after.is_none_or(|after| item > after)
                        }) {
                            if !walk.visit(bucket, view, reader, item)? {
                                return Ok(false);
                            }
                        }
                    }
                }
                Ok(true)
            })?;
        }
        if more || walk.done {
            walk.page.next = None; // the range is done
        }
        Ok(walk.page)
    }

    /// Every bucket that has records in `[from_ms, to_ms)`, oldest first, with how many it holds and
    /// how many are pending: from the indexes' entry counts and the dispatch logs, no record is read.
    pub fn timeline(&self, from_ms: i64, to_ms: i64) -> Result<Vec<BucketCount>> {
        self.caught_up()?;
        let width = self.segment_minutes();
        let mut counts = Vec::new();
        for (bucket, total) in self.entry_counts() {
            if bucket.end_ms(width) <= from_ms || bucket.start_ms() >= to_ms {
                continue;
            }
            // Most future buckets have no dispatch log: nothing to read, no view to keep. (With one,
            // the count of records is taken after its outcomes are read, as in `list`.)
            let (total, finished) = if self.dispatch().size(bucket)? == 0 {
                (total, 0)
            } else {
                self.with_view(bucket, false, |view, _| {
                    Ok((self.filed_records(bucket), view.finished()))
                })?
            };
            counts.push(BucketCount {
                bucket,
                total,
                pending: total.saturating_sub(finished),
            });
        }
        Ok(counts)
    }
}
