//! A member that rejoins empty neither votes nor stands for election until it has caught up.
//!
//! A member started with `join = true` on an empty data dir (one added to a running cluster, or one
//! whose disk was lost, restarted with its old id) holds none of the entries it may have acknowledged
//! before, and has forgotten its vote. Were it to vote at once, a candidate lacking acknowledged
//! entries could win with its vote (those entries were on it and on one other member only), and in a
//! term it had voted in before it could vote twice; standing itself, it could win with such a vote.
//! So it refuses every vote, and its own elections are off, until it has applied what the first
//! leader it heard from had committed then: from that point it holds everything any earlier majority
//! acknowledged, and the terms it knew before are over.
//!
//! ```text
//! {data}/raft/REJOIN   empty file: present while the hold lasts (made before the member serves)
//! ```
//!
//! Invariants:
//! - The hold survives restarts (the one that installs a snapshot above all): it is a file, removed
//!   only once this member has caught up. Deleting it by hand and restarting lifts it (the way out
//!   when the leader is lost for good before the member caught up, at the risk it guards against).
//! - A refused vote is answered as openraft refuses one: this member's vote, not granted.

use openraft::raft::VoteResponse;
use openraft::{LogId, Vote};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The hold's file, in the raft dir.
pub const REJOIN_FILE: &str = "REJOIN";

/// Whether this member still holds its vote, and until which applied entry.
#[derive(Debug)]
pub struct Rejoin {
    state: Mutex<State>,
    /// The hold's file; `None` for a member that never holds (in-process tests).
    file: Option<PathBuf>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Votes go to Raft as usual.
    #[default]
    Voting,
    /// No leader heard yet since the start.
    WaitingForLeader,
    /// Until this member has applied this index.
    CatchingUp(u64),
}

impl Default for Rejoin {
    /// A member that votes as usual.
    fn default() -> Rejoin {
        Rejoin {
            state: Mutex::new(State::Voting),
            file: None,
        }
    }
}

impl Rejoin {
    /// The hold of the member whose Raft state is in `raft_dir`: held if it starts empty with
    /// `join` (the file is made, durably, before this returns), or if the file is still there from
    /// an earlier start.
    pub fn open(raft_dir: &Path, empty_joiner: bool) -> Result<Rejoin, schedulelog::Error> {
        let file = raft_dir.join(REJOIN_FILE);
        let held = empty_joiner || file.exists();
        if empty_joiner && !file.exists() {
            schedulelog::write_atomically(&file, b"")?;
        }
        let state = match held {
            true => State::WaitingForLeader,
            false => State::Voting,
        };
        Ok(Rejoin {
            state: Mutex::new(state),
            file: Some(file),
        })
    }

    /// Whether this member holds its vote (and its elections) now.
    pub fn holds(&self) -> bool {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) != State::Voting
    }

    /// This member accepted an append from a leader that had committed up to `leader_commit`, and
    /// it has applied up to `applied`. Whether the hold ended just now (its file is then gone).
    pub fn heard_leader(&self, leader_commit: Option<u64>, applied: Option<u64>) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if *state == State::WaitingForLeader {
            *state = State::CatchingUp(leader_commit.unwrap_or(0));
        }
        self.caught_up(&mut state, applied)
    }

    /// Ends the hold if this member has applied what it waits for.
    fn caught_up(&self, state: &mut State, applied: Option<u64>) -> bool {
        let State::CatchingUp(target) = *state else {
            return false;
        };
        if applied.is_none_or(|a| a < target) {
            return false;
        }
        if let Some(file) = &self.file {
            if let Err(error) = std::fs::remove_file(file) {
                // Still held at the next start, which waits for a leader again: safe.
                tracing::warn!(%error, file = %file.display(), "the rejoin hold's file could not be removed");
            }
        }
        tracing::info!(applied = ?applied, "caught up after joining empty: this member votes from now on");
        *state = State::Voting;
        true
    }

    /// `None` when this member, whose vote is `vote` and which applied up to `applied_id`, may
    /// vote; else the refusal to answer a vote request with.
    pub fn refusal(
        &self,
        vote: Vote<u64>,
        applied_id: Option<LogId<u64>>,
    ) -> Option<VoteResponse<u64>> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.caught_up(&mut state, applied_id.map(|id| id.index));
        match *state {
            State::Voting => None,
            _ => Some(VoteResponse {
                vote,
                vote_granted: false,
                last_log_id: applied_id,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::LeaderId;

    fn applied(index: u64) -> Option<LogId<u64>> {
        Some(LogId::new(LeaderId::new(2, 1), index))
    }

    #[test]
    fn an_empty_joiner_refuses_votes_until_it_applied_what_its_first_leader_had_committed() {
        let dir = tempfile::tempdir().unwrap();
        let vote = Vote::new(3, 2);
        let rejoin = Rejoin::open(dir.path(), true).unwrap();
        assert!(rejoin.holds() && dir.path().join(REJOIN_FILE).exists());
        let refused = rejoin.refusal(vote, None).expect("no leader heard yet");
        assert!(!refused.vote_granted);
        assert_eq!((refused.vote, refused.last_log_id), (vote, None));
        assert!(!rejoin.heard_leader(Some(40), Some(3)));
        assert!(
            !rejoin.heard_leader(Some(90), Some(10)),
            "the first leader's commit is the target"
        );
        assert!(rejoin.refusal(vote, applied(39)).is_some(), "behind");
        // A restart meanwhile (the one that installs a snapshot): still held.
        let restarted = Rejoin::open(dir.path(), false).unwrap();
        assert!(restarted.holds());
        assert!(restarted.refusal(vote, applied(39)).is_some());
        assert!(rejoin.heard_leader(Some(90), Some(40)), "caught up");
        assert!(rejoin.refusal(vote, applied(0)).is_none(), "for good");
        assert!(!dir.path().join(REJOIN_FILE).exists());
        assert!(!Rejoin::open(dir.path(), false).unwrap().holds());
    }

    #[test]
    fn any_other_member_votes_as_usual() {
        let dir = tempfile::tempdir().unwrap();
        let rejoin = Rejoin::open(dir.path(), false).unwrap();
        assert!(!rejoin.holds() && !dir.path().join(REJOIN_FILE).exists());
        assert!(rejoin.refusal(Vote::new(1, 1), None).is_none());
        assert!(!rejoin.heard_leader(Some(10), None));
        assert!(rejoin.refusal(Vote::new(1, 1), None).is_none());
    }
}
