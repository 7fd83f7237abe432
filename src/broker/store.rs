//! A broker store: one commit log, the consume queues of the topics kept in it, and their checkpoint.
//!
//! ```text
//! {store}/commitlog/{base:020}                 commitlog.rs
//! {store}/consumequeue/{topic}/{queue}/{first:020}   queue.rs
//! {store}/checkpoint    commit log offset below which every record has its unit synced (u64 LE),
//!                       on a cluster member then the last replicated op stored below it (entry
//!                       index u64 LE, position u32 LE), then a CRC-32C (u32 LE) of what is before
//!                       it; replaced atomically every 100,000 messages (or 256 MiB)
//! {store}/settled       the floor below which every delivery's outcome is durable, with the
//!                       dispatch logs' marks its lookups read from (outcomes.rs)
//! ```
//!
//! Invariants and recovery:
//! - A delivery is acknowledged to the scheduler only after its record is synced, so the dispatch log
//!   never records a delivery the broker could lose. Its unit is written then, and synced only at the
//!   next checkpoint: units are derived data (each record carries its queue offset), and syncing every
//!   queue a batch touched cost one `fdatasync` per queue per batch.
//! - A unit is published to readers only after its record is synced. An append whose units cannot be
//!   written is undone, commit log included: nothing half-stored is ever acknowledged or read.
//! - On open the commit log is read from the checkpoint or the stored floor, whichever is earlier:
//!   from the floor on, deliveries are held for `Broker::reconcile` (outcomes.rs), and only from the
//!   checkpoint on are units touched.
//! - On open the commit log's torn tail is cut; every record after the checkpoint writes its unit again
//!   (idempotent), which restores units lost or torn in a crash; a queue that got records after the
//!   checkpoint is cut to end right after the last of them, and units at the end of any queue that are
//!   zero or point past the log are cut. A record whose queue offset leaves a gap is corruption.
//!   Recovery reads the log from the checkpoint one record at a time: its time and memory do not grow
//!   with the history kept.
//! - A checkpoint is taken under the store's lock (the log's end, the queue files written since the last
//!   one) and made durable off it, on a thread of its own: its syncs (a few milliseconds on a slow disk,
//!   tens with other syncs queued) would otherwise hold up every append and pull. One runs at a time, so
//!   the checkpoint file only moves forward; while one runs, the next waits for a later append. One whose
//!   thread cannot be started is made under the lock, as at open. Dropping the store waits for the job.
//! - A checkpoint is due every 100,000 messages, 256 MiB, or 64 queue files kept open for it (queue.rs).
//! - Queue files are synced through their shared handles by checkpoints only (queue.rs). After a job
//!   failed (or panicked) no further checkpoint is written until a restart (the kernel may have dropped
//!   those units' pages); the files kept for one are let go when it would have been due.
//! - On a cluster member, messages are placed in the queues the leader chose (carried by the op), and
//!   `applied` is the newest replicated op whose records are stored: each record names its op, the
//!   checkpoint names the newest below it, so recovery finds it again; an op applied again after a
//!   restart (entries after the schedule's checkpoint are) is recognised and not stored twice.
//! - Each queue's `min_offset` is the first unit whose record the log still holds: retention moves it
//!   when it deletes segments, and opening recomputes it (files of an interrupted deletion go then).

use super::commitlog::{CommitLog, Segment, HEADER_LEN};
use super::outcomes::{read_settled, Awaiting, Held};
use super::queue::{Queue, Unit};
use super::record::{decode_payload, encode_record};
use super::{io_err, lock, valid_topic, BrokerError, Incoming, OpAt, StoredMeta};
use schedulelog::{create_dir_durably, sync_dir, write_atomically};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Messages stored between two checkpoints, at most (recovery re-reads what follows the checkpoint;
/// a checkpoint syncs every queue file written since the last one, and the checkpoint file).
const CHECKPOINT_EVERY: u64 = 100_000;
/// Bytes stored between two checkpoints, at most.
const CHECKPOINT_EVERY_BYTES: u64 = 256 << 20;
/// Queue files kept open for the next checkpoint, at most (a queue moves on to a new file every
/// `segment_bytes / 1024` units: once per queue between two checkpoints with the default 1 GiB segments,
/// far more often with small ones).
const CHECKPOINT_EVERY_FILES: u64 = 64;
/// A read stops at this many commit-log segments (the next pull goes on from there): each holds a
/// descriptor until the answer is sent, and a queue whose records are spread thinly (other topics in
/// between, or small segments) would otherwise hold one per message, taking descriptors storage needs.
pub(crate) const MAX_SEGMENTS_PER_READ: usize = 8;

#[derive(Debug, Default)]
struct Topic {
    queues: Vec<Queue>,
    next_round_robin: u32,
}

/// Consume-queue units per file: about as many messages as a commit log segment of 1 KiB messages holds,
/// within RocketMQ's 300,000 (6 MB files) and at least 64.
fn units_per_file(segment_bytes: u64) -> u64 {
    (segment_bytes / 1024).clamp(64, 300_000)
}

/// What a pull reads: where it starts (at least the queue's `min_offset`) and, in queue order, where each
/// message's record is.
#[derive(Debug)]
pub(crate) struct ReadPlan {
    pub from: u64,
    pub records: Vec<(u64, Arc<File>, u64, u32)>,
}

/// A queue whose `min_offset` retention moved: (topic, queue, from, to).
pub(crate) type Moved = (String, u32, u64, u64);

/// Where a replicated op put a message: the queue the leader chose, and the topic's queue count,
/// should this store create the topic (so that every member creates it alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chosen {
    pub queue: u32,
    pub queues: u32,
}

