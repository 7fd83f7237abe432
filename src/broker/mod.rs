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
//! A record in a commit log is a frame of kind 5 whose payload is:
//!
//! ```text
//! 0   4   meta_len u32 LE
//! 4   ..  meta: JSON {"topic","queue","queue_offset","id","key"?,"headers","deliver_at_ms",
//!                     "delivered_at_ms","attempt"}
//! ..  ..  body bytes
//! ```
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

mod commitlog;
mod offsets;
mod queue;
mod store;

pub use offsets::CommitError;

use crate::sink::{BoxFuture, Delivery, Sink, SinkOutcome};
use schedulelog::frame::{self, Kind};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use store::Store;

/// A broker failure; the HTTP edge maps it to 500 (or 507 for a full disk).
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("broker I/O on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("broker data corrupt in {path} at offset {offset}: {reason}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    /// The store refuses writes until a restart (see `Store::failed`).
    #[error("the broker store refuses writes until delayd is restarted: {0}")]
    Failed(String),
}

impl BrokerError {
    /// Whether the failure was for want of disk space (nothing was stored; a later try may succeed).
    pub fn is_disk_full(&self) -> bool {
        matches!(self, BrokerError::Io { source, .. }
            if matches!(source.kind(), io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded))
    }

    /// The same error again, for each caller of a group commit that failed. An OS error keeps its code,
    /// so [`BrokerError::is_disk_full`] answers alike for the copy.
    fn duplicate(&self) -> BrokerError {
        match self {
            BrokerError::Io { path, source } => BrokerError::Io {
                path: path.clone(),
                source: match source.raw_os_error() {
                    Some(code) => io::Error::from_raw_os_error(code),
                    None => io::Error::new(source.kind(), source.to_string()),
                },
            },
            BrokerError::Corrupt {
                path,
                offset,
                reason,
            } => BrokerError::Corrupt {
                path: path.clone(),
                offset: *offset,
                reason: reason.clone(),
            },
            BrokerError::Failed(cause) => BrokerError::Failed(cause.clone()),
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> BrokerError + '_ {
    move |source| BrokerError::Io {
        path: path.to_path_buf(),
        source,
    }
}

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

/// The part of a stored message that is not the body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoredMeta {
    pub topic: String,
    pub queue: u32,
    pub queue_offset: u64,
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub deliver_at_ms: i64,
    pub delivered_at_ms: i64,
    pub attempt: u16,
}

/// A message as a consumer gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub offset: u64,
    pub meta: StoredMeta,
    pub body: Vec<u8>,
}

/// What a pull got: the queue offset it read from (the one asked for, or the queue's `min_offset` when
/// retention deleted the messages before it) and the messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    pub from: u64,
    pub messages: Vec<Stored>,
}

/// A message to store.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub topic: String,
    pub id: String,
    pub key: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub deliver_at_ms: i64,
    pub delivered_at_ms: i64,
    pub attempt: u16,
    pub body: Vec<u8>,
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
    crate::format::valid_name(name) || name == crate::scheduler::DEAD_TOPIC
}

/// The stores' names in metric labels: the main store, then dead letters.
pub const STORE_NAMES: [&str; 2] = ["main", "dead"];

/// Where each of a caller's messages went (queue, queue offset), or why none did.
type Placed = Result<Vec<(u32, u64)>, BrokerError>;

/// A store and its queue of appends: each caller's messages, and where they went.
type StoreGroup = schedulelog::Group<Store, Vec<Incoming>, Placed>;

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

fn encode_record(buf: &mut Vec<u8>, meta: &StoredMeta, body: &[u8]) {
    let at = frame::start(buf);
    let meta_json = serde_json::to_vec(meta).unwrap_or_default();
    buf.extend_from_slice(&(meta_json.len() as u32).to_le_bytes());
    buf.extend_from_slice(&meta_json);
    buf.extend_from_slice(body);
    frame::finish(buf, at, Kind::Broker);
}

/// (meta, body) of a whole record frame.
fn decode_record(bytes: &[u8]) -> Option<(StoredMeta, &[u8])> {
    match frame::decode(bytes) {
        frame::Next::Frame {
            kind: Kind::Broker,
            payload,
        } if frame::HEADER_LEN + payload.len() == bytes.len() => decode_payload(payload),
        _ => None,
    }
}

/// (meta, body) of a record's payload.
fn decode_payload(payload: &[u8]) -> Option<(StoredMeta, &[u8])> {
    let meta_len = u32::from_le_bytes(payload.get(..4)?.try_into().ok()?) as usize;
    let meta: StoredMeta = serde_json::from_slice(payload.get(4..4 + meta_len)?).ok()?;
    Some((meta, payload.get(4 + meta_len..)?))
}

/// The temporary file `write_atomically` writes `path` through: its name ends in `~`, which no topic or
/// group name may contain, so it never is another file's name (`a.z` and `a` would both write through
/// `a.tmp`, the file of a group named `a.tmp`) nor taken for a group's file after a crash.
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(TEMP_SUFFIX);
    path.with_file_name(name)
}

/// Ends the name of every temporary file of an atomic replacement.
const TEMP_SUFFIX: &str = ".tmp~";

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), BrokerError> {
    let tmp = temp_path(path);
    let written = fs::write(&tmp, bytes)
        .and_then(|()| File::open(&tmp)?.sync_all())
        .and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(path)(e));
    }
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Creates `dir` and any missing parents, each made durable by an fsync of the directory holding it
/// (a crash must not lose a directory that files were then written into).
fn make_dir(dir: &Path) -> Result<(), BrokerError> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(parent) = parent {
        make_dir(parent)?;
    }
    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(io_err(dir)(e)),
    }
    sync_dir(parent.unwrap_or(Path::new(".")))
}

