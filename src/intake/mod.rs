//! The way in for new messages, shared by the HTTP API and the MQ sources: the checks every message
//! passes before anything is written, the idempotency index of keyed messages, and scheduling through the
//! log (one group commit per call, acknowledged only after its `fdatasync`).
//!
//! Invariants:
//! - A message that fails a check is never written: the caller answers 4xx (HTTP) or makes it a dead
//!   letter (a source); either way it is not delivered.
//! - The delivery time is at most `max_delay` away; the body at most `limits.max_message_bytes`.
//! - The idempotency index (keys.rs) maps each [`MessageKey`] (sink, topic, key) to the id of its pending
//!   message: the scheduler reports each finished one (delivered, dead, cancelled) and
//!   [`Intake::start_pruning`] drops it, and an entry found finished on a lookup is dropped then. Two
//!   keyed requests for one key make one message: the check and the append happen under the index's
//!   lock. The index holds 16 bytes per key, the keys themselves stay on disk; it is rebuilt at a start
//!   from the records' starts, never their bodies.

mod keys;

use crate::disk::DiskWatch;
use crate::mq::{Targets, EXCHANGE_HEADER, REDIS_BODY};
use crate::names::{valid_name, valid_target};
use crate::scheduler::{FinishedKey, Scheduler};
use crate::timestamp::parse_rfc3339;
use keys::{KeyHash, KeyIndex, KeyIndexBuilder};
use schedulelog::{
    AppendError, Appended, Clock, EncodedMessage, Message, MessageId, MessageRef, MessageState,
    MessageStatus, ScheduleLog,
};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

pub const MAX_KEY_BYTES: usize = 1024;
pub const MAX_HEADERS: usize = 64;
pub const MAX_HEADER_VALUE_BYTES: usize = 8 * 1024;

/// Why a message is refused, with a stable code (the HTTP API's `code`, a dead letter's reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {detail}")]
pub struct Rejection {
    pub code: &'static str,
    pub detail: String,
    /// Refused for its size (HTTP 413) rather than its content (400).
    pub too_large: bool,
}

impl Rejection {
    pub fn new(code: &'static str, detail: impl Into<String>) -> Rejection {
        Rejection {
            code,
            detail: detail.into(),
            too_large: false,
        }
    }

    pub fn too_large(detail: impl Into<String>) -> Rejection {
        Rejection {
            code: "payload_too_large",
            detail: detail.into(),
            too_large: true,
        }
    }
}

/// A delivery time given as text: RFC 3339, or unix milliseconds.
pub fn deliver_at_from_text(text: &str) -> Result<i64, Rejection> {
    let text = text.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().map_err(|_| {
            Rejection::new("invalid_deliver_at", format!("{text:?} is out of range"))
        });
    }
    parse_rfc3339(text).ok_or_else(|| {
        Rejection::new(
            "invalid_deliver_at",
            format!("{text:?} is not an RFC 3339 time such as 2026-12-01T09:30:00Z, nor unix milliseconds"),
        )
    })
}

/// A delay given as text: `"30s"`-style, or milliseconds.
pub fn delay_from_text(text: &str) -> Result<Duration, Rejection> {
    let text = text.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text
            .parse()
            .map(Duration::from_millis)
            .map_err(|_| Rejection::new("invalid_delay", format!("{text:?} is out of range")));
    }
    crate::setting::parse_duration(text).map_err(|e| Rejection::new("invalid_delay", e))
}

/// A message to schedule, borrowing from the request it came in.
#[derive(Debug)]
pub struct Draft<'a> {
    pub deliver_at_ms: i64,
    pub topic: &'a str,
    pub key: Option<&'a str>,
    pub headers: Vec<(&'a str, &'a str)>,
    pub sink: &'a str,
    pub body: Cow<'a, [u8]>,
    /// With a key: while a message with this topic and key is pending, return it instead of adding one.
    pub dedup: bool,
}

/// What a new message is checked against: the limits and each configured sink's rules. Made once
/// from the configuration (`Config::admission`). A test's default refuses every message.
#[derive(Debug, Clone)]
#[cfg_attr(test, derive(Default))]
pub struct Admission {
    /// The delivery time may be at most this far away.
    pub max_delay_ms: i64,
    pub max_message_bytes: usize,
    /// By sink name; a message naming another sink is refused (`unknown_sink`).
    pub sinks: HashMap<String, SinkRules>,
}

