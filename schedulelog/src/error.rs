//! Error types of the storage engine.
//!
//! [`Error`] is what opening, reading and maintenance return; it names the file (and for corruption the
//! offset) so an operator can find the bad bytes. [`AppendError`] is what a submitter of the WAL gets back:
//! it is `Clone` because one failed group commit answers every submitter of that group.
//!
//! Two kinds of I/O failure are kept apart, because they call for opposite answers:
//! - a full disk (`ENOSPC`, `EDQUOT`) on a write, create, rename or file growth ([`Error::is_disk_full`])
//!   changed nothing durable and can be tried again once space is freed;
//! - a failed `fsync`/`fdatasync` ([`Error::Sync`]) may have dropped dirty pages the kernel then marks
//!   clean, so a later sync can succeed over lost data. It is never retried and never counts as a full
//!   disk, whatever its errno.

use std::io;
use std::path::PathBuf;
use std::sync::Mutex;

/// A failure of the storage engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// An `fsync`/`fdatasync` failed: the data written to `path` since its last sync may be lost.
    #[error("fsync of {path} failed: {source}")]
    Sync {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("corrupt log {path} at offset {offset}: {reason}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("data dir {0} is in use by another process (LOCK is held)")]
    Locked(PathBuf),
    #[error(
        "data dir was created with segment_minutes = {stored}, but {configured} is configured; \
         the bucket width is fixed for a data dir"
    )]
    SegmentMinutesMismatch { stored: u16, configured: u16 },
    #[error("invalid option: {0}")]
    InvalidOption(String),
    #[error(transparent)]
    Append(#[from] AppendError),
    /// The record was acknowledged but is not filed into its segment yet, and the replayer is held up
    /// (by a full disk, named in `cause`) or slow: a lookup would not find it. Ask again later.
    #[error("the record is acknowledged but not filed yet{}", cause.as_deref().map(|c| format!(": {c}")).unwrap_or_default())]
    NotFiledYet { cause: Option<String> },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }

    /// Maps the error of an `fsync`/`fdatasync` of `path`.
    pub(crate) fn sync(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
        let path = path.into();
        move |source| Error::Sync { path, source }
    }

    /// Whether this is a full disk (or an exhausted quota) met while writing, creating, renaming or
    /// growing a file: nothing it failed to do was promised to anyone, and the same work may succeed once
    /// space is freed. Never true for a failed sync ([`Error::Sync`]), whatever its errno: a sync that
    /// failed may have lost data already written.
    pub fn is_disk_full(&self) -> bool {
        match self {
            Error::Io { source, .. } => is_disk_full(source),
            Error::Append(AppendError::DiskFull) => true,
            _ => false,
        }
    }

    /// Whether a sync failed: the one failure after which nothing written may be trusted to be durable.
    pub(crate) fn is_sync_failure(&self) -> bool {
        matches!(self, Error::Sync { .. })
    }

    /// For a full disk, what [`crate::ScheduleLog::disk_full`] says about it: the file and the OS error.
    pub(crate) fn disk_full_cause(&self) -> Option<String> {
        match self {
            Error::Io { path, source } if is_disk_full(source) => Some(format!(
                "no space left writing {}: {source}",
                path.display()
            )),
            Error::Append(AppendError::DiskFull) => Some(AppendError::DiskFull.to_string()),
            _ => None,
        }
    }

    /// The same error again, for each caller of a group commit that failed (group.rs). An OS error keeps
    /// its code, so [`Error::is_disk_full`] answers alike for the copy.
    pub(crate) fn duplicate(&self) -> Error {
        let copy = |e: &io::Error| match e.raw_os_error() {
            Some(code) => io::Error::from_raw_os_error(code),
            None => io::Error::new(e.kind(), e.to_string()),
        };
        match self {
            Error::Io { path, source } => Error::Io {
                path: path.clone(),
                source: copy(source),
            },
            Error::Sync { path, source } => Error::Sync {
                path: path.clone(),
                source: copy(source),
            },
            Error::Corrupt {
                path,
                offset,
                reason,
            } => Error::Corrupt {
                path: path.clone(),
                offset: *offset,
                reason: reason.clone(),
            },
            Error::Locked(path) => Error::Locked(path.clone()),
            Error::SegmentMinutesMismatch { stored, configured } => Error::SegmentMinutesMismatch {
                stored: *stored,
                configured: *configured,
            },
            Error::InvalidOption(what) => Error::InvalidOption(what.clone()),
            Error::Append(e) => Error::Append(e.clone()),
            Error::NotFiledYet { cause } => Error::NotFiledYet {
                cause: cause.clone(),
            },
        }
    }

    pub(crate) fn corrupt(
        path: impl Into<PathBuf>,
        offset: u64,
        reason: impl Into<String>,
    ) -> Error {
        metrics::counter!("delayd_log_corruptions_total").increment(1);
        Error::Corrupt {
            path: path.into(),
            offset,
            reason: reason.into(),
        }
    }
}

