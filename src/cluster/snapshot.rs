//! A member's snapshots (DESIGN.md §10): the data dir at one applied entry, taken by linking its
//! files, sent over the peer link a chunk at a time, and installed by swapping them in at a restart.
//!
//! ```text
//! {data}/raft/snapshots/{id}/        one snapshot: its files as links, and
//!   MANIFEST                          JSON: openraft's meta, then every file's path and length
//! {data}/raft/snapshots/{id}.partial  one being taken (a crash leaves it; the next take removes it)
//! {data}/raft/incoming/{id}/          one being received: the offered files, as much of each as came
//! {data}/raft/INSTALL                 JSON {"staged": "incoming/{id}", "carried": [top-level names]}:
//!                                     a received snapshot to swap in before the data dir is opened
//! ```
//!
//! A snapshot's files are the data dir's `meta`, `checkpoint` (written for it: schedulelog's
//! `link_snapshot`), `schedule/`, `dispatch/`, `schedules/`, `broker/` and `sources/` ([`CARRIED`]); not the WAL
//! (the Raft log, which starts after the snapshot) nor `raft/` (the member's own vote).
//!
//! Invariants:
//! - Taken on the state machine's task, so that no entry is applied meanwhile: the files are the
//!   effect of every entry up to `meta.last_log_id` and of no later one, except bytes appended after
//!   it to files the snapshot links, which its lengths leave out. Linking costs a link per file and
//!   holds the schedule's and the broker's locks only while it links: never while it is sent.
//! - The broker's and the schedule's checkpoints are linked before their data files, so that no file
//!   is shorter than a checkpoint says: the snapshot is what a crash at that moment would have left,
//!   which each store's recovery already handles (what the leader applied after it comes again as
//!   entries).
//! - Ids are unique per take (the applied entry, the taker, the time): bytes of two snapshots are
//!   never joined in one staged file. The newest [`KEEP`] snapshots are kept, older ones deleted.
//! - Received bytes are checked (CRC-32C per chunk, each file's exact length, paths that stay in
//!   [`CARRIED`]) and synced before openraft is told the snapshot arrived; a refused chunk is sent
//!   again from where the member is. A transfer cut off resumes: the next offer of the same snapshot
//!   answers how much of each file is staged. Staged bytes are trusted only by the process that
//!   wrote them (they are synced only once whole): a start removes what a stopped one staged. An
//!   offer the disk has no room for is refused.
//! - A member whose log reaches past a snapshot refuses it: installing drops its whole log, and
//!   entries past the snapshot that it acknowledged may be counted in a commit (Raft keeps them;
//!   this member waits for a newer snapshot, or for the entries).
//! - Installing writes `raft/INSTALL` (the commit point) and restarts the member at once, before it
//!   appends or acknowledges anything more: at start, [`finish_install`] swaps the staged files in,
//!   empties the WAL, and removes the marker last, so a crash anywhere in between swaps again. The
//!   marker is written only once every staged file is checked whole; from the moment a snapshot is
//!   received whole until openraft is done with it, no offer or chunk is taken (they could remove
//!   its staged files). An install refused at the last moment restarts the member without it.

use super::store::to_raft_log_id;
use super::{Member, TypeConfig};
use crate::cluster::rpc::{ChunkTaken, SnapshotChunk, SnapshotHave, SnapshotOffer};
use openraft::storage::Snapshot;
use openraft::{SnapshotMeta, StoredMembership};
use schedulelog::{sync_dir, write_atomically, ScheduleLog, TEMP_SUFFIX};
use serde::{Deserialize, Serialize};
use std::fs;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A snapshot's list of its files, in its directory.
pub const MANIFEST: &str = "MANIFEST";
/// The marker of a received snapshot to swap in, in the raft dir.
const INSTALL: &str = "INSTALL";
const SNAPSHOTS: &str = "snapshots";
const INCOMING: &str = "incoming";
const PARTIAL: &str = ".partial";
/// Snapshots kept: the newest, and any older one a transfer is still reading (`InUse`).
pub const KEEP: usize = 1;
/// How long after a failed take (a full disk) the newest snapshot stands without a new try.
const RETRY_TAKE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);
/// Free space an offer leaves on the member's disk, beyond the snapshot's bytes.
const STAGING_MARGIN: u64 = 64 << 20;
/// What one chunk carries at most.
pub const CHUNK_BYTES: usize = 1 << 20;
/// The data dir's files and directories a snapshot carries, by their top-level name.
pub const CARRIED: [&str; 7] = [
    "meta",
    "checkpoint",
    "schedule",
    "dispatch",
    "schedules",
    "broker",
    "sources",
];

/// One of a snapshot's files: its path under the snapshot's directory (and the data dir), and how
/// many of its bytes are the snapshot's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotFile {
    pub path: String,
    pub len: u64,
}

/// openraft's snapshot data: a directory holding the snapshot's files (taken, or received). While
/// one handed out by [`Snapshots`] lives (a transfer reads it), its directory is not pruned.
#[derive(Debug, Clone)]
pub struct SnapshotFiles {
    pub dir: PathBuf,
    pub files: Vec<SnapshotFile>,
    /// The hold on `dir` of a handle [`Snapshots`] gave out, shared by its clones.
    in_use: Option<Arc<PathBuf>>,
}

/// The snapshot directories handed out: those whose holds are still alive are in use.
type InUseDirs = Arc<Mutex<Vec<std::sync::Weak<PathBuf>>>>;

impl SnapshotFiles {
    pub fn new(dir: PathBuf, files: Vec<SnapshotFile>) -> SnapshotFiles {
        SnapshotFiles {
            dir,
            files,
            in_use: None,
        }
    }

    /// The same files, their directory in use (listed in `dirs`) while this handle or a clone lives.
    fn held_in(mut self, dirs: &InUseDirs) -> SnapshotFiles {
        let hold = Arc::new(self.dir.clone());
        let mut dirs = dirs.lock().unwrap_or_else(|p| p.into_inner());
        dirs.retain(|held| held.strong_count() > 0);
        dirs.push(Arc::downgrade(&hold));
        self.in_use = Some(hold);
        self
    }

