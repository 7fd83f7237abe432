//! Views of buckets: their records in due order and their outcomes by seq, for listings and lookups.
//!
//! A segment's index is in seq order and its dispatch log in the order things happened, so neither answers
//! "the next 100 due" or "what became of seq N" without reading all of it. A [`View`] of a bucket holds,
//! in memory:
//! - `due_order`: every index entry's `(deliver_at - bucket start) << 32 | position`, sorted: due order,
//!   ties in seq order (8 bytes a record);
//! - `outcomes`: every outcome frame's seq, kind and offset in the dispatch log, sorted by seq (24 bytes
//!   an outcome; the last few thousand read are kept aside in the order they happened until merged),
//!   and how many distinct seqs have one (the bucket's finished records).
//!
//! Invariants:
//! - Built on first use and brought up to date at each use by reading only what was added since: index
//!   entries past `entries` (the index only grows while the log is open) and dispatch-log bytes past
//!   `outcomes_read` (the log only grows; a torn or unfinished frame at its end is not read, and read
//!   again next time).
//! - Each part is built only when asked for: a lookup by id builds the outcomes alone.
//! - Kept for the buckets used last, up to [`MAX_VIEWS`] views and [`ITEM_BUDGET`] items in all (the one
//!   in use is kept whatever its size); a retired bucket's view is dropped. A timeline reads views of
//!   the buckets that have a dispatch log only, so most future buckets cost nothing.

use crate::bucket::Bucket;
use crate::dispatch::DispatchLogs;
use crate::error::{Error, Result};
use crate::record::{Outcome, OutcomeKind};
use crate::segment::SegmentReader;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// At most this many buckets have a view.
const MAX_VIEWS: usize = 1024;
/// Views are dropped, least recently used first, while they hold more items than this: an item is 8
/// bytes (a record in due order is one, an outcome three), so about 128 MiB in all.
const ITEM_BUDGET: usize = 16 << 20;

/// One outcome frame, as the index of a dispatch log keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct OutcomeRef {
    seq: u64,
    offset: u64,
    kind: Effect,
}

/// What an outcome says of its record's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Effect {
    Delivered,
    Dead,
    Cancelled,
    /// Put away after it died.
    Discarded,
    /// A later attempt exists: this record is not the message's current attempt.
    Retried,
}

impl Effect {
    fn of(kind: &OutcomeKind) -> Effect {
        match kind {
            OutcomeKind::Delivered => Effect::Delivered,
            OutcomeKind::Dead { .. } => Effect::Dead,
            OutcomeKind::Cancelled => Effect::Cancelled,
            OutcomeKind::Discarded => Effect::Discarded,
            OutcomeKind::Retried { .. } => Effect::Retried,
        }
    }
}

/// A bucket's records in due order and its outcomes by seq (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct View {
    /// Index entries in `due_order`.
    entries: u64,
    due_order: Vec<u64>,
    /// Dispatch-log bytes read into `outcomes` and `recent` (0: none yet).
    outcomes_read: u64,
    /// Sorted by seq (and offset).
    outcomes: Vec<OutcomeRef>,
    /// Distinct seqs in `outcomes`.
    merged_seqs: u64,
    /// Outcomes read since the last merge into `outcomes`, in the order they happened (so after every
    /// outcome of `outcomes`): merged once there are [`MERGE_AT`], so that a catch-up after each of
    /// many outcomes (a purge, a busy bucket's lookups) does not sort everything each time, and a
    /// look at `recent` stays short.
    recent: Vec<OutcomeRef>,
}

/// See `View::recent`. (Test builds merge sooner, so that tests cross it.)
#[cfg(not(test))]
const MERGE_AT: usize = 4096;
#[cfg(test)]
const MERGE_AT: usize = 256;

/// A bucket's index entry as `due_order` keeps it: its due time from the bucket start, and its position.
/// A record is due before its bucket starts when it was stored after its time (it is filed in the bucket
/// of when it was stored); it counts as due at the start.
pub(crate) fn due_key(deliver_at_ms: i64, bucket: Bucket) -> u32 {
    let due = deliver_at_ms.saturating_sub(bucket.start_ms()).max(0);
    // Below the bucket's width (at most 65,535 minutes), which fits 32 bits.
    u32::try_from(due).unwrap_or(u32::MAX)
}

impl View {
    fn items(&self) -> usize {
        self.due_order.len() + 3 * (self.outcomes.len() + self.recent.len())
    }

