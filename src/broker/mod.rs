//! The built-in broker: where the `broker` sink delivers, and what consumers pull from over HTTP.
//!
//! RocketMQ-style: one commit log for all topics, a consume queue of fixed 20-byte units per
//! (topic, queue), consumer group offsets, and long polling woken by arrivals.
//!
//! ```text
//! broker/commitlog/00000000000000000000   file header (schedulelog's, magic DLYDBRK\0), then frames of
//!                                         kind 5 whose payload is:
//!     0   4  meta_len u32
//!     4   ..  meta: JSON {"topic","queue","queue_offset","id","key"?,"headers","deliver_at_ms",
//!                          "delivered_at_ms","attempt"}
//!     ..  ..  body bytes
//! broker/consumequeue/{topic}/{queue}     20-byte units: commit log offset u64 | frame size u32 |
//!                                         tag hash u64 (CRC-32C of the key, 0 without one), LE
//! broker/checkpoint                       commit log position below which every record has its unit
//!                                         synced (u64 LE + CRC-32C), replaced atomically every 10,000
//!                                         messages
//! broker/offsets                          JSON {group: {topic: {queue: offset}}}, replaced atomically
//! ```
//!
//! Invariants and recovery:
//! - A delivery is acknowledged to the scheduler only after its record is synced, so the dispatch log
//!   never records a delivery the broker could lose. Its unit is written then, and synced only at the
//!   next checkpoint: units are derived data (each record carries its queue offset), and syncing every
//!   queue a batch touched cost one `fdatasync` per queue per batch.
//! - A unit is published to readers only after its record is synced.
//! - On open the commit log's torn tail is cut (schedulelog's tail policy); units at the end of a queue
//!   that are zero or point past the log's end are cut; every record after the checkpoint writes its unit
//!   again (idempotent), which restores units lost or torn in a crash, and a queue that got records after
//!   the checkpoint is cut to end right after the last of them. A record whose queue offset leaves a gap
//!   is corruption.
//! - A failed append cuts the commit log back to where it began; after a failed checkpoint sync no
//!   further checkpoint is written until a restart (the kernel may have dropped those units' pages).
//! - Topic names match `[A-Za-z0-9._-]{1,200}` and are not all dots, so no name reaches outside the
//!   data dir.

use crate::sink::{BoxFuture, Delivery, Sink, SinkOutcome};
use schedulelog::frame::{self, Frames, Kind, Stop};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

