//! Raft entries in the WAL of a replicated data dir (DESIGN §10): the Raft log *is* the WAL. Each entry
//! is an entry frame followed by the record frames it carries, padded to a block boundary, so that
//! replicating a group costs each member one write and one `fdatasync`, and an entry can be cut off
//! (truncated) exactly where it starts.
//!
//! ```text
//! entry (frame kind 6, WAL files of version 3 only)
//! 0   8  term        u64  } the entry's log id: the term and node id of the leader that made it,
//! 8   8  leader      u64  } and its index (dense: each entry's is the one before it plus one)
//! 16  8  index       u64  }
//! 24  8  first_seq   u64  the seq of its first record; for an entry without records, the next seq
//! 32  4  records     u32  how many record frames follow it: messages and cancels, whose seqs run
//!                         first_seq, first_seq + 1, ..., outcomes with their buckets and application
//!                         payloads (which take no seq)
//! 36  1  kind        u8   1 blank (a new leader's first entry), 2 normal (records), 3 membership
//! 37  ..             membership: the cluster's member set, opaque to the engine (empty otherwise)
//!
//! outcome with its bucket (frame kind 7, in normal entries only)
//! 0   4  bucket      u32  start minute of the bucket of the record it is for
//! 4   ..             an outcome record's payload (record.rs)
//!
//! application payload (frame kind 8, in normal entries only)
//! 0   ..             the bytes the application proposed (`ScheduleLog::propose_app`), opaque to the
//!                    engine: the replayer passes them over, the application applies them itself
//!                    (`app_payloads`) before it hands the entry to `ScheduleLog::apply_entries`
//! ```
//!
//! Invariants:
//! - An entry frame starts on a block boundary, and its records follow it, then padding: nothing of
//!   another entry shares its blocks.
//! - An entry is whole or absent: a torn entry (fewer records than it says) ends the log at the entry
//!   frame, never inside it.
//! - Only normal entries carry records; their messages' and cancels' seqs continue the entry before
//!   them without a gap. What decides delivery in a cluster (outcomes) travels as records too, so that
//!   every member's dispatch logs match; so does the application's own state (its payloads), so that
//!   every member's files match.
//! - `first_seq` below the WAL file's first seq marks a frame of the file's earlier use (wal.rs).

use crate::commit::Appended;
use crate::frame::{self, Frames, Kind, Stop};
use crate::id::{Location, MessageId};
use crate::record::{patch_committed, Cancel, EncodedMessage, MessageHead, Outcome};
use crate::replay::placement;
use crate::wal::WalRecord;
use crate::Bucket;
use crate::SegmentMinutes;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes of an entry frame's payload before a membership's bytes.
pub(crate) const ENTRY_HEAD_LEN: usize = 37;

/// The most bytes one entry may take in the WAL, padding included: one write, within the unsynced
/// window (frame.rs's tail policy). A proposer keeps its groups under it; an entry over it is refused.
pub const MAX_ENTRY_BYTES: usize = frame::UNSYNCED_LIMIT / 2;

/// The largest payload [`ScheduleLog::propose_app`](crate::ScheduleLog::propose_app) takes: the most
/// that fits one normal entry alone (its entry frame, its own frame's header, and room for the padding
/// frame after it).
pub const MAX_APP_PAYLOAD_BYTES: usize = MAX_ENTRY_BYTES - ENTRY_HEAD_LEN - 3 * frame::HEADER_LEN;

/// Where an entry stands in the Raft log: the leader that made it (its term and node id) and its index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct LogId {
    pub term: u64,
    pub node_id: u64,
    pub index: u64,
}

/// What an entry carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryPayload {
    /// A new leader's first entry: nothing for the state machine.
    Blank,
    /// Sealed record frames (message and cancel), as [`EntryBuilder`] makes them on the leader.
    Normal(Vec<u8>),
    /// The member set, in the cluster layer's encoding.
    Membership(Vec<u8>),
}

/// One Raft log entry as the cluster layer hands it in and reads it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub log_id: LogId,
    pub payload: EntryPayload,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum EntryKind {
    Blank = 1,
    Normal = 2,
    Membership = 3,
}

/// The fixed part of an entry frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EntryHead {
    pub log_id: LogId,
    pub first_seq: u64,
    pub records: u32,
    pub kind: EntryKind,
}

