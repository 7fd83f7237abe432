//! Opening a data dir: [`ScheduleLog::open`] takes its lock, checks its meta, recovers it from the
//! checkpoint and the WAL, and starts the WAL writer and the replayer threads.
//!
//! Open order: lock, meta, checkpoint, segments cut back to the checkpoint, WAL scanned from the
//! checkpoint (torn tail zeroed), WAL records replayed, new checkpoint, threads started. A full disk
//! does not stop an open: the WAL records it kept from being replayed go to the replayer, which files
//! them once there is room (the log opens disk full: see the failure states atop log/mod.rs).
//!
//! Invariants: nothing is cut from a segment unless the WAL reaches back to the checkpoint
//! ([`check_wal_reaches`]); the next seq handed out is above every seq a segment holds; the WAL loses
//! only what was never acknowledged: a tail wal.rs judges torn, a new file whose header is torn.

use super::replayer::run_replayer;
use super::{Options, ScheduleLog, Shared};
use crate::bucket::SegmentMinutes;
use crate::checkpoint::Checkpoint;
use crate::commit::{CommittedGroup, Writer};
use crate::dispatch::DispatchLogs;
use crate::entry::{EntryLog, Placed};
use crate::error::{Blocked, Error, Result};
use crate::frame;
use crate::header::{self, FileHeader, META_MAGIC};
use crate::proposals::Proposals;
use crate::replay::Replay;
use crate::view::Views;
use crate::wal::{self, ActiveWal};
use std::fs::{self, File};
use std::io;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