const UNIT_LEN: u64 = 20;
const LOG_HEADER_LEN: u64 = 32;
const LOG_MAGIC: &[u8; 8] = b"DLYDBRK\0";

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
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> BrokerError + '_ {
    move |source| BrokerError::Io {
        path: path.to_path_buf(),
        source,
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

/// Committed offsets: group → topic → queue → offset.
type GroupOffsets = BTreeMap<String, BTreeMap<String, BTreeMap<u32, u64>>>;

/// A message as a consumer gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub offset: u64,
    pub meta: StoredMeta,
    pub body: Vec<u8>,
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

#[derive(Debug)]
struct Queue {
    file: File,
    path: PathBuf,
    units: u64,
}

#[derive(Debug, Default)]
struct Topic {
    queues: Vec<Queue>,
    next_round_robin: u32,
}

#[derive(Debug)]
struct Store {
    log: File,
    log_path: PathBuf,
    log_end: u64,
    topics: BTreeMap<String, Topic>,
    /// Units written since the broker checkpoint.
    unsynced_since_checkpoint: u64,
    /// A checkpoint's sync failed: the kernel may have dropped those units' pages, so no later
    /// checkpoint may claim them; the next open rewrites every unit since the last good one.
    checkpoint_failed: bool,
}

/// The broker store. Cheap to share (`Arc`); blocking I/O, so async callers use `spawn_blocking`.
#[derive(Debug)]
pub struct Broker {
    dir: PathBuf,
    queues_per_topic: u32,
    store: Mutex<Store>,
    offsets: Mutex<GroupOffsets>,
    /// Woken on every append; long polls re-check their queue.
    arrivals: tokio::sync::Notify,
}

/// Whether `name` is a valid topic: a valid name, or `$dead` (where dead messages go).
pub fn valid_topic(name: &str) -> bool {
    crate::api::valid_name(name) || name == crate::scheduler::DEAD_TOPIC
}

impl Broker {
    pub fn open(data_dir: &Path, queues_per_topic: u32) -> Result<Broker, BrokerError> {
        let dir = data_dir.join("broker");
        for sub in ["commitlog", "consumequeue"] {
            let path = dir.join(sub);
            fs::create_dir_all(&path).map_err(io_err(&path))?;
        }
        let log_path = dir.join("commitlog").join(format!("{:020}", 0));
        let log = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        let bytes = fs::read(&log_path).map_err(io_err(&log_path))?;
        // Shorter than its header: created just before a crash (whatever of the header got written).
        let torn_header = bytes.len() < LOG_HEADER_LEN as usize
            && (bytes.iter().all(|&b| b == 0)
                || LOG_MAGIC.starts_with(&bytes[..bytes.len().min(8)]));
        let log_end = if torn_header {
            let mut header = [0u8; LOG_HEADER_LEN as usize];
            header[..8].copy_from_slice(LOG_MAGIC);
            log.set_len(0)
                .and_then(|()| log.write_all_at(&header, 0))
                .and_then(|()| log.sync_all())
                .map_err(io_err(&log_path))?;
            LOG_HEADER_LEN
        } else {
            if &bytes[..8.min(bytes.len())] != LOG_MAGIC {
                return Err(BrokerError::Corrupt {
                    path: log_path,
                    offset: 0,
                    reason: "not a broker commit log".into(),
                });
            }
            scan_end(&log_path, &bytes)?
        };
        if log_end < bytes.len() as u64 {
            log.set_len(log_end)
                .and_then(|()| log.sync_all())
                .map_err(io_err(&log_path))?;
        }
        let mut store = Store {
            log,
            log_path,
            log_end,
            topics: BTreeMap::new(),
            unsynced_since_checkpoint: 0,
            checkpoint_failed: false,
        };
        load_topics(&dir, &mut store)?;
        let broker = Broker {
            dir: dir.clone(),
            queues_per_topic,
            store: Mutex::new(store),
            offsets: Mutex::new(load_offsets(&dir)?),
            arrivals: tokio::sync::Notify::new(),
        };
        broker.repair(&bytes)?;
        Ok(broker)
    }

    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cuts units that are zero or point past the commit log, and rewrites the unit of every record after
    /// the checkpoint.
    fn repair(&self, bytes: &[u8]) -> Result<(), BrokerError> {
        let mut store = self.store();
        let log_end = store.log_end;
        for topic in store.topics.values_mut() {
            for queue in &mut topic.queues {
                while queue.units > 0 {
                    let (offset, len, _) = read_unit(queue, queue.units - 1)?;
                    if offset >= LOG_HEADER_LEN && len > 0 && offset + u64::from(len) <= log_end {
                        break;
                    }
                    queue.units -= 1;
                }
                queue
                    .file
                    .set_len(queue.units * UNIT_LEN)
                    .and_then(|()| queue.file.sync_all())
                    .map_err(io_err(&queue.path))?;
            }
        }
        let from = read_checkpoint(&self.dir).clamp(LOG_HEADER_LEN, log_end);
        let mut pos = from as usize;
        let end = log_end as usize;
        // Queues that got records after the checkpoint end exactly after the last of them: a unit past
        // it can only be left over from a crash, however valid it looks.
        let mut ends: BTreeMap<(String, u32), u64> = BTreeMap::new();
        while pos < end {
            let Some((meta, _, len)) = decode_record(&bytes[pos..end]) else {
                return Err(BrokerError::Corrupt {
                    path: store.log_path.clone(),
                    offset: pos as u64,
                    reason: "undecodable record before the end of the log".into(),
                });
            };
            let queue = self.queue_mut(&mut store, &meta.topic, meta.queue)?;
            if meta.queue_offset <= queue.units {
                // Written again even when present: an unsynced unit may be torn or zero.
                let unit = encode_unit(pos as u64, len, meta.key.as_deref());
                queue
                    .file
                    .write_all_at(&unit, meta.queue_offset * UNIT_LEN)
                    .map_err(io_err(&queue.path))?;
                queue.units = queue.units.max(meta.queue_offset + 1);
                ends.insert((meta.topic.clone(), meta.queue), meta.queue_offset + 1);
            } else {
                let path = queue.path.clone();
                return Err(BrokerError::Corrupt {
                    path,
                    offset: queue.units * UNIT_LEN,
                    reason: format!(
                        "commit log record for queue offset {} leaves a gap",
                        meta.queue_offset
                    ),
                });
            }
            pos += len as usize;
        }
        for ((topic, index), units) in ends {
            let queue = self.queue_mut(&mut store, &topic, index)?;
            if queue.units > units {
                queue.units = units;
                queue
                    .file
                    .set_len(units * UNIT_LEN)
                    .map_err(io_err(&queue.path))?;
            }
        }
        self.sync_and_checkpoint(&mut store)
    }

    fn queue_mut<'a>(
        &self,
        store: &'a mut Store,
        topic: &str,
        queue: u32,
    ) -> Result<&'a mut Queue, BrokerError> {
        if !store.topics.contains_key(topic) {
            let created = create_topic(&self.dir, topic, self.queues_per_topic)?;
            store.topics.insert(topic.to_string(), created);
        }
        let topic_state = store.topics.get_mut(topic).expect("inserted above");
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

    /// Stores messages durably (commit log synced, then units written) and wakes long polls.
    pub fn append(&self, messages: &[Incoming]) -> Result<Vec<(u32, u64)>, BrokerError> {
        let mut store = self.store();
        let mut placed = Vec::with_capacity(messages.len());
        let mut buf = Vec::new();
        // The new units of each queue, in order: one write per touched queue.
        let mut units: BTreeMap<(String, u32), Vec<u8>> = BTreeMap::new();
        let mut pos = store.log_end;
        for message in messages {
            if !store.topics.contains_key(&message.topic) {
                let created = create_topic(&self.dir, &message.topic, self.queues_per_topic)?;
                store.topics.insert(message.topic.clone(), created);
            }
            let topic = store.topics.get_mut(&message.topic).expect("created above");
            let count = topic.queues.len() as u32;
            let queue = match &message.key {
                Some(key) => crc32c::crc32c(key.as_bytes()) % count,
                None => {
                    topic.next_round_robin = topic.next_round_robin.wrapping_add(1);
                    topic.next_round_robin % count
                }
            };
            let queue_units = units.entry((message.topic.clone(), queue)).or_default();
            let queue_offset =
                topic.queues[queue as usize].units + (queue_units.len() as u64) / UNIT_LEN;
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
            };
            let start = buf.len();
            encode_record(&mut buf, &meta, &message.body);
            let len = (buf.len() - start) as u32;
            queue_units.extend_from_slice(&encode_unit(pos, len, message.key.as_deref()));
            pos += u64::from(len);
            placed.push((queue, queue_offset));
        }
        let log_end = store.log_end;
        let started = std::time::Instant::now();
        let written = store
            .log
            .write_all_at(&buf, log_end)
            .and_then(|()| store.log.sync_data());
        metrics::histogram!("delayd_sync_seconds", "file" => "broker")
            .record(started.elapsed().as_secs_f64());
        if let Err(e) = written {
            // Whatever part of the batch reached the file goes: whole frames left past the end would
            // come back on the next open as records no one acknowledged.
            let _ = store.log.set_len(log_end);
            return Err(io_err(&store.log_path)(e));
        }
        store.log_end = pos;
        for ((topic, index), bytes) in &units {
            let queue =
                &mut store.topics.get_mut(topic).expect("created above").queues[*index as usize];
            queue
                .file
                .write_all_at(bytes, queue.units * UNIT_LEN)
                .map_err(io_err(&queue.path))?;
            queue.units += bytes.len() as u64 / UNIT_LEN;
        }
        store.unsynced_since_checkpoint += messages.len() as u64;
        if store.unsynced_since_checkpoint >= 10_000 && !store.checkpoint_failed {
            // The messages are stored either way; a failed checkpoint only makes the next open
            // rewrite more units.
            if let Err(e) = self.sync_and_checkpoint(&mut store) {
                tracing::error!(error = %e, "broker checkpoint failed; no more until restart");
                store.checkpoint_failed = true;
            }
        }
        drop(store);
        self.arrivals.notify_waiters();
        Ok(placed)
    }

    fn sync_and_checkpoint(&self, store: &mut Store) -> Result<(), BrokerError> {
        for topic in store.topics.values() {
            for queue in &topic.queues {
                queue.file.sync_data().map_err(io_err(&queue.path))?;
            }
        }
        let mut bytes = store.log_end.to_le_bytes().to_vec();
        let crc = crc32c::crc32c(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        let path = self.dir.join("checkpoint");
        write_atomically(&path, &bytes)?;
        store.unsynced_since_checkpoint = 0;
        Ok(())
    }

    /// Topics and their queue counts.
    pub fn topics(&self) -> Vec<(String, u32)> {
        self.store()
            .topics
            .iter()
            .map(|(name, t)| (name.clone(), t.queues.len() as u32))
            .collect()
    }

    /// `(min_offset, max_offset)` of every queue of a topic; `None` for an unknown topic.
    pub fn queue_offsets(&self, topic: &str) -> Option<Vec<(u64, u64)>> {
        self.store()
            .topics
            .get(topic)
            .map(|t| t.queues.iter().map(|q| (0, q.units)).collect())
    }

    /// Up to `max` messages of a queue from `offset`. `None` for an unknown topic or queue.
    pub fn read(
        &self,
        topic: &str,
        queue: u32,
        offset: u64,
        max: usize,
    ) -> Result<Option<Vec<Stored>>, BrokerError> {
        let store = self.store();
        let Some(q) = store
            .topics
            .get(topic)
            .and_then(|t| t.queues.get(queue as usize))
        else {
            return Ok(None);
        };
        let end = q.units.min(offset.saturating_add(max as u64));
        let mut out = Vec::new();
        for at in offset..end {
            let (log_offset, len, _) = read_unit(q, at)?;
            if len as usize > frame::MAX_PAYLOAD + frame::HEADER_LEN
                || log_offset.saturating_add(u64::from(len)) > store.log_end
            {
                return Err(BrokerError::Corrupt {
                    path: q.path.clone(),
                    offset: at * UNIT_LEN,
                    reason: format!("unit points outside the commit log ({log_offset}+{len})"),
                });
            }
            let mut bytes = vec![0u8; len as usize];
            store
                .log
                .read_exact_at(&mut bytes, log_offset)
                .map_err(io_err(&store.log_path))?;
            let Some((meta, body, _)) = decode_record(&bytes) else {
                return Err(BrokerError::Corrupt {
                    path: store.log_path.clone(),
                    offset: log_offset,
                    reason: "unit points at an undecodable record".into(),
                });
            };
            out.push(Stored {
                offset: at,
                meta,
                body: body.to_vec(),
            });
        }
        Ok(Some(out))
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
    ) -> Result<Option<Vec<Stored>>, BrokerError> {
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
                Some(messages) if messages.is_empty() && tokio::time::Instant::now() < deadline => {
                    if tokio::time::timeout_at(deadline, notified).await.is_err() {
                        return Ok(Some(messages));
                    }
                }
                other => return Ok(other),
            }
        }
    }

    /// Stores a consumer group's offset for one queue (durably).
    pub fn commit_offset(
        &self,
        group: &str,
        topic: &str,
        queue: u32,
        offset: u64,
    ) -> Result<(), BrokerError> {
        let mut offsets = self.offsets.lock().unwrap_or_else(|p| p.into_inner());
        offsets
            .entry(group.to_string())
            .or_default()
            .entry(topic.to_string())
            .or_default()
            .insert(queue, offset);
        let bytes = serde_json::to_vec(&*offsets).unwrap_or_default();
        write_atomically(&self.dir.join("offsets"), &bytes)
    }

    /// A group's committed offsets for a topic, by queue.
    pub fn group_offsets(&self, group: &str, topic: &str) -> BTreeMap<u32, u64> {
        self.offsets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(group)
            .and_then(|g| g.get(topic))
            .cloned()
            .unwrap_or_default()
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

/// (meta, body, frame length) of the record at the start of `bytes`.
fn decode_record(bytes: &[u8]) -> Option<(StoredMeta, &[u8], u32)> {
    match frame::decode(bytes) {
        frame::Next::Frame {
            kind: Kind::Broker,
            payload,
        } => {
            let meta_len = u32::from_le_bytes(payload.get(..4)?.try_into().ok()?) as usize;
            let meta: StoredMeta = serde_json::from_slice(payload.get(4..4 + meta_len)?).ok()?;
            let body = payload.get(4 + meta_len..)?;
            Some((meta, body, (frame::HEADER_LEN + payload.len()) as u32))
        }
        _ => None,
    }
}

fn encode_unit(log_offset: u64, len: u32, key: Option<&str>) -> [u8; 20] {
    let mut unit = [0u8; 20];
    unit[..8].copy_from_slice(&log_offset.to_le_bytes());
    unit[8..12].copy_from_slice(&len.to_le_bytes());
    let tag = key.map_or(0, |k| u64::from(crc32c::crc32c(k.as_bytes())));
    unit[12..].copy_from_slice(&tag.to_le_bytes());
    unit
}

fn read_unit(queue: &Queue, index: u64) -> Result<(u64, u32, u64), BrokerError> {
    let mut unit = [0u8; 20];
    queue
        .file
        .read_exact_at(&mut unit, index * UNIT_LEN)
        .map_err(io_err(&queue.path))?;
    let u64_at = |r: std::ops::Range<usize>| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&unit[r]);
        u64::from_le_bytes(b)
    };
    let offset = u64_at(0..8);
    let tag = u64_at(12..20);
    Ok((
        offset,
        u32::from_le_bytes([unit[8], unit[9], unit[10], unit[11]]),
        tag,
    ))
}