    /// Every byte the snapshot's files hold.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.len).sum()
    }

    /// Up to [`CHUNK_BYTES`] of file `file` from `offset` (fewer at its end).
    pub fn read_chunk(&self, file: usize, offset: u64) -> io::Result<Vec<u8>> {
        let entry = self.files.get(file).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("no file {file}"))
        })?;
        let len = entry.len.saturating_sub(offset).min(CHUNK_BYTES as u64) as usize;
        let mut bytes = vec![0u8; len];
        let opened = fs::File::open(self.dir.join(&entry.path))?;
        opened.read_exact_at(&mut bytes, offset)?;
        Ok(bytes)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    meta: SnapshotMeta<u64, Member>,
    files: Vec<SnapshotFile>,
}

#[derive(Debug, Serialize, Deserialize)]
struct InstallMarker {
    staged: String,
    carried: Vec<String>,
}

/// Why a snapshot could not be taken, received or installed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Log(#[from] schedulelog::Error),
    #[error("linking the application's files: {0}")]
    App(String),
    #[error("{path}: not a snapshot manifest: {why}")]
    Manifest { path: PathBuf, why: String },
    /// A request of the sender that this member does not take: the text says why.
    #[error("{0}")]
    Refused(String),
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Links the application's own files (the broker's, the sources') into a snapshot's directory:
/// returns each one's path relative to it, and its length.
pub type AppFiles = Arc<dyn Fn(&Path) -> Result<Vec<(PathBuf, u64)>, String> + Send + Sync>;

/// What a member does once a received snapshot is ready to swap in (`raft/INSTALL` written): it
/// restarts (the process replaces itself), and never returns. Tests may do otherwise.
pub type OnInstall = Arc<dyn Fn() + Send + Sync>;

/// The snapshots of one member: taken from its log, received from a leader, installed.
#[derive(Clone)]
pub struct Snapshots {
    node_id: u64,
    log: Arc<ScheduleLog>,
    raft_dir: PathBuf,
    app: Option<AppFiles>,
    on_install: OnInstall,
    /// The snapshot being received, as its offer said.
    incoming: Arc<Mutex<Option<Incoming>>>,
    /// Set once a received snapshot is about to be installed: the log store acknowledges no append
    /// from then on (store.rs), since the restart drops the whole log.
    installing: Arc<AtomicBool>,
    /// Set while a snapshot received whole is handed to openraft ([`Installing`]).
    handing_over: Arc<AtomicBool>,
    /// When a take last failed: takes are not tried again for [`RETRY_TAKE_AFTER`].
    failed_take: Arc<Mutex<Option<std::time::Instant>>>,
    /// Snapshot directories handed out and still in use (a transfer reading one).
    in_use: InUseDirs,
}

impl std::fmt::Debug for Snapshots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshots")
            .field("node_id", &self.node_id)
            .field("raft_dir", &self.raft_dir)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct Incoming {
    meta: SnapshotMeta<u64, Member>,
    files: SnapshotFiles,
    /// This member has applied the snapshot's last entry already (it installed it, and restarted
    /// before its answer reached the leader): nothing is sent, nothing installed.
    held: bool,
}

/// A snapshot received whole (with the hold that keeps other transfers out until openraft is done
/// with it), or one this member holds already.
#[derive(Debug)]
pub enum Received {
    Whole(Snapshot<TypeConfig>, Installing),
    Held,
}

/// While it lives, this member takes no offer or chunk: a snapshot received whole is being
/// installed, and its staged files must stay as they are.
#[derive(Debug)]
pub struct Installing(Arc<AtomicBool>);

impl Drop for Installing {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Snapshots {
    /// The snapshots of member `node_id`, whose replicated log is `log` and Raft state `raft_dir`;
    /// `app` links the application's files into one.
    pub fn new(
        node_id: u64,
        log: Arc<ScheduleLog>,
        raft_dir: &Path,
        app: Option<AppFiles>,
        on_install: OnInstall,
    ) -> Snapshots {
        Snapshots {
            node_id,
            log,
            raft_dir: raft_dir.to_path_buf(),
            app,
            on_install,
            incoming: Arc::default(),
            installing: Arc::default(),
            handing_over: Arc::default(),
            failed_take: Arc::default(),
            in_use: InUseDirs::default(),
        }
    }

    /// Set while a received snapshot is being installed: the log store acknowledges nothing more.
    pub fn installing(&self) -> Arc<AtomicBool> {
        self.installing.clone()
    }

    fn root(&self) -> PathBuf {
        self.raft_dir.join(SNAPSHOTS)
    }

