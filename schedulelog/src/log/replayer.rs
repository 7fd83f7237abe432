//! The replayer thread: files the WAL writer's committed groups into their segments (through
//! [`Replay`]), publishes how far it got, and has checkpoints taken on a checkpointer thread of its own.
//!
//! Invariants: groups are applied in seq order, and none past one that failed; `Shared::filed` moves
//! only after a successful apply, and `Shared::replayed` is signalled with it. A full disk holds the
//! replayer up, not down: it retries with backoff while later groups wait in a backlog, bounded by
//! making the writer refuse new requests (`ScheduleLog::disk_full` says why meanwhile). Any other
//! error ends the thread, and its spawner (open.rs) poisons the log with it. At most one checkpoint job
//! is in flight.
//!
//! The sizes below trade throughput against memory and latency; tests shrink them so that every test
//! runs through the backlog and linger paths.

use super::{Options, Shared};
use crate::commit::CommittedGroup;
use crate::error::{Blocked, Error, Result};
use crate::replay::{CheckpointJob, Replay};
use crossbeam_channel::{Receiver, Sender};
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

/// While the replayer is held up by a full disk it keeps taking committed groups: they are durable in the
/// WAL already, and taking them lets the writer go on acknowledging appends while the WAL has room. Past
/// this many bytes of them the writer refuses new requests with `DiskFull` (never blocks on the channel).
#[cfg(not(test))]
const BACKLOG_LIMIT_BYTES: usize = 64 << 20;
/// Test groups are 4-8 KiB (a padded block or two): a limit a test can reach on purpose (40 groups)
/// and stays under otherwise (a dozen).
#[cfg(test)]
const BACKLOG_LIMIT_BYTES: usize = 128 << 10;

/// Queued groups are applied together up to this many bytes (see `Replay::apply`).
#[cfg(not(test))]
const APPLY_PASS_BYTES: usize = 32 << 20;
#[cfg(test)]
const APPLY_PASS_BYTES: usize = 16 << 10;

/// A pass that wrote to at least `LINGER_FROM_SEGMENTS` segments makes the next one wait up to `LINGER`
/// for more groups (until `LINGER_BYTES` of them), so that each segment gets fewer, larger writes: the
/// kernel's cost of a buffered write is mostly per call and per page touched, and a batch spread over a
/// month writes a few records to each of ~720 segments. On the realistic mix (issue 15), against no wait,
/// 20 ms raised ingest by ~12 % and 50 ms by ~20 % (the replayer's CPU down by a fifth and a third);
/// 100 ms did no better than 50. Messages of watched buckets (being delivered from) do not wait
/// (`Replay::apply_watched`), nor does a cancel of one; only `next_seq`, and so what waits for a record
/// to be filed (a lookup, a listing), does.
#[cfg(not(test))]
const LINGER_FROM_SEGMENTS: usize = 64;
#[cfg(not(test))]
const LINGER: Duration = Duration::from_millis(50);
/// Tests linger after every pass, briefly, so that every test runs through it.
#[cfg(test)]
const LINGER_FROM_SEGMENTS: usize = 1;
#[cfg(test)]
const LINGER: Duration = Duration::from_millis(3);
#[cfg(not(test))]
const LINGER_BYTES: usize = 32 << 20;
#[cfg(test)]
const LINGER_BYTES: usize = 8 << 10;

/// The wait before the first try after a full disk; it doubles with each failed try, up to `RETRY_MAX`.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Committed groups the replayer has taken but not applied, oldest first.
#[derive(Default)]
struct Backlog {
    groups: VecDeque<CommittedGroup>,
    bytes: usize,
}

impl Backlog {
    fn push(&mut self, group: CommittedGroup) {
        self.bytes += group.bytes.len();
        self.groups.push_back(group);
    }

    fn pop(&mut self) -> Option<CommittedGroup> {
        let group = self.groups.pop_front()?;
        self.bytes -= group.bytes.len();
        Some(group)
    }
}