/// One store.
#[derive(Debug)]
pub(crate) struct Store {
    dir: PathBuf,
    pub log: CommitLog,
    topics: BTreeMap<String, Topic>,
    queues_per_topic: u32,
    units_per_file: u64,
    unsynced_since_checkpoint: u64,
    unsynced_bytes_since_checkpoint: u64,
    /// Queue files kept open since the last checkpoint for the next one (queues moved on from them).
    kept_files: u64,
    /// Queues whose `min_offset` could not be moved at the last retention (an I/O error reading their
    /// units): the next pass tries them again.
    pub queues_behind: bool,
    /// Why appends are refused until a restart: undoing a failed append failed, so the files may no
    /// longer match what this store holds in memory.
    pub failed: Option<String>,
    /// The newest replicated op whose records are stored (a cluster member's store; module doc).
    pub applied: Option<OpAt>,
    /// How many of `applied`'s records recovery found after the checkpoint: an op may have been cut
    /// short by a crash between two of its writes (a segment rolled over, or the unsynced window
    /// filled), and is then completed when applied again. `None`: all of them (stored by this
    /// process, or before the checkpoint, which is never taken in the middle of an op).
    pub applied_present: Option<u64>,
    /// A checkpoint job failed (or panicked): no later checkpoint may claim the units it covered; the
    /// next open rewrites every unit since the last good one.
    checkpoint_failed: bool,
    /// The checkpoint job running or last run; it answers false when it failed.
    checkpointing: Option<JoinHandle<bool>>,
    /// Messages and bytes stored before a checkpoint is due.
    pub checkpoint_every: (u64, u64),
    /// Deliveries appended whose outcome is not known to be durable yet (outcomes.rs).
    pub awaiting: Arc<Mutex<Awaiting>>,
    /// Where a test holds checkpoint jobs before they sync anything.
    #[cfg(test)]
    pub checkpoint_gate: Option<Arc<Gate>>,
    /// The files the last checkpoint took, for tests.
    #[cfg(test)]
    pub checkpoint_files: Vec<PathBuf>,
}

/// A checkpoint taken under the store's lock, made durable off it: the queue files written since the
/// last one are synced, then the checkpoint file says every unit of a record below `end` is durable.
struct CheckpointJob {
    dir: PathBuf,
    end: u64,
    applied: Option<OpAt>,
    files: Vec<(Arc<File>, PathBuf)>,
    #[cfg(test)]
    gate: Option<Arc<Gate>>,
}

/// A gate a test opens: a checkpoint job waits at it (for 30 s at most, so that a failing test ends
/// rather than hangs in the store's drop).
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct Gate {
    open: Mutex<bool>,
    opened: std::sync::Condvar,
}

#[cfg(test)]
impl Gate {
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn pass(&self) {
        let open = self.open.lock().unwrap();
        let (_open, waited) = self
            .opened
            .wait_timeout_while(open, std::time::Duration::from_secs(30), |open| !*open)
            .unwrap();
        assert!(!waited.timed_out(), "a test left a checkpoint gate shut");
    }
}