impl ScheduleLog {
    /// Opens (creating if needed) the data dir and recovers it.
    pub fn open(data_dir: impl AsRef<Path>, options: Options) -> Result<ScheduleLog> {
        let data_dir = data_dir.as_ref().to_path_buf();
        let block = frame::BLOCK as u64;
        if options.wal_segment_bytes < 2 * block || !options.wal_segment_bytes.is_multiple_of(block)
        {
            return Err(Error::InvalidOption(
                "wal_segment_bytes must be a multiple of 4096 and at least 8192".into(),
            ));
        }
        for dir in ["", "wal", "schedule", "dispatch"] {
            header::create_dir_durably(&data_dir.join(dir))?;
        }
        let lock = lock(&data_dir)?;
        let width = check_meta(&data_dir, options.segment_minutes, options.replicated)?;
        let checkpoint = Checkpoint::load(&data_dir.join("checkpoint"), width)?;
        #[allow(unused_mut)] // set in test builds
        let mut dispatch = DispatchLogs::new(&data_dir.join("dispatch"), width);
        check_wal_reaches(&data_dir, &checkpoint)?;
        // Retired WAL files kept for reuse: as many as the WAL grows by while a checkpoint is taken and
        // made (its trigger, `checkpoint_bytes`, and as much again while its syncs run), at most 8
        // (512 MiB of disk). With the default trigger always 8: a node writing more than ~200 MB/s of WAL
        // outgrows them between two checkpoints and allocates a file or two per checkpoint, which costs
        // no writes, only slower syncs in those files (wal.rs).
        let wal_spares = (options.checkpoint_bytes.saturating_mul(2) / options.wal_segment_bytes)
            .clamp(1, 8) as usize;
        let mut replay = Replay::open(&data_dir, width, &checkpoint, wal_spares)?;
        #[cfg(test)]
        let faults = options.faults.clone().unwrap_or_default();
        #[cfg(test)]
        {
            dispatch.faults = faults.clone();
            replay.faults = faults.clone();
        }

        let wal_dir = data_dir.join("wal");
        wal::remove_leftovers(&wal_dir)?;
        let (active, next_seq, unfiled, placed) =
            recover_wal(&wal_dir, &options, &mut replay, &dispatch)?;
        let entry_log = options.replicated.then(|| {
            let applied = replay.applied.as_ref();
            let purged = applied.and_then(|a| a.purged);
            let applied = applied.map(|a| a.log_id.index);
            Arc::new(EntryLog::recovered(placed, next_seq, purged, applied))
        });
        replay.entry_log = entry_log.clone();
        let next_index = entry_log
            .as_ref()
            .and_then(|log| log.bounds().1)
            .map_or(0, |last| last.index + 1);
        // A full disk: the replayer files the rest, and checkpoints, once there is room.
        match replay.checkpoint() {
            Err(e) if !e.is_disk_full() => return Err(e),
            _ => {}
        }
        let filed = replay.next_seq;

        // In a replicated data dir the records past the checkpoint wait for their entries' apply.
        let committed = match options.replicated {
            true => Arc::new(AtomicU64::new(filed)),
            false => Arc::new(AtomicU64::new(next_seq)),
        };
        let shared = Arc::new(Shared {
            schedules: replay.schedules.clone(),
            data_dir,
            width,
            retention: options.retention,
            dispatch,
            views: Views::default(),
            replay: Mutex::new(replay),
            records: Mutex::default(),
            replayed: Condvar::new(),
            committed: committed.clone(),
            filed: AtomicU64::new(filed),
            clock: options.clock.clone(),
            poisoned: Arc::default(),
            disk_full: Arc::default(),
            closing: Default::default(),
            #[cfg(test)]
            crashed: Default::default(),
            #[cfg(test)]
            faults,
        });
        if let Some(unfiled) = &unfiled {
            // Said at once: what waits for the records to be filed (a lookup, a listing, a source
            // reading back its positions) answers so rather than waiting.
            shared
                .disk_full
                .set(Blocked::Replayer, unfiled.cause.clone());
        }
        let (submit, requests) = crossbeam_channel::bounded(4096);
        let (to_replay, committed_groups) = crossbeam_channel::bounded(8);
        let apply = entry_log.is_some().then(|| to_replay.clone());
        let (propose, proposals) = match entry_log.is_some() {
            true => {
                let (propose, requests) = crossbeam_channel::bounded(4096);
                (
                    Some(propose),
                    Some(Proposals {
                        requests,
                        width,
                        held: Default::default(),
                    }),
                )
            }
            false => (None, None),
        };
        let (recycle, recycled) = crossbeam_channel::bounded(4);
        let writer = Writer {
            wal: active,
            next_seq,
            clock: options.clock.clone(),
            width,
            policy: options.fsync,
            committed,
            replay: to_replay,
            recycled,
            poisoned: None,
            poison_report: shared.poisoned.clone(),
            disk_full: shared.disk_full.clone(),
            roll_failed_at_ms: None,
            entry_log: entry_log.clone(),
            next_index,
            #[cfg(test)]
            fault: None,
        };
        let writer = std::thread::Builder::new()
            .name("delayd-wal".into())
            .spawn(move || writer.run(requests))
            .map_err(Error::io("thread"))?;
        let replayer_shared = shared.clone();
        let replayer = std::thread::Builder::new()
            .name("delayd-replay".into())
            .spawn(move || {
                let unfiled = unfiled.map(|u| u.groups).unwrap_or_default();
                let result = run_replayer(
                    &replayer_shared,
                    &committed_groups,
                    recycle,
                    &options,
                    unfiled,
                );
                if let Err(e) = &result {
                    let _ = replayer_shared.poisoned.set(format!("replay failed: {e}"));
                }
                // Only now, with the real cause published: the writer learns that the replayer is gone
                // from a failed send, and would otherwise be first to poison with a cause of its own.
                drop(committed_groups);
                replayer_shared.disk_full.clear(Blocked::Replayer);
                result
            })
            .map_err(Error::io("thread"))?;
        Ok(ScheduleLog {
            shared,
            entry_log,
            apply,
            propose,
            proposals: Mutex::new(proposals),
            submit: Some(submit),
            writer: Some(writer),
            replayer: Some(replayer),
            _lock: lock,
        })
    }
}

fn lock(data_dir: &Path) -> Result<File> {
    let path = data_dir.join("LOCK");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(Error::io(&path))?;
    // A lock can be held for a moment by a process forked from this one that has not yet exec'd (file
    // descriptors are close-on-exec, not close-on-fork), so a busy lock is retried briefly before it is
    // reported as another process's.
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(fs::TryLockError::WouldBlock) => return Err(Error::Locked(data_dir.to_path_buf())),
            Err(fs::TryLockError::Error(e)) => return Err(Error::io(&path)(e)),
        }
    }
}

