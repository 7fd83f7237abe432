//! openraft's storage on the schedule log (DESIGN.md §10): the Raft log *is* the WAL of a replicated
//! data dir (schedulelog's `entries`), the vote is its `raft/vote` file, and the state machine is the
//! schedule the replayer files applied entries into, with the application's own state (the built-in
//! broker's files) that an [`Applier`] applies entries' application payloads to. A thin shell: what
//! the log checks and how it recovers is schedulelog's.
//!
//! Invariants:
//! - An append's callback fires only after the `fdatasync` that covers its entries returned.
//! - A vote is on disk before `save_vote` returns; the committed log id is saved without a sync (openraft
//!   asks no more of it: a lost one is learnt again from the leader).
//! - An entry's application payloads are applied before the entry is handed to the log: once the
//!   log says an entry is applied (which answers its proposer's submitters), so is their effect.
//! - A read is the log as it was at one moment, from the first entry asked for on: a purged first entry
//!   is an error, never left out. Entries past the end are simply absent, as openraft's reader contract
//!   allows, and so are those of a tail cut while it was read (this member deposed, following another):
//!   never old entries joined to those that replaced them.
//! - Entries go only once openraft purged them (after a snapshot, once no member needs them), and
//!   then with their WAL files, once everything in those is applied and checkpointed.
//! - A snapshot is taken on the state machine's task, between two applies (snapshot.rs): openraft's
//!   builder only hands it over. Installing one restarts the member (snapshot.rs says why).

#![allow(
    clippy::result_large_err,
    reason = "openraft's StorageError is what its traits return, and these helpers feed them"
)]

use super::snapshot::{SnapshotError, SnapshotFiles, Snapshots};
use super::{Member, Proposal, TypeConfig};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    AnyError, Entry, EntryPayload, ErrorSubject, ErrorVerb, LeaderId, LogId, Membership,
    RaftLogReader, RaftSnapshotBuilder, SnapshotMeta, StorageError, StorageIOError,
    StoredMembership, Vote,
};
use schedulelog::{Ack, RaftState, ScheduleLog, VoteFile};
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What `limited_get_log_entries` returns at most, past its first entry: a replication batch.
const READ_BATCH_BYTES: usize = 2 << 20;

type StorageResult<T> = Result<T, StorageError<u64>>;

fn storage_error(
    subject: ErrorSubject<u64>,
    verb: ErrorVerb,
    error: impl std::error::Error + 'static,
) -> StorageError<u64> {
    StorageError::IO {
        source: StorageIOError::new(subject, verb, AnyError::new(&error)),
    }
}

pub(super) fn to_raft_log_id(id: schedulelog::LogId) -> LogId<u64> {
    LogId::new(LeaderId::new(id.term, id.node_id), id.index)
}

fn from_raft_log_id(id: &LogId<u64>) -> schedulelog::LogId {
    schedulelog::LogId {
        term: id.leader_id.term,
        node_id: id.leader_id.node_id,
        index: id.index,
    }
}

/// An openraft entry as the schedule log stores it.
fn to_log_entry(entry: Entry<TypeConfig>) -> StorageResult<schedulelog::Entry> {
    let payload = match entry.payload {
        EntryPayload::Blank => schedulelog::EntryPayload::Blank,
        EntryPayload::Normal(proposal) => schedulelog::EntryPayload::Normal(proposal.frames),
        EntryPayload::Membership(membership) => {
            let bytes = serde_json::to_vec(&membership)
                .map_err(|e| storage_error(ErrorSubject::Log(entry.log_id), ErrorVerb::Write, e))?;
            schedulelog::EntryPayload::Membership(bytes)
        }
    };
    Ok(schedulelog::Entry {
        log_id: from_raft_log_id(&entry.log_id),
        payload,
    })
}

fn to_log_entries(
    entries: impl IntoIterator<Item = Entry<TypeConfig>>,
) -> StorageResult<Vec<schedulelog::Entry>> {
    entries.into_iter().map(to_log_entry).collect()
}

fn membership_of(bytes: &[u8], log_id: LogId<u64>) -> StorageResult<Membership<u64, Member>> {
    serde_json::from_slice(bytes)
        .map_err(|e| storage_error(ErrorSubject::Log(log_id), ErrorVerb::Read, e))
}

/// A stored entry as openraft's.
fn to_raft_entry(entry: schedulelog::Entry) -> StorageResult<Entry<TypeConfig>> {
    let log_id = to_raft_log_id(entry.log_id);
    let payload = match entry.payload {
        schedulelog::EntryPayload::Blank => EntryPayload::Blank,
        schedulelog::EntryPayload::Normal(frames) => EntryPayload::Normal(Proposal { frames }),
        schedulelog::EntryPayload::Membership(bytes) => {
            EntryPayload::Membership(membership_of(&bytes, log_id)?)
        }
    };
    Ok(Entry { log_id, payload })
}

