//! The built-in broker: where the `broker` sink delivers, and what consumers pull from over HTTP.
//!
//! RocketMQ-style: a commit log of all topics in segment files, a consume queue of fixed 20-byte units
//! per (topic, queue), consumer group offsets, long polling woken by arrivals, and retention that deletes
//! whole segments once their messages are old enough (or the store is over its size cap).
//!
//! ```text
//! broker/commitlog/, consumequeue/, checkpoint, settled   the main store (store.rs, outcomes.rs):
//!                                         every topic but `$dead`
//! broker/dead/...                         the same for dead letters (`$dead`), a store of their own so
//!                                         that they can be kept longer than the messages around them
//! broker/groups/{group}                  a consumer group's offsets (offsets.rs)
//! ```
//!
//! A record's format: record.rs.
//!
//! On a cluster member ([`Broker::replicate_through`], DESIGN.md §10) the broker's writes are Raft
//! entries: an append or an offset commit is encoded as an op (op.rs, with its byte layout), proposed
//! through the member's replicated schedule log, and applied by every member, the leader too, into
//! its own files ([`Broker::apply_op`], called by the cluster's state machine before the entry is
//! filed). The caller is answered once this member applied it. The leader chooses each message's
//! queue (by key, else its own round robin) and a new topic's queue count, and the op carries them, so
//! every member stores each message at the same queue offset. A single node's broker proposes nothing:
//! its appends and commits go straight to its files, as they always did.
//!
//! Invariants:
//! - A delivery is acknowledged only once its record is synced (store.rs has the details and recovery).
//! - A delivery is stored once, across crashes (outcomes.rs): each record names its attempt; a single
//!   node's start records the outcome of those a crash cut off from it ([`Broker::reconcile`]); a
//!   cluster's append op carries its deliveries' outcomes in its own Raft entry.
//! - Retention runs beside appends and pulls, holding the stores' locks only to take segments out of the
//!   logs; files are deleted after the locks are released (a pull that already holds one keeps reading
//!   it). A segment goes when its newest message was stored more than `retention` ago (`dead_retention`
//!   for `$dead`), or, oldest first across both stores, while they hold more than `max_bytes`. The
//!   segment taking appends is never deleted.
//! - A pull below a queue's `min_offset` is answered from `min_offset`; the answer says where it started.
//!   Messages retention deletes before a consumer group with a committed offset on their queue read them
//!   are counted (`delayd_broker_unread_retired_total`).
//! - A cluster member's broker files change only by applied ops (retention aside, which each member
//!   runs on its own clock): an append or commit on it is proposed, never written locally first.
//! - Topic names match `[A-Za-z0-9._-]{1,200}` and are not all dots (or are `$dead`), so no name reaches
//!   outside the data dir.

mod append;
mod commitlog;
mod config;
mod error;
mod inspect;
mod offsets;
pub(crate) mod op;
mod outcomes;
mod queue;
mod record;
mod sink;
mod store;

pub use config::BrokerConfig;
pub use error::BrokerError;
pub use inspect::inspect;
pub use offsets::CommitError;
pub use record::{Incoming, Pulled, Stored, StoredMeta};
pub use sink::{BrokerSink, BrokerSinkConfig};

use crate::sink::Delivery;
use append::{append_together, StoreGroup};
use error::io_err;
use op::{BrokerOp, OpMessage};
use outcomes::Awaiting;
use record::decode_record;
use schedulelog::ScheduleLog;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;
use store::{Chosen, Store};

/// How the broker stores and keeps messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerOptions {
    /// Consume queues of a new topic.
    pub queues_per_topic: u32,
    /// Size of a commit log segment (a record larger than this gets one of its own).
    pub segment_bytes: u64,
    /// Messages stored longer ago than this are deleted, a segment at a time.
    pub retention: Duration,
    /// The same for dead letters (`$dead`).
    pub dead_retention: Duration,
    /// A cap on the commit logs' bytes: the oldest segments go first past it.
    pub max_bytes: Option<u64>,
    /// Most bytes of records one read returns (at least one record).
    pub max_pull_bytes: u64,
}

impl Default for BrokerOptions {
    fn default() -> BrokerOptions {
        BrokerOptions {
            queues_per_topic: 4,
            segment_bytes: 1 << 30,
            retention: Duration::from_secs(72 * 3600),
            dead_retention: Duration::from_secs(7 * 86_400),
            max_bytes: None,
            max_pull_bytes: 16 << 20,
        }
    }
}

/// A store's lock is held now (see [`Broker::queue_offsets_now`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreBusy;

/// What one retention pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retired {
    pub segments: usize,
    pub bytes: u64,
    /// Messages deleted before a consumer group with a committed offset on their queue read them.
    pub unread: u64,
}

