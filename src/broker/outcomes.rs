//! Deliveries into the broker that await their dispatch outcome, and what makes them exactly once
//! across a crash (single node; a cluster's append op carries its outcomes in the same Raft entry,
//! mod.rs).
//!
//! A delivery's record is synced in the broker, then the lane records its outcome in the dispatch
//! log: a crash between the two would deliver the attempt again, and store it twice. Each record of
//! a delivery names its attempt (`attempt_at` and `attempt`, record.rs), so the broker itself can tell
//! which attempts it holds:
//!
//! ```text
//! {store}/settled   the floor: the commit-log offset below which every delivery's outcome is durable
//!                   (u64 LE); the dispatch-log marks taken before the log reached it: a count (u32 LE),
//!                   then for each dispatch log open then its bucket's start minute (u32 LE) and the
//!                   end of its synced outcomes (u64 LE), by bucket; then a CRC-32C (u32 LE) of all
//!                   that. Replaced atomically, at most once a second, when the floor moved. A file of
//!                   the floor alone (12 bytes, written before marks existed) is read as having none.
//! ```
//!
//! Invariants:
//! - An appended delivery is awaiting from its append (under the store's lock, with the log's new end)
//!   until the lane reports its outcome durable (`Sink::outcomes_recorded`); the floor is the oldest
//!   awaiting record's offset, else the end of what was appended. So the stored floor never passes a
//!   record whose outcome may be missing, and it moves independently of the unit checkpoint (which
//!   may be taken between an append and its outcome).
//! - Recovery reads the commit log from the stored floor (or the checkpoint, if earlier) and holds
//!   every delivery record from the floor on as awaiting: [`super::Broker::reconcile`], before any
//!   message is handed to a sink, records the outcome of each whose attempt has none (`delivered`, or
//!   `dead` with its reason for a dead letter) and lets them go. Until then the floor stays where it
//!   was, so a second crash finds them again.
//! - Lookups read only the dispatch logs' tails: a delivery at or past the floor was appended after
//!   the floor's marks were taken (they are taken, then the log's end read, once a second; the floor
//!   stored is paired with the newest marks whose end is not past it), and its outcome was recorded
//!   after its append, so it is at or past its bucket's mark. A bucket without a mark (its log was not
//!   open for append then) is read whole. So a start reads about a second of outcomes, not the hour's.
//! - An outcome recorded for an attempt that already has one is harmless: outcomes are a set
//!   (dispatch.rs). A bucket retired meanwhile is left alone (its attempts all had outcomes).
//! - What reconciling could not settle (a lookup or the write failed) stays held: the broker sink
//!   answers such a delivery stored when it comes due again, without storing it, and the lane records
//!   its outcome then. On a cluster member, a delivery whose append op failed or was answered in
//!   doubt is looked up in the dispatch logs when it comes again, and answered stored if its outcome
//!   (carried by the op's entry) is there.
//! - A record without `attempt_at` (a test's, or written before it existed) is never awaited: what
//!   such a version stored stays at least once.

use super::{BrokerError, Incoming, StoredMeta};
use crate::scheduler::{DEAD_REASON_HEADER, DEAD_TOPIC};
use schedulelog::{write_atomically, Bucket, Location, Outcome, OutcomeKind, ScheduleLog};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::Arc;

/// An attempt: where it is stored in the schedule log, and its number.
pub type Attempt = (Location, u16);

/// A delivery recovery found after the stored floor: its outcome may be missing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    pub offset: u64,
    /// The outcome it gets if its attempt has none.
    pub outcome: (Bucket, Outcome),
}

impl Held {
    /// The record's delivery as recovery read it; `None` for a record that names no attempt.
    pub fn of(offset: u64, meta: &StoredMeta) -> Option<Held> {
        let outcome = delivery_outcome(
            &meta.topic,
            &meta.headers,
            meta.attempt_location()?,
            meta.attempt,
            meta.delivered_at_ms,
        );
        Some(Held { offset, outcome })
    }

    pub fn attempt(&self) -> Attempt {
        attempt_of(&self.outcome)
    }
}

/// The attempt an outcome is for.
pub(crate) fn attempt_of((bucket, outcome): &(Bucket, Outcome)) -> Attempt {
    let at = Location {
        bucket: *bucket,
        seq: outcome.seq,
    };
    (at, outcome.attempt)
}

/// The outcome a stored delivery records: `delivered` when it was stamped, or `dead` with its reason
/// for a dead letter (`$dead`), as the lane records them.
fn delivery_outcome(
    topic: &str,
    headers: &BTreeMap<String, String>,
    at: Location,
    attempt: u16,
    delivered_at_ms: i64,
) -> (Bucket, Outcome) {
    let kind = match topic == DEAD_TOPIC {
        true => OutcomeKind::Dead {
            reason: (headers.get(DEAD_REASON_HEADER).cloned()).unwrap_or_default(),
        },
        false => OutcomeKind::Delivered,
    };
    let outcome = Outcome {
        seq: at.seq,
        at_ms: delivered_at_ms,
        attempt,
        kind,
    };
    (at.bucket, outcome)
}

