//! The checkpoint: how far the WAL has been replayed into schedule segments, and how much of each segment
//! is durable.
//!
//! ```text
//! checkpoint   (replaced atomically: checkpoint.tmp~, fsync, rename, directory fsync)
//! 0    8   magic            b"DLYDCKPT"
//! 8    2   version          u16, FORMAT_VERSION
//! 10   2   segment_minutes  u16
//! 12   4   segment count    u32 = n
//! 16   8   next_seq         u64: every WAL record below it is in its segment, synced
//! 24   28n segments, sorted by bucket:
//!          bucket minute u32 | log_len u64 | entries u64 | last_seq u64
//!          version 2 (a replicated data dir) only:
//! ..   24  applied          the last Raft entry applied: term u64 | leader u64 | index u64
//! ..   1   has membership   u8: 1 when the last applied membership follows, else 0
//! ..   24  membership id    its entry's term u64 | leader u64 | index u64
//! ..   4   membership len   u32, then the membership's bytes (the cluster layer's encoding)
//! ..   4   crc              u32, CRC-32C of everything before it
//! ```
//!
//! Invariant: a segment on disk that is not listed here was created after the checkpoint, so every record
//! in it is still in the WAL (at or after `next_seq`); recovery deletes it and replays it afresh. A listed
//! segment is cut back to its `log_len` and `entries`.

use crate::bucket::{Bucket, SegmentMinutes};
use crate::entry::LogId;
use crate::error::{Error, Result};
use crate::header::{write_atomically, FORMAT_VERSION};
use crate::segment::SegmentMark;
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::Path;

pub(crate) const MAGIC: [u8; 8] = *b"DLYDCKPT";
const FIXED_LEN: usize = 24;
const SEGMENT_LEN: usize = 28;
/// A checkpoint of a replicated data dir, with the Raft state applied.
const REPLICATED_VERSION: u16 = 2;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    pub next_seq: u64,
    pub segments: BTreeMap<Bucket, SegmentMark>,
    /// What of the Raft log the files hold (a replicated data dir): every record below `next_seq` is
    /// of an entry up to this one.
    pub applied: Option<AppliedState>,
}

/// How far a replicated data dir's files have applied the Raft log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedState {
    pub log_id: LogId,
    /// The last entry whose WAL file may be retired (all its entries are applied, and this was
    /// checkpointed before the file went): the Raft log starts after it.
    pub purged: Option<LogId>,
    /// The last membership applied: its entry and its bytes.
    pub membership: Option<(LogId, Vec<u8>)>,
}

fn put_log_id(out: &mut Vec<u8>, id: &LogId) {
    out.extend_from_slice(&id.term.to_le_bytes());
    out.extend_from_slice(&id.node_id.to_le_bytes());
    out.extend_from_slice(&id.index.to_le_bytes());
}

impl Checkpoint {
    pub(crate) fn empty() -> Checkpoint {
        Checkpoint {
            next_seq: 1,
            segments: BTreeMap::new(),
            applied: None,
        }
    }

    pub(crate) fn encode(&self, width: SegmentMinutes) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED_LEN + SEGMENT_LEN * self.segments.len() + 4);
        out.extend_from_slice(&MAGIC);
        let version = match self.applied {
            Some(_) => REPLICATED_VERSION,
            None => FORMAT_VERSION,
        };
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&width.get().to_le_bytes());
        let count = u32::try_from(self.segments.len()).expect("fewer than 4 billion segments");
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(&self.next_seq.to_le_bytes());
        for (bucket, mark) in &self.segments {
            out.extend_from_slice(&bucket.start_minute().to_le_bytes());
            out.extend_from_slice(&mark.log_len.to_le_bytes());
            out.extend_from_slice(&mark.entries.to_le_bytes());
            out.extend_from_slice(&mark.last_seq.to_le_bytes());
        }
        if let Some(applied) = &self.applied {
            put_log_id(&mut out, &applied.log_id);
            out.push(u8::from(applied.purged.is_some()));
            put_log_id(&mut out, &applied.purged.unwrap_or_default());
            match &applied.membership {
                Some((id, bytes)) => {
                    out.push(1);
                    put_log_id(&mut out, id);
                    let len = u32::try_from(bytes.len()).expect("a membership under 4 GiB");
                    out.extend_from_slice(&len.to_le_bytes());
                    out.extend_from_slice(bytes);
                }
                None => out.push(0),
            }
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    pub(crate) fn decode(bytes: &[u8], width: SegmentMinutes) -> Result<Checkpoint, &'static str> {
        let (body, crc) = bytes
            .split_last_chunk::<4>()
            .ok_or("checkpoint too short")?;
        if body.len() < FIXED_LEN {
            return Err("checkpoint too short");
        }
        if crc32c::crc32c(body) != u32::from_le_bytes(*crc) {
            return Err("checkpoint checksum mismatch");
        }
        let version = u16::from_le_bytes([body[8], body[9]]);
        if body[0..8] != MAGIC || !(FORMAT_VERSION..=REPLICATED_VERSION).contains(&version) {
            return Err("not a checkpoint of this format version");
        }
        if u16::from_le_bytes([body[10], body[11]]) != width.get() {
            return Err("checkpoint segment_minutes differs from the data dir");
        }
        let count = u32::from_le_bytes([body[12], body[13], body[14], body[15]]) as usize;
        let u64_at = |at: usize| -> u64 {
            let mut b = [0u8; 8];
            b.copy_from_slice(&body[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let next_seq = u64_at(16);
        let segments_end = FIXED_LEN.saturating_add(count.saturating_mul(SEGMENT_LEN));
        let fits = match version {
            FORMAT_VERSION => body.len() == segments_end,
            _ => body.len() >= segments_end.saturating_add(APPLIED_FIXED_LEN),
        };
        if !fits {
            return Err("checkpoint length does not match its segment count");
        }
        let mut segments = BTreeMap::new();
        for i in 0..count {
            let at = FIXED_LEN + i * SEGMENT_LEN;
            let minute = u32::from_le_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]);
            let mark = SegmentMark {
                log_len: u64_at(at + 4),
                entries: u64_at(at + 12),
                last_seq: u64_at(at + 20),
            };
            segments.insert(Bucket::from_start_minute(minute), mark);
        }
        let applied = match version {
            FORMAT_VERSION => None,
            _ => Some(decode_applied(&body[segments_end..])?),
        };
        Ok(Checkpoint {
            next_seq,
            segments,
            applied,
        })
    }
}