/// What a sink asks of the messages it is given.
#[derive(Debug, Clone)]
pub struct SinkRules {
    /// The topic is checked as a target on another MQ rather than as a topic name.
    pub topic_is_target: bool,
    /// Where an MQ sink may publish; `None`: anywhere its topic check allows.
    pub targets: Option<Targets>,
    /// A header named `body` is refused (a Redis entry's body field).
    pub body_header_reserved: bool,
}

impl Draft<'_> {
    /// Every check but the delivery time's parsing (the caller's, as its format differs).
    pub fn check(&self, admission: &Admission, now_ms: i64) -> Result<(), Rejection> {
        let sink = admission.sinks.get(self.sink);
        let is_target = sink.is_some_and(|s| s.topic_is_target);
        if is_target && !valid_target(self.topic) {
            return Err(Rejection::new(
                "invalid_target",
                "the target must have 1 to 255 bytes and no whitespace or control characters",
            ));
        }
        if !is_target && !valid_name(self.topic) {
            return Err(Rejection::new(
                "invalid_topic",
                "topic must match [A-Za-z0-9._-]{1,200} and not be only dots",
            ));
        }
        if self.deliver_at_ms.saturating_sub(now_ms) > admission.max_delay_ms {
            return Err(Rejection::new(
                "delay_too_long",
                format!(
                    "the delivery time is more than max_delay ({} ms) away",
                    admission.max_delay_ms
                ),
            ));
        }
        if self.body.len() > admission.max_message_bytes {
            return Err(Rejection::too_large(format!(
                "the body has {} bytes; limits.max_message_bytes is {}",
                self.body.len(),
                admission.max_message_bytes
            )));
        }
        if let Some(key) = self.key {
            if key.is_empty() || key.len() > MAX_KEY_BYTES {
                return Err(Rejection::new(
                    "invalid_key",
                    format!("key must have 1 to {MAX_KEY_BYTES} bytes"),
                ));
            }
        }
        if self.headers.len() > MAX_HEADERS {
            return Err(Rejection::new(
                "invalid_header",
                format!("at most {MAX_HEADERS} headers"),
            ));
        }
        for (name, value) in &self.headers {
            let name_ok = (1..=256).contains(&name.len())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
            if !name_ok {
                return Err(Rejection::new(
                    "invalid_header",
                    format!("header name {name:?} must match [A-Za-z0-9._-]{{1,256}}"),
                ));
            }
            let reserved = [schedulelog::SCHEDULE_HEADER, schedulelog::FIRE_AT_HEADER];
            if reserved.iter().any(|r| name.eq_ignore_ascii_case(r)) {
                return Err(Rejection::new(
                    "invalid_header",
                    format!("header {name:?} is reserved for the firings of recurring schedules"),
                ));
            }
            if value.len() > MAX_HEADER_VALUE_BYTES || value.chars().any(char::is_control) {
                return Err(Rejection::new(
                    "invalid_header",
                    format!("header {name:?}: at most {MAX_HEADER_VALUE_BYTES} bytes and no control characters"),
                ));
            }
        }
        if self.dedup && self.key.is_none() {
            return Err(Rejection::new("invalid_key", "dedup needs a key"));
        }
        let Some(sink) = sink else {
            return Err(Rejection::new(
                "unknown_sink",
                format!("no sink named {:?} is configured", self.sink),
            ));
        };
        if let Some(targets) = &sink.targets {
            let exchange = self
                .headers
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(EXCHANGE_HEADER))
                .map(|(_, value)| *value);
            targets
                .check(self.topic, exchange)
                .map_err(|why| Rejection::new("forbidden_target", why))?;
        }
        if sink.body_header_reserved {
            if let Some((name, _)) = self.headers.iter().find(|(name, _)| *name == REDIS_BODY) {
                return Err(Rejection::new(
                    "invalid_header",
                    format!("a header named {name:?} would overwrite the Redis entry's body field"),
                ));
            }
        }
        Ok(())
    }

    pub fn encode(&self) -> Result<EncodedMessage, Rejection> {
        MessageRef {
            deliver_at_ms: self.deliver_at_ms,
            topic: self.topic,
            key: self.key,
            headers: &self.headers,
            sink: self.sink,
            body: &self.body,
            retry_of: None,
            dedup: self.dedup,
        }
        .encode()
        .map_err(|e| Rejection::too_large(e.to_string()))
    }
}