impl CheckpointJob {
    /// Runs the job, timed, and logs a failure: whether the checkpoint was stored.
    fn run_reported(self) -> bool {
        let started = std::time::Instant::now();
        match self.run() {
            Ok(()) => {
                metrics::histogram!("delayd_sync_seconds", "file" => "broker_checkpoint")
                    .record(started.elapsed().as_secs_f64());
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "broker checkpoint failed; no more until restart");
                false
            }
        }
    }

    fn run(self) -> Result<(), BrokerError> {
        #[cfg(test)]
        if let Some(gate) = &self.gate {
            gate.pass();
        }
        for (file, path) in &self.files {
            schedulelog::slow_disk::sync();
            file.sync_data().map_err(io_err(path))?;
        }
        let mut bytes = self.end.to_le_bytes().to_vec();
        if let Some((index, position)) = self.applied {
            bytes.extend_from_slice(&index.to_le_bytes());
            bytes.extend_from_slice(&position.to_le_bytes());
        }
        let crc = crc32c::crc32c(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        Ok(write_atomically(&self.dir.join("checkpoint"), &bytes)?)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // A reopen (a restart, a test) must not meet a job still writing the checkpoint file.
        self.join_checkpoint();
    }
}

impl Store {
    /// Opens (creating if needed) the store in `dir` and recovers it.
    pub(crate) fn open(
        dir: &Path,
        queues_per_topic: u32,
        segment_bytes: u64,
    ) -> Result<Store, BrokerError> {
        let log = CommitLog::open(&dir.join("commitlog"), segment_bytes)?;
        let queues_dir = dir.join("consumequeue");
        create_dir_durably(&queues_dir)?;
        let mut store = Store {
            dir: dir.to_path_buf(),
            log,
            topics: BTreeMap::new(),
            queues_per_topic,
            units_per_file: units_per_file(segment_bytes),
            unsynced_since_checkpoint: 0,
            unsynced_bytes_since_checkpoint: 0,
            kept_files: 0,
            queues_behind: false,
            failed: None,
            applied: None,
            applied_present: None,
            checkpoint_failed: false,
            checkpointing: None,
            checkpoint_every: (CHECKPOINT_EVERY, CHECKPOINT_EVERY_BYTES),
            awaiting: Arc::default(),
            #[cfg(test)]
            checkpoint_gate: None,
            #[cfg(test)]
            checkpoint_files: Vec::new(),
        };
        store.load_topics()?;
        store.recover()?;
        Ok(store)
    }

    fn load_topics(&mut self) -> Result<(), BrokerError> {
        let queues_dir = self.dir.join("consumequeue");
        for entry in fs::read_dir(&queues_dir).map_err(io_err(&queues_dir))? {
            let entry = entry.map_err(io_err(&queues_dir))?;
            let Some(name) = entry.file_name().to_str().map(String::from) else {
                continue;
            };
            if !valid_topic(&name) {
                continue;
            }
            let topic_dir = entry.path();
            let present = |q: u32| {
                topic_dir.join(q.to_string()).exists()
                    || super::queue::migrating_dir(&topic_dir, q).exists()
            };
            let mut count = 0;
            while present(count) {
                count += 1;
            }
            if count == 0 {
                // Created just before a crash, before its queues: as if absent (made again on use).
                continue;
            }
            let mut topic = Topic::default();
            for queue in 0..count {
                topic
                    .queues
                    .push(Queue::open(&topic_dir, queue, self.units_per_file)?);
            }
            self.topics.insert(name, topic);
        }
        Ok(())
    }

