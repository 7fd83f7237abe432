//! A human-readable dump of any file the engine writes, with every checksum verified: what
//! `delayd inspect` prints.

use crate::bucket::{Bucket, SegmentMinutes};
use crate::checkpoint::{self, Checkpoint};
use crate::entry::EntryHead;
use crate::frame::{Frames, Kind, Stop, BLOCK};
use crate::header::{
    FileHeader, DISPATCH_MAGIC, HEADER_LEN, INDEX_MAGIC, META_MAGIC, SEGMENT_MAGIC, WAL_MAGIC,
};
use crate::record::{Cancel, Message, Outcome};
use crate::segment::{IndexEntry, INDEX_ENTRY_LEN};
use crate::wal;
use std::io::{self, Write};
use std::path::Path;

/// Writes a description of the file at `path` to `out`. Returns `Ok(true)` when every record checked
/// out and the file ends cleanly, `Ok(false)` when a problem was found (it is described in the output).
pub fn inspect(path: &Path, out: &mut impl Write) -> io::Result<bool> {
    let bytes = std::fs::read(path)?;
    let magic: [u8; 8] = bytes
        .get(..8)
        .and_then(|m| m.try_into().ok())
        .unwrap_or_default();
    let (name, start) = match magic {
        WAL_MAGIC => ("WAL file", wal::DATA_START as usize),
        SEGMENT_MAGIC => ("schedule segment", HEADER_LEN),
        DISPATCH_MAGIC => ("dispatch log", HEADER_LEN),
        INDEX_MAGIC => return inspect_index(&bytes, out),
        META_MAGIC => return inspect_meta(&bytes, out),
        checkpoint::MAGIC => return inspect_checkpoint(&bytes, out),
        crate::schedules::DEFINITIONS_MAGIC | crate::schedules::PROGRESS_MAGIC => {
            return match crate::schedules::describe(&bytes) {
                Ok(lines) => {
                    for line in lines {
                        writeln!(out, "{line}")?;
                    }
                    Ok(true)
                }
                Err(reason) => {
                    writeln!(out, "{}: {reason}", path.display())?;
                    Ok(false)
                }
            };
        }
        _ => {
            writeln!(
                out,
                "{}: not a delayd data file (unknown magic)",
                path.display()
            )?;
            return Ok(false);
        }
    };
    let header = match FileHeader::decode(&bytes, magic) {
        Ok(header) => header,
        Err(reason) => {
            writeln!(out, "{name}: bad header: {reason}")?;
            return Ok(false);
        }
    };
    match magic {
        WAL_MAGIC => writeln!(out, "{name}, first seq {}", header.value)?,
        _ => writeln!(
            out,
            "{name} of bucket {} ({} minutes)",
            Bucket::from_start_minute(u32::try_from(header.value).unwrap_or(0)),
            header.segment_minutes
        )?,
    }
    let body = bytes.get(start..).unwrap_or_default();
    let mut frames = Frames::new(body);
    let mut count = 0u64;
    let mut ok = true;
    // A WAL file's seqs run on from its first seq; a reused file holds its earlier uses' frames past its
    // own end (wal.rs).
    let mut next_seq = (magic == WAL_MAGIC).then_some(header.value);
    for (at, kind, payload) in frames.by_ref() {
        let offset = start + at;
        if let (Some(expected), Some(seq)) = (next_seq, wal::record_seq(&body[at..])) {
            if seq != expected {
                ok = seq < header.value;
                let what = match ok {
                    true => "what follows is from the file's earlier use",
                    false => "sequence gap",
                };
                writeln!(
                    out,
                    "{count} records; the log ends at offset {offset}: {what}"
                )?;
                return Ok(ok);
            }
            // An entry frame names the seq of its first record, which follows it.
            if kind != Kind::Entry {
                next_seq = Some(seq + 1);
            }
        }
        let line = match kind {
            Kind::Message => match Message::decode(payload) {
                Ok(m) => format!(
                    "message seq {} id {} attempt {} deliver_at_ms {} topic {:?} sink {:?} body {} bytes",
                    m.seq,
                    m.id,
                    m.attempt,
                    m.deliver_at_ms,
                    m.topic,
                    m.sink,
                    m.body.len()
                ),
                Err(e) => {
                    ok = false;
                    format!("message: {e}")
                }
            },
            Kind::Cancel => match Cancel::decode(payload) {
                Ok(c) => format!("cancel seq {} of {}@{}", c.seq, c.target.seq, c.target.bucket),
                Err(e) => {
                    ok = false;
                    format!("cancel: {e}")
                }
            },
            Kind::Outcome => match Outcome::decode(payload) {
                Ok(o) => format!("outcome seq {} attempt {} at_ms {}: {:?}", o.seq, o.attempt, o.at_ms, o.kind),
                Err(e) => {
                    ok = false;
                    format!("outcome: {e}")
                }
            },
            Kind::Padding => continue,
            Kind::Broker => format!("broker record, {} bytes", payload.len()),
            Kind::App => format!("application payload, {} bytes", payload.len()),
            Kind::PlacedOutcome => match payload.split_first_chunk::<4>().map(|(b, o)| (b, Outcome::decode(o))) {
                Some((bucket, Ok(o))) => format!(
                    "outcome for seq {} of {} attempt {} at_ms {}: {:?}",
                    o.seq,
                    Bucket::from_start_minute(u32::from_le_bytes(*bucket)),
                    o.attempt,
                    o.at_ms,
                    o.kind
                ),
                _ => {
                    ok = false;
                    "outcome with its bucket: malformed".into()
                }
            },
            Kind::Entry => match EntryHead::decode(payload) {
                Ok((e, _)) => format!(
                    "entry {} term {} leader {} ({:?}, {} records from seq {})",
                    e.log_id.index, e.log_id.term, e.log_id.node_id, e.kind, e.records, e.first_seq
                ),
                Err(e) => {
                    ok = false;
                    format!("entry: {e}")
                }
            },
        };
        count += 1;
        writeln!(out, "{offset:>12}  {line}")?;
    }
    // A WAL file's log ends at a block boundary; past it a reused file holds its earlier uses'
    // bytes, where no frame need start.
    let log_ends = |at: usize| magic == WAL_MAGIC && (start + at).is_multiple_of(BLOCK);
    let ended = write_end_of_frames(out, count, body, frames.stop(), log_ends, |at| {
        (start + at) as u64
    })?;
    Ok(ok && ended)
}