/// An append waiting for its `fdatasync`, and openraft's callback for it.
type Flush = (Ack<()>, LogFlushed<TypeConfig>);

/// The Raft log and the vote of a member.
#[derive(Clone)]
pub struct LogStore {
    log: Arc<ScheduleLog>,
    votes: Arc<Mutex<(VoteFile, RaftState)>>,
    /// Set while a received snapshot is installed (snapshot.rs): nothing more is appended or
    /// acknowledged.
    installing: Arc<AtomicBool>,
    /// To the thread that calls appends' callbacks as their acks come, in order.
    flushes: crossbeam_channel::Sender<Flush>,
}

impl Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore")
            .field("log", &self.log)
            .finish_non_exhaustive()
    }
}

impl LogStore {
    /// The log store of `log` (opened replicated), with the vote file in `raft_dir`; `installing`
    /// is [`Snapshots::installing`]. Starts the thread that reports appends durable; it ends with the
    /// last clone of the store.
    pub fn open(
        log: Arc<ScheduleLog>,
        raft_dir: &Path,
        installing: Arc<AtomicBool>,
    ) -> Result<LogStore, schedulelog::Error> {
        let (file, state) = VoteFile::open(raft_dir)?;
        let (flushes, pending) = crossbeam_channel::unbounded::<Flush>();
        let holding = installing.clone();
        std::thread::Builder::new()
            .name("delayd-raft-flush".into())
            .spawn(move || {
                for (ack, callback) in pending {
                    let done = ack.wait().map_err(std::io::Error::other);
                    // A snapshot is being installed: the member restarts and drops its log, so
                    // nothing more may count as acknowledged (the callback goes unanswered).
                    if holding.load(Ordering::SeqCst) {
                        continue;
                    }
                    callback.log_io_completed(done);
                }
            })
            .map_err(|source| schedulelog::Error::Io {
                path: "delayd-raft-flush thread".into(),
                source,
            })?;
        Ok(LogStore {
            log,
            votes: Arc::new(Mutex::new((file, state))),
            installing,
            flushes,
        })
    }

    fn save(&self, change: impl FnOnce(&mut RaftState), durable: bool) -> StorageResult<()> {
        let mut votes = self.votes.lock().unwrap_or_else(|p| p.into_inner());
        let (file, state) = &mut *votes;
        change(state);
        file.save(state, durable)
            .map_err(|e| storage_error(ErrorSubject::Vote, ErrorVerb::Write, e))
    }

    /// The index of the last entry this member knows to be committed (openraft saves it here as it
    /// learns it); `None` before the first.
    pub fn committed_index(&self) -> Option<u64> {
        self.state().committed.map(|id| id.index)
    }

    fn state(&self) -> RaftState {
        self.votes.lock().unwrap_or_else(|p| p.into_inner()).1
    }

    /// The entries of `[start, end)` that the log holds, as it is at one moment, reading on (past the
    /// first) only while `limit` bytes are not reached. A purged first entry is an error; a tail cut
    /// meanwhile (this member deposed, following another) ends the read early, which openraft allows.
    fn read(&self, start: u64, end: u64, limit: usize) -> StorageResult<Vec<Entry<TypeConfig>>> {
        let (purged, _) = self
            .log
            .entry_bounds()
            .map_err(|e| storage_error(ErrorSubject::Logs, ErrorVerb::Read, e))?;
        // A purged entry is an error, never left out: a read that starts later than asked would let
        // a leader send a member entries after a gap.
        if let Some(purged) = purged.filter(|p| start <= p.index && start < end) {
            let gone =
                std::io::Error::other(format!("entry {start} is purged (up to {})", purged.index));
            return Err(storage_error(
                ErrorSubject::LogIndex(start),
                ErrorVerb::Read,
                gone,
            ));
        }
        let read = self
            .log
            .read_entries_within(start..end, limit)
            .map_err(|e| storage_error(ErrorSubject::LogIndex(start), ErrorVerb::Read, e))?;
        read.into_iter().map(to_raft_entry).collect()
    }
}

