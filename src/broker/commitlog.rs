//! The commit log of a broker store: every message stored, in segment files deleted oldest first by
//! retention.
//!
//! ```text
//! commitlog/{base:020}   one segment; base = the log offset of its first byte
//!   0    8   magic b"DLYDBRK\0"
//!   8    8   reserved, zero
//!   16   8   base u64 LE, the file's name (zero in a log written before segments existed: its base is 0)
//!   24   8   reserved, zero
//!   32   ..  frames of kind 5 (schedulelog's frame layout), appended; the file ends where its last
//!            record ends (no preallocation)
//! ```
//!
//! A record at file position `p` has the log offset `base + p`, and the next segment's base is `base` plus
//! the length of this one: log offsets only grow, and a consume-queue unit names its record by one number.
//!
//! Invariants:
//! - A record never straddles segments. A new segment starts when a record would take the last one past
//!   `segment_bytes` (a record larger than that gets a segment of its own).
//! - A segment is sealed before the next one is created: synced, exactly as long as its records, its
//!   modification time set to the store time of its newest message (what retention reads after a
//!   restart). So only the last segment can have a torn tail.
//! - An append writes at most `UNSYNCED_LIMIT` bytes past the last sync (the tail policy of schedulelog's
//!   frames), and is acknowledged only once all of it is synced. A failed append leaves nothing: the
//!   segments it created are deleted and the one it began in is cut back.
//! - Retention takes whole sealed segments, oldest first; the last segment is never deleted.
//! - On open the segments must follow each other without a gap (retention deletes the oldest first, so a
//!   crash in the middle of it leaves none); a gap is corruption, named with its file, except an empty
//!   newest segment past it (started by a failed append whose undo could not delete it), which goes.

use super::{io_err, BrokerError};
use schedulelog::frame::{self, Kind, Next, UNSYNCED_LIMIT};
use schedulelog::{
    create_dir_durably, list_files, open_data_file, parse_offset_name, sync_dir, OpenMode,
};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

pub(crate) const HEADER_LEN: u64 = 32;
pub(crate) const MAGIC: &[u8; 8] = b"DLYDBRK\0";

pub(crate) fn header(base: u64) -> [u8; HEADER_LEN as usize] {
    let mut header = [0u8; HEADER_LEN as usize];
    header[..8].copy_from_slice(MAGIC);
    header[16..24].copy_from_slice(&base.to_le_bytes());
    header
}

/// One segment file.
#[derive(Debug)]
pub(crate) struct Segment {
    pub base: u64,
    pub path: PathBuf,
    /// Open for the segment taking appends; a sealed one is opened when read (a long retention keeps
    /// many, and each would otherwise hold a file descriptor the whole time).
    file: Option<Arc<File>>,
    /// Bytes of the file that hold the header and valid records.
    pub len: u64,
    /// Store time (unix ms) of its newest message: retention deletes it once this is old enough.
    pub newest_ms: i64,
}

impl Segment {
    pub(crate) fn end(&self) -> u64 {
        self.base + self.len
    }

    /// The segment's file: the open one, or a fresh handle on a sealed one.
    fn handle(&self) -> Result<Arc<File>, BrokerError> {
        match &self.file {
            Some(file) => Ok(file.clone()),
            None => open_data_file(&self.path, OpenMode::Existing)
                .map(Arc::new)
                .map_err(io_err(&self.path)),
        }
    }
}

/// Where the log ended at some moment, to put it back there.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark {
    base: u64,
    len: u64,
    newest_ms: i64,
}

/// A record found by [`CommitLog::scan_from`]: its log offset, frame length and payload.
pub(crate) struct Scanned<'a> {
    pub offset: u64,
    pub len: u32,
    pub payload: &'a [u8],
}

/// The segments of one store's commit log.
#[derive(Debug)]
pub(crate) struct CommitLog {
    dir: PathBuf,
    segment_bytes: u64,
    /// By base; the last one takes appends.
    segments: BTreeMap<u64, Segment>,
    /// Where each synced write began and how long it was, for tests of the unsynced bound.
    #[cfg(test)]
    pub(crate) writes: Vec<(u64, usize)>,
}

