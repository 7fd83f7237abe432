//! Consumer group offsets: where each group is in each queue it consumes.
//!
//! ```text
//! broker/groups/{group}   JSON {topic: {queue: offset}}, replaced atomically ({group}.tmp~, fsync,
//!                         rename, dir fsync; a leftover .tmp~ is deleted on open)
//! ```
//!
//! Invariants:
//! - A commit rewrites its own group's file only: its cost grows with that group's topics, not with all
//!   groups (before there was one file of every group, `broker/offsets`; opening moves it apart, and
//!   deletes it only once every group's file is durable, so a crash in between moves it again).
//! - An offset is visible to readers only once it is durable.
//! - Group names match `[A-Za-z0-9._-]{1,200}` and are not all dots: safe as file names. At most
//!   `max_groups` groups: a commit for one more is refused.

use super::{io_err, BrokerError};
use schedulelog::{create_dir_durably, sync_dir, write_atomically, TEMP_SUFFIX};
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// A group's offsets: topic → queue → offset.
pub(crate) type GroupOffsets = BTreeMap<String, BTreeMap<u32, u64>>;

/// Every group's offsets, and where they are kept.
#[derive(Debug)]
pub(crate) struct Offsets {
    dir: PathBuf,
    groups: BTreeMap<String, GroupOffsets>,
}

/// Why a commit was not stored.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("there are {max} consumer groups already (broker.max_groups)")]
    TooManyGroups { max: usize },
    /// No such topic or queue, or an offset past the queue's end (checked again on a cluster member,
    /// before the commit is proposed).
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