/// The broker. Cheap to share (`Arc`); blocking I/O, so async callers use `spawn_blocking`.
#[derive(Debug)]
pub struct Broker {
    options: BrokerOptions,
    /// The two stores, each with the appends waiting for the thread that holds it (group commit: lanes
    /// delivering at once share one commit-log write and sync).
    main: StoreGroup,
    dead: StoreGroup,
    offsets: Mutex<offsets::Offsets>,
    /// Woken on every append; long polls re-check their queue.
    arrivals: tokio::sync::Notify,
    /// Why the last delivery failed for want of space, and when: until one succeeds again, or a few
    /// seconds without a try (postponed deliveries try every second while there are any).
    disk_full: Mutex<Option<(String, std::time::Instant)>>,
    /// A data dir from before dead letters had a store of their own keeps them in the main store: its
    /// `$dead` queue has offsets that consumer groups committed, and units that point into the main log.
    dead_in_main: bool,
    /// A cluster member's replicated log, once set: appends and offset commits are proposed through it.
    /// Weak: the log closes when its owner lets it go (which ends its proposer), whoever holds the
    /// broker.
    replicated: OnceLock<Weak<ScheduleLog>>,
    /// Where this member's own apply put the messages of the append ops it proposed, by the op's
    /// nonce: `None` until applied; taken by the proposer once `propose_app` returned.
    placements: Mutex<HashMap<u64, Option<Placements>>>,
    /// The leader's round robin over the queues of each topic, for messages without a key (a choice
    /// the op carries, so no member needs its own to agree).
    round_robin: Mutex<HashMap<String, u32>>,
    /// The next append op's nonce: from a random start, so that no two members' ops in flight share one.
    next_nonce: AtomicU64,
    /// Each store's dir and its deliveries awaiting their outcome (outcomes.rs): main, then dead.
    awaiting: [(PathBuf, Arc<Mutex<Awaiting>>); 2],
    /// Held while a floor file is replaced.
    floor_writing: Mutex<()>,
    /// A cluster member's deliveries whose append failed, some maybe committed (outcomes.rs).
    in_doubt: Mutex<HashSet<outcomes::Attempt>>,
}

/// Where each message of an append went: (queue, queue offset), in order.
type Placements = Vec<(u32, u64)>;

/// A replicated op's place in the Raft log: its entry's index, and its position among that entry's
/// application payloads.
pub type OpAt = (u64, u32);

/// Whether `name` is a valid topic: a valid name, or `$dead` (where dead messages go).
pub fn valid_topic(name: &str) -> bool {
    crate::names::valid_name(name) || name == crate::scheduler::DEAD_TOPIC
}

/// The stores' names in metric labels: the main store, then dead letters.
pub const STORE_NAMES: [&str; 2] = ["main", "dead"];

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

impl Broker {
    pub fn open(data_dir: &Path, options: BrokerOptions) -> Result<Broker, BrokerError> {
        let dir = data_dir.join("broker");
        let (queues, segment_bytes) = (options.queues_per_topic, options.segment_bytes);
        let main = Store::open(&dir, queues, segment_bytes)?;
        let dead = Store::open(&dir.join("dead"), queues, segment_bytes)?;
        let awaiting = [
            (dir.clone(), main.awaiting.clone()),
            (dir.join("dead"), dead.awaiting.clone()),
        ];
        let dead_in_main = main.queue_offsets(crate::scheduler::DEAD_TOPIC).is_some();
        if dead_in_main {
            tracing::warn!("this data dir keeps dead letters in the main broker store (it was created before they had one of their own): broker.retention applies to them, not broker.dead_retention");
        }
        let broker = Broker {
            dead_in_main,
            offsets: Mutex::new(offsets::Offsets::open(&dir)?),
            options,
            main: StoreGroup::new(main),
            dead: StoreGroup::new(dead),
            arrivals: tokio::sync::Notify::new(),
            disk_full: Mutex::new(None),
            replicated: OnceLock::new(),
            placements: Mutex::new(HashMap::new()),
            round_robin: Mutex::new(HashMap::new()),
            next_nonce: AtomicU64::new(random_start()),
            awaiting,
            floor_writing: Mutex::new(()),
            in_doubt: Mutex::default(),
        };
        broker.report_sizes();
        for name in STORE_NAMES {
            // The series exists from the start (at 0), for rate() and alerts.
            metrics::counter!("delayd_broker_retired_bytes_total", "store" => name).increment(0);
        }
        metrics::counter!("delayd_broker_reconciled_total").increment(0);
        Ok(broker)
    }