/// Why an append (or cancel) was not made durable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppendError {
    /// A write or fsync of the WAL failed earlier; nothing more is accepted until restart.
    #[error("the log is poisoned after a failed write or fsync ({0}); restart the process")]
    Poisoned(String),
    /// No space for the next WAL segment. Nothing of this group was written; later appends may succeed.
    #[error("disk full: no space for the next WAL segment")]
    DiskFull,
    /// Too many requests are waiting for the disk; try again shortly.
    #[error("overloaded: too many appends are waiting for the disk")]
    Overloaded,
    /// The log is shutting down.
    #[error("the log is closed")]
    Closed,
    /// A replicated log's write reached a member that does not lead the cluster (the leader, when
    /// known): nothing was proposed.
    #[error("this member does not lead the cluster (the leader is {leader:?})")]
    NotLeader { leader: Option<u64> },
    /// A replicated log's write was proposed, but no quorum took it in time: it may still take effect.
    /// Every record of it has a seq below `seqs_below` (the end of the entry it was proposed in), so
    /// once the log has filed that far it is known whether it did.
    #[error("no quorum took the write in time; it may still take effect")]
    Uncertain { seqs_below: u64 },
    /// A request this log does not take: Raft entries that do not continue it, or one too large for a
    /// WAL file; a plain append to a replicated log, or entries to a single node's. Nothing was written.
    #[error("refused: {0}")]
    Refused(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `ENOSPC` or `EDQUOT`.
fn is_disk_full(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
    )
}

/// A writer of the engine that a full disk can hold up; each reports for itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blocked {
    /// The replayer, retrying a committed group or a checkpoint.
    Replayer,
    /// The WAL writer, whose last rollover found no space.
    WalRoll,
}

/// Which writers are held up by a full disk right now, and why: what `ScheduleLog::disk_full` reports.
/// Each writer sets its cause when a try fails and clears it when a try succeeds.
#[derive(Debug, Default)]
pub(crate) struct DiskFullReport {
    causes: Mutex<[Option<String>; 2]>,
    /// The replayer is held up and its backlog is at its bound: the writer refuses new requests with
    /// `DiskFull` rather than commit groups it could not hand over (it would block, and every request
    /// behind it would wait instead of being answered).
    backlog_full: std::sync::atomic::AtomicBool,
}

impl DiskFullReport {
    pub(crate) fn set_backlog_full(&self, full: bool) {
        self.backlog_full
            .store(full, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn backlog_full(&self) -> bool {
        self.backlog_full.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub(crate) fn set(&self, who: Blocked, cause: String) {
        self.causes.lock().unwrap_or_else(|p| p.into_inner())[who as usize] = Some(cause);
    }

    pub(crate) fn held_up(&self, who: Blocked) -> bool {
        self.causes.lock().unwrap_or_else(|p| p.into_inner())[who as usize].is_some()
    }

    pub(crate) fn clear(&self, who: Blocked) {
        self.causes.lock().unwrap_or_else(|p| p.into_inner())[who as usize] = None;
    }

    /// Every current cause, joined; `None` when no writer is held up.
    pub(crate) fn cause(&self) -> Option<String> {
        let causes = self.causes.lock().unwrap_or_else(|p| p.into_inner());
        let joined: Vec<&str> = causes.iter().flatten().map(String::as_str).collect();
        (!joined.is_empty()).then(|| joined.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_told_from_a_failed_sync() {
        let os = io::Error::from_raw_os_error;
        let path = "/data/schedule/20261201T0900Z.log";
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            let write = Error::io(path)(os(errno));
            assert!(write.is_disk_full(), "{write}");
            let cause = write.disk_full_cause().unwrap();
            assert!(
                cause.starts_with(&format!("no space left writing {path}: ")),
                "{cause}"
            );
            assert!(cause.contains(&format!("(os error {errno})")), "{cause}");
            // A sync that failed for want of space may still have dropped written pages.
            let sync = Error::sync(path)(os(errno));
            assert!(!sync.is_disk_full() && sync.is_sync_failure(), "{sync}");
            assert_eq!(sync.disk_full_cause(), None);
            assert!(sync.to_string().contains(path), "{sync}");
            // What each caller of a failed group commit gets answers alike.
            let (write_copy, sync_copy) = (write.duplicate(), sync.duplicate());
            assert!(write_copy.is_disk_full() && !write_copy.is_sync_failure());
            assert!(sync_copy.is_sync_failure() && !sync_copy.is_disk_full());
            assert_eq!(write_copy.to_string(), write.to_string());
            assert_eq!(sync_copy.to_string(), sync.to_string());
        }
        let eio = Error::io(path)(os(libc::EIO));
        assert!(!eio.is_disk_full() && !eio.is_sync_failure());
        assert!(Error::Append(AppendError::DiskFull).is_disk_full());
        assert!(!Error::Append(AppendError::Poisoned("x".into())).is_disk_full());
        assert!(!Error::corrupt(path, 0, "bad").is_disk_full());
    }

    #[test]
    fn the_disk_full_report_names_every_blocked_writer_until_it_clears() {
        let report = DiskFullReport::default();
        assert_eq!(report.cause(), None);
        report.set(Blocked::Replayer, "no space left writing a".into());
        report.set(Blocked::WalRoll, "no space left writing b".into());
        assert_eq!(
            report.cause().as_deref(),
            Some("no space left writing a; no space left writing b")
        );
        report.clear(Blocked::Replayer);
        assert_eq!(report.cause().as_deref(), Some("no space left writing b"));
        report.clear(Blocked::WalRoll);
        assert_eq!(report.cause(), None);
    }
}
