//! WAL files: the message log, the commit point of every append and cancel.
//!
//! ```text
//! wal/{first_seq:020}.wal   preallocated with zeros to `wal_segment_bytes`
//! 0     32   file header (header.rs): magic b"DLYDWAL\0", value = seq of the first record
//! 32    ..   zeros up to 4096
//! 4096  ..   frames (frame.rs) of kind message, cancel or padding; message and cancel seqs run
//!            first_seq, first_seq + 1, ... without gaps
//! ..    ..   zeros to the end of the file
//! wal/next.tmp              the next file, prepared in the background (zero-filled at open, else
//!                           allocated)
//! wal/spare-{seq:020}.tmp   a retired file (seq: its old first seq) kept for reuse
//! ```
//!
//! Invariants:
//! - Sequence numbers are dense: each file starts at the seq after the last record of the previous file,
//!   and a frame whose seq is not the next one ends the log exactly like a bad checksum does (it can only
//!   be a stale or forged frame).
//! - A file is synced before the next one is created, so only the last file can have a torn tail.
//! - Files are written over, never appended to: overwriting written blocks costs `fdatasync` no metadata,
//!   ~2x faster on the reference disk than appending to a growing file. The files made at open are
//!   zero-filled; one made for a rollover that found no spare is only allocated (`fallocate`: its blocks
//!   read as zeros and are not written), and its first use pays a journal commit per sync (~1.7x an
//!   overwrite's), its reuses do not (but for blocks its first use did not reach). `Make` says why.
//! - Files are reused. A file whose records are all replayed and checkpointed is retired: kept as a spare
//!   (up to a number the log sets), deleted otherwise; an idle node sheds them one per checkpoint
//!   interval (`Replay::shed_spare`), giving the space back. A rollover takes a spare when there is one
//!   (renamed to its new first seq, header rewritten) and `next.tmp` only when there is none. Past the
//!   files made at open, each record is written twice (here and in its segment), never three times
//!   (where the file system can allocate).
//! - So past the end of its own log a file may hold frames of its earlier uses. Every one of them has a
//!   seq below the file's first seq (the files before it hold the lower seqs), so the seq check ends the
//!   log at them, and the tail policy for WAL files (`check_tail`) asks not for zeros past the unsynced
//!   window, as frame.rs's does, but for no frame of the file's own use there (a seq at or above its first
//!   seq) at any block boundary: every write starts with a record frame on a block boundary. Headers say
//!   version 2 (header.rs), so that an older delayd, which would take the old frames for damage, refuses
//!   the file by its version instead.
//! - A reused file is renamed before its new header is written; its first group's `fdatasync` makes the
//!   header durable. A newest file whose header still names an earlier first seq was being reused when
//!   the process died: nothing in it was acknowledged.
//! - Every write starts and ends on a 4096-byte block boundary (the writer pads each write with a padding
//!   frame), so the file is written with `O_DIRECT`: the disk takes the bytes straight from the writer's
//!   buffer, no copy into the page cache (which nobody reads back), and no block is ever rewritten, so a
//!   torn write can only damage bytes that were never acknowledged.
//! - A file is deleted only once every record in it has been replayed and checkpointed.

use crate::entry::EntryHead;
use crate::error::{Error, Result};
use crate::frame::{self, Frames, Kind, Next, Stop, BLOCK, UNSYNCED_LIMIT};
use crate::header::{
    self, list_files, parse_offset_name, FileHeader, HEADER_LEN, REPLICATED_WAL_VERSION, WAL_MAGIC,
};
use crate::record::{Cancel, MessageHead};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

const NEXT_FILE: &str = "next.tmp";

/// Where the first frame of a WAL file starts: the header has a block of its own.
pub(crate) const DATA_START: u64 = BLOCK as u64;

pub(crate) fn wal_path(dir: &Path, first_seq: u64) -> PathBuf {
    dir.join(format!("{first_seq:020}.wal"))
}

fn spare_path(dir: &Path, old_first_seq: u64) -> PathBuf {
    dir.join(format!("spare-{old_first_seq:020}.tmp"))
}

