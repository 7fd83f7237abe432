//! Group commit: the WAL writer thread and the acknowledgements it hands out.
//!
//! Submitters send requests through a `crossbeam-channel`. The writer takes the first request, drains
//! whatever else is queued (up to `GROUP_TARGET_BYTES`), assigns seqs, writes the group with one `pwrite`,
//! calls `fdatasync` once and only then answers every submitter of the group and hands the group to the
//! replayer. With [`FsyncPolicy::Interval`] it keeps collecting until the interval has passed since the
//! group's first request: fewer syncs, later acks, the same durability on ack.
//!
//! Invariants:
//! - No acknowledgement before the `fdatasync` that covers the record has returned.
//! - At most `frame::UNSYNCED_LIMIT` bytes are written past the last sync (the tail policy relies on it).
//! - Every write is padded to a block boundary (wal.rs explains why).
//! - A request's frames never straddle a failed rollover: the writer rolls before a request that does not
//!   fit, so "disk full" fails that request cleanly. Only a request larger than a whole WAL file can
//!   straddle files, and a failure there poisons the log.
//! - After a failed write or sync the log is poisoned: every later request fails with
//!   [`AppendError::Poisoned`], nothing is retried (a failed fsync may have dropped dirty pages for good).
//!   The cause carries the file and the OS error. WAL files are preallocated, so a full disk cannot fail
//!   a WAL write; if one does anyway, it poisons like any other write error.
//! - A poison cause published by someone else (the replayer's error, a failed segment sync) is adopted
//!   before the next request, so requests fail with the real cause, not with "the replayer stopped".
//! - A full disk at rollover is a state, not a failure: it fails the request that needed the new file
//!   with [`AppendError::DiskFull`] and is reported through `ScheduleLog::disk_full`. For
//!   `ROLL_RETRY_MS` after it, a request that needs a rollover fails the same way at once, without
//!   trying: preparing a file (allocating it, or zero-filling it where the file system cannot) in this
//!   thread, which every queued request would wait for. While idle in that state the writer tries the
//!   rollover itself once a second, so that the state clears once space is freed even if no request
//!   comes. A retry first checks (`statvfs`) that a whole file fits, rather than preparing one until
//!   `ENOSPC` each time. The first rollover that succeeds clears the state.

use crate::bucket::SegmentMinutes;
use crate::clock::Clock;
use crate::entry::{
    entry_frame_bytes, seal_message, Entry, EntryHead, EntryKind, EntryLog, EntryPayload, LogId,
    Placed, PlacedOutcome, RecordCount,
};
use crate::error::{AppendError, Blocked, DiskFullReport};
use crate::frame::{self, UNSYNCED_LIMIT};
use crate::id::{Location, MessageId};
use crate::record::{Cancel, EncodedMessage, CANCEL_PAYLOAD_LEN};
use crate::wal::{ActiveWal, RollError, WalRecord};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

#[cfg(test)]
use crate::fault::Fault;

/// A group stops taking queued requests past this many bytes (one request may take it over).
#[cfg(not(test))]
const GROUP_TARGET_BYTES: usize = 4 << 20;
#[cfg(test)]
const GROUP_TARGET_BYTES: usize = 2 << 10;

/// After a rollover found the disk full, rollovers fail at once for this long (by the log's clock).
const ROLL_RETRY_MS: i64 = 1_000;

/// A failure in the middle of a request is a poisoning one, whatever its cause.
fn mid_request(error: AppendError) -> AppendError {
    match error {
        AppendError::DiskFull => AppendError::Poisoned(
            "disk full in the middle of a request larger than a WAL file".into(),
        ),
        other => other,
    }
}

/// The most bytes `len` bytes of frames take once padded to a block boundary.
fn padded(len: u64) -> u64 {
    len + (frame::BLOCK + frame::HEADER_LEN) as u64
}

/// When an appended record is durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FsyncPolicy {
    /// Sync every group as soon as it is written (the default).
    #[default]
    Always,
    /// Sync at most once per interval; a request is acknowledged after the sync that follows it.
    Interval(Duration),
}

