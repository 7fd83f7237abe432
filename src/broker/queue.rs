//! Consume queues: for each (topic, queue), where its messages are in the commit log, in order.
//!
//! ```text
//! consumequeue/{topic}/{queue}/{first:020}   the units of queue offsets [first, the next file's first)
//!   0   8  commit log offset  u64 LE
//!   8   4  frame size         u32 LE
//!   12  8  tag hash           u64 LE (CRC-32C of the key, 0 without one)
//! ```
//!
//! Invariants:
//! - The unit of queue offset `i` is in the file with the greatest `first` ≤ `i`, at `(i − first) × 20`.
//!   A new file starts when the last one holds `units_per_file` units; files are never rewritten whole.
//! - Units are appended in commit-log order, so their log offsets increase within a queue and the first
//!   unit whose record is still in the log is found by binary search.
//! - `min_offset` is the first queue offset whose record the commit log still holds; files whose units
//!   are all below it are deleted (never the last file, which appends go to).
//! - Only the last file is written to (repair excepted). Through the handles the queue keeps, its files
//!   are synced by the broker checkpoint alone, a job off the store's lock (one at a time):
//!   `take_unsynced` hands it every file written since the last one took its files, the active one and
//!   those the queue moved on from meanwhile (kept open until then). A write-back error is reported to
//!   one sync per open file, so a second syncer of the same handle could take it from the job. `cut`
//!   and recovery's repair sync through handles of their own; a failure there fails the append (and
//!   the store) or the open.
//! - Before the queues were segmented a queue was one file, `consumequeue/{topic}/{queue}`; opening one
//!   moves it to `{queue}/00000000000000000000` by way of `{queue}.migrating/`, crash-safely.

use super::{io_err, BrokerError};
use schedulelog::{
    create_dir_durably, list_files, open_data_file, parse_offset_name, sync_dir, OpenMode,
};
use std::collections::BTreeSet;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(crate) const UNIT_LEN: u64 = 20;

/// Where one message of a queue is in the commit log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unit {
    pub log_offset: u64,
    pub len: u32,
    pub tag: u64,
}

impl Unit {
    pub(crate) fn new(log_offset: u64, len: u32, key: Option<&str>) -> Unit {
        let tag = key.map_or(0, |k| u64::from(crc32c::crc32c(k.as_bytes())));
        Unit {
            log_offset,
            len,
            tag,
        }
    }

    pub(crate) fn encode(&self) -> [u8; UNIT_LEN as usize] {
        let mut unit = [0u8; UNIT_LEN as usize];
        unit[..8].copy_from_slice(&self.log_offset.to_le_bytes());
        unit[8..12].copy_from_slice(&self.len.to_le_bytes());
        unit[12..].copy_from_slice(&self.tag.to_le_bytes());
        unit
    }

    pub(crate) fn decode(bytes: &[u8]) -> Unit {
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        Unit {
            log_offset: u64_at(0),
            len: u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]),
            tag: u64_at(12),
        }
    }
}

fn file_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:020}"))
}

/// The directory a legacy queue file is moved into before the directory takes the queue's name.
pub(crate) fn migrating_dir(topic_dir: &Path, index: u32) -> PathBuf {
    topic_dir.join(format!("{index}.migrating"))
}

/// Moves a queue from before segmentation (one file, `{queue}`) to its first segment,
/// `{queue}/00000000000000000000`, so that a crash at any step leaves a state this finishes:
/// the file goes into `{queue}.migrating/`, which is then renamed to `{queue}` in one step.
fn migrate_legacy(topic_dir: &Path, index: u32) -> Result<(), BrokerError> {
    let dir = topic_dir.join(index.to_string());
    let migrating = migrating_dir(topic_dir, index);
    if dir.is_file() {
        if !migrating.is_dir() {
            fs::create_dir(&migrating).map_err(io_err(&migrating))?;
        }
        fs::rename(&dir, file_path(&migrating, 0)).map_err(io_err(&dir))?;
        sync_dir(&migrating)?;
    }
    if migrating.is_dir() && !dir.exists() {
        fs::rename(&migrating, &dir).map_err(io_err(&migrating))?;
        sync_dir(topic_dir)?;
    }
    Ok(())
}

/// One consume queue.
#[derive(Debug)]
pub(crate) struct Queue {
    dir: PathBuf,
    units_per_file: u64,
    /// The first queue offset of each file, oldest first; the last one is `active`.
    files: BTreeSet<u64>,
    /// Shared with a checkpoint job syncing it off the store's lock (see `take_unsynced`).
    active: Arc<File>,
    /// Queue offset of the next unit (the queue's `max_offset`).
    pub units: u64,
    /// The first queue offset whose record is still in the commit log.
    pub min_offset: u64,
    /// The active file was written since a checkpoint last took it (or `cut` synced it).
    dirty: bool,
    /// Files the queue moved on from, written since a checkpoint last took them: for the next one.
    retired: Vec<(Arc<File>, PathBuf)>,
}

