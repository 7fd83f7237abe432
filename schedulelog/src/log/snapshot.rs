//! A replicated data dir's part of a cluster snapshot (DESIGN.md §10): the schedule as it is at one
//! moment, linked into a directory of its own, for the cluster layer to stream to a member.
//!
//! ```text
//! {dir}/meta                       hard link of the data dir's meta
//! {dir}/checkpoint                 written: the checkpoint of the linked files (below)
//! {dir}/schedule/{bucket}.log|idx  hard links of every segment the checkpoint lists
//! {dir}/dispatch/{bucket}.log      hard links of their dispatch logs
//! {dir}/schedules/definitions      written: the schedule table as of the checkpoint (schedules.rs)
//! {dir}/schedules/progress
//! ```
//!
//! Invariants:
//! - Taken under the replayer's lock, once it has filed and checkpointed every entry applied so far:
//!   no record is filed and no bucket retired meanwhile, and the checkpoint written lists exactly the
//!   segments linked, at their marks, which the data dir's own checkpoint holds too (so a restart,
//!   which cuts segments back to it in place, never cuts a linked file below its length).
//! - The checkpoint's `purged` is its `applied` entry: a data dir restored from the snapshot holds
//!   every entry's effect up to it, and its Raft log starts after it (its WAL is empty).
//! - Links, not copies: taking one costs a link per file, whatever the data's size. A linked file
//!   the log appends to later grows under the link too, so each file's length is the snapshot's
//!   (what to send); a file the log deletes (retirement) stays as long as the link does.
//! - A dispatch log is linked only with its segment: a bucket retired between the two removals is
//!   left out whole.

use super::ScheduleLog;
use crate::checkpoint::{AppliedState, Checkpoint};
use crate::error::{Error, Result};
use crate::header::{create_dir_durably, HEADER_LEN};
use crate::segment::{self, INDEX_ENTRY_LEN};
use crate::{dispatch, header};
use std::fs;
use std::path::{Path, PathBuf};

/// What [`ScheduleLog::link_snapshot`] linked.
#[derive(Debug, Clone)]
pub struct LinkedSchedule {
    /// The last entry the linked files hold (and its membership).
    pub applied: AppliedState,
    /// Each file, relative to the snapshot's directory, and how many of its bytes are the snapshot's.
    pub files: Vec<(PathBuf, u64)>,
}

impl ScheduleLog {
    /// Links the schedule's files into `dir` (which must not exist yet) as they are now, with a
    /// checkpoint of them: see the module's invariants. Fails on a single node's log, and before any
    /// entry was applied.
    pub fn link_snapshot(&self, dir: &Path) -> Result<LinkedSchedule> {
        if self.entry_log.is_none() {
            return Err(Error::InvalidOption(
                "only a replicated data dir has snapshots".into(),
            ));
        }
        // Every entry applied so far is filed, synced and checkpointed before the lock is taken (and
        // none is applied while the caller, the state machine, takes the snapshot): the data dir's
        // own checkpoint then holds the lengths linked, so a restart never cuts a segment (in place,
        // through the snapshot's links too) below them.
        self.checkpoint()?;
        let replay = self.shared.replay();
        let Some(applied) = replay.applied.clone() else {
            return Err(Error::InvalidOption(
                "no entry is applied yet: nothing to snapshot".into(),
            ));
        };
        let checkpoint = Checkpoint {
            next_seq: replay.next_seq,
            segments: replay.written_marks(),
            applied: Some(AppliedState {
                purged: Some(applied.log_id),
                ..applied.clone()
            }),
        };
        let data_dir = &self.shared.data_dir;
        for sub in ["schedule", "dispatch"] {
            create_dir_durably(&dir.join(sub))?;
        }
        let mut files = Vec::new();
        let mut link = |relative: PathBuf, len: u64| -> Result<()> {
            let (from, to) = (data_dir.join(&relative), dir.join(&relative));
            fs::hard_link(&from, &to).map_err(Error::io(&to))?;
            files.push((relative, len));
            Ok(())
        };
        let meta_len = fs::metadata(data_dir.join("meta"))
            .map_err(Error::io(data_dir.join("meta")))?
            .len();
        link(PathBuf::from("meta"), meta_len)?;
        let (schedule, dispatch_dir) = (Path::new("schedule"), Path::new("dispatch"));
        for (&bucket, mark) in &checkpoint.segments {
            let index_len = HEADER_LEN as u64 + mark.entries * INDEX_ENTRY_LEN as u64;
            link(segment::log_path(schedule, bucket), mark.log_len)?;
            link(segment::index_path(schedule, bucket), index_len)?;
            let outcomes = dispatch::path(dispatch_dir, bucket);
            match fs::metadata(data_dir.join(&outcomes)) {
                Ok(found) => link(outcomes, found.len())?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(data_dir.join(&outcomes))(e)),
            }
        }
        // Written, not linked (its files are replaced whole, and may lag the checkpoint): the table as
        // of `next_seq`, which every file here holds.
        let table = replay.schedules.lock().unwrap_or_else(|p| p.into_inner());
        let table_files = table.all_files(dir);
        drop(table);
        drop(replay);
        for (name, len) in table_files.store()? {
            files.push((Path::new(crate::schedules::DIR).join(name), len));
        }
        for sub in ["schedule", "dispatch"] {
            header::sync_dir(&dir.join(sub))?;
        }
        let written = checkpoint.encode(self.shared.width);
        header::write_atomically(&dir.join("checkpoint"), &written)?;
        files.push((PathBuf::from("checkpoint"), written.len() as u64));
        Ok(LinkedSchedule { applied, files })
    }
}
