//! Schedule segments: one per bucket, holding the messages due in it, and their index.
//!
//! ```text
//! schedule/{YYYYMMDDTHHMM}Z.log   file header (magic b"DLYDSEG\0", segment_minutes, value = bucket start
//!                                 minute), then message frames exactly as they were in the WAL, in
//!                                 increasing seq order
//! schedule/{YYYYMMDDTHHMM}Z.idx   file header (magic b"DLYDIDX\0", same fields), then one 32-byte entry
//!                                 per message, in the same order:
//!   0   8  seq            u64
//!   8   8  deliver_at_ms  i64
//!   16  8  offset | tag   u64  bits 16..64: offset of the frame in the .log file (segments are below
//!                              256 TiB); bits 0..16: the sink tag of the message (record.rs `sink_tag`)
//!   24  4  frame_len      u32  bits 0..31: the frame's length, header included; bit 31: the message
//!                              has an idempotency key (`dedup`)
//!   28  4  crc            u32  CRC-32C of bytes 0..28
//! ```
//!
//! Invariants:
//! - Only the replayer writes segments, appending in increasing seq order, so a segment's seqs are sorted
//!   and the index can be binary-searched by seq.
//! - The checkpoint records each segment's synced `.log` length and `.idx` entry count; on open, anything
//!   past them is cut (it is replayed again from the WAL). So a segment never holds a record twice.
//! - Readers never read past the entry count the replayer has published, so they never see a half-written
//!   entry.
//! - A writer's `written` mark only moves when a write of records succeeded. A write that failed (a full
//!   disk) leaves the writer at that mark: bytes that reached the files past it are cut, or overwritten
//!   by the next write, and never published or checkpointed. So the replayer can write the same records
//!   again and get each in the segment once.

use crate::bucket::{Bucket, SegmentMinutes};
use crate::error::{Error, Result};
use crate::frame::{self, Kind, Next};
use crate::header::{
    list_files, open_data_file, FileHeader, OpenMode, HEADER_LEN, INDEX_MAGIC, SEGMENT_MAGIC,
};
use crate::record::{Message, MessageHead, MessageMeta, PrefixError};
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub const INDEX_ENTRY_LEN: usize = 32;

/// Where a message is in its segment and when it is due: what the loader pages into the wheel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    pub seq: u64,
    pub deliver_at_ms: i64,
    pub offset: u64,
    pub frame_len: u32,
    pub sink_tag: u16,
    /// The message has an idempotency key.
    pub dedup: bool,
}

impl IndexEntry {
    fn encode(&self) -> [u8; INDEX_ENTRY_LEN] {
        let mut out = [0u8; INDEX_ENTRY_LEN];
        out[0..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..16].copy_from_slice(&self.deliver_at_ms.to_le_bytes());
        out[16..24].copy_from_slice(&(self.offset << 16 | u64::from(self.sink_tag)).to_le_bytes());
        let flagged = self.frame_len | if self.dedup { 1 << 31 } else { 0 };
        out[24..28].copy_from_slice(&flagged.to_le_bytes());
        let crc = crc32c::crc32c(&out[..28]);
        out[28..32].copy_from_slice(&crc.to_le_bytes());
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Option<IndexEntry> {
        let field = |r: std::ops::Range<usize>| -> [u8; 8] {
            let mut out = [0u8; 8];
            out.copy_from_slice(&bytes[r]);
            out
        };
        let crc = u32::from_le_bytes([bytes[28], bytes[29], bytes[30], bytes[31]]);
        (crc32c::crc32c(&bytes[..28]) == crc).then(|| IndexEntry {
            seq: u64::from_le_bytes(field(0..8)),
            deliver_at_ms: i64::from_le_bytes(field(8..16)),
            offset: u64::from_le_bytes(field(16..24)) >> 16,
            sink_tag: (u64::from_le_bytes(field(16..24)) & 0xffff) as u16,
            frame_len: u32::from_le_bytes([bytes[24], bytes[25], bytes[26], bytes[27]])
                & !(1 << 31),
            dedup: bytes[27] & 0x80 != 0,
        })
    }
}

pub(crate) fn log_path(dir: &Path, bucket: Bucket) -> PathBuf {
    dir.join(format!("{bucket}.log"))
}

pub(crate) fn index_path(dir: &Path, bucket: Bucket) -> PathBuf {
    dir.join(format!("{bucket}.idx"))
}

/// The checkpointed state of a segment: how much of it is durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SegmentMark {
    pub log_len: u64,
    pub entries: u64,
    pub last_seq: u64,
}