/// The outcome of a delivery stored (one that names its attempt): what a cluster's append op
/// carries in its entry.
pub(crate) fn outcome_of(m: &Incoming) -> Option<(Bucket, Outcome)> {
    let at = m.attempt_at?;
    Some(delivery_outcome(
        &m.topic,
        &m.headers,
        at,
        m.attempt,
        m.delivered_at_ms,
    ))
}

/// Where each dispatch log open for append ended at some moment (`ScheduleLog::dispatch_marks`), by
/// bucket: its outcomes recorded after that moment are at or past its mark.
pub(crate) type Marks = Arc<[(Bucket, u64)]>;

/// Where recovery's lookups begin in `bucket`'s dispatch log: its mark, or the start without one.
fn mark_of(marks: &[(Bucket, u64)], bucket: Bucket) -> u64 {
    marks
        .binary_search_by_key(&bucket, |(b, _)| *b)
        .map_or(0, |i| marks[i].1)
}

/// What a `settled` file holds (module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settled {
    pub floor: u64,
    /// Marks taken before the commit log reached the floor.
    pub marks: Marks,
}

/// Marks kept per store while its floor stays (an outcome slow to come): beyond them, the oldest after
/// the first (the floor's) goes, which only makes a later lookup read more.
const MAX_MARKS: usize = 64;

/// A store's deliveries awaiting their outcome (module doc).
#[derive(Debug, Default)]
pub(crate) struct Awaiting {
    by_offset: BTreeMap<u64, Attempt>,
    by_attempt: HashMap<Attempt, u64>,
    /// The commit log's end after the last append (or recovery).
    end: u64,
    /// The floor in the `settled` file (0 without one).
    stored: u64,
    /// What recovery found and [`super::Broker::reconcile`] has not settled yet.
    pub held: HashMap<Attempt, Held>,
    /// Marks, each with the log's end when it was taken, oldest first: a delivery at or past that end
    /// was appended after the marks were taken. The first came with the stored floor.
    marks: VecDeque<(u64, Marks)>,
}

impl Awaiting {
    /// After recovery: the log's `end`, what the `settled` file holds, and the deliveries held.
    pub fn recovered(end: u64, settled: Option<Settled>, held: Vec<Held>) -> Awaiting {
        let Settled { floor, marks } = settled.unwrap_or(Settled {
            floor: 0,
            marks: Marks::default(),
        });
        let mut awaiting = Awaiting {
            end,
            stored: floor,
            marks: VecDeque::from([(floor, marks)]),
            ..Awaiting::default()
        };
        for h in held {
            awaiting.insert(h.offset, h.attempt());
            awaiting.held.insert(h.attempt(), h);
        }
        awaiting
    }

    pub fn insert(&mut self, offset: u64, attempt: Attempt) {
        self.by_offset.insert(offset, attempt);
        // An attempt stored twice (by a version before this one) awaits at its newer place.
        if let Some(before) = self.by_attempt.insert(attempt, offset) {
            if before != offset {
                self.by_offset.remove(&before);
            }
        }
    }

    /// Whether the attempt is stored here and awaits its outcome.
    pub fn holds(&self, attempt: &Attempt) -> bool {
        self.by_attempt.contains_key(attempt)
    }

    /// Appends ended the log at `end`.
    pub fn appended(&mut self, end: u64) {
        self.end = self.end.max(end);
    }

    /// The attempts' outcomes are durable.
    pub fn recorded(&mut self, attempts: impl IntoIterator<Item = Attempt>) {
        for attempt in attempts {
            self.held.remove(&attempt);
            if let Some(offset) = self.by_attempt.remove(&attempt) {
                self.by_offset.remove(&offset);
            }
        }
    }

    /// Below this offset every delivery's outcome is durable.
    pub fn floor(&self) -> u64 {
        self.by_offset
            .first_key_value()
            .map_or(self.end, |(offset, _)| *offset)
    }

    /// Marks taken just now, before the log's end is read here.
    pub fn marked(&mut self, marks: Marks) {
        if self.marks.back().is_some_and(|(end, _)| *end == self.end) {
            return; // nothing appended since the last ones: they serve
        }
        self.marks.push_back((self.end, marks));
        if self.marks.len() > MAX_MARKS {
            self.marks.remove(1); // the first serves the floor while it stays
        }
    }

    /// The newest marks that hold for every delivery at or past `offset`.
    pub fn marks_at(&self, offset: u64) -> Marks {
        (self.marks.iter().rev())
            .find(|(end, _)| *end <= offset)
            .map_or_else(Marks::default, |(_, marks)| marks.clone())
    }

    /// The floor and its marks, when the floor differs from the stored one.
    pub fn to_store(&self) -> Option<Settled> {
        let floor = self.floor();
        (floor != self.stored).then(|| Settled {
            floor,
            marks: self.marks_at(floor),
        })
    }

