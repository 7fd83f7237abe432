//! Kafka partition epochs: what tells the records of a topic deleted and made again from the old
//! topic's. Both start their offsets at 0, so a position of topic, partition and offset alone would take
//! a new request for a redelivery of an old one (never scheduled) and order a new cancel before an old
//! request (never applied). A position carries its partition's epoch; a new epoch starts a new order.
//!
//! ```text
//! sources/{name}~kafka-epochs   {"delayd-in/0": {"epoch": 0, "committed": true}, ...}
//! ```
//!
//! - A partition starts in epoch 0 (its positions are then those of delayd before epochs:
//!   `{topic}/{partition}/{offset}`).
//! - Kafka deletes a deleted topic's committed offsets. So a partition for which the group has no
//!   committed offset although delayd committed one in its epoch was made again (or its offsets were
//!   deleted on purpose, say to read it again from the start): a new epoch starts, the time in unix ms
//!   (above the last one), saved before any record of it is handled, so that a restart finds it.
//! - `committed` is saved once per partition and epoch (at its first commit): this file changes
//!   seldom, never once per batch.
//!
//! The epoch is looked up when this consumer first reads from a partition, after a rebalance, and when
//! the partition's offsets go back (the topic was made again while delayd ran). Epochs are this node's:
//! nodes sharing a group keep theirs apart, as they keep their messages; the members of a cluster
//! share theirs (the file is replaced through the cluster's log: state.rs), as they share their
//! messages, so a new leader knows where the old one committed. A topic made again before
//! delayd committed anything in it is not seen as new: its requests may be taken for redeliveries of the
//! old one's not yet acknowledged (within the redelivery window).

use super::super::{StateFileError, StateFiles};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Epoch {
    epoch: u64,
    /// delayd committed an offset in this partition in this epoch.
    committed: bool,
}

/// The partitions' epochs of one source, kept in a file.
#[derive(Debug)]
pub(super) struct Epochs {
    files: StateFiles,
    /// Its name among them (`{source}~kafka-epochs`).
    file: String,
    /// By `{topic}/{partition}`.
    partitions: BTreeMap<String, Epoch>,
}

impl Epochs {
    /// Reads the file (none: every partition in epoch 0); one that cannot be read is an error naming it.
    pub(super) fn open(files: &StateFiles, file: &str) -> anyhow::Result<Epochs> {
        let path = files.path(file);
        let partitions = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                anyhow::anyhow!(
                    "the Kafka partition epochs {} are unreadable: {e}",
                    path.display()
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => anyhow::bail!("reading {}: {e}", path.display()),
        };
        Ok(Epochs {
            files: files.clone(),
            file: file.to_string(),
            partitions,
        })
    }

    /// The epoch of a partition, given whether the group has a committed offset for it: a new one,
    /// saved, when it has none although delayd committed one in the current epoch.
    pub(super) async fn resolve(
        &mut self,
        topic: &str,
        partition: i32,
        has_committed_offset: bool,
    ) -> Result<u64, StateFileError> {
        let name = format!("{topic}/{partition}");
        let known = self.partitions.get(&name).copied().unwrap_or_default();
        if has_committed_offset || !known.committed {
            return Ok(known.epoch);
        }
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let epoch = now_ms.max(known.epoch + 1);
        self.partitions.insert(
            name,
            Epoch {
                epoch,
                committed: false,
            },
        );
        self.save().await?;
        tracing::info!(
            topic,
            partition,
            epoch,
            "kafka: the group has no committed offset for a partition delayd committed in (the topic was made again, or its offsets deleted): its records start a new epoch of positions"
        );
        Ok(epoch)
    }

    /// Offsets were committed in these partitions: remembered, and saved when that is new.
    pub(super) async fn committed(
        &mut self,
        partitions: &[(String, i32)],
    ) -> Result<(), StateFileError> {
        let mut changed = false;
        for (topic, partition) in partitions {
            let entry = self
                .partitions
                .entry(format!("{topic}/{partition}"))
                .or_default();
            changed |= !entry.committed;
            entry.committed = true;
        }
        match changed {
            true => self.save().await,
            false => Ok(()),
        }
    }

    /// Writes the file durably (off the async threads; on a cluster member, on every member).
    async fn save(&self) -> Result<(), StateFileError> {
        let bytes = serde_json::to_vec(&self.partitions).expect("epochs are numbers and names");
        self.files
            .replace_off_thread(self.file.clone(), bytes)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_without_a_committed_offset_after_a_commit_starts_a_new_epoch_that_a_restart_finds(
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let files = StateFiles::local(dir.path());
        let mut epochs = Epochs::open(&files, "in~kafka-epochs").unwrap();
        runtime.block_on(async {
            // A new group: nothing committed anywhere, epoch 0 (positions as before epochs).
            assert_eq!(epochs.resolve("t", 0, false).await.unwrap(), 0);
            epochs.committed(&[("t".into(), 0)]).await.unwrap();
            // Kafka still has the offset: the same epoch.
            assert_eq!(epochs.resolve("t", 0, true).await.unwrap(), 0);
            // The topic was made again: Kafka has no offset although delayd committed one.
            let new = epochs.resolve("t", 0, false).await.unwrap();
            assert!(new > 0);
            // Before the first commit in it (a crash, say) the epoch holds.
            assert_eq!(epochs.resolve("t", 0, false).await.unwrap(), new);
            let reopened = Epochs::open(&files, "in~kafka-epochs").unwrap();
            assert_eq!(reopened.partitions["t/0"].epoch, new);
            epochs.committed(&[("t".into(), 0)]).await.unwrap();
            let newer = epochs.resolve("t", 0, false).await.unwrap();
            assert!(newer > new, "{newer} after {new}");
            // Other partitions are their own.
            assert_eq!(epochs.resolve("t", 1, false).await.unwrap(), 0);
        });
        let path = files.path("in~kafka-epochs");
        std::fs::write(&path, "{").unwrap();
        let error = Epochs::open(&files, "in~kafka-epochs")
            .unwrap_err()
            .to_string();
        assert!(error.contains(&path.display().to_string()), "{error}");
    }
}