impl EntryHead {
    /// Appends the entry frame (with `membership` bytes for a membership entry) to `buf`.
    pub(crate) fn encode_frame(&self, membership: &[u8], buf: &mut Vec<u8>) {
        let at = frame::start(buf);
        buf.extend_from_slice(&self.log_id.term.to_le_bytes());
        buf.extend_from_slice(&self.log_id.node_id.to_le_bytes());
        buf.extend_from_slice(&self.log_id.index.to_le_bytes());
        buf.extend_from_slice(&self.first_seq.to_le_bytes());
        buf.extend_from_slice(&self.records.to_le_bytes());
        buf.push(self.kind as u8);
        buf.extend_from_slice(membership);
        frame::finish(buf, at, Kind::Entry);
    }

    /// The head and the membership bytes of an entry frame's payload.
    pub(crate) fn decode(payload: &[u8]) -> Result<(EntryHead, &[u8]), &'static str> {
        let Some((fixed, membership)) = payload.split_first_chunk::<ENTRY_HEAD_LEN>() else {
            return Err("entry frame shorter than its fixed fields");
        };
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&fixed[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let kind = match fixed[36] {
            1 => EntryKind::Blank,
            2 => EntryKind::Normal,
            3 => EntryKind::Membership,
            _ => return Err("unknown entry kind"),
        };
        let records = u32::from_le_bytes([fixed[32], fixed[33], fixed[34], fixed[35]]);
        if kind != EntryKind::Membership && !membership.is_empty() {
            return Err("bytes after the fixed fields of an entry that is not a membership");
        }
        if kind != EntryKind::Normal && records != 0 {
            return Err("records in an entry that is not a normal one");
        }
        let head = EntryHead {
            log_id: LogId {
                term: u64_at(0),
                node_id: u64_at(8),
                index: u64_at(16),
            },
            first_seq: u64_at(24),
            records,
            kind,
        };
        Ok((head, membership))
    }
}

/// The bytes a normal entry with `records` bytes of record frames takes in the WAL, padding included.
pub(crate) fn normal_entry_bytes(records: usize) -> usize {
    frame::padded_len(frame::HEADER_LEN + ENTRY_HEAD_LEN + records)
}

/// The bytes an entry takes in the WAL, padding aside: its entry frame and its records.
pub(crate) fn entry_frame_bytes(entry: &Entry) -> usize {
    frame::HEADER_LEN + ENTRY_HEAD_LEN + payload_len(entry)
}

/// Seals `message` at the end of `buf` as the record `seq`, committed at `created_at_ms`: the WAL record
/// (its frame's range in `buf`) and what its submitter is told.
pub(crate) fn seal_message(
    buf: &mut Vec<u8>,
    message: &EncodedMessage,
    seq: u64,
    created_at_ms: i64,
    width: SegmentMinutes,
) -> (WalRecord, Appended) {
    let head = MessageHead {
        seq,
        deliver_at_ms: message.deliver_at_ms,
        created_at_ms,
        sink_tag: message.sink_tag,
        dedup: message.dedup,
        retry: message.retry_of.filter(|(_, attempt)| *attempt > 0),
    };
    let location = Location {
        bucket: placement(&head, width),
        seq,
    };
    let id = message
        .retry_of
        .map_or(MessageId::new(location), |(id, _)| id);
    let at = buf.len();
    buf.extend_from_slice(&message.frame);
    patch_committed(&mut buf[at..], seq, created_at_ms, id);
    let appended = Appended {
        id,
        location,
        deliver_at_ms: message.deliver_at_ms,
        created_at_ms,
    };
    let record = WalRecord::Message {
        head,
        frame: at..buf.len(),
    };
    (record, appended)
}

/// Forms the records of one normal entry on the leader: assigns seqs, commit times and ids, as the WAL
/// writer of a single node does for a group. The entry's records are [`EntryBuilder::finish`]'s bytes.
#[derive(Debug)]
pub struct EntryBuilder {
    next_seq: u64,
    width: SegmentMinutes,
    frames: Vec<u8>,
    records: u32,
}

impl EntryBuilder {
    /// Starts an entry whose first record gets `next_seq` (the seq after the last record of the log,
    /// entries not yet flushed included).
    pub fn new(next_seq: u64, width: SegmentMinutes) -> EntryBuilder {
        EntryBuilder {
            next_seq,
            width,
            frames: Vec::new(),
            records: 0,
        }
    }