    /// Takes a snapshot of everything applied so far, or returns the newest one if it is of that
    /// already. Blocking; called where no entry is being applied (the state machine's task).
    pub fn take(&self) -> Result<Snapshot<TypeConfig>, SnapshotError> {
        let root = self.root();
        schedulelog::create_dir_durably(&root)?;
        let applied = self.log.applied_state().map(|a| to_raft_log_id(a.log_id));
        if let Some(newest) = self.current()? {
            if newest.meta.last_log_id == applied {
                return Ok(newest);
            }
        }
        for entry in fs::read_dir(&root).map_err(io_error(&root))? {
            let path = entry.map_err(io_error(&root))?.path();
            if path.to_string_lossy().ends_with(PARTIAL) {
                fs::remove_dir_all(&path).map_err(io_error(&path))?;
            }
        }
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let taking = root.join(format!("taking{PARTIAL}"));
        let linked = self.log.link_snapshot(&taking)?;
        let mut files = linked.files;
        if let Some(app) = &self.app {
            files.extend(app(&taking).map_err(SnapshotError::App)?);
        }
        sync_tree(&taking)?;
        let last_log_id = to_raft_log_id(linked.applied.log_id);
        let last_membership = match &linked.applied.membership {
            Some((id, bytes)) => {
                let membership = serde_json::from_slice(bytes).map_err(|e| {
                    SnapshotError::Refused(format!("the applied membership does not decode: {e}"))
                })?;
                StoredMembership::new(Some(to_raft_log_id(*id)), membership)
            }
            None => StoredMembership::default(),
        };
        let id = format!(
            "{}-{}-{}-{}-{now_ms}",
            last_log_id.index,
            last_log_id.leader_id.term,
            last_log_id.leader_id.node_id,
            self.node_id
        );
        let files: Vec<SnapshotFile> = files
            .into_iter()
            .map(|(path, len)| SnapshotFile {
                path: path.to_string_lossy().into_owned(),
                len,
            })
            .collect();
        let manifest = Manifest {
            meta: SnapshotMeta {
                last_log_id: Some(last_log_id),
                last_membership,
                snapshot_id: id.clone(),
            },
            files,
        };
        let json = serde_json::to_vec(&manifest).map_err(|e| SnapshotError::Manifest {
            path: taking.join(MANIFEST),
            why: e.to_string(),
        })?;
        write_atomically(&taking.join(MANIFEST), &json)?;
        let dir = root.join(&id);
        fs::rename(&taking, &dir).map_err(io_error(&dir))?;
        sync_dir(&root)?;
        self.prune()?;
        let bytes: u64 = manifest.files.iter().map(|f| f.len).sum();
        tracing::info!(snapshot = %id, files = manifest.files.len(), bytes, "took a snapshot");
        metrics::counter!("delayd_cluster_snapshots_taken_total").increment(1);
        metrics::gauge!("delayd_cluster_snapshot_bytes").set(bytes as f64);
        let files = SnapshotFiles::new(dir, manifest.files).held_in(&self.in_use);
        Ok(Snapshot {
            meta: manifest.meta,
            snapshot: Box::new(files),
        })
    }

    /// A snapshot of everything applied so far, or, when that cannot be taken (a full disk), the
    /// newest one: an error stops Raft, which a full disk should not. After a failed take none is
    /// tried for a while (openraft asks again at every commit meanwhile). An error only when there
    /// is no snapshot at all. Blocking.
    pub fn take_or_newest(&self) -> Result<Snapshot<TypeConfig>, SnapshotError> {
        let failed = *self.failed_take.lock().unwrap_or_else(|p| p.into_inner());
        if failed.is_some_and(|at| at.elapsed() < RETRY_TAKE_AFTER) {
            if let Some(newest) = self.current()? {
                return Ok(newest);
            }
        }
        match self.take() {
            Ok(snapshot) => {
                *self.failed_take.lock().unwrap_or_else(|p| p.into_inner()) = None;
                Ok(snapshot)
            }
            Err(error) => {
                tracing::error!(%error, "taking a snapshot failed; the newest one stands, and the log is not purged further until one is taken (tried again in a minute)");
                *self.failed_take.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(std::time::Instant::now());
                self.current()?.ok_or(error)
            }
        }
    }

    /// The newest snapshot taken, if any: not pruned while the handle lives.
    pub fn current(&self) -> Result<Option<Snapshot<TypeConfig>>, SnapshotError> {
        let newest = self.taken()?.pop();
        // Whole, or none: a file shorter than the manifest says (cut back by a crash) could not be
        // sent; a new snapshot is taken instead.
        let newest = newest.filter(|snapshot| {
            let whole = snapshot.snapshot.files.iter().all(|file| {
                fs::metadata(snapshot.snapshot.dir.join(&file.path)).is_ok_and(|m| m.len() >= file.len)
            });
            if !whole {
                tracing::warn!(snapshot = %snapshot.meta.snapshot_id, "the newest snapshot lacks bytes of its files: a new one will be taken");
            }
            whole
        });
        Ok(newest.map(|Snapshot { meta, snapshot }| Snapshot {
            meta,
            snapshot: Box::new(snapshot.held_in(&self.in_use)),
        }))
    }

    /// Every complete snapshot, oldest first (by applied index).
    fn taken(&self) -> Result<Vec<Snapshot<TypeConfig>>, SnapshotError> {
        let root = self.root();
        let entries = match fs::read_dir(&root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error(&root)(e)),
        };
        let mut taken = Vec::new();
        for entry in entries {
            let dir = entry.map_err(io_error(&root))?.path();
            if dir.to_string_lossy().ends_with(PARTIAL) {
                continue;
            }
            let path = dir.join(MANIFEST);
            let bytes = match fs::read(&path) {
                Ok(bytes) => bytes,
                // Taken part-way before a crash, or never finished: not a snapshot.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_error(&path)(e)),
            };
            let manifest: Manifest =
                serde_json::from_slice(&bytes).map_err(|e| SnapshotError::Manifest {
                    path: path.clone(),
                    why: e.to_string(),
                })?;
            taken.push(Snapshot {
                meta: manifest.meta,
                snapshot: Box::new(SnapshotFiles::new(dir, manifest.files)),
            });
        }
        taken.sort_by_cached_key(|s| {
            let index = s.meta.last_log_id.map_or(0, |id| id.index);
            (index, s.meta.snapshot_id.clone())
        });
        Ok(taken)
    }

    /// Deletes all but the newest [`KEEP`] snapshots, and those in use.
    fn prune(&self) -> Result<(), SnapshotError> {
        let taken = self.taken()?;
        let old = taken.len().saturating_sub(KEEP);
        let in_use: Vec<PathBuf> = (self.in_use.lock().unwrap_or_else(|p| p.into_inner()).iter())
            .filter_map(|held| held.upgrade().map(|dir| (*dir).clone()))
            .collect();
        for snapshot in taken.into_iter().take(old) {
            if in_use.contains(&snapshot.snapshot.dir) {
                continue;
            }
            // Out of sight first, atomically: a crash while its links go leaves a `.partial`, which
            // the next take removes, never a snapshot without all its files.
            let dir = &snapshot.snapshot.dir;
            let going = PathBuf::from(format!("{}{PARTIAL}", dir.display()));
            fs::rename(dir, &going).map_err(io_error(dir))?;
            fs::remove_dir_all(&going).map_err(io_error(&going))?;
        }
        Ok(())
    }