fn sync_dir(dir: &Path) -> Result<(), BrokerError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// One store append for the messages of every caller in a group: stored in the order they queued, each
/// caller gets where its own went. A caller whose topic cannot be created (its files cannot be made)
/// fails alone, before anything is written; any later failure (the commit log, a consume queue, a full
/// disk) undoes the append as a whole and fails every caller in it alike.
fn append_together(store: &mut Store, works: Vec<Vec<Incoming>>) -> Vec<Placed> {
    let mut results: Vec<Option<Placed>> = works
        .iter()
        .map(|w| {
            let created = w.iter().try_for_each(|m| store.ensure_topic(&m.topic));
            created.err().map(Err)
        })
        .collect();
    let ready: Vec<usize> = (0..works.len()).filter(|&i| results[i].is_none()).collect();
    let all: Vec<&Incoming> = ready.iter().flat_map(|&i| &works[i]).collect();
    if !all.is_empty() {
        match append_to(store, &all) {
            Ok(placed) => {
                let mut placed = placed.into_iter();
                for &i in &ready {
                    results[i] = Some(Ok(placed.by_ref().take(works[i].len()).collect()));
                }
            }
            Err(e) => {
                for &i in &ready {
                    results[i] = Some(Err(e.duplicate()));
                }
            }
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every caller answered"))
        .collect()
}

/// Appends messages to a store, stamped with the latest time any of them was delivered.
fn append_to(store: &mut Store, messages: &[&Incoming]) -> Placed {
    let stored_at_ms = messages
        .iter()
        .map(|m| m.delivered_at_ms)
        .max()
        .unwrap_or(0);
    store.append(messages, stored_at_ms)
}

/// The `broker` sink: stores each delivery in the broker, durably, before answering.
#[derive(Debug)]
pub struct BrokerSink {
    broker: Arc<Broker>,
    clock: Arc<dyn schedulelog::Clock>,
    /// When a failure was last logged: at most one line every 10 s while they go on.
    last_report: Mutex<Option<std::time::Instant>>,
}

impl BrokerSink {
    pub fn new(broker: Arc<Broker>, clock: Arc<dyn schedulelog::Clock>) -> BrokerSink {
        BrokerSink {
            broker,
            clock,
            last_report: Mutex::new(None),
        }
    }

    fn report(&self, reason: &str) {
        let mut last = lock(&self.last_report);
        if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
            *last = Some(std::time::Instant::now());
            tracing::error!(%reason, "storing deliveries in the broker failed; they are postponed (delayd_messages_postponed_total) and tried again");
        }
    }

    /// A batch as the broker stores it, stamped as delivered now.
    fn incoming(&self, batch: &[Delivery]) -> Vec<Incoming> {
        let now = self.clock.now_ms();
        batch
            .iter()
            .map(|d| Incoming {
                topic: d.message.topic.clone(),
                id: d.id.to_string(),
                key: d.message.key.clone(),
                headers: d.message.headers.iter().cloned().collect(),
                deliver_at_ms: d.message.deliver_at_ms,
                delivered_at_ms: now,
                attempt: d.message.attempt,
                body: d.message.body.clone(),
            })
            .collect()
    }

    /// The answer for each of `count` deliveries stored together (or not). Trouble with delayd's own
    /// storage is not the message's fault: postponed, using up no attempt (a retry would also copy the
    /// message through the WAL into a segment again, and a few minutes of trouble would make every due
    /// message dead).
    fn answer<T>(&self, count: usize, stored: Result<T, BrokerError>) -> Vec<SinkOutcome> {
        let (reason, disk_full) = match stored {
            Ok(_) => return vec![SinkOutcome::Delivered; count],
            Err(e) => (e.to_string(), e.is_disk_full()),
        };
        let after = if disk_full {
            // Reported once by the disk watch, not for every batch while it lasts.
            tracing::debug!(%reason, "storing deliveries in the broker failed");
            Duration::from_secs(1)
        } else {
            self.report(&reason);
            Duration::from_secs(5)
        };
        vec![SinkOutcome::Postpone { after, reason }; count]
    }
}

impl Sink for BrokerSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(async move {
            let (broker, incoming) = (self.broker.clone(), self.incoming(batch));
            let stored = tokio::task::spawn_blocking(move || broker.append(incoming))
                .await
                .unwrap_or_else(|e| {
                    Err(BrokerError::Io {
                        path: PathBuf::from("broker"),
                        source: io::Error::other(e.to_string()),
                    })
                });
            self.answer(batch.len(), stored)
        })
    }

    fn deliver_blocking(&self, batch: &[Delivery]) -> Option<Vec<SinkOutcome>> {
        Some(self.answer(batch.len(), self.broker.append(self.incoming(batch))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn incoming(topic: &str, key: Option<&str>, body: &str) -> Incoming {
        stored_at(topic, key, body, 2)
    }

    fn stored_at(topic: &str, key: Option<&str>, body: &str, at_ms: i64) -> Incoming {
        Incoming {
            topic: topic.into(),
            id: format!("id-{body}"),
            key: key.map(String::from),
            headers: BTreeMap::new(),
            deliver_at_ms: 1,
            delivered_at_ms: at_ms,
            attempt: 0,
            body: body.as_bytes().to_vec(),
        }
    }

    fn options(queues: u32) -> BrokerOptions {
        BrokerOptions {
            queues_per_topic: queues,
            ..BrokerOptions::default()
        }
    }

    /// Small segments, so that a few hundred messages make several.
    fn small(queues: u32) -> BrokerOptions {
        BrokerOptions {
            segment_bytes: 64 << 10,
            retention: Duration::from_secs(3600),
            ..options(queues)
        }
    }

    fn bodies(pulled: &Pulled) -> Vec<String> {
        pulled
            .messages
            .iter()
            .map(|m| String::from_utf8(m.body.clone()).unwrap())
            .collect()
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    const LOG_0: &str = "broker/commitlog/00000000000000000000";

    #[test]
    fn append_read_reopen_and_repair() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), options(2)).unwrap();
        let placed = broker
            .append(vec![
                incoming("t", Some("k"), "a"),
                incoming("t", Some("k"), "b"),
                incoming("u", None, "c"),
            ])
            .unwrap();
        assert_eq!(placed[0].0, placed[1].0, "same key, same queue");
        assert_eq!(placed[1].1, placed[0].1 + 1);
        let q = placed[0].0;
        let read = broker.read("t", q, 0, 10).unwrap().unwrap();
        assert_eq!(bodies(&read), ["a", "b"]);
        assert_eq!(read.messages[1].offset, 1);
        assert_eq!(broker.read("nope", 0, 0, 10).unwrap(), None);
        drop(broker);

        // Lose the last unit of queue q: reopening restores it from the commit log.
        let path = dir
            .path()
            .join(format!("broker/consumequeue/t/{q}/00000000000000000000"));
        let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(queue::UNIT_LEN).unwrap();
        fs::remove_file(dir.path().join("broker/checkpoint")).unwrap();
        // And append garbage to the commit log (a torn write).
        let log = dir.path().join(LOG_0);
        let lf = fs::OpenOptions::new().append(true).open(&log).unwrap();
        lf.write_all_at(&[7u8; 13], lf.metadata().unwrap().len())
            .unwrap();
        let broker = Broker::open(dir.path(), options(2)).unwrap();
        let read = broker.read("t", q, 0, 10).unwrap().unwrap();
        assert_eq!(read.messages.len(), 2);
        assert_eq!(
            broker.topics(),
            vec![("t".to_string(), 2), ("u".to_string(), 2)]
        );
        broker.append(vec![incoming("t", Some("k"), "d")]).unwrap();
        assert_eq!(bodies(&broker.read("t", q, 2, 10).unwrap().unwrap()), ["d"]);
    }

    #[test]
    fn units_written_after_the_checkpoint_are_rewritten_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), options(2)).unwrap();
        let names = ["a", "b", "c", "d", "e"];
        let placed = broker
            .append(names.map(|b| incoming("t", Some("k"), b)).to_vec())
            .unwrap();
        let q = placed[0].0;
        drop(broker);

        // Units are not synced per append; a crash may leave them zero, torn, or the file longer than
        // what was written.
        let path = dir
            .path()
            .join(format!("broker/consumequeue/t/{q}/00000000000000000000"));
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let unit = queue::UNIT_LEN;
        f.write_all_at(&[0; queue::UNIT_LEN as usize], unit)
            .unwrap();
        f.write_all_at(&[9; 8], 3 * unit).unwrap();
        f.write_all_at(&[0; 4], 3 * unit + 8).unwrap();
        f.set_len(7 * unit).unwrap();
        // And stale bytes that look like a unit (a copy of the first) past the last record's.
        let mut first = [0; queue::UNIT_LEN as usize];
        f.read_exact_at(&mut first, 0).unwrap();
        f.write_all_at(&first, 6 * unit).unwrap();

        let broker = Broker::open(dir.path(), options(2)).unwrap();
        let read = broker.read("t", q, 0, 10).unwrap().unwrap();
        assert_eq!(bodies(&read), names);
        assert_eq!(
            broker.append(vec![incoming("t", Some("k"), "f")]).unwrap()[0],
            (q, 5),
            "the units past the last record were cut"
        );
    }

    #[test]
    fn a_commit_log_torn_inside_its_header_is_started_afresh() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join(LOG_0);
        fs::create_dir_all(log.parent().unwrap()).unwrap();
        let mut torn = b"DLYDBRK\0".to_vec();
        torn.extend([0u8; 12]);
        fs::write(&log, &torn).unwrap();
        let broker = Broker::open(dir.path(), options(1)).unwrap();
        broker.append(vec![incoming("t", None, "after")]).unwrap();
        assert_eq!(
            bodies(&broker.read("t", 0, 0, 1).unwrap().unwrap()),
            ["after"]
        );
    }

    #[test]
    fn offsets_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), options(1)).unwrap();
        broker.commit_offset("g", "t", 0, 13, 10).unwrap();
        drop(broker);
        let broker = Broker::open(dir.path(), options(1)).unwrap();
        assert_eq!(broker.group_offsets("g", "t"), BTreeMap::from([(0, 13)]));
        assert!(broker.group_offsets("other", "t").is_empty());
    }

    /// 600 messages of 1 KiB in batches of 50, stored an hour apart per batch from `t0`.
    fn fill(broker: &Broker, t0: i64) {
        let body = "x".repeat(1000);
        for batch in 0..12 {
            let messages: Vec<Incoming> = (0..50)
                .map(|i| {
                    stored_at(
                        "t",
                        None,
                        &format!("{batch:02}-{i:02}-{body}"),
                        t0 + batch * 3_600_000,
                    )
                })
                .collect();
            broker.append(messages).unwrap();
        }
    }

    #[test]
    fn retention_deletes_old_segments_and_pulls_below_min_offset_start_at_it() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = 1_796_117_400_000;
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        fill(&broker, t0);
        let log_dir = dir.path().join("broker/commitlog");
        let segments = files(&log_dir).len();
        assert!(segments >= 8, "1 KiB x 600 in 64 KiB segments: {segments}");
        broker.commit_offset("slow", "t", 0, 10, 10).unwrap();
        broker.commit_offset("done", "t", 0, 600, 10).unwrap();
        // Nothing is old enough yet.
        assert_eq!(broker.enforce_retention(t0).unwrap(), Retired::default());

        // Five hours later, batches stored more than an hour before are gone (a segment at a time).
        let retired = broker.enforce_retention(t0 + 5 * 3_600_000).unwrap();
        assert!(retired.segments > 0 && retired.bytes > 0, "{retired:?}");
        let (min, max) = broker.queue_offsets("t").unwrap()[0];
        assert_eq!(max, 600);
        assert!((150..=250).contains(&min), "about 4 batches gone: {min}");
        assert_eq!(
            retired.unread,
            min - 10,
            "only the slow group missed messages"
        );
        assert_eq!(files(&log_dir).len(), segments - retired.segments);
        // A pull below min_offset is answered from it.
        let pulled = broker.read("t", 0, 3, 2).unwrap().unwrap();
        assert_eq!(pulled.from, min);
        assert_eq!(pulled.messages[0].offset, min);
        assert!(bodies(&pulled)[0].starts_with(&format!("{:02}-", min / 50)));
        // Queue files that only pointed into deleted segments are gone too.
        let queue_files = files(&dir.path().join("broker/consumequeue/t/0"));
        assert!(
            queue_files[0].parse::<u64>().unwrap() > 0,
            "{queue_files:?}"
        );

        // Reopened, the minimum is recomputed from the log, and nothing else changed.
        drop(broker);
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        assert_eq!(broker.queue_offsets("t").unwrap()[0], (min, 600));
        assert_eq!(
            broker.read("t", 0, 599, 5).unwrap().unwrap().messages.len(),
            1
        );

        // Everything expired: all but the segment taking appends go, and appends go on.
        broker.enforce_retention(t0 + 100 * 3_600_000).unwrap();
        assert_eq!(files(&log_dir).len(), 1);
        broker
            .append(vec![stored_at("t", None, "later", t0)])
            .unwrap();
        let (min, max) = broker.queue_offsets("t").unwrap()[0];
        assert_eq!(max, 601);
        assert_eq!(
            bodies(&broker.read("t", 0, 600, 10).unwrap().unwrap()),
            ["later"]
        );
        assert!(min <= 600);
    }

    #[test]
    fn a_deletion_cut_short_by_a_crash_is_finished_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = 1_796_117_400_000;
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        fill(&broker, t0);
        drop(broker);
        let log_dir = dir.path().join("broker/commitlog");
        let segments = files(&log_dir);
        // Retention had deleted the oldest three segments, then the process died: the queue files that
        // pointed into them are still there.
        for segment in &segments[..3] {
            fs::remove_file(log_dir.join(segment)).unwrap();
        }
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        assert_eq!(files(&log_dir), segments[3..].to_vec());
        let (min, max) = broker.queue_offsets("t").unwrap()[0];
        assert_eq!(max, 600);
        let pulled = broker.read("t", 0, 0, 1000).unwrap().unwrap();
        assert_eq!(pulled.from, min);
        assert!(pulled.messages[0].meta.queue_offset == min && min > 0);
        // The rest, a few segments per read.
        let mut read = pulled.messages.len() as u64;
        while min + read < 600 {
            let more = broker.read("t", 0, min + read, 1000).unwrap().unwrap();
            assert_eq!(more.messages[0].meta.queue_offset, min + read);
            read += more.messages.len() as u64;
        }
        assert_eq!(read, 600 - min);
        let queue_files = files(&dir.path().join("broker/consumequeue/t/0"));
        assert!(
            queue_files[0].parse::<u64>().unwrap() <= min,
            "queue files wholly below min_offset went: {queue_files:?}"
        );
        drop(broker);
        // And opening again changes nothing.
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        assert_eq!(broker.queue_offsets("t").unwrap()[0], (min, 600));
    }

    #[test]
    fn a_hole_in_the_commit_log_is_reported_and_an_empty_stray_segment_removed() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        fill(&broker, 1_796_117_400_000);
        drop(broker);
        let log_dir = dir.path().join("broker/commitlog");
        let segments = files(&log_dir);
        // An empty segment past the end, after a gap: what a failed append whose undo could not delete
        // the segment it started leaves. It holds nothing, and goes.
        let last = log_dir.join(segments.last().unwrap());
        let end =
            segments.last().unwrap().parse::<u64>().unwrap() + fs::metadata(&last).unwrap().len();
        let stray = format!("{:020}", end + 4096);
        fs::write(log_dir.join(&stray), commitlog::header(end + 4096)).unwrap();
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        assert_eq!(files(&log_dir), segments);
        assert_eq!(broker.queue_offsets("t").unwrap()[0], (0, 600));
        drop(broker);
        // A segment missing from the middle is corruption, named; nothing is deleted.
        fs::remove_file(log_dir.join(&segments[2])).unwrap();
        let error = Broker::open(dir.path(), small(1)).unwrap_err();
        assert!(
            matches!(&error, BrokerError::Corrupt { path, .. } if path.ends_with(&segments[1])),
            "{error}"
        );
        assert!(error.to_string().contains("missing"), "{error}");
        assert_eq!(files(&log_dir).len(), segments.len() - 1);
    }

    #[test]
    fn max_bytes_deletes_the_oldest_segments_first() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = 1_796_117_400_000;
        let options = BrokerOptions {
            max_bytes: Some(256 << 10),
            retention: Duration::from_secs(1 << 30),
            ..small(1)
        };
        let broker = Broker::open(dir.path(), options.clone()).unwrap();
        fill(&broker, t0);
        let retired = broker.enforce_retention(t0).unwrap();
        assert!(retired.segments > 0);
        let log_bytes: u64 = fs::read_dir(dir.path().join("broker/commitlog"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert!(log_bytes <= 256 << 10, "{log_bytes}");
        let pulled = broker.read("t", 0, 0, 1000).unwrap().unwrap();
        assert_eq!(
            pulled.messages.last().unwrap().offset,
            599,
            "the newest stay"
        );
        assert!(pulled.from > 0);
    }

    #[test]
    fn dead_letters_live_in_their_own_store_with_their_own_retention() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = 1_796_117_400_000;
        let options = BrokerOptions {
            dead_retention: Duration::from_secs(100 * 3600),
            ..small(1)
        };
        let broker = Broker::open(dir.path(), options).unwrap();
        let dead = crate::scheduler::DEAD_TOPIC;
        let body = "y".repeat(1000);
        for batch in 0..12 {
            let messages: Vec<Incoming> = (0..50)
                .map(|i| {
                    let topic = if i % 2 == 0 { "t" } else { dead };
                    stored_at(
                        topic,
                        None,
                        &format!("{batch}-{i}-{body}"),
                        t0 + batch * 3_600_000,
                    )
                })
                .collect();
            let placed = broker.append(messages).unwrap();
            // Each store numbers its own queues.
            assert_eq!(placed[1].1, batch as u64 * 25);
        }
        assert!(dir
            .path()
            .join("broker/dead/consumequeue")
            .join(dead)
            .is_dir());
        broker.enforce_retention(t0 + 20 * 3_600_000).unwrap();
        let main_min = broker.queue_offsets("t").unwrap()[0].0;
        assert!(main_min > 250, "all but the last segment went: {main_min}");
        assert_eq!(
            broker.queue_offsets(dead).unwrap()[0],
            (0, 300),
            "dead letters stay"
        );
        assert_eq!(
            broker.topics(),
            vec![(dead.to_string(), 1), ("t".to_string(), 1)]
        );
    }

    #[test]
    fn dead_letters_of_a_data_dir_from_before_their_store_stay_readable() {
        let dir = tempfile::tempdir().unwrap();
        let dead = crate::scheduler::DEAD_TOPIC;
        // The layout before dead letters had a store of their own: `$dead` in the main store.
        let mut legacy = Store::open(&dir.path().join("broker"), 1, 64 << 10).unwrap();
        let old = [incoming(dead, None, "old-1"), incoming(dead, None, "old-2")];
        legacy.append(&old.iter().collect::<Vec<_>>(), 2).unwrap();
        drop(legacy);
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        broker.commit_offset("ops", dead, 0, 1, 10).unwrap();
        assert_eq!(broker.queue_offsets(dead).unwrap(), vec![(0, 2)]);
        // New dead letters continue the queue the groups know.
        let placed = broker.append(vec![incoming(dead, None, "new")]).unwrap();
        assert_eq!(placed, vec![(0, 2)]);
        assert_eq!(
            bodies(&broker.read(dead, 0, 1, 10).unwrap().unwrap()),
            ["old-2", "new"]
        );
        assert_eq!(broker.topics(), vec![(dead.to_string(), 1)]);
    }

    #[test]
    fn an_append_whose_units_cannot_be_written_is_undone_records_included() {
        let dir = tempfile::tempdir().unwrap();
        // 64 KiB segments: 64 units per queue file.
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        let first: Vec<Incoming> = (0..64)
            .map(|i| incoming("t", None, &format!("a{i}")))
            .collect();
        broker.append(first).unwrap();
        let log = dir.path().join(LOG_0);
        let log_len = fs::metadata(&log).unwrap().len();
        // The queue's next file cannot be started: a directory is in its way.
        let blocker = dir
            .path()
            .join("broker/consumequeue/t/0/00000000000000000064");
        fs::create_dir(&blocker).unwrap();
        let second: Vec<Incoming> = (0..3)
            .map(|i| incoming("t", None, &format!("b{i}")))
            .collect();
        assert!(broker.append(second.clone()).is_err());
        assert_eq!(
            fs::metadata(&log).unwrap().len(),
            log_len,
            "the records were cut back"
        );
        assert_eq!(broker.queue_offsets("t").unwrap()[0], (0, 64));
        assert_eq!(broker.failed(), None, "the undo worked");
        fs::remove_dir(&blocker).unwrap();
        assert_eq!(broker.append(second).unwrap()[0], (0, 64));
        assert_eq!(
            bodies(&broker.read("t", 0, 63, 10).unwrap().unwrap()),
            ["a63", "b0", "b1", "b2"]
        );
        drop(broker);
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        assert_eq!(broker.queue_offsets("t").unwrap()[0], (0, 67));
        assert_eq!(
            bodies(&broker.read("t", 0, 64, 10).unwrap().unwrap()),
            ["b0", "b1", "b2"]
        );
    }

    #[test]
    fn a_read_is_bounded_in_bytes_but_always_has_a_message() {
        let dir = tempfile::tempdir().unwrap();
        let options = BrokerOptions {
            max_pull_bytes: 3 << 10,
            ..small(1)
        };
        let broker = Broker::open(dir.path(), options).unwrap();
        let kib = "k".repeat(1000);
        let messages: Vec<Incoming> = (0..10)
            .map(|i| incoming("t", None, &format!("{i}{kib}")))
            .collect();
        broker.append(messages).unwrap();
        broker
            .append(vec![incoming("t", None, &"big".repeat(3000))])
            .unwrap();
        let read = broker.read("t", 0, 0, 100).unwrap().unwrap();
        assert!(
            (1..=3).contains(&read.messages.len()),
            "{}",
            read.messages.len()
        );
        let total: usize = read.messages.iter().map(|m| m.body.len()).sum();
        assert!(total <= 3 << 10);
        let big = broker.read("t", 0, 10, 100).unwrap().unwrap();
        assert_eq!(
            big.messages.len(),
            1,
            "one message larger than the cap still comes"
        );
    }

    #[test]
    fn the_sink_postpones_what_its_own_storage_fails_to_take() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Arc::new(Broker::open(dir.path(), small(1)).unwrap());
        let sink = BrokerSink::new(broker.clone(), Arc::new(schedulelog::SystemClock));
        let location = schedulelog::Location {
            bucket: schedulelog::Bucket::from_start_minute(29_935_260),
            seq: 1,
        };
        let delivery = |body: &str| Delivery {
            id: schedulelog::MessageId::new(location),
            location,
            message: schedulelog::Message {
                seq: 1,
                deliver_at_ms: 1,
                created_at_ms: 1,
                id: schedulelog::MessageId::new(location),
                attempt: 3,
                topic: "t".into(),
                key: None,
                dedup: false,
                headers: Vec::new(),
                sink: "broker".into(),
                body: body.as_bytes().to_vec(),
            },
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let first = vec![delivery(&"a".repeat(60 << 10))];
        assert_eq!(
            runtime.block_on(sink.deliver(&first)),
            vec![SinkOutcome::Delivered]
        );
        // In place (as lanes deliver), the same: stored, then answered.
        assert_eq!(
            sink.deliver_blocking(&[delivery("in place")]),
            Some(vec![SinkOutcome::Delivered])
        );
        assert_eq!(
            bodies(&broker.read("t", 0, 0, 10).unwrap().unwrap())[1],
            "in place"
        );
        // The next segment cannot be created (a directory in its way): not a full disk, an I/O error.
        let log_dir = dir.path().join("broker/commitlog");
        let last = files(&log_dir).pop().unwrap();
        let end = last.parse::<u64>().unwrap() + fs::metadata(log_dir.join(&last)).unwrap().len();
        fs::create_dir(log_dir.join(format!("{end:020}"))).unwrap();
        let second = vec![delivery(&"b".repeat(60 << 10))];
        let answers = runtime.block_on(sink.deliver(&second));
        assert!(
            matches!(&answers[..], [SinkOutcome::Postpone { after, .. }] if *after == Duration::from_secs(5)),
            "postponed, no attempt used: {answers:?}"
        );
        let answers = sink.deliver_blocking(&second).unwrap();
        assert!(
            matches!(&answers[..], [SinkOutcome::Postpone { after, .. }] if *after == Duration::from_secs(5)),
            "in place too: {answers:?}"
        );
        assert_eq!(broker.disk_full(), None, "not a full disk");
    }

    #[test]
    fn a_large_batch_is_synced_in_bounded_writes_so_a_torn_one_is_a_tail() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), options(1)).unwrap();
        // 40 MiB in one batch (the sink's largest is 1,024 messages of up to 16 MiB).
        let mib = "m".repeat((1 << 20) - 512);
        let batch: Vec<Incoming> = (0..40)
            .map(|i| incoming("t", None, &format!("{i:02}{mib}")))
            .collect();
        broker.append(batch).unwrap();
        let writes = broker.main.lock().log.writes.clone();
        assert!(writes.len() >= 2, "{writes:?}");
        let limit = frame::UNSYNCED_LIMIT;
        assert!(writes.iter().all(|(_, len)| *len <= limit), "{writes:?}");
        drop(broker);
        // A power loss during the last write: its first frame is torn, the rest of it garbage. Only
        // that write was unsynced, so what it held is a torn tail, cut, and what came before stays.
        let (at, len) = *writes.last().unwrap();
        let log = fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join(LOG_0))
            .unwrap();
        log.write_all_at(&vec![0xab; len], at).unwrap();
        fs::remove_file(dir.path().join("broker/checkpoint")).ok();
        let broker = Broker::open(dir.path(), options(1)).unwrap();
        let kept = broker.queue_offsets("t").unwrap()[0].1;
        assert!(kept > 0 && kept < 40, "{kept}");
        let read = broker.read("t", 0, kept - 1, 1).unwrap().unwrap();
        assert!(bodies(&read)[0].starts_with(&format!("{:02}", kept - 1)));
    }

    #[test]
    fn only_the_segment_taking_appends_holds_a_file_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        fill(&broker, 1_796_117_400_000);
        let log_dir = dir.path().join("broker/commitlog");
        assert!(files(&log_dir).len() >= 8);
        let open_here = || {
            fs::read_dir("/proc/self/fd")
                .unwrap()
                .filter_map(|e| fs::read_link(e.unwrap().path()).ok())
                .filter(|target| target.starts_with(&log_dir))
                .count()
        };
        assert_eq!(
            open_here(),
            1,
            "sealed segments are opened when read, not kept open"
        );
        // Reading from a sealed one opens it for the read only.
        assert_eq!(
            broker.read("t", 0, 0, 5).unwrap().unwrap().messages.len(),
            5
        );
        assert_eq!(open_here(), 1);
    }

    #[test]
    fn a_read_spans_a_bounded_number_of_segments() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        // Each message of `t` in a segment of its own, with a large one of `u` between.
        let filler = "u".repeat(50 << 10);
        for i in 0..20 {
            broker
                .append(vec![
                    incoming("t", None, &format!("t{i}")),
                    incoming("u", None, &filler),
                ])
                .unwrap();
        }
        assert!(files(&dir.path().join("broker/commitlog")).len() >= 19);
        let first = broker.read("t", 0, 0, 100).unwrap().unwrap();
        // Each segment read holds a descriptor until the answer is sent: a few per read, not 20.
        assert_eq!(first.messages.len(), store::MAX_SEGMENTS_PER_READ);
        let next = |p: &Pulled| p.from + p.messages.len() as u64;
        let rest = broker.read("t", 0, next(&first), 100).unwrap().unwrap();
        let mut all = bodies(&first);
        all.extend(bodies(&rest));
        let more = broker.read("t", 0, next(&rest), 100).unwrap().unwrap();
        all.extend(bodies(&more));
        assert_eq!(all, (0..20).map(|i| format!("t{i}")).collect::<Vec<_>>());
    }

    #[test]
    fn a_failed_append_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        let body = "z".repeat(1000);
        broker
            .append(
                (0..60)
                    .map(|i| incoming("t", None, &format!("{i}{body}")))
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        let log_dir = dir.path().join("broker/commitlog");
        let before = files(&log_dir);
        let last = log_dir.join(before.last().unwrap());
        let end =
            before.last().unwrap().parse::<u64>().unwrap() + fs::metadata(&last).unwrap().len();
        // The next segment cannot be created: a directory is in its way.
        let blocker = log_dir.join(format!("{end:020}"));
        fs::create_dir(&blocker).unwrap();
        let batch: Vec<Incoming> = (0..70)
            .map(|i| incoming("t", None, &format!("b{i}{body}")))
            .collect();
        assert!(broker.append(batch.clone()).is_err());
        assert_eq!(broker.queue_offsets("t").unwrap()[0].1, 60, "no units");
        assert_eq!(
            fs::metadata(&last).unwrap().len() + before.last().unwrap().parse::<u64>().unwrap(),
            end,
            "the log was cut back"
        );
        fs::remove_dir(&blocker).unwrap();
        let placed = broker.append(batch).unwrap();
        assert_eq!(placed[0].1, 60, "queue offsets go on without a gap");
        let pulled = broker.read("t", 0, 58, 4).unwrap().unwrap();
        assert_eq!(pulled.messages.len(), 4);
        assert!(bodies(&pulled)[2].starts_with("b0"));
        drop(broker);
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        assert_eq!(broker.queue_offsets("t").unwrap()[0].1, 130);
    }

    /// Starts one thread per call while the main store is held, waits until every call is queued, lets
    /// go, and answers each call's result in order.
    fn appended_together(broker: &Arc<Broker>, calls: Vec<Vec<Incoming>>) -> Vec<Placed> {
        let count = calls.len();
        let held = broker.main.lock();
        let callers: Vec<_> = calls
            .into_iter()
            .map(|messages| {
                let broker = broker.clone();
                std::thread::spawn(move || broker.append(messages))
            })
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while broker.main.queued() < count {
            assert!(std::time::Instant::now() < deadline, "every append queues");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(held);
        callers.into_iter().map(|c| c.join().unwrap()).collect()
    }

    /// Opens its gate when dropped, however the test ends: a job held at it would hold up the store's
    /// drop (for the gate's 30 s).
    struct GateOpens(Arc<store::Gate>);

    impl Drop for GateOpens {
        fn drop(&mut self) {
            self.0.open();
        }
    }

    /// Makes the main store's checkpoints due every two messages and holds their jobs at a gate.
    fn gate_checkpoints(broker: &Broker) -> GateOpens {
        let gate = Arc::new(store::Gate::default());
        let mut store = broker.main.lock();
        store.checkpoint_every = (2, u64::MAX);
        store.checkpoint_gate = Some(gate.clone());
        GateOpens(gate)
    }

    /// A checkpoint is taken under the store's lock and made durable off it: while its job is held before
    /// its first sync, appends and reads go on and the checkpoint file is untouched; released, the file
    /// gets the log's end as it was when the job was taken. A checkpoint due while one runs waits for a
    /// later append; dropping the broker waits for a running job; units of records after the last
    /// checkpoint are rewritten on open.
    #[test]
    fn a_checkpoint_is_made_durable_off_the_stores_lock() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Arc::new(Broker::open(dir.path(), options(1)).unwrap());
        let gate = gate_checkpoints(&broker);
        let checkpoint = || store::read_checkpoint(&dir.path().join("broker"));
        let end = || broker.main.lock().log.end();
        let append = |bodies: [&str; 2]| {
            broker
                .append(bodies.map(|b| incoming("t", None, b)).to_vec())
                .unwrap()
        };
        let before = checkpoint();
        // On a thread of its own: were the job run under the lock, this append would wait at the gate.
        let (done, appended) = std::sync::mpsc::channel();
        let first = broker.clone();
        let appending = std::thread::spawn(move || {
            let messages = vec![incoming("t", None, "a"), incoming("t", None, "b")];
            done.send(first.append(messages).map(|_| ())).unwrap();
        });
        appended
            .recv_timeout(Duration::from_secs(20))
            .expect("the append returns while its checkpoint waits to sync")
            .unwrap();
        appending.join().unwrap();
        let taken = end();
        assert!(taken > before);
        append(["c", "d"]);
        let read = broker.read("t", 0, 0, 10).unwrap().unwrap();
        assert_eq!(
            bodies(&read),
            ["a", "b", "c", "d"],
            "appends and reads go on"
        );
        assert_eq!(checkpoint(), before, "nothing stored before the syncs");
        gate.0.open();
        broker.main.lock().wait_for_checkpoint();
        assert_eq!(
            checkpoint(),
            taken,
            "the end as it was when the job was taken"
        );

        append(["e", "f"]);
        broker.main.lock().wait_for_checkpoint();
        assert_eq!(
            checkpoint(),
            end(),
            "the next one, due since c and d, started at e and f"
        );

        let held = gate_checkpoints(&broker);
        append(["g", "h"]);
        let at_h = end();
        broker.main.lock().checkpoint_every = (u64::MAX, u64::MAX);
        append(["i", "j"]);
        // The gate opens a moment after the drop began: a drop that did not wait for the job would end
        // before its checkpoint is stored.
        let opening = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        drop(broker);
        assert_eq!(checkpoint(), at_h, "the drop waited for the job");
        opening.join().unwrap();
        // i and j came after the last checkpoint: their units, zeroed here as a crash may leave them,
        // are rewritten on open (a checkpoint past them would have them cut instead).
        let queue = dir
            .path()
            .join("broker/consumequeue/t/0/00000000000000000000");
        let file = fs::OpenOptions::new().write(true).open(queue).unwrap();
        file.write_all_at(&[0; 2 * queue::UNIT_LEN as usize], 8 * queue::UNIT_LEN)
            .unwrap();
        let broker = Broker::open(dir.path(), options(1)).unwrap();
        let read = broker.read("t", 0, 0, 20).unwrap().unwrap();
        assert_eq!(
            bodies(&read),
            ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]
        );
    }

    /// Queue files are synced by checkpoint jobs alone: a file the queue moved on from while a job held
    /// it goes to the next job, before the active one; everything reads back after a reopen.
    #[test]
    fn a_queue_file_moved_on_from_goes_to_the_next_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        let gate = gate_checkpoints(&broker);
        let names: Vec<String> = (0..74).map(|i| format!("m{i}")).collect();
        let messages = |names: &[String]| names.iter().map(|n| incoming("t", None, n)).collect();
        let queue_file = |first: u64| {
            dir.path()
                .join(format!("broker/consumequeue/t/0/{first:020}"))
        };
        broker.append(messages(&names[..2])).unwrap();
        let taken = broker.main.lock().log.end();
        assert_eq!(broker.main.lock().checkpoint_files, [queue_file(0)]);
        // 64 units a file with these segments: the queue moves on while the job holds file 0.
        broker.append(messages(&names[2..72])).unwrap();
        assert!(queue_file(64).exists(), "the queue moved on");
        gate.0.open();
        broker.main.lock().wait_for_checkpoint();
        assert_eq!(store::read_checkpoint(&dir.path().join("broker")), taken);
        broker.append(messages(&names[72..])).unwrap();
        broker.main.lock().wait_for_checkpoint();
        assert_eq!(
            broker.main.lock().checkpoint_files,
            [queue_file(0), queue_file(64)],
            "the file moved on from (written after the first job took it), then the active one"
        );
        drop(broker);
        let broker = Broker::open(dir.path(), small(1)).unwrap();
        let read = broker.read("t", 0, 0, 100).unwrap().unwrap();
        assert_eq!(bodies(&read), names);
    }

    /// A store's lock is held through an append's commit-log sync: `queue_offsets_now` answers busy at
    /// once instead of waiting (an async caller then asks on the blocking pool), only for the store that
    /// is held, and otherwise answers what `queue_offsets` does.
    #[test]
    fn offsets_now_answer_busy_rather_than_wait_for_a_held_store() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), options(2)).unwrap();
        let dead = crate::scheduler::DEAD_TOPIC;
        broker
            .append(vec![incoming("t", None, "a"), incoming(dead, None, "d")])
            .unwrap();
        let offsets = broker.queue_offsets("t");
        assert_eq!(offsets, Some(vec![(0, 0), (0, 1)]));
        assert_eq!(broker.queue_offsets_now("t"), Ok(offsets.clone()));
        assert_eq!(broker.queue_offsets_now("nope"), Ok(None));
        let held = broker.main.lock();
        assert_eq!(broker.queue_offsets_now("t"), Err(StoreBusy));
        assert_eq!(
            broker.queue_offsets_now(dead),
            Ok(Some(vec![(0, 0), (0, 1)])),
            "the dead letters' store has a lock of its own"
        );
        drop(held);
        assert_eq!(broker.queue_offsets_now("t"), Ok(offsets));
    }

    /// Lanes delivering at once share the commit log's write and sync: three appends that arrive while
    /// the store is busy go in one write, each caller gets its own placements, and all are readable.
    #[test]
    fn appends_that_arrive_together_share_one_write() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Arc::new(Broker::open(dir.path(), options(1)).unwrap());
        broker.append(vec![incoming("t", None, "first")]).unwrap();
        let writes_before = broker.main.lock().log.writes.len();
        let bodies_of = |n: usize| [format!("{n}a"), format!("{n}b")];
        let calls = (0..3)
            .map(|n| {
                bodies_of(n)
                    .iter()
                    .map(|b| incoming("t", None, b))
                    .collect()
            })
            .collect();
        for (n, placed) in appended_together(&broker, calls).into_iter().enumerate() {
            let placed = placed.unwrap();
            assert_eq!(
                placed[1].1,
                placed[0].1 + 1,
                "a caller's messages stay together"
            );
            for (body, (_, offset)) in bodies_of(n).iter().zip(&placed) {
                let pulled = broker.read("t", 0, *offset, 1).unwrap().unwrap();
                assert_eq!(&bodies(&pulled)[0], body, "where it says it went");
            }
        }
        assert_eq!(
            broker.main.lock().log.writes.len(),
            writes_before + 1,
            "one commit-log write for the three"
        );
        assert_eq!(broker.queue_offsets("t").unwrap()[0].1, 7);
    }

    /// A caller whose own messages cannot be stored (a topic whose files cannot be made) fails alone:
    /// the others in its group are stored, where they say, with offsets that go on without a gap.
    #[test]
    fn a_caller_that_fails_in_a_group_fails_alone() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Arc::new(Broker::open(dir.path(), options(1)).unwrap());
        broker.append(vec![incoming("t", None, "first")]).unwrap();
        // A file where the topic's consume queues would go.
        fs::write(dir.path().join("broker/consumequeue/blocked"), b"").unwrap();
        let calls = ["t", "blocked", "t"]
            .iter()
            .enumerate()
            .map(|(n, topic)| vec![incoming(topic, None, &n.to_string())])
            .collect();
        let answers = appended_together(&broker, calls);
        let err = answers[1].as_ref().unwrap_err();
        assert!(err.to_string().contains("blocked"), "{err}");
        assert!(!err.is_disk_full(), "{err}");
        let mut offsets: Vec<u64> = [&answers[0], &answers[2]]
            .iter()
            .map(|a| a.as_ref().unwrap()[0].1)
            .collect();
        offsets.sort();
        assert_eq!(
            offsets,
            vec![1, 2],
            "after the first message, without a gap"
        );
        for n in [0, 2] {
            let offset = answers[n].as_ref().unwrap()[0].1;
            let pulled = broker.read("t", 0, offset, 1).unwrap().unwrap();
            assert_eq!(bodies(&pulled), vec![n.to_string()]);
        }
        assert_eq!(broker.failed(), None);
    }

    /// A failure after the group's messages went to the commit log (its next segment cannot be made)
    /// undoes the append as a whole: every caller hears it, none of it is stored, and the queue goes on
    /// without a gap once the trouble is gone.
    #[test]
    fn a_write_that_fails_for_a_group_fails_every_caller_in_it() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Arc::new(Broker::open(dir.path(), small(1)).unwrap());
        broker
            .append(vec![incoming("t", None, &"a".repeat(60 << 10))])
            .unwrap();
        let log_dir = dir.path().join("broker/commitlog");
        let last = files(&log_dir).pop().unwrap();
        let end = last.parse::<u64>().unwrap() + fs::metadata(log_dir.join(&last)).unwrap().len();
        let blocker = log_dir.join(format!("{end:020}"));
        fs::create_dir(&blocker).unwrap();
        let calls = (0..3)
            .map(|n| vec![incoming("t", None, &format!("{n}{}", "b".repeat(4 << 10)))])
            .collect();
        for answer in appended_together(&broker, calls) {
            let err = answer.unwrap_err();
            assert!(!err.is_disk_full(), "{err}");
        }
        assert_eq!(
            broker.queue_offsets("t").unwrap()[0].1,
            1,
            "nothing of the group stored"
        );
        fs::remove_dir(&blocker).unwrap();
        let placed = broker.append(vec![incoming("t", None, "after")]).unwrap();
        assert_eq!(placed[0].1, 1, "no gap");
        assert_eq!(broker.failed(), None);
    }
}