/// The end of the valid records of a commit log, applying schedulelog's tail policy.
fn scan_end(path: &Path, bytes: &[u8]) -> Result<u64, BrokerError> {
    let body = &bytes[LOG_HEADER_LEN as usize..];
    let mut frames = Frames::new(body);
    for _ in frames.by_ref() {}
    match frames.stop() {
        Some(Stop::End { at }) if at == body.len() => Ok(LOG_HEADER_LEN + at as u64),
        Some(Stop::End { at }) | Some(Stop::Invalid { at, .. }) => {
            frame::check_torn_tail(path, body, LOG_HEADER_LEN, at, "torn broker record").map_err(
                |e| BrokerError::Corrupt {
                    path: path.to_path_buf(),
                    offset: LOG_HEADER_LEN + at as u64,
                    reason: e.to_string(),
                },
            )?;
            Ok(LOG_HEADER_LEN + at as u64)
        }
        None => Ok(bytes.len() as u64),
    }
}

fn create_topic(dir: &Path, topic: &str, queues: u32) -> Result<Topic, BrokerError> {
    if !valid_topic(topic) {
        return Err(BrokerError::Corrupt {
            path: PathBuf::from(topic),
            offset: 0,
            reason: "invalid topic name".into(),
        });
    }
    let topic_dir = dir.join("consumequeue").join(topic);
    fs::create_dir_all(&topic_dir).map_err(io_err(&topic_dir))?;
    let mut state = Topic::default();
    for queue in 0..queues {
        state.queues.push(open_queue(&topic_dir, queue)?);
    }
    sync_dir(&topic_dir)?;
    sync_dir(&dir.join("consumequeue"))?;
    Ok(state)
}

