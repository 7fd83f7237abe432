//! Record payloads: message, cancel and outcome. All integers little-endian.
//!
//! ```text
//! message (frame kind 1)
//! 0   8  seq            u64  WAL sequence of this record
//! 8   8  deliver_at_ms  i64  unix ms
//! 16  8  created_at_ms  i64  unix ms, the WAL commit time
//! 24  4  id bucket      u32  first attempt's bucket start minute  } the message id (see id.rs);
//! 28  8  id seq         u64  first attempt's seq                   } for attempt 0 it is this record
//! 36  2  attempt        u16  0 for the first attempt
//! 38  2  shard          u16
//! 40  1  topic len, then topic (UTF-8)
//! ..  1  sink len, then sink name (UTF-8)
//! ..  2  key len u16: 0xFFFF = no key; else bits 0..15 the length (at most 32767) and bit 15 set
//!        when the key is an idempotency key (`dedup`); then the key (UTF-8)
//! ..  2  header count u16, then per header: name len u16, name, value len u32, value (UTF-8)
//! ..  4  body len u32, then body bytes
//!
//! cancel (frame kind 2)
//! 0   8  seq            u64  WAL sequence of this record
//! 8   8  created_at_ms  i64
//! 16  4  target bucket  u32  location of the attempt being cancelled
//! 20  8  target seq     u64
//!
//! outcome (frame kind 3, dispatch logs only)
//! 0   8  seq            u64  the record (in this bucket) the outcome is for
//! 8   1  kind           u8   1 delivered, 2 dead, 3 cancelled, 4 retried, 5 discarded (a dead one put away)
//! 9   8  at_ms          i64  when it happened
//! 17  2  attempt        u16  the attempt the outcome is for
//! 19  4  next bucket    u32  } retried: where the next attempt lives; 0 otherwise
//! 23  8  next seq       u64  }
//! 31  2  reason len u16, then reason (UTF-8)
//! ```
//!
//! Schedules (schedules.rs) travel as message records too, so that they are written, replicated and
//! recovered exactly as messages are: an op on a schedule is a message for the reserved sink
//! [`SCHEDULE_SINK`] (no configured sink can have its name) whose topic is the schedule's id and whose
//! body is the op byte (1 put, 2 pause, 3 resume, 4 delete) then, for a put, the definition (opaque to
//! the engine); it is applied to the schedule table and never filed. A firing is an ordinary message
//! whose first two headers are [`SCHEDULE_HEADER`] (the schedule's id) and [`FIRE_AT_HEADER`] (its
//! nominal time, `YYYY-MM-DDTHH:MM:SS.mmmZ`); it is filed like any message, and its first attempt
//! counts as the schedule's progress.
//!
//! The seq, created_at and id of a message are only known at commit, so [`NewMessage::encode`] writes
//! placeholders there and the WAL writer patches them in place ([`patch_committed`]) before sealing the
//! frame. Everything variable-length is encoded by the submitter, off the writer thread.

use crate::bucket::Bucket;
use crate::frame::{self, Kind};
use crate::id::{Location, MessageId};

const SEQ: usize = 0;
const CREATED_AT: usize = 16;
const ID_BUCKET: usize = 24;
const ID_SEQ: usize = 28;
const SHARD: usize = 38;
const VARIABLE: usize = 40;
const NO_KEY: u16 = u16::MAX;
const DEDUP_KEY: u16 = 0x8000;
/// The sink of schedule ops: not a valid sink name (names.rs), so never a configured sink's.
pub const SCHEDULE_SINK: &str = "$schedule";
/// The first header of a firing: the id of its schedule.
pub const SCHEDULE_HEADER: &str = "delayd-schedule";
/// The second header of a firing: its nominal time, RFC 3339 in UTC with milliseconds.
pub const FIRE_AT_HEADER: &str = "delayd-fire-at";
/// Outcome reasons are for people; longer ones are cut at a character boundary rather than refused.
pub const MAX_REASON_BYTES: usize = 512;