    /// See the module doc: the log's tail, the units after the checkpoint, the queues' ends and minimums.
    fn recover(&mut self) -> Result<(), BrokerError> {
        let (checkpoint, applied) = read_checkpoint_and_op(&self.dir);
        // Deliveries from the stored floor on may lack their outcome (outcomes.rs): read from there
        // too. Without a floor (a store older than it), from the checkpoint as before.
        let settled = read_settled(&self.dir);
        let floor = settled.as_ref().map_or(checkpoint, |s| s.floor);
        let from = checkpoint.min(floor);
        let mut held = Vec::new();
        let mut applied = applied;
        let mut present = None;
        // Queues that got records after the checkpoint end exactly after the last of them: a unit past
        // it can only be left over from a crash, however valid it looks.
        let mut ends: BTreeMap<(String, u32), u64> = BTreeMap::new();
        let Store {
            dir,
            log,
            topics,
            queues_per_topic,
            units_per_file,
            ..
        } = self;
        let log_path = log.dir().to_path_buf();
        log.scan_from(from, |record| {
            let Some((meta, _)) = decode_payload(record.payload) else {
                return Err(BrokerError::Corrupt {
                    path: log_path.clone(),
                    offset: record.offset,
                    reason: "undecodable broker record".into(),
                });
            };
            // A cluster member's records (of ops) carry their outcomes in their entries.
            if record.offset >= floor && meta.op.is_none() {
                held.extend(Held::of(record.offset, &meta));
            }
            if record.offset < checkpoint {
                return Ok(()); // its unit is durable: read for its outcome only
            }
            let queue = queue_mut(
                topics,
                dir,
                *queues_per_topic,
                *units_per_file,
                &meta.topic,
                meta.queue,
            )?;
            if meta.queue_offset > queue.units {
                return Err(BrokerError::Corrupt {
                    path: queue.dir().to_path_buf(),
                    offset: queue.units,
                    reason: format!(
                        "commit log record for queue offset {} leaves a gap",
                        meta.queue_offset
                    ),
                });
            }
            match meta.op {
                Some(op) if Some(op) > applied => (applied, present) = (Some(op), Some(1)),
                Some(op) if Some(op) == applied => present = present.map(|n| n + 1),
                _ => {}
            }
            // Written again even when present: an unsynced unit may be torn or zero.
            let unit = Unit::new(record.offset, record.len, meta.key.as_deref());
            queue.write_at(meta.queue_offset, &unit)?;
            ends.insert((meta.topic, meta.queue), meta.queue_offset + 1);
            Ok(())
        })?;
        self.applied = applied;
        self.applied_present = present;
        let end = self.log.end();
        self.awaiting = Arc::new(Mutex::new(Awaiting::recovered(end, settled, held)));
        for ((topic, index), units) in ends {
            let queue = self.queue_mut(&topic, index)?;
            queue.truncate(units)?;
        }
        let log_end = self.log.end();
        for topic in self.topics.values_mut() {
            for queue in &mut topic.queues {
                let mut valid = queue.units;
                while valid > queue.min_offset {
                    let [unit] = queue.read(valid - 1, 1)?[..] else {
                        break;
                    };
                    if unit.len > 0
                        && unit.log_offset >= HEADER_LEN
                        && unit.log_offset + u64::from(unit.len) <= log_end
                    {
                        break;
                    }
                    valid -= 1;
                }
                queue.truncate(valid)?;
            }
        }
        let (_, doomed) = self.retire_queues();
        if self.queues_behind {
            return Err(BrokerError::Corrupt {
                path: self.dir.join("consumequeue"),
                offset: 0,
                reason: "a queue's units could not be read (the server log names it)".into(),
            });
        }
        remove_files(&doomed)?;
        match self.take_checkpoint().run() {
            // The queues were synced; only the new checkpoint file found no room. The one before stays
            // and is as true (it covers less): the next start reads more of the commit log, and a
            // checkpoint later in this run stores the new end.
            Err(e) if e.is_disk_full() => {
                tracing::warn!(error = %e, "the broker's checkpoint could not be stored at the start for want of space; the next start reads more of its commit log");
                Ok(())
            }
            stored => stored,
        }
    }

    fn queue_mut(&mut self, topic: &str, queue: u32) -> Result<&mut Queue, BrokerError> {
        queue_mut(
            &mut self.topics,
            &self.dir,
            self.queues_per_topic,
            self.units_per_file,
            topic,
            queue,
        )
    }

    /// Creates a topic's queues if it has none yet (not in a store that refuses writes). Nothing else
    /// changes, whether it succeeds or not.
    pub(crate) fn ensure_topic(&mut self, topic: &str) -> Result<(), BrokerError> {
        self.ensure_topic_with(topic, self.queues_per_topic, false)
    }

    /// [`Store::ensure_topic`], creating it with `queues` queues; `replicated`: `queues` is the count
    /// a replicated op names, which an existing topic is completed to.
    fn ensure_topic_with(
        &mut self,
        topic: &str,
        queues: u32,
        replicated: bool,
    ) -> Result<(), BrokerError> {
        if let Some(cause) = &self.failed {
            return Err(BrokerError::Failed(cause.clone()));
        }
        match self.topics.get_mut(topic) {
            None => {
                let created = create_topic(&self.dir, topic, queues, self.units_per_file)?;
                self.topics.insert(topic.to_string(), created);
            }
            // A replicated op names the queue count the leader created the topic with: a crash here
            // between two of its queues' directories left fewer, and nothing in them yet, which are
            // completed (a topic with messages keeps what it has: an op that disagrees is refused
            // by the append; a single node's topic keeps what it has).
            Some(existing)
                if replicated
                    && existing.queues.len() < queues as usize
                    && existing.queues.iter().all(|q| q.units == 0) =>
            {
                let topic_dir = self.dir.join("consumequeue").join(topic);
                for queue in existing.queues.len() as u32..queues {
                    existing
                        .queues
                        .push(Queue::open(&topic_dir, queue, self.units_per_file)?);
                }
                sync_dir(&topic_dir)?;
            }
            Some(_) => {}
        }
        Ok(())
    }

