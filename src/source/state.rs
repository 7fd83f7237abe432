//! A source's state files, `sources/{file}` in the data dir (its mark, mark.rs; beside it, a Kafka
//! source's partition epochs), and how they are replaced. A single node replaces a file durably in its
//! own dir, as it always did. On a cluster member (DESIGN.md §10) what a source keeps must outlive
//! its leader: a replacement is a Raft entry (an application payload, `ScheduleLog::propose_app`) that
//! every member applies into its own `sources/` dir, so a new leader starts each source from the mark
//! the old one saved last and recognises the requests the MQ delivers to it again.
//!
//! The op, in the application payloads' space of version and kind (lib.rs hands each payload to its
//! owner by its kind; 1 and 2 are the built-in broker's, broker/op.rs):
//!
//! ```text
//! 0   1  version  u8 = 1
//! 1   1  kind     u8 = 3 (a source's state file)
//! 2   2  name length u16, then the file's name (UTF-8): `{source}` or `{source}~{what}`
//! ..  .. content  the file's whole new content, to the end of the payload
//! ```
//!
//! Invariants:
//! - A file's name is a source's name (`[A-Za-z0-9._-]{1,200}`, not only dots: names.rs), alone or
//!   followed by `~` and another such name. It is checked before a replacement and again when an op
//!   is applied, so no payload writes outside `sources/`: an op with another name, or one that does
//!   not decode, is an error naming its place in the Raft log.
//! - A replacement is whole and atomic (a temporary file, fsync, rename, directory fsync). So an op
//!   applied again (entries past a member's checkpoint are, after a restart) leaves the same file, and
//!   ops applied in log order leave the last one's bytes on every member.
//! - On a member a replacement returns once this member applied it: the file read back afterwards is
//!   the one written. One that fails (this member does not lead, no quorum answered in time) leaves
//!   this member's file as it was; its caller keeps its state and tries again later. (One whose fate
//!   is uncertain may still take effect, before any later one of this member's: a source's older
//!   state is never wrong, only longer to read back.)
//! - A content is at most `schedulelog::MAX_APP_PAYLOAD_BYTES` less the head on a member (16 MiB:
//!   a mark of some 300,000 unacknowledged positions); a larger one is refused.

use schedulelog::{AppendError, ScheduleLog};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

/// The directory of the state files, in the data dir.
pub const DIR: &str = "sources";

const VERSION: u8 = 1;
/// This op's kind, byte 1 of an application payload.
pub(crate) const KIND: u8 = 3;
/// The bytes of an op before the file's name.
const HEAD_LEN: usize = 4;

/// Where the sources' state files are kept, and how they are replaced: in this node's dir, or through
/// the cluster's log on a member. Cheap to clone: every source of a term holds one.
#[derive(Debug, Clone)]
pub struct StateFiles {
    data_dir: PathBuf,
    /// A cluster member's log; weak, as the broker's, so that no source keeps it open past its close.
    replicated: Option<Weak<ScheduleLog>>,
}

/// A state file that could not be replaced, or an op that could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    /// Nothing was written.
    #[error(
        "{0:?} is not the name of a source's state file ({{source}} or {{source}}~{{what}}, each \
         [A-Za-z0-9._-]{{1,200}} and not only dots)"
    )]
    InvalidName(String),
    /// Writing, syncing or renaming the file (or its temporary file, or making `sources/`) failed;
    /// the error names the file.
    #[error("replacing a source's state file: {0}")]
    Write(#[from] schedulelog::Error),
    /// A member's proposal was not taken (or its fate is unknown: `Uncertain`).
    #[error("replacing {file} through the cluster: {source}")]
    Replication {
        file: String,
        #[source]
        source: AppendError,
    },
    /// The blocking task replacing `file` ended without an answer (the runtime shuts down).
    #[error("replacing {file}: the task doing it ended ({why})")]
    Interrupted { file: String, why: String },
    /// An op that does not decode, or names no state file, at its place in the Raft log (its entry's
    /// index, and its position among that entry's application payloads).
    #[error("source state file op {} of Raft entry {}: {reason}", at.1, at.0)]
    Corrupt { at: (u64, u32), reason: String },
}

impl StateFiles {
    /// A single node's: replaced in `data_dir` alone.
    pub fn local(data_dir: &Path) -> StateFiles {
        StateFiles {
            data_dir: data_dir.to_path_buf(),
            replicated: None,
        }
    }

    /// A cluster member's: replaced through `log` (opened replicated), by every member's apply
    /// ([`apply_op`]) into its own `data_dir`.
    pub fn replicated(data_dir: &Path, log: &Arc<ScheduleLog>) -> StateFiles {
        StateFiles {
            data_dir: data_dir.to_path_buf(),
            replicated: Some(Arc::downgrade(log)),
        }
    }

    /// Where the file `file` is (`sources/{file}`), to read it.
    pub fn path(&self, file: &str) -> PathBuf {
        path(&self.data_dir, file)
    }