/// A message as the caller hands it in.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NewMessage {
    pub deliver_at_ms: i64,
    pub topic: String,
    pub key: Option<String>,
    pub headers: Vec<(String, String)>,
    pub sink: String,
    pub body: Vec<u8>,
    /// `None` for a new message; for a retry, the id and number of the new attempt.
    pub retry_of: Option<(MessageId, u16)>,
    /// The key is an idempotency key: while this message is pending, the same key gets it back.
    /// Ignored without a key.
    pub dedup: bool,
}

/// A message as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub seq: u64,
    pub deliver_at_ms: i64,
    pub created_at_ms: i64,
    pub id: MessageId,
    pub attempt: u16,
    pub topic: String,
    pub key: Option<String>,
    /// The key is an idempotency key.
    pub dedup: bool,
    pub headers: Vec<(String, String)>,
    pub sink: String,
    pub body: Vec<u8>,
}

/// A field does not fit the record format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} is too long for the record format (at most {max} bytes)")]
pub struct TooLarge {
    pub field: &'static str,
    pub max: usize,
}

/// A message encoded as a complete frame with placeholders for what the commit assigns.
#[derive(Debug, Clone)]
pub struct EncodedMessage {
    pub(crate) frame: Vec<u8>,
    pub(crate) deliver_at_ms: i64,
    pub(crate) sink_tag: u16,
    pub(crate) dedup: bool,
    /// For a retry: the message's id and the number of this attempt.
    pub(crate) retry_of: Option<(MessageId, u16)>,
}

impl EncodedMessage {
    /// Bytes this message takes in the log.
    pub fn frame_len(&self) -> usize {
        self.frame.len()
    }
}

/// A message to append, borrowed: for callers that hold its parts elsewhere (the HTTP edge parses a
/// batch in place) and would otherwise copy each part once more only to encode it.
#[derive(Debug, Clone, Default)]
pub struct MessageRef<'a> {
    pub deliver_at_ms: i64,
    pub topic: &'a str,
    pub key: Option<&'a str>,
    pub headers: &'a [(&'a str, &'a str)],
    pub sink: &'a str,
    pub body: &'a [u8],
    /// As in [`NewMessage`].
    pub retry_of: Option<(MessageId, u16)>,
    /// As in [`NewMessage`].
    pub dedup: bool,
}

impl NewMessage {
    /// Encodes the message into a frame, checking every length against the format's limits.
    pub fn encode(&self) -> Result<EncodedMessage, TooLarge> {
        let headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        MessageRef {
            deliver_at_ms: self.deliver_at_ms,
            topic: &self.topic,
            key: self.key.as_deref(),
            headers: &headers,
            sink: &self.sink,
            body: &self.body,
            retry_of: self.retry_of,
            dedup: self.dedup,
        }
        .encode()
    }
}