/// Reads the data dir's fixed settings, or writes them on first open: the bucket width, and whether it
/// is a cluster member's (the meta's value is 1) or a single node's (0).
fn check_meta(
    data_dir: &Path,
    configured: SegmentMinutes,
    replicated: bool,
) -> Result<SegmentMinutes> {
    let path = data_dir.join("meta");
    match fs::read(&path) {
        Ok(bytes) => {
            let meta = FileHeader::check(&bytes, META_MAGIC, &path)?;
            if meta.segment_minutes != configured.get() {
                return Err(Error::SegmentMinutesMismatch {
                    stored: meta.segment_minutes,
                    configured: configured.get(),
                });
            }
            if (meta.value == 1) != replicated {
                let (was, is) = match replicated {
                    true => ("a single node's", "a cluster member's"),
                    false => ("a cluster member's", "a single node's"),
                };
                return Err(Error::InvalidOption(format!(
                    "the data dir {} is {was}, and cannot be opened as {is}",
                    data_dir.display()
                )));
            }
            Ok(configured)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let meta = FileHeader {
                magic: META_MAGIC,
                segment_minutes: configured.get(),
                value: u64::from(replicated),
            };
            header::write_atomically(&path, &meta.encode())?;
            Ok(configured)
        }
        Err(e) => Err(Error::io(&path)(e)),
    }
}

/// Opening the replayer deletes the segments the checkpoint does not list and cuts the others back to
/// its marks, trusting the WAL to hold everything after it. Before anything is cut, the WAL must reach
/// back to the checkpoint: a checkpoint lost, or older than the WAL (a data dir copied file by file
/// while it ran, WAL files deleted by hand), would otherwise make recovery delete acknowledged
/// messages and then fail anyway on the gap. Without any WAL file a stored checkpoint is enough (a
/// crash can leave none: a torn new file is removed at the next start); with neither, the segments
/// cannot be trusted to anything and nothing is cut.
fn check_wal_reaches(data_dir: &Path, checkpoint: &Checkpoint) -> Result<()> {
    let schedule_dir = data_dir.join("schedule");
    if crate::segment::list(&schedule_dir)?.is_empty() {
        return Ok(()); // nothing to cut
    }
    let checkpoint_path = data_dir.join("checkpoint");
    let first = wal::list(&data_dir.join("wal"))?
        .first()
        .map(|(seq, _)| *seq);
    let reason = match first {
        Some(first) if first <= checkpoint.next_seq => return Ok(()),
        None if checkpoint_path.exists() => return Ok(()),
        Some(first) => format!(
            "the checkpoint's position (seq {}) is before the WAL's first record (seq {first}): the checkpoint is missing or older than the WAL",
            checkpoint.next_seq
        ),
        None => "there is neither a checkpoint nor a WAL file, but there are schedule segments".into(),
    };
    Err(Error::corrupt(
        checkpoint_path,
        0,
        format!("{reason}; replaying would cut the schedule segments, so nothing was changed (restore the data dir from a consistent backup)"),
    ))
}

/// What a full disk kept an open from filing: why, and the WAL's groups from there on.
struct Unfiled {
    cause: String,
    groups: Vec<CommittedGroup>,
}

