//! The schedule table: every recurring schedule's definition and progress (DESIGN §14), kept by the
//! replayer from the records it applies (record.rs: ops are records for the reserved sink, firings are
//! messages with the schedule's headers) and saved beside the checkpoint, so that it outlives the WAL
//! the way segments do.
//!
//! ```text
//! schedules/definitions   (replaced atomically, before a checkpoint, when an op was applied since)
//! 0   8  magic        b"DLYDSDEF"
//! 8   2  version      u16, 1
//! 10  8  next_seq     u64: every op below it is in here
//! 18  4  count        u32, then per schedule, by id:
//!        id len u8 | id | since seq u64 | since at i64 | paused u8 | definition len u32 | definition
//! ..  4  crc          u32, CRC-32C of everything before it
//!
//! schedules/progress      (replaced atomically, before a checkpoint, when a firing was applied since)
//! 0   8  magic        b"DLYDSPRG"
//! 8   2  version      u16, 1
//! 10  8  next_seq     u64: every firing below it is counted in here
//! 18  4  count        u32, then per schedule that has fired:
//!        id len u8 | id | fired u64 | fire_at i64 | message shard u16 | bucket minute u32 | seq u64
//! ..  4  crc
//! ```
//!
//! Invariants:
//! - Ops and firings are applied in seq order, each once: an op below `next_op` (a firing below
//!   `next_firing`) is in the table already, whether from its file or an earlier try of its group.
//! - A file is written with the `next_*` the table had when its checkpoint job was taken, under the
//!   replayer's lock, so it holds exactly the records below it; it is stored before that job's
//!   checkpoint, so a checkpoint never covers a record the files lack (the WAL keeps what they lack).
//!   A file newer than the checkpoint is harmless: its records are skipped when the WAL is replayed.
//! - A firing counts only for a schedule that exists when it is applied. `since` is the op (put or
//!   resume) from which the schedule plans afresh: a last firing below it belongs to an earlier
//!   definition or to before a pause.

use crate::error::{Error, Result};
use crate::header::{create_dir_durably, write_atomically};
use crate::id::{Location, MessageId};
use crate::record::ScheduleOp;
use crate::Bucket;
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(crate) const DEFINITIONS_MAGIC: [u8; 8] = *b"DLYDSDEF";
pub(crate) const PROGRESS_MAGIC: [u8; 8] = *b"DLYDSPRG";
const VERSION: u16 = 1;
const FIXED_LEN: usize = 22;
/// The directory of the table's files, in the data dir.
pub(crate) const DIR: &str = "schedules";
const DEFINITIONS: &str = "definitions";
const PROGRESS: &str = "progress";

/// A schedule as the table holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleState {
    pub id: String,
    /// The application's definition, opaque to the engine.
    pub definition: Arc<[u8]>,
    /// The seq and commit time of the op from which it plans afresh: its put, or its last resume.
    pub since_seq: u64,
    pub since_ms: i64,
    pub paused: bool,
    /// Firings written for it (first attempts), over all its definitions.
    pub fired: u64,
    pub last: Option<LastFiring>,
}

/// The newest firing written for a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LastFiring {
    /// Its nominal time, unix ms.
    pub fire_at_ms: i64,
    pub message: MessageId,
}

impl LastFiring {
    /// The firing was written under the schedule's current definition and since its last resume.
    pub fn is_current(&self, state: &ScheduleState) -> bool {
        self.message.first.seq > state.since_seq
    }
}

/// The table and what of it is saved.
#[derive(Debug, Default)]
pub(crate) struct ScheduleTable {
    entries: BTreeMap<String, ScheduleState>,
    /// The first op seq not applied yet / the first firing seq not counted yet.
    next_op: u64,
    next_firing: u64,
    /// `next_op` / `next_firing` of the files last stored: a file is written again once they moved.
    saved_op: u64,
    saved_firing: u64,
}

/// A definition as its file holds it, taken from the table (the bytes shared, not copied).
type DefinitionRow = (String, u64, i64, bool, Arc<[u8]>);

/// The table's files as a checkpoint job writes them (None: unchanged since the last stored). The
/// definitions are encoded by the job, off the replayer's lock (they may be many megabytes); the
/// progress, fixed-size rows, as it is taken.
#[derive(Debug, Default)]
pub(crate) struct TableFiles {
    dir: PathBuf,
    definitions: Option<(u64, Vec<DefinitionRow>)>,
    progress: Option<(u64, Vec<u8>)>,
}