/// The replayer's handle on one segment.
#[derive(Debug)]
pub(crate) struct SegmentWriter {
    log: File,
    index: File,
    log_path: PathBuf,
    index_path: PathBuf,
    /// Written to the files (not necessarily synced).
    written: SegmentMark,
    /// Where the `.log`'s next writeback chunk starts (see `write_frames`).
    writeback_from: u64,
    #[cfg(test)]
    pub faults: std::sync::Arc<crate::fault::Faults>,
}

/// The `.log` is handed to the kernel for writeback in chunks of this size as it fills.
const WRITEBACK_CHUNK: u64 = 4 << 20;

impl SegmentWriter {
    /// Creates a new, empty segment (files with headers only; the caller syncs the directory).
    pub(crate) fn create(
        dir: &Path,
        bucket: Bucket,
        width: SegmentMinutes,
    ) -> Result<SegmentWriter> {
        let open = |path: &Path, magic| -> Result<File> {
            let file = open_data_file(path, OpenMode::Empty).map_err(Error::io(path))?;
            let header = FileHeader {
                magic,
                segment_minutes: width.get(),
                value: u64::from(bucket.start_minute()),
            };
            file.write_all_at(&header.encode(), 0)
                .map_err(Error::io(path))?;
            Ok(file)
        };
        let (log_path, index_path) = (log_path(dir, bucket), index_path(dir, bucket));
        Ok(SegmentWriter {
            log: open(&log_path, SEGMENT_MAGIC)?,
            index: open(&index_path, INDEX_MAGIC)?,
            log_path,
            index_path,
            written: SegmentMark {
                log_len: HEADER_LEN as u64,
                entries: 0,
                last_seq: 0,
            },
            writeback_from: 0,
            #[cfg(test)]
            faults: Default::default(),
        })
    }

    /// Opens an existing segment and cuts it back to its checkpointed `mark`.
    pub(crate) fn open(
        dir: &Path,
        bucket: Bucket,
        width: SegmentMinutes,
        mark: SegmentMark,
    ) -> Result<SegmentWriter> {
        let open = |path: &Path, magic, len: u64| -> Result<File> {
            let file = open_data_file(path, OpenMode::Existing).map_err(Error::io(path))?;
            let mut header = [0u8; HEADER_LEN];
            file.read_exact_at(&mut header, 0)
                .map_err(Error::io(path))?;
            let header = FileHeader::check(&header, magic, path)?;
            if header.value != u64::from(bucket.start_minute())
                || header.segment_minutes != width.get()
            {
                return Err(Error::corrupt(
                    path,
                    0,
                    "header does not match the file name",
                ));
            }
            let actual = file.metadata().map_err(Error::io(path))?.len();
            if actual < len {
                return Err(Error::corrupt(
                    path,
                    actual,
                    format!("shorter than its checkpointed length {len}"),
                ));
            }
            if actual > len {
                file.set_len(len).map_err(Error::io(path))?;
                file.sync_all().map_err(Error::sync(path))?;
            }
            Ok(file)
        };
        let (log_path, index_path) = (log_path(dir, bucket), index_path(dir, bucket));
        let index_len = HEADER_LEN as u64 + mark.entries * INDEX_ENTRY_LEN as u64;
        Ok(SegmentWriter {
            log: open(&log_path, SEGMENT_MAGIC, mark.log_len)?,
            index: open(&index_path, INDEX_MAGIC, index_len)?,
            log_path,
            index_path,
            written: mark,
            writeback_from: mark.log_len / WRITEBACK_CHUNK * WRITEBACK_CHUNK,
            #[cfg(test)]
            faults: Default::default(),
        })
    }

    /// The seq of the last record written (0 if none): replay skips seqs at or below it.
    pub(crate) fn last_seq(&self) -> u64 {
        self.written.last_seq
    }

