//! The built-in broker: where the `broker` sink delivers, and what consumers pull from over HTTP.
//!
//! RocketMQ-style: a commit log of all topics in segment files, a consume queue of fixed 20-byte units
//! per (topic, queue), consumer group offsets, long polling woken by arrivals, and retention that deletes
//! whole segments once their messages are old enough (or the store is over its size cap).
//!
//! ```text
//! broker/commitlog/, consumequeue/, checkpoint   the main store (store.rs): every topic but `$dead`
//! broker/dead/commitlog/, consumequeue/, checkpoint   dead letters (`$dead`), a store of their own so
//!                                         that they can be kept longer than the messages around them
//! broker/groups/{group}                  a consumer group's offsets (offsets.rs)
//! ```
//!
//! A record's format: record.rs.
//!
//! Invariants:
//! - A delivery is acknowledged only once its record is synced (store.rs has the details and recovery).
//! - Retention runs beside appends and pulls, holding the stores' locks only to take segments out of the
//!   logs; files are deleted after the locks are released (a pull that already holds one keeps reading
//!   it). A segment goes when its newest message was stored more than `retention` ago (`dead_retention`
//!   for `$dead`), or, oldest first across both stores, while they hold more than `max_bytes`. The
//!   segment taking appends is never deleted.
//! - A pull below a queue's `min_offset` is answered from `min_offset`; the answer says where it started.
//!   Messages retention deletes before a consumer group with a committed offset on their queue read them
//!   are counted (`delayd_broker_unread_retired_total`).
//! - Topic names match `[A-Za-z0-9._-]{1,200}` and are not all dots (or are `$dead`), so no name reaches
//!   outside the data dir.

mod append;
mod commitlog;
mod config;
mod error;
mod inspect;
mod offsets;
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

use append::{append_together, StoreGroup};
use error::io_err;
use record::decode_record;
use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use store::Store;

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
}

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
        };
        broker.report_sizes();
        for name in STORE_NAMES {
            // The series exists from the start (at 0), for rate() and alerts.
            metrics::counter!("delayd_broker_retired_bytes_total", "store" => name).increment(0);
        }
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

    /// Stores messages durably (commit log synced, then units written), wakes long polls, and returns
    /// each message's queue and queue offset, in order. Messages that other threads append to the same
    /// store meanwhile are stored with them, in one write and one sync; a failure of that write fails
    /// them all, but a topic that cannot be created fails only the callers with messages for it.
    pub fn append(&self, messages: Vec<Incoming>) -> Result<Vec<(u32, u64)>, BrokerError> {
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
    pub fn commit_offset(
        &self,
        group: &str,
        topic: &str,
        queue: u32,
        offset: u64,
        max_groups: usize,
    ) -> Result<(), CommitError> {
        // Not noted as a full disk: the consumer got its 507, and no later delivery would clear it.
        lock(&self.offsets).commit(group, topic, queue, offset, max_groups)
    }

    /// A group's committed offsets for a topic, by queue.
    pub fn group_offsets(&self, group: &str, topic: &str) -> BTreeMap<u32, u64> {
        lock(&self.offsets).of(group, topic)
    }

    /// Deletes the segments whose messages are past their retention, then the oldest ones while the
    /// stores hold more than `max_bytes`, with the consume-queue files that pointed only into them.
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

#[cfg(test)]
mod tests;