/// The spare files in `dir`, oldest first.
fn spares(dir: &Path) -> Result<Vec<PathBuf>> {
    let spares = list_files(dir, |name| {
        (name.starts_with("spare-") && name.ends_with(".tmp")).then(|| name.to_string())
    })?;
    Ok(spares.into_iter().map(|(_, path)| path).collect())
}

/// Retires the WAL file `path` (first seq `first_seq`), all of whose records are replayed and
/// checkpointed: keeps it as a spare while fewer than `keep` are kept, deletes it otherwise. The caller
/// syncs the directory.
pub(crate) fn retire(dir: &Path, path: &Path, first_seq: u64, keep: usize) -> Result<()> {
    if spares(dir)?.len() < keep {
        let spare = spare_path(dir, first_seq);
        fs::rename(path, &spare).map_err(Error::io(&spare))
    } else {
        fs::remove_file(path).map_err(Error::io(path))
    }
}

/// How many spares `dir` holds.
#[cfg(test)]
pub(crate) fn spare_count(dir: &Path) -> Result<usize> {
    spares(dir).map(|s| s.len())
}

/// Deletes the newest spare, if there is one (the caller syncs the directory). The writer takes the
/// oldest, so the two meet only over a last spare (and `ActiveWal::roll` copes with that).
pub(crate) fn shed_spare(dir: &Path) -> Result<bool> {
    match spares(dir)?.last() {
        Some(spare) => match fs::remove_file(spare) {
            Ok(()) => Ok(true),
            // Taken by the writer since the listing.
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io(spare)(e)),
        },
        None => Ok(false),
    }
}

/// A spare of `bytes` bytes to reuse, if there is one. Spares of another size (the WAL file size was
/// changed) are deleted.
fn take_spare(dir: &Path, bytes: u64) -> Result<Option<PathBuf>> {
    for spare in spares(dir)? {
        match fs::metadata(&spare) {
            Ok(meta) if meta.len() == bytes => return Ok(Some(spare)),
            // Shed by the replayer since the listing.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            _ => match fs::remove_file(&spare) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(Error::io(&spare)(e));
                }
                _ => {}
            },
        }
    }
    Ok(None)
}

/// The seq of the message or cancel frame at the start of `bytes` (of an entry frame: its first seq), if
/// a valid one starts there.
pub(crate) fn record_seq(bytes: &[u8]) -> Option<u64> {
    match frame::decode(bytes) {
        Next::Frame {
            kind: Kind::Message,
            payload,
        } => MessageHead::decode(payload).ok().map(|h| h.seq),
        Next::Frame {
            kind: Kind::Cancel,
            payload,
        } => Cancel::decode(payload).ok().map(|c| c.seq),
        Next::Frame {
            kind: Kind::Entry,
            payload,
        } => EntryHead::decode(payload).ok().map(|(h, _)| h.first_seq),
        _ => None,
    }
}

/// The tail policy of WAL files (see the module's invariants): the log of a file ends at `at` of `body`
/// (file offset `base + at`) for `reason`. `Ok(())` when that is its end: past `window` bytes after it
/// (the unsynced window for the newest file; 0 for the others, synced before the next was made) no
/// block starts with a record of this file's own use (seq at or above `first_seq`). Otherwise synced
/// records were damaged: a corruption error naming the file and the offset.
fn check_tail(
    path: &Path,
    body: &[u8],
    (base, at): (u64, usize),
    window: usize,
    first_seq: u64,
    reason: &str,
) -> Result<()> {
    let window_end = at.saturating_add(window).next_multiple_of(BLOCK);
    let later = (window_end..body.len())
        .step_by(BLOCK)
        .find_map(|b| record_seq(&body[b..]).filter(|&seq| seq >= first_seq));
    match later {
        None => Ok(()),
        Some(seq) => Err(Error::corrupt(
            path,
            base + at as u64,
            format!("{reason}, followed by record seq {seq} more than {window} bytes later"),
        )),
    }
}

/// The WAL files in `dir`, oldest first, as (first seq, path). Stray files are ignored.
pub(crate) fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    list_files(dir, |name| {
        name.strip_suffix(".wal").and_then(parse_offset_name)
    })
}