    /// Writes message frames (as they were in the WAL, in increasing seq order, above
    /// [`SegmentWriter::last_seq`]) and their index entries (no sync). `frames` are the messages' heads
    /// and frame lengths, `log` the frames' bytes in the same order, in as few slices as the caller
    /// has them: they go to the file in one vectored write straight from the caller's buffers, for
    /// gathering them into one first cost the replayer a copy of every record. Returns their index
    /// entries and the mark of what is now written.
    ///
    /// On failure none of them counts as written: the writer is back at its last written mark (see the
    /// module's invariants), so the caller can write them again.
    pub(crate) fn write_frames(
        &mut self,
        frames: &[(&MessageHead, usize)],
        log: &[&[u8]],
    ) -> Result<(Vec<IndexEntry>, SegmentMark)> {
        let mut entries = Vec::with_capacity(frames.len());
        let mut index = Vec::with_capacity(frames.len() * INDEX_ENTRY_LEN);
        let mut log_len = self.written.log_len;
        let mut last_seq = self.written.last_seq;
        for &(head, frame_len) in frames {
            debug_assert!(head.seq > last_seq);
            let entry = IndexEntry {
                seq: head.seq,
                deliver_at_ms: head.deliver_at_ms,
                sink_tag: head.sink_tag,
                dedup: head.dedup,
                offset: log_len,
                frame_len: u32::try_from(frame_len).expect("frames are bounded by MAX_PAYLOAD"),
            };
            log_len += frame_len as u64;
            last_seq = head.seq;
            index.extend_from_slice(&entry.encode());
            entries.push(entry);
        }
        debug_assert_eq!(
            log.iter().map(|l| l.len() as u64).sum::<u64>(),
            log_len - self.written.log_len,
            "the frames' bytes and lengths agree"
        );
        if entries.is_empty() {
            return Ok((entries, self.written));
        }
        if let Err(e) = self.write_files(log, &index) {
            self.cut_back();
            return Err(e);
        }
        self.written = SegmentMark {
            log_len,
            entries: self.written.entries + entries.len() as u64,
            last_seq,
        };
        // Whole written-out chunks start their way to the disk now: left to the checkpoint, a burst
        // makes one fdatasync of hundreds of megabytes that stalls every other sync behind it.
        let full = self.written.log_len / WRITEBACK_CHUNK * WRITEBACK_CHUNK;
        if full > self.writeback_from {
            // Advice only: the checkpoint's fdatasync is what makes the data durable.
            let _ = crate::sys::start_writeback(
                &self.log,
                self.writeback_from,
                full - self.writeback_from,
            );
            self.writeback_from = full;
        }
        Ok((entries, self.written))
    }

    /// Writes frames at the `.log`'s written end and index entries at the `.idx`'s.
    fn write_files(&self, log: &[&[u8]], index: &[u8]) -> Result<()> {
        let index_at = HEADER_LEN as u64 + self.written.entries * INDEX_ENTRY_LEN as u64;
        let write_log = || {
            crate::sys::write_all_vectored_at(&self.log, log, self.written.log_len)
                .map_err(Error::io(&self.log_path))
        };
        #[cfg(test)]
        if self.faults.strikes(crate::fault::Point::SegmentWrite) {
            // As a full disk part-way through leaves it: the records in the .log, half their entries in
            // the .idx.
            write_log()?;
            self.index
                .write_all_at(&index[..index.len().div_ceil(2)], index_at)
                .map_err(Error::io(&self.index_path))?;
            return Err(Error::io(&self.index_path)(crate::fault::no_space()));
        }
        crate::slow_disk::write(log.iter().map(|l| l.len()).sum());
        write_log()?;
        crate::slow_disk::write(index.len());
        self.index
            .write_all_at(index, index_at)
            .map_err(Error::io(&self.index_path))
    }

    /// Cuts what part of a failed write reached the files. Best effort, and only to give the space back
    /// at once: bytes past the mark are overwritten by the next write, and cut on open if a crash comes
    /// first.
    fn cut_back(&self) {
        let index_len = HEADER_LEN as u64 + self.written.entries * INDEX_ENTRY_LEN as u64;
        let _ = self.log.set_len(self.written.log_len);
        let _ = self.index.set_len(index_len);
    }

    pub(crate) fn mark(&self) -> SegmentMark {
        self.written
    }
}

/// Reads records of a segment's log at places known from elsewhere (a wheel entry, an index entry).
/// Needs no index, so it stays valid as the segment grows: a record, once written and reported, is
/// never moved or cut while its segment exists.
#[derive(Debug)]
pub(crate) struct RecordReader {
    log: File,
    log_path: PathBuf,
}

impl RecordReader {
    pub(crate) fn open(dir: &Path, bucket: Bucket) -> Result<RecordReader> {
        let log_path = log_path(dir, bucket);
        Ok(RecordReader {
            log: File::open(&log_path).map_err(Error::io(&log_path))?,
            log_path,
        })
    }

    /// Reads and decodes the message frame of `frame_len` bytes at `offset`.
    pub(crate) fn read_at(&self, offset: u64, frame_len: u32) -> Result<Message> {
        let mut bytes = vec![0u8; frame_len as usize];
        self.log
            .read_exact_at(&mut bytes, offset)
            .map_err(Error::io(&self.log_path))?;
        let corrupt = |reason: String| Error::corrupt(&self.log_path, offset, reason);
        match frame::decode(&bytes) {
            Next::Frame {
                kind: Kind::Message,
                payload,
            } if payload.len() + frame::HEADER_LEN == bytes.len() => {
                Message::decode(payload).map_err(|e| corrupt(e.to_string()))
            }
            Next::Invalid(reason) => Err(corrupt(reason.to_string())),
            _ => Err(corrupt("not a message frame".to_string())),
        }
    }
}