    /// The floor is stored: marks older than its own are no longer needed.
    pub fn stored(&mut self, floor: u64) {
        self.stored = floor;
        while self.marks.get(1).is_some_and(|(end, _)| *end <= floor) {
            self.marks.pop_front();
        }
    }
}

/// Of the `held` deliveries, the outcomes to record: those whose attempt has none in the dispatch
/// logs (read from `marks`, module doc), and every one settled so (recorded now, or found recorded
/// or retired). The deliveries of a bucket whose lookup fails stay held (the sink answers them stored
/// when they come again: [`super::Broker::stored_already`]).
pub(crate) fn to_reconcile(
    log: &ScheduleLog,
    marks: &[(Bucket, u64)],
    held: &[Held],
) -> (Vec<(Bucket, Outcome)>, Vec<Attempt>) {
    // Retired: a bucket is retired once finished, each of its attempts with an outcome (and a
    // lookup there finds none: the dispatch log went with it). One older than every bucket with a
    // segment was; a newer one without a segment may be one whose records are not filed yet (the
    // WAL's tail, held up by a full disk), so it is looked up. (Retirement skips unfinished buckets:
    // a newer one retired in the last second before a crash gets its held outcomes again, in a
    // dispatch log of its own that stays. Rare, and no delivery is repeated.)
    let retired = |bucket: Bucket| (log.buckets().first()).is_some_and(|oldest| bucket < *oldest);
    let mut by_bucket: BTreeMap<Bucket, Vec<&Held>> = BTreeMap::new();
    for held in held {
        by_bucket.entry(held.outcome.0).or_default().push(held);
    }
    let (mut missing, mut settled) = (Vec::new(), Vec::new());
    for (bucket, held) in by_bucket {
        let recorded: HashSet<(u64, u16)> = match retired(bucket) {
            true => HashSet::new(),
            false => match log.outcomes_since(bucket, mark_of(marks, bucket)) {
                Ok(outcomes) => outcomes.iter().map(|o| (o.seq, o.attempt)).collect(),
                Err(e) => {
                    tracing::warn!(error = %e, %bucket, held = held.len(), "looking up the outcomes of stored deliveries failed: they are answered as stored when they come due again");
                    continue;
                }
            },
        };
        // Asked again after the lookup: retired meanwhile, its log gone, nothing is recorded.
        let retired = recorded.is_empty() && retired(bucket);
        for held in held {
            let (at, attempt) = held.attempt();
            if !retired && !recorded.contains(&(at.seq, attempt)) {
                missing.push(held.outcome.clone());
            }
            settled.push((at, attempt));
        }
    }
    (missing, settled)
}

/// What a store's `settled` file holds, if it is whole.
pub(crate) fn read_settled(dir: &Path) -> Option<Settled> {
    let path = dir.join("settled");
    let bytes = std::fs::read(&path).ok()?;
    let settled = decode_settled(&bytes);
    if settled.is_none() {
        tracing::warn!(path = %path.display(), "a broker floor file is damaged: recovery starts from the checkpoint");
    }
    settled
}

/// A `settled` file's floor and marks, if the bytes are whole.
pub(crate) fn decode_settled(bytes: &[u8]) -> Option<Settled> {
    let (body, crc) = bytes.split_last_chunk::<4>()?;
    if *crc != crc32c::crc32c(body).to_le_bytes() {
        return None;
    }
    let (floor, rest) = body.split_first_chunk::<8>()?;
    let floor = u64::from_le_bytes(*floor);
    if rest.is_empty() {
        let marks = Marks::default(); // written before marks existed
        return Some(Settled { floor, marks });
    }
    let (count, rest) = rest.split_first_chunk::<4>()?;
    if rest.len()
        != usize::try_from(u32::from_le_bytes(*count))
            .ok()?
            .checked_mul(12)?
    {
        return None;
    }
    let marks = rest
        .chunks_exact(12)
        .map(|mark| {
            let (minute, end) = mark.split_at(4);
            let minute = u32::from_le_bytes(minute.try_into().expect("4 bytes"));
            let end = u64::from_le_bytes(end.try_into().expect("8 bytes"));
            (Bucket::from_start_minute(minute), end)
        })
        .collect();
    Some(Settled { floor, marks })
}

/// Stores the floor and its marks durably (replacing the file atomically).
pub(crate) fn write_settled(dir: &Path, settled: &Settled) -> Result<(), BrokerError> {
    let mut bytes = settled.floor.to_le_bytes().to_vec();
    let count = u32::try_from(settled.marks.len()).expect("a mark per open dispatch log");
    bytes.extend_from_slice(&count.to_le_bytes());
    for (bucket, end) in settled.marks.iter() {
        bytes.extend_from_slice(&bucket.start_minute().to_le_bytes());
        bytes.extend_from_slice(&end.to_le_bytes());
    }
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    Ok(write_atomically(&dir.join("settled"), &bytes)?)
}