impl MessageRef<'_> {
    /// Encodes the message into a frame, checking every length against the format's limits.
    pub fn encode(&self) -> Result<EncodedMessage, TooLarge> {
        // The exact size: a guess one byte short made every 1 KiB message grow (and copy) its buffer.
        let headers: usize = self
            .headers
            .iter()
            .map(|(n, v)| 6 + n.len() + v.len())
            .sum();
        let variable =
            1 + self.topic.len() + 1 + self.sink.len() + 2 + self.key.map_or(0, str::len);
        let len = frame::HEADER_LEN + VARIABLE + variable + 2 + headers + 4 + self.body.len();
        let mut buf = Vec::with_capacity(len);
        let at = frame::start(&mut buf);
        let (id, attempt) = match self.retry_of {
            Some((id, attempt)) => (Some(id), attempt),
            None => (None, 0),
        };
        buf.extend_from_slice(&0u64.to_le_bytes()); // seq
        buf.extend_from_slice(&self.deliver_at_ms.to_le_bytes());
        buf.extend_from_slice(&0i64.to_le_bytes()); // created_at
        let first = id.map(|id| id.first);
        let minute = first.map_or(0, |l| l.bucket.start_minute());
        buf.extend_from_slice(&minute.to_le_bytes());
        buf.extend_from_slice(&first.map_or(0, |l| l.seq).to_le_bytes());
        buf.extend_from_slice(&attempt.to_le_bytes());
        buf.extend_from_slice(&id.map_or(0, |id| id.shard).to_le_bytes());
        put_str8(&mut buf, self.topic, "topic")?;
        put_str8(&mut buf, self.sink, "sink")?;
        match self.key {
            Some(key) => {
                put_str16(&mut buf, key, "key", usize::from(DEDUP_KEY) - 1)?;
                if self.dedup {
                    let at = buf.len() - key.len() - 2;
                    buf[at + 1] |= 0x80;
                }
            }
            None => buf.extend_from_slice(&NO_KEY.to_le_bytes()),
        }
        let count = u16::try_from(self.headers.len()).map_err(|_| TooLarge {
            field: "headers",
            max: usize::from(u16::MAX),
        })?;
        buf.extend_from_slice(&count.to_le_bytes());
        for (name, value) in self.headers {
            put_str16(&mut buf, name, "header name", usize::from(u16::MAX))?;
            put_bytes32(&mut buf, value.as_bytes(), "header value")?;
        }
        put_bytes32(&mut buf, self.body, "body")?;
        if buf.len() - frame::HEADER_LEN > frame::MAX_PAYLOAD {
            return Err(TooLarge {
                field: "message",
                max: frame::MAX_PAYLOAD,
            });
        }
        frame::finish(&mut buf, at, Kind::Message);
        debug_assert_eq!(buf.len(), len, "the size computed up front");
        Ok(EncodedMessage {
            frame: buf,
            deliver_at_ms: self.deliver_at_ms,
            sink_tag: sink_tag(self.sink),
            dedup: self.dedup && self.key.is_some(),
            retry_of: self.retry_of,
        })
    }
}

/// Writes the commit-time fields into an encoded message frame and reseals it.
pub(crate) fn patch_committed(frame_bytes: &mut [u8], seq: u64, created_at_ms: i64, id: MessageId) {
    let payload = &mut frame_bytes[frame::HEADER_LEN..];
    payload[SEQ..SEQ + 8].copy_from_slice(&seq.to_le_bytes());
    payload[CREATED_AT..CREATED_AT + 8].copy_from_slice(&created_at_ms.to_le_bytes());
    payload[ID_BUCKET..ID_BUCKET + 4]
        .copy_from_slice(&id.first.bucket.start_minute().to_le_bytes());
    payload[ID_SEQ..ID_SEQ + 8].copy_from_slice(&id.first.seq.to_le_bytes());
    payload[SHARD..SHARD + 2].copy_from_slice(&id.shard.to_le_bytes());
    frame::seal(frame_bytes);
}

fn put_str8(buf: &mut Vec<u8>, s: &str, field: &'static str) -> Result<(), TooLarge> {
    let len = u8::try_from(s.len()).map_err(|_| TooLarge { field, max: 255 })?;
    buf.push(len);
    buf.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_str16(buf: &mut Vec<u8>, s: &str, field: &'static str, max: usize) -> Result<(), TooLarge> {
    if s.len() > max {
        return Err(TooLarge { field, max });
    }
    let len = u16::try_from(s.len()).map_err(|_| TooLarge { field, max })?;
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_bytes32(buf: &mut Vec<u8>, b: &[u8], field: &'static str) -> Result<(), TooLarge> {
    let max = frame::MAX_PAYLOAD;
    if b.len() > max {
        return Err(TooLarge { field, max });
    }
    let len = u32::try_from(b.len()).map_err(|_| TooLarge { field, max })?;
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(b);
    Ok(())
}

/// An op on a schedule, as its record's body starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ScheduleOp {
    /// Create or replace; the definition follows.
    Put = 1,
    Pause = 2,
    Resume = 3,
    Delete = 4,
}

impl ScheduleOp {
    fn from_u8(byte: u8) -> Option<ScheduleOp> {
        match byte {
            1 => Some(ScheduleOp::Put),
            2 => Some(ScheduleOp::Pause),
            3 => Some(ScheduleOp::Resume),
            4 => Some(ScheduleOp::Delete),
            _ => None,
        }
    }

    /// The record of this op on schedule `id`, to append like a message. `definition` is the put's
    /// (ignored for the other ops).
    pub fn encode(self, id: &str, definition: &[u8]) -> Result<EncodedMessage, TooLarge> {
        let mut body = Vec::with_capacity(1 + definition.len());
        body.push(self as u8);
        if self == ScheduleOp::Put {
            body.extend_from_slice(definition);
        }
        MessageRef {
            topic: id,
            sink: SCHEDULE_SINK,
            body: &body,
            ..MessageRef::default()
        }
        .encode()
    }
}

/// What a message record means for the schedule table, read in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScheduleMark<'a> {
    Op {
        id: &'a str,
        op: ScheduleOp,
        definition: &'a [u8],
    },
    /// The first attempt of a firing.
    Firing { id: &'a str, fire_at: &'a str },
}