    /// The queue count of `topic`, if it exists.
    pub(crate) fn queue_count(&self, topic: &str) -> Option<u32> {
        self.topics.get(topic).map(|t| t.queues.len() as u32)
    }

    /// Stores messages durably (commit log synced, then units written) and returns each one's queue and
    /// queue offset. `stored_at_ms` is their store time (retention goes by it).
    pub(crate) fn append(
        &mut self,
        messages: &[&Incoming],
        stored_at_ms: i64,
    ) -> Result<Vec<(u32, u64)>, BrokerError> {
        let messages: Vec<_> = messages.iter().map(|m| (*m, None)).collect();
        self.append_placed(&messages, stored_at_ms, None)
    }

    /// [`Store::append`] of a replicated op's messages, each in the queue the leader chose; the op's
    /// place is recorded with them (module doc). Refused (nothing stored) for a queue the topic does
    /// not have.
    pub(crate) fn append_chosen(
        &mut self,
        messages: &[(&Incoming, Chosen)],
        stored_at_ms: i64,
        op: OpAt,
    ) -> Result<Vec<(u32, u64)>, BrokerError> {
        let messages: Vec<_> = messages.iter().map(|(m, c)| (*m, Some(*c))).collect();
        self.append_placed(&messages, stored_at_ms, Some(op))
    }

    fn append_placed(
        &mut self,
        messages: &[(&Incoming, Option<Chosen>)],
        stored_at_ms: i64,
        op: Option<OpAt>,
    ) -> Result<Vec<(u32, u64)>, BrokerError> {
        if let Some(cause) = &self.failed {
            return Err(BrokerError::Failed(cause.clone()));
        }
        let mut placed = Vec::with_capacity(messages.len());
        let mut buf = Vec::new();
        let mut ends = Vec::with_capacity(messages.len());
        // Units each touched queue gets from this batch so far.
        let mut batch_units: BTreeMap<(&str, u32), u64> = BTreeMap::new();
        for &(message, chosen) in messages {
            let queues = chosen.map_or(self.queues_per_topic, |c| c.queues);
            self.ensure_topic_with(&message.topic, queues, true)?;
            let topic = self.topics.get_mut(&message.topic).expect("created above");
            let count = topic.queues.len() as u32;
            let queue = match (chosen, &message.key) {
                (Some(chosen), _) if chosen.queue < count => chosen.queue,
                (Some(chosen), _) => {
                    return Err(BrokerError::Corrupt {
                        path: PathBuf::from(&message.topic),
                        offset: 0,
                        reason: format!(
                            "a replicated append to queue {} of a topic with {count} queues",
                            chosen.queue
                        ),
                    })
                }
                (None, Some(key)) => crc32c::crc32c(key.as_bytes()) % count,
                (None, None) => {
                    topic.next_round_robin = topic.next_round_robin.wrapping_add(1);
                    topic.next_round_robin % count
                }
            };
            let earlier = batch_units.entry((&message.topic, queue)).or_default();
            let queue_offset = topic.queues[queue as usize].units + *earlier;
            *earlier += 1;
            let meta = StoredMeta {
                topic: message.topic.clone(),
                queue,
                queue_offset,
                id: message.id.clone(),
                key: message.key.clone(),
                headers: message.headers.clone(),
                deliver_at_ms: message.deliver_at_ms,
                delivered_at_ms: message.delivered_at_ms,
                attempt: message.attempt,
                op,
                attempt_at: (message.attempt_at).map(|at| (at.bucket.start_minute(), at.seq)),
            };
            encode_record(&mut buf, &meta, &message.body);
            ends.push(buf.len());
            placed.push((queue, queue_offset));
        }
        let mark = self.log.mark();
        let offsets = match self.log.append(&buf, &ends, stored_at_ms) {
            Ok(offsets) => offsets,
            Err(e) => {
                if let Err(undo) = self.log.undo(mark) {
                    self.fail(&undo);
                }
                return Err(e);
            }
        };
        // The new units of each queue, in order: one write per touched queue.
        let mut units: BTreeMap<(&str, u32), Vec<u8>> = BTreeMap::new();
        let mut start = 0;
        for ((&(message, _), &(queue, _)), (&offset, &end)) in
            messages.iter().zip(&placed).zip(offsets.iter().zip(&ends))
        {
            let unit = Unit::new(offset, (end - start) as u32, message.key.as_deref());
            units
                .entry((&message.topic, queue))
                .or_default()
                .extend_from_slice(&unit.encode());
            start = end;
        }
        let mut written: Vec<((&str, u32), u64)> = Vec::new();
        for ((topic, index), bytes) in &units {
            let queue =
                &mut self.topics.get_mut(*topic).expect("created above").queues[*index as usize];
            let (before, kept) = (queue.units, queue.kept_files());
            if let Err(e) = queue.append(bytes) {
                // Undone as a whole: units already written for this batch and the records themselves.
                written.push(((topic, *index), before));
                let mut undone = Ok(());
                for ((topic, index), before) in written {
                    let queue =
                        &mut self.topics.get_mut(topic).expect("exists").queues[index as usize];
                    undone = undone.and(queue.cut(before));
                }
                undone = undone.and(self.log.undo(mark));
                if let Err(undo) = undone {
                    self.fail(&undo);
                }
                return Err(e);
            }
            self.kept_files += queue.kept_files() - kept;
            written.push(((topic, *index), before));
        }
        if op.is_some() {
            self.applied = self.applied.max(op);
            self.applied_present = None;
        }
        let mut awaiting = lock(&self.awaiting);
        if op.is_none() {
            for (&(message, _), &offset) in messages.iter().zip(&offsets) {
                if let Some(at) = message.attempt_at {
                    awaiting.insert(offset, (at, message.attempt));
                }
            }
        }
        awaiting.appended(self.log.end());
        drop(awaiting);
        self.unsynced_since_checkpoint += messages.len() as u64;
        self.unsynced_bytes_since_checkpoint += buf.len() as u64;
        self.start_checkpoint_if_due();
        Ok(placed)
    }