/// A message made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    pub id: MessageId,
    /// Where this attempt is filed (for a first attempt, `id.first`).
    pub location: Location,
    pub deliver_at_ms: i64,
    pub created_at_ms: i64,
}

/// The answer to a submitted request, to wait for synchronously ([`Ack::wait`]) or to `.await`.
#[derive(Debug)]
#[must_use = "an append is only known durable once its Ack resolves"]
pub struct Ack<T> {
    rx: oneshot::Receiver<Result<T, AppendError>>,
}

impl<T> Ack<T> {
    /// Blocks until the group holding the request is durable (or failed).
    pub fn wait(self) -> Result<T, AppendError> {
        self.rx.recv().unwrap_or(Err(AppendError::Closed))
    }
}

impl<T> IntoFuture for Ack<T> {
    type Output = Result<T, AppendError>;
    type IntoFuture = AckFuture<T>;

    fn into_future(self) -> AckFuture<T> {
        AckFuture {
            rx: self.rx.into_future(),
        }
    }
}

/// An [`Ack`] being awaited.
#[derive(Debug)]
pub struct AckFuture<T> {
    rx: oneshot::AsyncReceiver<Result<T, AppendError>>,
}

impl<T> Future for AckFuture<T> {
    type Output = Result<T, AppendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.rx)
            .poll(cx)
            .map(|r| r.unwrap_or(Err(AppendError::Closed)))
    }
}

pub(crate) enum Request {
    Append {
        messages: Vec<EncodedMessage>,
        reply: oneshot::Sender<Result<Vec<Appended>, AppendError>>,
    },
    Cancel {
        target: Location,
        reply: oneshot::Sender<Result<u64, AppendError>>,
    },
    /// Raft entries to make durable (a replicated log), handed in to its `EntryLog` already.
    Entries {
        entries: Vec<Arc<Entry>>,
        /// How many records each carries (`EntryLog::hand_in` counted them).
        records: Vec<RecordCount>,
        reply: oneshot::Sender<Result<(), AppendError>>,
    },
    /// Outcomes to record through Raft (a replicated log; never reaches the writer).
    Outcomes {
        outcomes: Vec<PlacedOutcome>,
        reply: oneshot::Sender<Result<(), AppendError>>,
    },
    /// An application payload to propose, with outcomes that go in the same entry (a replicated log;
    /// never reaches the writer).
    App {
        payload: Vec<u8>,
        outcomes: Vec<PlacedOutcome>,
        reply: oneshot::Sender<Result<(), AppendError>>,
    },
    /// Cuts a replicated log's entries from this index on.
    Truncate {
        from: u64,
        reply: oneshot::Sender<Result<(), AppendError>>,
    },
    /// Makes the next sync or rollover fail, for tests of the failure paths.
    #[cfg(test)]
    InjectFault(Fault),
}

impl Request {
    pub(crate) fn append(messages: Vec<EncodedMessage>) -> (Request, Ack<Vec<Appended>>) {
        let (reply, rx) = oneshot::channel();
        (Request::Append { messages, reply }, Ack { rx })
    }

    pub(crate) fn cancel(target: Location) -> (Request, Ack<u64>) {
        let (reply, rx) = oneshot::channel();
        (Request::Cancel { target, reply }, Ack { rx })
    }

    pub(crate) fn entries(
        entries: Vec<Arc<Entry>>,
        records: Vec<RecordCount>,
    ) -> (Request, Ack<()>) {
        let (reply, rx) = oneshot::channel();
        let request = Request::Entries {
            entries,
            records,
            reply,
        };
        (request, Ack { rx })
    }

    pub(crate) fn outcomes(outcomes: Vec<PlacedOutcome>) -> (Request, Ack<()>) {
        let (reply, rx) = oneshot::channel();
        (Request::Outcomes { outcomes, reply }, Ack { rx })
    }