    /// Adds messages committed at `created_at_ms`; what each submitter will be told once the entry is
    /// committed.
    pub fn append(&mut self, messages: &[EncodedMessage], created_at_ms: i64) -> Vec<Appended> {
        let mut appended = Vec::with_capacity(messages.len());
        for message in messages {
            let (_, one) = seal_message(
                &mut self.frames,
                message,
                self.next_seq,
                created_at_ms,
                self.width,
            );
            self.next_seq += 1;
            self.records += 1;
            appended.push(one);
        }
        appended
    }

    /// Adds a tombstone for the attempt at `target`; its seq.
    pub fn cancel(&mut self, target: Location, created_at_ms: i64) -> u64 {
        let cancel = Cancel {
            seq: self.next_seq,
            created_at_ms,
            target,
        };
        cancel.encode_frame(&mut self.frames);
        self.next_seq += 1;
        self.records += 1;
        cancel.seq
    }

    /// Adds outcomes, each for the record in its bucket: what every member's dispatch logs record.
    pub fn outcomes(&mut self, outcomes: &[PlacedOutcome]) {
        for (bucket, outcome) in outcomes {
            encode_placed_outcome(*bucket, outcome, &mut self.frames);
            self.records += 1;
        }
    }

    /// Adds an application payload (no seq): what every member's application applies.
    pub fn app(&mut self, payload: &[u8]) {
        encode_app(payload, &mut self.frames);
        self.records += 1;
    }

    /// The entry's payload, and the seq the next entry starts at.
    pub fn finish(self) -> (EntryPayload, u64) {
        (EntryPayload::Normal(self.frames), self.next_seq)
    }
}

/// Where an entry of the WAL is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placed {
    pub log_id: LogId,
    /// The first seq of the WAL file holding it (its name).
    pub file: u64,
    /// File offset of its entry frame, and of what follows it and its padding.
    pub at: u64,
    pub end: u64,
    pub first_seq: u64,
    pub records: u32,
}

/// How long an apply waits for its entry's `fdatasync`.
const FLUSH_WAIT: Duration = Duration::from_secs(30);

/// Entries in memory are dropped once flushed past this many bytes.
const FRESH_LIMIT_BYTES: usize = 64 << 20;

/// The entries of a replicated WAL, shared by its writer (which places and cuts them), its readers and
/// the replayer (which purges them with their files).
///
/// Invariants: `placed` holds every entry in the WAL files, dense by index, in seq order; an entry
/// handed in is in `fresh` from before it is queued until it is flushed and either applied or pushed
/// out by newer ones past `FRESH_LIMIT_BYTES`, so that it can be read back at once (openraft reads
/// entries it has just appended, before their flush).
#[derive(Debug, Default)]
pub(crate) struct EntryLog {
    state: Mutex<EntryLogState>,
    /// Signalled each time `flushed` moves.
    flushes: Condvar,
}

#[derive(Debug, Default)]
struct EntryLogState {
    placed: BTreeMap<u64, Placed>,
    fresh: BTreeMap<u64, Arc<Entry>>,
    fresh_bytes: usize,
    /// Every entry up to this index is durable.
    flushed: Option<u64>,
    /// Every entry up to this index is applied (handed to the replayer): never cut off.
    applied: Option<u64>,
    /// Entries up to this index may go (with their WAL files): the Raft layer no longer needs them.
    purgeable: Option<u64>,
    last_purged: Option<LogId>,
    /// The last entry handed in (placed or not yet).
    last: Option<LogId>,
    /// The seq after the last record of the last entry handed in.
    next_seq: u64,
}

fn payload_len(entry: &Entry) -> usize {
    match &entry.payload {
        EntryPayload::Blank => 0,
        EntryPayload::Normal(b) | EntryPayload::Membership(b) => b.len(),
    }
}

impl EntryLog {
    fn state(&self) -> MutexGuard<'_, EntryLogState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What recovery found: the entries in the WAL files after the last purged one, oldest first;
    /// `next_seq` after them; the last entry purged, and the last applied (the checkpoint's).
    pub(crate) fn recovered(
        placed: Vec<Placed>,
        next_seq: u64,
        last_purged: Option<LogId>,
        applied: Option<u64>,
    ) -> EntryLog {
        let last = placed.last().map(|p| p.log_id).or(last_purged);
        let flushed = last.map(|l| l.index);
        let placed = placed.into_iter().map(|p| (p.log_id.index, p)).collect();
        EntryLog {
            flushes: Condvar::new(),
            state: Mutex::new(EntryLogState {
                placed,
                flushed,
                applied,
                last_purged,
                last,
                next_seq,
                ..EntryLogState::default()
            }),
        }
    }

