//! Frames: the unit of every log file (WAL, schedule segment, dispatch log).
//!
//! ```text
//! offset  size  field
//! 0       4     len     u32 LE, payload bytes (the 9-byte header not included)
//! 4       4     crc     u32 LE, CRC-32C of bytes 8 .. 9 + len (kind and payload)
//! 8       1     kind    u8: 1 message, 2 cancel, 3 outcome, 4 padding, 5 broker message (delayd's
//!                       built-in broker store), 6 Raft entry (entry.rs), 7 outcome with its bucket
//!                       (in a Raft entry), 8 application payload (in a Raft entry); 0 is never a
//!                       valid kind
//! 9       len   payload
//! ```
//!
//! Nine zero bytes are the end of a log: files are preallocated (or grown) with zeros, and no valid frame
//! starts with them because kind 0 does not exist.
//!
//! # Tail policy
//!
//! A writer never has more than [`UNSYNCED_LIMIT`] bytes written past its last sync. So after a crash only
//! the last `UNSYNCED_LIMIT` bytes of a log can be damaged. When a scan meets an invalid frame at offset
//! `at` and every byte from `at + UNSYNCED_LIMIT` to the end of the file is zero, the frame is a torn
//! tail: the log is cut back to `at`. Otherwise the damage is in synced data and is reported as corruption
//! with the file and offset; the engine does not guess.

use crate::error::Error;
use std::path::Path;

pub const HEADER_LEN: usize = 9;

/// The largest payload a frame may carry. Bounded so that a damaged length field cannot make a reader
/// allocate or skip gigabytes, and so that one record always fits the unsynced window.
#[cfg(not(test))]
pub const MAX_PAYLOAD: usize = 16 << 20;
#[cfg(test)]
pub const MAX_PAYLOAD: usize = 1 << 10;

/// The most bytes any writer leaves written but not yet synced (see the tail policy above).
#[cfg(not(test))]
pub const UNSYNCED_LIMIT: usize = 32 << 20;
#[cfg(test)]
pub const UNSYNCED_LIMIT: usize = 16 << 10;

/// The block size the WAL aligns its writes to (for `O_DIRECT`).
pub const BLOCK: usize = 4096;

/// The largest payload a reader accepts: a record, or a padding frame of up to two blocks.
const MAX_FRAME_PAYLOAD: usize = if MAX_PAYLOAD > 2 * BLOCK {
    MAX_PAYLOAD
} else {
    2 * BLOCK
};

/// What a frame holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Message = 1,
    Cancel = 2,
    Outcome = 3,
    /// Fills a WAL write up to a block boundary; its payload is zeros and means nothing.
    Padding = 4,
    /// A message delivered into delayd's built-in broker store (its commit log has its own layout).
    Broker = 5,
    /// A Raft entry's head, before the records it carries (WAL files of replicated data dirs).
    Entry = 6,
    /// An outcome and the bucket of the record it is for, carried by a Raft entry (entry.rs).
    PlacedOutcome = 7,
    /// Bytes the application proposed through a Raft entry, opaque to the engine (entry.rs).
    App = 8,
}

impl Kind {
    fn from_u8(byte: u8) -> Option<Kind> {
        match byte {
            1 => Some(Kind::Message),
            2 => Some(Kind::Cancel),
            3 => Some(Kind::Outcome),
            4 => Some(Kind::Padding),
            5 => Some(Kind::Broker),
            6 => Some(Kind::Entry),
            7 => Some(Kind::PlacedOutcome),
            8 => Some(Kind::App),
            _ => None,
        }
    }
}

/// Starts a frame at the end of `buf`; write the payload after it, then call [`finish`].
pub fn start(buf: &mut Vec<u8>) -> usize {
    let at = buf.len();
    buf.extend_from_slice(&[0; HEADER_LEN]);
    at
}

/// Fills in the header of the frame started at `at`, whose payload is everything after it in `buf`.
pub fn finish(buf: &mut [u8], at: usize, kind: Kind) {
    buf[at + 8] = kind as u8;
    seal(&mut buf[at..]);
}