    /// A leader's offer: starts (or resumes) receiving its snapshot, and answers how much of each
    /// file is staged already. Blocking.
    pub fn offer(&self, offer: SnapshotOffer) -> Result<SnapshotHave, SnapshotError> {
        self.not_installing()?;
        let SnapshotOffer { meta, files, .. } = offer;
        let id = meta.snapshot_id.clone();
        if id.is_empty()
            || id.len() > 128
            || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(SnapshotError::Refused(format!(
                "snapshot id {id:?}: not [A-Za-z0-9-]{{1,128}}"
            )));
        }
        let Some(last) = meta.last_log_id else {
            return Err(SnapshotError::Refused(format!(
                "snapshot {id} holds no entry"
            )));
        };
        let applied = self.log.applied_state().map(|a| a.log_id.index);
        if let Some(applied) = applied.filter(|&applied| applied >= last.index) {
            tracing::info!(snapshot = %id, up_to = last.index, applied, "offered a snapshot this member has applied already");
            let have = files.iter().map(|(_, len)| *len).collect();
            *self.incoming.lock().unwrap_or_else(|p| p.into_inner()) = Some(Incoming {
                meta,
                files: SnapshotFiles::new(PathBuf::new(), Vec::new()),
                held: true,
            });
            return Ok(SnapshotHave { have });
        }
        if let Some(own_last) = self.reaches_past(last)? {
            return Err(SnapshotError::Refused(format!(
                "this member's log reaches entry {own_last}, past snapshot {id} (up to {}): it waits for a newer snapshot, or for entries",
                last.index
            )));
        }
        for needed in ["meta", "checkpoint"] {
            if !files.iter().any(|(path, _)| path == needed) {
                return Err(SnapshotError::Refused(format!(
                    "snapshot {id} has no {needed}: a data dir cannot be opened without it"
                )));
            }
        }
        let mut seen = std::collections::HashSet::new();
        for file in &files {
            if carried(&file.0).is_none() || !seen.insert(file.0.as_str()) {
                return Err(SnapshotError::Refused(format!(
                    "snapshot {id}: file {:?} is not one a snapshot carries, or comes twice",
                    file.0
                )));
            }
        }
        let incoming_root = self.raft_dir.join(INCOMING);
        schedulelog::create_dir_durably(&incoming_root)?;
        // One snapshot is received at a time: any other's staged files go.
        for entry in fs::read_dir(&incoming_root).map_err(io_error(&incoming_root))? {
            let path = entry.map_err(io_error(&incoming_root))?.path();
            if path.file_name().is_some_and(|name| *name != *id) {
                fs::remove_dir_all(&path).map_err(io_error(&path))?;
            }
        }
        let dir = incoming_root.join(&id);
        let mut have = Vec::with_capacity(files.len());
        for (path, len) in &files {
            let staged = dir.join(path);
            let held = match fs::metadata(&staged) {
                Ok(found) if found.len() <= *len => found.len(),
                // Longer than the file offered: not this snapshot's bytes; start it again.
                Ok(_) => {
                    fs::remove_file(&staged).map_err(io_error(&staged))?;
                    0
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
                Err(e) => return Err(io_error(&staged)(e)),
            };
            have.push(held);
        }
        let needed: u64 = files
            .iter()
            .zip(&have)
            .map(|((_, len), held)| len - held)
            .sum();
        let free =
            schedulelog::available_bytes(&incoming_root).map_err(io_error(&incoming_root))?;
        if needed.saturating_add(STAGING_MARGIN) > free {
            return Err(SnapshotError::Refused(format!(
                "snapshot {id} needs {needed} bytes more in {}, which has {free} free (and {STAGING_MARGIN} are kept free)",
                incoming_root.display()
            )));
        }
        let files = files
            .into_iter()
            .map(|(path, len)| SnapshotFile { path, len })
            .collect();
        *self.incoming.lock().unwrap_or_else(|p| p.into_inner()) = Some(Incoming {
            meta,
            files: SnapshotFiles::new(dir, files),
            held: false,
        });
        Ok(SnapshotHave { have })
    }

    /// Whether `files` can be swapped in now: this member's log does not go on past the snapshot's
    /// last entry (see `reaches_past`), and every staged file is there, whole.
    fn installable(
        &self,
        meta: &SnapshotMeta<u64, Member>,
        files: &SnapshotFiles,
    ) -> Result<(), SnapshotError> {
        if let Some(last) = meta.last_log_id {
            if let Some(own) = self.reaches_past(last)? {
                return Err(SnapshotError::Refused(format!(
                    "this member's log reached entry {own} while snapshot {} (up to {}) arrived",
                    meta.snapshot_id, last.index
                )));
            }
        }
        for file in &files.files {
            let path = files.dir.join(&file.path);
            let held = fs::metadata(&path).map_or(None, |m| Some(m.len()));
            if held != Some(file.len) {
                return Err(SnapshotError::Refused(format!(
                    "snapshot {}: {} is not staged whole ({held:?} of {} bytes)",
                    meta.snapshot_id,
                    path.display(),
                    file.len
                )));
            }
        }
        Ok(())
    }

