//! The broker's error type, and how the storage engine's errors become it.

use std::io;
use std::path::{Path, PathBuf};

/// A broker failure; the HTTP edge maps it to 500 (or 507 for a full disk).
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("broker I/O on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("broker data corrupt in {path} at offset {offset}: {reason}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    /// The store refuses writes until a restart (see `Store::failed`).
    #[error("the broker store refuses writes until delayd is restarted: {0}")]
    Failed(String),
    /// A cluster member's write was not taken through Raft (op.rs): this member does not lead, no
    /// quorum answered in time (it may still take effect), the log is closing, or the op is larger
    /// than an entry. Not the message's fault.
    #[error("the cluster did not take the broker write: {0}")]
    Replication(schedulelog::AppendError),
}

impl BrokerError {
    /// Whether the failure was for want of disk space (nothing was stored; a later try may succeed).
    pub fn is_disk_full(&self) -> bool {
        matches!(self, BrokerError::Io { source, .. }
            if matches!(source.kind(), io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded))
    }

    /// The same error again, for each caller of a group commit that failed. An OS error keeps its code,
    /// so [`BrokerError::is_disk_full`] answers alike for the copy.
    pub(super) fn duplicate(&self) -> BrokerError {
        match self {
            BrokerError::Io { path, source } => BrokerError::Io {
                path: path.clone(),
                source: match source.raw_os_error() {
                    Some(code) => io::Error::from_raw_os_error(code),
                    None => io::Error::new(source.kind(), source.to_string()),
                },
            },
            BrokerError::Corrupt {
                path,
                offset,
                reason,
            } => BrokerError::Corrupt {
                path: path.clone(),
                offset: *offset,
                reason: reason.clone(),
            },
            BrokerError::Failed(cause) => BrokerError::Failed(cause.clone()),
            BrokerError::Replication(e) => BrokerError::Replication(e.clone()),
        }
    }
}

impl From<schedulelog::Error> for BrokerError {
    /// The engine's file helpers (durable directories, atomic replaces) answer with its error; a failed
    /// fsync is an I/O error here too (the store refuses writes when undoing an append fails).
    fn from(e: schedulelog::Error) -> BrokerError {
        match e {
            schedulelog::Error::Io { path, source } | schedulelog::Error::Sync { path, source } => {
                BrokerError::Io { path, source }
            }
            schedulelog::Error::Corrupt {
                path,
                offset,
                reason,
            } => BrokerError::Corrupt {
                path,
                offset,
                reason,
            },
            other => BrokerError::Failed(other.to_string()),
        }
    }
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> BrokerError + '_ {
    move |source| BrokerError::Io {
        path: path.to_path_buf(),
        source,
    }
}