/// How long `len` bytes become once [`pad_to_block`] padded them.
pub fn padded_len(len: usize) -> usize {
    let used = len % BLOCK;
    match used {
        0 => len,
        _ if BLOCK - used < HEADER_LEN => len + 2 * BLOCK - used,
        _ => len + BLOCK - used,
    }
}

/// Appends a padding frame so that `buf.len() - from` becomes a multiple of [`BLOCK`] (adding a whole
/// block when the gap is too small for a frame header).
pub fn pad_to_block(buf: &mut Vec<u8>, from: usize) {
    let used = (buf.len() - from) % BLOCK;
    if used == 0 {
        return;
    }
    let mut gap = BLOCK - used;
    if gap < HEADER_LEN {
        gap += BLOCK;
    }
    let at = start(buf);
    buf.resize(at + gap, 0);
    finish(buf, at, Kind::Padding);
}

/// Recomputes the length and checksum of a complete frame whose payload was patched in place.
pub fn seal(frame: &mut [u8]) {
    let len = u32::try_from(frame.len() - HEADER_LEN).expect("frame payload over 4 GiB");
    frame[0..4].copy_from_slice(&len.to_le_bytes());
    let crc = crc32c::crc32c(&frame[8..]);
    frame[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// One step of reading a log.
#[derive(Debug, PartialEq, Eq)]
pub enum Next<'a> {
    Frame {
        kind: Kind,
        payload: &'a [u8],
    },
    /// Nine zero bytes, or the end of the bytes exactly at a frame boundary.
    End,
    /// Not a valid frame: torn, damaged or garbage. The string says which check failed.
    Invalid(&'static str),
}

/// Decodes the frame at the start of `rest`.
pub fn decode(rest: &[u8]) -> Next<'_> {
    if rest.is_empty() {
        return Next::End;
    }
    let Some(header) = rest.get(..HEADER_LEN) else {
        return if rest.iter().all(|&b| b == 0) {
            Next::End
        } else {
            Next::Invalid("truncated frame header")
        };
    };
    if header.iter().all(|&b| b == 0) {
        return Next::End;
    }
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    if len > MAX_FRAME_PAYLOAD {
        return Next::Invalid("frame length over the maximum");
    }
    let Some(body) = rest.get(8..HEADER_LEN + len) else {
        return Next::Invalid("truncated frame");
    };
    if crc32c::crc32c(body) != crc {
        return Next::Invalid("checksum mismatch");
    }
    match Kind::from_u8(body[0]) {
        Some(kind) => Next::Frame {
            kind,
            payload: &body[1..],
        },
        None => Next::Invalid("unknown frame kind"),
    }
}

/// Applies the tail policy to an invalid frame at `at` of a log whose bytes are `bytes`: `Ok(())` when it
/// is a torn tail that may be cut, a corruption error naming `path` and the offset otherwise.
/// `base` is the file offset of `bytes[0]`.
pub fn check_torn_tail(
    path: &Path,
    bytes: &[u8],
    base: u64,
    at: usize,
    reason: &str,
) -> Result<(), Error> {
    let window_end = at.saturating_add(UNSYNCED_LIMIT).min(bytes.len());
    if bytes[window_end..].iter().all(|&b| b == 0) {
        Ok(())
    } else {
        Err(Error::corrupt(
            path,
            base + at as u64,
            format!("{reason}, followed by data more than {UNSYNCED_LIMIT} bytes later"),
        ))
    }
}

/// Walks the frames of `bytes` from the start; see [`Frames::stop`] for why it ended.
#[derive(Debug)]
pub struct Frames<'a> {
    bytes: &'a [u8],
    pos: usize,
    stop: Option<Stop>,
}

/// Why a walk over frames ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A zero header or the end of the bytes at offset `at`.
    End { at: usize },
    /// An invalid frame at offset `at`.
    Invalid { at: usize, reason: &'static str },
}