/// The first read of a [`RecordReader::read_meta_at`]: a whole frame of a message with a body of up to
/// about 3 KiB, or the start of a larger one.
#[cfg(not(test))]
const META_READ: usize = 4096;
/// Test frames are at most 1 KiB (frame.rs): a smaller first read takes the larger frames' path.
#[cfg(test)]
const META_READ: usize = 64;

impl RecordReader {
    /// Reads a message frame's fields before its body ([`MessageMeta`]): the whole frame when it is
    /// at most [`META_READ`] bytes (its checksum is checked then), else only its start, and more of it
    /// only when its headers are longer than that.
    ///
    /// The checksum covers the whole frame, so the fields of a larger frame are read unchecked: callers
    /// use them as hints that a full read checks before anything is decided on them (a key index
    /// entry), or whose damage can at worst repeat a delivery (a source's position).
    pub(crate) fn read_meta_at(&self, offset: u64, frame_len: u32) -> Result<MessageMeta> {
        let frame_len = frame_len as usize;
        if frame_len <= META_READ {
            return self
                .read_at(offset, frame_len as u32)
                .map(MessageMeta::from);
        }
        let corrupt = |reason: String| Error::corrupt(&self.log_path, offset, reason);
        let mut bytes = vec![0u8; META_READ];
        loop {
            self.log
                .read_exact_at(&mut bytes, offset)
                .map_err(Error::io(&self.log_path))?;
            let payload_len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
            if bytes[8] != Kind::Message as u8 || payload_len + frame::HEADER_LEN != frame_len {
                return Err(corrupt("not a message frame".to_string()));
            }
            match MessageMeta::decode_prefix(&bytes[frame::HEADER_LEN..]) {
                Ok(meta) => return Ok(meta),
                Err(PrefixError::Short) if bytes.len() < frame_len => {
                    bytes.resize((bytes.len() * 4).min(frame_len), 0);
                }
                Err(PrefixError::Short) => return Err(corrupt("truncated payload".to_string())),
                Err(PrefixError::Malformed(e)) => return Err(corrupt(e.to_string())),
            }
        }
    }
}

/// Reads a segment the replayer has published up to `entries` index entries.
#[derive(Debug)]
pub struct SegmentReader {
    records: RecordReader,
    index: File,
    index_path: PathBuf,
    entries: u64,
}

impl SegmentReader {
    pub(crate) fn open(dir: &Path, bucket: Bucket, entries: u64) -> Result<SegmentReader> {
        let index_path = index_path(dir, bucket);
        Ok(SegmentReader {
            records: RecordReader::open(dir, bucket)?,
            index: File::open(&index_path).map_err(Error::io(&index_path))?,
            index_path,
            entries,
        })
    }

    /// Number of published index entries.
    pub fn len(&self) -> u64 {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Reads index entries `[from, from + count)` (clamped to the published ones), checking each.
    pub fn entries(&self, from: u64, count: u64) -> Result<Vec<IndexEntry>> {
        let wanted = count.min(self.entries.saturating_sub(from));
        let mut entries = Vec::with_capacity(usize::try_from(wanted).unwrap_or(0));
        self.scan(from, count, |_, entry| entries.push(*entry))?;
        Ok(entries)
    }

    /// Reads index entries `[from, from + count)` (clamped to the published ones), checking each, and
    /// hands each to `f` with its position: a megabyte at a time into one buffer, for walks over a
    /// whole index (a bucket's view reads millions).
    pub(crate) fn scan(
        &self,
        from: u64,
        count: u64,
        mut f: impl FnMut(u64, &IndexEntry),
    ) -> Result<()> {
        const CHUNK: u64 = 32 << 10; // entries: 1 MiB
        let end = from.saturating_add(count).min(self.entries);
        let mut bytes = Vec::new();
        let mut position = from;
        while position < end {
            let n = CHUNK.min(end - position);
            bytes.resize(usize::try_from(n).unwrap_or(0) * INDEX_ENTRY_LEN, 0);
            let at = HEADER_LEN as u64 + position * INDEX_ENTRY_LEN as u64;
            self.index
                .read_exact_at(&mut bytes, at)
                .map_err(Error::io(&self.index_path))?;
            for (i, chunk) in bytes.chunks_exact(INDEX_ENTRY_LEN).enumerate() {
                let entry = IndexEntry::decode(chunk).ok_or_else(|| {
                    Error::corrupt(
                        &self.index_path,
                        at + (i * INDEX_ENTRY_LEN) as u64,
                        "index entry checksum mismatch",
                    )
                })?;
                f(position + i as u64, &entry);
            }
            position += n;
        }
        Ok(())
    }

    /// Finds the index entry of `seq` by binary search.
    pub fn find(&self, seq: u64) -> Result<Option<IndexEntry>> {
        Ok(self.position(seq)?.map(|(_, entry)| entry))
    }

    /// Finds the index entry of `seq` and its position in the index, by binary search.
    pub fn position(&self, seq: u64) -> Result<Option<(u64, IndexEntry)>> {
        let (mut lo, mut hi) = (0u64, self.entries);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let [entry] = self.entries(mid, 1)?[..] else {
                return Ok(None);
            };
            match entry.seq.cmp(&seq) {
                std::cmp::Ordering::Equal => return Ok(Some((mid, entry))),
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
            }
        }
        Ok(None)
    }