/// Reads a message payload's schedule op or firing, if it is one (see the module doc).
pub(crate) fn schedule_mark(payload: &[u8]) -> Option<ScheduleMark<'_>> {
    let mut r = Reader {
        bytes: payload,
        pos: VARIABLE - 4,
    };
    let attempt = r.u16().ok()?;
    r.pos = VARIABLE;
    let topic_len = usize::from(r.u8().ok()?);
    let topic = r.take(topic_len).ok()?;
    let sink_len = usize::from(r.u8().ok()?);
    let sink = r.take(sink_len).ok()?;
    match r.u16().ok()? {
        NO_KEY => {}
        len => {
            r.take(usize::from(len & !DEDUP_KEY)).ok()?;
        }
    }
    let count = r.u16().ok()?;
    if sink == SCHEDULE_SINK.as_bytes() {
        for _ in 0..count {
            let name_len = usize::from(r.u16().ok()?);
            r.take(name_len).ok()?;
            let value_len = r.u32().ok()? as usize;
            r.take(value_len).ok()?;
        }
        let body_len = r.u32().ok()? as usize;
        let (&op, definition) = r.take(body_len).ok()?.split_first()?;
        return Some(ScheduleMark::Op {
            id: std::str::from_utf8(topic).ok()?,
            op: ScheduleOp::from_u8(op)?,
            definition,
        });
    }
    if attempt != 0 || count < 2 {
        return None;
    }
    let mut header = || -> Option<(&[u8], &[u8])> {
        let name_len = usize::from(r.u16().ok()?);
        let name = r.take(name_len).ok()?;
        let value_len = r.u32().ok()? as usize;
        Some((name, r.take(value_len).ok()?))
    };
    let (name, id) = header()?;
    if name != SCHEDULE_HEADER.as_bytes() {
        return None;
    }
    let (name, fire_at) = header()?;
    if name != FIRE_AT_HEADER.as_bytes() {
        return None;
    }
    Some(ScheduleMark::Firing {
        id: std::str::from_utf8(id).ok()?,
        fire_at: std::str::from_utf8(fire_at).ok()?,
    })
}

/// Bytes that do not decode as the record they claim to be. The frame checksum passed, so this means a
/// bug or a forged file, never a torn write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed record: {0}")]
pub struct Malformed(pub &'static str);

/// What [`Reader`] answers when the bytes end before a field does.
const TRUNCATED: Malformed = Malformed("truncated payload");

/// A bounds-checked reader over a payload: every accessor fails instead of panicking.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(Malformed("length overflow"))?;
        let out = self.bytes.get(self.pos..end).ok_or(TRUNCATED)?;
        self.pos = end;
        Ok(out)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, Malformed> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, Malformed> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn i64(&mut self) -> Result<i64, Malformed> {
        Ok(i64::from_le_bytes(self.array()?))
    }
    fn str(&mut self, len: usize) -> Result<String, Malformed> {
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Malformed("text is not UTF-8"))
    }
    fn finish(self) -> Result<(), Malformed> {
        if self.pos == self.bytes.len() {
            Ok(())
        } else {
            Err(Malformed("trailing bytes"))
        }
    }
}

