//! Broker ops: what a cluster member's broker proposes through Raft instead of writing its own files
//! (DESIGN.md §10, "broker appends and group offsets"). The leader encodes an op, proposes it as an
//! application payload of an entry (`ScheduleLog::propose_app`), and every member applies it into its
//! own broker files ([`super::Broker::apply_op`]), so a follower's broker is a hot standby.
//!
//! ```text
//! 0   1  version  u8 = 1
//! 1   1  kind     u8: 1 append, 2 commit offset (3 is a source's state file, source/state.rs:
//!                 lib.rs's applier hands the broker only its own kinds)
//!
//! append (kind 1)
//! 2   8  nonce    u64: the proposing broker's, to find the placements its own apply produced
//! 10  4  count    u32: messages that follow, each:
//!    0   4  queues   u32: the topic's queue count, for a member that creates the topic with it
//!    4   4  len      u32: bytes of the record payload that follows
//!    8   len record  a broker record's payload (record.rs: meta_len u32, meta JSON, body bytes as
//!                    they are); its meta's `queue` is the queue the leader chose, `queue_offset` 0
//!                    (each member's apply gives the next one of the queue, the same everywhere)
//!
//! commit offset (kind 2)
//! 2   2  group length u16, then the group (UTF-8)
//! ..  2  topic length u16, then the topic (UTF-8)
//! ..  4  queue    u32
//! ..  8  offset   u64
//! ```
//!
//! Invariants:
//! - Everything a member's apply decides is in the op: queues, the queue count of a new topic, each
//!   message's times. So members that apply the same ops in the same order hold the same messages at
//!   the same offsets.
//! - Decoding never panics: a cut or garbled op is an error naming what is wrong.

use super::record::{decode_payload, encode_payload};
use super::store::Chosen;
use super::{Incoming, StoredMeta};

const VERSION: u8 = 1;
const APPEND: u8 = 1;
const COMMIT_OFFSET: u8 = 2;
/// The kinds of application payload (byte 1) that are broker ops.
pub(crate) const KINDS: [u8; 2] = [APPEND, COMMIT_OFFSET];

/// A message of an append op, with the queue the leader chose.
#[derive(Debug, Clone)]
pub(crate) struct OpMessage {
    pub chosen: Chosen,
    pub message: Incoming,
}

/// One replicated change to the broker.
#[derive(Debug, Clone)]
pub(crate) enum BrokerOp {
    Append {
        nonce: u64,
        messages: Vec<OpMessage>,
    },
    CommitOffset {
        group: String,
        topic: String,
        queue: u32,
        offset: u64,
    },
}

/// The bytes an append op's message takes.
pub(crate) fn message_bytes(message: &OpMessage) -> Vec<u8> {
    let incoming = &message.message;
    let meta = StoredMeta {
        topic: incoming.topic.clone(),
        queue: message.chosen.queue,
        queue_offset: 0,
        id: incoming.id.clone(),
        key: incoming.key.clone(),
        headers: incoming.headers.clone(),
        deliver_at_ms: incoming.deliver_at_ms,
        delivered_at_ms: incoming.delivered_at_ms,
        attempt: incoming.attempt,
        op: None,
        attempt_at: (incoming.attempt_at).map(|at| (at.bucket.start_minute(), at.seq)),
    };
    let mut bytes = Vec::with_capacity(8 + 256 + incoming.body.len());
    bytes.extend_from_slice(&message.chosen.queues.to_le_bytes());
    bytes.extend_from_slice(&[0; 4]); // the record's length, once it is written
    encode_payload(&mut bytes, &meta, &incoming.body);
    let len = (bytes.len() - 8) as u32;
    bytes[4..8].copy_from_slice(&len.to_le_bytes());
    bytes
}

/// The bytes of an append op before its messages.
pub(crate) const APPEND_HEAD_LEN: usize = 14;

/// An append op of messages already encoded by [`message_bytes`].
pub(crate) fn encode_append(nonce: u64, messages: &[Vec<u8>]) -> Vec<u8> {
    let len = APPEND_HEAD_LEN + messages.iter().map(Vec::len).sum::<usize>();
    let mut bytes = Vec::with_capacity(len);
    bytes.extend_from_slice(&[VERSION, APPEND]);
    bytes.extend_from_slice(&nonce.to_le_bytes());
    bytes.extend_from_slice(&(messages.len() as u32).to_le_bytes());
    for message in messages {
        bytes.extend_from_slice(message);
    }
    bytes
}