/// `[start, end)` of a range of indexes.
fn bounds(range: &impl RangeBounds<u64>) -> (u64, u64) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => u64::MAX,
    };
    (start, end)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> StorageResult<Vec<Entry<TypeConfig>>> {
        let (start, end) = bounds(&range);
        let store = self.clone();
        run_blocking(move || store.read(start, end, usize::MAX)).await
    }

    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> StorageResult<Vec<Entry<TypeConfig>>> {
        let store = self.clone();
        run_blocking(move || store.read(start, end, READ_BATCH_BYTES)).await
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> StorageResult<LogState<TypeConfig>> {
        let (purged, last) = self
            .log
            .entry_bounds()
            .map_err(|e| storage_error(ErrorSubject::Logs, ErrorVerb::Read, e))?;
        Ok(LogState {
            last_purged_log_id: purged.map(to_raft_log_id),
            last_log_id: last.map(to_raft_log_id),
        })
    }

    async fn get_log_reader(&mut self) -> LogStore {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> StorageResult<()> {
        let vote = schedulelog::Vote {
            term: vote.leader_id.term,
            node_id: vote.leader_id.node_id,
            committed: vote.committed,
        };
        let store = self.clone();
        run_blocking(move || store.save(|s| s.vote = Some(vote), true)).await
    }

    async fn read_vote(&mut self) -> StorageResult<Option<Vote<u64>>> {
        Ok(self.state().vote.map(|v| match v.committed {
            true => Vote::new_committed(v.term, v.node_id),
            false => Vote::new(v.term, v.node_id),
        }))
    }

    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> StorageResult<()> {
        let committed = committed.as_ref().map(from_raft_log_id);
        let store = self.clone();
        run_blocking(move || store.save(|s| s.committed = committed, false)).await
    }

    async fn read_committed(&mut self) -> StorageResult<Option<LogId<u64>>> {
        Ok(self.state().committed.map(to_raft_log_id))
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> StorageResult<()>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        if self.installing.load(Ordering::SeqCst) {
            let restarting =
                std::io::Error::other("a snapshot is being installed: this member restarts");
            return Err(storage_error(
                ErrorSubject::Logs,
                ErrorVerb::Write,
                restarting,
            ));
        }
        let entries = to_log_entries(entries)?;
        let ack = self.log.append_entries(entries);
        // Readable now; durable when the ack comes, which the flush thread tells openraft.
        self.flushes.send((ack, callback)).map_err(|_| {
            let gone = std::io::Error::other("the flush thread stopped");
            storage_error(ErrorSubject::Logs, ErrorVerb::Write, gone)
        })
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> StorageResult<()> {
        let ack = self.log.truncate_entries(log_id.index);
        ack.await
            .map_err(|e| storage_error(ErrorSubject::Log(log_id), ErrorVerb::Delete, e))
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> StorageResult<()> {
        // Entries go with their WAL files, once everything in them is also applied and checkpointed.
        self.log
            .purge_entries(log_id.index)
            .map_err(|e| storage_error(ErrorSubject::Log(log_id), ErrorVerb::Delete, e))
    }
}

/// Runs blocking storage work off the async runtime's threads.
async fn run_blocking<T: Send + 'static>(
    work: impl FnOnce() -> StorageResult<T> + Send + 'static,
) -> StorageResult<T> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| Err(storage_error(ErrorSubject::Store, ErrorVerb::Read, e)))
}

/// Applies the application payloads of committed entries on this member (`ScheduleLog::propose_app`;
/// delayd's are the built-in broker's ops): called with each payload's place in the log (its entry's
/// index, and its position among that entry's payloads, from 0) and its bytes, in log order, on a
/// blocking thread. A payload may come again after a restart (entries after the schedule's checkpoint
/// are applied again), with the same place: the applier makes that harmless. An error is a storage
/// error: openraft stops this member (its files could no longer match the others').
pub type Applier = Arc<dyn Fn((u64, u32), &[u8]) -> Result<(), String> + Send + Sync>;

/// The state machine: the schedule the applied entries' records are filed into, the application's
/// own state (through its [`Applier`]), and their snapshots.
#[derive(Clone)]
pub struct StateMachine {
    log: Arc<ScheduleLog>,
    applier: Option<Applier>,
    snapshots: Snapshots,
}

impl Debug for StateMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateMachine")
            .field("log", &self.log)
            .field("applier", &self.applier.is_some())
            .field("snapshots", &self.snapshots)
            .finish()
    }
}

impl StateMachine {
    /// The state machine of `log`: with an `applier`, application payloads go to it before each
    /// entry is filed (without one they are passed over).
    pub fn new(
        log: Arc<ScheduleLog>,
        applier: Option<Applier>,
        snapshots: Snapshots,
    ) -> StateMachine {
        StateMachine {
            log,
            applier,
            snapshots,
        }
    }
}

fn snapshot_error(error: SnapshotError) -> StorageError<u64> {
    storage_error(ErrorSubject::Snapshot(None), ErrorVerb::Write, error)
}

/// openraft's snapshot builder: the snapshot taken when openraft asked for the builder (on the
/// state machine's task, between two applies), or why it could not be.
#[derive(Debug)]
pub struct Taken(Option<StorageResult<Snapshot<TypeConfig>>>);