/// The fixed prefix of a message payload: what the replay and the loader need without decoding the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageHead {
    pub seq: u64,
    pub deliver_at_ms: i64,
    pub created_at_ms: i64,
    /// [`sink_tag`] of the message's sink name.
    pub sink_tag: u16,
    /// The message has an idempotency key.
    pub dedup: bool,
    /// For a later attempt (attempt > 0): the message's id and the attempt's number. The replayer files a
    /// pointer to every later attempt under the first one (replay.rs), which is how a lookup finds the
    /// newest attempt even when the `retried` outcome of the one before it was never recorded.
    pub retry: Option<(MessageId, u16)>,
}

/// A 16-bit tag of a sink name, stored in index entries so that the scheduler can route a due message to
/// its sink without reading the record. (Two configured sinks whose names share a tag are refused.)
pub fn sink_tag(sink: &str) -> u16 {
    (crc32c::crc32c(sink.as_bytes()) & 0xffff) as u16
}

impl MessageHead {
    pub fn decode(payload: &[u8]) -> Result<MessageHead, Malformed> {
        let mut r = Reader {
            bytes: payload
                .get(..VARIABLE)
                .ok_or(Malformed("truncated message"))?,
            pos: SEQ,
        };
        let seq = r.u64()?;
        let deliver_at_ms = r.i64()?;
        let created_at_ms = r.i64()?;
        let id_minute = r.u32()?;
        let id_seq = r.u64()?;
        let attempt = r.u16()?;
        let shard = r.u16()?;
        let retry = (attempt > 0).then(|| {
            let first = Location {
                bucket: Bucket::from_start_minute(id_minute),
                seq: id_seq,
            };
            (MessageId { shard, first }, attempt)
        });
        let mut r = Reader {
            bytes: payload,
            pos: VARIABLE,
        };
        let topic_len = usize::from(r.u8()?);
        r.take(topic_len)?;
        let sink_len = usize::from(r.u8()?);
        let sink =
            std::str::from_utf8(r.take(sink_len)?).map_err(|_| Malformed("text is not UTF-8"))?;
        let key_len = r.u16()?;
        let dedup = key_len != NO_KEY && key_len & DEDUP_KEY != 0;
        Ok(MessageHead {
            seq,
            deliver_at_ms,
            created_at_ms,
            sink_tag: sink_tag(sink),
            dedup,
            retry,
        })
    }
}

/// A message without its body: what an index is rebuilt from at a start (the idempotency keys of the
/// pending messages, an MQ source's positions), read from the start of a frame without the body
/// ([`MessageMeta::decode_prefix`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageMeta {
    pub seq: u64,
    pub deliver_at_ms: i64,
    pub created_at_ms: i64,
    pub id: MessageId,
    pub attempt: u16,
    pub topic: String,
    pub key: Option<String>,
    /// The key is an idempotency key.
    pub dedup: bool,
    pub headers: Vec<(String, String)>,
    pub sink: String,
}

/// Why a prefix did not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefixError {
    /// The prefix ends before the body's length: read more of the frame.
    Short,
    Malformed(Malformed),
}

impl MessageMeta {
    /// Decodes everything before the body from the start of a message payload (or all of it); the
    /// body's length is the last field read.
    pub fn decode_prefix(prefix: &[u8]) -> Result<MessageMeta, PrefixError> {
        let mut r = Reader {
            bytes: prefix,
            pos: 0,
        };
        MessageMeta::read(&mut r).map_err(|e| match e {
            TRUNCATED => PrefixError::Short,
            other => PrefixError::Malformed(other),
        })
    }

    /// Reads the fields up to the body, leaving `r` at the body's length.
    fn read(r: &mut Reader<'_>) -> Result<MessageMeta, Malformed> {
        let seq = r.u64()?;
        let deliver_at_ms = r.i64()?;
        let created_at_ms = r.i64()?;
        let id_minute = r.u32()?;
        let id_seq = r.u64()?;
        let attempt = r.u16()?;
        let shard = r.u16()?;
        debug_assert_eq!(r.pos, VARIABLE);
        let topic_len = usize::from(r.u8()?);
        let topic = r.str(topic_len)?;
        let sink_len = usize::from(r.u8()?);
        let sink = r.str(sink_len)?;
        let (key, dedup) = match r.u16()? {
            NO_KEY => (None, false),
            len => (
                Some(r.str(usize::from(len & !DEDUP_KEY))?),
                len & DEDUP_KEY != 0,
            ),
        };
        let count = r.u16()?;
        let mut headers = Vec::with_capacity(usize::from(count).min(64));
        for _ in 0..count {
            let name_len = usize::from(r.u16()?);
            let name = r.str(name_len)?;
            let value_len = r.u32()? as usize;
            let value = r.str(value_len)?;
            headers.push((name, value));
        }
        Ok(MessageMeta {
            seq,
            deliver_at_ms,
            created_at_ms,
            id: MessageId {
                shard,
                first: Location {
                    bucket: Bucket::from_start_minute(id_minute),
                    seq: id_seq,
                },
            },
            attempt,
            topic,
            key,
            dedup,
            headers,
            sink,
        })
    }
}