impl BrokerOp {
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            BrokerOp::Append { nonce, messages } => {
                let messages: Vec<_> = messages.iter().map(message_bytes).collect();
                encode_append(*nonce, &messages)
            }
            BrokerOp::CommitOffset {
                group,
                topic,
                queue,
                offset,
            } => {
                let mut bytes = vec![VERSION, COMMIT_OFFSET];
                for name in [group, topic] {
                    // Names are at most 200 bytes (names.rs): a u16 always holds their length.
                    bytes.extend_from_slice(&(name.len() as u16).to_le_bytes());
                    bytes.extend_from_slice(name.as_bytes());
                }
                bytes.extend_from_slice(&queue.to_le_bytes());
                bytes.extend_from_slice(&offset.to_le_bytes());
                bytes
            }
        }
    }

    /// Decodes an op; the error names what is wrong and where.
    pub(crate) fn decode(bytes: &[u8]) -> Result<BrokerOp, String> {
        let mut at = Reader { bytes, at: 0 };
        let version = at.u8("the version")?;
        if version != VERSION {
            return Err(format!(
                "broker op of version {version} (this delayd reads {VERSION})"
            ));
        }
        let op = match at.u8("the kind")? {
            APPEND => {
                let nonce = at.u64("the nonce")?;
                let count = at.u32("the message count")?;
                // Bounded by the bytes there are (8 at least each): a garbled count allocates nothing.
                let mut messages = Vec::with_capacity((count as usize).min(at.left() / 8));
                for i in 0..count {
                    let what = |field: &str| format!("{field} of message {i} of {count}");
                    let queues = at.u32(&what("the queue count"))?;
                    let len = at.u32(&what("the record length"))?;
                    let record = at.take(len as usize, &what("the record"))?;
                    let Some((meta, body)) = decode_payload(record) else {
                        return Err(format!("{} is not a broker record", what("the record")));
                    };
                    if meta.queue >= queues {
                        return Err(format!(
                            "message {i} of {count} is for queue {} of a topic of {queues} queues",
                            meta.queue
                        ));
                    }
                    let attempt_at = meta.attempt_location();
                    messages.push(OpMessage {
                        chosen: Chosen {
                            queue: meta.queue,
                            queues,
                        },
                        message: Incoming {
                            topic: meta.topic,
                            id: meta.id,
                            key: meta.key,
                            headers: meta.headers,
                            deliver_at_ms: meta.deliver_at_ms,
                            delivered_at_ms: meta.delivered_at_ms,
                            attempt: meta.attempt,
                            attempt_at,
                            body: body.to_vec(),
                        },
                    });
                }
                BrokerOp::Append { nonce, messages }
            }
            COMMIT_OFFSET => {
                let group = at.name("the group")?;
                let topic = at.name("the topic")?;
                // They name files: never a path out of the broker's dir, whatever the bytes say.
                if !crate::names::valid_name(&group) {
                    return Err(format!(
                        "an offset commit for the invalid group name {group:?}"
                    ));
                }
                if !super::valid_topic(&topic) {
                    return Err(format!(
                        "an offset commit for the invalid topic name {topic:?}"
                    ));
                }
                BrokerOp::CommitOffset {
                    group,
                    topic,
                    queue: at.u32("the queue")?,
                    offset: at.u64("the offset")?,
                }
            }
            kind => return Err(format!("broker op of unknown kind {kind}")),
        };
        match at.left() {
            0 => Ok(op),
            extra => Err(format!("{extra} bytes after the end of a broker op")),
        }
    }
}

/// Reads an op's fields in order, each bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, len: usize, what: &str) -> Result<&'a [u8], String> {
        if self.left() < len {
            return Err(format!(
                "broker op cut short in {what}: {len} bytes needed at {}, {} there",
                self.at,
                self.left()
            ));
        }
        let taken = &self.bytes[self.at..self.at + len];
        self.at += len;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let mut array = [0; N];
        array.copy_from_slice(self.take(N, what)?);
        Ok(array)
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn name(&mut self, what: &str) -> Result<String, String> {
        let len = u16::from_le_bytes(self.array(what)?);
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }
}