/// Says how a file's frames (`body`, `count` of them read) ended: cleanly, at an invalid frame, or at
/// an invalid frame where `log_ends` says the log may end. `offset` turns a place in `body` into the
/// offset shown. Returns whether the end is a clean one.
pub fn write_end_of_frames(
    out: &mut impl Write,
    count: u64,
    body: &[u8],
    stop: Option<Stop>,
    log_ends: impl Fn(usize) -> bool,
    offset: impl Fn(usize) -> u64,
) -> io::Result<bool> {
    match stop {
        Some(Stop::End { at }) if body[at..].iter().all(|&b| b == 0) => {
            writeln!(out, "{count} records; clean end at offset {}", offset(at))?;
        }
        Some(Stop::End { at }) => {
            writeln!(
                out,
                "{count} records; a zero header at offset {} is followed by data",
                offset(at)
            )?;
            return Ok(false);
        }
        Some(Stop::Invalid { at, .. }) if log_ends(at) => {
            writeln!(
                out,
                "{count} records; the log ends at offset {}: what follows is not a record of this file",
                offset(at)
            )?;
        }
        Some(Stop::Invalid { at, reason }) => {
            writeln!(
                out,
                "{count} records; invalid frame at offset {}: {reason}",
                offset(at)
            )?;
            return Ok(false);
        }
        None => {}
    }
    Ok(true)
}

/// The data dir's `meta`: the bucket width it was made with.
fn inspect_meta(bytes: &[u8], out: &mut impl Write) -> io::Result<bool> {
    match FileHeader::decode(bytes, META_MAGIC) {
        Ok(meta) => {
            writeln!(
                out,
                "data dir meta: buckets of {} minutes",
                meta.segment_minutes
            )?;
            Ok(true)
        }
        Err(reason) => {
            writeln!(out, "data dir meta: bad header: {reason}")?;
            Ok(false)
        }
    }
}

/// The replayer's checkpoint: how far the WAL is filed, and each segment's durable length.
fn inspect_checkpoint(bytes: &[u8], out: &mut impl Write) -> io::Result<bool> {
    let width = bytes
        .get(10..12)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .and_then(SegmentMinutes::new);
    let decoded = width
        .ok_or("bad bucket width")
        .and_then(|width| Checkpoint::decode(bytes, width));
    let checkpoint = match decoded {
        Ok(checkpoint) => checkpoint,
        Err(reason) => {
            writeln!(out, "checkpoint: {reason}")?;
            return Ok(false);
        }
    };
    writeln!(
        out,
        "checkpoint: every WAL record below seq {} is filed; {} segments",
        checkpoint.next_seq,
        checkpoint.segments.len()
    )?;
    for (bucket, mark) in &checkpoint.segments {
        writeln!(
            out,
            "{bucket}: log_len {} entries {} last_seq {}",
            mark.log_len, mark.entries, mark.last_seq
        )?;
    }
    Ok(true)
}

fn inspect_index(bytes: &[u8], out: &mut impl Write) -> io::Result<bool> {
    writeln!(out, "schedule index")?;
    let entries = bytes.get(HEADER_LEN..).unwrap_or_default();
    let mut ok = entries.len() % INDEX_ENTRY_LEN == 0;
    for (i, chunk) in entries.chunks_exact(INDEX_ENTRY_LEN).enumerate() {
        let offset = HEADER_LEN + i * INDEX_ENTRY_LEN;
        match IndexEntry::decode(chunk) {
            Some(e) => writeln!(
                out,
                "{offset:>12}  seq {} deliver_at_ms {} offset {} len {} sink tag {:#06x}",
                e.seq, e.deliver_at_ms, e.offset, e.frame_len, e.sink_tag
            )?,
            None => {
                ok = false;
                writeln!(out, "{offset:>12}  checksum mismatch")?;
            }
        }
    }
    writeln!(
        out,
        "{} entries{}",
        entries.len() / INDEX_ENTRY_LEN,
        if ok { "" } else { "; problems found" }
    )?;
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{append_one, options, T0};
    use crate::{ManualClock, ScheduleLog};
    use std::sync::Arc;

    #[test]
    fn describes_segments_and_reports_damage() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let log = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
        let a = append_one(&log, T0 + 1000, "hello");
        log.close().unwrap();
        let segment = dir
            .path()
            .join(format!("schedule/{}.log", a.location.bucket));
        let mut out = Vec::new();
        assert!(inspect(&segment, &mut out).unwrap());
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("topic \"orders.timeout\""), "{text}");
        assert!(text.contains("1 records; clean end"), "{text}");
        let index = segment.with_extension("idx");
        assert!(inspect(&index, &mut Vec::new()).unwrap());

        let mut bytes = std::fs::read(&segment).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&segment, bytes).unwrap();
        let mut out = Vec::new();
        assert!(!inspect(&segment, &mut out).unwrap());
        assert!(String::from_utf8(out)
            .unwrap()
            .contains("invalid frame at offset 32: checksum mismatch"));
    }
}