    /// Reads the outcomes recorded since the last call.
    pub(crate) fn catch_up_outcomes(
        &mut self,
        dispatch: &DispatchLogs,
        bucket: Bucket,
    ) -> Result<()> {
        let (new, end) = dispatch.read_from(bucket, self.outcomes_read)?;
        self.outcomes_read = end;
        self.recent
            .extend(new.iter().map(|(offset, outcome)| OutcomeRef {
                seq: outcome.seq,
                offset: *offset,
                kind: Effect::of(&outcome.kind),
            }));
        if self.recent.len() >= MERGE_AT {
            self.recent.sort();
            self.outcomes.append(&mut self.recent);
            // Two sorted runs: the stable sort merges them in linear time.
            self.outcomes.sort();
            self.merged_seqs = self.outcomes.chunk_by(|a, b| a.seq == b.seq).count() as u64;
        }
        Ok(())
    }

    /// Reads the index entries published since the last call into `due_order`.
    pub(crate) fn catch_up_entries(
        &mut self,
        reader: &SegmentReader,
        bucket: Bucket,
    ) -> Result<()> {
        let len = reader.len();
        if len > u64::from(u32::MAX) {
            return Err(Error::InvalidOption(format!(
                "bucket {bucket} holds {len} records; listing supports at most {} in a bucket",
                u32::MAX
            )));
        }
        if len <= self.entries {
            return Ok(());
        }
        // Read whole before anything changes, so that a failed read leaves the view as it was.
        let mut fresh = Vec::with_capacity(usize::try_from(len - self.entries).unwrap_or(0));
        reader.scan(self.entries, len - self.entries, |position, entry| {
            fresh.push(u64::from(due_key(entry.deliver_at_ms, bucket)) << 32 | position);
        })?;
        sort_by_due(&mut fresh);
        if self.due_order.is_empty() {
            self.due_order = fresh;
        } else {
            self.due_order.append(&mut fresh);
            self.due_order.sort(); // merges the two sorted runs
        }
        self.entries = len;
        Ok(())
    }

    /// How many distinct records have an outcome.
    pub(crate) fn finished(&self) -> u64 {
        let mut fresh: Vec<u64> = self
            .recent
            .iter()
            .map(|r| r.seq)
            .filter(|&seq| self.merged(seq).is_empty())
            .collect();
        fresh.sort_unstable();
        fresh.dedup();
        self.merged_seqs + fresh.len() as u64
    }

    /// The records in due order, as `(due relative to the bucket start, position in the index)`, from
    /// the first due at `due_ms` (relative) or later that comes after `after` (a position in this
    /// order, as this gives it) if given.
    pub(crate) fn due_from(
        &self,
        due_ms: u32,
        after: Option<(u32, u64)>,
    ) -> impl Iterator<Item = (u32, u64)> + '_ {
        let from = u64::from(due_ms) << 32;
        let mut first = self.due_order.partition_point(|&k| k < from);
        if let Some((due, position)) = after {
            let after = u64::from(due) << 32 | position;
            first = first.max(self.due_order.partition_point(|&k| k <= after));
        }
        self.due_order[first..]
            .iter()
            .map(|&k| ((k >> 32) as u32, k & u64::from(u32::MAX)))
    }

    /// What the outcomes recorded for a seq make of it (`None`: it has none, it is pending).
    pub(crate) fn effect(&self, seq: u64) -> Option<Effect> {
        effect(&self.refs(seq))
    }

    /// Every seq whose outcomes make it `effect`, in seq order.
    pub(crate) fn seqs_with(&self, wanted: Effect) -> Vec<u64> {
        let mut recent = self.recent.clone();
        recent.sort();
        // Both sorted by seq: walk them together a seq at a time, the merged outcomes first (they
        // happened first).
        let (mut a, mut b) = (&self.outcomes[..], &recent[..]);
        let mut found = Vec::new();
        loop {
            let seq = match (a.first(), b.first()) {
                (Some(x), Some(y)) => x.seq.min(y.seq),
                (Some(x), None) => x.seq,
                (None, Some(y)) => y.seq,
                (None, None) => return found,
            };
            let (mine_a, rest_a) = a.split_at(a.partition_point(|r| r.seq == seq));
            let (mine_b, rest_b) = b.split_at(b.partition_point(|r| r.seq == seq));
            let refs: Vec<OutcomeRef> = mine_a.iter().chain(mine_b).copied().collect();
            if effect(&refs) == Some(wanted) {
                found.push(seq);
            }
            (a, b) = (rest_a, rest_b);
        }
    }

    /// Every outcome recorded for a seq, in the order they happened; `None` when the bucket was
    /// retired meanwhile.
    pub(crate) fn outcomes_of(
        &self,
        dispatch: &DispatchLogs,
        bucket: Bucket,
        seq: u64,
    ) -> Result<Option<Vec<Outcome>>> {
        let offsets: Vec<u64> = self.refs(seq).iter().map(|r| r.offset).collect();
        dispatch.read_at(bucket, &offsets)
    }

    /// A seq's outcomes, in the order they happened.
    fn refs(&self, seq: u64) -> Vec<OutcomeRef> {
        let mut refs = self.merged(seq).to_vec();
        refs.extend(self.recent.iter().filter(|r| r.seq == seq));
        refs
    }

    fn merged(&self, seq: u64) -> &[OutcomeRef] {
        let first = self.outcomes.partition_point(|r| r.seq < seq);
        let end = first + self.outcomes[first..].partition_point(|r| r.seq == seq);
        &self.outcomes[first..end]
    }
}