    /// The last entry of this member's log if the log holds the snapshot's last entry `last` and
    /// goes on past it: those entries may have been acknowledged, and installing would drop them.
    /// (A log that holds another entry at that index, or none, has nothing past it that counts: a
    /// different entry at a committed index was never committed, nor was anything after it.)
    fn reaches_past(&self, last: openraft::LogId<u64>) -> Result<Option<u64>, SnapshotError> {
        let (purged, own_last) = self.log.entry_bounds()?;
        let Some(own_last) = own_last.filter(|l| l.index > last.index) else {
            return Ok(None);
        };
        // Purged up to it: the log's entry there is gone, and so is the question (a purged entry
        // is an applied one, which a snapshot past this member's applied state cannot hold).
        if purged.is_some_and(|p| p.index >= last.index) {
            return Ok(None);
        }
        let local = self.log.read_entries(last.index..last.index + 1)?;
        let local = local.first().map(|entry| to_raft_log_id(entry.log_id));
        Ok((local == Some(last)).then_some(own_last.index))
    }

    /// A chunk of the snapshot being received: taken if it is where the staged file ends and its
    /// CRC matches; the answer says where the file ends now either way. Blocking.
    pub fn chunk(&self, chunk: &SnapshotChunk) -> Result<ChunkTaken, SnapshotError> {
        self.not_installing()?;
        let incoming = self.incoming(&chunk.snapshot_id)?;
        if incoming.held {
            return Err(SnapshotError::Refused(format!(
                "snapshot {} is applied here already: nothing to send",
                chunk.snapshot_id
            )));
        }
        let file = incoming
            .files
            .files
            .get(chunk.file as usize)
            .ok_or_else(|| {
                SnapshotError::Refused(format!(
                    "snapshot {} has no file {}",
                    chunk.snapshot_id, chunk.file
                ))
            })?;
        let path = incoming.files.dir.join(&file.path);
        let have = match fs::metadata(&path) {
            Ok(found) => found.len(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            Err(e) => return Err(io_error(&path)(e)),
        };
        let end = chunk.offset.saturating_add(chunk.bytes.len() as u64);
        if end > file.len {
            return Err(SnapshotError::Refused(format!(
                "snapshot {}: a chunk of {} ends at byte {end}, past its {} bytes",
                chunk.snapshot_id, file.path, file.len
            )));
        }
        if chunk.offset != have {
            return Ok(ChunkTaken { have });
        }
        if crc32c::crc32c(&chunk.bytes) != chunk.crc {
            tracing::warn!(snapshot = %chunk.snapshot_id, file = %file.path, offset = chunk.offset, "a snapshot chunk's CRC does not match its bytes: refused, to be sent again");
            return Ok(ChunkTaken { have });
        }
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io_error(parent))?;
        }
        let staged = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io_error(&path))?;
        staged
            .write_all_at(&chunk.bytes, chunk.offset)
            .map_err(io_error(&path))?;
        Ok(ChunkTaken { have: end })
    }

    /// Refuses a transfer while a snapshot received whole is being installed.
    fn not_installing(&self) -> Result<(), SnapshotError> {
        let busy =
            self.handing_over.load(Ordering::SeqCst) || self.installing.load(Ordering::SeqCst);
        match busy {
            true => Err(SnapshotError::Refused(
                "a snapshot received whole is being installed here: try again later".into(),
            )),
            false => Ok(()),
        }
    }

    fn incoming(&self, id: &str) -> Result<Incoming, SnapshotError> {
        let incoming = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        match &*incoming {
            Some(open) if open.meta.snapshot_id == id => Ok(open.clone()),
            _ => Err(SnapshotError::Refused(format!(
                "snapshot {id} is not being received here: offer it first"
            ))),
        }
    }

    /// The snapshot being received, once every file is whole: synced, for openraft to install.
    /// Blocking.
    pub fn received(&self, id: &str) -> Result<Received, SnapshotError> {
        let incoming = self.incoming(id)?;
        if incoming.held {
            return Ok(Received::Held);
        }
        if self.handing_over.swap(true, Ordering::SeqCst) {
            return Err(SnapshotError::Refused(
                "a snapshot received whole is being installed here already".into(),
            ));
        }
        let hold = Installing(self.handing_over.clone());
        let dir = &incoming.files.dir;
        let mut dirs = std::collections::BTreeSet::from([dir.clone()]);
        for file in &incoming.files.files {
            let path = dir.join(&file.path);
            let staged = match fs::File::open(&path) {
                Ok(staged) => staged,
                // An empty file has no chunk: it is made here.
                Err(e) if e.kind() == io::ErrorKind::NotFound && file.len == 0 => {
                    if let Some(parent) = path.parent() {
                        fs::create_dir_all(parent).map_err(io_error(parent))?;
                    }
                    fs::File::create(&path).map_err(io_error(&path))?
                }
                Err(e) => return Err(io_error(&path)(e)),
            };
            let held = staged.metadata().map_err(io_error(&path))?.len();
            if held != file.len {
                return Err(SnapshotError::Refused(format!(
                    "snapshot {id}: {} has {held} of its {} bytes",
                    file.path, file.len
                )));
            }
            staged.sync_all().map_err(io_error(&path))?;
            let mut parent = path.parent();
            while let Some(p) = parent.filter(|p| p.starts_with(dir)) {
                dirs.insert(p.to_path_buf());
                parent = p.parent();
            }
        }
        for dir in dirs.iter().rev() {
            sync_dir(dir)?;
        }
        let snapshot = Snapshot {
            meta: incoming.meta,
            snapshot: Box::new(incoming.files),
        };
        Ok(Received::Whole(snapshot, hold))
    }

    /// Lets go of snapshot `id`, received whole, when openraft did not install it (this member had
    /// applied its entries meanwhile): its staged files go. Another snapshot's are left alone.
    pub fn discard_incoming(&self, id: &str) -> Result<(), SnapshotError> {
        let mut incoming = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        let ours = incoming
            .as_ref()
            .is_some_and(|open| open.meta.snapshot_id == id && !open.held);
        match incoming.take_if(|_| ours) {
            Some(open) => remove_any(&open.files.dir),
            None => Ok(()),
        }
    }

    /// Installs a received snapshot: marks it to be swapped in (the commit point), then restarts
    /// this member (`on_install`). Blocking.
    pub fn install(
        &self,
        meta: &SnapshotMeta<u64, Member>,
        files: &SnapshotFiles,
    ) -> Result<(), SnapshotError> {
        // No append is acknowledged from here on; every one that was is handed in already, so the
        // log's last entry says whether this member acknowledged anything past the snapshot, which
        // the restart would drop: then it does not install (Raft stops, the member restarts without
        // the snapshot, and refuses it while its log reaches past it).
        self.installing.store(true, Ordering::SeqCst);
        if let Err(refused) = self.installable(meta, files) {
            // openraft moved its state on already: this member restarts as it is (its staged files
            // are removed at the start) rather than go on in a state it does not have.
            tracing::warn!(%refused, "a snapshot received whole is not installed: this member restarts without it");
            (self.on_install)();
            return Err(refused);
        }
        let staged = files
            .dir
            .strip_prefix(&self.raft_dir)
            .map_err(|_| {
                SnapshotError::Refused(format!(
                    "snapshot {} is not staged in {}",
                    meta.snapshot_id,
                    self.raft_dir.display()
                ))
            })?
            .to_string_lossy()
            .into_owned();
        let mut carried_names: Vec<String> = files
            .files
            .iter()
            .filter_map(|f| carried(&f.path).map(|top| top.to_string()))
            .collect();
        carried_names.sort();
        carried_names.dedup();
        let marker = InstallMarker {
            staged,
            carried: carried_names,
        };
        let json = serde_json::to_vec(&marker).map_err(|e| SnapshotError::Manifest {
            path: self.raft_dir.join(INSTALL),
            why: e.to_string(),
        })?;
        write_atomically(&self.raft_dir.join(INSTALL), &json)?;
        tracing::info!(
            snapshot = %meta.snapshot_id,
            up_to = ?meta.last_log_id.map(|id| id.index),
            bytes = files.bytes(),
            "received a snapshot: this member restarts to swap it in"
        );
        (self.on_install)();
        Ok(())
    }
}