impl From<Message> for MessageMeta {
    fn from(m: Message) -> MessageMeta {
        MessageMeta {
            seq: m.seq,
            deliver_at_ms: m.deliver_at_ms,
            created_at_ms: m.created_at_ms,
            id: m.id,
            attempt: m.attempt,
            topic: m.topic,
            key: m.key,
            dedup: m.dedup,
            headers: m.headers,
            sink: m.sink,
        }
    }
}

impl Message {
    pub fn decode(payload: &[u8]) -> Result<Message, Malformed> {
        let mut r = Reader {
            bytes: payload,
            pos: 0,
        };
        let meta = MessageMeta::read(&mut r)?;
        let body_len = r.u32()? as usize;
        let body = r.take(body_len)?.to_vec();
        r.finish()?;
        Ok(Message {
            seq: meta.seq,
            deliver_at_ms: meta.deliver_at_ms,
            created_at_ms: meta.created_at_ms,
            id: meta.id,
            attempt: meta.attempt,
            topic: meta.topic,
            key: meta.key,
            dedup: meta.dedup,
            headers: meta.headers,
            sink: meta.sink,
            body,
        })
    }
}

/// A tombstone: the attempt at `target` is cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cancel {
    pub seq: u64,
    pub created_at_ms: i64,
    pub target: Location,
}

pub(crate) const CANCEL_PAYLOAD_LEN: usize = 28;

impl Cancel {
    /// Appends this tombstone as a whole frame to `buf`.
    pub(crate) fn encode_frame(&self, buf: &mut Vec<u8>) {
        let at = frame::start(buf);
        buf.extend_from_slice(&self.seq.to_le_bytes());
        buf.extend_from_slice(&self.created_at_ms.to_le_bytes());
        buf.extend_from_slice(&self.target.bucket.start_minute().to_le_bytes());
        buf.extend_from_slice(&self.target.seq.to_le_bytes());
        frame::finish(buf, at, Kind::Cancel);
    }

    pub fn decode(payload: &[u8]) -> Result<Cancel, Malformed> {
        let mut r = Reader {
            bytes: payload,
            pos: 0,
        };
        let cancel = Cancel {
            seq: r.u64()?,
            created_at_ms: r.i64()?,
            target: Location {
                bucket: Bucket::from_start_minute(r.u32()?),
                seq: r.u64()?,
            },
        };
        r.finish()?;
        Ok(cancel)
    }
}

/// What happened to one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutcomeKind {
    /// The sink acknowledged it.
    Delivered,
    /// It will never be delivered; the reason says why.
    Dead { reason: String },
    /// A cancel was acknowledged before it was delivered.
    Cancelled,
    /// The sink asked for a retry, or a dead attempt was requeued; the next attempt is durable at
    /// `next`.
    Retried { next: Location, reason: String },
    /// A dead attempt an operator put away: it stays dead, and out of the dead-letter list.
    Discarded,
}

/// One line of a dispatch log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub seq: u64,
    pub at_ms: i64,
    pub attempt: u16,
    pub kind: OutcomeKind,
}

impl Outcome {
    pub(crate) fn encode_frame(&self, buf: &mut Vec<u8>) {
        let at = frame::start(buf);
        self.encode_payload(buf);
        frame::finish(buf, at, Kind::Outcome);
    }