    /// Replaces the file `file` with `content`, durably: here, or on a member once the op is committed
    /// and this member applied it. Blocks (an fsync; on a member, a round of Raft).
    pub fn replace(&self, file: &str, content: &[u8]) -> Result<(), StateFileError> {
        if !valid_file_name(file) {
            return Err(StateFileError::InvalidName(file.to_string()));
        }
        let Some(log) = &self.replicated else {
            return write_durably(&self.path(file), content);
        };
        let replication = |source| StateFileError::Replication {
            file: file.to_string(),
            source,
        };
        let log = log
            .upgrade()
            .ok_or_else(|| replication(AppendError::Closed))?;
        // Its apply here, as on every member, writes the file (apply_op).
        log.propose_app(encode(file, content)).map_err(replication)
    }

    /// [`StateFiles::replace`] off the async threads.
    pub async fn replace_off_thread(
        &self,
        file: String,
        content: Vec<u8>,
    ) -> Result<(), StateFileError> {
        let (files, name) = (self.clone(), file.clone());
        tokio::task::spawn_blocking(move || files.replace(&name, &content))
            .await
            .unwrap_or_else(|ended| {
                Err(StateFileError::Interrupted {
                    file,
                    why: ended.to_string(),
                })
            })
    }
}

fn path(data_dir: &Path, file: &str) -> PathBuf {
    data_dir.join(DIR).join(file)
}

/// Whether `file` names a source's state file: `{source}` or `{source}~{what}`, each a valid name
/// (so no `/`, `\`, NUL, `~` within, and neither `.` nor `..`).
pub fn valid_file_name(file: &str) -> bool {
    let (source, what) = match file.split_once('~') {
        Some((source, what)) => (source, Some(what)),
        None => (file, None),
    };
    crate::names::valid_name(source) && what.is_none_or(crate::names::valid_name)
}

/// Replaces a file durably (the engine's atomic replace), its directory made first if need be.
fn write_durably(path: &Path, content: &[u8]) -> Result<(), StateFileError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    schedulelog::create_dir_durably(dir)?;
    schedulelog::write_atomically(path, content)?;
    Ok(())
}

/// The op replacing `file` (a valid name) with `content`.
fn encode(file: &str, content: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEAD_LEN + file.len() + content.len());
    bytes.extend_from_slice(&[VERSION, KIND]);
    // A valid name is at most 401 bytes: a u16 always holds its length.
    bytes.extend_from_slice(&(file.len() as u16).to_le_bytes());
    bytes.extend_from_slice(file.as_bytes());
    bytes.extend_from_slice(content);
    bytes
}

/// An op's file name and content; the error says what is wrong. Never panics.
fn decode(bytes: &[u8]) -> Result<(&str, &[u8]), String> {
    let [version, kind, len_low, len_high, rest @ ..] = bytes else {
        return Err(format!(
            "cut short: {} bytes, {HEAD_LEN} at least",
            bytes.len()
        ));
    };
    if *version != VERSION || *kind != KIND {
        return Err(format!(
            "version {version} kind {kind} (this delayd reads version {VERSION} kind {KIND})"
        ));
    }
    let len = usize::from(u16::from_le_bytes([*len_low, *len_high]));
    if rest.len() < len {
        return Err(format!(
            "cut short in the file's name: {len} bytes, {} there",
            rest.len()
        ));
    }
    let (name, content) = rest.split_at(len);
    let name = std::str::from_utf8(name).map_err(|_| "the file's name is not UTF-8".to_string())?;
    if !valid_file_name(name) {
        return Err(format!("{name:?} is not the name of a source's state file"));
    }
    Ok((name, content))
}