/// The top-level name of `path` if it is a relative path a snapshot may carry: plain components
/// under one of [`CARRIED`], no temporary file.
fn carried(path: &str) -> Option<&'static str> {
    let mut parts = path.split('/');
    let top = parts.next()?;
    let top = CARRIED.into_iter().find(|c| *c == top)?;
    // `meta` and `checkpoint` are files; the others directories, which hold files.
    let file = matches!(top, "meta" | "checkpoint");
    if file == path.contains('/') {
        return None;
    }
    let rest_ok = parts.all(|p| !p.is_empty() && p != "." && p != ".." && !p.contains('\0'));
    let plain = path.len() <= 1024 && !path.ends_with(TEMP_SUFFIX) && !path.contains('\0');
    (rest_ok && plain).then_some(top)
}

/// Links every file under `data_dir/relative` (recursively, but for temporary files) into `into`,
/// at the same relative path: in each directory a `checkpoint` first, then the other files, then
/// its subdirectories (a store's checkpoint before the files it speaks of). Returns each file's
/// relative path and its length when linked. A directory that does not exist links nothing, and a
/// file deleted between the listing and its link is left out (the broker's retention deletes whole
/// files, the oldest first, which its recovery takes as done).
pub fn link_tree(
    data_dir: &Path,
    relative: &Path,
    into: &Path,
) -> Result<Vec<(PathBuf, u64)>, SnapshotError> {
    let from = data_dir.join(relative);
    let entries = match fs::read_dir(&from) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_error(&from)(e)),
    };
    let (mut files, mut dirs) = (Vec::new(), Vec::new());
    for entry in entries {
        let entry = entry.map_err(io_error(&from))?;
        let name = entry.file_name();
        if name.to_string_lossy().ends_with(TEMP_SUFFIX) {
            continue;
        }
        let kind = entry.file_type().map_err(io_error(&entry.path()))?;
        if kind.is_dir() {
            dirs.push(name);
        } else if kind.is_file() {
            files.push(name);
        }
    }
    files.sort_by_key(|name| (name != "checkpoint", name.clone()));
    dirs.sort();
    fs::create_dir_all(into.join(relative)).map_err(io_error(&into.join(relative)))?;
    let mut linked = Vec::new();
    for name in files {
        let path = relative.join(&name);
        let (source, target) = (data_dir.join(&path), into.join(&path));
        match fs::hard_link(&source, &target) {
            Ok(()) => {}
            // Deleted since it was listed (retention, which deletes whole files, oldest first,
            // off the stores' locks): as if it had gone a moment earlier.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_error(&target)(e)),
        }
        let len = fs::metadata(&target).map_err(io_error(&target))?.len();
        linked.push((path, len));
    }
    for name in dirs {
        linked.extend(link_tree(data_dir, &relative.join(name), into)?);
    }
    Ok(linked)
}