    /// Appends the outcome's payload (the layout above) to `buf`.
    pub(crate) fn encode_payload(&self, buf: &mut Vec<u8>) {
        let (code, next, reason) = match &self.kind {
            OutcomeKind::Delivered => (1u8, None, ""),
            OutcomeKind::Dead { reason } => (2, None, reason.as_str()),
            OutcomeKind::Cancelled => (3, None, ""),
            OutcomeKind::Retried { next, reason } => (4, Some(*next), reason.as_str()),
            OutcomeKind::Discarded => (5, None, ""),
        };
        buf.extend_from_slice(&self.seq.to_le_bytes());
        buf.push(code);
        buf.extend_from_slice(&self.at_ms.to_le_bytes());
        buf.extend_from_slice(&self.attempt.to_le_bytes());
        buf.extend_from_slice(&next.map_or(0, |l| l.bucket.start_minute()).to_le_bytes());
        buf.extend_from_slice(&next.map_or(0, |l| l.seq).to_le_bytes());
        let mut end = reason.len().min(MAX_REASON_BYTES);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        buf.extend_from_slice(&u16::try_from(end).unwrap_or(0).to_le_bytes());
        buf.extend_from_slice(&reason.as_bytes()[..end]);
    }

    pub fn decode(payload: &[u8]) -> Result<Outcome, Malformed> {
        let mut r = Reader {
            bytes: payload,
            pos: 0,
        };
        let seq = r.u64()?;
        let code = r.u8()?;
        let at_ms = r.i64()?;
        let attempt = r.u16()?;
        let next = Location {
            bucket: Bucket::from_start_minute(r.u32()?),
            seq: r.u64()?,
        };
        let reason_len = usize::from(r.u16()?);
        let reason = r.str(reason_len)?;
        r.finish()?;
        let kind = match code {
            1 => OutcomeKind::Delivered,
            2 => OutcomeKind::Dead { reason },
            3 => OutcomeKind::Cancelled,
            4 => OutcomeKind::Retried { next, reason },
            5 => OutcomeKind::Discarded,
            _ => return Err(Malformed("unknown outcome kind")),
        };
        Ok(Outcome {
            seq,
            at_ms,
            attempt,
            kind,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{decode, Next};
    use proptest::prelude::*;

    fn payload(frame_bytes: &[u8]) -> &[u8] {
        match decode(frame_bytes) {
            Next::Frame { payload, .. } => payload,
            other => panic!("{other:?}"),
        }
    }

    fn message_strategy() -> impl Strategy<Value = NewMessage> {
        (
            any::<i64>(),
            "[a-z.]{1,20}",
            proptest::option::of("\\PC{0,10}"),
            proptest::collection::vec(("[a-z]{1,5}", "\\PC{0,8}"), 0..4),
            "[a-z]{0,8}",
            proptest::collection::vec(any::<u8>(), 0..200),
            proptest::option::of((any::<u32>(), any::<u64>(), any::<u16>())),
            any::<bool>(),
        )
            .prop_map(
                |(deliver_at_ms, topic, key, headers, sink, body, retry, dedup)| NewMessage {
                    deliver_at_ms,
                    topic,
                    key,
                    dedup,
                    headers,
                    sink,
                    body,
                    retry_of: retry.map(|(minute, seq, attempt)| {
                        let first = Location {
                            bucket: Bucket::from_start_minute(minute),
                            seq,
                        };
                        (MessageId::new(first), attempt)
                    }),
                },
            )
    }

    proptest! {
        #[test]
        fn messages_round_trip(new in message_strategy(), seq: u64, created: i64) {
            let encoded = new.encode().unwrap();
            let mut frame_bytes = encoded.frame.clone();
            let id = new.retry_of.map_or(MessageId::new(Location { bucket: Bucket::from_start_minute(7), seq }), |r| r.0);
            patch_committed(&mut frame_bytes, seq, created, id);
            let message = Message::decode(payload(&frame_bytes)).unwrap();
            prop_assert_eq!(message.seq, seq);
            prop_assert_eq!(message.created_at_ms, created);
            prop_assert_eq!(message.id, id);
            prop_assert_eq!(message.attempt, new.retry_of.map_or(0, |r| r.1));
            prop_assert_eq!(&message.topic, &new.topic);
                        prop_assert_eq!(&message.key, &new.key);
            prop_assert_eq!(message.dedup, new.dedup && new.key.is_some());
            prop_assert_eq!(&message.headers, &new.headers);
            prop_assert_eq!(&message.sink, &new.sink);
            prop_assert_eq!(&message.body, &new.body);
            let head = MessageHead::decode(payload(&frame_bytes)).unwrap();
            prop_assert_eq!(head, MessageHead { seq, deliver_at_ms: new.deliver_at_ms, created_at_ms: created, sink_tag: sink_tag(&new.sink), dedup: new.dedup && new.key.is_some(), retry: new.retry_of.filter(|r| r.1 > 0) });
            // Everything but the body, from any prefix that reaches the body's length; a shorter one
            // asks for more.
            let whole = payload(&frame_bytes);
            let meta_end = whole.len() - new.body.len() - 4;
            let meta = MessageMeta::decode_prefix(whole).unwrap();
            prop_assert_eq!(&meta, &MessageMeta::decode_prefix(&whole[..meta_end]).unwrap());
            prop_assert_eq!((meta.seq, meta.id, meta.attempt), (seq, message.id, message.attempt));
            prop_assert_eq!((&meta.topic, &meta.key, &meta.sink), (&new.topic, &new.key, &new.sink));
            prop_assert_eq!(&meta.headers, &new.headers);
            prop_assert_eq!(meta.dedup, message.dedup);
            prop_assert_eq!(MessageMeta::decode_prefix(&whole[..meta_end - 1]), Err(PrefixError::Short));
        }

        #[test]
        fn garbage_payloads_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
            let _ = Message::decode(&bytes);
            let _ = MessageHead::decode(&bytes);
            let _ = MessageMeta::decode_prefix(&bytes);
            let _ = Cancel::decode(&bytes);
            let _ = Outcome::decode(&bytes);
        }
    }

    #[test]
    fn oversized_fields_are_refused() {
        let long_topic = NewMessage {
            topic: "t".repeat(256),
            ..Default::default()
        };
        assert_eq!(long_topic.encode().unwrap_err().field, "topic");
        let big_body = NewMessage {
            body: vec![0; frame::MAX_PAYLOAD + 1],
            ..Default::default()
        };
        assert_eq!(big_body.encode().unwrap_err().field, "body");
        let near = NewMessage {
            body: vec![0; frame::MAX_PAYLOAD - 10],
            ..Default::default()
        };
        assert_eq!(near.encode().unwrap_err().field, "message");
    }

    #[test]
    fn cancels_and_outcomes_round_trip() {
        let cancel = Cancel {
            seq: 9,
            created_at_ms: -3,
            target: Location {
                bucket: Bucket::from_start_minute(120),
                seq: 4,
            },
        };
        let mut buf = Vec::new();
        cancel.encode_frame(&mut buf);
        assert_eq!(buf.len(), frame::HEADER_LEN + CANCEL_PAYLOAD_LEN);
        assert_eq!(Cancel::decode(payload(&buf)), Ok(cancel));

        let kinds = [
            OutcomeKind::Delivered,
            OutcomeKind::Dead {
                reason: "HTTP 400".into(),
            },
            OutcomeKind::Cancelled,
            OutcomeKind::Retried {
                next: cancel.target,
                reason: "HTTP 503".into(),
            },
        ];
        for kind in kinds {
            let outcome = Outcome {
                seq: 77,
                at_ms: 1_000,
                attempt: 3,
                kind,
            };
            let mut buf = Vec::new();
            outcome.encode_frame(&mut buf);
            assert_eq!(Outcome::decode(payload(&buf)), Ok(outcome));
        }
        let long = Outcome {
            seq: 1,
            at_ms: 0,
            attempt: 0,
            kind: OutcomeKind::Dead {
                reason: "é".repeat(2000),
            },
        };
        let mut buf = Vec::new();
        long.encode_frame(&mut buf);
        let OutcomeKind::Dead { reason } = Outcome::decode(payload(&buf)).unwrap().kind else {
            panic!()
        };
        assert_eq!(reason.len(), MAX_REASON_BYTES);
    }
}
