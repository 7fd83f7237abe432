//! The messages the broker stores and hands out, and a commit-log record's format.
//!
//! A record in a commit log is a frame of kind 5 whose payload is:
//!
//! ```text
//! 0   4   meta_len u32 LE
//! 4   ..  meta: JSON {"topic","queue","queue_offset","id","key"?,"headers","deliver_at_ms",
//!                     "delivered_at_ms","attempt","op"?,"attempt_at"?}
//! ..  ..  body bytes
//! ```
//!
//! `op` (a cluster member's store only): `[entry index, position]` of the replicated op that stored
//! the record (op.rs), so that an op applied again after a restart is recognised as stored.
//! `attempt_at` (a delivery's record, from this version on): `[bucket start minute, seq]` of the
//! attempt it delivers in the schedule log, which the dispatch outcome it awaits is recorded for
//! (outcomes.rs).

use schedulelog::frame::{self, Kind};
use schedulelog::{Bucket, Location};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
    /// The replicated op that stored it: its entry's index and its place among the entry's payloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<(u64, u32)>,
    /// The attempt's place in the schedule log: its bucket's start minute and its seq.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_at: Option<(u32, u64)>,
}

impl StoredMeta {
    /// The attempt this record delivers, where the meta says.
    pub fn attempt_location(&self) -> Option<Location> {
        let (minute, seq) = self.attempt_at?;
        Some(Location {
            bucket: Bucket::from_start_minute(minute),
            seq,
        })
    }
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
    /// Where the attempt is stored in the schedule log (a delivery's; `None` for a test's message).
    pub attempt_at: Option<Location>,
    pub body: Vec<u8>,
}

pub(super) fn encode_record(buf: &mut Vec<u8>, meta: &StoredMeta, body: &[u8]) {
    let at = frame::start(buf);
    encode_payload(buf, meta, body);
    frame::finish(buf, at, Kind::Broker);
}

/// Appends a record's payload (no frame header) to `buf`.
pub(super) fn encode_payload(buf: &mut Vec<u8>, meta: &StoredMeta, body: &[u8]) {
    let meta_json = serde_json::to_vec(meta).unwrap_or_default();
    buf.extend_from_slice(&(meta_json.len() as u32).to_le_bytes());
    buf.extend_from_slice(&meta_json);
    buf.extend_from_slice(body);
}

/// (meta, body) of a whole record frame.
pub(super) fn decode_record(bytes: &[u8]) -> Option<(StoredMeta, &[u8])> {
    match frame::decode(bytes) {
        frame::Next::Frame {
            kind: Kind::Broker,
            payload,
        } if frame::HEADER_LEN + payload.len() == bytes.len() => decode_payload(payload),
        _ => None,
    }
}

/// (meta, body) of a record's payload.
pub(super) fn decode_payload(payload: &[u8]) -> Option<(StoredMeta, &[u8])> {
    let meta_len = u32::from_le_bytes(payload.get(..4)?.try_into().ok()?) as usize;
    let meta: StoredMeta = serde_json::from_slice(payload.get(4..4 + meta_len)?).ok()?;
    Some((meta, payload.get(4 + meta_len..)?))
}
