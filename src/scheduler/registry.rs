//! The one point of truth between lanes, cancels and the loader: which messages are being delivered,
//! which are being cancelled, and which cancels a lane must still honour. One mutex guards it all, so that
//! each of these decisions sees the others' latest state:
//!
//! - A **lane** that has read a due record *admits* it under the lock: a cancelled attempt is dropped; a
//!   message whose cancel is in progress is held back (handed back if the cancel fails); anything else is
//!   registered in flight, and stays so until its outcome is durable (a retry: its next attempt in the WAL
//!   and the `retried` outcome recorded). Only then is it released.
//! - A **cancel** (`DELETE /v1/messages/{id}`) first takes the message under the lock: if an attempt is
//!   in flight it is refused, writing nothing (409 `delivery_in_flight`: it may still be delivered, so a
//!   200 would be a lie; a lookup that finds the message already delivered or dead answers that
//!   instead); otherwise no lane can start an attempt of the message until the cancel is finished. Only
//!   then does it look the message up, so the attempt it cancels is the current one (no retry can be
//!   written meanwhile), and writes the tombstone. When the tombstone is durable it decides, under the
//!   lock, whether the cancel must stay in memory (below).
//! - The **loader** marks a bucket loaded under the lock *before* it takes the bucket's snapshot.
//!
//! Invariants:
//! - An acknowledged cancel means no attempt starts afterwards. Its tombstone is durable before the
//!   answer. If its bucket was marked loaded when the tombstone became durable, the cancelled location
//!   is in `cancelled` from then on, and a lane drops the entry when it meets it. If not, the loader
//!   marks the bucket later and its snapshot, taken after the replayer filed everything committed
//!   before (`ScheduleLog::watch`), leaves the message out. That wait is bounded (a replayer held up by
//!   a full disk), so a cancel whose tombstone is not filed yet stays in `recent` until it is, and a
//!   bucket marked meanwhile takes it into `cancelled`.
//! - The replayer also reports tombstones filed into watched buckets (the tap). Those of cancels made
//!   here are known by their seq in `recent`, or, while their cancel is still writing (a report may
//!   come before it knows the seq), by their target in `targets`, and ignored: the cancel put its location in memory already,
//!   and a report arriving after a lane met the entry would otherwise put it back for good. A report of
//!   any other tombstone (written straight through `ScheduleLog::cancel`) goes into `cancelled`.
//! - Memory: cancels are held only for loaded buckets (until a lane meets the entry, the bucket's
//!   snapshot turns out to have left the record out, or the bucket is retired and its records can no
//!   longer be read) and, for other buckets, only until the replayer has
//!   filed their tombstones (milliseconds). Far-future cancels live on disk only. `recent` holds a seq
//!   per cancel until it is filed and, for a loaded bucket, its report handled by the wheel thread.
//! - An attempt is in flight from its admission until its outcome is durable; a message is never both
//!   in flight and being cancelled.

use super::wheel::Entry;
use super::SchedulerState;
use schedulelog::{
    AppendError, Bucket, BucketSnapshot, Location, MessageId, MessageState, MessageStatus,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

/// What a lane does with a due record it has read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Deliver it: the message is now in flight.
    Deliver,
    /// It is cancelled: drop it.
    Cancelled,
    /// Its cancel is in progress: the registry holds the entry until the cancel is decided.
    Held,
}

#[derive(Debug, Default)]
pub(crate) struct Registry {
    /// Buckets the loader has begun to load (marked before their snapshot), until they are retired.
    loaded: HashSet<Bucket>,
    /// Cancelled attempts a lane may still meet.
    cancelled: HashSet<Location>,
    /// Tombstones written by cancels here, by seq, until filed (and, for a loaded bucket, reported).
    recent: BTreeMap<u64, Location>,
    /// Messages with attempts admitted by a lane and not yet settled, with how many.
    in_flight: HashMap<MessageId, u32>,
    /// Messages a cancel is working on.
    cancelling: HashSet<MessageId>,
    /// The attempts those cancels are writing tombstones for: the replayer may report a tombstone
    /// before its cancel has put its seq in `recent`, and the cancel decides where it goes.
    targets: HashSet<Location>,
    /// Entries a lane met while their message was being cancelled, with their locations.
    held: HashMap<MessageId, Vec<(Location, Entry)>>,
}

impl Registry {
    /// A lane's decision for a due record it has read (see the module doc).
    pub fn admit(&mut self, id: MessageId, location: Location, entry: Entry) -> Admission {
        if self.cancelled.remove(&location) {
            return Admission::Cancelled;
        }
        if self.cancelling.contains(&id) {
            self.held.entry(id).or_default().push((location, entry));
            return Admission::Held;
        }
        *self.in_flight.entry(id).or_default() += 1;
        Admission::Deliver
    }