    /// Takes entries in before they are queued for the writer: they must continue the log (index and
    /// seqs). How many records each carries; on `Err` nothing changed.
    pub(crate) fn hand_in(&self, entries: &[Arc<Entry>]) -> Result<Vec<RecordCount>, String> {
        let mut state = self.state();
        let mut last = state.last;
        let mut next_seq = state.next_seq;
        let mut counts = Vec::with_capacity(entries.len());
        for entry in entries {
            let expected = last.map_or(0, |l| l.index + 1);
            if entry.log_id.index != expected {
                return Err(format!(
                    "entry {} does not follow the log's last entry (the next index is {expected})",
                    entry.log_id.index
                ));
            }
            let bytes = frame::padded_len(entry_frame_bytes(entry));
            let membership = match &entry.payload {
                EntryPayload::Membership(m) => m.len(),
                _ => 0,
            };
            // One entry is one write at most, and its entry frame within a frame's bounds.
            if bytes > MAX_ENTRY_BYTES || ENTRY_HEAD_LEN + membership > frame::MAX_PAYLOAD {
                return Err(format!(
                    "entry {} takes {bytes} bytes, more than one write may ({MAX_ENTRY_BYTES})",
                    entry.log_id.index,
                ));
            }
            let records = match &entry.payload {
                EntryPayload::Normal(frames) => check_records(frames, next_seq)?,
                _ => RecordCount::default(),
            };
            next_seq += u64::from(records.seqs);
            last = Some(entry.log_id);
            counts.push(records);
        }
        for entry in entries {
            state.fresh_bytes += payload_len(entry);
            state.fresh.insert(entry.log_id.index, entry.clone());
        }
        state.last = last;
        state.next_seq = next_seq;
        Ok(counts)
    }

    pub(crate) fn placed_at(&self, index: u64) -> Option<Placed> {
        self.state().placed.get(&index).copied()
    }

    pub(crate) fn place(&self, placed: Placed) {
        self.state().placed.insert(placed.log_id.index, placed);
    }

    /// Every entry up to `index` is durable; fresh ones past the memory bound are dropped.
    pub(crate) fn flushed(&self, index: u64) {
        let mut state = self.state();
        state.flushed = Some(index);
        self.flushes.notify_all();
        while state.fresh_bytes > FRESH_LIMIT_BYTES {
            let Some(entry) = state.fresh.first_entry() else {
                break;
            };
            if *entry.key() > index {
                break;
            }
            let entry = entry.remove();
            state.fresh_bytes -= payload_len(&entry);
        }
    }

    /// Marks the entry `index` applied, which must be the one after the last applied; memory no longer
    /// holds it. Waits (up to `FLUSH_WAIT`) for it to be durable here: a follower may learn that an
    /// entry is committed (on a quorum without it) before its own `fdatasync` of it returned.
    pub(crate) fn apply(&self, index: u64) -> Result<(), String> {
        let mut state = self.state();
        if state.applied.is_some_and(|a| index != a + 1) {
            let after = state.applied.unwrap_or_default();
            return Err(format!("entry {index} applied after entry {after}"));
        }
        let deadline = Instant::now() + FLUSH_WAIT;
        while state.flushed.is_none_or(|f| index > f) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero()
                || !state.fresh.contains_key(&index) && !state.placed.contains_key(&index)
            {
                return Err(format!(
                    "entry {index} applied before it is in the log, durably"
                ));
            }
            state = self
                .flushes
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        state.applied = Some(index);
        let kept = state.fresh.split_off(&(index + 1));
        let gone = std::mem::replace(&mut state.fresh, kept);
        state.fresh_bytes -= gone.values().map(|e| payload_len(e)).sum::<usize>();
        Ok(())
    }

    /// The last entry applied.
    pub(crate) fn applied_index(&self) -> Option<u64> {
        self.state().applied
    }

    /// Cuts every entry from `from` on; the entry there, for the writer to cut the file back to.
    /// `None` (nothing cut) when it is applied, or not placed.
    pub(crate) fn cut(&self, from: u64) -> Option<Placed> {
        let mut state = self.state();
        if state.applied.is_some_and(|a| from <= a) {
            return None;
        }
        let cut = state.placed.get(&from).copied()?;
        state.placed.split_off(&from);
        let gone = state.fresh.split_off(&from);
        state.fresh_bytes -= gone.values().map(|e| payload_len(e)).sum::<usize>();
        state.last = state
            .placed
            .values()
            .next_back()
            .map(|p| p.log_id)
            .or(state.last_purged);
        state.next_seq = cut.first_seq;
        state.flushed = state.flushed.and(from.checked_sub(1)).min(state.flushed);
        Some(cut)
    }