/// Waits up to `LINGER` for more groups while the backlog is below `LINGER_BYTES`, filing the messages of
/// watched buckets at once; stops early for a cancel of one, or when the WAL writer is gone. The lock is
/// not held while waiting. Returns the lock again, and whether the writer is still there.
fn linger<'a>(
    shared: &'a Shared,
    mut replay: MutexGuard<'a, Replay>,
    groups: &Receiver<CommittedGroup>,
    backlog: &mut Backlog,
    mut open: bool,
) -> Result<(MutexGuard<'a, Replay>, bool)> {
    let deadline = Instant::now() + LINGER;
    // The groups whose watched messages are filed, and the watched buckets they were filed for: only a
    // change of those makes the groups before worth another look (`apply_watched` says why).
    let mut filed = 0;
    let mut watched = replay.watched.clone();
    while open && !backlog.groups.is_empty() && backlog.bytes < LINGER_BYTES {
        if replay.watched != watched {
            (filed, watched) = (0, replay.watched.clone());
        }
        let pass: Vec<_> = backlog
            .groups
            .iter()
            .skip(filed)
            .map(|g| (&g.bytes[..], &g.records[..]))
            .collect();
        filed = backlog.groups.len();
        match replay.apply_watched(&pass) {
            Ok(false) => {}
            Ok(true) => break,
            // The apply that follows meets it again and is held up as usual.
            Err(e) if e.is_disk_full() => break,
            Err(e) => return Err(e),
        }
        drop(replay);
        let got = groups.recv_deadline(deadline);
        replay = shared.replay();
        match got {
            Ok(group) => backlog.push(group),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => break,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => open = false,
        }
    }
    Ok((replay, open))
}

/// When the replayer tries again the work a full disk held up.
struct Retry {
    at: Instant,
    wait: Duration,
}

/// The replayer thread: applies committed groups in order and checkpoints. A full disk holds it up, not
/// down: the group (or checkpoint) that met it is tried again with backoff, later groups wait behind it
/// in a bounded backlog, and `ScheduleLog::disk_full` says why. Any other error ends it (and poisons the
/// log). On shutdown while held up it gives up at once: what it has not applied is in the WAL.
///
/// Checkpoints are made by a checkpointer thread of its own (replay.rs): the replayer takes a job under
/// its lock, hands it over, goes on applying groups, and records the job's result when it comes back.
/// One job at a time.
/// `unfiled`: groups of the WAL a full disk kept the open from filing, filed first.
pub(super) fn run_replayer(
    shared: &Shared,
    groups: &Receiver<CommittedGroup>,
    recycle: Sender<Vec<u8>>,
    options: &Options,
    unfiled: Vec<CommittedGroup>,
) -> Result<()> {
    std::thread::scope(|scope| {
        let (jobs, jobs_rx) = crossbeam_channel::bounded::<CheckpointJob>(1);
        let (done_tx, done) = crossbeam_channel::bounded(1);
        std::thread::Builder::new()
            .name("delayd-checkpoint".into())
            .spawn_scoped(scope, move || {
                for job in jobs_rx {
                    let stored = job.run();
                    if done_tx.send((job, stored)).is_err() {
                        break;
                    }
                }
            })
            .map_err(Error::io("thread"))?;
        let result = replay_loop(shared, groups, recycle, options, &jobs, &done, unfiled);
        // The checkpointer finishes the job it has (the scope waits for it) and stops.
        drop(jobs);
        result
    })
}

fn checkpointer_stopped() -> Error {
    Error::io("checkpointer")(io::Error::other("the checkpointer thread stopped"))
}