    /// The outcomes of these admitted attempts are durable (or they went back to the wheel).
    pub fn release(&mut self, ids: &[MessageId]) {
        for id in ids {
            if let Some(count) = self.in_flight.get_mut(id) {
                *count -= 1;
                if *count == 0 {
                    self.in_flight.remove(id);
                }
            }
        }
    }

    /// Whether the attempt at `location` was cancelled since it was admitted (a tombstone written by
    /// someone other than [`super::Scheduler::cancel`], reported by the replayer); forgets it.
    pub fn take_cancelled(&mut self, location: &Location) -> bool {
        self.cancelled.remove(location)
    }

    /// A tombstone the replayer filed into a watched (so loaded) bucket.
    pub fn on_replayed_cancel(&mut self, target: Location, seq: u64) {
        if self.recent.remove(&seq).is_none() && !self.targets.contains(&target) {
            self.cancelled.insert(target);
        }
    }

    /// The loader is about to take `bucket`'s snapshot. `filed_below` is the replayer's position: a cancel
    /// not filed yet may be missing from the snapshot, so it is held in memory from now on.
    pub fn mark_loaded(&mut self, bucket: Bucket, filed_below: u64) {
        self.prune(filed_below, false);
        for location in self.recent.values() {
            if location.bucket == bucket {
                self.cancelled.insert(*location);
            }
        }
        self.loaded.insert(bucket);
    }

    /// The loader took `snapshot` after the replayer had filed every record below `filed_below`: a
    /// cancelled record below that and not in the snapshot is finished (its tombstone kept it out), so
    /// no lane will meet it, and its cancel leaves memory.
    pub fn snapshot_taken(&mut self, snapshot: &BucketSnapshot, filed_below: u64) {
        let pending = &snapshot.pending; // in seq order
        self.cancelled.retain(|l| {
            l.bucket != snapshot.bucket
                || l.seq >= filed_below
                || pending.binary_search_by_key(&l.seq, |e| e.seq).is_ok()
        });
    }

    /// `bucket` was retired: its records can no longer be read, so nothing needs its cancels.
    pub fn forget(&mut self, bucket: Bucket) {
        self.loaded.remove(&bucket);
        self.cancelled.retain(|l| l.bucket != bucket);
    }

    /// Forgets the seqs of tombstones below `filed_below` (filed): for buckets not loaded (no report can
    /// come), and, once the caller has handled every report sent before it read `filed_below`
    /// (`reports_handled`, the wheel thread), for loaded ones too.
    pub fn prune(&mut self, filed_below: u64, reports_handled: bool) {
        let filed: Vec<u64> = self
            .recent
            .range(..filed_below)
            .filter(|(_, l)| reports_handled || !self.loaded.contains(&l.bucket))
            .map(|(seq, _)| *seq)
            .collect();
        for seq in filed {
            self.recent.remove(&seq);
        }
    }

    /// Attempts in flight (admitted by a lane, not yet settled).
    #[cfg(test)]
    pub fn in_flight_len(&self) -> usize {
        self.in_flight.len()
    }

    /// Cancelled locations a lane may still meet.
    #[cfg(test)]
    pub fn cancelled_len(&self) -> usize {
        self.cancelled.len()
    }

    /// Cancels of buckets not loaded still in memory (their tombstones not filed yet).
    #[cfg(test)]
    pub fn unfiled_len(&self) -> usize {
        self.recent
            .values()
            .filter(|l| !self.loaded.contains(&l.bucket))
            .count()
    }
}

/// How a cancel ended well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// This call wrote the tombstone.
    Now,
    /// The message was cancelled before.
    Already,
}