    pub(crate) fn app(payload: Vec<u8>, outcomes: Vec<PlacedOutcome>) -> (Request, Ack<()>) {
        let (reply, rx) = oneshot::channel();
        let request = Request::App {
            payload,
            outcomes,
            reply,
        };
        (request, Ack { rx })
    }

    /// Whether a replicated log forms it into an entry (through Raft) rather than its writer taking it.
    pub(crate) fn is_proposal(&self) -> bool {
        matches!(
            self,
            Request::Append { .. }
                | Request::Cancel { .. }
                | Request::Outcomes { .. }
                | Request::App { .. }
        )
    }

    pub(crate) fn truncate(from: u64) -> (Request, Ack<()>) {
        let (reply, rx) = oneshot::channel();
        (Request::Truncate { from, reply }, Ack { rx })
    }

    fn frame_bytes(&self) -> usize {
        match self {
            Request::Append { messages, .. } => messages.iter().map(|m| m.frame.len()).sum(),
            Request::Cancel { .. } => frame::HEADER_LEN + CANCEL_PAYLOAD_LEN,
            // Entries make room for themselves, one at a time.
            Request::Entries { .. }
            | Request::Truncate { .. }
            | Request::Outcomes { .. }
            | Request::App { .. } => 0,
            #[cfg(test)]
            Request::InjectFault(_) => 0,
        }
    }

    pub(crate) fn fail(self, error: AppendError) {
        match self {
            Request::Append { reply, .. } => drop(reply.send(Err(error))),
            Request::Cancel { reply, .. } => drop(reply.send(Err(error))),
            Request::Entries { reply, .. }
            | Request::Truncate { reply, .. }
            | Request::Outcomes { reply, .. }
            | Request::App { reply, .. } => drop(reply.send(Err(error))),
            #[cfg(test)]
            Request::InjectFault(_) => {}
        }
    }
}

/// Records handed from the writer to the replayer once durable.
#[derive(Debug)]
pub(crate) struct CommittedGroup {
    pub bytes: Vec<u8>,
    pub records: Vec<WalRecord>,
    /// The Raft entry it is (a replicated log), and the member set of a membership entry.
    pub entry: Option<(LogId, Option<Vec<u8>>)>,
    /// The outcomes the entry carries, for the dispatch logs once its records are filed.
    pub outcomes: Vec<PlacedOutcome>,
}

pub(crate) enum Answer {
    Append(
        oneshot::Sender<Result<Vec<Appended>, AppendError>>,
        Vec<Appended>,
    ),
    Cancel(oneshot::Sender<Result<u64, AppendError>>, u64),
    Done(oneshot::Sender<Result<(), AppendError>>),
}

impl Answer {
    pub(crate) fn send(self, error: Option<&AppendError>) {
        match (self, error) {
            (Answer::Append(reply, appended), None) => drop(reply.send(Ok(appended))),
            (Answer::Cancel(reply, seq), None) => drop(reply.send(Ok(seq))),
            (Answer::Done(reply), None) => drop(reply.send(Ok(()))),
            (Answer::Append(reply, _), Some(e)) => drop(reply.send(Err(e.clone()))),
            (Answer::Cancel(reply, _), Some(e)) => drop(reply.send(Err(e.clone()))),
            (Answer::Done(reply), Some(e)) => drop(reply.send(Err(e.clone()))),
        }
    }
}

/// The group being built: its bytes (all of them, for the replayer), how many were written to the file
/// already, and who to answer. The first `written` bytes of a fresh group are a lead-in that puts the
/// first frame on a block-aligned address, so that `O_DIRECT` can write straight from this buffer.
#[derive(Default)]
struct Group {
    bytes: Vec<u8>,
    written: usize,
    records: Vec<WalRecord>,
    answers: Vec<Answer>,
    started: Option<Instant>,
}