/// The replayer's loop (see [`run_replayer`]); `jobs` goes to the checkpointer, `done` comes back.
fn replay_loop(
    shared: &Shared,
    groups: &Receiver<CommittedGroup>,
    recycle: Sender<Vec<u8>>,
    options: &Options,
    jobs: &Sender<CheckpointJob>,
    done: &Receiver<(CheckpointJob, Result<bool>)>,
    unfiled: Vec<CommittedGroup>,
) -> Result<()> {
    let mut in_flight = false;
    let mut backlog = Backlog::default();
    // The open marked the disk full for what it left unfiled: filing it is this loop's first retry, and
    // the one that clears the mark once it works.
    let mut retry = (!unfiled.is_empty()).then(|| Retry {
        at: Instant::now(),
        wait: RETRY_FIRST,
    });
    for group in unfiled {
        backlog.push(group);
    }
    // After a stall, a checkpoint at once rather than at the next interval: it deletes the WAL files
    // that piled up, which is space the disk is short of.
    let mut checkpoint_soon = false;
    let mut last_checkpoint = Instant::now();
    let mut bytes_since = 0u64;
    let mut open = true;
    loop {
        let mut finished = None;
        match &retry {
            None if backlog.groups.is_empty() => {
                crossbeam_channel::select! {
                    recv(groups) -> group => match group {
                        Ok(group) => backlog.push(group),
                        Err(_) => open = false,
                    },
                    recv(done) -> job => finished = Some(job.map_err(|_| checkpointer_stopped())?),
                    default(options.checkpoint_interval) => {}
                }
            }
            None => {}
            // The retried checkpoint is on its way: its answer decides whether the disk is still full.
            // Meanwhile groups are taken and applied as they come, one event a pass (a held-up apply is
            // so tried again at most once per group the writer sends, and each failure doubles the
            // wait before a pass with no group).
            Some(retry) if in_flight => {
                let wait = retry.at.saturating_duration_since(Instant::now());
                let mut got = None;
                if !open {
                    finished = Some(done.recv().map_err(|_| checkpointer_stopped())?);
                } else if wait.is_zero() {
                    crossbeam_channel::select! {
                        recv(groups) -> group => got = Some(group),
                        recv(done) -> job => finished = Some(job.map_err(|_| checkpointer_stopped())?),
                    }
                } else {
                    crossbeam_channel::select! {
                        recv(groups) -> group => got = Some(group),
                        recv(done) -> job => finished = Some(job.map_err(|_| checkpointer_stopped())?),
                        default(wait) => {}
                    }
                }
                match got {
                    Some(Ok(group)) => {
                        backlog.push(group);
                        shared
                            .disk_full
                            .set_backlog_full(backlog.bytes >= BACKLOG_LIMIT_BYTES);
                    }
                    Some(Err(_)) => open = false,
                    None => {}
                }
            }
            Some(retry) => {
                // No bound here: past BACKLOG_LIMIT_BYTES the writer refuses new requests, so only the
                // groups it committed before it saw that still come, and none of them may block it.
                while open {
                    match groups.recv_deadline(retry.at) {
                        Ok(group) => {
                            backlog.push(group);
                            shared
                                .disk_full
                                .set_backlog_full(backlog.bytes >= BACKLOG_LIMIT_BYTES);
                        }
                        Err(crossbeam_channel::RecvTimeoutError::Timeout) => break,
                        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => open = false,
                    }
                }
                if open {
                    std::thread::sleep(retry.at.saturating_duration_since(Instant::now()));
                }
            }
        }

        let mut replay = shared.replay();
        let mut held_up = None;
        if retry.is_none() && replay.spread() >= LINGER_FROM_SEGMENTS {
            (replay, open) = linger(shared, replay, groups, &mut backlog, open)?;
        }
        if let Some((job, stored)) = finished.or_else(|| done.try_recv().ok()) {
            in_flight = false;
            match replay.finish_checkpoint(&job, stored) {
                Ok(()) => checkpoint_soon = false,
                Err(e) if e.is_disk_full() => held_up = Some(e),
                Err(e) => return Err(e),
            }
        }
        if retry.is_none() {
            // Groups that queued up meanwhile are applied together (`Replay::apply` says why).
            while backlog.bytes < APPLY_PASS_BYTES {
                match groups.try_recv() {
                    Ok(group) => backlog.push(group),
                    Err(_) => break,
                }
            }
        }
        while !backlog.groups.is_empty() {
            let mut pass = Vec::new();
            let mut pass_bytes = 0;
            for group in &backlog.groups {
                if !pass.is_empty() && pass_bytes + group.bytes.len() > APPLY_PASS_BYTES {
                    break;
                }
                pass_bytes += group.bytes.len();
                pass.push((&group.bytes[..], &group.records[..]));
            }
            let taken = pass.len();
            match replay.apply(&pass, &shared.dispatch) {
                Ok(()) => {
                    shared.filed.store(replay.next_seq, Ordering::Release);
                    shared.replayed.notify_all();
                    // The pass's entries' outcomes go to the dispatch logs once their records are
                    // filed (one append, one sync for them all), and before the entries count as
                    // applied. A failure leaves the whole pass to be tried again: its records are then
                    // skipped as filed.
                    let outcomes: Vec<_> = backlog
                        .groups
                        .iter()
                        .take(taken)
                        .flat_map(|g| g.outcomes.iter().cloned())
                        .collect();
                    if !outcomes.is_empty() {
                        match shared.dispatch.append(&outcomes) {
                            Ok(()) => {}
                            Err(e) if e.is_disk_full() => {
                                held_up = Some(e);
                                break;
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    for _ in 0..taken {
                        let group = backlog.pop().expect("applied, so present");
                        bytes_since += group.bytes.len() as u64;
                        if let Some((log_id, membership)) = group.entry {
                            replay.entry_applied(log_id, membership);
                            continue; // an entry's bytes are its own, not a writer's buffer
                        }
                        let _ = recycle.try_send(group.bytes);
                    }
                }
                Err(e) if e.is_disk_full() => {
                    held_up = Some(e);
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        let due = checkpoint_soon
            || last_checkpoint.elapsed() >= options.checkpoint_interval
            || bytes_since >= options.checkpoint_bytes;
        if held_up.is_none() && due && !in_flight {
            if replay.checkpointed_all() {
                checkpoint_soon = false;
                // Nothing new to checkpoint, but a WAL file may have become deletable since the last
                // checkpoint: the writer starts its next file only after it (a rollover a full disk held
                // up), and on a quiet node no record would come to trigger another. That space may be
                // what the rest of the node is waiting for. A failure is retried at the next interval.
                let _ = replay.delete_replayed_wal();
                // Idle: a WAL spare goes back to the file system.
                let _ = replay.shed_spare();
            } else {
                let job = replay.start_checkpoint()?;
                jobs.send(job).map_err(|_| checkpointer_stopped())?;
                in_flight = true;
                last_checkpoint = Instant::now();
                bytes_since = 0;
            }
        }
        drop(replay);

        shared
            .disk_full
            .set_backlog_full(held_up.is_some() && backlog.bytes >= BACKLOG_LIMIT_BYTES);
        match held_up {
            // A retried checkpoint was handed over: the disk counts as full until it succeeded.
            None if in_flight && retry.is_some() => {}
            None => {
                if retry.take().is_some() {
                    shared.disk_full.clear(Blocked::Replayer);
                }
            }
            Some(e) => {
                if !open || shared.closing.load(Ordering::SeqCst) {
                    #[cfg(test)]
                    if shared.crashed.load(Ordering::SeqCst) {
                        return Ok(());
                    }
                    return Err(e);
                }
                let cause = e.disk_full_cause().unwrap_or_else(|| e.to_string());
                shared.disk_full.set(Blocked::Replayer, cause);
                let wait = retry
                    .as_ref()
                    .map_or(RETRY_FIRST, |r| (r.wait * 2).min(RETRY_MAX));
                retry = Some(Retry {
                    at: Instant::now() + wait,
                    wait,
                });
                checkpoint_soon = true;
            }
        }
        if !open && backlog.groups.is_empty() {
            break;
        }
    }
    if in_flight {
        if let Ok((job, stored)) = done.recv() {
            // Its error, if any, is met again by the final checkpoint below.
            let _ = shared.replay().finish_checkpoint(&job, stored);
        }
    }
    #[cfg(test)]
    if shared.crashed.load(Ordering::SeqCst) {
        return Ok(());
    }
    let mut replay = shared.replay();
    replay.checkpoint()
}