impl TableFiles {
    /// Writes the changed files, each atomically: the name and length of each written.
    pub(crate) fn store(&self) -> Result<Vec<(&'static str, u64)>> {
        let mut written = Vec::new();
        if self.definitions.is_none() && self.progress.is_none() {
            return Ok(written);
        }
        create_dir_durably(&self.dir)?;
        if let Some((next, rows)) = &self.definitions {
            let bytes = encode_definitions(*next, rows);
            write_atomically(&self.dir.join(DEFINITIONS), &bytes)?;
            written.push((DEFINITIONS, bytes.len() as u64));
        }
        if let Some((_, bytes)) = &self.progress {
            write_atomically(&self.dir.join(PROGRESS), bytes)?;
            written.push((PROGRESS, bytes.len() as u64));
        }
        Ok(written)
    }

    /// What the table saved once these files are stored.
    pub(crate) fn saved(&self) -> (Option<u64>, Option<u64>) {
        (
            self.definitions.as_ref().map(|(next, _)| *next),
            self.progress.as_ref().map(|(next, _)| *next),
        )
    }
}

impl ScheduleTable {
    /// Loads the files of `data_dir` (an empty table without them).
    pub(crate) fn load(data_dir: &Path) -> Result<ScheduleTable> {
        let dir = data_dir.join(DIR);
        let mut table = ScheduleTable::default();
        if let Some(bytes) = read(&dir.join(DEFINITIONS))? {
            let path = dir.join(DEFINITIONS);
            let (next, entries) = decode_definitions(&bytes)
                .map_err(|(offset, reason)| Error::corrupt(&path, offset, reason))?;
            table.next_op = next;
            table.saved_op = next;
            table.entries = entries;
        }
        if let Some(bytes) = read(&dir.join(PROGRESS))? {
            let path = dir.join(PROGRESS);
            let next = decode_progress(&bytes, &mut table.entries)
                .map_err(|(offset, reason)| Error::corrupt(&path, offset, reason))?;
            table.next_firing = next;
            table.saved_firing = next;
        }
        Ok(table)
    }

    pub(crate) fn get(&self, id: &str) -> Option<&ScheduleState> {
        self.entries.get(id)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Up to `limit` schedules whose ids come after `after`, by id.
    pub(crate) fn page(&self, after: Option<&str>, limit: usize) -> Vec<ScheduleState> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = after.map_or(Unbounded, |a| Excluded(a.to_string()));
        self.entries
            .range((from, Unbounded))
            .take(limit)
            .map(|(_, s)| s.clone())
            .collect()
    }

    /// Applies the op record `seq`, committed at `at_ms`.
    pub(crate) fn apply_op(
        &mut self,
        seq: u64,
        at_ms: i64,
        id: &str,
        op: ScheduleOp,
        definition: &[u8],
    ) {
        if seq < self.next_op {
            return;
        }
        self.next_op = seq + 1;
        match op {
            ScheduleOp::Put => {
                let (fired, last, paused) = self
                    .entries
                    .get(id)
                    .map_or((0, None, false), |s| (s.fired, s.last, s.paused));
                let state = ScheduleState {
                    id: id.to_string(),
                    definition: definition.into(),
                    since_seq: seq,
                    since_ms: at_ms,
                    paused,
                    fired,
                    last,
                };
                self.entries.insert(id.to_string(), state);
            }
            ScheduleOp::Pause => {
                if let Some(state) = self.entries.get_mut(id) {
                    state.paused = true;
                }
            }
            ScheduleOp::Resume => {
                if let Some(state) = self.entries.get_mut(id) {
                    if state.paused {
                        state.paused = false;
                        state.since_seq = seq;
                        state.since_ms = at_ms;
                    }
                }
            }
            ScheduleOp::Delete => {
                self.entries.remove(id);
            }
        }
    }

    /// Counts the firing `message` (its first attempt, record `seq`) of schedule `id`. A nominal time
    /// that does not parse is not delayd's own firing and counts for nothing.
    pub(crate) fn apply_firing(&mut self, seq: u64, id: &str, fire_at: &str, message: MessageId) {
        if seq < self.next_firing {
            return;
        }
        self.next_firing = seq + 1;
        let (Some(state), Some(fire_at_ms)) = (self.entries.get_mut(id), parse_fire_at(fire_at))
        else {
            return;
        };
        state.fired += 1;
        // Catch-up firings are written oldest first, so the newest written is the last.
        state.last = Some(LastFiring {
            fire_at_ms,
            message,
        });
    }

