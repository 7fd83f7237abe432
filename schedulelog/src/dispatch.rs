//! Dispatch logs: one per bucket, recording what became of its records.
//!
//! ```text
//! dispatch/{YYYYMMDDTHHMM}Z.log   file header (magic b"DLYDDSP\0", segment_minutes, value = bucket start
//!                                 minute), then outcome frames (record.rs) in the order they happened
//! ```
//!
//! Invariants:
//! - An outcome is appended only after the fact it records is durable elsewhere (the sink acknowledged,
//!   the retry is in the WAL, the cancel is in the WAL), so losing the tail of a dispatch log can only
//!   cause a repeat delivery, never a loss.
//! - Appends are grouped: one call writes every outcome it is given and `fdatasync`s each touched file
//!   once before returning; calls that arrive while another one writes and syncs are done together by
//!   the next of them (group commit, group.rs), so lanes settling batches at once share those syncs.
//! - Outcomes are facts about seqs and are applied as a set: a repeated outcome is harmless, so replaying
//!   a cancel twice needs no deduplication.
//! - A torn tail is cut on first open for append (tail policy in frame.rs).
//! - A failed append (a full disk part-way through a write, say) leaves every log appendable: the handle
//!   of each log it failed on is dropped, so the next append reopens it and cuts whatever part of a frame
//!   reached it; whole outcomes that did reach it are kept, and a retry of the same outcomes repeats them
//!   harmlessly. A write error is `Error::Io` (a full disk is [`Error::is_disk_full`]); a failed sync is
//!   `Error::Sync`, which the callers treat as fatal. In a group, a caller hears the error of a log it
//!   had outcomes for (the other logs' callers are answered for theirs); a failed directory sync fails
//!   every caller.
//! - A log created by an append is in a synced directory before any later append returns, even if the
//!   append that created it failed.

use crate::bucket::{Bucket, SegmentMinutes};
use crate::error::{Error, Result};
use crate::frame::{self, Frames, Kind, Stop};
use crate::group::Group;
use crate::header::{open_data_file, FileHeader, OpenMode, DISPATCH_MAGIC, HEADER_LEN};
use crate::record::Outcome;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub(crate) fn path(dir: &Path, bucket: Bucket) -> PathBuf {
    dir.join(format!("{bucket}.log"))
}

/// Handles kept open for append, at most this many at a time.
const MAX_OPEN: usize = 256;

#[derive(Debug)]
struct DispatchFile {
    file: File,
    len: u64,
}

#[derive(Debug, Default)]
struct OpenLogs {
    files: HashMap<Bucket, DispatchFile>,
    /// A log was created since the directory was last synced.
    dir_unsynced: bool,
}

/// Outcomes for each bucket, encoded: one caller's part of a group commit.
type Appends = HashMap<Bucket, Vec<u8>>;

/// The dispatch logs of a data dir.
#[derive(Debug)]
pub(crate) struct DispatchLogs {
    dir: PathBuf,
    width: SegmentMinutes,
    /// The open logs, and appends waiting for the thread that holds them.
    open: Group<OpenLogs, Appends, Result<()>>,
    #[cfg(test)]
    pub faults: std::sync::Arc<crate::fault::Faults>,
}

impl DispatchLogs {
    pub(crate) fn new(dir: &Path, width: SegmentMinutes) -> DispatchLogs {
        DispatchLogs {
            dir: dir.to_path_buf(),
            width,
            open: Group::new(OpenLogs::default()),
            #[cfg(test)]
            faults: Default::default(),
        }
    }

