//! Error types of the storage engine.
//!
//! [`Error`] is what opening, reading and maintenance return; it names the file (and for corruption the
//! offset) so an operator can find the bad bytes. [`AppendError`] is what a submitter of the WAL gets back:
//! it is `Clone` because one failed group commit answers every submitter of that group.

use std::io;
use std::path::PathBuf;

/// A failure of the storage engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error on {path}: {source}")]
    Io {
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
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
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
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