    /// Entries up to `index` may go with their WAL files (never beyond what is applied: retirement
    /// checks that too).
    pub(crate) fn allow_purge(&self, index: u64) {
        let mut state = self.state();
        state.purgeable = state.purgeable.max(Some(index));
    }

    /// Up to which index entries may go.
    pub(crate) fn purgeable(&self) -> Option<u64> {
        self.state().purgeable
    }

    /// The placed entries in the WAL file named `file`, in order.
    pub(crate) fn in_file(&self, file: u64) -> Vec<Placed> {
        let state = self.state();
        state
            .placed
            .values()
            .filter(|p| p.file == file)
            .copied()
            .collect()
    }

    /// The WAL file named `file` was retired: its entries are purged.
    pub(crate) fn purge_file(&self, file: u64) {
        let mut state = self.state();
        let gone: Vec<u64> = state
            .placed
            .values()
            .filter(|p| p.file == file)
            .map(|p| p.log_id.index)
            .collect();
        for index in gone {
            if let Some(p) = state.placed.remove(&index) {
                if state.last_purged.is_none_or(|l| l.index < index) {
                    state.last_purged = Some(p.log_id);
                }
            }
        }
    }

    /// Whether the entry `placed` names is still there (not cut since it was located).
    pub(crate) fn still_placed(&self, placed: &Placed) -> bool {
        self.state().placed.get(&placed.log_id.index) == Some(placed)
    }

    /// (last purged, last) entry.
    pub(crate) fn bounds(&self) -> (Option<LogId>, Option<LogId>) {
        let state = self.state();
        (state.last_purged, state.last)
    }

    /// The seq the next entry's first record gets.
    pub(crate) fn next_seq(&self) -> u64 {
        self.state().next_seq
    }

    /// For each index of `range`, as the log is at this moment: the entry in memory, or where it is
    /// on disk; up to the first index the log does not have (purged, or past its end), which comes
    /// second.
    pub(crate) fn locate(&self, range: Range<u64>) -> (Vec<Located>, Option<u64>) {
        let state = self.state();
        let mut located =
            Vec::with_capacity(range.end.saturating_sub(range.start).min(4096) as usize);
        for index in range {
            match state.fresh.get(&index) {
                Some(entry) => located.push(Located::Fresh(entry.clone())),
                None => match state.placed.get(&index) {
                    Some(placed) => located.push(Located::Placed(*placed)),
                    None => return (located, Some(index)),
                },
            }
        }
        (located, None)
    }
}

/// Where [`EntryLog::locate`] found an entry.
#[derive(Debug, Clone)]
pub(crate) enum Located {
    Fresh(Arc<Entry>),
    Placed(Placed),
}

/// How many record frames an entry carries, and how many of them take a seq.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RecordCount {
    pub frames: u32,
    pub seqs: u32,
}

/// Checks that `frames` are whole record frames (message, cancel, outcome with its bucket), the seqs of
/// messages and cancels running from `first_seq` on without a gap; their count.
pub(crate) fn check_records(frames: &[u8], first_seq: u64) -> Result<RecordCount, String> {
    let Records {
        records,
        outcomes,
        apps,
    } = records_of(frames)?;
    for (i, record) in records.iter().enumerate() {
        let expected = first_seq + i as u64;
        if record.seq() != expected {
            return Err(format!(
                "record {i} of an entry has seq {}, where {expected} comes next",
                record.seq()
            ));
        }
    }
    let count = |n: usize| u32::try_from(n).map_err(|_| "an entry of over 4 billion records");
    Ok(RecordCount {
        frames: count(records.len() + outcomes.len() + apps)?,
        seqs: count(records.len())?,
    })
}

/// An outcome and the bucket of the record it is for, as an entry carries it.
pub type PlacedOutcome = (Bucket, Outcome);

/// What a normal entry's frames hold, as the engine sees them.
#[derive(Debug)]
pub(crate) struct Records {
    /// Messages and cancels (each message frame's range in the entry's frames).
    pub records: Vec<WalRecord>,
    pub outcomes: Vec<PlacedOutcome>,
    /// How many application payloads it carries (the application reads them: [`app_payloads`]).
    pub apps: usize,
}