/// A committed WAL record, borrowed from the bytes of its file or group.
#[derive(Debug, Clone)]
pub(crate) enum WalRecord {
    /// `frame` is the whole frame (header included), copied as is into the schedule segment.
    Message {
        head: MessageHead,
        frame: Range<usize>,
    },
    Cancel(Cancel),
}

impl WalRecord {
    pub(crate) fn seq(&self) -> u64 {
        match self {
            WalRecord::Message { head, .. } => head.seq,
            WalRecord::Cancel(cancel) => cancel.seq,
        }
    }
}

/// What recovery found in one WAL file.
#[derive(Debug)]
pub(crate) struct ScannedFile {
    pub bytes: Vec<u8>,
    pub records: Vec<WalRecord>,
    /// The Raft entries of a replicated data dir's file, in order.
    pub entries: Vec<ScannedEntry>,
    /// Offset just past the last valid record: where appends continue.
    pub end: u64,
    /// The seq the next record must have.
    pub next_seq: u64,
    /// Offset of a torn tail that must be zeroed before appending, if any.
    pub torn_at: Option<u64>,
    /// The log ends cleanly at a frame of the file's earlier use (`torn_at` is set all the same: a torn
    /// write may have left frames of its own in the window past it).
    pub reused_end: bool,
}

/// A Raft entry found by recovery.
#[derive(Debug, Clone)]
pub(crate) struct ScannedEntry {
    pub head: EntryHead,
    /// File offset of its entry frame, and of what follows it and its padding (the next entry, or the
    /// end of the log).
    pub at: u64,
    pub end: u64,
}

/// The entry whose records a scan is reading.
struct OpenEntry {
    head: EntryHead,
    /// Offset of its frame in the body.
    at: usize,
    first_record: usize,
    left: u32,
}