    /// The files to store with a checkpoint taken now: those whose records moved since last stored.
    pub(crate) fn files(&self, data_dir: &Path) -> TableFiles {
        TableFiles {
            dir: data_dir.join(DIR),
            definitions: (self.next_op > self.saved_op)
                .then(|| (self.next_op, self.definition_rows())),
            progress: (self.next_firing > self.saved_firing)
                .then(|| (self.next_firing, self.encode_progress())),
        }
    }

    /// Every file as of now, whether changed or not (a snapshot's).
    pub(crate) fn all_files(&self, dir: &Path) -> TableFiles {
        TableFiles {
            dir: dir.join(DIR),
            definitions: Some((self.next_op, self.definition_rows())),
            progress: Some((self.next_firing, self.encode_progress())),
        }
    }

    /// Records what a stored job's files held.
    pub(crate) fn stored(&mut self, files: &TableFiles) {
        let (op, firing) = files.saved();
        self.saved_op = self.saved_op.max(op.unwrap_or(0));
        self.saved_firing = self.saved_firing.max(firing.unwrap_or(0));
    }

    fn definition_rows(&self) -> Vec<DefinitionRow> {
        (self.entries.values())
            .map(|s| {
                let definition = s.definition.clone();
                (s.id.clone(), s.since_seq, s.since_ms, s.paused, definition)
            })
            .collect()
    }

    fn encode_progress(&self) -> Vec<u8> {
        let fired = self.entries.values().filter_map(|s| Some((s, s.last?)));
        let mut buf = head(PROGRESS_MAGIC, self.next_firing, fired.clone().count());
        for (state, last) in fired {
            put_id(&mut buf, &state.id);
            buf.extend_from_slice(&state.fired.to_le_bytes());
            buf.extend_from_slice(&last.fire_at_ms.to_le_bytes());
            buf.extend_from_slice(&last.message.shard.to_le_bytes());
            let location = last.message.first;
            buf.extend_from_slice(&location.bucket.start_minute().to_le_bytes());
            buf.extend_from_slice(&location.seq.to_le_bytes());
        }
        seal(buf)
    }
}

/// What `delayd inspect` says of a table file: its kind, `next_seq` and schedules (with, for the
/// progress, each one's count and last fire time), or why it does not decode.
pub(crate) fn describe(bytes: &[u8]) -> std::result::Result<Vec<String>, String> {
    let damaged = |(offset, reason): Damage| format!("{reason} at offset {offset}");
    let magic = bytes.get(..8).unwrap_or_default();
    if magic == DEFINITIONS_MAGIC {
        let (next, entries) = decode_definitions(bytes).map_err(damaged)?;
        let mut lines = vec![format!(
            "schedule definitions: every op below seq {next}; {} schedules",
            entries.len()
        )];
        lines.extend(entries.values().map(|s| {
            format!(
                "{}: since seq {}{}, definition {} bytes",
                s.id,
                s.since_seq,
                if s.paused { ", paused" } else { "" },
                s.definition.len()
            )
        }));
        return Ok(lines);
    }
    // Checked whole first (its entries are dropped: there are no definitions to hang them on).
    let next = decode_progress(bytes, &mut BTreeMap::new()).map_err(damaged)?;
    let (_, count, mut r) = open_file(bytes, PROGRESS_MAGIC).map_err(damaged)?;
    let mut lines = vec![format!(
        "schedule progress: every firing below seq {next}; {count} schedules have fired"
    )];
    for _ in 0..count {
        let id = r.id().map_err(damaged)?;
        let fired = r.u64().map_err(damaged)?;
        let fire_at_ms = r.u64().map_err(damaged)? as i64;
        r.take(14).map_err(damaged)?;
        lines.push(format!(
            "{id}: fired {fired}, last fire time {fire_at_ms} ms"
        ));
    }
    Ok(lines)
}

fn encode_definitions(next: u64, rows: &[DefinitionRow]) -> Vec<u8> {
    let mut buf = head(DEFINITIONS_MAGIC, next, rows.len());
    for (id, since_seq, since_ms, paused, definition) in rows {
        put_id(&mut buf, id);
        buf.extend_from_slice(&since_seq.to_le_bytes());
        buf.extend_from_slice(&since_ms.to_le_bytes());
        buf.push(u8::from(*paused));
        buf.extend_from_slice(&(definition.len() as u32).to_le_bytes());
        buf.extend_from_slice(definition);
    }
    seal(buf)
}