    /// Appends outcomes, each to its bucket's log, and makes them durable. Outcomes that other threads
    /// append meanwhile share the write and the sync of each log (group commit, group.rs); a log that
    /// fails fails only the callers with outcomes for it (and a failed directory sync, every caller).
    pub(crate) fn append(&self, outcomes: &[(Bucket, Outcome)]) -> Result<()> {
        let mut mine = Appends::new();
        for (bucket, outcome) in outcomes {
            outcome.encode_frame(mine.entry(*bucket).or_default());
        }
        self.open.run(mine, |open, works| {
            let mut all = Appends::new();
            for work in &works {
                for (bucket, bytes) in work {
                    all.entry(*bucket).or_default().extend_from_slice(bytes);
                }
            }
            let failed = self.append_all(open, &all);
            works
                .iter()
                .map(|work| match &failed {
                    Err(dir) => Err(dir.duplicate()),
                    Ok(failed) => match work.keys().find_map(|b| failed.get(b)) {
                        Some(e) => Err(e.duplicate()),
                        None => Ok(()),
                    },
                })
                .collect()
        })
    }

    /// Writes and syncs each bucket's bytes, and answers the buckets that failed and why; `Err` if the
    /// directory could not be synced after a log was created (that fails every bucket).
    fn append_all(&self, open: &mut OpenLogs, all: &Appends) -> Result<HashMap<Bucket, Error>> {
        if open.files.len() + all.len() > MAX_OPEN {
            open.files.clear(); // every open handle is synced: closing them loses nothing
        }
        let mut failed = HashMap::new();
        for (bucket, bytes) in all {
            if let Err(e) = self.append_one(open, *bucket, bytes) {
                failed.insert(*bucket, e);
            }
        }
        // A group may span more logs than one call would; what is over stays closed until needed.
        if open.files.len() > MAX_OPEN {
            open.files.clear();
        }
        // Also after a failure: a log created before it must not vanish in a crash once its outcomes
        // are synced (a later append would not know to sync the directory).
        if open.dir_unsynced {
            crate::header::sync_dir(&self.dir)?;
            open.dir_unsynced = false;
        }
        Ok(failed)
    }

    fn append_one(&self, open: &mut OpenLogs, bucket: Bucket, bytes: &[u8]) -> Result<()> {
        if !open.files.contains_key(&bucket) {
            let (file, new) = self.open_for_append(bucket)?;
            open.dir_unsynced |= new;
            open.files.insert(bucket, file);
        }
        let target = open.files.get_mut(&bucket).expect("inserted above");
        let path = path(&self.dir, bucket);
        let written = self.write(target, bytes, &path);
        if written.is_err() {
            // The handle's end is now unknown; reopen (and re-check the tail) next time.
            open.files.remove(&bucket);
            return written;
        }
        target.len += bytes.len() as u64;
        Ok(())
    }

    /// Writes `bytes` at the end of `target` and syncs it.
    fn write(&self, target: &DispatchFile, bytes: &[u8], path: &Path) -> Result<()> {
        #[cfg(test)]
        if self.faults.strikes(crate::fault::Point::DispatchAppend) {
            // As a full disk mid-write leaves it: part of a frame on the file.
            let half = &bytes[..bytes.len().div_ceil(2)];
            target
                .file
                .write_all_at(half, target.len)
                .map_err(Error::io(path))?;
            return Err(Error::io(path)(crate::fault::no_space()));
        }
        target
            .file
            .write_all_at(bytes, target.len)
            .map_err(Error::io(path))?;
        let started = std::time::Instant::now();
        #[cfg(test)]
        self.faults
            .sync_fails_at(crate::fault::Point::DispatchSync, path)?;
        crate::slow_disk::sync();
        let synced = target.file.sync_data().map_err(Error::sync(path));
        metrics::histogram!("delayd_sync_seconds", "file" => "dispatch")
            .record(started.elapsed().as_secs_f64());
        synced
    }

