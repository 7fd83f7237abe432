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
//!   acknowledged yet. A recurring request writes a schedule op, which carries no position: its
//!   position is listed with a seq at or after its op's (what the log had filed once the op was), and
//!   only this list knows it.
//!
//! The file of older versions, a decimal `below` alone, reads as one with nothing unacknowledged. The
//! file is replaced durably (a temporary file, fsync, rename, directory fsync), and on a cluster member
//! through the cluster's log, on every member (state.rs): seqs are the same on every member, so a new
//! leader reads back from the mark the old one saved. One that cannot be read or parsed is an error
//! naming it: a guess would either read the whole store again (the old fallback, an out-of-memory at
//! start with millions pending) or forget requests the MQ may deliver again.

use super::state::{StateFileError, StateFiles};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mark {
    pub below: u64,
    #[serde(default)]
    pub unacked: Vec<(String, u64)>,
}

/// The name of another file of a source's state, `what` (`kafka-epochs`), in `sources/`:
/// `{source}~{what}`, a name no source's mark can have (no source name holds `~`).
pub fn beside(source: &str, what: &str) -> String {
    format!("{source}~{what}")
}

/// Reads a source's mark (`sources/{source}`); `None` when there is none (the source never ran).
pub fn read(files: &StateFiles, source: &str) -> anyhow::Result<Option<Mark>> {
    let path = files.path(source);
    let text = match std::fs::read_to_string(&path) {
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

/// Replaces a source's mark durably (on a cluster member, on every member). Blocks.
pub fn save(files: &StateFiles, source: &str, mark: &Mark) -> Result<(), StateFileError> {
    files.replace(source, &encode(mark))
}

/// A mark's bytes, as its file holds them.
pub fn encode(mark: &Mark) -> Vec<u8> {
    serde_json::to_vec(mark).expect("a mark is numbers and strings")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_round_trips_an_old_one_reads_and_a_damaged_one_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let files = StateFiles::local(dir.path());
        assert_eq!(read(&files, "orders-in").unwrap(), None);
        let mark = Mark {
            below: 1234,
            unacked: vec![("id with \"quotes\"\n".into(), 1200), ("18".into(), 1201)],
        };
        save(&files, "orders-in", &mark).unwrap();
        assert_eq!(read(&files, "orders-in").unwrap(), Some(mark));
        let at = files.path("orders-in");
        assert_eq!(at, dir.path().join("sources").join("orders-in"));
        std::fs::write(&at, "977\n").unwrap();
        assert_eq!(
            read(&files, "orders-in").unwrap(),
            Some(Mark {
                below: 977,
                unacked: Vec::new()
            })
        );
        // Sources whose names differ after a dot do not share a temporary file, nor a file beside.
        let eu = files.path("orders-in.eu");
        let us = files.path("orders-in.us");
        assert_ne!(schedulelog::temp_path(&eu), schedulelog::temp_path(&us));
        assert_ne!(schedulelog::temp_path(&at), schedulelog::temp_path(&eu));
        save(&files, "orders-in.eu", &Mark::default()).unwrap();
        assert_eq!(read(&files, "orders-in.eu").unwrap(), Some(Mark::default()));
        assert_ne!(files.path(&beside("orders-in", "kafka-epochs")), eu);
        for damaged in ["", "97x", "{\"below\": -1}", "{\"unacked\": []}"] {
            std::fs::write(&at, damaged).unwrap();
            let error = read(&files, "orders-in").unwrap_err().to_string();
            assert!(
                error.contains(&at.display().to_string()),
                "{damaged:?}: {error}"
            );
        }
    }
}