/// Applies `entries` in log order: each one's application payloads through `applier` first, then the
/// entry itself into the schedule (entries without payloads handed over together).
fn apply_in_order(
    log: &ScheduleLog,
    applier: Option<&Applier>,
    entries: Vec<schedulelog::Entry>,
) -> StorageResult<()> {
    let subject = |id: schedulelog::LogId| ErrorSubject::Apply(to_raft_log_id(id));
    let file = |batch: &mut Vec<schedulelog::Entry>| {
        let Some(first) = batch.first().map(|e| e.log_id) else {
            return Ok(());
        };
        log.apply_entries(std::mem::take(batch))
            .map_err(|e| storage_error(subject(first), ErrorVerb::Write, e))
    };
    let mut batch = Vec::with_capacity(entries.len());
    for entry in entries {
        if let (Some(applier), schedulelog::EntryPayload::Normal(frames)) =
            (applier, &entry.payload)
        {
            let payloads = schedulelog::app_payloads(frames).map_err(|why| {
                storage_error(subject(entry.log_id), ErrorVerb::Read, Refused(why))
            })?;
            if !payloads.is_empty() {
                // What comes before it is filed first: the log's order, whoever looks.
                file(&mut batch)?;
                for (nth, payload) in (0u32..).zip(payloads) {
                    applier((entry.log_id.index, nth), payload).map_err(|why| {
                        storage_error(subject(entry.log_id), ErrorVerb::Write, Refused(why))
                    })?;
                }
            }
        }
        batch.push(entry);
    }
    file(&mut batch)
}

/// Why an application payload could not be applied (or read).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Refused(String);

impl RaftSnapshotBuilder<TypeConfig> for Taken {
    async fn build_snapshot(&mut self) -> StorageResult<Snapshot<TypeConfig>> {
        self.0.take().unwrap_or_else(|| {
            let twice = std::io::Error::other("a snapshot builder was used twice");
            Err(storage_error(
                ErrorSubject::Snapshot(None),
                ErrorVerb::Read,
                twice,
            ))
        })
    }
}

/// openraft receives snapshots through `Raft::install_full_snapshot` (snapshot.rs streams them over
/// the peer link), never in its own chunks.
#[derive(Debug, thiserror::Error)]
#[error("snapshots arrive over the peer link, not in openraft's chunks")]
struct NotChunked;

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = Taken;

    async fn applied_state(
        &mut self,
    ) -> StorageResult<(Option<LogId<u64>>, StoredMembership<u64, Member>)> {
        let log = self.log.clone();
        let applied = run_blocking(move || Ok(log.applied_state())).await?;
        let Some(applied) = applied else {
            return Ok((None, StoredMembership::default()));
        };
        let membership = match applied.membership {
            Some((id, bytes)) => {
                let id = to_raft_log_id(id);
                StoredMembership::new(Some(id), membership_of(&bytes, id)?)
            }
            None => StoredMembership::default(),
        };
        Ok((Some(to_raft_log_id(applied.log_id)), membership))
    }

    async fn apply<I>(&mut self, entries: I) -> StorageResult<Vec<()>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let entries = to_log_entries(entries)?;
        let count = entries.len();
        let (log, applier) = (self.log.clone(), self.applier.clone());
        run_blocking(move || apply_in_order(&log, applier.as_ref(), entries)).await?;
        Ok(vec![(); count])
    }

    /// Takes the snapshot here, where no entry is being applied: the builder only hands it over. A
    /// take that fails (a full disk) hands over the newest snapshot instead, which purges nothing
    /// more: an error here would stop this member. Only with none at all is it an error.
    async fn get_snapshot_builder(&mut self) -> Taken {
        let snapshots = self.snapshots.clone();
        Taken(Some(
            run_blocking(move || snapshots.take_or_newest().map_err(snapshot_error)).await,
        ))
    }

    async fn begin_receiving_snapshot(&mut self) -> StorageResult<Box<SnapshotFiles>> {
        Err(storage_error(
            ErrorSubject::Snapshot(None),
            ErrorVerb::Write,
            NotChunked,
        ))
    }

    /// Marks the snapshot to be swapped in and restarts this member (snapshot.rs).
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, Member>,
        snapshot: Box<SnapshotFiles>,
    ) -> StorageResult<()> {
        let (snapshots, meta) = (self.snapshots.clone(), meta.clone());
        run_blocking(move || snapshots.install(&meta, &snapshot).map_err(snapshot_error)).await
    }

    /// The newest snapshot; one is taken now if there is none and anything is applied (a member
    /// restored from a snapshot has purged its log up to it, and must be able to send one).
    async fn get_current_snapshot(&mut self) -> StorageResult<Option<Snapshot<TypeConfig>>> {
        let (snapshots, log) = (self.snapshots.clone(), self.log.clone());
        run_blocking(move || match snapshots.current().map_err(snapshot_error)? {
            Some(snapshot) => Ok(Some(snapshot)),
            None if log.applied_state().is_some() => {
                snapshots.take_or_newest().map(Some).map_err(snapshot_error)
            }
            None => Ok(None),
        })
        .await
    }
}
