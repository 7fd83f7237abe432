//! The way in for new messages, shared by the HTTP API and the MQ sources: the checks every message
//! passes before anything is written, the idempotency index of keyed messages, and scheduling through the
//! log (one group commit per call, acknowledged only after its `fdatasync`).
//!
//! Invariants:
//! - A message that fails a check is never written: the caller answers 4xx (HTTP) or makes it a dead
//!   letter (a source); either way it is not delivered.
//! - The delivery time is at most `max_delay` away; the body at most `limits.max_message_bytes`.
//! - The idempotency index holds `(topic, key) → id` only while that message is pending: the scheduler
//!   reports each finished one (delivered, dead, cancelled) and [`Intake::start_pruning`] drops it. Two
//!   keyed requests for one `(topic, key)` make one message: the check and the append happen under the
//!   index's lock.

use crate::config::Config;
use crate::disk::DiskWatch;
use crate::format::{parse_rfc3339, valid_name, valid_target};
use crate::scheduler::{FinishedKey, Scheduler};
use schedulelog::{
    AppendError, Appended, Clock, EncodedMessage, MessageId, MessageRef, MessageState,
    MessageStatus, ScheduleLog,
};
use std::borrow::Cow;
use std::collections::HashMap;
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
    crate::config::parse_duration(text).map_err(|e| Rejection::new("invalid_delay", e))
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