/// Sorts `due_order` items given in position order by due time, keeping position order among equal
/// ones: so in `due_order`'s order. A stable radix sort on the due time's bits, 11 a pass (three at
/// most; none over bits no item has): a bucket's 10 M items took about a third of the time a
/// comparison sort took (`cargo bench --bench listing`).
fn sort_by_due(items: &mut Vec<u64>) {
    let highest = items.iter().map(|k| k >> 32).max().unwrap_or(0);
    if highest == 0 {
        return; // all due at once: in position order already
    }
    let mut sorted = vec![0u64; items.len()];
    let mut shift = 32;
    while shift < 64 && highest >> (shift - 32) > 0 {
        let digit = |k: u64| ((k >> shift) & 0x7ff) as usize;
        let mut starts = vec![0usize; 0x800];
        for &k in items.iter() {
            starts[digit(k)] += 1;
        }
        let mut sum = 0;
        for start in starts.iter_mut() {
            (*start, sum) = (sum, sum + *start);
        }
        for &k in items.iter() {
            let at = &mut starts[digit(k)];
            sorted[*at] = k;
            *at += 1;
        }
        std::mem::swap(items, &mut sorted);
        shift += 11;
    }
}

/// What a record's outcomes (sorted by offset: in the order they happened) make of it, as a lookup
/// reads them (log/lookup.rs `deciding`): a `retried` outcome wins (a later attempt is the current
/// one), then a discard (it follows a `dead`), then the first outcome recorded.
fn effect(refs: &[OutcomeRef]) -> Option<Effect> {
    let has = |e: Effect| refs.iter().any(|r| r.kind == e);
    if has(Effect::Retried) {
        Some(Effect::Retried)
    } else if has(Effect::Discarded) {
        Some(Effect::Discarded)
    } else {
        refs.first().map(|r| r.kind)
    }
}

#[derive(Debug)]
struct Slot {
    used: u64,
    items: usize,
    view: Arc<Mutex<View>>,
}

/// The views kept, by bucket.
#[derive(Debug, Default)]
pub(crate) struct Views {
    slots: Mutex<(u64, HashMap<Bucket, Slot>)>,
}

impl Views {
    /// A bucket's view (empty when new), marked as used now. Lock it to read or catch it up, then
    /// report its size with [`Views::sized`].
    pub(crate) fn get(&self, bucket: Bucket) -> Arc<Mutex<View>> {
        let mut slots = self.slots();
        slots.0 += 1;
        let now = slots.0;
        let slot = slots.1.entry(bucket).or_insert_with(|| Slot {
            used: now,
            items: 0,
            view: Arc::default(),
        });
        slot.used = now;
        slot.view.clone()
    }

    /// Records a view's size after a catch-up, and drops the least recently used views over the limits.
    pub(crate) fn sized(&self, bucket: Bucket, view: &View) {
        let mut slots = self.slots();
        if let Some(slot) = slots.1.get_mut(&bucket) {
            slot.items = view.items();
        }
        loop {
            let total: usize = slots.1.values().map(|s| s.items).sum();
            if slots.1.len() <= MAX_VIEWS && total <= ITEM_BUDGET {
                break;
            }
            let oldest = slots
                .1
                .iter()
                .filter(|(b, _)| **b != bucket)
                .min_by_key(|(_, s)| s.used)
                .map(|(b, _)| *b);
            match oldest {
                Some(oldest) => slots.1.remove(&oldest),
                None => break,
            };
        }
    }

    /// Drops a bucket's view (its files are gone).
    pub(crate) fn forget(&self, bucket: Bucket) {
        self.slots().1.remove(&bucket);
    }

    fn slots(&self) -> MutexGuard<'_, (u64, HashMap<Bucket, Slot>)> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Locks a view; a panic while it was held left it as it was, and the next catch-up goes on from there.
pub(crate) fn lock(view: &Mutex<View>) -> MutexGuard<'_, View> {
    view.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_radix_sort_orders_like_a_comparison_sort(dues in proptest::collection::vec(any::<u32>(), 0..2000), small in any::<bool>()) {
            // Positions ascending, as items are read; dues over 32 bits, or few of them (ties).
            let mut items: Vec<u64> = dues
                .iter()
                .enumerate()
                .map(|(i, &d)| u64::from(if small { d % 7 } else { d }) << 32 | i as u64)
                .collect();
            let mut expected = items.clone();
            expected.sort_unstable();
            sort_by_due(&mut items);
            prop_assert_eq!(items, expected);
        }
    }
}
