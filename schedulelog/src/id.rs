//! Message ids and record locations.
//!
//! A [`Location`] is where a record lives: its bucket and its WAL sequence number. A [`MessageId`] is the
//! public, URL-safe name of a message: the location of its first attempt plus a shard number (0 on a
//! single node; DESIGN.md §10 leaves room for sharding). Retries keep the id and move the record, and
//! the dispatch log of the old location points to the new one, so an id can always be followed to the
//! current attempt without a global in-memory index.
//!
//! ```text
//! id bytes (14, big-endian so that ids sort by shard, bucket, seq):
//! 0   2  shard          u16
//! 2   4  bucket minute  u32, the bucket's UTC start in minutes since the epoch
//! 6   8  seq            u64, the WAL sequence of the first attempt
//! text: RFC 4648 base32, lowercase, no padding: 23 characters of [a-z2-7]
//! ```

use crate::bucket::Bucket;
use std::fmt;
use std::str::FromStr;

/// Where a record lives: its bucket and WAL sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Location {
    pub bucket: Bucket,
    pub seq: u64,
}

/// The public id of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageId {
    pub shard: u16,
    pub first: Location,
}

const ID_BYTES: usize = 14;
const ID_CHARS: usize = (ID_BYTES * 8).div_ceil(5);
const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

impl MessageId {
    pub fn new(first: Location) -> MessageId {
        MessageId { shard: 0, first }
    }

    fn to_bytes(self) -> [u8; ID_BYTES] {
        let mut out = [0u8; ID_BYTES];
        out[0..2].copy_from_slice(&self.shard.to_be_bytes());
        out[2..6].copy_from_slice(&self.first.bucket.start_minute().to_be_bytes());
        out[6..14].copy_from_slice(&self.first.seq.to_be_bytes());
        out
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = self.to_bytes();
        let mut text = [0u8; ID_CHARS];
        for (i, c) in text.iter_mut().enumerate() {
            let bit = i * 5;
            let (byte, shift) = (bit / 8, bit % 8);
            let hi = u16::from(bytes[byte]) << 8;
            let lo = bytes.get(byte + 1).copied().map_or(0, u16::from);
            let index = ((hi | lo) >> (11 - shift)) & 0x1f;
            *c = ALPHABET[usize::from(index)];
        }
        f.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?)
    }
}

/// The text is not an id this service issued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a message id: expected 23 characters of [a-z2-7]")]
pub struct InvalidId;

impl FromStr for MessageId {
    type Err = InvalidId;

    fn from_str(text: &str) -> Result<MessageId, InvalidId> {
        if text.len() != ID_CHARS {
            return Err(InvalidId);
        }
        let mut acc: u128 = 0;
        for c in text.bytes() {
            let value = ALPHABET.iter().position(|&a| a == c).ok_or(InvalidId)?;
            acc = (acc << 5) | value as u128;
        }
        // 23 characters carry 115 bits: the 112 of the id and 3 zero bits of padding.
        if acc & 0b111 != 0 {
            return Err(InvalidId);
        }
        let bytes = (acc >> 3).to_be_bytes();
        let bytes = &bytes[16 - ID_BYTES..];
        let shard = u16::from_be_bytes([bytes[0], bytes[1]]);
        let minute = u32::from_be_bytes([bytes[2], bytes[3], bytes[4], bytes[5]]);
        let mut seq = [0u8; 8];
        seq.copy_from_slice(&bytes[6..14]);
        Ok(MessageId {
            shard,
            first: Location {
                bucket: Bucket::from_start_minute(minute),
                seq: u64::from_be_bytes(seq),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn ids_round_trip(shard: u16, minute: u32, seq: u64) {
            let id = MessageId { shard, first: Location { bucket: Bucket::from_start_minute(minute), seq } };
            let text = id.to_string();
            prop_assert_eq!(text.len(), 23);
            prop_assert!(text.bytes().all(|c| ALPHABET.contains(&c)));
            prop_assert_eq!(text.parse::<MessageId>(), Ok(id));
        }

        #[test]
        fn random_text_never_panics(text in "\\PC{0,30}") {
            let _ = text.parse::<MessageId>();
        }
    }

    #[test]
    fn ids_sort_like_their_locations() {
        let a = MessageId::new(Location {
            bucket: Bucket::from_start_minute(60),
            seq: 900,
        });
        let b = MessageId::new(Location {
            bucket: Bucket::from_start_minute(120),
            seq: 5,
        });
        assert!(a.to_string() < b.to_string());
    }

    #[test]
    fn rejects_bad_text() {
        for bad in [
            "",
            "aaaaaaaaaaaaaaaaaaaaaa",
            "aaaaaaaaaaaaaaaaaaaaaaaa",
            "AAAAAAAAAAAAAAAAAAAAAAA",
            "aaaaaaaaaaaaaaaaaaaaaab",
            "aaaaaaaaaaaaaaaaaaaaa01",
        ] {
            assert_eq!(bad.parse::<MessageId>(), Err(InvalidId), "{bad}");
        }
    }
}