impl Draft<'_> {
    /// Every check but the delivery time's parsing (the caller's, as its format differs).
    pub fn check(&self, config: &Config, now_ms: i64) -> Result<(), Rejection> {
        let mq = config.sinks.get(self.sink).is_some_and(|s| s.is_mq());
        if mq && !valid_target(self.topic) {
            return Err(Rejection::new(
                "invalid_target",
                "the target must have 1 to 255 bytes and no whitespace or control characters",
            ));
        }
        if !mq && !valid_name(self.topic) {
            return Err(Rejection::new(
                "invalid_topic",
                "topic must match [A-Za-z0-9._-]{1,200} and not be only dots",
            ));
        }
        if self.deliver_at_ms.saturating_sub(now_ms) > config.max_delay.as_ms() {
            return Err(Rejection::new(
                "delay_too_long",
                format!(
                    "the delivery time is more than max_delay ({} ms) away",
                    config.max_delay.as_ms()
                ),
            ));
        }
        if self.body.len() > config.limits.max_message_bytes {
            return Err(Rejection::too_large(format!(
                "the body has {} bytes; limits.max_message_bytes is {}",
                self.body.len(),
                config.limits.max_message_bytes
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
        if !config.sinks.contains_key(self.sink) {
            return Err(Rejection::new(
                "unknown_sink",
                format!("no sink named {:?} is configured", self.sink),
            ));
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

/// (topic, key) → message id, for pending messages sent with `dedup`.
pub type KeyIndex = HashMap<(String, String), MessageId>;

/// What scheduling a keyed message did.
#[derive(Debug)]
pub enum Keyed {
    /// A new message.
    Scheduled(Appended),
    /// A message with this topic and key is pending: it is the answer, nothing was written.
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
}

/// The services new messages go through.
#[derive(Debug)]
pub struct Intake {
    pub log: Arc<ScheduleLog>,
    pub scheduler: Arc<Scheduler>,
    pub config: Arc<Config>,
    pub clock: Arc<dyn Clock>,
    /// Whether new messages are refused for want of disk space.
    pub disk: Arc<DiskWatch>,
    pub keys: Arc<tokio::sync::Mutex<KeyIndex>>,
}

impl Intake {
    /// Rebuilds the idempotency index from the pending keyed messages.
    pub fn open(
        log: Arc<ScheduleLog>,
        scheduler: Arc<Scheduler>,
        config: Arc<Config>,
        clock: Arc<dyn Clock>,
        disk: Arc<DiskWatch>,
    ) -> Result<Intake, schedulelog::Error> {
        let keys: KeyIndex = log
            .pending_dedup()?
            .into_iter()
            .filter_map(|(_, m)| Some(((m.topic, m.key?), m.id)))
            .collect();
        Ok(Intake {
            log,
            scheduler,
            config,
            clock,
            disk,
            keys: Arc::new(tokio::sync::Mutex::new(keys)),
        })
    }

    /// Lets the idempotency index forget each key once its message is finished, as the scheduler
    /// reports them. Runs once per scheduler (later calls do nothing); reports made before wait.
    pub fn start_pruning(&self) {
        if let Some(finished) = self.scheduler.take_finished_keys() {
            tokio::spawn(prune_keys(self.keys.clone(), finished));
        }
    }

    /// Appends checked messages in one group commit; answers once it is durable.
    pub async fn schedule(
        &self,
        messages: Vec<EncodedMessage>,
    ) -> Result<Vec<Appended>, AppendError> {
        self.log.append(messages).await
    }

    /// Schedules a message sent with `dedup` and a key, unless one with its topic and key is pending.
    pub async fn schedule_keyed(
        &self,
        topic: &str,
        key: &str,
        message: EncodedMessage,
    ) -> Result<Keyed, IntakeError> {
        self.start_pruning();
        // Check and append under one lock, so that two requests with one key make one message.
        let mut index = self.keys.lock().await;
        let index_key = (topic.to_string(), key.to_string());
        if let Some(existing) = index.get(&index_key).copied() {
            match self.lookup(existing).await? {
                Some(status) if status.state == MessageState::Pending => {
                    return Ok(Keyed::Pending(existing, Box::new(status)));
                }
                _ => {
                    index.remove(&index_key);
                }
            }
        }
        let appended = self.log.append(vec![message]).await?;
        let appended = appended
            .into_iter()
            .next()
            .ok_or_else(|| IntakeError::Interrupted("an append returned no id".into()))?;
        index.insert(index_key, appended.id);
        Ok(Keyed::Scheduled(appended))
    }

    /// Schedules messages in one group commit, in order. One with a `(topic, key)` is left out (`None`)
    /// while a message with that topic and key is pending, or an earlier one of this call has them.
    pub async fn schedule_all(
        &self,
        messages: Vec<(Option<(String, String)>, EncodedMessage)>,
    ) -> Result<Vec<Option<Appended>>, IntakeError> {
        self.start_pruning();
        // Checked and appended under one lock, as `schedule_keyed`, when any message has a key.
        let mut index = match messages.iter().any(|(key, _)| key.is_some()) {
            true => Some(self.keys.lock().await),
            false => None,
        };
        let mut kept = Vec::with_capacity(messages.len());
        let mut encoded = Vec::with_capacity(messages.len());
        let mut this_call = std::collections::HashSet::new();
        for (key, message) in messages {
            let keep = match (&key, index.as_mut()) {
                (Some(key), Some(index)) => {
                    if !this_call.insert(key.clone()) {
                        false
                    } else if let Some(existing) = index.get(key).copied() {
                        match self.lookup(existing).await? {
                            Some(status) if status.state == MessageState::Pending => false,
                            _ => {
                                index.remove(key);
                                true
                            }
                        }
                    } else {
                        true
                    }
                }
                _ => true,
            };
            if keep {
                encoded.push(message);
            }
            kept.push((keep, key));
        }
        let mut appended = match encoded.is_empty() {
            true => Vec::new(),
            false => self.log.append(encoded).await?,
        }
        .into_iter();
        let mut answers = Vec::with_capacity(kept.len());
        for (keep, key) in kept {
            if !keep {
                answers.push(None);
                continue;
            }
            let one = appended
                .next()
                .ok_or_else(|| IntakeError::Interrupted("an append returned too few ids".into()))?;
            if let (Some(key), Some(index)) = (key, index.as_mut()) {
                index.insert(key, one.id);
            }
            answers.push(Some(one));
        }
        Ok(answers)
    }

    /// The pending message with this topic and key, if any.
    pub async fn pending_with_key(&self, topic: &str, key: &str) -> Option<MessageId> {
        self.keys
            .lock()
            .await
            .get(&(topic.to_string(), key.to_string()))
            .copied()
    }

    /// Finds a message by id off the async threads.
    pub async fn lookup(&self, id: MessageId) -> Result<Option<MessageStatus>, IntakeError> {
        let log = self.log.clone();
        Ok(tokio::task::spawn_blocking(move || log.lookup(id))
            .await
            .map_err(|e| IntakeError::Interrupted(e.to_string()))??)
    }
}

/// Drops each finished message's key from the index, until the scheduler is gone.
async fn prune_keys(
    index: Arc<tokio::sync::Mutex<KeyIndex>>,
    mut finished: tokio::sync::mpsc::UnboundedReceiver<FinishedKey>,
) {
    while let Some(first) = finished.recv().await {
        let mut index = index.lock().await;
        let mut next = Some(first);
        while let Some(done) = next {
            let key = (done.topic, done.key);
            // Only this message's entry: the key may name a newer pending message by now.
            if index.get(&key) == Some(&done.id) {
                index.remove(&key);
            }
            next = finished.try_recv().ok();
        }
        // A map keeps its capacity; give memory back once most of it is unused.
        if index.capacity() > 1024 && index.len() < index.capacity() / 4 {
            index.shrink_to_fit();
        }
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

    fn key(topic: &str, key: &str) -> (String, String) {
        (topic.to_string(), key.to_string())
    }

    /// A finished message's key leaves the index; a key that names a newer message stays.
    #[test]
    fn finished_keys_leave_the_idempotency_index() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let index = Arc::new(tokio::sync::Mutex::new(KeyIndex::from([
            (key("t", "a"), id(1)),
            (key("t", "b"), id(3)), // b was sent again after message 2 finished
            (key("u", "a"), id(4)),
        ])));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let finished = |topic: &str, k: &str, seq| FinishedKey {
            topic: topic.into(),
            key: k.into(),
            id: id(seq),
        };
        tx.send(finished("t", "a", 1)).unwrap();
        tx.send(finished("t", "b", 2)).unwrap();
        drop(tx); // the pruning ends with the scheduler
        runtime.block_on(prune_keys(index.clone(), rx));
        let index = runtime.block_on(index.lock());
        assert_eq!(
            *index,
            KeyIndex::from([(key("t", "b"), id(3)), (key("u", "a"), id(4))])
        );
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
