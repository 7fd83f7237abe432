//! The Raft log of a replicated data dir (DESIGN §10, entry.rs): entries handed in, read back, cut off
//! and applied. The cluster layer's storage adapter is a thin shell around these calls; openraft's
//! rules for them are its business, and the checks here keep the log whole whatever it asks.
//!
//! Invariants:
//! - An entry handed in is readable at once (before its `fdatasync`), durable when its [`Ack`] resolves.
//! - [`ScheduleLog::read_entries`] returns every entry asked for or an error. What replication reads
//!   ([`ScheduleLog::read_entries_within`]) is the log as it was at one moment, from the first entry
//!   asked for on, never with a hole and never old entries joined to those that replaced them: a
//!   tail cut (or a head purged) while it is read ends it early.
//! - Records reach the schedule only through [`ScheduleLog::apply_entries`], in entry order; an entry
//!   that may still be cut off is never applied (the caller applies only committed entries, and a cut
//!   below the applied index is refused).

use super::ScheduleLog;
use crate::checkpoint::AppliedState;
use crate::commit::{Ack, CommittedGroup, Request};
use crate::entry::{
    self, Entry, EntryHead, EntryKind, EntryLog, EntryPayload, Located, LogId, Placed,
};
use crate::error::{AppendError, Blocked, Error, Result};
use crate::frame::{self, Frames, Kind};
use crate::proposals::Proposals;
use crate::replay::Replay;
use crate::wal::wal_path;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl ScheduleLog {
    pub(crate) fn entry_log(&self) -> Result<&EntryLog> {
        self.entry_log
            .as_deref()
            .ok_or_else(|| Error::InvalidOption("this data dir is not replicated".into()))
    }

    /// Queues Raft entries, which must continue the log (dense indexes, dense record seqs); they are
    /// readable at once and durable once the answer comes. Entries are refused, all of them and before
    /// anything is written, when they do not continue the log or one is larger than a WAL file.
    pub fn append_entries(&self, entries: Vec<Entry>) -> Ack<()> {
        // Shared by the writer and the readers of fresh entries, not copied.
        let entries: Vec<Arc<Entry>> = entries.into_iter().map(Arc::new).collect();
        let counted = self
            .entry_log()
            .map_err(|e| e.to_string())
            .and_then(|log| log.hand_in(&entries));
        match counted {
            Ok(records) => {
                let (request, ack) = Request::entries(entries, records);
                self.submit(request);
                ack
            }
            Err(why) => {
                let (request, ack) = Request::entries(Vec::new(), Vec::new());
                request.fail(AppendError::Refused(why));
                ack
            }
        }
    }

    /// Cuts every entry from index `from` on (a follower whose tail conflicts with its leader's). Durable
    /// when the answer comes. Refused for an applied entry.
    pub fn truncate_entries(&self, from: u64) -> Ack<()> {
        let (request, ack) = Request::truncate(from);
        self.submit(request);
        ack
    }

    /// The entries with indexes in `range`, all of them, or an error naming the first missing one.
    pub fn read_entries(&self, range: Range<u64>) -> Result<Vec<Entry>> {
        let log = self.entry_log()?;
        let (located, missing) = log.locate(range.clone());
        if let Some(index) = missing {
            let (purged, last) = log.bounds();
            return Err(Error::InvalidOption(format!(
                "entry {index} is not in the log (last purged {:?}, last {:?})",
                purged.map(|p| p.index),
                last.map(|l| l.index)
            )));
        }
        self.read_located(located, usize::MAX)
    }

    /// The entries of `range` the log holds, from its start on, as they are at one moment: up to its
    /// end (or the end of the log), reading on past the first only while `limit` payload bytes are not
    /// reached. What openraft's replication reads: a tail cut meanwhile (this member deposed, following
    /// another) shortens the read, never mixes the old entries with those that replace them. Empty
    /// when the first entry is not in the log (purged; the caller checks that first).
    pub fn read_entries_within(&self, range: Range<u64>, limit: usize) -> Result<Vec<Entry>> {
        let (located, _) = self.entry_log()?.locate(range);
        self.read_located(located, limit)
    }

    /// The entries `located` found, read from memory or their WAL files, up to one cut (or purged)
    /// since then, and past the first only while `limit` payload bytes are not reached.
    pub(crate) fn read_located(&self, located: Vec<Located>, limit: usize) -> Result<Vec<Entry>> {
        let log = self.entry_log()?;
        let mut entries = Vec::with_capacity(located.len().min(1024));
        let mut bytes = 0;
        for located in located {
            let entry = match located {
                Located::Fresh(entry) => Entry::clone(&entry),
                Located::Placed(placed) => match self.read_placed(&placed) {
                    Ok(entry) => entry,
                    // Cut (its file cut back, perhaps written over since) or purged while it was
                    // read: the log no longer has it, and this read ends there.
                    Err(_) if !log.still_placed(&placed) => return Ok(entries),
                    Err(e) => return Err(e),
                },
            };
            bytes += match &entry.payload {
                EntryPayload::Normal(frames) => frames.len(),
                EntryPayload::Membership(m) => m.len(),
                EntryPayload::Blank => 0,
            };
            entries.push(entry);
            if bytes >= limit {
                break;
            }
        }
        Ok(entries)
    }

    /// Reads an entry from its WAL file.
    fn read_placed(&self, placed: &Placed) -> Result<Entry> {
        let path = wal_path(&self.shared.data_dir.join("wal"), placed.file);
        let file = std::fs::File::open(&path).map_err(Error::io(&path))?;
        let mut bytes = vec![0u8; (placed.end - placed.at) as usize];
        file.read_exact_at(&mut bytes, placed.at)
            .map_err(Error::io(&path))?;
        let corrupt =
            |offset: usize, why: &str| Error::corrupt(&path, placed.at + offset as u64, why);
        let mut frames = Frames::new(&bytes);
        let head = match frames.next() {
            Some((_, Kind::Entry, payload)) => {
                let (head, membership) =
                    EntryHead::decode(payload).map_err(|why| corrupt(0, why))?;
                if head.log_id != placed.log_id {
                    return Err(corrupt(0, "an entry other than the one placed there"));
                }
                (head, membership.to_vec())
            }
            _ => return Err(corrupt(0, "no entry frame where an entry was placed")),
        };
        let records_at = frame::HEADER_LEN + entry::ENTRY_HEAD_LEN + head.1.len();
        let mut records_end = records_at;
        for _ in 0..head.0.records {
            match frames.next() {
                Some((
                    at,
                    Kind::Message | Kind::Cancel | Kind::PlacedOutcome | Kind::App,
                    payload,
                )) => {
                    records_end = at + frame::HEADER_LEN + payload.len();
                }
                _ => {
                    return Err(corrupt(
                        records_end,
                        "an entry with fewer records than it says",
                    ))
                }
            }
        }
        let payload = match head.0.kind {
            EntryKind::Blank => EntryPayload::Blank,
            EntryKind::Normal => EntryPayload::Normal(bytes[records_at..records_end].to_vec()),
            EntryKind::Membership => EntryPayload::Membership(head.1),
        };
        Ok(Entry {
            log_id: placed.log_id,
            payload,
        })
    }

    /// The queue of this replicated log's appends, cancels and outcomes, for its proposer: given once
    /// (`None` after, and for a single node).
    pub fn proposals(&self) -> Option<Proposals> {
        self.proposals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Lets entries up to `index` go: their WAL files are retired once every entry in them is applied
    /// and checkpointed (not at once: `entry_bounds` says when).
    pub fn purge_entries(&self, index: u64) -> Result<()> {
        self.entry_log()?.allow_purge(index);
        Ok(())
    }

    /// (The last entry purged, the last entry): the log holds every entry between them.
    pub fn entry_bounds(&self) -> Result<(Option<LogId>, Option<LogId>)> {
        Ok(self.entry_log()?.bounds())
    }

    /// The seq the first record of the next entry gets: where a new leader's [`EntryBuilder`]
    /// (crate::EntryBuilder) starts.
    pub fn next_entry_seq(&self) -> Result<u64> {
        Ok(self.entry_log()?.next_seq())
    }

    /// The last entry whose records the schedule holds (and the last membership applied): after an
    /// open, the checkpoint's; entries after it are applied again.
    pub fn applied_state(&self) -> Option<AppliedState> {
        self.wait_applied();
        self.shared.replay().applied.clone()
    }

    /// Waits (at most 10 s, as a lookup waits for filing, and not while a full disk holds the replayer
    /// up) until the replayer has taken in every entry applied so far, those without records too
    /// (which `wait_replayed`, by seq, does not see). Whether it has.
    pub(crate) fn wait_applied(&self) -> bool {
        let Some(target) = self.entry_log.as_ref().and_then(|log| log.applied_index()) else {
            return true;
        };
        let applied = |r: &Replay| r.applied.as_ref().is_some_and(|a| a.log_id.index >= target);
        let held_up = || self.shared.disk_full.held_up(Blocked::Replayer);
        applied(&self.wait_for_replayer(applied, held_up))
    }

    /// Applies committed entries, in order: their records go to the replayer, which files them into the
    /// schedule as a single node's are. Blocks while the replayer is behind (a bounded queue).
    pub fn apply_entries(&self, entries: Vec<Entry>) -> Result<()> {
        let log = self.entry_log()?;
        let Some(apply) = &self.apply else {
            return Err(Error::Append(AppendError::Closed));
        };
        for entry in entries {
            // The entry's bytes become the replayer's group as they are: no copy.
            let (bytes, membership) = match entry.payload {
                EntryPayload::Normal(frames) => (frames, None),
                EntryPayload::Membership(m) => (Vec::new(), Some(m)),
                EntryPayload::Blank => (Vec::new(), None),
            };
            // Application payloads are the application's: applied by it before this call.
            let entry::Records {
                records, outcomes, ..
            } = entry::records_of(&bytes).map_err(|why| {
                Error::InvalidOption(format!("entry {}: {why}", entry.log_id.index))
            })?;
            let next_seq = records.last().map(|r| r.seq() + 1);
            // Marked before the replayer has it, so that no cut can race it.
            log.apply(entry.log_id.index)
                .map_err(|why| Error::InvalidOption(format!("apply: {why}")))?;
            let group = CommittedGroup {
                bytes,
                records,
                entry: Some((entry.log_id, membership)),
                outcomes,
            };
            apply.send(group).map_err(|_| {
                let cause = self
                    .poisoned()
                    .unwrap_or_else(|| "the replayer stopped".into());
                Error::Append(AppendError::Poisoned(cause))
            })?;
            if let Some(next_seq) = next_seq {
                self.shared.committed.fetch_max(next_seq, Ordering::Release);
            }
        }
        Ok(())
    }
}