    /// Starts a checkpoint job when one is due, none is running and none failed. The messages are
    /// stored either way; a failed checkpoint only makes the next open rewrite more units.
    fn start_checkpoint_if_due(&mut self) {
        let (every, every_bytes) = self.checkpoint_every;
        let due = self.unsynced_since_checkpoint >= every
            || self.unsynced_bytes_since_checkpoint >= every_bytes
            || self.kept_files >= CHECKPOINT_EVERY_FILES;
        if !due
            || self
                .checkpointing
                .as_ref()
                .is_some_and(|j| !j.is_finished())
        {
            return; // one at a time: a later append starts the next
        }
        self.join_checkpoint();
        if self.checkpoint_failed {
            // None is stored until a restart: the files kept open for the next one are let go.
            drop(self.take_checkpoint());
            return;
        }
        // The thread first, then the checkpoint: a thread that cannot be started has taken nothing.
        let (hand_over, handed) = std::sync::mpsc::channel::<CheckpointJob>();
        let spawned = std::thread::Builder::new()
            .name("delayd-broker-checkpoint".into())
            // Nothing sent is nothing taken.
            .spawn(move || handed.recv().map_or(true, CheckpointJob::run_reported));
        match spawned {
            Ok(job) => {
                if hand_over.send(self.take_checkpoint()).is_err() {
                    // Cannot happen (the thread waits for it); were it so, the files taken are unsynced.
                    self.checkpoint_failed = true;
                }
                self.checkpointing = Some(job);
            }
            Err(e) => {
                // Done here then, under the lock, as at open: the files kept for it are let go.
                tracing::warn!(error = %e, "starting a broker checkpoint thread failed; checkpointing under the store's lock");
                if !self.take_checkpoint().run_reported() {
                    self.checkpoint_failed = true;
                }
            }
        }
    }

    /// Joins the last checkpoint job: one that failed (or panicked) stops every later checkpoint, for
    /// the files it took may not be durable.
    fn join_checkpoint(&mut self) {
        if let Some(job) = self.checkpointing.take() {
            if !matches!(job.join(), Ok(true)) {
                self.checkpoint_failed = true;
            }
        }
    }

    /// Waits for the checkpoint job running, if one is; it must have stored its checkpoint.
    #[cfg(test)]
    pub fn wait_for_checkpoint(&mut self) {
        if let Some(job) = self.checkpointing.take() {
            assert!(
                job.join().expect("the checkpoint job panicked"),
                "the checkpoint failed"
            );
        }
    }

    /// A checkpoint of what is stored now: the log's end and the queue files written since the last one.
    fn take_checkpoint(&mut self) -> CheckpointJob {
        let files = self
            .topics
            .values_mut()
            .flat_map(|topic| topic.queues.iter_mut())
            .flat_map(Queue::take_unsynced)
            .collect::<Vec<_>>();
        #[cfg(test)]
        {
            self.checkpoint_files = files.iter().map(|(_, path)| path.clone()).collect();
        }
        self.unsynced_since_checkpoint = 0;
        self.unsynced_bytes_since_checkpoint = 0;
        self.kept_files = 0;
        CheckpointJob {
            dir: self.dir.clone(),
            end: self.log.end(),
            applied: self.applied,
            files,
            #[cfg(test)]
            gate: self.checkpoint_gate.clone(),
        }
    }