    /// Reads and decodes the message an index entry points to.
    pub fn read(&self, entry: &IndexEntry) -> Result<Message> {
        let message = self.read_at(entry.offset, entry.frame_len)?;
        if message.seq != entry.seq {
            let reason = format!("record has seq {}, index says {}", message.seq, entry.seq);
            return Err(Error::corrupt(&self.records.log_path, entry.offset, reason));
        }
        Ok(message)
    }

    /// Reads and decodes the message frame of `frame_len` bytes at `offset`.
    pub fn read_at(&self, offset: u64, frame_len: u32) -> Result<Message> {
        self.records.read_at(offset, frame_len)
    }

    /// Reads the fields before the body of the message an index entry points to (see
    /// [`RecordReader::read_meta_at`]).
    pub fn read_meta(&self, entry: &IndexEntry) -> Result<MessageMeta> {
        let meta = self.records.read_meta_at(entry.offset, entry.frame_len)?;
        if meta.seq != entry.seq {
            let reason = format!("record has seq {}, index says {}", meta.seq, entry.seq);
            return Err(Error::corrupt(&self.records.log_path, entry.offset, reason));
        }
        Ok(meta)
    }
}

/// The buckets that have segment files in `dir` (by their `.log` files).
pub(crate) fn list(dir: &Path) -> Result<Vec<Bucket>> {
    let files = list_files(dir, |name| {
        (name
            .strip_suffix(".log")
            .or_else(|| name.strip_suffix(".idx")))
        .and_then(Bucket::parse_file_stem)
    })?;
    let mut buckets: Vec<Bucket> = files.into_iter().map(|(bucket, _)| bucket).collect();
    buckets.dedup();
    Ok(buckets)
}

/// Syncs the files of a segment (through handles of its own: the replayer may go on writing to the files
/// through its writer meanwhile, and a sync covers every byte written before it, through any handle).
///
/// With `drop_cache` the synced pages of the `.log` (up to `log_len`) are then dropped from the page
/// cache: a segment is read again only when its bucket comes due, usually much later, and written-once
/// pages kept in the cache only push useful ones out. The caller keeps them for a bucket being delivered
/// from, whose records are read back within seconds (dropping them turns every delivery into a disk
/// read).
pub(crate) fn sync_files(dir: &Path, bucket: Bucket, log_len: u64, drop_cache: bool) -> Result<()> {
    for path in [log_path(dir, bucket), index_path(dir, bucket)] {
        let file = OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(Error::io(&path))?;
        crate::slow_disk::sync();
        file.sync_data().map_err(Error::sync(&path))?;
        if drop_cache && path.extension().is_some_and(|e| e == "log") {
            let _ = crate::sys::drop_cached_pages(&file, 0, log_len);
        }
    }
    Ok(())
}

/// Drops the pages of a synced segment's `.log` up to `log_len` from the page cache, as [`sync_files`]
/// does with `drop_cache`, for a segment synced by other means. Advice only: errors are ignored.
pub(crate) fn drop_cached_log(dir: &Path, bucket: Bucket, log_len: u64) {
    if let Ok(file) = File::open(log_path(dir, bucket)) {
        let _ = crate::sys::drop_cached_pages(&file, 0, log_len);
    }
}

/// Deletes a segment's files (missing files are fine: a crash may have left one of the two).
pub(crate) fn remove(dir: &Path, bucket: Bucket) -> Result<()> {
    for path in [log_path(dir, bucket), index_path(dir, bucket)] {
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&path)(e)),
        }
    }
    Ok(())
}