/// Reads and checks a whole WAL file. `last` says whether it is the newest file, the only one that may
/// have a torn tail. `replicated`: the data dir's WAL holds Raft entries (version 3 files), whose first
/// index must be `next_index` when it is known. `Ok(None)`: the newest file's header itself is torn (a
/// crash right after the file was created), or still names an earlier first seq (a crash while it was
/// being reused); it holds no acknowledged record and may be deleted.
pub(crate) fn scan_file(
    path: &Path,
    first_seq: u64,
    last: bool,
    replicated: bool,
    next_index: Option<u64>,
) -> Result<Option<ScannedFile>> {
    let bytes = fs::read(path).map_err(Error::io(path))?;
    match FileHeader::decode_versioned(&bytes, WAL_MAGIC) {
        Ok((h, version)) if h.value == first_seq => {
            if (version == REPLICATED_WAL_VERSION) != replicated {
                let why = match replicated {
                    true => "a single node's WAL file in a replicated data dir",
                    false => "a replicated WAL file (version 3) in a single node's data dir",
                };
                return Err(Error::corrupt(path, 8, why));
            }
        }
        Ok((h, _)) if last && h.value < first_seq => return Ok(None),
        Ok(_) => {
            return Err(Error::corrupt(
                path,
                16,
                "first seq differs from the file name",
            ))
        }
        Err(reason) => {
            if last {
                frame::check_torn_tail(path, &bytes, 0, 0, reason)?;
                return Ok(None);
            }
            return Err(Error::corrupt(path, 0, reason));
        }
    }
    let start = (DATA_START as usize).min(bytes.len());
    let body = &bytes[start..];
    let base = start as u64;
    let mut records = Vec::new();
    let mut entries = Vec::new();
    let mut open: Option<OpenEntry> = None;
    let mut next_seq = first_seq;
    let mut next_index = next_index;
    let mut frames = Frames::new(body);
    while let Some((at, kind, payload)) = frames.next() {
        if replicated {
            let inside = open.as_ref().is_some_and(|o| o.left > 0);
            match kind {
                Kind::Entry if inside => {
                    frames.reject_last(at, "an entry frame among the records of another");
                    break;
                }
                Kind::Entry => {
                    if let Some(done) = open.take() {
                        entries.push(done.scanned(base, at));
                    }
                    let head = match EntryHead::decode(payload) {
                        Ok((head, _)) => head,
                        Err(reason) => {
                            frames.reject_last(at, reason);
                            break;
                        }
                    };
                    let reason = if head.first_seq < first_seq {
                        Some("an entry of the file's earlier use")
                    } else if head.first_seq != next_seq {
                        Some("sequence gap")
                    } else if next_index.is_some_and(|i| i != head.log_id.index) {
                        Some("entry index gap")
                    } else if !(base + at as u64).is_multiple_of(BLOCK as u64) {
                        Some("an entry frame off a block boundary")
                    } else {
                        None
                    };
                    if let Some(reason) = reason {
                        frames.reject_last(at, reason);
                        break;
                    }
                    next_index = Some(head.log_id.index + 1);
                    open = Some(OpenEntry {
                        head,
                        at,
                        first_record: records.len(),
                        left: head.records,
                    });
                    continue;
                }
                Kind::Message | Kind::Cancel | Kind::PlacedOutcome | Kind::App if !inside => {
                    frames.reject_last(at, "a record outside an entry");
                    break;
                }
                // An outcome or an application payload takes no seq: it only counts towards its
                // entry's records.
                Kind::PlacedOutcome | Kind::App => {
                    if let Some(open) = &mut open {
                        open.left -= 1;
                    }
                    continue;
                }
                Kind::Padding if inside => {
                    frames.reject_last(at, "padding among the records of an entry");
                    break;
                }
                _ => {}
            }
        }
        let record = match kind {
            Kind::Message => MessageHead::decode(payload).map(|head| WalRecord::Message {
                head,
                frame: start + at..start + at + frame::HEADER_LEN + payload.len(),
            }),
            Kind::Cancel => Cancel::decode(payload).map(WalRecord::Cancel),
            Kind::Padding => continue,
            Kind::Outcome | Kind::Broker | Kind::Entry | Kind::PlacedOutcome | Kind::App => {
                frames.reject_last(at, "a frame kind that does not belong in the WAL");
                break;
            }
        };
        match record {
            Ok(record) if record.seq() == next_seq => {
                next_seq += 1;
                records.push(record);
                if let Some(open) = &mut open {
                    open.left -= 1;
                }
            }
            Ok(record) if record.seq() < first_seq => {
                frames.reject_last(at, "a record of the file's earlier use");
                break;
            }
            Ok(_) => {
                frames.reject_last(at, "sequence gap");
                break;
            }
            Err(e) => return Err(Error::corrupt(path, base + at as u64, e.to_string())),
        }
    }
    let mut stop = frames.stop();
    match open {
        // A torn entry: the log ends where it starts, without its records.
        Some(torn) if torn.left > 0 => {
            records.truncate(torn.first_record);
            next_seq = torn.head.first_seq;
            let reason = match stop {
                Some(Stop::Invalid { reason, .. }) => reason,
                _ => "an entry with fewer records than it says",
            };
            stop = Some(Stop::Invalid {
                at: torn.at,
                reason,
            });
        }
        Some(done) => {
            let end = match stop {
                Some(Stop::End { at } | Stop::Invalid { at, .. }) => at,
                None => body.len(),
            };
            entries.push(done.scanned(base, end));
        }
        None => {}
    }
    let (end, torn_at, reused_end) = match stop {
        Some(Stop::End { at }) => (at, None, false),
        Some(Stop::Invalid { at, reason }) => {
            let reused_end = record_seq(&body[at..]).is_some_and(|seq| seq < first_seq);
            // An older file was synced whole before the next one was made: its own log ends at a block
            // boundary (writes are padded), and past it lie only zeros or its earlier uses' bytes,
            // which need not start with a frame there (an old group or record may span it).
            if !last && !(base + at as u64).is_multiple_of(BLOCK as u64) {
                return Err(Error::corrupt(path, base + at as u64, reason));
            }
            let window = if last { UNSYNCED_LIMIT } else { 0 };
            check_tail(path, body, (base, at), window, first_seq, reason)?;
            (at, last.then_some(base + at as u64), reused_end)
        }
        None => unreachable!("the frame walk ended without a stop"),
    };
    Ok(Some(ScannedFile {
        end: base + end as u64,
        records,
        entries,
        next_seq,
        torn_at,
        reused_end,
        bytes,
    }))
}