fn read(path: &Path) -> Result<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path)(e)),
    }
}

fn head(magic: [u8; 8], next: u64, count: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(FIXED_LEN + count * 64);
    buf.extend_from_slice(&magic);
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.extend_from_slice(&next.to_le_bytes());
    buf.extend_from_slice(&(count as u32).to_le_bytes());
    buf
}

fn put_id(buf: &mut Vec<u8>, id: &str) {
    // Ids are at most 200 bytes (the API checks; the op record's topic holds at most 255).
    buf.push(id.len() as u8);
    buf.extend_from_slice(id.as_bytes());
}

fn seal(mut buf: Vec<u8>) -> Vec<u8> {
    let crc = crc32c::crc32c(&buf);
    buf.extend_from_slice(&crc.to_le_bytes());
    buf
}

/// A reason a file is refused, with the offset where it was found.
type Damage = (u64, &'static str);

/// Checks a file's magic, version and checksum; returns its `next_seq`, its count and a reader past the
/// fixed part.
fn open_file(bytes: &[u8], magic: [u8; 8]) -> std::result::Result<(u64, u32, Cursor<'_>), Damage> {
    let (body, crc) = bytes.split_last_chunk::<4>().ok_or((0, "file too short"))?;
    if body.len() < FIXED_LEN || crc32c::crc32c(body) != u32::from_le_bytes(*crc) {
        return Err((0, "checksum mismatch"));
    }
    let mut r = Cursor {
        bytes: body,
        pos: 0,
    };
    if r.take(8)? != magic || r.u16()? != VERSION {
        return Err((0, "not a schedule file of this format version"));
    }
    let next = r.u64()?;
    let count = r.u32()?;
    Ok((next, count, r))
}

fn decode_definitions(
    bytes: &[u8],
) -> std::result::Result<(u64, BTreeMap<String, ScheduleState>), Damage> {
    let (next, count, mut r) = open_file(bytes, DEFINITIONS_MAGIC)?;
    let mut entries = BTreeMap::new();
    for _ in 0..count {
        let id = r.id()?;
        let since_seq = r.u64()?;
        let since_ms = r.u64()? as i64;
        let paused = r.take(1)?[0] != 0;
        let len = r.u32()? as usize;
        let definition = r.take(len)?.into();
        let state = ScheduleState {
            id: id.clone(),
            definition,
            since_seq,
            since_ms,
            paused,
            fired: 0,
            last: None,
        };
        entries.insert(id, state);
    }
    r.end()?;
    Ok((next, entries))
}

fn decode_progress(
    bytes: &[u8],
    entries: &mut BTreeMap<String, ScheduleState>,
) -> std::result::Result<u64, Damage> {
    let (next, count, mut r) = open_file(bytes, PROGRESS_MAGIC)?;
    for _ in 0..count {
        let id = r.id()?;
        let fired = r.u64()?;
        let fire_at_ms = r.u64()? as i64;
        let shard = r.u16()?;
        let minute = r.u32()?;
        let seq = r.u64()?;
        // A schedule deleted since (its definitions file is the newer) has no entry: dropped.
        if let Some(state) = entries.get_mut(&id) {
            state.fired = fired;
            state.last = Some(LastFiring {
                fire_at_ms,
                message: MessageId {
                    shard,
                    first: Location {
                        bucket: Bucket::from_start_minute(minute),
                        seq,
                    },
                },
            });
        }
    }
    r.end()?;
    Ok(next)
}

/// A bounds-checked reader over a file's body.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], Damage> {
        let out = self
            .bytes
            .get(self.pos..self.pos.saturating_add(n))
            .ok_or((self.pos as u64, "truncated"))?;
        self.pos += n;
        Ok(out)
    }
    fn u16(&mut self) -> std::result::Result<u16, Damage> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().unwrap_or_default(),
        ))
    }
    fn u32(&mut self) -> std::result::Result<u32, Damage> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> std::result::Result<u64, Damage> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }
    fn id(&mut self) -> std::result::Result<String, Damage> {
        let at = self.pos as u64;
        let len = usize::from(self.take(1)?[0]);
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| (at, "schedule id is not UTF-8"))
    }
    fn end(self) -> std::result::Result<(), Damage> {
        match self.pos == self.bytes.len() {
            true => Ok(()),
            false => Err((self.pos as u64, "trailing bytes")),
        }
    }
}