pub(crate) struct Writer {
    pub wal: ActiveWal,
    pub next_seq: u64,
    pub clock: Arc<dyn Clock>,
    pub width: SegmentMinutes,
    pub policy: FsyncPolicy,
    /// Every seq below this is durable in the WAL (readers use it to tell "not yet replayed" from "never
    /// existed"); in a replicated log, applied.
    pub committed: Arc<AtomicU64>,
    pub replay: Sender<CommittedGroup>,
    /// Group buffers the replayer is done with, for reuse: a fresh multi-megabyte buffer per group costs
    /// page faults and zeroing on every commit.
    pub recycled: Receiver<Vec<u8>>,
    pub poisoned: Option<String>,
    /// Where the poison cause is published for health checks (and by the replayer, for the writer).
    pub poison_report: Arc<OnceLock<String>>,
    /// Where a rollover that found the disk full says so.
    pub disk_full: Arc<DiskFullReport>,
    /// When (by `clock`) the last rollover found the disk full, until one succeeds.
    pub roll_failed_at_ms: Option<i64>,
    /// A replicated log's entries: it takes entries and truncations instead of appends and cancels.
    pub entry_log: Option<Arc<EntryLog>>,
    /// The index the next entry must have (a replicated log).
    pub next_index: u64,
    #[cfg(test)]
    pub fault: Option<Fault>,
}