impl OpenEntry {
    /// The entry, complete; the next one (or the end of the log) starts at body offset `end`.
    fn scanned(self, base: u64, end: usize) -> ScannedEntry {
        ScannedEntry {
            head: self.head,
            at: base + self.at as u64,
            end: base + end as u64,
        }
    }
}

/// Zeroes the unsynced window of a torn tail (from `at`, up to `frame::UNSYNCED_LIMIT` bytes, as far as
/// there are non-zero bytes) and syncs, so that no frame a torn write left there is read as a record
/// once appends continue at `at`. Past the window there is nothing of the file's own use (`check_tail`
/// made sure), only zeros or frames of its earlier uses, which the seq check rejects. `torn` counts it as
/// a torn tail (not so for a clean end at a frame of an earlier use).
pub(crate) fn zero_torn_tail(path: &Path, bytes: &[u8], at: u64, torn: bool) -> Result<()> {
    let start = usize::try_from(at).unwrap_or(bytes.len()).min(bytes.len());
    let window = &bytes[..start.saturating_add(UNSYNCED_LIMIT).min(bytes.len())];
    let end = window
        .iter()
        .rposition(|&b| b != 0)
        .map_or(start, |i| (i + 1).max(start));
    if end > start {
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(Error::io(path))?;
        file.write_all_at(&vec![0u8; end - start], at)
            .map_err(Error::io(path))?;
        crate::slow_disk::sync();
        file.sync_data().map_err(Error::sync(path))?;
    }
    if torn {
        metrics::counter!("delayd_log_torn_tails_total").increment(1);
    }
    Ok(())
}

/// Fills a replicated WAL file from `end` (just past a whole entry, where a torn padding frame was
/// zeroed) to a block boundary with a padding frame, synced, so that a scan goes on to the entries
/// written next; returns where they start. Done at open, before anything is appended, so a crash while
/// at it leaves the file as it was. (A single node starts a new file instead, which a replicated file
/// of entries without records cannot do: the new file would take its name.)
pub(crate) fn pad_tail(path: &Path, end: u64) -> Result<u64> {
    let mut buf = vec![0u8; (end % BLOCK as u64) as usize];
    frame::pad_to_block(&mut buf, 0);
    let gap = &buf[(end % BLOCK as u64) as usize..];
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(Error::io(path))?;
    file.write_all_at(gap, end).map_err(Error::io(path))?;
    crate::slow_disk::sync();
    file.sync_data().map_err(Error::sync(path))?;
    Ok(end + gap.len() as u64)
}

/// The file the writer appends to, and the preparation of the one after it.
#[derive(Debug)]
pub(crate) struct ActiveWal {
    dir: PathBuf,
    segment_bytes: u64,
    file: File,
    path: PathBuf,
    /// The current file's first seq (its name).
    first_seq: u64,
    /// The format version its files are written with (`REPLICATED_WAL_VERSION` for Raft entries).
    version: u16,
    /// Where the next write goes; always a multiple of [`BLOCK`].
    pos: u64,
    next: Option<JoinHandle<Result<()>>>,
    staging: AlignedBuf,
}

impl ActiveWal {
    /// Continues appending to an existing file at `pos`, which must be block-aligned.
    pub(crate) fn resume(
        dir: &Path,
        (segment_bytes, version): (u64, u16),
        (first_seq, path): (u64, &Path),
        pos: u64,
    ) -> Result<ActiveWal> {
        debug_assert_eq!(pos % BLOCK as u64, 0);
        let file = open_direct(path).map_err(Error::io(path))?;
        let mut wal = ActiveWal {
            dir: dir.to_path_buf(),
            segment_bytes,
            file,
            path: path.to_path_buf(),
            first_seq,
            version,
            pos,
            next: None,
            staging: AlignedBuf::default(),
        };
        wal.prepare_next(Make::Written);
        Ok(wal)
    }