impl<'a> Frames<'a> {
    pub fn new(bytes: &'a [u8]) -> Frames<'a> {
        Frames {
            bytes,
            pos: 0,
            stop: None,
        }
    }

    /// Why the walk ended; `None` while it has not.
    pub fn stop(&self) -> Option<Stop> {
        self.stop
    }

    /// Ends the walk at the frame just returned, as if it were invalid (for checks above the frame layer,
    /// such as a WAL sequence gap).
    pub fn reject_last(&mut self, at: usize, reason: &'static str) {
        self.pos = at;
        self.stop = Some(Stop::Invalid { at, reason });
    }
}

impl<'a> Iterator for Frames<'a> {
    /// (offset of the frame, kind, payload)
    type Item = (usize, Kind, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.stop.is_some() {
            return None;
        }
        let at = self.pos;
        match decode(&self.bytes[at..]) {
            Next::Frame { kind, payload } => {
                self.pos = at + HEADER_LEN + payload.len();
                Some((at, kind, payload))
            }
            Next::End => {
                self.stop = Some(Stop::End { at });
                None
            }
            Next::Invalid(reason) => {
                self.stop = Some(Stop::Invalid { at, reason });
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: Kind, payload: &[u8]) -> Vec<u8> {
        let mut buf = Vec::new();
        let at = start(&mut buf);
        buf.extend_from_slice(payload);
        finish(&mut buf, at, kind);
        buf
    }

    #[test]
    fn round_trip_and_end() {
        let mut log = frame(Kind::Message, b"hello");
        log.extend(frame(Kind::Outcome, b""));
        log.extend([0u8; 20]);
        let mut frames = Frames::new(&log);
        assert_eq!(frames.next(), Some((0, Kind::Message, &b"hello"[..])));
        assert_eq!(frames.next(), Some((14, Kind::Outcome, &b""[..])));
        assert_eq!(frames.next(), None);
        assert_eq!(frames.stop(), Some(Stop::End { at: 23 }));
    }

    #[test]
    fn every_damage_is_invalid_not_a_panic() {
        let good = frame(Kind::Cancel, b"0123456789");
        for cut in 1..good.len() {
            assert!(
                matches!(decode(&good[..cut]), Next::Invalid(_)),
                "cut {cut}"
            );
        }
        for i in 0..good.len() {
            for bit in 0..8 {
                let mut bad = good.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    !matches!(
                        decode(&bad),
                        Next::Frame {
                            payload: b"0123456789",
                            ..
                        }
                    ),
                    "flip byte {i} bit {bit}"
                );
            }
        }
        let mut unknown = good.clone();
        unknown[8] = 9;
        seal(&mut unknown);
        assert_eq!(decode(&unknown), Next::Invalid("unknown frame kind"));
        let mut huge = good;
        huge[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode(&huge),
            Next::Invalid("frame length over the maximum")
        );
    }

    #[test]
    fn padding_fills_to_the_block_and_reads_as_a_frame() {
        for len in [
            0usize,
            1,
            100,
            BLOCK - HEADER_LEN,
            BLOCK - HEADER_LEN + 1,
            BLOCK - 1,
            BLOCK,
            BLOCK + 5,
        ] {
            let mut buf = vec![7u8; 10];
            buf.resize(10 + len, 1);
            pad_to_block(&mut buf, 10);
            assert_eq!((buf.len() - 10) % BLOCK, 0, "len {len}");
            assert!(buf.len() - 10 - len < BLOCK + HEADER_LEN, "len {len}");
            if len % BLOCK != 0 {
                assert!(
                    matches!(
                        decode(&buf[10 + len..]),
                        Next::Frame {
                            kind: Kind::Padding,
                            ..
                        }
                    ),
                    "len {len}"
                );
            }
        }
    }

    #[test]
    fn torn_tail_versus_corruption() {
        let path = Path::new("x.log");
        let mut log = vec![1u8; 10];
        log.resize(10 + UNSYNCED_LIMIT, 0);
        assert!(check_torn_tail(path, &log, 0, 5, "t").is_ok());
        log.push(7);
        let err = check_torn_tail(path, &log, 100, 5, "t").unwrap_err();
        assert!(matches!(err, Error::Corrupt { offset: 105, .. }), "{err}");
    }
}