/// Why a message was not cancelled.
#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    #[error("no message has this id (or it was retired after its retention)")]
    NotFound,
    #[error("the message was delivered already")]
    AlreadyDelivered,
    #[error("the message is dead (it will not be delivered)")]
    AlreadyDead,
    /// An attempt is being delivered right now: it may end delivered, dead or retried. Nothing was
    /// written; ask again once it settled.
    #[error("an attempt of this message is being delivered right now")]
    InFlight,
    /// Looking the message up failed (for a replayer held up by a full disk, `NotFiledYet` says so).
    #[error("looking the message up failed: {0}")]
    Lookup(#[from] schedulelog::Error),
    /// The cancel's task ended without an answer (it panicked).
    #[error("the cancel was interrupted: {0}")]
    Interrupted(String),
    /// Writing a tombstone failed: the current attempt is not cancelled (orphaned older attempts,
    /// cancelled first, may be).
    #[error(transparent)]
    Append(#[from] AppendError),
}

/// Takes the message for a cancel and gives it back when dropped: records the tombstones made durable
/// in memory where a lane may still need them, drops or hands back what lanes held meanwhile, and wakes
/// other cancels of the same message.
struct Intent {
    shared: Arc<SchedulerState>,
    id: MessageId,
    /// Locations whose tombstones are durable, with each tombstone's seq.
    done: Vec<(u64, Location)>,
    /// The current attempt, when the lookup found it cancelled before.
    cancelled_before: Option<Location>,
    /// The attempts whose tombstones this cancel writes (registered as `targets`).
    targets: Vec<Location>,
}

impl Drop for Intent {
    fn drop(&mut self) {
        let filed_below = self.shared.log.filed_below();
        let held = {
            let mut registry = self.shared.registry();
            registry.cancelling.remove(&self.id);
            for target in &self.targets {
                registry.targets.remove(target);
            }
            let held = registry.held.remove(&self.id).unwrap_or_default();
            for &(seq, location) in &self.done {
                registry.recent.insert(seq, location);
                let met = held.iter().any(|(at, _)| *at == location); // dropped below
                if !met && registry.loaded.contains(&location.bucket) {
                    registry.cancelled.insert(location);
                }
            }
            registry.prune(filed_below, false);
            held
        };
        let now = self.shared.clock.now_ms();
        for (location, entry) in held {
            let cancelled = self.done.iter().any(|(_, at)| *at == location)
                || self.cancelled_before == Some(location);
            if cancelled {
                if let Some(settled) = &self.shared.settled {
                    let _ = settled.send(vec![(self.id, super::Settled::Cancelled)]);
                }
            } else {
                // Not cancelled after all (a tombstone failed, or the message was finished): due
                // again at once.
                self.shared.requeue_at(entry, now);
            }
        }
        self.shared.cancel_done.notify_waiters();
    }
}

/// Looks a message up off the async threads.
async fn lookup(shared: &SchedulerState, id: MessageId) -> Result<MessageStatus, CancelError> {
    let log = shared.log.clone();
    tokio::task::spawn_blocking(move || log.lookup(id))
        .await
        .map_err(|e| CancelError::Interrupted(e.to_string()))??
        .ok_or(CancelError::NotFound)
}

/// Cancels every pending attempt of `id` (see the module doc for the order of things).
pub(crate) async fn cancel(
    shared: Arc<SchedulerState>,
    id: MessageId,
) -> Result<Cancelled, CancelError> {
    let mut intent = loop {
        // Registered before the look, so that a cancel finishing in between still wakes this one.
        let finished = shared.cancel_done.notified();
        tokio::pin!(finished);
        finished.as_mut().enable();
        let (in_flight, taken) = {
            let mut registry = shared.registry();
            let in_flight = registry.in_flight.contains_key(&id);
            (in_flight, !in_flight && registry.cancelling.insert(id))
        };
        if in_flight {
            // A finished state is the answer (the attempt settled and is being released, or a later
            // attempt runs); otherwise the attempt may still end either way.
            return Err(match lookup(&shared, id).await?.state {
                MessageState::Delivered { .. } => CancelError::AlreadyDelivered,
                MessageState::Dead { .. } | MessageState::Discarded { .. } => {
                    CancelError::AlreadyDead
                }
                MessageState::Pending | MessageState::Cancelled { .. } => CancelError::InFlight,
            });
        }
        if taken {
            break Intent {
                shared: shared.clone(),
                id,
                done: Vec::new(),
                cancelled_before: None,
                targets: Vec::new(),
            };
        }
        // Another cancel of the same message is in progress: its answer decides this one's.
        finished.await;
    };
    #[cfg(test)]
    shared.hook_cancel_begun(id).await;

    let status = lookup(&shared, id).await?;
    match status.state {
        MessageState::Delivered { .. } => return Err(CancelError::AlreadyDelivered),
        MessageState::Dead { .. } | MessageState::Discarded { .. } => {
            return Err(CancelError::AlreadyDead)
        }
        MessageState::Cancelled { .. } => intent.cancelled_before = Some(status.location),
        MessageState::Pending => {}
    }
    if intent.cancelled_before.is_some() && status.orphaned.is_empty() {
        return Ok(Cancelled::Already);
    }
    // Orphaned attempts first: the answer is about the current one, and a failure leaves it pending.
    let mut targets = status.orphaned.clone();
    if status.state == MessageState::Pending {
        targets.push(status.location);
    }
    // Their reports are the cancel's to handle (see `targets`), even if one comes before this knows
    // the tombstone's seq.
    shared.registry().targets.extend(targets.iter().copied());
    intent.targets.clone_from(&targets);
    for location in targets {
        let seq = shared.log.cancel(location).await?;
        intent.done.push((seq, location));
        #[cfg(test)]
        shared.hook_tombstone_written(seq).await;
    }
    shared.finished_key(&status.message, id);
    drop(intent);
    Ok(if status.state == MessageState::Pending {
        Cancelled::Now
    } else {
        Cancelled::Already
    })
}