fn open_queue(topic_dir: &Path, queue: u32) -> Result<Queue, BrokerError> {
    let path = topic_dir.join(queue.to_string());
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_err(&path))?;
    let len = file.metadata().map_err(io_err(&path))?.len();
    Ok(Queue {
        file,
        path,
        units: len / UNIT_LEN,
    })
}

fn load_topics(dir: &Path, store: &mut Store) -> Result<(), BrokerError> {
    let queues_dir = dir.join("consumequeue");
    for entry in fs::read_dir(&queues_dir).map_err(io_err(&queues_dir))? {
        let entry = entry.map_err(io_err(&queues_dir))?;
        let Some(name) = entry.file_name().to_str().map(String::from) else {
            continue;
        };
        if !valid_topic(&name) {
            continue;
        }
        let mut count = 0;
        while entry.path().join(count.to_string()).exists() {
            count += 1;
        }
        let mut topic = Topic::default();
        for queue in 0..count {
            topic.queues.push(open_queue(&entry.path(), queue)?);
        }
        store.topics.insert(name, topic);
    }
    Ok(())
}

fn load_offsets(dir: &Path) -> Result<GroupOffsets, BrokerError> {
    let path = dir.join("offsets");
    match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| BrokerError::Corrupt {
            path,
            offset: 0,
            reason: e.to_string(),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(e) => Err(io_err(&path)(e)),
    }
}