impl Queue {
    /// Opens (creating if needed) queue `index` of the topic whose directory is `topic_dir`.
    pub(crate) fn open(
        topic_dir: &Path,
        index: u32,
        units_per_file: u64,
    ) -> Result<Queue, BrokerError> {
        let dir = topic_dir.join(index.to_string());
        migrate_legacy(topic_dir, index)?;
        create_dir_durably(&dir)?;
        let mut files: BTreeSet<u64> = list_files(&dir, parse_offset_name)?
            .into_iter()
            .map(|(first, _)| first)
            .collect();
        if files.is_empty() {
            File::create(file_path(&dir, 0)).map_err(io_err(&dir))?;
            sync_dir(&dir)?;
            files.insert(0);
        }
        let active_first = *files.last().expect("at least one file");
        let path = file_path(&dir, active_first);
        let active = open_data_file(&path, OpenMode::Existing).map_err(io_err(&path))?;
        let len = active.metadata().map_err(io_err(&path))?.len();
        let first = *files.first().expect("at least one file");
        Ok(Queue {
            dir,
            units_per_file: units_per_file.max(1),
            files,
            active: Arc::new(active),
            units: active_first + len / UNIT_LEN,
            min_offset: first,
            dirty: false,
            retired: Vec::new(),
        })
    }

    fn active_first(&self) -> u64 {
        *self.files.last().expect("a queue always has a file")
    }

    /// Appends units (already encoded, in queue order) at the end of the queue. Not synced.
    pub(crate) fn append(&mut self, mut units: &[u8]) -> Result<(), BrokerError> {
        while !units.is_empty() {
            let limit = self.active_first().saturating_add(self.units_per_file);
            if self.units >= limit {
                self.start_file(self.units)?;
                continue;
            }
            let room = limit - self.units;
            let take = (units.len() as u64 / UNIT_LEN).min(room) as usize * UNIT_LEN as usize;
            let at = (self.units - self.active_first()) * UNIT_LEN;
            self.active
                .write_all_at(&units[..take], at)
                .map_err(io_err(&file_path(&self.dir, self.active_first())))?;
            self.dirty = true;
            self.units += take as u64 / UNIT_LEN;
            units = &units[take..];
        }
        Ok(())
    }

    /// Starts a new file whose first queue offset is `first`; the one it replaces is synced by the next
    /// checkpoint (see the module doc).
    fn start_file(&mut self, first: u64) -> Result<(), BrokerError> {
        if std::mem::take(&mut self.dirty) {
            let path = file_path(&self.dir, self.active_first());
            self.retired.push((self.active.clone(), path));
        }
        let path = file_path(&self.dir, first);
        let file = open_data_file(&path, OpenMode::Empty).map_err(io_err(&path))?;
        sync_dir(&self.dir)?;
        self.files.insert(first);
        self.active = Arc::new(file);
        Ok(())
    }

    /// Writes the unit of queue offset `index`, which is at most the current end (repair after a crash:
    /// the unit may be torn or zero on disk).
    pub(crate) fn write_at(&mut self, index: u64, unit: &Unit) -> Result<(), BrokerError> {
        if index >= self.units {
            return self.append(&unit.encode());
        }
        let active = self.active_first();
        self.with_file(index, |file, first, path| {
            file.write_all_at(&unit.encode(), (index - first) * UNIT_LEN)
                .map_err(io_err(path))?;
            if first == active {
                Ok(())
            } else {
                // Repair of an older file: rare, and nothing else would sync it.
                file.sync_data().map_err(io_err(path))
            }
        })?;
        if self.files.range(..=index).next_back() == Some(&active) {
            self.dirty = true;
        }
        Ok(())
    }

    /// Runs `f` on the file holding queue offset `index` (the active one, or a fresh handle on an older
    /// one: only the active file is kept open), with its first queue offset and its path.
    fn with_file<R>(
        &self,
        index: u64,
        f: impl FnOnce(&File, u64, &Path) -> Result<R, BrokerError>,
    ) -> Result<R, BrokerError> {
        let first =
            *self
                .files
                .range(..=index)
                .next_back()
                .ok_or_else(|| BrokerError::Corrupt {
                    path: self.dir.clone(),
                    offset: index * UNIT_LEN,
                    reason: format!("no file holds queue offset {index}"),
                })?;
        let path = file_path(&self.dir, first);
        if first == self.active_first() {
            return f(&self.active, first, &path);
        }
        let file = open_data_file(&path, OpenMode::Existing).map_err(io_err(&path))?;
        f(&file, first, &path)
    }