    /// Refuses appends from now on: an undo failed, so the files may hold what memory does not.
    fn fail(&mut self, undo: &BrokerError) {
        tracing::error!(error = %undo, "undoing a failed broker append failed; this store refuses writes until a restart (which recovers it from the commit log)");
        self.failed = Some(format!("undoing a failed append failed: {undo}"));
    }

    /// Topics and their queue counts.
    pub(crate) fn topics(&self) -> impl Iterator<Item = (&String, u32)> {
        self.topics.iter().map(|(n, t)| (n, t.queues.len() as u32))
    }

    /// `(min_offset, max_offset)` of every queue of a topic; `None` for an unknown topic.
    pub(crate) fn queue_offsets(&self, topic: &str) -> Option<Vec<(u64, u64)>> {
        self.topics
            .get(topic)
            .map(|t| t.queues.iter().map(|q| (q.min_offset, q.units)).collect())
    }

    /// Where the records of up to `max` messages (and `max_bytes`, unless the first alone is larger; and
    /// in at most [`MAX_SEGMENTS_PER_READ`] segment files) of a queue from `offset` are; `None` for an
    /// unknown topic or queue. Below `min_offset` it starts at `min_offset`.
    pub(crate) fn plan_read(
        &self,
        topic: &str,
        queue: u32,
        offset: u64,
        max: usize,
        max_bytes: u64,
    ) -> Result<Option<ReadPlan>, BrokerError> {
        let Some(q) = self
            .topics
            .get(topic)
            .and_then(|t| t.queues.get(queue as usize))
        else {
            return Ok(None);
        };
        let mut from = offset.max(q.min_offset);
        let first = self.log.first_offset();
        let mut records = Vec::new();
        let mut bytes = 0u64;
        // Consecutive records are mostly in one segment: one handle for them.
        let mut open: Option<(u64, Arc<File>)> = None;
        let mut segments = 0;
        for (i, unit) in q.read(from, max as u64)?.into_iter().enumerate() {
            let at = from + i as u64;
            bytes += u64::from(unit.len);
            if !records.is_empty() && bytes > max_bytes {
                break; // the answer's size is bounded too, but it always has a message
            }
            if records.is_empty() && unit.log_offset < first {
                // Retired, though min_offset has not moved past it yet (see retire_queues).
                continue;
            }
            let located = self.log.locate(unit.log_offset, unit.len).filter(|_| {
                unit.len as usize
                    <= schedulelog::frame::MAX_PAYLOAD + schedulelog::frame::HEADER_LEN
            });
            let Some((base, pos)) = located else {
                return Err(BrokerError::Corrupt {
                    path: q.dir().to_path_buf(),
                    offset: at * super::queue::UNIT_LEN,
                    reason: format!(
                        "unit points outside the commit log ({}+{})",
                        unit.log_offset, unit.len
                    ),
                });
            };
            let file = match &open {
                Some((open_base, file)) if *open_base == base => file.clone(),
                _ if segments == MAX_SEGMENTS_PER_READ => break,
                _ => {
                    segments += 1;
                    let file = self.log.file(base)?;
                    open = Some((base, file.clone()));
                    file
                }
            };
            records.push((at, file, pos, unit.len));
        }
        if let Some((at, ..)) = records.first() {
            from = *at;
        } else if q.units > from {
            // Every unit read was retired: the next pull starts past them.
            from = (from + max as u64).min(q.units);
        }
        Ok(Some(ReadPlan { from, records }))
    }

    /// Moves every queue's `min_offset` past what the log no longer holds, and returns the queues that
    /// moved and the queue files wholly below their new minimum (to delete outside the lock). A queue
    /// whose units cannot be read keeps its minimum (logged; `queues_behind` says to try again).
    pub(crate) fn retire_queues(&mut self) -> (Vec<Moved>, Vec<PathBuf>) {
        let first = self.log.first_offset();
        let mut moved = Vec::new();
        let mut doomed = Vec::new();
        self.queues_behind = false;
        for (name, topic) in &mut self.topics {
            for (index, queue) in topic.queues.iter_mut().enumerate() {
                let before = queue.min_offset;
                // Each queue moves whole or not at all; one that cannot be read is tried again next
                // time (reads skip units below the log meanwhile).
                match queue.retire_below(first) {
                    Ok((_, files)) => doomed.extend(files),
                    Err(error) => {
                        tracing::error!(%error, topic = %name, queue = index, "moving a queue past retired segments failed; trying again");
                        self.queues_behind = true;
                    }
                }
                if queue.min_offset != before {
                    moved.push((name.clone(), index as u32, before, queue.min_offset));
                }
            }
        }
        (moved, doomed)
    }