    /// Opens (or creates) a bucket's log for append, cutting a torn tail. Returns whether it was created.
    fn open_for_append(&self, bucket: Bucket) -> Result<(DispatchFile, bool)> {
        let path = path(&self.dir, bucket);
        let file = open_data_file(&path, OpenMode::Keep).map_err(Error::io(&path))?;
        let bytes = fs::read(&path).map_err(Error::io(&path))?;
        if bytes.len() < HEADER_LEN || (bytes.len() == HEADER_LEN && bytes.iter().all(|&b| b == 0))
        {
            // New; or created just before a crash, or by an append that then found the disk full, with
            // none or part of its header (it is the first thing written, before any outcome): start it
            // afresh.
            let header = FileHeader {
                magic: DISPATCH_MAGIC,
                segment_minutes: self.width.get(),
                value: u64::from(bucket.start_minute()),
            };
            file.set_len(0)
                .and_then(|()| file.write_all_at(&header.encode(), 0))
                .map_err(Error::io(&path))?;
            // (Its header reaches the disk with the first outcome's sync.)
            let len = HEADER_LEN as u64;
            return Ok((DispatchFile { file, len }, true));
        }
        // Only the end is needed: the outcomes are not decoded (the loader's reads check them).
        let scan = scan(&path, &bytes, bucket, self.width, false)?;
        if scan.torn {
            file.set_len(scan.end).map_err(Error::io(&path))?;
            file.sync_all().map_err(Error::sync(&path))?;
            metrics::counter!("delayd_log_torn_tails_total").increment(1);
        }
        Ok((
            DispatchFile {
                file,
                len: scan.end,
            },
            false,
        ))
    }

    /// Every outcome recorded for `bucket`, oldest first (empty when it has no log).
    pub(crate) fn read(&self, bucket: Bucket) -> Result<Vec<Outcome>> {
        self.read_sized(bucket).map(|(outcomes, _)| outcomes)
    }

