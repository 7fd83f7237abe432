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
//! {store}/settled   commit-log offset below which every delivery's outcome is durable (u64 LE), then
//!                   a CRC-32C (u32 LE) of it; replaced atomically, at most once a second, when it moved
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
//!   was, so a second crash finds them again. Lookups are by location in the bucket's outcome index:
//!   bounded work (the deliveries of about the last second, or of an outage of the dispatch log).
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
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

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
}

impl Awaiting {
    /// After recovery: the log's `end`, the floor the `settled` file holds, and the deliveries held.
    pub fn recovered(end: u64, stored: u64, held: Vec<Held>) -> Awaiting {
        let mut awaiting = Awaiting {
            end,
            stored,
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

    /// The floor, when it differs from the stored one.
    pub fn floor_to_store(&self) -> Option<u64> {
        let floor = self.floor();
        (floor != self.stored).then_some(floor)
    }

    pub fn stored(&mut self, floor: u64) {
        self.stored = floor;
    }
}

/// Of the `held` deliveries, the outcomes to record: those whose attempt has none in the dispatch
/// logs, and every one settled so (recorded now, or found recorded or retired). A delivery whose
/// lookup fails stays held (the sink answers it stored when it comes again: [`super::Broker::stored_already`]).
pub(crate) fn to_reconcile(
    log: &ScheduleLog,
    oldest: Option<Bucket>,
    held: &[Held],
) -> (Vec<(Bucket, Outcome)>, Vec<Attempt>) {
    let (mut missing, mut settled) = (Vec::new(), Vec::new());
    for held in held {
        let (at, attempt) = held.attempt();
        // Retired: a bucket is retired once finished, each of its attempts with an outcome (and a
        // lookup there finds none: the dispatch log went with it). Retirement takes the oldest
        // buckets: a newer one without a segment may be one whose records are not filed yet (the
        // WAL's tail, held up by a full disk).
        if oldest.is_some_and(|oldest| at.bucket < oldest) {
            settled.push((at, attempt));
            continue;
        }
        match log.outcomes_of(at) {
            Ok(Some(outcomes)) if outcomes.iter().any(|o| o.attempt == attempt) => {}
            Ok(None) => {} // retired meanwhile
            Ok(Some(_)) => missing.push(held.outcome.clone()),
            Err(e) => {
                tracing::warn!(error = %e, location = ?at, "looking up a stored delivery's outcome failed: it is answered as stored when it comes due again");
                continue;
            }
        }
        settled.push((at, attempt));
    }
    (missing, settled)
}

/// The floor a store's `settled` file holds, if it is whole.
pub(crate) fn read_floor(dir: &Path) -> Option<u64> {
    let path = dir.join("settled");
    let bytes = std::fs::read(&path).ok()?;
    let floor = decode_floor(&bytes);
    if floor.is_none() {
        tracing::warn!(path = %path.display(), "a broker floor file is damaged: recovery starts from the checkpoint");
    }
    floor
}

/// A `settled` file's floor, if the bytes are whole.
pub(crate) fn decode_floor(bytes: &[u8]) -> Option<u64> {
    let (body, crc) = bytes.split_last_chunk::<4>()?;
    if *crc != crc32c::crc32c(body).to_le_bytes() {
        return None;
    }
    Some(u64::from_le_bytes(body.try_into().ok()?))
}

/// Stores the floor durably (replacing the file atomically).
pub(crate) fn write_floor(dir: &Path, floor: u64) -> Result<(), BrokerError> {
    let mut bytes = floor.to_le_bytes().to_vec();
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    Ok(write_atomically(&dir.join("settled"), &bytes)?)
}