impl Offsets {
    /// Loads the offsets kept under `broker_dir`, moving a legacy `offsets` file apart first.
    pub(crate) fn open(broker_dir: &Path) -> Result<Offsets, BrokerError> {
        let dir = broker_dir.join("groups");
        create_dir_durably(&dir)?;
        let mut offsets = Offsets {
            dir,
            groups: BTreeMap::new(),
        };
        let legacy = broker_dir.join("offsets");
        match fs::read(&legacy) {
            Ok(bytes) => {
                let all: BTreeMap<String, GroupOffsets> =
                    serde_json::from_slice(&bytes).map_err(|e| BrokerError::Corrupt {
                        path: legacy.clone(),
                        offset: 0,
                        reason: e.to_string(),
                    })?;
                for (group, topics) in &all {
                    offsets.store(group, topics)?;
                }
                fs::remove_file(&legacy).map_err(io_err(&legacy))?;
                sync_dir(broker_dir)?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&legacy)(e)),
        }
        for entry in fs::read_dir(&offsets.dir).map_err(io_err(&offsets.dir))? {
            let path = entry.map_err(io_err(&offsets.dir))?.path();
            let Some(group) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if group.ends_with(TEMP_SUFFIX) {
                // Left by a commit a crash interrupted before its rename: the group's file (if
                // any) holds its last durable offsets.
                fs::remove_file(&path).map_err(io_err(&path))?;
                continue;
            }
            if !crate::names::valid_name(group) {
                continue; // a stranger's file
            }
            let bytes = fs::read(&path).map_err(io_err(&path))?;
            let topics: GroupOffsets =
                serde_json::from_slice(&bytes).map_err(|e| BrokerError::Corrupt {
                    path: path.clone(),
                    offset: 0,
                    reason: e.to_string(),
                })?;
            offsets.groups.insert(group.to_string(), topics);
        }
        Ok(offsets)
    }

    fn store(&self, group: &str, topics: &GroupOffsets) -> Result<(), BrokerError> {
        let bytes = serde_json::to_vec(topics).unwrap_or_default();
        Ok(write_atomically(&self.dir.join(group), &bytes)?)
    }

    /// Stores a group's offset for one queue, durably, then makes it visible.
    pub(crate) fn commit(
        &mut self,
        group: &str,
        topic: &str,
        queue: u32,
        offset: u64,
        max_groups: usize,
    ) -> Result<(), CommitError> {
        if !self.admits(group, max_groups) {
            return Err(CommitError::TooManyGroups { max: max_groups });
        }
        let mut topics = self.groups.get(group).cloned().unwrap_or_default();
        topics
            .entry(topic.to_string())
            .or_default()
            .insert(queue, offset);
        self.store(group, &topics)?;
        self.groups.insert(group.to_string(), topics);
        Ok(())
    }

    /// Whether a commit of `group` fits within `max_groups` groups (it is known, or one more fits).
    pub(crate) fn admits(&self, group: &str, max_groups: usize) -> bool {
        self.groups.contains_key(group) || self.groups.len() < max_groups
    }

    /// A group's offsets for a topic, by queue.
    pub(crate) fn of(&self, group: &str, topic: &str) -> BTreeMap<u32, u64> {
        self.groups
            .get(group)
            .and_then(|g| g.get(topic))
            .cloned()
            .unwrap_or_default()
    }

    /// Every group's offset on a queue.
    pub(crate) fn on_queue<'a>(
        &'a self,
        topic: &'a str,
        queue: u32,
    ) -> impl Iterator<Item = u64> + 'a {
        self.groups
            .values()
            .filter_map(move |g| g.get(topic).and_then(|t| t.get(&queue)).copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_writes_its_group_only_and_a_legacy_file_is_moved_apart() {
        let dir = tempfile::tempdir().unwrap();
        let legacy = r#"{"a": {"t": {"0": 5}}, "b": {"t": {"1": 7}, "u": {"0": 1}}}"#;
        fs::write(dir.path().join("offsets"), legacy).unwrap();
        let mut offsets = Offsets::open(dir.path()).unwrap();
        assert!(!dir.path().join("offsets").exists());
        assert_eq!(offsets.of("b", "t"), BTreeMap::from([(1, 7)]));
        let b_before = fs::read(dir.path().join("groups/b")).unwrap();
        offsets.commit("a", "t", 0, 9, 10).unwrap();
        assert_eq!(fs::read(dir.path().join("groups/b")).unwrap(), b_before);
        drop(offsets);
        let mut offsets = Offsets::open(dir.path()).unwrap();
        assert_eq!(offsets.of("a", "t"), BTreeMap::from([(0, 9)]));
        assert_eq!(offsets.on_queue("t", 1).collect::<Vec<_>>(), vec![7]);
        // The bound: a third group is refused, the known ones go on.
        assert!(matches!(
            offsets.commit("c", "t", 0, 1, 2),
            Err(CommitError::TooManyGroups { max: 2 })
        ));
        offsets.commit("b", "t", 1, 8, 2).unwrap();
        assert!(!dir.path().join("groups/c").exists());
    }

    #[test]
    fn a_commit_interrupted_before_its_rename_leaves_no_group_and_names_never_collide() {
        let dir = tempfile::tempdir().unwrap();
        let mut offsets = Offsets::open(dir.path()).unwrap();
        offsets.commit("a.tmp", "t", 0, 4, 10).unwrap();
        // Groups whose temporary files would once have been `a.tmp`, the file of the group above.
        offsets.commit("a.z", "t", 0, 5, 10).unwrap();
        offsets.commit("a", "t", 0, 6, 10).unwrap();
        // A crash before the rename leaves a temporary file: empty (its data never reached the disk)
        // or whole.
        fs::write(dir.path().join("groups/a.z.tmp~"), b"").unwrap();
        fs::write(dir.path().join("groups/b.tmp~"), br#"{"t":{"0":9}}"#).unwrap();
        drop(offsets);
        let offsets = Offsets::open(dir.path()).unwrap();
        assert_eq!(offsets.of("a.tmp", "t"), BTreeMap::from([(0, 4)]));
        assert_eq!(offsets.of("a.z", "t"), BTreeMap::from([(0, 5)]));
        assert_eq!(offsets.of("a", "t"), BTreeMap::from([(0, 6)]));
        assert_eq!(offsets.groups.len(), 3, "{:?}", offsets.groups.keys());
        assert!(!dir.path().join("groups/b.tmp~").exists());
        assert!(!dir.path().join("groups/a.z.tmp~").exists());
    }
}