    /// [`Self::read`], with the size of the log read (0 without one).
    pub(crate) fn read_sized(&self, bucket: Bucket) -> Result<(Vec<Outcome>, u64)> {
        let path = path(&self.dir, bucket);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
            Err(e) => return Err(Error::io(&path)(e)),
        };
        let outcomes = scan(&path, &bytes, bucket, self.width, true)?.outcomes;
        Ok((outcomes, bytes.len() as u64))
    }

    /// The outcomes of a bucket's log from byte `from` on (0: from the start), each with the offset of
    /// its frame, and the offset just past the last whole frame: what an outcome index (view.rs) reads
    /// to catch up, and a lookup of the outcomes recorded since a mark ([`Self::marks`]). It stops at
    /// the end, and at a frame still being written or torn (the next open for append deals with
    /// that); damage in synced data is an error naming the file and offset.
    pub(crate) fn read_from(
        &self,
        bucket: Bucket,
        from: u64,
    ) -> Result<(Vec<(u64, Outcome)>, u64)> {
        let path = path(&self.dir, bucket);
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), from)),
            Err(e) => return Err(Error::io(&path)(e)),
        };
        let len = file.metadata().map_err(Error::io(&path))?.len();
        let start = from.max(HEADER_LEN as u64);
        if len <= start {
            return Ok((Vec::new(), from));
        }
        if from < HEADER_LEN as u64 {
            let mut header = [0u8; HEADER_LEN];
            file.read_exact_at(&mut header, 0)
                .map_err(Error::io(&path))?;
            if header.iter().all(|&b| b == 0) {
                return Ok((Vec::new(), from)); // its header is not written yet
            }
            let header = FileHeader::check(&header, DISPATCH_MAGIC, &path)?;
            if header.value != u64::from(bucket.start_minute()) {
                return Err(Error::corrupt(
                    &path,
                    0,
                    "header does not match the file name",
                ));
            }
        }
        // Read up to the end as it is now: an append for the next open may have cut a torn tail since
        // the length was taken.
        let mut bytes = vec![0u8; usize::try_from(len - start).unwrap_or(usize::MAX)];
        let mut read = 0;
        while read < bytes.len() {
            match file.read_at(&mut bytes[read..], start + read as u64) {
                Ok(0) => break,
                Ok(n) => read += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(&path)(e)),
            }
        }
        bytes.truncate(read);
        let mut found = Vec::new();
        let mut frames = Frames::new(&bytes);
        for (at, kind, payload) in frames.by_ref() {
            let offset = start + at as u64;
            let decoded = match kind {
                Kind::Outcome => Outcome::decode(payload).map_err(|e| e.to_string()),
                _ => Err("a non-outcome frame in a dispatch log".to_string()),
            };
            found.push((
                offset,
                decoded.map_err(|reason| Error::corrupt(&path, offset, reason))?,
            ));
        }
        let end = match frames.stop() {
            Some(Stop::End { at }) => at,
            Some(Stop::Invalid { at, reason }) => {
                frame::check_torn_tail(&path, &bytes, start, at, reason)?;
                at
            }
            None => unreachable!("the frame walk ended without a stop"),
        };
        Ok((found, start + end as u64))
    }

    /// The outcomes whose frames start at `offsets` in a bucket's log (offsets [`Self::read_from`] gave);
    /// `None` when the log is gone (the bucket was retired meanwhile, its records with it).
    pub(crate) fn read_at(&self, bucket: Bucket, offsets: &[u64]) -> Result<Option<Vec<Outcome>>> {
        if offsets.is_empty() {
            return Ok(Some(Vec::new()));
        }
        let path = path(&self.dir, bucket);
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(&path)(e)),
        };
        let mut outcomes = Vec::with_capacity(offsets.len());
        for &offset in offsets {
            let mut header = [0u8; frame::HEADER_LEN];
            file.read_exact_at(&mut header, offset)
                .map_err(Error::io(&path))?;
            let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
            let mut bytes = vec![0u8; frame::HEADER_LEN + len.min(frame::MAX_PAYLOAD)];
            file.read_exact_at(&mut bytes, offset)
                .map_err(Error::io(&path))?;
            let outcome = match frame::decode(&bytes) {
                frame::Next::Frame {
                    kind: Kind::Outcome,
                    payload,
                } => Outcome::decode(payload).map_err(|e| e.to_string()),
                _ => Err("no outcome frame where its index says".to_string()),
            };
            outcomes.push(outcome.map_err(|reason| Error::corrupt(&path, offset, reason))?);
        }
        Ok(Some(outcomes))
    }

    /// For each log open for append, the end of its synced outcomes: an outcome appended after this
    /// call lands at or past it (a torn tail is never cut below that end). Waits for an append in
    /// progress; a log not open has no mark (its outcomes are read from the start), and none has
    /// while the directory owes a sync (a log created since might not survive a crash, and one made
    /// afresh after it would not have the mark's frame boundary).
    pub(crate) fn marks(&self) -> Vec<(Bucket, u64)> {
        let open = self.open.lock();
        if open.dir_unsynced {
            return Vec::new();
        }
        let mut marks: Vec<(Bucket, u64)> = open.files.iter().map(|(b, f)| (*b, f.len)).collect();
        marks.sort_unstable();
        marks
    }

    /// The size of a bucket's log now (0 without one).
    pub(crate) fn size(&self, bucket: Bucket) -> Result<u64> {
        let path = path(&self.dir, bucket);
        match fs::metadata(&path) {
            Ok(meta) => Ok(meta.len()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(Error::io(&path)(e)),
        }
    }

    /// Forgets the handle of a bucket and deletes its log.
    pub(crate) fn remove(&self, bucket: Bucket) -> Result<()> {
        self.open.lock().files.remove(&bucket);
        let path = path(&self.dir, bucket);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(&path)(e)),
        }
    }
}

struct Scan {
    outcomes: Vec<Outcome>,
    end: u64,
    torn: bool,
}