/// Swaps in a received snapshot marked for install (`raft/INSTALL`), before the data dir is opened:
/// the carried files and directories replace the data dir's, the WAL goes (the Raft log starts
/// after the snapshot), and so do this member's own older snapshots. Idempotent: a crash part-way
/// leaves the marker, and the next start finishes. Whether there was one.
pub fn finish_install(data_dir: &Path, raft_dir: &Path) -> Result<bool, SnapshotError> {
    let marker_path = raft_dir.join(INSTALL);
    let bytes = match fs::read(&marker_path) {
        Ok(bytes) => bytes,
        // A transfer cut by a stop: its staged bytes were never synced, so none is trusted (the
        // leader sends the snapshot again, whole).
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            remove_any(&raft_dir.join(INCOMING))?;
            return Ok(false);
        }
        Err(e) => return Err(io_error(&marker_path)(e)),
    };
    let marker: InstallMarker =
        serde_json::from_slice(&bytes).map_err(|e| SnapshotError::Manifest {
            path: marker_path.clone(),
            why: e.to_string(),
        })?;
    let staged_ok = marker.staged.strip_prefix("incoming/").is_some_and(|id| {
        !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    });
    if !staged_ok {
        return Err(SnapshotError::Manifest {
            path: marker_path,
            why: format!("{:?} is no staged snapshot", marker.staged),
        });
    }
    let staged = raft_dir.join(&marker.staged);
    for name in CARRIED {
        let (from, to) = (staged.join(name), data_dir.join(name));
        if from.exists() {
            remove_any(&to)?;
            fs::rename(&from, &to).map_err(io_error(&to))?;
        } else if !marker.carried.iter().any(|c| c == name) {
            remove_any(&to)?;
        }
    }
    remove_any(&data_dir.join("wal"))?;
    remove_any(&raft_dir.join(SNAPSHOTS))?;
    sync_dir(data_dir)?;
    fs::remove_file(&marker_path).map_err(io_error(&marker_path))?;
    sync_dir(raft_dir)?;
    remove_any(&raft_dir.join(INCOMING))?;
    tracing::info!(staged = %marker.staged, "swapped in the snapshot this member received");
    metrics::counter!("delayd_cluster_snapshots_installed_total").increment(1);
    Ok(true)
}

/// Syncs `dir` and every directory under it: the links made in them are durable.
fn sync_tree(dir: &Path) -> Result<(), SnapshotError> {
    for entry in fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        if entry.file_type().map_err(io_error(&entry.path()))?.is_dir() {
            sync_tree(&entry.path())?;
        }
    }
    sync_dir(dir)?;
    Ok(())
}