fn read_checkpoint(dir: &Path) -> u64 {
    let Ok(bytes) = fs::read(dir.join("checkpoint")) else {
        return 0;
    };
    if bytes.len() != 12 || crc32c::crc32c(&bytes[..8]).to_le_bytes() != bytes[8..12] {
        return 0; // replaying from the start is always correct, only slower
    }
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(b)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), BrokerError> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, bytes)
        .and_then(|()| File::open(&tmp)?.sync_all())
        .and_then(|()| fs::rename(&tmp, path))
        .map_err(io_err(path))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

fn sync_dir(dir: &Path) -> Result<(), BrokerError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// The `broker` sink: stores each delivery in the broker, durably, before answering.
#[derive(Debug)]
pub struct BrokerSink {
    pub broker: Arc<Broker>,
    pub clock: Arc<dyn schedulelog::Clock>,
}

impl Sink for BrokerSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(async move {
            let now = self.clock.now_ms();
            let incoming: Vec<Incoming> = batch
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
                .collect();
            let broker = self.broker.clone();
            let stored = tokio::task::spawn_blocking(move || broker.append(&incoming)).await;
            match stored {
                Ok(Ok(_)) => vec![SinkOutcome::Delivered; batch.len()],
                other => {
                    let reason = match other {
                        Ok(Err(e)) => e.to_string(),
                        Err(e) => e.to_string(),
                        Ok(Ok(_)) => unreachable!("matched above"),
                    };
                    tracing::error!(%reason, "storing deliveries in the broker failed");
                    let retry = SinkOutcome::Retry {
                        after: Some(Duration::from_secs(5)),
                        reason,
                    };
                    vec![retry; batch.len()]
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn incoming(topic: &str, key: Option<&str>, body: &str) -> Incoming {
        Incoming {
            topic: topic.into(),
            id: format!("id-{body}"),
            key: key.map(String::from),
            headers: BTreeMap::new(),
            deliver_at_ms: 1,
            delivered_at_ms: 2,
            attempt: 0,
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn append_read_reopen_and_repair() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), 2).unwrap();
        let placed = broker
            .append(&[
                incoming("t", Some("k"), "a"),
                incoming("t", Some("k"), "b"),
                incoming("u", None, "c"),
            ])
            .unwrap();
        assert_eq!(placed[0].0, placed[1].0, "same key, same queue");
        assert_eq!(placed[1].1, placed[0].1 + 1);
        let q = placed[0].0;
        let read = broker.read("t", q, 0, 10).unwrap().unwrap();
        assert_eq!(
            read.iter().map(|s| s.body.clone()).collect::<Vec<_>>(),
            vec![b"a".to_vec(), b"b".to_vec()]
        );
        assert_eq!(read[1].offset, 1);
        assert_eq!(broker.read("nope", 0, 0, 10).unwrap(), None);
        drop(broker);

        // Lose the last unit of queue q: reopening restores it from the commit log.
        let path = dir.path().join(format!("broker/consumequeue/t/{q}"));
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(UNIT_LEN).unwrap();
        fs::remove_file(dir.path().join("broker/checkpoint")).unwrap();
        // And append garbage to the commit log (a torn write).
        let log = dir.path().join("broker/commitlog/00000000000000000000");
        let lf = OpenOptions::new().append(true).open(&log).unwrap();
        lf.write_all_at(&[7u8; 13], lf.metadata().unwrap().len())
            .unwrap();
        let broker = Broker::open(dir.path(), 2).unwrap();
        let read = broker.read("t", q, 0, 10).unwrap().unwrap();
        assert_eq!(read.len(), 2);
        assert_eq!(
            broker.topics(),
            vec![("t".to_string(), 2), ("u".to_string(), 2)]
        );
        broker.append(&[incoming("t", Some("k"), "d")]).unwrap();
        assert_eq!(broker.read("t", q, 2, 10).unwrap().unwrap()[0].body, b"d");
    }

    #[test]
    fn units_written_after_the_checkpoint_are_rewritten_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), 2).unwrap();
        let bodies = ["a", "b", "c", "d", "e"];
        let placed = broker
            .append(&bodies.map(|b| incoming("t", Some("k"), b)))
            .unwrap();
        let q = placed[0].0;
        drop(broker);

        // Units are not synced per append; a crash may leave them zero, torn, or the file longer than
        // what was written.
        let path = dir.path().join(format!("broker/consumequeue/t/{q}"));
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        f.write_all_at(&[0; UNIT_LEN as usize], UNIT_LEN).unwrap();
        f.write_all_at(&[9; 8], 3 * UNIT_LEN).unwrap();
        f.write_all_at(&[0; 4], 3 * UNIT_LEN + 8).unwrap();
        f.set_len(7 * UNIT_LEN).unwrap();
        // And stale bytes that look like a unit (a copy of the first) past the last record's.
        let mut first = [0; UNIT_LEN as usize];
        f.read_exact_at(&mut first, 0).unwrap();
        f.write_all_at(&first, 6 * UNIT_LEN).unwrap();

        let broker = Broker::open(dir.path(), 2).unwrap();
        let read = broker.read("t", q, 0, 10).unwrap().unwrap();
        assert_eq!(
            read.iter().map(|s| s.body.clone()).collect::<Vec<_>>(),
            bodies.map(|b| b.as_bytes().to_vec()).to_vec()
        );
        assert_eq!(
            broker.append(&[incoming("t", Some("k"), "f")]).unwrap()[0],
            (q, 5),
            "the units past the last record were cut"
        );
    }

    #[test]
    fn a_commit_log_torn_inside_its_header_is_started_afresh() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("broker/commitlog/00000000000000000000");
        fs::create_dir_all(log.parent().unwrap()).unwrap();
        let mut torn = LOG_MAGIC.to_vec();
        torn.extend([0u8; 12]);
        fs::write(&log, &torn).unwrap();
        let broker = Broker::open(dir.path(), 1).unwrap();
        broker.append(&[incoming("t", None, "after")]).unwrap();
        assert_eq!(
            broker.read("t", 0, 0, 1).unwrap().unwrap()[0].body,
            b"after"
        );
    }

    #[test]
    fn offsets_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), 1).unwrap();
        broker.commit_offset("g", "t", 0, 13).unwrap();
        drop(broker);
        let broker = Broker::open(dir.path(), 1).unwrap();
        assert_eq!(broker.group_offsets("g", "t"), BTreeMap::from([(0, 13)]));
        assert!(broker.group_offsets("other", "t").is_empty());
    }
}