impl CommitLog {
    /// Opens the log in `dir`, creating it if needed. The last segment's length is its file's length
    /// until [`CommitLog::scan_from`] has checked its tail: call it before appending.
    pub(crate) fn open(dir: &Path, segment_bytes: u64) -> Result<CommitLog, BrokerError> {
        create_dir_durably(dir)?;
        let bases: Vec<u64> = list_files(dir, parse_offset_name)?
            .into_iter()
            .map(|(base, _)| base)
            .collect();
        let mut log = CommitLog {
            dir: dir.to_path_buf(),
            segment_bytes,
            segments: BTreeMap::new(),
            #[cfg(test)]
            writes: Vec::new(),
        };
        if bases.is_empty() {
            log.create_segment(0, 0)?;
            return Ok(log);
        }
        // Newest first: the log is the run of segments that each end where the next begins.
        let mut newest = true;
        let mut next_base: Option<u64> = None;
        for &base in bases.iter().rev() {
            let path = dir.join(format!("{base:020}"));
            let file = open_data_file(&path, OpenMode::Existing).map_err(io_err(&path))?;
            let meta = file.metadata().map_err(io_err(&path))?;
            let len = meta.len();
            if let Some(next) = next_base {
                if base + len > next {
                    return Err(BrokerError::Corrupt {
                        path,
                        offset: next - base,
                        reason: "the segment runs past the start of the next one".into(),
                    });
                }
                if base + len < next {
                    // Retention deletes the oldest segments first, so it never leaves a hole. What can:
                    // a segment started by a failed append whose undo could not delete it, empty.
                    let stray = log.segments.len() == 1
                        && log.segments.get(&next).is_some_and(|s| s.len <= HEADER_LEN);
                    if !stray {
                        return Err(BrokerError::Corrupt {
                            path,
                            offset: len,
                            reason: format!(
                                "the next segment starts at log offset {next}, not where this one ends \
                                 ({}): a segment is missing from the middle of the commit log",
                                base + len
                            ),
                        });
                    }
                    let stray = log.segments.remove(&next).expect("checked above");
                    tracing::warn!(path = %stray.path.display(), "deleting an empty commit log segment past a gap (left by a failed append)");
                    fs::remove_file(&stray.path).map_err(io_err(&stray.path))?;
                    sync_dir(dir)?;
                    newest = true;
                }
            }
            let mut head = [0u8; HEADER_LEN as usize];
            let read = file.read_at(&mut head, 0).map_err(io_err(&path))?;
            if read < HEADER_LEN as usize && newest {
                let written = &head[..read];
                if written.iter().all(|&b| b == 0) || MAGIC.starts_with(&written[..read.min(8)]) {
                    // Created just before a crash: whatever of the header got written. Start it afresh.
                    file.set_len(0)
                        .and_then(|()| file.write_all_at(&header(base), 0))
                        .and_then(|()| file.sync_all())
                        .map_err(io_err(&path))?;
                    head = header(base);
                }
            }
            if head != header(base) {
                return Err(BrokerError::Corrupt {
                    path,
                    offset: 0,
                    reason: "not a broker commit log segment (bad header)".into(),
                });
            }
            let newest_ms = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .and_then(|d| i64::try_from(d.as_millis()).ok())
                .unwrap_or(0);
            log.segments.insert(
                base,
                Segment {
                    base,
                    path,
                    file: newest.then(|| Arc::new(file)),
                    len: len.max(HEADER_LEN),
                    newest_ms,
                },
            );
            next_base = Some(base);
            newest = false;
        }
        Ok(log)
    }

    fn create_segment(&mut self, base: u64, newest_ms: i64) -> Result<(), BrokerError> {
        let path = self.dir.join(format!("{base:020}"));
        let file = open_data_file(&path, OpenMode::Empty).map_err(io_err(&path))?;
        let made = file
            .write_all_at(&header(base), 0)
            .and_then(|()| file.sync_data())
            .map_err(io_err(&path))
            .and_then(|()| sync_dir(&self.dir).map_err(BrokerError::from));
        if let Err(e) = made {
            let _ = fs::remove_file(&path);
            return Err(e);
        }
        self.segments.insert(
            base,
            Segment {
                base,
                path,
                file: Some(Arc::new(file)),
                len: HEADER_LEN,
                newest_ms,
            },
        );
        Ok(())
    }