/// Bytes of a version 2 checkpoint's trailer before its membership's id and bytes.
const APPLIED_FIXED_LEN: usize = 50;

/// The trailer of a version 2 checkpoint (at least `APPLIED_FIXED_LEN` bytes, checked by the caller).
fn decode_applied(bytes: &[u8]) -> Result<AppliedState, &'static str> {
    let u64_at = |at: usize| -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let log_id_at = |at: usize| LogId {
        term: u64_at(at),
        node_id: u64_at(at + 8),
        index: u64_at(at + 16),
    };
    let log_id = log_id_at(0);
    let purged = match bytes[24] {
        0 => None,
        1 => Some(log_id_at(25)),
        _ => return Err("checkpoint applied state is malformed"),
    };
    let membership = match bytes[49] {
        0 if bytes.len() == APPLIED_FIXED_LEN => None,
        1 if bytes.len() >= APPLIED_FIXED_LEN + 28 => {
            let len = u32::from_le_bytes([bytes[74], bytes[75], bytes[76], bytes[77]]) as usize;
            if bytes.len() != APPLIED_FIXED_LEN + 28 + len {
                return Err("checkpoint membership length does not match the file");
            }
            Some((log_id_at(50), bytes[78..].to_vec()))
        }
        _ => return Err("checkpoint applied state is malformed"),
    };
    Ok(AppliedState {
        log_id,
        purged,
        membership,
    })
}

impl Checkpoint {
    /// Reads the checkpoint at `path`; a data dir without one starts from an empty checkpoint.
    pub(crate) fn load(path: &Path, width: SegmentMinutes) -> Result<Checkpoint> {
        match fs::read(path) {
            Ok(bytes) => {
                Checkpoint::decode(&bytes, width).map_err(|reason| Error::corrupt(path, 0, reason))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Checkpoint::empty()),
            Err(e) => Err(Error::io(path)(e)),
        }
    }

    pub(crate) fn store(&self, path: &Path, width: SegmentMinutes) -> Result<()> {
        write_atomically(path, &self.encode(width))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_damage() {
        let width = SegmentMinutes::DEFAULT;
        let mut checkpoint = Checkpoint::empty();
        checkpoint.next_seq = 42;
        for minute in [60u32, 120, 6_000] {
            let mark = SegmentMark {
                log_len: u64::from(minute) * 3,
                entries: 7,
                last_seq: 41,
            };
            checkpoint
                .segments
                .insert(Bucket::from_start_minute(minute), mark);
        }
        let bytes = checkpoint.encode(width);
        assert_eq!(Checkpoint::decode(&bytes, width), Ok(checkpoint.clone()));
        for cut in 0..bytes.len() {
            assert!(
                Checkpoint::decode(&bytes[..cut], width).is_err(),
                "cut {cut}"
            );
        }
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 1;
            assert!(Checkpoint::decode(&bad, width).is_err(), "flip {i}");
        }
        let other = SegmentMinutes::new(30).unwrap();
        assert!(Checkpoint::decode(&bytes, other).is_err());

        // A replicated data dir's, with and without a membership.
        let log_id = |index| LogId {
            term: 3,
            node_id: 2,
            index,
        };
        for membership in [None, Some((log_id(4), b"{\"voters\":[1,2,3]}".to_vec()))] {
            let replicated = Checkpoint {
                applied: Some(AppliedState {
                    log_id: log_id(9),
                    purged: Some(log_id(7)),
                    membership,
                }),
                ..checkpoint.clone()
            };
            let bytes = replicated.encode(width);
            assert_eq!(bytes[8..10], REPLICATED_VERSION.to_le_bytes());
            assert_eq!(Checkpoint::decode(&bytes, width), Ok(replicated));
            for cut in 0..bytes.len() {
                assert!(
                    Checkpoint::decode(&bytes[..cut], width).is_err(),
                    "cut {cut}"
                );
            }
        }
    }
}