    /// Starts a new WAL file whose first record will be `first_seq`.
    pub(crate) fn create(
        dir: &Path,
        (segment_bytes, version): (u64, u16),
        first_seq: u64,
    ) -> Result<ActiveWal> {
        let next = dir.join(NEXT_FILE);
        prepare(&next, segment_bytes, Make::Written)?;
        let mut staging = AlignedBuf::default();
        let (file, path) = install(dir, &next, (first_seq, version), &mut staging)?;
        let mut wal = ActiveWal {
            dir: dir.to_path_buf(),
            segment_bytes,
            file,
            path,
            first_seq,
            version,
            pos: DATA_START,
            next: None,
            staging,
        };
        wal.prepare_next(Make::Written);
        Ok(wal)
    }

    /// Fails with a full disk when the file system reports less free space than a new file takes and
    /// there is no spare to reuse. For retries after a rollover found the disk full: a retry that
    /// prepares a file until `ENOSPC` may write (and delete) up to a whole file's worth of bytes each
    /// time (where the file system cannot allocate), for nothing.
    pub(crate) fn check_room_for_next(&self) -> Result<()> {
        let next = self.dir.join(NEXT_FILE);
        if !spares(&self.dir)?.is_empty() {
            return Ok(());
        }
        let available = crate::sys::available_bytes(&self.dir).map_err(Error::io(&self.dir))?;
        if available >= self.segment_bytes {
            return Ok(());
        }
        let why = format!(
            "No space left on device: {available} bytes free, a WAL file takes {}",
            self.segment_bytes
        );
        Err(Error::io(next)(io::Error::new(
            io::ErrorKind::StorageFull,
            why,
        )))
    }

    /// Bytes still free in the current file.
    pub(crate) fn remaining(&self) -> u64 {
        self.segment_bytes.saturating_sub(self.pos)
    }

    /// Where the next write goes in the current file.
    pub(crate) fn position(&self) -> u64 {
        self.pos
    }

    /// The current file's first seq.
    pub(crate) fn first_seq(&self) -> u64 {
        self.first_seq
    }

    /// Cuts the log back to offset `at` of the file named `first_seq` (block-aligned): deletes every
    /// later file, newest first, then zeroes that file from `end` back to `at`, a chunk and a sync at a
    /// time (a crash midway leaves a shorter log, never a hole followed by records), and continues
    /// there.
    pub(crate) fn cut_back(&mut self, first_seq: u64, at: u64, end: u64) -> Result<()> {
        const CHUNK: u64 = 1 << 20;
        debug_assert_eq!(at % BLOCK as u64, 0);
        let later: Vec<_> = list(&self.dir)?
            .into_iter()
            .filter(|(first, _)| *first > first_seq)
            .collect();
        // One directory sync per file: the deletions must reach the disk newest first, or a crash
        // could leave a gap in the files' seqs.
        for (_, path) in later.iter().rev() {
            fs::remove_file(path).map_err(Error::io(path))?;
            header::sync_dir(&self.dir)?;
        }
        let path = wal_path(&self.dir, first_seq);
        let zeros = vec![0u8; CHUNK.min(end.saturating_sub(at)) as usize];
        let file = OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(Error::io(&path))?;
        let mut to = end;
        while to > at {
            let from = to.saturating_sub(CHUNK).max(at);
            file.write_all_at(&zeros[..(to - from) as usize], from)
                .map_err(Error::io(&path))?;
            crate::slow_disk::sync();
            file.sync_data().map_err(Error::sync(&path))?;
            to = from;
        }
        if path != self.path {
            self.file = open_direct(&path).map_err(Error::io(&path))?;
            self.path = path;
            self.first_seq = first_seq;
        }
        self.pos = at;
        Ok(())
    }

    /// Nothing has been written to the current file yet.
    pub(crate) fn is_empty(&self) -> bool {
        self.pos == DATA_START
    }