    /// Whether `topic` lives in the dead letters' store.
    fn in_dead_store(&self, topic: &str) -> bool {
        topic == crate::scheduler::DEAD_TOPIC && !self.dead_in_main
    }

    /// The store `topic` lives in, with its queue of appends.
    fn group(&self, topic: &str) -> &StoreGroup {
        if self.in_dead_store(topic) {
            &self.dead
        } else {
            &self.main
        }
    }

    fn store(&self, topic: &str) -> MutexGuard<'_, Store> {
        self.group(topic).lock()
    }

    /// Remembers whether a delivery failed for want of space (for [`Broker::disk_full`]).
    fn note<T>(&self, result: &Result<T, BrokerError>) {
        let full = match result {
            Err(e) if e.is_disk_full() => Some((e.to_string(), std::time::Instant::now())),
            Err(_) => return,
            Ok(_) => None,
        };
        *lock(&self.disk_full) = full;
    }

    /// Why deliveries fail for want of disk space, if the last one did (and tried within 5 s).
    pub fn disk_full(&self) -> Option<String> {
        lock(&self.disk_full)
            .as_ref()
            .filter(|(_, at)| at.elapsed() < Duration::from_secs(5))
            .map(|(cause, _)| cause.clone())
    }

    /// Why a store refuses writes until a restart, if one does.
    pub fn failed(&self) -> Option<String> {
        [&self.main, &self.dead]
            .iter()
            .find_map(|store| store.lock().failed.clone())
    }

    /// Makes this broker a cluster member's (module doc): from now on [`Broker::append`] and
    /// [`Broker::commit_offset`] propose ops through `log` (opened replicated) and return once this
    /// member applied them. Called once, at start, before any write; a second call changes nothing.
    pub fn replicate_through(&self, log: &Arc<ScheduleLog>) {
        let _ = self.replicated.set(Arc::downgrade(log));
        // A member's append ops carry their outcomes: nothing awaits, nothing is reconciled.
        for (_, awaiting) in &self.awaiting {
            let mut awaiting = lock(awaiting);
            let held: Vec<_> = awaiting.held.keys().copied().collect();
            awaiting.recorded(held);
        }
    }

    /// The deliveries' outcomes are durable (`Sink::outcomes_recorded`): they await nothing more.
    pub fn outcomes_recorded(&self, deliveries: &[&Delivery]) {
        for (i, (_, awaiting)) in self.awaiting.iter().enumerate() {
            let in_store = |d: &&&Delivery| self.in_dead_store(&d.message.topic) == (i == 1);
            let mut attempts = deliveries.iter().filter(in_store).peekable();
            if attempts.peek().is_some() {
                lock(awaiting).recorded(attempts.map(|d| (d.location, d.message.attempt)));
            }
        }
        let mut in_doubt = lock(&self.in_doubt);
        if !in_doubt.is_empty() {
            for d in deliveries {
                in_doubt.remove(&(d.location, d.message.attempt));
            }
        }
    }

    /// Which of `deliveries` the broker holds already, awaiting only their outcome (outcomes.rs):
    /// stored by this process or held since a start that could not settle them (an answer lost to
    /// a panic, say, or a batch that failed in the other store), or, on a cluster member, in doubt
    /// after a failed append and found with their outcome since. The sink answers them delivered without
    /// storing them again. Blocking (a member's lookups read the dispatch logs).
    pub fn stored_already(&self, deliveries: &[Delivery]) -> Vec<bool> {
        let mut stored = vec![false; deliveries.len()];
        for (i, (_, awaiting)) in self.awaiting.iter().enumerate() {
            let awaiting = lock(awaiting);
            for (d, stored) in deliveries.iter().zip(stored.iter_mut()) {
                if self.in_dead_store(&d.message.topic) == (i == 1) {
                    *stored |= awaiting.holds(&(d.location, d.message.attempt));
                }
            }
        }
        let in_doubt: Vec<usize> = {
            let in_doubt = lock(&self.in_doubt);
            (deliveries.iter().enumerate())
                .filter(|(_, d)| in_doubt.contains(&(d.location, d.message.attempt)))
                .map(|(i, _)| i)
                .collect()
        };
        if let (false, Some(Ok(log))) = (in_doubt.is_empty(), self.replicated()) {
            for i in in_doubt {
                let (at, attempt) = (deliveries[i].location, deliveries[i].message.attempt);
                let found = log.outcomes_of(at);
                stored[i] |= matches!(found, Ok(Some(o)) if o.iter().any(|o| o.attempt == attempt));
                lock(&self.in_doubt).remove(&(at, attempt));
            }
        }
        stored
    }

    /// A cluster member's append of `deliveries` failed: some of its ops may be committed (their
    /// outcomes with them), so [`Broker::stored_already`] looks them up when they come again.
    pub fn note_in_doubt(&self, deliveries: &[Delivery]) {
        if self.replicated.get().is_some() {
            let mut in_doubt = lock(&self.in_doubt);
            in_doubt.extend(deliveries.iter().map(|d| (d.location, d.message.attempt)));
        }
    }

    /// Records the outcome of every delivery recovery found stored whose attempt has none (a crash
    /// came between the two), so that it is not delivered, and stored, again; returns how many.
    /// Called before any message is handed to a sink (outcomes.rs). What it cannot settle (a lookup
    /// or the write failing after a few tries) stays held, for the sink to answer as stored.
    /// Blocking.
    pub fn reconcile(&self, log: &ScheduleLog) -> usize {
        let started = std::time::Instant::now();
        let (mut held_count, mut recorded, mut recording) = (0, 0, Duration::ZERO);
        for (_, awaiting) in &self.awaiting {
            let (held, marks) = {
                let awaiting = lock(awaiting);
                let held: Vec<outcomes::Held> = awaiting.held.values().cloned().collect();
                // The held deliveries are at or past the floor.
                (held, awaiting.marks_at(awaiting.floor()))
            };
            if held.is_empty() {
                continue;
            }
            held_count += held.len();
            let (missing, settled) = outcomes::to_reconcile(log, &marks, &held);
            let mut pause = Duration::from_millis(100);
            let recording_started = std::time::Instant::now();
            let written = missing.is_empty()
                || loop {
                    match log.record_outcomes(&missing) {
                        Ok(()) => break true,
                        Err(error)
                            if pause >= Duration::from_secs(2) || log.poisoned().is_some() =>
                        {
                            tracing::error!(%error, held = missing.len(), "recording the outcomes of deliveries the broker holds failed: the broker sink answers them as stored when they come due");
                            break false;
                        }
                        Err(error) => {
                            tracing::warn!(%error, "recording the outcomes of deliveries the broker holds failed; trying again");
                            std::thread::sleep(pause);
                            pause *= 2;
                        }
                    }
                };
            recording += recording_started.elapsed();
            let missing: HashSet<outcomes::Attempt> =
                missing.iter().map(outcomes::attempt_of).collect();
            if written {
                recorded += missing.len();
            }
            let done = (settled.into_iter()).filter(|a| written || !missing.contains(a));
            lock(awaiting).recorded(done);
        }
        if held_count > 0 {
            let elapsed_ms = started.elapsed().as_millis() as u64;
            let recording_ms = recording.as_millis() as u64;
            tracing::info!(looked_up = held_count, recorded, elapsed_ms, recording_ms, "deliveries the broker stored since its floor were looked up; those a crash left without an outcome got it, and are not stored again");
        }
        metrics::counter!("delayd_broker_reconciled_total").increment(recorded as u64);
        recorded
    }

    /// Takes `log`'s dispatch marks and stores each store's floor, with its marks, when it moved
    /// (outcomes.rs): called once a second on a single node, and at a stop.
    pub fn store_floors(&self, log: &ScheduleLog) -> Result<(), BrokerError> {
        if self.replicated.get().is_some() {
            return Ok(());
        }
        // One writer at a time: the file is replaced through one temporary path.
        let _writing = lock(&self.floor_writing);
        // Taken before each store's end is read (in `marked`).
        let marks: outcomes::Marks = log.dispatch_marks().into();
        for (dir, awaiting) in &self.awaiting {
            let settled = {
                let mut awaiting = lock(awaiting);
                awaiting.marked(marks.clone());
                awaiting.to_store()
            };
            let Some(settled) = settled else {
                continue;
            };
            outcomes::write_settled(dir, &settled)?;
            lock(awaiting).stored(settled.floor);
        }
        Ok(())
    }

    /// A cluster member's log: `None` on a single node, `Err` once the log is closed.
    fn replicated(&self) -> Option<Result<Arc<ScheduleLog>, BrokerError>> {
        let log = self.replicated.get()?;
        Some(
            log.upgrade()
                .ok_or(BrokerError::Replication(schedulelog::AppendError::Closed)),
        )
    }

    /// Stores messages durably (commit log synced, then units written), wakes long polls, and returns
    /// each message's queue and queue offset, in order. Messages that other threads append to the same
    /// store meanwhile are stored with them, in one write and one sync; a failure of that write fails
    /// them all, but a topic that cannot be created fails only the callers with messages for it.
    ///
    /// On a cluster member: proposed as append ops (more than one when the messages do not fit one
    /// Raft entry), and answered once this member applied them. A failed op fails the call
    /// ([`BrokerError::Replication`] when Raft did not take it), though the ops before it in the same
    /// call are stored: a retry stores those messages again (consumers dedup by `delayd-id`).
    pub fn append(&self, messages: Vec<Incoming>) -> Result<Vec<(u32, u64)>, BrokerError> {
        if let Some(log) = self.replicated() {
            // Its apply notes a full disk and wakes long polls.
            return self.propose_append(&*log?, messages);
        }
        let result = self.append_to_stores(messages);
        self.note(&result);
        if result.is_ok() {
            self.arrivals.notify_waiters();
        }
        result
    }

    fn append_to_stores(&self, messages: Vec<Incoming>) -> Result<Vec<(u32, u64)>, BrokerError> {
        let mut placed = vec![(0, 0); messages.len()];
        let (dead, main): (Vec<_>, Vec<_>) = messages
            .into_iter()
            .enumerate()
            .partition(|(_, m)| self.in_dead_store(&m.topic));
        for (store, part) in [(&self.main, main), (&self.dead, dead)] {
            if part.is_empty() {
                continue;
            }
            let (indices, part): (Vec<usize>, Vec<Incoming>) = part.into_iter().unzip();
            let stored = store.run(part, append_together)?;
            for (i, at) in indices.into_iter().zip(stored) {
                placed[i] = at;
            }
        }
        Ok(placed)
    }

    /// Chooses queues for `messages`, encodes them as append ops within an entry's bytes each, and
    /// proposes them one after the other.
    fn propose_append(
        &self,
        log: &ScheduleLog,
        messages: Vec<Incoming>,
    ) -> Result<Vec<(u32, u64)>, BrokerError> {
        let mut placed = Vec::with_capacity(messages.len());
        let mut chunk: Vec<Vec<u8>> = Vec::new();
        let mut chunk_outcomes = Vec::new();
        let mut chunk_bytes = op::APPEND_HEAD_LEN;
        for message in messages {
            // The deliveries' outcomes go in the op's entry (outcomes.rs): one entry, one fact.
            let outcomes: Vec<_> = outcomes::outcome_of(&message).into_iter().collect();
            let chosen = self.choose_queue(&message);
            let bytes = op::message_bytes(&OpMessage { chosen, message });
            let more = bytes.len() + schedulelog::outcomes_bytes(&outcomes);
            if !chunk.is_empty() && chunk_bytes + more > schedulelog::MAX_APP_PAYLOAD_BYTES {
                let (messages, outcomes) = (
                    std::mem::take(&mut chunk),
                    std::mem::take(&mut chunk_outcomes),
                );
                placed.extend(self.propose_chunk(log, messages, outcomes)?);
                chunk_bytes = op::APPEND_HEAD_LEN;
            }
            chunk_bytes += more;
            chunk.push(bytes);
            chunk_outcomes.extend(outcomes);
        }
        if !chunk.is_empty() {
            placed.extend(self.propose_chunk(log, chunk, chunk_outcomes)?);
        }
        Ok(placed)
    }

    /// The queue a message goes to, as a single node's store would choose it: by its key's hash, else
    /// round robin; and its topic's queue count (this member's, or the configured count for a topic it
    /// does not have yet).
    fn choose_queue(&self, message: &Incoming) -> Chosen {
        let topic = &message.topic;
        let queues = self
            .store(topic)
            .queue_count(topic)
            .unwrap_or(self.options.queues_per_topic)
            .max(1);
        let queue = match &message.key {
            Some(key) => crc32c::crc32c(key.as_bytes()) % queues,
            None => {
                let mut round_robin = lock(&self.round_robin);
                let next = round_robin.entry(topic.clone()).or_default();
                *next = next.wrapping_add(1);
                *next % queues
            }
        };
        Chosen { queue, queues }
    }

    /// Proposes one append op of `messages` (encoded), with their deliveries' `outcomes` in its entry,
    /// and returns where this member's apply put them.
    fn propose_chunk(
        &self,
        log: &ScheduleLog,
        messages: Vec<Vec<u8>>,
        outcomes: Vec<(schedulelog::Bucket, schedulelog::Outcome)>,
    ) -> Result<Vec<(u32, u64)>, BrokerError> {
        let count = messages.len();
        let nonce = self.next_nonce.fetch_add(1, Ordering::Relaxed);
        lock(&self.placements).insert(nonce, None);
        let proposed = log.propose_app_with(op::encode_append(nonce, &messages), outcomes);
        let placed = lock(&self.placements).remove(&nonce).flatten();
        proposed.map_err(BrokerError::Replication)?;
        match placed {
            Some(placed) if placed.len() == count => Ok(placed),
            // Its apply here found it stored already: only an op applied again after a restart is.
            _ => Err(BrokerError::Failed(format!(
                "this member applied its own append op {nonce} without storing it"
            ))),
        }
    }

    /// Applies a replicated op (op.rs) to this member's files; `at` is its place in the Raft log.
    /// Every member applies every op, in log order (the cluster's state machine calls this before it
    /// files the op's entry); an op applied again (after a restart: entries after the schedule's
    /// checkpoint are) changes nothing: each store knows the last op it stored, and an offset commit
    /// sets what it set before. An error stops this member's Raft (a storage error): an op that does
    /// not decode, messages for a queue their topic does not have, a commit for a queue or offset
    /// this member does not have (its files no longer match the leader's), or a failed write (a full
    /// disk included: the member is restarted once space is freed, and applies the op again).
    pub fn apply_op(&self, at: OpAt, bytes: &[u8]) -> Result<(), BrokerError> {
        let corrupt = |reason: String| BrokerError::Corrupt {
            path: PathBuf::from(format!("broker op {} of Raft entry {}", at.1, at.0)),
            offset: 0,
            reason,
        };
        match BrokerOp::decode(bytes).map_err(corrupt)? {
            BrokerOp::Append { nonce, messages } => {
                let result = self.apply_append(at, messages);
                self.note(&result);
                let placed = result?;
                if let Some(waiting) = lock(&self.placements).get_mut(&nonce) {
                    *waiting = placed;
                }
                self.arrivals.notify_waiters();
                Ok(())
            }
            BrokerOp::CommitOffset {
                group,
                topic,
                queue,
                offset,
            } => {
                self.check_commit(&topic, queue, offset).map_err(corrupt)?;
                // No bound on groups here: the leader checked it, and members' settings may differ.
                match lock(&self.offsets).commit(&group, &topic, queue, offset, usize::MAX) {
                    Ok(()) => Ok(()),
                    Err(CommitError::Broker(e)) => Err(e),
                    Err(other) => Err(BrokerError::Failed(other.to_string())),
                }
            }
        }
    }

    /// Stores an append op's messages, in the queues it names, each store's part once: where they
    /// went, or `None` when a part was stored before (an op applied again).
    fn apply_append(
        &self,
        at: OpAt,
        messages: Vec<OpMessage>,
    ) -> Result<Option<Vec<(u32, u64)>>, BrokerError> {
        let mut placed = vec![(0, 0); messages.len()];
        let mut complete = true;
        let (dead, main): (Vec<_>, Vec<_>) = messages
            .into_iter()
            .enumerate()
            .partition(|(_, m)| self.in_dead_store(&m.message.topic));
        for (group, part) in [(&self.main, main), (&self.dead, dead)] {
            if part.is_empty() {
                continue;
            }
            let mut store = group.lock();
            // Stored before (an op applied again after a restart): all of it, or the first records
            // of it that a crash between two of its writes left (store.rs, `applied_present`).
            let stored = match (store.applied, store.applied_present) {
                (Some(applied), _) if applied > at => part.len(),
                (Some(applied), Some(present)) if applied == at => present as usize,
                (Some(applied), None) if applied == at => part.len(),
                _ => 0,
            };
            if stored > 0 {
                complete = false;
            }
            let part = &part[stored.min(part.len())..];
            if part.is_empty() {
                continue;
            }
            // Stamped as a single node's group commit stamps a batch: the latest delivery in it.
            let stored_at_ms = part
                .iter()
                .map(|(_, m)| m.message.delivered_at_ms)
                .max()
                .unwrap_or(0);
            let chosen: Vec<_> = part.iter().map(|(_, m)| (&m.message, m.chosen)).collect();
            let stored = store.append_chosen(&chosen, stored_at_ms, at)?;
            for ((i, _), at) in part.iter().zip(stored) {
                placed[*i] = at;
            }
        }
        Ok(complete.then_some(placed))
    }

    /// That a commit names a queue this member has, at an offset not past its end.
    fn check_commit(&self, topic: &str, queue: u32, offset: u64) -> Result<(), String> {
        let queues = self
            .queue_offsets(topic)
            .ok_or_else(|| format!("no topic {topic:?}"))?;
        let Some(&(_, end)) = queues.get(queue as usize) else {
            return Err(format!("topic {topic:?} has {} queues", queues.len()));
        };
        if offset > end {
            return Err(format!(
                "offset {offset} is past the end of queue {queue} of {topic:?} ({end})"
            ));
        }
        Ok(())
    }

    /// Topics and their queue counts.
    pub fn topics(&self) -> Vec<(String, u32)> {
        let mut topics: Vec<(String, u32)> = [&self.main, &self.dead]
            .iter()
            .flat_map(|store| {
                store
                    .lock()
                    .topics()
                    .map(|(n, q)| (n.clone(), q))
                    .collect::<Vec<_>>()
            })
            .collect();
        topics.sort();
        topics.dedup_by(|a, b| a.0 == b.0);
        topics
    }

    /// `(min_offset, max_offset)` of every queue of a topic; `None` for an unknown topic.
    pub fn queue_offsets(&self, topic: &str) -> Option<Vec<(u64, u64)>> {
        self.store(topic).queue_offsets(topic)
    }

    /// [`Broker::queue_offsets`] without waiting: [`StoreBusy`] while the topic's store is locked (an
    /// append holds it through its commit-log sync), for async callers, which then ask on the blocking
    /// pool instead.
    pub fn queue_offsets_now(&self, topic: &str) -> Result<Option<Vec<(u64, u64)>>, StoreBusy> {
        let store = self.group(topic).try_lock().ok_or(StoreBusy)?;
        Ok(store.queue_offsets(topic))
    }

    /// Up to `max` messages of a queue from `offset` (from `min_offset` when `offset` is below it), and
    /// no more than `max_pull_bytes` of them unless the first alone is larger.
    /// `None` for an unknown topic or queue. The records are read after the store's lock is released.
    pub fn read(
        &self,
        topic: &str,
        queue: u32,
        offset: u64,
        max: usize,
    ) -> Result<Option<Pulled>, BrokerError> {
        let (plan, log_dir) = {
            let store = self.store(topic);
            let plan = store.plan_read(topic, queue, offset, max, self.options.max_pull_bytes)?;
            (plan, store.log_dir())
        };
        let Some(plan) = plan else {
            return Ok(None);
        };
        let mut messages = Vec::with_capacity(plan.records.len());
        for (at, file, pos, len) in plan.records {
            let mut bytes = vec![0u8; len as usize];
            file.read_exact_at(&mut bytes, pos)
                .map_err(io_err(&log_dir))?;
            let Some((meta, body)) = decode_record(&bytes) else {
                return Err(BrokerError::Corrupt {
                    path: log_dir,
                    offset: pos,
                    reason: format!("queue offset {at} points at an undecodable record"),
                });
            };
            messages.push(Stored {
                offset: at,
                meta,
                body: body.to_vec(),
            });
        }
        Ok(Some(Pulled {
            from: plan.from,
            messages,
        }))
    }

    /// A future that completes at the next append after it was created (enable it before checking).
    pub fn arrivals(&self) -> tokio::sync::futures::Notified<'_> {
        self.arrivals.notified()
    }

    /// Long poll: messages from `offset`, waiting up to `wait` for the first one to arrive.
    pub async fn pull(
        self: &Arc<Self>,
        topic: &str,
        queue: u32,
        offset: u64,
        max: usize,
        wait: Duration,
    ) -> Result<Option<Pulled>, BrokerError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.arrivals();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let this = self.clone();
            let (t, o) = (topic.to_string(), offset);
            let read = tokio::task::spawn_blocking(move || this.read(&t, queue, o, max))
                .await
                .map_err(|e| BrokerError::Io {
                    path: PathBuf::from("broker"),
                    source: io::Error::other(e.to_string()),
                })??;
            match read {
                Some(pulled)
                    if pulled.messages.is_empty() && tokio::time::Instant::now() < deadline =>
                {
                    if tokio::time::timeout_at(deadline, notified).await.is_err() {
                        return Ok(Some(pulled));
                    }
                }
                other => return Ok(other),
            }
        }
    }

    /// Stores a consumer group's offset for one queue (durably). The caller has checked that the queue
    /// exists and the offset is not past its end; at most `max_groups` groups.
    ///
    /// On a cluster member: those checks are made again here, then the commit is proposed as an op
    /// and answered once this member applied it ([`BrokerError::Replication`] when Raft did not take
    /// it).
    pub fn commit_offset(
        &self,
        group: &str,
        topic: &str,
        queue: u32,
        offset: u64,
        max_groups: usize,
    ) -> Result<(), CommitError> {
        let Some(log) = self.replicated() else {
            // Not noted as a full disk: the consumer got its 507, and no later delivery would clear it.
            return lock(&self.offsets).commit(group, topic, queue, offset, max_groups);
        };
        let log = log?;
        self.check_commit(topic, queue, offset)
            .map_err(CommitError::Invalid)?;
        if !lock(&self.offsets).admits(group, max_groups) {
            return Err(CommitError::TooManyGroups { max: max_groups });
        }
        let op = BrokerOp::CommitOffset {
            group: group.to_string(),
            topic: topic.to_string(),
            queue,
            offset,
        };
        log.propose_app(op.encode())
            .map_err(|e| CommitError::Broker(BrokerError::Replication(e)))
    }

    /// A group's committed offsets for a topic, by queue.
    pub fn group_offsets(&self, group: &str, topic: &str) -> BTreeMap<u32, u64> {
        lock(&self.offsets).of(group, topic)
    }

    /// Deletes the segments whose messages are past their retention, then the oldest ones while the
    /// stores hold more than `max_bytes`, with the consume-queue files that pointed only into them.
    /// Runs `f` while nothing changes the broker's files but its background checkpoint jobs (which
    /// replace a checkpoint atomically, never before the data it speaks of is synced): both stores
    /// and the group offsets are held. For linking the files into a snapshot.
    pub fn quiesced<T>(&self, f: impl FnOnce() -> T) -> T {
        let _main = self.main.lock();
        let _dead = self.dead.lock();
        let _offsets = lock(&self.offsets);
        f()
    }

    pub fn enforce_retention(&self, now_ms: i64) -> Result<Retired, BrokerError> {
        let retention = [
            millis(self.options.retention),
            millis(self.options.dead_retention),
        ];
        let mut main = self.main.lock();
        let mut dead = self.dead.lock();
        let stores: [&mut Store; 2] = [&mut main, &mut dead];
        let mut taken: [Vec<commitlog::Segment>; 2] = [Vec::new(), Vec::new()];
        loop {
            let oldest = [
                stores[0].log.oldest_sealed_ms(),
                stores[1].log.oldest_sealed_ms(),
            ];
            let expired = (0..2).find(|&i| {
                oldest[i].is_some_and(|newest| newest.saturating_add(retention[i]) <= now_ms)
            });
            let bytes = stores[0].log.bytes() + stores[1].log.bytes();
            let over_cap = self.options.max_bytes.is_some_and(|max| bytes > max);
            let oldest_first = match oldest {
                [Some(a), Some(b)] => Some(if b < a { 1 } else { 0 }),
                [Some(_), None] => Some(0),
                [None, Some(_)] => Some(1),
                [None, None] => None,
            };
            let Some(i) = expired.or(oldest_first.filter(|_| over_cap)) else {
                break;
            };
            match stores[i].take_oldest() {
                Some(segment) => taken[i].push(segment),
                None => break,
            }
        }
        let mut retired = Retired::default();
        let mut doomed: [(PathBuf, Vec<PathBuf>); 2] = Default::default();
        let mut moved = Vec::new();
        for (i, store) in stores.into_iter().enumerate() {
            if taken[i].is_empty() && !store.queues_behind {
                continue;
            }
            let (queues, files) = store.retire_queues();
            moved.extend(queues);
            doomed[i] = (store.log_dir(), files);
        }
        drop(main);
        drop(dead);
        // Outside the stores' locks: the offsets' lock is held across a commit's fsync.
        retired.unread = self.unread(&moved);
        let mut failed = None;
        for (i, name) in STORE_NAMES.iter().enumerate() {
            // Taken out of the logs already: deleted whatever else fails (a segment file that stays is
            // the oldest of its log at the next open, and retention takes it again).
            let removed = commitlog::remove(&doomed[i].0, &taken[i])
                .and_then(|()| store::remove_files(&doomed[i].1));
            if let Err(e) = removed {
                failed.get_or_insert(e);
            }
            let bytes: u64 = taken[i].iter().map(|s| s.len).sum();
            retired.segments += taken[i].len();
            retired.bytes += bytes;
            metrics::counter!("delayd_broker_retired_bytes_total", "store" => *name)
                .increment(bytes);
        }
        // Counted once the files are gone (the retention test relies on it).
        metrics::counter!("delayd_broker_unread_retired_total").increment(retired.unread);
        self.report_sizes();
        match failed {
            Some(e) => Err(e),
            None => Ok(retired),
        }
    }

    /// Messages in the ranges retention moved queues past that a consumer group had not read yet.
    fn unread(&self, moved: &[store::Moved]) -> u64 {
        let offsets = lock(&self.offsets);
        let mut unread = 0;
        for (topic, queue, from, to) in moved {
            for at in offsets.on_queue(topic, *queue) {
                unread += to.saturating_sub(at.max(*from));
            }
        }
        unread
    }

    fn report_sizes(&self) {
        for (store, name) in [&self.main, &self.dead].into_iter().zip(STORE_NAMES) {
            let bytes = store.lock().log.bytes();
            metrics::gauge!("delayd_broker_bytes", "store" => name).set(bytes as f64);
        }
    }
}

/// A random start for append op nonces (the clock's nanoseconds should the OS have no randomness).
fn random_start() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    })
}

#[cfg(test)]
mod tests;