/// Applies a state file op (`at`: its place in the Raft log) into `data_dir`'s `sources/`: every
/// member does, in log order, the proposer too. An error stops the member's Raft: an op that does not
/// decode or names no state file ([`StateFileError::Corrupt`]), or a failed write.
pub fn apply_op(data_dir: &Path, at: (u64, u32), payload: &[u8]) -> Result<(), StateFileError> {
    let (file, content) =
        decode(payload).map_err(|reason| StateFileError::Corrupt { at, reason })?;
    write_durably(&path(data_dir, file), content)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BAD_NAMES: [&str; 14] = [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        "a\\b",
        "a\0b",
        "in~",
        "~x",
        "in~..",
        "in~a/b",
        "in~a~b",
        "sp ace",
        "/etc/passwd",
    ];

    #[test]
    fn an_op_round_trips_and_a_bad_or_cut_one_is_an_error() {
        for (file, content) in [
            ("orders-in", &b"{\"below\": 7, \"unacked\": []}"[..]),
            ("orders-in~kafka-epochs", b"{}"),
            ("a..b", b""),
            ("in", &[0, 255, 1, 3][..]),
        ] {
            let bytes = encode(file, content);
            assert_eq!(bytes[..2], [VERSION, KIND]);
            assert_eq!(decode(&bytes), Ok((file, content)));
            // Every cut within the head and the name is an error; a cut in the content is a
            // shorter content (the content runs to the end of the payload: the entry's frame
            // checks the bytes).
            for end in 0..HEAD_LEN + file.len() {
                assert!(decode(&bytes[..end]).is_err(), "{file}: cut at {end}");
            }
        }
        // A broker op is not one.
        assert!(decode(&[1, 1, 0, 0]).is_err() && decode(&[1, 2, 0, 0, b'x']).is_err());
        for bad in BAD_NAMES {
            let mut bytes = vec![VERSION, KIND];
            bytes.extend_from_slice(&(bad.len() as u16).to_le_bytes());
            bytes.extend_from_slice(bad.as_bytes());
            let error = decode(&bytes).unwrap_err();
            assert!(error.contains("not the name"), "{bad:?}: {error}");
        }
        let mut other_version = encode("in", b"x");
        other_version[0] = 2;
        assert!(decode(&other_version).unwrap_err().contains("version 2"));
        let not_utf8 = [VERSION, KIND, 1, 0, 0xff];
        assert!(decode(&not_utf8).unwrap_err().contains("UTF-8"));
    }

    #[test]
    fn valid_names_are_sources_and_files_beside_them() {
        for good in ["in", "orders-in.eu", "in~kafka-epochs", &"x".repeat(200)] {
            assert!(valid_file_name(good), "{good:?}");
        }
        for bad in BAD_NAMES.iter().copied().chain([&*"x".repeat(201)]) {
            assert!(!valid_file_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn applying_writes_the_file_and_again_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let older = encode("in", b"{\"below\": 1}");
        let newer = encode("in", b"{\"below\": 2}");
        let read = || std::fs::read(dir.path().join("sources/in")).unwrap();
        apply_op(dir.path(), (7, 0), &older).unwrap();
        assert_eq!(read(), b"{\"below\": 1}");
        apply_op(dir.path(), (9, 1), &newer).unwrap();
        // After a restart: the same ops again, in log order, leave the last one's bytes.
        for _ in 0..2 {
            apply_op(dir.path(), (7, 0), &older).unwrap();
            apply_op(dir.path(), (9, 1), &newer).unwrap();
            assert_eq!(read(), b"{\"below\": 2}");
        }
        let names: Vec<_> = std::fs::read_dir(dir.path().join("sources"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["in"], "no temporary file is left behind");
        // A bad op names its place in the log, and writes nothing.
        let mut bad = encode("in", b"x");
        bad.truncate(3);
        let error = apply_op(dir.path(), (12, 3), &bad).unwrap_err().to_string();
        assert!(error.contains("op 3 of Raft entry 12"), "{error}");
        let mut outside = vec![VERSION, KIND, 5, 0];
        outside.extend_from_slice(b"../in");
        let error = apply_op(dir.path(), (13, 0), &outside).unwrap_err();
        assert!(
            matches!(error, StateFileError::Corrupt { at: (13, 0), .. }),
            "{error}"
        );
        assert!(!dir.path().join("in").exists());
        assert_eq!(read(), b"{\"below\": 2}");
    }

    #[test]
    fn a_single_node_replaces_its_own_file_and_refuses_a_bad_name() {
        let dir = tempfile::tempdir().unwrap();
        let files = StateFiles::local(dir.path());
        files.replace("in~kafka-epochs", b"{}").unwrap();
        assert_eq!(std::fs::read(files.path("in~kafka-epochs")).unwrap(), b"{}");
        assert_eq!(files.path("in"), dir.path().join("sources").join("in"));
        for bad in BAD_NAMES {
            let refused = files.replace(bad, b"x");
            assert!(
                matches!(refused, Err(StateFileError::InvalidName(_))),
                "{bad:?}: {refused:?}"
            );
        }
    }

    #[test]
    fn a_single_nodes_log_proposes_nothing_and_a_closed_one_is_said_so() {
        let dir = tempfile::tempdir().unwrap();
        let log = Arc::new(
            ScheduleLog::open(dir.path().join("data"), schedulelog::Options::default()).unwrap(),
        );
        // Made replicated on a log that is not (a mistake): refused, nothing written.
        let files = StateFiles::replicated(dir.path(), &log);
        let refused = files.replace("in", b"x");
        assert!(
            matches!(
                refused,
                Err(StateFileError::Replication {
                    source: AppendError::Refused(_),
                    ..
                })
            ),
            "{refused:?}"
        );
        assert!(!files.path("in").exists());
        drop(log);
        let closed = files.replace("in", b"x");
        assert!(
            matches!(
                closed,
                Err(StateFileError::Replication {
                    source: AppendError::Closed,
                    ..
                })
            ),
            "{closed:?}"
        );
    }
}