    /// Writes whole blocks at the current position (no sync). Bytes at a block-aligned address go to the
    /// disk as they are; others are copied to an aligned buffer first.
    pub(crate) fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        debug_assert_eq!(bytes.len() % BLOCK, 0);
        crate::slow_disk::write(bytes.len());
        if bytes.as_ptr().align_offset(BLOCK) == 0 {
            self.file.write_all_at(bytes, self.pos)?;
        } else {
            let window = self.staging.window(bytes.len());
            window.copy_from_slice(bytes);
            self.file.write_all_at(window, self.pos)?;
        }
        self.pos += bytes.len() as u64;
        Ok(())
    }

    pub(crate) fn sync(&self) -> io::Result<()> {
        crate::slow_disk::sync();
        self.file.sync_data()
    }

    /// The file being appended to.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Switches to a file whose first record is `first_seq`: a spare when there is one, else
    /// `next.tmp`. The caller has synced the current file. A failure to prepare the new file
    /// changed nothing (the current file stays active, and the half-prepared one is deleted), so a roll
    /// that found the disk full may be tried again; a failure to install it leaves the directory in a
    /// state only recovery sorts out.
    pub(crate) fn roll(&mut self, first_seq: u64) -> Result<(), RollError> {
        if let Some(spare) =
            take_spare(&self.dir, self.segment_bytes).map_err(RollError::Prepare)?
        {
            let path = wal_path(&self.dir, first_seq);
            match fs::rename(&spare, &path) {
                Ok(()) => {
                    (self.file, self.path) = start(
                        &self.dir,
                        path,
                        (first_seq, self.version),
                        &mut self.staging,
                    )
                    .map_err(RollError::Install)?;
                    self.first_seq = first_seq;
                    self.pos = DATA_START;
                    metrics::counter!("delayd_wal_files_total", "from" => "spare").increment(1);
                    // `next.tmp` (prepared, or being prepared) stays for a rollover finding no spare.
                    return Ok(());
                }
                // Shed by the replayer since the listing (an idle node gives its spares back):
                // nothing changed, and `next.tmp` serves.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(RollError::Prepare(Error::io(&path)(e))),
            }
        }
        let next = self.dir.join(NEXT_FILE);
        let prepared = match self.next.take() {
            Some(handle) => handle.join().unwrap_or_else(|_| {
                Err(Error::io(&next)(io::Error::other(
                    "WAL preparation thread panicked",
                )))
            }),
            None => prepare(&next, self.segment_bytes, Make::Allocated),
        };
        if let Err(e) = prepared {
            // Gives the space a half-filled file took back.
            let _ = fs::remove_file(&next);
            return Err(RollError::Prepare(e));
        }
        (self.file, self.path) = install(
            &self.dir,
            &next,
            (first_seq, self.version),
            &mut self.staging,
        )
        .map_err(RollError::Install)?;
        self.first_seq = first_seq;
        self.pos = DATA_START;
        // Past the first after a start (zero-filled), each one's first use pays a journal commit per sync
        // (`Make::Allocated`): the cost to a node short of spares.
        metrics::counter!("delayd_wal_files_total", "from" => "new").increment(1);
        self.prepare_next(Make::Allocated);
        Ok(())
    }

    fn prepare_next(&mut self, make: Make) {
        let path = self.dir.join(NEXT_FILE);
        let bytes = self.segment_bytes;
        let spawned = std::thread::Builder::new()
            .name("delayd-wal-prep".into())
            .spawn(move || prepare(&path, bytes, make));
        self.next = spawned.ok();
    }
}

/// Why a rollover failed.
#[derive(Debug)]
pub(crate) enum RollError {
    /// Preparing the next file failed; nothing changed.
    Prepare(Error),
    /// The prepared file could not be put in place (after which it may be there, without a header).
    Install(Error),
}

/// A reusable buffer with a window that starts on a block boundary, as `O_DIRECT` requires. (Found
/// inside a larger `Vec` with `align_offset`, so no allocator tricks and no `unsafe`.)
#[derive(Debug, Default)]
struct AlignedBuf {
    raw: Vec<u8>,
}

impl AlignedBuf {
    fn window(&mut self, len: usize) -> &mut [u8] {
        if self.raw.len() < len + BLOCK {
            self.raw = vec![0; (len + BLOCK).next_power_of_two()];
        }
        let start = self.raw.as_ptr().align_offset(BLOCK).min(BLOCK);
        &mut self.raw[start..start + len]
    }
}