    /// The units of queue offsets `[from, from + count)`, clamped to the queue.
    pub(crate) fn read(&self, from: u64, count: u64) -> Result<Vec<Unit>, BrokerError> {
        let end = from.saturating_add(count).min(self.units);
        let mut out = Vec::with_capacity(end.saturating_sub(from) as usize);
        let mut at = from;
        while at < end {
            let file_end = self
                .files
                .range(at + 1..)
                .next()
                .copied()
                .unwrap_or(u64::MAX)
                .min(end);
            let mut bytes = vec![0u8; ((file_end - at) * UNIT_LEN) as usize];
            self.with_file(at, |file, first, path| {
                file.read_exact_at(&mut bytes, (at - first) * UNIT_LEN)
                    .map_err(io_err(path))
            })?;
            out.extend(bytes.chunks_exact(UNIT_LEN as usize).map(Unit::decode));
            at = file_end;
        }
        Ok(out)
    }

    /// Cuts the queue to end at queue offset `units` (repair: the units past it are not backed by the
    /// commit log). Files that start past it are deleted. Nothing to do for a queue that ends there.
    pub(crate) fn truncate(&mut self, units: u64) -> Result<(), BrokerError> {
        if units >= self.units {
            return Ok(());
        }
        self.cut(units)
    }

    /// Cuts the queue to end at queue offset `units` (at most where it ends), files included: also the
    /// bytes a failed append left past its end, which would otherwise count as units on the next open.
    pub(crate) fn cut(&mut self, units: u64) -> Result<(), BrokerError> {
        let units = units.min(self.units);
        let doomed: Vec<u64> = self.files.range(units + 1..).copied().collect();
        let first = self.files.range(..=units).next_back().copied();
        for first in &doomed {
            let path = file_path(&self.dir, *first);
            fs::remove_file(&path).map_err(io_err(&path))?;
            self.files.remove(first);
        }
        let first = match first {
            Some(first) => first,
            None => {
                // Nothing is left below the cut: start an empty file at it.
                self.files.insert(units);
                units
            }
        };
        let path = file_path(&self.dir, first);
        let file = open_data_file(&path, OpenMode::Keep).map_err(io_err(&path))?;
        file.set_len((units - first) * UNIT_LEN)
            .and_then(|()| file.sync_all())
            .map_err(io_err(&path))?;
        sync_dir(&self.dir)?;
        self.active = Arc::new(file);
        self.units = units;
        self.min_offset = self.min_offset.min(units);
        self.dirty = false;
        Ok(())
    }

    /// Files kept open for the next checkpoint.
    pub(crate) fn kept_files(&self) -> u64 {
        self.retired.len() as u64
    }

    /// The files written since a checkpoint last took them (those the queue moved on from, then the
    /// active one), with their paths, marked taken: the caller, a broker checkpoint job, syncs them off
    /// the store's lock, and a failure stops every later checkpoint (store.rs), so a unit this leaves
    /// unsynced is never claimed durable.
    pub(crate) fn take_unsynced(&mut self) -> Vec<(Arc<File>, PathBuf)> {
        let mut files = std::mem::take(&mut self.retired);
        if std::mem::take(&mut self.dirty) {
            files.push((
                self.active.clone(),
                file_path(&self.dir, self.active_first()),
            ));
        }
        files
    }