/// Parses a firing's nominal time as delayd writes it: `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC), to unix ms.
pub fn parse_fire_at(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    if b.len() != 24 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' {
        return None;
    }
    if b[16] != b':' || b[19] != b'.' || b[23] != b'Z' {
        return None;
    }
    let num = |from: usize, to: usize| -> Option<i64> {
        let digits = b.get(from..to)?;
        digits.iter().try_fold(0i64, |n, &d| {
            d.is_ascii_digit().then(|| n * 10 + i64::from(d - b'0'))
        })
    };
    let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (hour, minute, second, ms) = (num(11, 13)?, num(14, 16)?, num(17, 19)?, num(20, 23)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    if second > 59 {
        return None;
    }
    let days = crate::bucket::days_from_civil(year, month, day);
    Some(((days * 24 + hour) * 60 + minute) * 60_000 + second * 1000 + ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(seq: u64) -> MessageId {
        MessageId::new(Location {
            bucket: Bucket::from_start_minute(60),
            seq,
        })
    }

    #[test]
    fn fire_times_parse_as_delayd_writes_them() {
        assert_eq!(parse_fire_at("1970-01-01T00:00:00.000Z"), Some(0));
        assert_eq!(
            parse_fire_at("2028-02-29T09:30:15.250Z"),
            Some(1_835_429_415_250) // date -u -d 2028-02-29T09:30:15.250Z +%s%3N
        );
        for bad in [
            "2028-02-29T09:30:15Z",
            "2028-13-01T00:00:00.000Z",
            "2028-02-29 09:30:15.250Z",
            "x",
        ] {
            assert_eq!(parse_fire_at(bad), None, "{bad}");
        }
    }

    #[test]
    fn ops_and_firings_apply_once_in_seq_order_and_survive_a_save() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut table = ScheduleTable::default();
        table.apply_op(1, 100, "a", ScheduleOp::Put, b"def-a");
        table.apply_op(2, 100, "b", ScheduleOp::Put, b"def-b");
        table.apply_firing(3, "a", "1970-01-01T00:00:01.000Z", id(3));
        // Applied again (a group retried): counted once.
        table.apply_firing(3, "a", "1970-01-01T00:00:01.000Z", id(3));
        table.apply_firing(4, "nobody", "1970-01-01T00:00:01.000Z", id(4));
        table.apply_op(5, 200, "b", ScheduleOp::Pause, b"");
        table.apply_op(6, 300, "a", ScheduleOp::Put, b"def-a2");
        let a = table.get("a").expect("a");
        assert_eq!(
            (a.fired, &*a.definition, a.since_seq),
            (1, &b"def-a2"[..], 6)
        );
        assert!(
            !a.last.expect("last").is_current(a),
            "fired under the old definition"
        );
        assert!(table.get("b").expect("b").paused);

        let files = table.files(dir.path());
        files.store().expect("store");
        table.stored(&files);
        assert!(
            table.files(dir.path()).saved() == (None, None),
            "nothing new to write"
        );
        let loaded = ScheduleTable::load(dir.path()).expect("load");
        assert_eq!(loaded.page(None, 10), table.page(None, 10));
        assert_eq!((loaded.next_op, loaded.next_firing), (7, 5));

        table.apply_op(7, 400, "b", ScheduleOp::Resume, b"");
        table.apply_op(8, 400, "a", ScheduleOp::Delete, b"");
        let b = table.get("b").expect("b");
        assert!(!b.paused && b.since_seq == 7);
        assert_eq!(table.page(None, 10).len(), 1);
        assert_eq!(table.files(dir.path()).saved(), (Some(9), None));
    }

    #[test]
    fn a_damaged_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut table = ScheduleTable::default();
        table.apply_op(1, 100, "a", ScheduleOp::Put, b"def-a");
        table.files(dir.path()).store().expect("store");
        let path = dir.path().join(DIR).join(DEFINITIONS);
        let mut bytes = fs::read(&path).expect("read");
        bytes[25] ^= 1;
        fs::write(&path, bytes).expect("write");
        let err = ScheduleTable::load(dir.path()).expect_err("damaged");
        assert!(err.to_string().contains("definitions"), "{err}");
        assert!(describe(&fs::read(&path).expect("read")).is_err());
        table.files(dir.path()).store().expect("store");
        let described = describe(&fs::read(&path).expect("read")).expect("whole");
        assert_eq!(described[1], "a: since seq 1, definition 5 bytes");
    }
}