/// Parses the records of a normal entry's frames: its messages and cancels (each frame's range in
/// `frames`), its outcomes, and how many application payloads it carries.
pub(crate) fn records_of(frames: &[u8]) -> Result<Records, String> {
    let mut records = Vec::new();
    let mut outcomes = Vec::new();
    let mut apps = 0;
    let mut walk = Frames::new(frames);
    for (at, kind, payload) in walk.by_ref() {
        let bad = |e: crate::record::Malformed| format!("record at {at} of an entry: {e}");
        match kind {
            Kind::Message => records.push(WalRecord::Message {
                head: MessageHead::decode(payload).map_err(bad)?,
                frame: at..at + frame::HEADER_LEN + payload.len(),
            }),
            Kind::Cancel => records.push(WalRecord::Cancel(Cancel::decode(payload).map_err(bad)?)),
            Kind::PlacedOutcome => {
                let Some((bucket, outcome)) = payload.split_first_chunk::<4>() else {
                    return Err(format!("outcome at {at} of an entry without its bucket"));
                };
                let bucket = Bucket::from_start_minute(u32::from_le_bytes(*bucket));
                outcomes.push((bucket, Outcome::decode(outcome).map_err(bad)?));
            }
            Kind::App => apps += 1,
            _ => {
                return Err(format!(
                    "a frame of kind {kind:?} at {at} of an entry's records"
                ))
            }
        }
    }
    whole(walk, frames.len())?;
    Ok(Records {
        records,
        outcomes,
        apps,
    })
}

/// Checks that a walk over an entry's `len` bytes of frames ended exactly at their end.
fn whole(walk: Frames<'_>, len: usize) -> Result<(), String> {
    match walk.stop() {
        Some(Stop::End { at }) if at == len => Ok(()),
        Some(Stop::End { at }) | Some(Stop::Invalid { at, .. }) => {
            Err(format!("an entry's records end at {at} of {len} bytes"))
        }
        None => unreachable!("the frame walk ended without a stop"),
    }
}

/// The application payloads of a normal entry's frames (`EntryPayload::Normal`), in order; the other
/// records are passed over. An error when the bytes are not whole frames.
pub fn app_payloads(frames: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut apps = Vec::new();
    let mut walk = Frames::new(frames);
    for (at, kind, payload) in walk.by_ref() {
        match kind {
            Kind::App => apps.push(payload),
            Kind::Message | Kind::Cancel | Kind::PlacedOutcome => {}
            _ => {
                return Err(format!(
                    "a frame of kind {kind:?} at {at} of an entry's records"
                ))
            }
        }
    }
    whole(walk, frames.len())?;
    Ok(apps)
}

/// Appends an application payload as a frame to `buf`.
fn encode_app(payload: &[u8], buf: &mut Vec<u8>) {
    let at = frame::start(buf);
    buf.extend_from_slice(payload);
    frame::finish(buf, at, Kind::App);
}

/// Appends an outcome with its bucket as a frame to `buf`.
fn encode_placed_outcome(bucket: Bucket, outcome: &Outcome, buf: &mut Vec<u8>) {
    let at = frame::start(buf);
    buf.extend_from_slice(&bucket.start_minute().to_le_bytes());
    outcome.encode_payload(buf);
    frame::finish(buf, at, Kind::PlacedOutcome);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::Next;

    #[test]
    fn an_entry_frame_round_trips_and_damage_is_refused() {
        let head = EntryHead {
            log_id: LogId {
                term: 7,
                node_id: 2,
                index: 9312,
            },
            first_seq: 41,
            records: 0,
            kind: EntryKind::Membership,
        };
        let mut buf = Vec::new();
        head.encode_frame(b"{\"voters\":[1,2,3]}", &mut buf);
        let Next::Frame {
            kind: Kind::Entry,
            payload,
        } = frame::decode(&buf)
        else {
            panic!("not an entry frame");
        };
        assert_eq!(
            EntryHead::decode(payload),
            Ok((head, &b"{\"voters\":[1,2,3]}"[..]))
        );
        for cut in 0..ENTRY_HEAD_LEN {
            assert!(EntryHead::decode(&payload[..cut]).is_err(), "cut {cut}");
        }
        let mut bad_kind = payload.to_vec();
        bad_kind[36] = 9;
        assert_eq!(
            EntryHead::decode(&bad_kind).map(|_| ()),
            Err("unknown entry kind")
        );
        let mut blank_with_records = payload[..ENTRY_HEAD_LEN].to_vec();
        blank_with_records[36] = EntryKind::Blank as u8;
        blank_with_records[32] = 1;
        assert!(EntryHead::decode(&blank_with_records).is_err());
    }
}