/// Scans the WAL from the checkpoint, files what it finds, cuts a torn tail and returns the file to
/// append to and the next seq. In a replicated data dir nothing is filed: records are applied only once
/// their entries are known committed (by the cluster layer, through `ScheduleLog::apply_entries`);
/// the entries after the checkpoint's applied one come back instead. A full disk stops the filing, not the open: what is left comes back
/// (the scan goes on, for the seqs and the tail), for the replayer to file once there is room. It is
/// held in memory until then: at most the WAL written since the last checkpoint (`checkpoint_bytes`).
fn recover_wal(
    wal_dir: &Path,
    options: &Options,
    replay: &mut Replay,
    dispatch: &DispatchLogs,
) -> Result<(ActiveWal, u64, Option<Unfiled>, Vec<Placed>)> {
    let files = wal::list(wal_dir)?;
    let replicated = options.replicated;
    let applied = replay.applied.as_ref().map(|a| a.log_id.index);
    let purged = replay
        .applied
        .as_ref()
        .and_then(|a| a.purged)
        .map(|p| p.index);
    let mut placed = Vec::new();
    let mut next_index = None;
    // Files entirely below the checkpoint were replayed already (their deletion may have been cut short).
    let start = files
        .iter()
        // (A replicated data dir's are its Raft log, all of them: its entries are kept, applied or not,
        // until their files are retired.)
        .rposition(|(first, _)| !options.replicated && *first <= replay.next_seq)
        .unwrap_or(0);
    let checkpointed = replay.next_seq;
    let mut expected: Option<u64> = None;
    let mut tail = None;
    let mut unfiled: Option<Unfiled> = None;
    for (i, (first_seq, path)) in files.iter().enumerate().skip(start) {
        let gap = match expected {
            Some(expected) => *first_seq != expected,
            None => *first_seq > checkpointed,
        };
        if gap {
            return Err(Error::corrupt(
                path,
                0,
                "WAL files do not continue each other's sequence",
            ));
        }
        let last = i + 1 == files.len();
        match wal::scan_file(path, *first_seq, last, replicated, next_index)? {
            Some(scanned) => {
                if let Some(at) = scanned.torn_at {
                    wal::zero_torn_tail(path, &scanned.bytes, at, !scanned.reused_end)?;
                }
                expected = Some(scanned.next_seq);
                tail = Some((*first_seq, path.clone(), scanned.end, scanned.next_seq));
                if replicated {
                    next_index = scanned.entries.last().map(|e| e.head.log_id.index + 1);
                    let unpurged = scanned
                        .entries
                        .iter()
                        .filter(|e| purged.is_none_or(|p| e.head.log_id.index > p));
                    placed.extend(unpurged.map(|e| Placed {
                        log_id: e.head.log_id,
                        file: *first_seq,
                        at: e.at,
                        end: e.end,
                        first_seq: e.head.first_seq,
                        records: e.head.records,
                    }));
                    continue;
                }
                let filed = match &unfiled {
                    None => replay.apply(&[(&scanned.bytes, &scanned.records)], dispatch),
                    Some(_) => Ok(()), // not tried: the groups must be filed in order
                };
                match filed {
                    Err(e) if e.is_disk_full() => {
                        let cause = e.disk_full_cause().unwrap_or_else(|| e.to_string());
                        let groups = Vec::new();
                        unfiled = Some(Unfiled { cause, groups });
                    }
                    result => result?,
                }
                if let Some(unfiled) = &mut unfiled {
                    unfiled.groups.push(CommittedGroup {
                        bytes: scanned.bytes,
                        records: scanned.records,
                        entry: None,
                        outcomes: Vec::new(),
                    });
                }
            }
            None => {
                // A torn header: the file was being created when the process died. Nothing in it was
                // acknowledged.
                fs::remove_file(path).map_err(Error::io(path))?;
                header::sync_dir(wal_dir)?;
            }
        }
    }
    // Never a seq a segment holds already (`Replay::highest_seq`): a new record with it would be taken
    // for filed and skipped.
    let next_seq = expected
        .unwrap_or(checkpointed)
        .max(checkpointed)
        .max(replay.highest_seq() + 1);
    let version = match replicated {
        true => header::REPLICATED_WAL_VERSION,
        false => header::WAL_FORMAT_VERSION,
    };
    let file = (options.wal_segment_bytes, version);
    // The log runs from the entry after the purged one, and holds every applied entry after it.
    if placed.is_empty() && applied.is_some_and(|a| purged.is_none_or(|p| a > p)) {
        let why = format!(
            "no Raft entry is left, where the applied ones after {purged:?} up to {applied:?} must be"
        );
        return Err(Error::corrupt(wal_dir, 0, why));
    }
    if let Some(first) = placed.first() {
        let expected = purged.map_or(first.log_id.index, |p| p + 1);
        let last = placed.last().map_or(0, |l| l.log_id.index);
        if first.log_id.index != expected || applied.is_some_and(|a| a > last) {
            let path = wal::wal_path(wal_dir, first.file);
            let why = format!(
                "the WAL's entries run from {} to {last}, where they must start at {expected} and reach the applied one ({applied:?})",
                first.log_id.index
            );
            return Err(Error::corrupt(path, first.at, why));
        }
    }
    let active = match tail {
        // A replicated log continues in its file, on the next block (`pad_tail` says why).
        Some((first_seq, path, end, tail_next)) if tail_next == next_seq && replicated => {
            let end = match end.is_multiple_of(frame::BLOCK as u64) {
                true => end,
                false => wal::pad_tail(&path, end)?,
            };
            ActiveWal::resume(wal_dir, file, (first_seq, &path), end)?
        }
        Some((first_seq, path, end, tail_next))
            if tail_next == next_seq && end.is_multiple_of(frame::BLOCK as u64) =>
        {
            ActiveWal::resume(wal_dir, file, (first_seq, &path), end)?
        }
        // No WAL yet; or its tail ends before the checkpoint (the end of the log was lost after it was
        // replayed), so seqs would not be dense; or a torn write was cut off mid-block, where an aligned
        // write cannot continue: start a fresh file.
        _ => ActiveWal::create(wal_dir, file, next_seq)?,
    };
    Ok((active, next_seq, unfiled, placed))
}