/// Removes a file or a directory tree, if there is one.
fn remove_any(path: &Path) -> Result<(), SnapshotError> {
    let removed = match fs::symlink_metadata(path) {
        Ok(found) if found.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    removed.map_err(io_error(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::rpc::SnapshotOffer;
    use openraft::{LeaderId, LogId, Membership, Vote};
    use std::collections::{BTreeMap, BTreeSet};

    fn replicated(dir: &Path) -> Arc<ScheduleLog> {
        let options = schedulelog::Options {
            replicated: true,
            ..Default::default()
        };
        Arc::new(ScheduleLog::open(dir.join("data"), options).unwrap())
    }

    /// A membership entry at index 0 and blank ones up to `last`, appended and applied.
    fn applied_up_to(log: &ScheduleLog, last: u64) {
        let member = Member {
            api: "http://127.0.0.1:7071".into(),
            peer: "127.0.0.1:7171".into(),
        };
        let membership = Membership::new(
            vec![BTreeSet::from([1u64])],
            BTreeMap::from([(1u64, member)]),
        );
        let id = |index| schedulelog::LogId {
            term: 1,
            node_id: 1,
            index,
        };
        let mut entries = vec![schedulelog::Entry {
            log_id: id(0),
            payload: schedulelog::EntryPayload::Membership(
                serde_json::to_vec(&membership).unwrap(),
            ),
        }];
        entries.extend((1..=last).map(|index| schedulelog::Entry {
            log_id: id(index),
            payload: schedulelog::EntryPayload::Blank,
        }));
        let from = log.entry_bounds().unwrap().1.map_or(0, |l| l.index + 1);
        let entries: Vec<_> = entries.into_iter().skip(from as usize).collect();
        log.append_entries(entries.clone()).wait().unwrap();
        log.apply_entries(entries).unwrap();
    }

    fn snapshots(dir: &Path, log: Arc<ScheduleLog>) -> Snapshots {
        Snapshots::new(1, log, &dir.join("raft"), None, Arc::new(|| {}))
    }

    fn offer(id: &str, last: u64, files: &[(&str, u64)]) -> SnapshotOffer {
        SnapshotOffer {
            vote: Vote::new_committed(2, 2),
            meta: SnapshotMeta {
                last_log_id: Some(LogId::new(LeaderId::new(2, 2), last)),
                last_membership: StoredMembership::default(),
                snapshot_id: id.into(),
            },
            files: files.iter().map(|(p, l)| (p.to_string(), *l)).collect(),
        }
    }

    #[test]
    fn a_snapshot_is_taken_once_per_applied_entry_and_the_newest_and_those_in_use_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let log = replicated(dir.path());
        let snapshots = snapshots(dir.path(), log.clone());
        assert!(snapshots.current().unwrap().is_none());
        applied_up_to(&log, 3);
        let first = snapshots.take().unwrap();
        assert_eq!(first.meta.last_log_id.map(|id| id.index), Some(3));
        assert_eq!(
            first.meta.last_membership.log_id().map(|id| id.index),
            Some(0)
        );
        let paths: Vec<&str> = first
            .snapshot
            .files
            .iter()
            .map(|f| f.path.as_str())
            .collect();
        assert!(
            paths.contains(&"checkpoint") && paths.contains(&"meta"),
            "{paths:?}"
        );
        assert!(first.snapshot.dir.join(MANIFEST).exists());
        // Nothing applied since: the same snapshot.
        let again = snapshots.take().unwrap();
        assert_eq!(again.meta.snapshot_id, first.meta.snapshot_id);
        let indexes = |snapshots: &Snapshots| -> Vec<u64> {
            let taken = snapshots.taken().unwrap();
            taken
                .iter()
                .map(|s| s.meta.last_log_id.unwrap().index)
                .collect()
        };
        // A snapshot being sent (its handle alive) is kept beside the newest; once let go, the
        // next take prunes it.
        applied_up_to(&log, 5);
        drop(snapshots.take().unwrap());
        assert_eq!(indexes(&snapshots), vec![3, 5], "3 is in use");
        let first_dir = first.snapshot.dir.clone();
        drop((first, again));
        applied_up_to(&log, 7);
        drop(snapshots.take().unwrap());
        assert_eq!(indexes(&snapshots), vec![7], "the newest alone");
        assert!(!first_dir.exists(), "the oldest went");
    }

    #[test]
    fn offers_that_could_not_be_installed_safely_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let log = replicated(dir.path());
        applied_up_to(&log, 9);
        let snapshots = snapshots(dir.path(), log);
        let refused = |offer: SnapshotOffer| match snapshots.offer(offer) {
            Err(SnapshotError::Refused(why)) => why,
            other => panic!("{other:?}"),
        };
        assert!(refused(offer("../x", 20, &[])).contains("not [A-Za-z0-9-]"));
        for path in [
            "schedule",
            "meta/x",
            "../etc/passwd",
            "/etc/passwd",
            "wal/00000000000000000001.wal",
            "raft/vote",
            "schedule/../../x",
            "schedule//x",
            "checkpoint.tmp~",
            "",
        ] {
            let why = refused(offer(
                "20-2-2-2-1",
                20,
                &[("meta", 1), ("checkpoint", 1), (path, 1)],
            ));
            assert!(
                why.contains("is not one a snapshot carries"),
                "{path}: {why}"
            );
        }
        let twice = refused(offer(
            "20-2-2-2-1",
            20,
            &[("meta", 1), ("checkpoint", 1), ("meta", 1)],
        ));
        assert!(twice.contains("comes twice"), "{twice}");
        let without = refused(offer("20-2-2-2-1", 20, &[("meta", 1)]));
        assert!(without.contains("has no checkpoint"), "{without}");
        // The member's log reaches entry 9, past a snapshot of entry 8... which it has applied.
        let have = snapshots
            .offer(offer("8-2-2-2-1", 8, &[("meta", 3)]))
            .unwrap();
        assert_eq!(have.have, vec![3], "held already: nothing to send");
        assert!(matches!(
            snapshots.received("8-2-2-2-1").unwrap(),
            Received::Held
        ));
    }

    #[test]
    fn a_log_holding_the_snapshots_entry_and_more_refuses_it_a_diverging_one_takes_it() {
        let dir = tempfile::tempdir().unwrap();
        let log = replicated(dir.path());
        applied_up_to(&log, 2);
        // Entries 3 to 5 in the log, not applied (not known committed).
        let more: Vec<_> = (3..=5)
            .map(|index| schedulelog::Entry {
                log_id: schedulelog::LogId {
                    term: 1,
                    node_id: 1,
                    index,
                },
                payload: schedulelog::EntryPayload::Blank,
            })
            .collect();
        log.append_entries(more).wait().unwrap();
        let snapshots = snapshots(dir.path(), log);
        // The snapshot's entry 4 is the one this log holds: 5 may have been acknowledged.
        let whole = [("meta", 1), ("checkpoint", 1)];
        let mut same = offer("4-1-1-2-1", 4, &whole);
        same.meta.last_log_id = Some(LogId::new(LeaderId::new(1, 1), 4));
        match snapshots.offer(same) {
            Err(SnapshotError::Refused(why)) => assert!(why.contains("reaches entry 5"), "{why}"),
            other => panic!("{other:?}"),
        }
        // Another entry 4 (a later term's): this log's 4 and 5 were never committed.
        let have = snapshots.offer(offer("4-2-2-2-1", 4, &whole)).unwrap();
        assert_eq!(have.have, vec![0, 0]);
    }

    /// The swap at start: the staged files replace the data dir's, the WAL and own snapshots go;
    /// interrupted part-way (some names moved already), the next start finishes it.
    #[test]
    fn an_install_interrupted_part_way_is_finished_at_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        let (data, raft) = (dir.path().join("data"), dir.path().join("data/raft"));
        for (path, text) in [
            ("meta", "old meta"),
            ("checkpoint", "old checkpoint"),
            ("schedule/old.log", "old segment"),
            ("sources/in", "old mark"),
            ("wal/00000000000000000001.wal", "old wal"),
            ("raft/vote", "the vote"),
            ("raft/snapshots/1-1-1-1-1/MANIFEST", "{}"),
            ("raft/incoming/9-2-2-2-1/meta", "new meta"),
            ("raft/incoming/9-2-2-2-1/checkpoint", "new checkpoint"),
            ("raft/incoming/9-2-2-2-1/schedule/new.log", "new segment"),
            ("raft/incoming/9-2-2-2-1/broker/commitlog/0", "new broker"),
        ] {
            let path = data.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        let marker = InstallMarker {
            staged: "incoming/9-2-2-2-1".into(),
            carried: ["broker", "checkpoint", "meta", "schedule"]
                .map(String::from)
                .to_vec(),
        };
        write_atomically(&raft.join(INSTALL), &serde_json::to_vec(&marker).unwrap()).unwrap();
        // Interrupted after `meta` and `checkpoint` moved in.
        for name in ["meta", "checkpoint"] {
            fs::remove_file(data.join(name)).unwrap();
            fs::rename(raft.join("incoming/9-2-2-2-1").join(name), data.join(name)).unwrap();
        }
        assert!(finish_install(&data, &raft).unwrap());
        let read = |path: &str| fs::read_to_string(data.join(path)).ok();
        assert_eq!(read("meta").as_deref(), Some("new meta"));
        assert_eq!(read("checkpoint").as_deref(), Some("new checkpoint"));
        assert_eq!(read("schedule/new.log").as_deref(), Some("new segment"));
        assert_eq!(read("schedule/old.log"), None);
        assert_eq!(read("broker/commitlog/0").as_deref(), Some("new broker"));
        assert_eq!(
            read("sources/in"),
            None,
            "not carried: the snapshot had none"
        );
        assert!(
            !data.join("wal").exists(),
            "the log starts after the snapshot"
        );
        assert_eq!(
            read("raft/vote").as_deref(),
            Some("the vote"),
            "the vote stays"
        );
        assert!(!raft.join("snapshots").exists() && !raft.join("incoming").exists());
        assert!(!raft.join(INSTALL).exists());
        assert!(!finish_install(&data, &raft).unwrap(), "nothing left to do");
    }
}
