//! A source's mark (`sources/{name}` in the data dir): what a restart needs to recognise the requests
//! its MQ delivers again (a crash between the fsync and the ack), without reading the log from the
//! start.
//!
//! ```text
//! {"below": 1234, "unacked": [["17", 1200], ["18", 1201]]}
//! ```
//!
//! - `below`: every record this source wrote with a seq below it is of a request acknowledged to its
//!   MQ, but for those listed in `unacked`. Records at or above it are read back at a start (their
//!   positions only: `ScheduleLog::records_since`); it follows the log's end while the source has
//!   nothing unacknowledged, so that read covers the last second or so of the log, whatever the store
//!   holds. A read-back that fails (an I/O error; a corrupt record is reported and passed over) keeps
//!   `below` where it was until a start reads back in full.
//! - `unacked`: the position and seq of each record below `below` whose request was not
//!   acknowledged yet.
//!
//! The file of older versions, a decimal `below` alone, reads as one with nothing unacknowledged. The
//! file is replaced durably (a temporary file, fsync, rename, directory fsync). One that cannot be
//! read or parsed is an error naming it: a guess would either read the whole store again (the old
//! fallback, an out-of-memory at start with millions pending) or forget requests the MQ may deliver
//! again.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mark {
    pub below: u64,
    #[serde(default)]
    pub unacked: Vec<(String, u64)>,
}

/// Where a source's mark is kept.
pub fn path(data_dir: &Path, source: &str) -> PathBuf {
    data_dir.join("sources").join(source)
}

/// Where a source keeps another file of its state, `what` (`kafka-epochs`): `sources/{name}~{what}`,
/// a name no source's mark can have (no source name holds `~`).
pub fn beside(data_dir: &Path, source: &str, what: &str) -> PathBuf {
    data_dir.join("sources").join(format!("{source}~{what}"))
}

/// Reads a mark; `None` when there is none (the source never ran).
pub fn read(path: &Path) -> anyhow::Result<Option<Mark>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => anyhow::bail!("reading the source's mark {}: {e}", path.display()),
    };
    if let Ok(below) = text.trim().parse::<u64>() {
        return Ok(Some(Mark {
            below,
            unacked: Vec::new(),
        }));
    }
    serde_json::from_str(&text).map(Some).map_err(|e| {
        anyhow::anyhow!(
            "the source's mark {} is unreadable ({e}); if it was damaged, remove it: requests the MQ \
             delivers again then may be scheduled twice",
            path.display()
        )
    })
}

/// Replaces a mark durably.
pub fn write(path: &Path, mark: &Mark) -> std::io::Result<()> {
    write_durably(path, &serde_json::to_vec(mark)?)
}

/// Replaces a file of a source's state durably (the engine's atomic replace: a temporary file beside
/// it, fsync, rename, directory fsync), its directory made first if need be.
pub fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    schedulelog::create_dir_durably(dir)
        .and_then(|()| schedulelog::write_atomically(path, bytes))
        .map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_round_trips_an_old_one_reads_and_a_damaged_one_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let at = path(dir.path(), "orders-in");
        assert_eq!(read(&at).unwrap(), None);
        let mark = Mark {
            below: 1234,
            unacked: vec![("id with \"quotes\"\n".into(), 1200), ("18".into(), 1201)],
        };
        write(&at, &mark).unwrap();
        assert_eq!(read(&at).unwrap(), Some(mark));
        std::fs::write(&at, "977\n").unwrap();
        assert_eq!(
            read(&at).unwrap(),
            Some(Mark {
                below: 977,
                unacked: Vec::new()
            })
        );
        // Sources whose names differ after a dot do not share a temporary file, nor a file beside.
        let eu = path(dir.path(), "orders-in.eu");
        let us = path(dir.path(), "orders-in.us");
        assert_ne!(schedulelog::temp_path(&eu), schedulelog::temp_path(&us));
        assert_ne!(schedulelog::temp_path(&at), schedulelog::temp_path(&eu));
        write(&eu, &Mark::default()).unwrap();
        assert_eq!(read(&eu).unwrap(), Some(Mark::default()));
        assert_ne!(beside(dir.path(), "orders-in", "kafka-epochs"), eu);
        for damaged in ["", "97x", "{\"below\": -1}", "{\"unacked\": []}"] {
            std::fs::write(&at, damaged).unwrap();
            let error = read(&at).unwrap_err().to_string();
            assert!(
                error.contains(&at.display().to_string()),
                "{damaged:?}: {error}"
            );
        }
    }
}