/// A message's idempotency key: the sink it goes to, its topic (an MQ sink's target) and its key. While
/// a message with `dedup` is pending, no other message gets its key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageKey {
    pub sink: String,
    pub topic: String,
    pub key: String,
}

impl MessageKey {
    /// Whether `message` (a record read back) has this key.
    fn names(&self, message: &Message) -> bool {
        message.dedup
            && message.sink == self.sink
            && message.topic == self.topic
            && message.key.as_deref() == Some(self.key.as_str())
    }
}

/// What scheduling a keyed message did.
#[derive(Debug)]
pub enum Keyed {
    /// A new message.
    Scheduled(Appended),
    /// A message with this key is pending: it is the answer, nothing was written.
    Pending(MessageId, Box<MessageStatus>),
}

/// Why scheduling failed: nothing of it is acknowledged.
#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    #[error(transparent)]
    Append(#[from] AppendError),
    #[error(transparent)]
    Lookup(#[from] schedulelog::Error),
    #[error("a lookup was interrupted: {0}")]
    Interrupted(String),
    /// The index of idempotency keys is not rebuilt yet: its rebuild at the start waits while a full
    /// disk holds the replayer up (it reads every pending keyed message, and must not miss one).
    #[error("keyed messages are refused until the index of idempotency keys is rebuilt, once the disk has room")]
    KeysNotReady,
    /// A write with this key was answered [`AppendError::Uncertain`] and is not filed yet: it may
    /// still take effect, so whether a message with the key is pending is not known.
    #[error("a write with this idempotency key was answered write_uncertain and has not settled yet: it may still take effect; resend in a moment")]
    KeyUnsettled,
}

/// The idempotency index, and whether it holds every pending key yet.
#[derive(Debug)]
struct Keys {
    index: KeyIndex,
    complete: bool,
    /// The keys of writes answered [`AppendError::Uncertain`] (a cluster member's: proposed, not seen
    /// committed in time). Such a write may still be committed, in this leader's term (a leader never
    /// drops its own entries; another leader's term starts a new intake, whose index is rebuilt from
    /// the files), so a message sent again with one of its keys is refused
    /// ([`IntakeError::KeyUnsettled`]) until [`settle`] knows: once the log has filed every seq the
    /// write could have, its records found there go into the index and its keys leave this set.
    unsettled: HashSet<MessageKey>,
}

impl Keys {
    fn complete(&mut self) -> Result<&mut KeyIndex, IntakeError> {
        match self.complete {
            true => Ok(&mut self.index),
            false => Err(IntakeError::KeysNotReady),
        }
    }
}

/// The services new messages go through.
#[derive(Debug)]
pub struct Intake {
    pub log: Arc<ScheduleLog>,
    pub scheduler: Arc<Scheduler>,
    pub admission: Admission,
    pub clock: Arc<dyn Clock>,
    /// Whether new messages are refused for want of disk space.
    pub disk: Arc<DiskWatch>,
    /// Locked from a keyed message's check to its append, so that two with one key make one message.
    keys: Arc<tokio::sync::Mutex<Keys>>,
}

impl Intake {
    /// Rebuilds the idempotency index from the pending keyed messages (blocking: call it off the async
    /// threads). While a full disk holds the replayer up the index cannot be rebuilt: the intake opens
    /// without it, refuses keyed messages ([`IntakeError::KeysNotReady`]), and [`Intake::start_pruning`]
    /// rebuilds it once the disk has room.
    pub fn open(
        log: Arc<ScheduleLog>,
        scheduler: Arc<Scheduler>,
        admission: Admission,
        clock: Arc<dyn Clock>,
        disk: Arc<DiskWatch>,
    ) -> Result<Intake, schedulelog::Error> {
        let keys = match rebuild_keys(&log) {
            Ok(index) => Keys {
                index,
                complete: true,
                unsettled: HashSet::new(),
            },
            Err(schedulelog::Error::NotFiledYet { cause }) => {
                tracing::warn!(cause = cause.as_deref().unwrap_or("the replayer is behind"), "the index of idempotency keys waits for the disk: keyed messages are refused until it is rebuilt");
                Keys {
                    index: KeyIndex::new(),
                    complete: false,
                    unsettled: HashSet::new(),
                }
            }
            Err(e) => return Err(e),
        };
        Ok(Intake {
            log,
            scheduler,
            admission,
            clock,
            disk,
            keys: Arc::new(tokio::sync::Mutex::new(keys)),
        })
    }

    /// Completes the idempotency index if the start could not, then lets it forget each key once its
    /// message is finished, as the scheduler reports them. Runs once per scheduler (later calls do
    /// nothing); reports made before wait.
    pub fn start_pruning(&self) {
        if let Some(finished) = self.scheduler.take_finished_keys() {
            tokio::spawn(maintain_keys(self.log.clone(), self.keys.clone(), finished));
        }
    }

    /// Appends checked messages in one group commit; answers once it is durable.
    pub async fn schedule(
        &self,
        messages: Vec<EncodedMessage>,
    ) -> Result<Vec<Appended>, AppendError> {
        self.log.append(messages).await
    }

    /// Schedules a message sent with `dedup` and a key, unless one with its key is pending.
    pub async fn schedule_keyed(
        &self,
        key: &MessageKey,
        message: EncodedMessage,
    ) -> Result<Keyed, IntakeError> {
        self.start_pruning();
        // Check and append under one lock, so that two requests with one key make one message.
        let mut keys = self.keys.clone().lock_owned().await;
        let hash = keys.complete()?.hash(&key.sink, &key.topic, &key.key);
        if let Some((id, status)) = self.pending_with(&mut keys, hash, key).await? {
            return Ok(Keyed::Pending(id, status));
        }
        let unsettled = self.unsettled(vec![key.clone()]);
        let ack = self.log.append(vec![message]);
        let appended = file_when_durable(ack, keys, unsettled, move |index, appended| {
            if let Some(one) = appended.first() {
                index.insert(hash, one.id);
            }
        })
        .await?;
        let appended = appended
            .into_iter()
            .next()
            .ok_or_else(|| IntakeError::Interrupted("an append returned no id".into()))?;
        Ok(Keyed::Scheduled(appended))
    }

    /// Schedules messages in one group commit, in order. One with a key is left out (`None`) while a
    /// message with that key is pending, or an earlier one of this call has it.
    pub async fn schedule_all(
        &self,
        messages: Vec<(Option<MessageKey>, EncodedMessage)>,
    ) -> Result<Vec<Option<Appended>>, IntakeError> {
        self.start_pruning();
        // Checked and appended under one lock, as `schedule_keyed`, when any message has a key.
        let mut keys = match messages.iter().any(|(key, _)| key.is_some()) {
            true => Some(self.keys.clone().lock_owned().await),
            false => None,
        };
        if let Some(keys) = keys.as_mut() {
            keys.complete()?;
        }
        let mut kept = Vec::with_capacity(messages.len());
        let mut encoded = Vec::with_capacity(messages.len());
        let mut this_call = HashSet::new();
        let mut unsettled = Vec::new();
        for (key, message) in messages {
            let filed = match (&key, keys.as_mut()) {
                (Some(key), Some(keys)) => {
                    let hash = keys.index.hash(&key.sink, &key.topic, &key.key);
                    let first = this_call.insert(key.clone());
                    match first && self.pending_with(keys, hash, key).await?.is_none() {
                        true => Some(Some(hash)),
                        false => None,
                    }
                }
                _ => Some(None),
            };
            if filed.is_some() {
                encoded.push(message);
            }
            // Its key, moved (not copied), for the case the write is answered uncertain.
            if let (Some(Some(_)), Some(key)) = (filed, key) {
                unsettled.push(key);
            }
            kept.push(filed);
        }
        let hashes: Vec<Option<KeyHash>> = kept.iter().flatten().copied().collect();
        let appended = match (encoded.is_empty(), keys) {
            (true, _) => Vec::new(),
            (false, Some(keys)) => {
                let unsettled = self.unsettled(unsettled);
                let ack = self.log.append(encoded);
                file_when_durable(ack, keys, unsettled, move |index, appended| {
                    for (hash, one) in hashes.iter().zip(appended) {
                        if let Some(hash) = hash {
                            index.insert(*hash, one.id);
                        }
                    }
                })
                .await?
            }
            (false, None) => self.log.append(encoded).await?,
        };
        let mut appended = appended.into_iter();
        let mut answers = Vec::with_capacity(kept.len());
        for filed in kept {
            if filed.is_none() {
                answers.push(None);
                continue;
            }
            let one = appended
                .next()
                .ok_or_else(|| IntakeError::Interrupted("an append returned too few ids".into()))?;
            answers.push(Some(one));
        }
        Ok(answers)
    }

    /// The pending message with this key, if any.
    pub async fn pending_with_key(
        &self,
        key: &MessageKey,
    ) -> Result<Option<MessageId>, IntakeError> {
        let mut keys = self.keys.lock().await;
        let hash = keys.complete()?.hash(&key.sink, &key.topic, &key.key);
        Ok(self
            .pending_with(&mut keys, hash, key)
            .await?
            .map(|(id, _)| id))
    }

    /// The pending message with `key` (whose hash is `hash`), as [`Intake::pending_of`] finds it;
    /// [`IntakeError::KeyUnsettled`] while a write with the key is in doubt (`Keys::unsettled`).
    async fn pending_with(
        &self,
        keys: &mut Keys,
        hash: KeyHash,
        key: &MessageKey,
    ) -> Result<Option<(MessageId, Box<MessageStatus>)>, IntakeError> {
        if keys.unsettled.contains(key) {
            return Err(IntakeError::KeyUnsettled);
        }
        self.pending_of(keys.complete()?, hash, key).await
    }

    /// What settles the keys of a keyed write about to be appended, should it be answered
    /// `Uncertain`: its records' seqs are this or above.
    fn unsettled(&self, keys: Vec<MessageKey>) -> Unsettled {
        Unsettled {
            keys,
            from: self.log.filed_below(),
            log: Arc::downgrade(&self.log),
            index: Arc::downgrade(&self.keys),
        }
    }

    /// The pending message with `key` among the index's candidates for its `hash`, read from disk.
    /// Candidates found finished (or gone) are removed; another key's (a hash collision) are kept.
    async fn pending_of(
        &self,
        index: &mut KeyIndex,
        hash: KeyHash,
        key: &MessageKey,
    ) -> Result<Option<(MessageId, Box<MessageStatus>)>, IntakeError> {
        for id in index.candidates(hash) {
            match self.lookup(id).await? {
                Some(status) if !key.names(&status.message) => {}
                Some(status) if status.state == MessageState::Pending => {
                    return Ok(Some((id, Box::new(status))));
                }
                _ => {
                    index.remove(hash, id);
                }
            }
        }
        Ok(None)
    }

    /// Finds a message by id off the async threads.
    pub async fn lookup(&self, id: MessageId) -> Result<Option<MessageStatus>, IntakeError> {
        let log = self.log.clone();
        Ok(tokio::task::spawn_blocking(move || log.lookup(id))
            .await
            .map_err(|e| IntakeError::Interrupted(e.to_string()))??)
    }
}

/// The idempotency index of the pending keyed messages, read from the log (their starts, not their
/// bodies). `NotFiledYet` while a full disk holds the replayer up.
fn rebuild_keys(log: &ScheduleLog) -> Result<KeyIndex, schedulelog::Error> {
    let mut builder = KeyIndexBuilder::default();
    log.pending_keyed(|meta| match meta {
        Ok(meta) => {
            if let Some(key) = &meta.key {
                let hash = builder.hash(&meta.sink, &meta.topic, key);
                builder.add(hash, meta.id);
            }
        }
        // It cannot be delivered either (the lanes count it in delayd_unreadable_messages): a new
        // message with its key is taken.
        Err(error) => {
            tracing::error!(%error, "a pending keyed message is unreadable; its key is left out of the index")
        }
    })?;
    let index = builder.build();
    report_size(&index);
    Ok(index)
}

/// `delayd_key_index_entries` and `delayd_key_index_bytes`.
fn report_size(index: &KeyIndex) {
    metrics::gauge!("delayd_key_index_entries").set(index.len() as f64);
    metrics::gauge!("delayd_key_index_bytes").set(index.heap_bytes() as f64);
}

/// Waits for an append made under the index's lock, and files its ids in the index (`file`) before the
/// lock is let go, in a task of its own: a caller that stops waiting (an HTTP client gone, a handler
/// dropped) must not leave messages it appended out of the index, where a retry with their key would
/// not find them and would schedule each again. An append answered `Uncertain` leaves its keys
/// unsettled instead (`Keys::unsettled`), for [`settle`] to settle.
async fn file_when_durable(
    ack: schedulelog::Ack<Vec<Appended>>,
    mut keys: tokio::sync::OwnedMutexGuard<Keys>,
    unsettled: Unsettled,
    file: impl FnOnce(&mut KeyIndex, &[Appended]) + Send + 'static,
) -> Result<Vec<Appended>, IntakeError> {
    let filed = tokio::spawn(async move {
        let appended = match ack.await {
            Ok(appended) => appended,
            Err(AppendError::Uncertain { seqs_below }) => {
                keys.unsettled.extend(unsettled.keys.iter().cloned());
                tokio::spawn(settle(unsettled, seqs_below));
                return Err(AppendError::Uncertain { seqs_below }.into());
            }
            Err(other) => return Err(other.into()),
        };
        file(&mut keys.index, &appended);
        Ok(appended)
    });
    filed
        .await
        .map_err(|e| IntakeError::Interrupted(format!("filing keyed messages failed: {e}")))?
}

/// The keys of a keyed write, and what [`settle`] needs should the write be answered `Uncertain`.
struct Unsettled {
    keys: Vec<MessageKey>,
    /// The log's `filed_below` before the append: the write's records have this seq or above.
    from: u64,
    /// Weak: a write in doubt holds neither the log open nor the intake of a term that ended.
    log: std::sync::Weak<ScheduleLog>,
    index: std::sync::Weak<tokio::sync::Mutex<Keys>>,
}

/// How often [`settle`] looks whether the log has filed as far as a write in doubt could reach.
const SETTLE_POLL: Duration = Duration::from_millis(50);

/// Settles the keys of a write answered `Uncertain`, whose records (if it took effect) have seqs in
/// `from..seqs_below`: once the log has filed below `seqs_below` (the write was committed, or
/// another's records took its seqs), the records with those keys filed in that range go into the
/// index, and the keys are taken again. The range is the few entries proposed meanwhile (a
/// proposer proposes nothing while a write is in doubt), read right away. Ends early once the
/// intake (its term) or the log is gone.
async fn settle(unsettled: Unsettled, seqs_below: u64) {
    let found = loop {
        if unsettled.index.strong_count() == 0 {
            return;
        }
        let Some(log) = unsettled.log.upgrade() else {
            return;
        };
        if log.filed_below() < seqs_below {
            drop(log);
            tokio::time::sleep(SETTLE_POLL).await;
            continue;
        }
        let (keys, from) = (unsettled.keys.clone(), unsettled.from);
        let scanned = tokio::task::spawn_blocking(move || {
            let sinks: HashSet<&str> = keys.iter().map(|k| k.sink.as_str()).collect();
            let mut found = Vec::new();
            for sink in sinks {
                log.records_since(from, sink, |meta| {
                    let Ok(meta) = meta else { return };
                    if meta.seq >= seqs_below || !meta.dedup || meta.attempt != 0 {
                        return;
                    }
                    let named = keys.iter().find(|k| {
                        k.sink == meta.sink
                            && k.topic == meta.topic
                            && meta.key.as_deref() == Some(k.key.as_str())
                    });
                    if let Some(key) = named {
                        found.push((key.clone(), meta.id));
                    }
                })?;
            }
            Ok::<_, schedulelog::Error>(found)
        })
        .await;
        match scanned {
            Ok(Ok(found)) => break found,
            Ok(Err(error)) => {
                tracing::warn!(%error, "reading back a write in doubt failed; its keys stay refused, trying again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(error) => {
                tracing::error!(%error, "reading back a write in doubt panicked; trying again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let Some(keys) = unsettled.index.upgrade() else {
        return;
    };
    let mut keys = keys.lock().await;
    for (key, id) in found {
        let hash = keys.index.hash(&key.sink, &key.topic, &key.key);
        keys.index.insert(hash, id);
    }
    for key in &unsettled.keys {
        keys.unsettled.remove(key);
    }
}

/// Rebuilds the index if the start could not (retrying each second), then drops each finished
/// message's key from it, until the scheduler is gone.
async fn maintain_keys(
    log: Arc<ScheduleLog>,
    keys: Arc<tokio::sync::Mutex<Keys>>,
    mut finished: tokio::sync::mpsc::UnboundedReceiver<FinishedKey>,
) {
    while !keys.lock().await.complete {
        let log = log.clone();
        match tokio::task::spawn_blocking(move || rebuild_keys(&log)).await {
            Ok(Ok(index)) => {
                tracing::info!(
                    keys = index.len(),
                    "the index of idempotency keys is rebuilt: keyed messages are taken again"
                );
                let mut keys = keys.lock().await;
                (keys.index, keys.complete) = (index, true);
            }
            Ok(Err(error)) => {
                tracing::debug!(%error, "the index of idempotency keys still waits");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(error) => {
                tracing::error!(%error, "rebuilding the index of idempotency keys panicked; trying again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    while let Some(first) = finished.recv().await {
        let mut keys = keys.lock().await;
        let index = &mut keys.index;
        let mut next = Some(first);
        while let Some(done) = next {
            // Only this message's entry: the key may name a newer pending message by now.
            let hash = index.hash(&done.sink, &done.topic, &done.key);
            index.remove(hash, done.id);
            next = finished.try_recv().ok();
        }
        report_size(index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedulelog::{Bucket, Location};

    fn id(seq: u64) -> MessageId {
        MessageId::new(Location {
            bucket: Bucket::from_start_minute(29_935_260),
            seq,
        })
    }

    /// A finished message's key leaves the index; a key that names a newer message stays.
    #[test]
    fn finished_keys_leave_the_idempotency_index() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let log = Arc::new(ScheduleLog::open(dir.path(), schedulelog::Options::default()).unwrap());
        let mut index = KeyIndex::new();
        for (sink, topic, key, seq) in [
            ("s", "t", "a", 1),
            ("s", "t", "b", 3), // b was sent again after message 2 finished
            ("s", "u", "a", 4),
            ("r", "t", "a", 5), // another sink's key
        ] {
            let hash = index.hash(sink, topic, key);
            index.insert(hash, id(seq));
        }
        let keys = Arc::new(tokio::sync::Mutex::new(Keys {
            index,
            complete: true,
            unsettled: HashSet::new(),
        }));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let finished = |topic: &str, k: &str, seq| FinishedKey {
            sink: "s".into(),
            topic: topic.into(),
            key: k.into(),
            id: id(seq),
        };
        tx.send(finished("t", "a", 1)).unwrap();
        tx.send(finished("t", "b", 2)).unwrap();
        drop(tx); // the pruning ends with the scheduler
        runtime.block_on(maintain_keys(log, keys.clone(), rx));
        let keys = runtime.block_on(keys.lock());
        let left = |sink, topic, key| keys.index.candidates(keys.index.hash(sink, topic, key));
        assert!(left("s", "t", "a").is_empty());
        assert_eq!(left("s", "t", "b"), [id(3)]);
        assert_eq!(left("s", "u", "a"), [id(4)]);
        assert_eq!(left("r", "t", "a"), [id(5)]);
        assert_eq!(keys.index.len(), 3);
    }

    /// An intake over a new log in a temporary dir, with a runtime to drive it and a clock that does
    /// not move.
    struct Harness {
        runtime: tokio::runtime::Runtime,
        intake: Intake,
        _dir: tempfile::TempDir,
    }

    const NOW: i64 = 1_796_117_400_000;

    fn harness(index: KeyIndex) -> Harness {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let log = Arc::new(ScheduleLog::open(dir.path(), schedulelog::Options::default()).unwrap());
        let clock: Arc<dyn Clock> = Arc::new(schedulelog::ManualClock::new(NOW));
        let scheduler = Scheduler::start(
            log.clone(),
            &crate::sink::SinkRegistry::new(),
            crate::scheduler::SchedulerConfig::default(),
            clock.clone(),
            runtime.handle(),
        )
        .unwrap();
        let intake = Intake {
            log,
            scheduler: Arc::new(scheduler),
            admission: Admission::default(),
            clock,
            disk: Arc::new(DiskWatch::new(dir.path().into(), 0)),
            keys: Arc::new(tokio::sync::Mutex::new(Keys {
                index,
                complete: true,
                unsettled: HashSet::new(),
            })),
        };
        Harness {
            runtime,
            intake,
            _dir: dir,
        }
    }

    fn key(key: &str) -> MessageKey {
        MessageKey {
            sink: "s".into(),
            topic: "t".into(),
            key: key.into(),
        }
    }

    /// Due in an hour: pending all through a test (the clock does not move).
    fn message(key: &str) -> EncodedMessage {
        MessageRef {
            deliver_at_ms: NOW + 3_600_000,
            topic: "t",
            key: Some(key),
            sink: "s",
            body: key.as_bytes(),
            dedup: true,
            ..Default::default()
        }
        .encode()
        .unwrap()
    }

    /// Two keys under one hash (a collision, forced here): each finds its own pending message and never
    /// the other's, and a candidate of the other key is kept, not pruned.
    #[test]
    fn keys_that_share_a_hash_stay_apart() {
        let harness = harness(KeyIndex::colliding());
        let intake = &harness.intake;
        harness.runtime.block_on(async {
            let scheduled = |keyed| match keyed {
                Keyed::Scheduled(appended) => appended.id,
                Keyed::Pending(id, _) => panic!("taken for the pending {id}"),
            };
            let a = scheduled(
                intake
                    .schedule_keyed(&key("a"), message("a"))
                    .await
                    .unwrap(),
            );
            let b = scheduled(
                intake
                    .schedule_keyed(&key("b"), message("b"))
                    .await
                    .unwrap(),
            );
            assert_ne!(a, b);
            match intake
                .schedule_keyed(&key("a"), message("a"))
                .await
                .unwrap()
            {
                Keyed::Pending(id, _) => assert_eq!(id, a),
                Keyed::Scheduled(_) => panic!("a second message for key a"),
            }
            assert_eq!(intake.pending_with_key(&key("b")).await.unwrap(), Some(b));
            assert_eq!(intake.pending_with_key(&key("c")).await.unwrap(), None);
            let all = intake
                .schedule_all(vec![
                    (Some(key("b")), message("b")),
                    (Some(key("c")), message("c")),
                    (Some(key("c")), message("c")),
                ])
                .await
                .unwrap();
            assert!(all[0].is_none(), "b is pending");
            assert!(all[1].is_some(), "c is new, though its hash is a's and b's");
            assert!(all[2].is_none(), "c twice in one call");
            assert_eq!(intake.keys.lock().await.index.len(), 3);
        });
    }

    /// Polls a future once: whether it finished then, and with what.
    async fn poll_once<F: std::future::Future>(
        mut call: std::pin::Pin<&mut F>,
    ) -> std::task::Poll<F::Output> {
        std::future::poll_fn(|cx| std::task::Poll::Ready(call.as_mut().poll(cx))).await
    }

    /// A caller that stops waiting for its keyed append (an HTTP client that went away) still leaves
    /// the message in the index once it is durable: a retry with the key finds it, and makes no second.
    #[test]
    fn a_keyed_append_whose_caller_stopped_waiting_is_still_indexed() {
        let harness = harness(KeyIndex::new());
        let intake = &harness.intake;
        harness.runtime.block_on(async {
            for (name, schedule) in [("keyed", true), ("batch", false)] {
                let k = key(name);
                let submitted = match schedule {
                    true => {
                        let call = intake.schedule_keyed(&k, message(name));
                        tokio::pin!(call);
                        poll_once(call.as_mut()).await.is_pending()
                    }
                    false => {
                        let call = intake.schedule_all(vec![(Some(k.clone()), message(name))]);
                        tokio::pin!(call);
                        poll_once(call.as_mut()).await.is_pending()
                    }
                };
                assert!(submitted, "{name}: the append waits for its fsync");
                // The call is dropped; its append goes on, and is found by its key once durable.
                let found = intake.pending_with_key(&k).await.unwrap();
                let found = found.unwrap_or_else(|| panic!("{name}: the appended message is lost"));
                match intake.schedule_keyed(&k, message(name)).await.unwrap() {
                    Keyed::Pending(id, _) => assert_eq!(id, found, "{name}"),
                    Keyed::Scheduled(_) => panic!("{name}: a second message for the key"),
                }
            }
        });
    }

    #[test]
    fn times_and_delays_as_text() {
        assert_eq!(deliver_at_from_text("1796117400123"), Ok(1_796_117_400_123));
        assert_eq!(
            deliver_at_from_text("2026-12-01T09:30:00.123Z"),
            Ok(1_796_117_400_123)
        );
        assert_eq!(
            deliver_at_from_text("tomorrow").unwrap_err().code,
            "invalid_deliver_at"
        );
        assert_eq!(
            deliver_at_from_text("99999999999999999999")
                .unwrap_err()
                .code,
            "invalid_deliver_at"
        );
        assert_eq!(delay_from_text("1500"), Ok(Duration::from_millis(1500)));
        assert_eq!(delay_from_text("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(delay_from_text("-5").unwrap_err().code, "invalid_delay");
    }
}