    /// Takes the oldest sealed segment out of the log (see [`CommitLog::take_oldest`]).
    pub(crate) fn take_oldest(&mut self) -> Option<Segment> {
        self.log.take_oldest()
    }

    pub(crate) fn log_dir(&self) -> PathBuf {
        self.log.dir().to_path_buf()
    }
}

fn queue_mut<'a>(
    topics: &'a mut BTreeMap<String, Topic>,
    dir: &Path,
    queues_per_topic: u32,
    units_per_file: u64,
    topic: &str,
    queue: u32,
) -> Result<&'a mut Queue, BrokerError> {
    if !topics.contains_key(topic) {
        let created = create_topic(dir, topic, queues_per_topic, units_per_file)?;
        topics.insert(topic.to_string(), created);
    }
    let topic_state = topics.get_mut(topic).expect("inserted above");
    let count = topic_state.queues.len();
    topic_state
        .queues
        .get_mut(queue as usize)
        .ok_or_else(|| BrokerError::Corrupt {
            path: PathBuf::from(topic),
            offset: 0,
            reason: format!("queue {queue} of a topic with {count} queues"),
        })
}

fn create_topic(
    dir: &Path,
    topic: &str,
    queues: u32,
    units_per_file: u64,
) -> Result<Topic, BrokerError> {
    if !valid_topic(topic) {
        return Err(BrokerError::Corrupt {
            path: PathBuf::from(topic),
            offset: 0,
            reason: "invalid topic name".into(),
        });
    }
    let topic_dir = dir.join("consumequeue").join(topic);
    create_dir_durably(&topic_dir)?;
    let mut state = Topic::default();
    for queue in 0..queues {
        state
            .queues
            .push(Queue::open(&topic_dir, queue, units_per_file)?);
    }
    sync_dir(&topic_dir)?;
    sync_dir(&dir.join("consumequeue"))?;
    Ok(state)
}

/// A commit-log segment's header length, for tests that cut one back to it.
#[cfg(test)]
pub(crate) const HEADER_LEN_FOR_TESTS: u64 = HEADER_LEN;

#[cfg(test)]
pub(crate) fn read_checkpoint(dir: &Path) -> u64 {
    read_checkpoint_and_op(dir).0
}

/// The commit-log offset a store's checkpoint holds, and the last replicated op stored below it.
pub(crate) fn read_checkpoint_and_op(dir: &Path) -> (u64, Option<OpAt>) {
    // Replaying from the start is always correct, only slower (and finds the last op again).
    fs::read(dir.join("checkpoint"))
        .ok()
        .and_then(|bytes| decode_checkpoint_and_op(&bytes))
        .unwrap_or((0, None))
}

/// The commit-log offset a store's checkpoint holds, if it is whole.
pub(crate) fn decode_checkpoint(bytes: &[u8]) -> Option<u64> {
    decode_checkpoint_and_op(bytes).map(|(end, _)| end)
}

/// What a store's checkpoint holds (`end` u64 LE, on a cluster member the last op's entry index u64
/// LE and position u32 LE, then a CRC-32C u32 LE of what is before it), if it is whole.
pub(crate) fn decode_checkpoint_and_op(bytes: &[u8]) -> Option<(u64, Option<OpAt>)> {
    let (body, crc) = bytes.split_last_chunk::<4>()?;
    if *crc != crc32c::crc32c(body).to_le_bytes() {
        return None;
    }
    let u64_at = |at: usize| Some(u64::from_le_bytes(body.get(at..at + 8)?.try_into().ok()?));
    match body.len() {
        8 => Some((u64_at(0)?, None)),
        20 => {
            let position = u32::from_le_bytes(body.get(16..20)?.try_into().ok()?);
            Some((u64_at(0)?, Some((u64_at(8)?, position))))
        }
        _ => None,
    }
}

/// Deletes files taken out of a store (missing ones are fine: a crash may have taken them already) and
/// syncs their directories.
pub(crate) fn remove_files(paths: &[PathBuf]) -> Result<(), BrokerError> {
    let mut dirs = std::collections::BTreeSet::new();
    for path in paths {
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(path)(e)),
        }
        if let Some(dir) = path.parent() {
            dirs.insert(dir.to_path_buf());
        }
    }
    for dir in dirs {
        sync_dir(&dir)?;
    }
    Ok(())
}