impl Writer {
    /// Runs until every submitter is gone, then commits what is pending and returns.
    pub(crate) fn run(mut self, requests: Receiver<Request>) {
        let mut group = self.fresh_group();
        loop {
            let request = match (self.policy, group.started) {
                (FsyncPolicy::Interval(every), Some(started)) => {
                    match requests.recv_deadline(started + every) {
                        Ok(request) => request,
                        Err(RecvTimeoutError::Timeout) => {
                            self.commit(&mut group);
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
                // Nothing pending (the group is committed), but a rollover found the disk full.
                _ if self.roll_failed_at_ms.is_some() => {
                    match requests.recv_timeout(Duration::from_millis(ROLL_RETRY_MS as u64)) {
                        Ok(request) => request,
                        Err(RecvTimeoutError::Timeout) => {
                            self.retry_roll();
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
                _ => match requests.recv() {
                    Ok(request) => request,
                    Err(_) => break,
                },
            };
            self.add(request, &mut group);
            while group.bytes.len() < GROUP_TARGET_BYTES {
                match requests.try_recv() {
                    Ok(request) => self.add(request, &mut group),
                    Err(_) => break,
                }
            }
            let due = match (self.policy, group.started) {
                (FsyncPolicy::Always, _) => true,
                (FsyncPolicy::Interval(every), Some(started)) => started.elapsed() >= every,
                (FsyncPolicy::Interval(_), None) => false,
            };
            if due || group.bytes.len() >= UNSYNCED_LIMIT / 2 {
                self.commit(&mut group);
            }
        }
        self.commit(&mut group);
    }

    fn add(&mut self, request: Request, group: &mut Group) {
        self.adopt_reported_poison();
        if let Some(cause) = &self.poisoned {
            return request.fail(AppendError::Poisoned(cause.clone()));
        }
        #[cfg(test)]
        if let Request::InjectFault(fault) = request {
            self.fault = Some(fault);
            return;
        }
        let request = match request {
            Request::Entries {
                entries,
                records,
                reply,
            } => return self.add_entries(&entries, &records, reply, group),
            Request::Truncate { from, reply } => {
                // What is queued before it is made durable (and answered) first.
                self.commit(group);
                let result = self.truncate(from);
                if let Err(e) = &result {
                    self.poison(e);
                }
                return drop(reply.send(result));
            }
            request if self.entry_log.is_some() => {
                return request.fail(AppendError::Refused(
                    "this log is replicated: messages come as Raft entries".into(),
                ));
            }
            request => request,
        };
        if self.disk_full.backlog_full() {
            // Nothing is written: what is acknowledged already waits in the WAL for the replayer.
            return request.fail(AppendError::DiskFull);
        }
        // Roll over before a request that does not fit, so that a full disk fails it cleanly.
        let size = request.frame_bytes() as u64;
        let unwritten = (group.bytes.len() - group.written) as u64;
        if padded(size + unwritten) > self.wal.remaining()
            && !(self.wal.is_empty() && unwritten == 0)
        {
            if let Err(e) = self.write_and_sync(group).and_then(|()| self.roll()) {
                self.poison(&e);
                return request.fail(e);
            }
        }
        group.started.get_or_insert_with(Instant::now);
        let created_at_ms = self.clock.now_ms();
        match request {
            Request::Append { messages, reply } => {
                let mut appended = Vec::with_capacity(messages.len());
                for message in &messages {
                    if let Err(e) = self.make_room(message.frame.len(), group) {
                        // Part of this request may be written already: the log's state no longer matches
                        // what its submitters were told, even for a full disk, so nothing more is taken.
                        let e = mid_request(e);
                        self.poison(&e);
                        return drop(reply.send(Err(e)));
                    }
                    let (record, one) = seal_message(
                        &mut group.bytes,
                        message,
                        self.next_seq,
                        created_at_ms,
                        self.width,
                    );
                    self.next_seq += 1;
                    group.records.push(record);
                    appended.push(one);
                }
                group.answers.push(Answer::Append(reply, appended));
            }
            Request::Cancel { target, reply } => {
                if let Err(e) = self.make_room(frame::HEADER_LEN + CANCEL_PAYLOAD_LEN, group) {
                    let e = mid_request(e);
                    self.poison(&e);
                    return drop(reply.send(Err(e)));
                }
                let cancel = Cancel {
                    seq: self.next_seq,
                    created_at_ms,
                    target,
                };
                self.next_seq += 1;
                cancel.encode_frame(&mut group.bytes);
                group.records.push(WalRecord::Cancel(cancel));
                group.answers.push(Answer::Cancel(reply, cancel.seq));
            }
            // Taken above, or (outcomes, application payloads) never sent to the writer.
            Request::Entries { .. }
            | Request::Truncate { .. }
            | Request::Outcomes { .. }
            | Request::App { .. } => {}
            #[cfg(test)]
            Request::InjectFault(_) => {} // taken above
        }
    }

    /// Adds Raft entries to the group, each on a block boundary of its own and within one WAL file, or
    /// refuses them all (nothing written) when they do not continue the log or one cannot fit a file.
    fn add_entries(
        &mut self,
        entries: &[Arc<Entry>],
        counts: &[RecordCount],
        reply: oneshot::Sender<Result<(), AppendError>>,
        group: &mut Group,
    ) {
        let Some(log) = self.entry_log.clone() else {
            let why = "this log is a single node's: it takes no Raft entries";
            return drop(reply.send(Err(AppendError::Refused(why.into()))));
        };
        // `EntryLog::hand_in` checked them against the log as handed in, which is what the writer has
        // placed plus what is queued before them: a mismatch here means the two views of the log
        // parted, and nothing more may be written.
        let mismatch = (self.next_index..).zip(entries).find_map(|(index, entry)| {
            (entry.log_id.index != index).then(|| {
                format!(
                    "entry {} reached the WAL writer where entry {index} was due",
                    entry.log_id.index
                )
            })
        });
        // Each entry's first record (a message or a cancel: outcomes take no seq) continues the seqs
        // of the ones before it.
        let mut due = self.next_seq;
        let mismatch = mismatch.or_else(|| {
            entries.iter().zip(counts).find_map(|(entry, records)| {
                let first = match &entry.payload {
                    EntryPayload::Normal(frames) if records.seqs > 0 => first_record_seq(frames),
                    _ => None,
                };
                let why = first.filter(|&seq| seq != due).map(|seq| {
                    format!("records from seq {seq} reached the WAL writer where seq {due} was due")
                });
                due += u64::from(records.seqs);
                why
            })
        });
        if let Some(why) = mismatch {
            let e = AppendError::Poisoned(why);
            self.poison(&e);
            return drop(reply.send(Err(e)));
        }
        group.started.get_or_insert_with(Instant::now);
        for (entry, &records) in entries.iter().zip(counts) {
            let bytes = entry_frame_bytes(entry);
            frame::pad_to_block(&mut group.bytes, group.written);
            if let Err(e) = self.make_room_for_entry(frame::padded_len(bytes), group) {
                let e = mid_request(e);
                self.poison(&e);
                return drop(reply.send(Err(e)));
            }
            let at = self.wal.position() + (group.bytes.len() - group.written) as u64;
            let (kind, membership, frames): (_, &[u8], &[u8]) = match &entry.payload {
                EntryPayload::Blank => (EntryKind::Blank, &[], &[]),
                EntryPayload::Normal(frames) => (EntryKind::Normal, &[], frames),
                EntryPayload::Membership(m) => (EntryKind::Membership, m, &[]),
            };
            let head = EntryHead {
                log_id: entry.log_id,
                first_seq: self.next_seq,
                records: records.frames,
                kind,
            };
            head.encode_frame(membership, &mut group.bytes);
            group.bytes.extend_from_slice(frames);
            log.place(Placed {
                log_id: entry.log_id,
                file: self.wal.first_seq(),
                at,
                end: at + frame::padded_len(bytes) as u64,
                first_seq: self.next_seq,
                records: records.frames,
            });
            self.next_seq += u64::from(records.seqs);
            self.next_index = entry.log_id.index + 1;
        }
        group.answers.push(Answer::Done(reply));
    }

    /// Cuts the log's entries from `from` on: later WAL files deleted, the file holding `from` zeroed
    /// back to front from its end to the entry (a crash midway leaves a shorter tail of the same
    /// entries, never a hole), and appends continue there.
    fn truncate(&mut self, from: u64) -> Result<(), AppendError> {
        let Some(log) = self.entry_log.clone() else {
            let why = "this log is a single node's: it has no Raft entries";
            return Err(AppendError::Refused(why.into()));
        };
        if let Some(cause) = &self.poisoned {
            return Err(AppendError::Poisoned(cause.clone()));
        }
        if from >= self.next_index {
            return Ok(());
        }
        if let Some(applied) = log.applied_index().filter(|&a| from <= a) {
            return Err(AppendError::Refused(format!(
                "entry {from} is applied (up to {applied}) and cannot be cut off"
            )));
        }
        let Some(cut) = log.placed_at(from) else {
            return Err(AppendError::Refused(format!(
                "entry {from} is not in the log (purged)"
            )));
        };
        let end = match cut.file == self.wal.first_seq() {
            true => self.wal.position(),
            false => log
                .in_file(cut.file)
                .iter()
                .map(|p| p.end)
                .max()
                .unwrap_or(cut.end),
        };
        // Out of the log's map before the file is cut back: a read that located an entry before this
        // and finds its bytes gone sees it is no longer placed (read_entries), not a corrupt log.
        if log.cut(from).is_none() {
            return Err(AppendError::Refused(format!(
                "entry {from} could not be cut off (applied, or not in the log)"
            )));
        }
        self.wal.cut_back(cut.file, cut.at, end).map_err(|e| {
            AppendError::Poisoned(format!("truncating the WAL from entry {from} failed: {e}"))
        })?;
        self.next_seq = cut.first_seq;
        self.next_index = from;
        Ok(())
    }

    /// Before adding a frame of `len` bytes: keeps the unsynced bytes under the limit, and rolls over
    /// mid-request when a request is larger than what is left of the file.
    fn make_room(&mut self, len: usize, group: &mut Group) -> Result<(), AppendError> {
        let unwritten = (group.bytes.len() - group.written) as u64;
        if padded(unwritten + len as u64) > UNSYNCED_LIMIT as u64 {
            self.write_and_sync(group)?;
        }
        let unwritten = (group.bytes.len() - group.written) as u64;
        if padded(unwritten + len as u64) > self.wal.remaining() {
            self.write_and_sync(group)?;
            self.roll()?;
        }
        Ok(())
    }

    /// Before adding an entry that takes `len` bytes once padded, to a group whose unwritten bytes end
    /// on a block boundary: writes them first when the unsynced window would overflow, and rolls over
    /// when the entry does not fit the file. Unless the file is empty, or holds no record (files are
    /// named by their first seq, which the next file would share): it then grows past its size.
    fn make_room_for_entry(&mut self, len: usize, group: &mut Group) -> Result<(), AppendError> {
        let unwritten = group.bytes.len() - group.written;
        if unwritten + len > UNSYNCED_LIMIT {
            self.write_and_sync(group)?;
        }
        let unwritten = group.bytes.len() - group.written;
        let fits = (unwritten + len) as u64 <= self.wal.remaining();
        if !fits && self.wal.first_seq() < self.next_seq && !(self.wal.is_empty() && unwritten == 0)
        {
            self.write_and_sync(group)?;
            self.roll()?;
        }
        Ok(())
    }

    /// Switches to a new WAL file starting at the next seq.
    fn roll(&mut self) -> Result<(), AppendError> {
        let now_ms = self.clock.now_ms();
        if let Some(failed_at_ms) = self.roll_failed_at_ms {
            // A clock that went back ends the wait rather than stretching it.
            if (failed_at_ms..failed_at_ms.saturating_add(ROLL_RETRY_MS)).contains(&now_ms) {
                return Err(AppendError::DiskFull);
            }
        }
        #[cfg(test)]
        let injected = self
            .fault
            .take_if(|f| *f == Fault::DiskFullAtRoll)
            .map(|_| {
                let next = self.wal.path().with_file_name("next.tmp");
                RollError::Prepare(crate::Error::io(next)(crate::fault::no_space()))
            });
        #[cfg(not(test))]
        let injected = None;
        let rolled = match injected {
            Some(e) => Err(e),
            // A retry first asks the file system whether the file can fit at all.
            None if self.roll_failed_at_ms.is_some() => self
                .wal
                .check_room_for_next()
                .map_err(RollError::Prepare)
                .and_then(|()| self.wal.roll(self.next_seq)),
            None => self.wal.roll(self.next_seq),
        };
        match rolled {
            Ok(()) => {
                if self.roll_failed_at_ms.take().is_some() {
                    self.disk_full.clear(Blocked::WalRoll);
                }
                Ok(())
            }
            Err(RollError::Prepare(e)) if e.is_disk_full() => {
                self.roll_failed_at_ms = Some(now_ms);
                let cause = e.disk_full_cause().unwrap_or_else(|| e.to_string());
                self.disk_full.set(Blocked::WalRoll, cause);
                Err(AppendError::DiskFull)
            }
            Err(RollError::Prepare(e)) => Err(AppendError::Poisoned(format!(
                "preparing the next WAL file failed: {e}"
            ))),
            Err(RollError::Install(e)) => Err(AppendError::Poisoned(format!(
                "installing the next WAL file failed: {e}"
            ))),
        }
    }

    /// Tries again, while idle, a rollover that found the disk full: so that the state clears (and
    /// `ScheduleLog::disk_full` says so) once space is freed, not only when a request needs the file. A
    /// caller that stops sending requests while the disk is reported full would otherwise never see it
    /// clear. Called only with nothing pending, so the current file is synced, as a rollover requires.
    fn retry_roll(&mut self) {
        if self.poisoned.is_some() || self.wal.is_empty() {
            return;
        }
        if let Err(e) = self.roll() {
            self.poison(&e);
        }
    }

    /// Pads the group's unwritten bytes to a block boundary, writes them to the current file and syncs.
    fn write_and_sync(&mut self, group: &mut Group) -> Result<(), AppendError> {
        if group.bytes.len() == group.written {
            return Ok(());
        }
        frame::pad_to_block(&mut group.bytes, group.written);
        let unwritten = &group.bytes[group.written..];
        let path = self.wal.path().display().to_string();
        let poison = |what: &str, e: std::io::Error| {
            AppendError::Poisoned(format!("WAL {what} of {path} failed: {e}"))
        };
        self.wal.write(unwritten).map_err(|e| poison("write", e))?;
        let started = Instant::now();
        #[cfg(test)]
        if self.fault.take_if(|f| *f == Fault::Sync).is_some() {
            return Err(poison(
                "fdatasync",
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        self.wal.sync().map_err(|e| poison("fdatasync", e))?;
        metrics::histogram!("delayd_wal_fsync_seconds").record(started.elapsed().as_secs_f64());
        metrics::counter!("delayd_wal_bytes_written_total").increment(unwritten.len() as u64);
        group.written = group.bytes.len();
        Ok(())
    }

    /// Makes the group durable, answers its submitters and hands it to the replayer.
    fn commit(&mut self, group: &mut Group) {
        self.adopt_reported_poison();
        if group.answers.is_empty() {
            // Nothing to answer (every request failed before joining): no interval is running.
            group.started = None;
            return;
        }
        let fresh = self.fresh_group();
        let mut group = std::mem::replace(group, fresh);
        let result = match &self.poisoned {
            Some(cause) => Err(AppendError::Poisoned(cause.clone())),
            None => self.write_and_sync(&mut group),
        };
        if let Err(e) = &result {
            self.poison(e);
            for answer in group.answers {
                answer.send(Some(e));
            }
            return;
        }
        metrics::histogram!("delayd_wal_batch_records").record(group.records.len() as f64);
        match &self.entry_log {
            // A replicated log's records count as committed once applied (`apply_entries`).
            Some(log) => {
                if let Some(last) = self.next_index.checked_sub(1) {
                    log.flushed(last);
                }
            }
            None => self.committed.store(self.next_seq, Ordering::Release),
        }
        for answer in group.answers {
            answer.send(None);
        }
        if !group.records.is_empty() {
            let sent = self.replay.send(CommittedGroup {
                bytes: group.bytes,
                records: group.records,
                entry: None,
                outcomes: Vec::new(),
            });
            if sent.is_err() {
                // The replayer failed: what is in the WAL is safe and replays on restart, but nothing
                // more would reach the schedule, so stop accepting. It published its error before it
                // let go of the channel.
                let cause = self.poison_report.get().cloned();
                let cause = cause.unwrap_or_else(|| "the replayer stopped".into());
                self.poison(&AppendError::Poisoned(cause));
            }
        }
    }

    /// An empty group, on a recycled buffer when there is one.
    fn fresh_group(&self) -> Group {
        let mut bytes = self
            .recycled
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(GROUP_TARGET_BYTES + (1 << 20)));
        bytes.clear();
        let lead = bytes.as_ptr().align_offset(frame::BLOCK).min(frame::BLOCK);
        bytes.resize(lead, 0);
        Group {
            bytes,
            written: lead,
            ..Group::default()
        }
    }

    /// Takes on a poison cause published by another thread (the replayer, a failed segment sync).
    fn adopt_reported_poison(&mut self) {
        if self.poisoned.is_none() {
            if let Some(cause) = self.poison_report.get() {
                self.poisoned = Some(cause.clone());
            }
        }
    }

    /// Remembers a failure that leaves the WAL in an unknown state. A full disk at rollover does not:
    /// nothing was written.
    fn poison(&mut self, error: &AppendError) {
        if let AppendError::Poisoned(cause) = error {
            if self.poisoned.is_none() {
                metrics::counter!("delayd_wal_poisoned_total").increment(1);
                self.poisoned = Some(cause.clone());
                let _ = self.poison_report.set(cause.clone());
            }
        }
    }
}

/// The seq of the first message or cancel among an entry's frames (its outcomes, which take no seq,
/// passed over).
fn first_record_seq(frames: &[u8]) -> Option<u64> {
    frame::Frames::new(frames).find_map(|(at, kind, _)| match kind {
        frame::Kind::Message | frame::Kind::Cancel => crate::wal::record_seq(&frames[at..]),
        _ => None,
    })
}