    /// Moves `min_offset` to the first unit whose record is at or after `log_first` (the first offset the
    /// commit log still holds) and takes the files wholly below it out of the queue, returning their paths
    /// for the caller to delete. Returns how far `min_offset` moved, too.
    pub(crate) fn retire_below(
        &mut self,
        log_first: u64,
    ) -> Result<(u64, Vec<PathBuf>), BrokerError> {
        // Binary search for the first unit at or after log_first.
        let (mut lo, mut hi) = (self.min_offset.max(self.first_file()), self.units);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let [unit] = self.read(mid, 1)?[..] else {
                break;
            };
            if unit.log_offset < log_first {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let moved = lo.saturating_sub(self.min_offset);
        self.min_offset = self.min_offset.max(lo);
        let active = self.active_first();
        let mut doomed = Vec::new();
        while let Some(&first) = self.files.first() {
            let next = self.files.range(first + 1..).next().copied();
            match next {
                Some(next) if next <= self.min_offset && first != active => {
                    self.files.remove(&first);
                    doomed.push(file_path(&self.dir, first));
                }
                _ => break,
            }
        }
        Ok((moved, doomed))
    }

    fn first_file(&self) -> u64 {
        *self.files.first().expect("a queue always has a file")
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(range: std::ops::Range<u64>) -> Vec<u8> {
        range
            .flat_map(|i| Unit::new(1_000 + i * 100, 100, None).encode())
            .collect()
    }

    #[test]
    fn units_span_files_and_retire_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let mut queue = Queue::open(dir.path(), 0, 4).unwrap();
        queue.append(&units(0..10)).unwrap();
        assert_eq!(queue.units, 10);
        let names: Vec<String> = fs::read_dir(dir.path().join("0"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        assert_eq!(
            names,
            vec![
                "00000000000000000000",
                "00000000000000000004",
                "00000000000000000008"
            ]
        );
        let read = queue.read(2, 5).unwrap();
        assert_eq!(
            read.iter().map(|u| u.log_offset).collect::<Vec<_>>(),
            (2..7).map(|i| 1_000 + i * 100).collect::<Vec<_>>()
        );
        // The log now starts at the record of queue offset 5: the first file goes, the second stays.
        let (moved, doomed) = queue.retire_below(1_500).unwrap();
        assert_eq!((moved, queue.min_offset), (5, 5));
        assert_eq!(doomed, vec![dir.path().join("0/00000000000000000000")]);
        for path in doomed {
            fs::remove_file(path).unwrap();
        }
        // Reopened, the queue keeps its end; the store recomputes min_offset from the log.
        drop(queue);
        let mut queue = Queue::open(dir.path(), 0, 4).unwrap();
        assert_eq!((queue.min_offset, queue.units), (4, 10));
        assert_eq!(queue.retire_below(1_500).unwrap().0, 1);
        // Everything retired: the active file stays for appends.
        let (_, doomed) = queue.retire_below(u64::MAX).unwrap();
        assert_eq!(doomed, vec![dir.path().join("0/00000000000000000004")]);
        assert_eq!(queue.min_offset, 10);
        queue.append(&units(10..11)).unwrap();
        assert_eq!(queue.read(10, 5).unwrap()[0].log_offset, 2_000);
    }

    #[test]
    fn a_legacy_move_cut_short_at_any_step_is_finished() {
        let legacy = units(0..5);
        // The states a crash can leave between the move's steps.
        for step in 0..3 {
            let dir = tempfile::tempdir().unwrap();
            let migrating = migrating_dir(dir.path(), 0);
            match step {
                0 => {
                    fs::write(dir.path().join("0"), &legacy).unwrap();
                    fs::create_dir(&migrating).unwrap();
                }
                1 => {
                    fs::create_dir(&migrating).unwrap();
                    fs::write(file_path(&migrating, 0), &legacy).unwrap();
                }
                _ => {
                    fs::create_dir(dir.path().join("0")).unwrap();
                    fs::write(dir.path().join("0/00000000000000000000"), &legacy).unwrap();
                }
            }
            let queue = Queue::open(dir.path(), 0, 4).unwrap();
            assert_eq!(queue.units, 5, "step {step}");
            assert_eq!(queue.read(0, 5).unwrap().len(), 5);
            assert!(!migrating.exists());
        }
    }

    #[test]
    fn truncate_cuts_across_files_and_a_legacy_file_is_moved_in() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("0"), units(0..6)).unwrap();
        let mut queue = Queue::open(dir.path(), 0, 4).unwrap();
        assert_eq!(queue.units, 6, "the legacy file is the first segment");
        assert!(dir.path().join("0/00000000000000000000").is_file());
        queue.append(&units(6..9)).unwrap();
        assert!(dir.path().join("0/00000000000000000006").is_file());
        queue.truncate(5).unwrap();
        assert!(!dir.path().join("0/00000000000000000006").exists());
        assert_eq!(queue.units, 5);
        queue.append(&units(5..7)).unwrap();
        assert_eq!(queue.read(4, 10).unwrap().len(), 3);
        queue.write_at(1, &Unit::new(7, 7, Some("k"))).unwrap();
        assert_eq!(queue.read(1, 1).unwrap()[0], Unit::new(7, 7, Some("k")));
    }

    /// An append that fails part-way leaves units past the queue's end; the store's undo cuts them, so
    /// that the next open does not count them (truncate, for repair, leaves a queue that ends there).
    #[test]
    fn cut_drops_units_a_failed_append_left_past_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let mut queue = Queue::open(dir.path(), 0, 100).unwrap();
        queue.append(&units(0..3)).unwrap();
        let file = dir.path().join("0/00000000000000000000");
        let mut bytes = fs::read(&file).unwrap();
        bytes.extend(units(3..5));
        fs::write(&file, bytes).unwrap();
        queue.truncate(3).unwrap();
        assert_eq!(Queue::open(dir.path(), 0, 100).unwrap().units, 5);
        queue.cut(3).unwrap();
        assert_eq!(queue.units, 3);
        assert_eq!(Queue::open(dir.path(), 0, 100).unwrap().units, 3);
        queue.append(&units(3..4)).unwrap();
        assert_eq!(queue.read(0, 10).unwrap().len(), 4);
    }
}
