//! The Raft cluster (DESIGN.md §10): openraft replicates the log, this module gives it its types, its
//! storage and its RPCs over the peer link (peer.rs). Consensus is openraft's; what an entry means is
//! the storage layer's. [`crate::run`] starts a [`node::Node`] when the config has a `[cluster]`
//! section; the in-process tests run members of their own.
//!
//! - [`TypeConfig`]: openraft's types for delayd. A node id is the member's `cluster.node_id`; a
//!   node's data is a [`Member`]; an entry's app data is a [`Proposal`].
//! - `store`: openraft's log storage and state machine on a replicated schedule log (its WAL is the
//!   Raft log).
//! - `propose`: the leader's writes, one entry per group commit.
//! - `node`: a running member: Raft, peer listener, proposer, delivery lease, status and metrics.
//! - `rpc`: the binary codec of the RPCs (its byte layout is there).
//! - `network`: [`network::PeerNetwork`] sends them to members, [`network::RaftService`] answers them.
//! - `rejoin`: a member that joins empty votes only once it has caught up.
//! - `membership`: members added (a learner, then a voter) and removed, on the leader.
//! - `handoff`: a member that refuses a candidate for its shorter log stands itself at once.
//! - `snapshot`: snapshots taken (the data dir's files linked), streamed, received and installed.
//!
//! Invariants:
//! - A [`Proposal`] is opaque here: its frames are the WAL frames of one group commit, sealed by the
//!   leader that proposed them, and every member applies them as they are. Nothing in this module
//!   reads or changes them; the RPC codec copies them once each way and never through serde.
//! - The types are openraft's own (`Vote`, `LogId`, `Entry`, the RPC messages): no mirror types to
//!   keep in step. openraft is pinned to one exact version in Cargo.toml, so their shape cannot change
//!   under the codec.

pub mod handoff;
pub mod membership;
pub mod network;
pub mod node;
pub mod propose;
pub mod rejoin;
pub mod rpc;
pub mod snapshot;
pub mod store;

#[cfg(test)]
mod in_process;

use serde::{Deserialize, Serialize};

openraft::declare_raft_types!(
    /// openraft's types for delayd. `R = ()`: a committed entry answers nothing through Raft, the
    /// storage layer tells its writer what became of it. A snapshot's data is a directory of files
    /// (snapshot.rs), which the network streams itself.
    pub TypeConfig:
        D = Proposal,
        R = (),
        NodeId = u64,
        Node = Member,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = snapshot::SnapshotFiles,
        AsyncRuntime = openraft::TokioRuntime,
);

/// openraft's settings for a member whose election timeout is `election_timeout` (DESIGN.md §10):
/// heartbeats at a quarter of it; a follower that heard from its leader stands for election after the
/// leader's lease (openraft's: the longest election timeout, `election_timeout` itself) plus a random
/// timeout between half of it and all of it, so 1.5 to 2 election timeouts after the last heartbeat.
/// (openraft 0.9 adds its lease to the timeout; a range above `election_timeout` would make that 2.5
/// to 3.) Every `snapshot_entries` applied entries a member takes a snapshot (snapshot.rs), which
/// lets it purge the entries more than `max_in_snapshot_log_to_keep` before it (1,000, or
/// `snapshot_entries` if fewer), whether every member has them or not; the log then retires their
/// WAL files. A member further behind than that is sent a snapshot.
pub fn raft_config(
    election_timeout: std::time::Duration,
    snapshot_entries: u64,
) -> std::sync::Arc<openraft::Config> {
    let election_ms = u64::try_from(election_timeout.as_millis())
        .unwrap_or(u64::MAX)
        .max(4);
    openraft::Config {
        cluster_name: "delayd".into(),
        heartbeat_interval: election_ms / 4,
        election_timeout_min: election_ms / 2,
        election_timeout_max: election_ms,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(snapshot_entries),
        max_in_snapshot_log_to_keep: snapshot_entries.min(1_000),
        ..openraft::Config::default()
    }
    .validate()
    .map(std::sync::Arc::new)
    .expect("a heartbeat a quarter of the election timeout, of at least 4 ms, is valid")
}

/// The app data of one Raft entry: the WAL frames of one group commit, already sealed by the leader.
/// Their meaning is the storage layer's business.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Proposal {
    pub frames: Vec<u8>,
}

impl std::fmt::Debug for Proposal {
    /// The length only: a group commit may hold megabytes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Proposal {{ frames: {} bytes }}", self.frames.len())
    }
}

/// Serialized as one byte string (compact in binary formats; JSON writes an array of numbers), not
/// as a sequence of `u8` each tagged on its own. The RPC codec does not use this: openraft requires
/// serde of its app data, and only diagnostics and tests reach it.
impl Serialize for Proposal {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.frames)
    }
}

impl<'de> Deserialize<'de> for Proposal {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Proposal, D::Error> {
        struct Frames;

        impl<'de> serde::de::Visitor<'de> for Frames {
            type Value = Proposal;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("the bytes of a proposal's frames")
            }

            fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Proposal, E> {
                Ok(Proposal {
                    frames: bytes.to_vec(),
                })
            }

            fn visit_byte_buf<E: serde::de::Error>(self, frames: Vec<u8>) -> Result<Proposal, E> {
                Ok(Proposal { frames })
            }

            /// What a format without byte strings (JSON) wrote: one number a byte.
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Proposal, A::Error> {
                // The hint is the input's claim: bounded, so that it cannot make us allocate much.
                let mut frames = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(byte) = seq.next_element::<u8>()? {
                    frames.push(byte);
                }
                Ok(Proposal { frames })
            }
        }

        deserializer.deserialize_bytes(Frames)
    }
}

/// What a member is, as the cluster's membership records it (DESIGN.md §10, `[[cluster.members]]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Its client listener, where followers forward `/v1` requests: `http://host:port`.
    pub api: String,
    /// Its peer listener (`cluster.listen`), where Raft's RPCs go: `host:port`.
    pub peer: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proposal_goes_through_serde_as_its_bytes() {
        let proposal = Proposal {
            frames: vec![0, 1, 254, 255],
        };
        let json = serde_json::to_string(&proposal).unwrap();
        assert_eq!(json, "[0,1,254,255]");
        assert_eq!(serde_json::from_str::<Proposal>(&json).unwrap(), proposal);
        assert!(serde_json::from_str::<Proposal>("[256]").is_err());
        assert_eq!(format!("{proposal:?}"), "Proposal { frames: 4 bytes }");
    }

    #[test]
    fn a_member_goes_through_serde_by_its_names() {
        let member = Member {
            api: "http://127.0.0.1:7071".into(),
            peer: "127.0.0.1:7171".into(),
        };
        let json = serde_json::to_string(&member).unwrap();
        assert_eq!(
            json,
            r#"{"api":"http://127.0.0.1:7071","peer":"127.0.0.1:7171"}"#
        );
        assert_eq!(serde_json::from_str::<Member>(&json).unwrap(), member);
    }
}
