//! What `delayd inspect` prints for the broker's own files, every checksum verified: a commit-log
//! segment (each record's message), a store's checkpoint, a consume-queue file (each unit) and a
//! consumer group's offsets. The engine's files are `schedulelog::inspect`'s.

use super::commitlog::{self, HEADER_LEN};
use super::queue::{Unit, UNIT_LEN};
use super::record::decode_payload;
use super::store::decode_checkpoint;
use schedulelog::frame::{Frames, Kind};
use schedulelog::write_end_of_frames;
use std::io::{self, Write};
use std::path::Path;

/// Describes the broker file at `path` to `out`: `Some(clean)` for a broker file (`clean`: every
/// record checked out and it ends cleanly), `None` for a file that is not the broker's.
pub fn inspect(path: &Path, out: &mut impl Write) -> io::Result<Option<bool>> {
    let bytes = std::fs::read(path)?;
    if bytes.starts_with(commitlog::MAGIC) {
        return commit_log(&bytes, out).map(Some);
    }
    if bytes.starts_with(b"DLYD") {
        return Ok(None); // one of the engine's files
    }
    // The broker's other files have no magic: they are known by where they are in the data dir.
    let path = std::fs::canonicalize(path)?;
    let name = |up: usize| {
        path.ancestors()
            .nth(up)
            .and_then(Path::file_name)
            .and_then(|n| n.to_str())
            .unwrap_or_default()
    };
    let broker = |up: usize| name(up) == "broker" || name(up) == "dead" && name(up + 1) == "broker";
    if name(0) == "checkpoint" && broker(1) {
        return match decode_checkpoint(&bytes) {
            Some(end) => writeln!(out, "broker store checkpoint: a start reads the commit log from offset {end} (or from the floor in `settled`, if that is earlier)").map(|()| Some(true)),
            None => writeln!(out, "broker store checkpoint: damaged (12 bytes with a CRC-32C expected; a start reads the whole commit log)").map(|()| Some(false)),
        };
    }
    if name(0) == "settled" && broker(1) {
        return match super::outcomes::decode_settled(&bytes) {
            Some(settled) => writeln!(out, "broker store floor: every delivery below commit log offset {} has its outcome; a start looks up those from there on, in the dispatch logs of {} buckets from their marks (others' whole)", settled.floor, settled.marks.len()).map(|()| Some(true)),
            None => writeln!(out, "broker store floor: damaged (a floor, marks and a CRC-32C expected; a start looks up the deliveries from the checkpoint on)").map(|()| Some(false)),
        };
    }
    // consumequeue/{topic}/{queue}/{first}
    if name(3) == "consumequeue" && broker(4) {
        return consume_queue(name(0), &bytes, out).map(Some);
    }
    if name(1) == "groups" && name(2) == "broker" {
        let group = name(0);
        return match serde_json::from_slice::<serde_json::Value>(&bytes) {
            Ok(offsets) => writeln!(
                out,
                "consumer group {group:?}: offsets by topic and queue {offsets}"
            )
            .map(|()| Some(true)),
            Err(e) => {
                writeln!(out, "consumer group {group:?}: not JSON: {e}").map(|()| Some(false))
            }
        };
    }
    Ok(None)
}

fn commit_log(bytes: &[u8], out: &mut impl Write) -> io::Result<bool> {
    let start = HEADER_LEN as usize;
    let base = bytes
        .get(16..24)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes);
    writeln!(out, "broker commit log segment, base offset {base}")?;
    let body = bytes.get(start..).unwrap_or_default();
    let mut frames = Frames::new(body);
    let (mut count, mut ok) = (0u64, true);
    for (at, kind, payload) in frames.by_ref() {
        let offset = base + (start + at) as u64;
        let line = match (kind, decode_payload(payload)) {
            (Kind::Broker, Some((meta, body))) => format!(
                "topic {:?} queue {} queue_offset {} id {} attempt {} delivered_at_ms {} body {} bytes",
                meta.topic,
                meta.queue,
                meta.queue_offset,
                meta.id,
                meta.attempt,
                meta.delivered_at_ms,
                body.len()
            ),
            (Kind::Padding, _) => continue,
            (kind, _) => {
                ok = false;
                format!("not a broker record ({kind:?}, {} bytes)", payload.len())
            }
        };
        count += 1;
        writeln!(out, "{offset:>12}  {line}")?;
    }
    let ended = write_end_of_frames(
        out,
        count,
        body,
        frames.stop(),
        |_| false,
        |at| base + (start + at) as u64,
    )?;
    Ok(ok && ended)
}

/// A consume-queue file, named for the queue offset of its first unit.
fn consume_queue(name: &str, bytes: &[u8], out: &mut impl Write) -> io::Result<bool> {
    let first: u64 = name.parse().unwrap_or(0);
    writeln!(out, "consume queue file, units from queue offset {first}")?;
    let mut units = bytes.chunks_exact(UNIT_LEN as usize);
    for (i, chunk) in units.by_ref().enumerate() {
        let unit = Unit::decode(chunk);
        writeln!(
            out,
            "{:>12}  commit log offset {} frame {} bytes tag {:#x}",
            first + i as u64,
            unit.log_offset,
            unit.len,
            unit.tag
        )?;
    }
    let rest = units.remainder().len();
    if rest > 0 {
        writeln!(
            out,
            "{} units and a torn one of {rest} bytes",
            bytes.len() / UNIT_LEN as usize
        )?;
        return Ok(false);
    }
    writeln!(out, "{} units", bytes.len() / UNIT_LEN as usize)?;
    Ok(true)
}