/// Opens a file for writing with `O_DIRECT`, or without it where the file system refuses it (tmpfs).
fn open_direct(path: &Path) -> io::Result<File> {
    let direct = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    match direct {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            OpenOptions::new().write(true).open(path)
        }
        other => other,
    }
}

/// How a new WAL file is made (both read as zeros).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Make {
    /// Zeros written (with `O_DIRECT`: the disk copies them by DMA, no CPU, no page cache): its syncs are
    /// overwrites from the first. At open, when the node has the time: a quiet node may write into its
    /// first files for days, and an allocated file's syncs cost it ~1.7x on every request (a fresh
    /// node's single-message ingest was a fifth lower with an allocated first file).
    Written,
    /// Space allocated (`fallocate`), nothing written: for a rollover that found no spare, a node growing
    /// its WAL under load. Zero-filling then wrote a whole file of extra bytes for every file the WAL
    /// grew by (write amplification 2.4-2.8 instead of 2.2 on the realistic mix, issue 15); a sync of a
    /// write into allocated space commits the journal (the extent becomes written), ~1.7x an overwrite's
    /// on the reference disk, only until the file comes back as a spare. Zeros are written where the file
    /// system cannot allocate.
    Allocated,
}

/// Makes a file of `bytes` bytes at `path` that reads as zeros, and syncs it.
fn prepare(path: &Path, bytes: u64, make: Make) -> Result<()> {
    const CHUNK: usize = 1 << 20;
    let fill = || -> io::Result<File> {
        let file = File::create(path)?;
        if make == Make::Allocated {
            match crate::sys::allocate(&file, bytes) {
                Err(e) if e.kind() == io::ErrorKind::Unsupported => {}
                other => return other.map(|()| file),
            }
        }
        let mut file = open_direct(path)?;
        let mut buffer = AlignedBuf::default();
        let chunk = buffer.window(CHUNK);
        let mut left = bytes;
        while left >= CHUNK as u64 {
            crate::slow_disk::write(CHUNK);
            file.write_all(chunk)?;
            left -= CHUNK as u64;
        }
        let tail = left - left % BLOCK as u64;
        file.write_all(&chunk[..tail as usize])?;
        Ok(file)
    };
    let file = fill().map_err(Error::io(path))?;
    crate::slow_disk::sync();
    file.sync_all().map_err(Error::sync(path))
}

/// Renames a prepared file (`next.tmp` or a spare) to the name of its first seq and writes its header
/// block. The header is made durable by the first group's fdatasync; the name by the directory fsync
/// here.
fn install(
    dir: &Path,
    prepared: &Path,
    (first_seq, version): (u64, u16),
    staging: &mut AlignedBuf,
) -> Result<(File, PathBuf)> {
    let path = wal_path(dir, first_seq);
    fs::rename(prepared, &path).map_err(Error::io(&path))?;
    start(dir, path, (first_seq, version), staging)
}

/// Writes the header block of the WAL file just renamed to `path` and syncs the directory.
fn start(
    dir: &Path,
    path: PathBuf,
    (first_seq, version): (u64, u16),
    staging: &mut AlignedBuf,
) -> Result<(File, PathBuf)> {
    let file = open_direct(&path).map_err(Error::io(&path))?;
    let header = FileHeader {
        magic: WAL_MAGIC,
        segment_minutes: 0,
        value: first_seq,
    };
    let block = staging.window(BLOCK);
    block.fill(0);
    block[..HEADER_LEN].copy_from_slice(&header.encode_as(version));
    file.write_all_at(block, 0).map_err(Error::io(&path))?;
    header::sync_dir(dir)?;
    Ok((file, path))
}

/// Deletes a leftover `next.tmp` (its preparation may have been cut short by a crash).
pub(crate) fn remove_leftovers(dir: &Path) -> Result<()> {
    match fs::remove_file(dir.join(NEXT_FILE)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(dir.join(NEXT_FILE))(e)),
    }
}