    fn last(&self) -> &Segment {
        self.segments
            .values()
            .next_back()
            .expect("a log has a segment")
    }

    fn last_mut(&mut self) -> &mut Segment {
        self.segments
            .values_mut()
            .next_back()
            .expect("a log has a segment")
    }

    /// The offset of the first record the log still holds (or would hold).
    pub(crate) fn first_offset(&self) -> u64 {
        self.segments
            .values()
            .next()
            .expect("a log has a segment")
            .base
            + HEADER_LEN
    }

    /// The offset just past the last record.
    pub(crate) fn end(&self) -> u64 {
        self.last().end()
    }

    /// Bytes in all segments.
    pub(crate) fn bytes(&self) -> u64 {
        self.segments.values().map(|s| s.len).sum()
    }

    /// Reads every record from log offset `from` to the end, and cuts a torn tail off the last segment.
    /// `from` must be a record boundary (an offset the log ended at once); it is clamped into the log.
    /// Reads one record at a time: memory stays bounded by the largest record, however long the log.
    pub(crate) fn scan_from(
        &mut self,
        from: u64,
        mut visit: impl FnMut(Scanned<'_>) -> Result<(), BrokerError>,
    ) -> Result<(), BrokerError> {
        let from = from.clamp(self.first_offset(), self.end());
        let last_base = self.last().base;
        let bases: Vec<u64> = self
            .segments
            .range(..=from)
            .next_back()
            .map(|(b, _)| *b)
            .into_iter()
            .chain(self.segments.range(from + 1..).map(|(b, _)| *b))
            .collect();
        for base in bases {
            let segment = &self.segments[&base];
            let (file, path, file_len) = (segment.handle()?, segment.path.clone(), segment.len);
            let mut pos = from.saturating_sub(base).max(HEADER_LEN);
            let stop = loop {
                match read_frame(&file, pos, file_len).map_err(io_err(&path))? {
                    Ok(Some(bytes)) => {
                        let len = bytes.len() as u32;
                        let Next::Frame { payload, .. } = frame::decode(&bytes) else {
                            unreachable!("read_frame returns decoded frames only");
                        };
                        visit(Scanned {
                            offset: base + pos,
                            len,
                            payload,
                        })?;
                        pos += u64::from(len);
                    }
                    Ok(None) => break None,
                    Err(reason) => break Some(reason),
                }
            };
            if pos == file_len {
                continue;
            }
            if base != last_base {
                return Err(BrokerError::Corrupt {
                    path,
                    offset: pos,
                    reason: format!(
                        "{} before the end of a sealed segment",
                        stop.unwrap_or("zeros")
                    ),
                });
            }
            // The last segment: a torn tail is cut, damage in synced data is reported.
            let window_end = pos.saturating_add(UNSYNCED_LIMIT as u64).min(file_len);
            if !zeros(&file, window_end, file_len).map_err(io_err(&path))? {
                return Err(BrokerError::Corrupt {
                    path,
                    offset: pos,
                    reason: format!(
                        "{}, followed by data more than {UNSYNCED_LIMIT} bytes later",
                        stop.unwrap_or("zeros")
                    ),
                });
            }
            file.set_len(pos)
                .and_then(|()| file.sync_all())
                .map_err(io_err(&path))?;
            metrics::counter!("delayd_log_torn_tails_total").increment(1);
            self.last_mut().len = pos;
        }
        Ok(())
    }

    /// Appends the records in `bytes` (frames ending at each of `ends`), durably, and returns each one's
    /// log offset. `stored_at_ms` is their store time, which retention goes by. On failure part of them
    /// may be in the files: the caller puts the log back with [`CommitLog::undo`] to the mark it took
    /// before.
    pub(crate) fn append(
        &mut self,
        bytes: &[u8],
        ends: &[usize],
        stored_at_ms: i64,
    ) -> Result<Vec<u64>, BrokerError> {
        let mut offsets = Vec::with_capacity(ends.len());
        self.append_from(bytes, ends, stored_at_ms, &mut offsets)?;
        let newest = self.last_mut();
        newest.newest_ms = newest.newest_ms.max(stored_at_ms);
        Ok(offsets)
    }

    fn append_from(
        &mut self,
        bytes: &[u8],
        ends: &[usize],
        stored_at_ms: i64,
        offsets: &mut Vec<u64>,
    ) -> Result<(), BrokerError> {
        // bytes[pending..start] are collected for the next write.
        let mut pending = 0;
        let mut start = 0;
        for &end in ends {
            let len = (end - start) as u64;
            let collected = (start - pending) as u64;
            let last = self.last();
            if last.len + collected > HEADER_LEN && last.len + collected + len > self.segment_bytes
            {
                self.write_synced(&bytes[pending..start])?;
                pending = start;
                self.seal_and_roll(stored_at_ms)?;
            } else if collected + len > UNSYNCED_LIMIT as u64 {
                self.write_synced(&bytes[pending..start])?;
                pending = start;
            }
            offsets.push(self.end() + (start - pending) as u64);
            start = end;
        }
        self.write_synced(&bytes[pending..])
    }

    fn write_synced(&mut self, bytes: &[u8]) -> Result<(), BrokerError> {
        if bytes.is_empty() {
            return Ok(());
        }
        let last = self.last_mut();
        let file = last.handle()?;
        let started = std::time::Instant::now();
        schedulelog::slow_disk::write(bytes.len());
        schedulelog::slow_disk::sync();
        let written = file
            .write_all_at(bytes, last.len)
            .and_then(|()| file.sync_data());
        metrics::histogram!("delayd_sync_seconds", "file" => "broker")
            .record(started.elapsed().as_secs_f64());
        written.map_err(io_err(&last.path))?;
        let at = last.len;
        last.len += bytes.len() as u64;
        #[cfg(test)]
        self.writes.push((at, bytes.len()));
        #[cfg(not(test))]
        let _ = at;
        Ok(())
    }

    /// Seals the last segment (it is synced already) and starts the next one.
    fn seal_and_roll(&mut self, stored_at_ms: i64) -> Result<(), BrokerError> {
        let last = self.last_mut();
        last.newest_ms = last.newest_ms.max(stored_at_ms);
        let modified =
            UNIX_EPOCH + Duration::from_millis(u64::try_from(last.newest_ms).unwrap_or(0));
        // Advice for retention after a restart; the log is correct without it.
        if let Some(file) = &last.file {
            let _ = file.set_modified(modified);
        }
        let (sealed, base, newest) = (last.base, last.end(), last.newest_ms);
        self.create_segment(base, newest)?;
        if let Some(segment) = self.segments.get_mut(&sealed) {
            segment.file = None;
        }
        Ok(())
    }

    /// Puts the log back as it was at `mark` (a failed append, or one whose consume-queue units could not
    /// be written): the segments started since are deleted, the one it ended in is cut back. An error
    /// means the files may still hold what was undone in memory.
    pub(crate) fn undo(
        &mut self,
        Mark {
            base,
            len,
            newest_ms,
        }: Mark,
    ) -> Result<(), BrokerError> {
        let created: Vec<u64> = self.segments.range(base + 1..).map(|(b, _)| *b).collect();
        let mut result = Ok(());
        for base in &created {
            if let Some(segment) = self.segments.remove(base) {
                result = result.and(fs::remove_file(&segment.path).map_err(io_err(&segment.path)));
            }
        }
        if !created.is_empty() {
            result = result.and(sync_dir(&self.dir).map_err(BrokerError::from));
        }
        if let Some(segment) = self.segments.get_mut(&base) {
            // Whole frames left past the end would come back on the next open as records nobody
            // acknowledged. (It takes appends again: its handle stays open.)
            match segment.handle() {
                Ok(file) => {
                    result = result.and(file.set_len(len).map_err(io_err(&segment.path)));
                    segment.file = Some(file);
                }
                Err(e) => result = result.and(Err(e)),
            }
            segment.len = len;
            segment.newest_ms = newest_ms;
        }
        result
    }

    /// Where the record of `len` bytes at log `offset` is, if it lies inside one segment of the log: the
    /// segment's base and the position in its file.
    pub(crate) fn locate(&self, offset: u64, len: u32) -> Option<(u64, u64)> {
        let (_, segment) = self.segments.range(..=offset).next_back()?;
        let pos = offset - segment.base;
        (pos >= HEADER_LEN && offset.checked_add(u64::from(len))? <= segment.end())
            .then_some((segment.base, pos))
    }

    /// A handle on the file of the segment at `base` (readable after retention deletes it).
    pub(crate) fn file(&self, base: u64) -> Result<Arc<File>, BrokerError> {
        match self.segments.get(&base) {
            Some(segment) => segment.handle(),
            None => Err(BrokerError::Corrupt {
                path: self.dir.join(format!("{base:020}")),
                offset: 0,
                reason: "no such segment".into(),
            }),
        }
    }

    /// Takes the oldest segment out of the log, unless it is the one taking appends. The caller deletes
    /// its file (outside any lock: a reader may still hold it open, which is fine on Unix).
    pub(crate) fn take_oldest(&mut self) -> Option<Segment> {
        if self.segments.len() < 2 {
            return None;
        }
        self.segments.pop_first().map(|(_, segment)| segment)
    }

    /// The store time of the newest message in the oldest segment, unless it is the one taking appends.
    pub(crate) fn oldest_sealed_ms(&self) -> Option<i64> {
        match self.segments.len() {
            0 | 1 => None,
            _ => self.segments.values().next().map(|s| s.newest_ms),
        }
    }

    /// What [`CommitLog::undo`] puts back.
    pub(crate) fn mark(&self) -> Mark {
        let last = self.last();
        Mark {
            base: last.base,
            len: last.len,
            newest_ms: last.newest_ms,
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Reads the frame at `pos` of a file whose valid bytes end at `file_len`: `Ok(Some(frame))` for a broker
/// record, `Ok(None)` at a clean end (the end of the file, or zeros), `Err(reason)` for anything else.
fn read_frame(
    file: &File,
    pos: u64,
    file_len: u64,
) -> std::io::Result<Result<Option<Vec<u8>>, &'static str>> {
    if pos >= file_len {
        return Ok(Ok(None));
    }
    let mut head = [0u8; frame::HEADER_LEN];
    let available = (file_len - pos).min(frame::HEADER_LEN as u64) as usize;
    file.read_exact_at(&mut head[..available], pos)?;
    if head.iter().all(|&b| b == 0) {
        return Ok(Ok(None));
    }
    if available < frame::HEADER_LEN {
        return Ok(Err("truncated frame header"));
    }
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if len > frame::MAX_PAYLOAD {
        return Ok(Err("frame length over the maximum"));
    }
    let total = (frame::HEADER_LEN + len) as u64;
    if pos + total > file_len {
        return Ok(Err("truncated frame"));
    }
    let mut bytes = vec![0u8; total as usize];
    file.read_exact_at(&mut bytes, pos)?;
    Ok(match frame::decode(&bytes) {
        Next::Frame {
            kind: Kind::Broker, ..
        } => Ok(Some(bytes)),
        Next::Frame { .. } => Err("not a broker record"),
        Next::End => Ok(None),
        Next::Invalid(reason) => Err(reason),
    })
}

/// Whether `file` holds only zeros in `[from, to)`, read a megabyte at a time.
fn zeros(file: &File, from: u64, to: u64) -> std::io::Result<bool> {
    let mut buffer = vec![0u8; 1 << 20];
    let mut at = from;
    while at < to {
        let n = (to - at).min(buffer.len() as u64) as usize;
        file.read_exact_at(&mut buffer[..n], at)?;
        if buffer[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}

/// Deletes the files of segments taken out of a log, and syncs its directory.
pub(crate) fn remove(dir: &Path, segments: &[Segment]) -> Result<(), BrokerError> {
    for segment in segments {
        match fs::remove_file(&segment.path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&segment.path)(e)),
        }
    }
    if segments.is_empty() {
        Ok(())
    } else {
        Ok(sync_dir(dir)?)
    }
}