/// Walks a log's frames to the end of the whole ones; with `decode`, also decodes each outcome (a
/// first open for append needs only the end: a million outcomes' decoding was most of its time).
fn scan(
    path: &Path,
    bytes: &[u8],
    bucket: Bucket,
    width: SegmentMinutes,
    decode: bool,
) -> Result<Scan> {
    if bytes.len() < HEADER_LEN || (bytes.len() == HEADER_LEN && bytes.iter().all(|&b| b == 0)) {
        // Created but the header never (wholly) reached the disk: an empty log.
        return Ok(Scan {
            outcomes: Vec::new(),
            end: HEADER_LEN as u64,
            torn: false,
        });
    }
    let header = FileHeader::check(bytes, DISPATCH_MAGIC, path)?;
    if header.value != u64::from(bucket.start_minute()) || header.segment_minutes != width.get() {
        return Err(Error::corrupt(
            path,
            0,
            "header does not match the file name",
        ));
    }
    let body = &bytes[HEADER_LEN..];
    let mut outcomes = Vec::new();
    let mut frames = Frames::new(body);
    for (at, kind, payload) in frames.by_ref() {
        let decoded = match kind {
            Kind::Outcome if !decode => continue,
            Kind::Outcome => Outcome::decode(payload).map_err(|e| e.to_string()),
            _ => Err("a non-outcome frame in a dispatch log".to_string()),
        };
        outcomes.push(
            decoded.map_err(|reason| Error::corrupt(path, (HEADER_LEN + at) as u64, reason))?,
        );
    }
    let (end, torn) = match frames.stop() {
        // Files grow by append, so anything after the end marker is a torn write, as long as it is
        // within the unsynced window.
        Some(Stop::End { at }) if at == body.len() => (at, false),
        Some(Stop::End { at }) => {
            frame::check_torn_tail(path, body, HEADER_LEN as u64, at, "zeros inside the log")?;
            (at, true)
        }
        Some(Stop::Invalid { at, reason }) => {
            frame::check_torn_tail(path, body, HEADER_LEN as u64, at, reason)?;
            (at, true)
        }
        None => unreachable!("the frame walk ended without a stop"),
    };
    Ok(Scan {
        outcomes,
        end: (HEADER_LEN + end) as u64,
        torn,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::Fault;
    use crate::record::OutcomeKind;
    use crate::tests::{wait_until, HOUR_MS, T0};
    use std::sync::Arc;

    fn outcome(seq: u64) -> Outcome {
        Outcome {
            seq,
            at_ms: T0,
            attempt: 0,
            kind: OutcomeKind::Delivered,
        }
    }

    /// Dispatch logs in a fresh directory (kept while the handle lives), and two consecutive buckets.
    fn two_buckets() -> (tempfile::TempDir, Arc<DispatchLogs>, [Bucket; 2]) {
        let dir = tempfile::tempdir().unwrap();
        let width = SegmentMinutes::new(60).unwrap();
        let logs = Arc::new(DispatchLogs::new(dir.path(), width));
        let buckets = [Bucket::of(T0, width), Bucket::of(T0 + HOUR_MS, width)];
        (dir, logs, buckets)
    }

    /// Starts one thread per call while the logs are held, waits until every call is queued, lets go,
    /// and answers each call's result in order.
    fn queued_together(
        logs: &Arc<DispatchLogs>,
        calls: Vec<Vec<(Bucket, Outcome)>>,
    ) -> Vec<Result<()>> {
        let count = calls.len();
        let held = logs.open.lock();
        let callers: Vec<_> = calls
            .into_iter()
            .map(|outcomes| {
                let logs = logs.clone();
                std::thread::spawn(move || logs.append(&outcomes))
            })
            .collect();
        wait_until("every append queues", || logs.open.queued() == count);
        drop(held);
        callers.into_iter().map(|c| c.join().unwrap()).collect()
    }

    /// Three appends that arrive while the logs are held are done together, and each is durable in its
    /// own log; if that shared write fails, each caller hears it, and a retry lands all of them.
    #[test]
    fn appends_that_arrive_together_are_done_together() {
        let (_dir, logs, [first, second]) = two_buckets();
        let calls = || {
            (0..3u64)
                .map(|n| vec![(first, outcome(n)), (second, outcome(10 + n))])
                .collect()
        };
        logs.faults.arm(Fault::DispatchAppendsFull(1));
        for answer in queued_together(&logs, calls()) {
            assert!(
                answer.as_ref().is_err_and(Error::is_disk_full),
                "{answer:?}"
            );
        }
        for answer in queued_together(&logs, calls()) {
            answer.unwrap();
        }
        for (bucket, seqs) in [(first, [0, 1, 2]), (second, [10, 11, 12])] {
            let found: std::collections::BTreeSet<u64> =
                logs.read(bucket).unwrap().iter().map(|o| o.seq).collect();
            assert!(
                seqs.iter().all(|s| found.contains(s)),
                "{bucket}: {found:?}"
            );
        }
    }

    /// A group writes each log once for all its callers, and a log that fails fails only the callers
    /// with outcomes for it: the others' outcomes are durable, and they hear so.
    #[test]
    fn a_log_that_fails_in_a_group_fails_only_its_own_callers() {
        let (_dir, logs, [first, second]) = two_buckets();
        let calls = vec![
            vec![(first, outcome(1))],
            vec![(first, outcome(2))],
            vec![(second, outcome(3))],
        ];
        // Only the group's first write strikes: one log, with every outcome queued for it.
        logs.faults.arm(Fault::DispatchAppendsFull(1));
        let failed: Vec<bool> = queued_together(&logs, calls)
            .iter()
            .map(Result::is_err)
            .collect();
        assert!(
            failed == [true, true, false] || failed == [false, false, true],
            "the callers of exactly one log failed: {failed:?}"
        );
        let (ok_bucket, ok_seqs) = if failed[0] {
            (second, vec![3])
        } else {
            (first, vec![1, 2])
        };
        let found: Vec<u64> = logs
            .read(ok_bucket)
            .unwrap()
            .iter()
            .map(|o| o.seq)
            .collect();
        assert_eq!(found.len(), ok_seqs.len(), "{found:?}");
        assert!(ok_seqs.iter().all(|s| found.contains(s)), "{found:?}");
    }

    /// A mark is where the next outcome of its log begins, also after an append that tore the tail:
    /// read from it, every outcome appended since is found, and none from before it.
    #[test]
    fn outcomes_appended_after_a_mark_are_read_from_it() {
        let (_dir, logs, [first, second]) = two_buckets();
        assert!(logs.marks().is_empty(), "no log is open yet");
        logs.append(&[(first, outcome(1)), (first, outcome(2))])
            .unwrap();
        let marks = logs.marks();
        assert_eq!(marks, vec![(first, logs.size(first).unwrap())]);
        // A full disk tears the next append part-way; the log is reopened and cut by the one after.
        logs.faults.arm(Fault::DispatchAppendsFull(1));
        logs.append(&[(first, outcome(3))]).unwrap_err();
        assert!(
            logs.size(first).unwrap() > marks[0].1,
            "a torn frame is on the log"
        );
        logs.append(&[(first, outcome(4)), (second, outcome(5))])
            .unwrap();
        let (after, _) = logs.read_from(first, marks[0].1).unwrap();
        let seqs: Vec<u64> = after.iter().map(|(_, o)| o.seq).collect();
        assert_eq!(seqs, vec![4]);
        let (all, _) = logs.read_from(first, 0).unwrap();
        assert_eq!(all.len(), 3, "{all:?}");
        let now = logs.marks();
        assert_eq!(now.len(), 2, "{now:?}");
        assert!(now[0].1 > marks[0].1, "{now:?}");
    }

    /// While the directory owes a sync (a failed one), no log has a mark: one created since might
    /// not survive a crash.
    #[test]
    fn no_marks_while_the_directory_owes_a_sync() {
        let (_dir, logs, [first, _]) = two_buckets();
        logs.append(&[(first, outcome(1))]).unwrap();
        assert_eq!(logs.marks().len(), 1);
        logs.open.lock().dir_unsynced = true;
        assert!(logs.marks().is_empty());
    }
}
