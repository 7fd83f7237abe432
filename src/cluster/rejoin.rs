//! A member that rejoins empty grants no vote until it has caught up.
//!
//! A member started with `join = true` on an empty data dir (one added to a running cluster, or one
//! whose disk was lost, restarted with its old id) holds none of the entries it may have acknowledged
//! before, and has forgotten its vote. Were it to vote at once, a candidate lacking acknowledged
//! entries could win with its vote (those entries were on it and on one other member only), and in a
//! term it had voted in before it could vote twice. So it refuses every vote until it has applied what
//! the first leader it heard from had committed then: from that point it holds everything any earlier
//! majority acknowledged, and the terms it knew before are over.
//!
//! Invariants:
//! - Only a member that started empty with `join` is held; the hold ends once, for good (a restart
//!   with a log or a vote is not empty).
//! - A refused vote is answered as openraft refuses one: this member's vote, not granted.

use openraft::raft::VoteResponse;
use openraft::{LogId, Vote};
use std::sync::Mutex;

/// Whether this member still refuses votes, and until which applied entry.
#[derive(Debug, Default)]
pub struct Rejoin {
    state: Mutex<State>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Votes go to Raft as usual.
    #[default]
    Voting,
    /// Started empty to join: no leader heard yet.
    WaitingForLeader,
    /// Until this member has applied this index.
    CatchingUp(u64),
}

impl Rejoin {
    /// A member that started empty with `join` holds its votes; any other votes as usual.
    pub fn new(empty_joiner: bool) -> Rejoin {
        let state = match empty_joiner {
            true => State::WaitingForLeader,
            false => State::Voting,
        };
        Rejoin {
            state: Mutex::new(state),
        }
    }

    /// This member accepted an append from a leader that had committed up to `leader_commit`.
    pub fn heard_leader(&self, leader_commit: Option<u64>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if *state == State::WaitingForLeader {
            *state = State::CatchingUp(leader_commit.unwrap_or(0));
        }
    }

    /// `None` when this member, whose vote is `vote` and which applied up to `applied`, may vote;
    /// else the refusal to answer a vote request with.
    pub fn refusal(
        &self,
        vote: Vote<u64>,
        applied_id: Option<LogId<u64>>,
    ) -> Option<VoteResponse<u64>> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let applied = applied_id.map(|id| id.index);
        if let State::CatchingUp(target) = *state {
            if applied.is_some_and(|a| a >= target) {
                tracing::info!(applied = ?applied, "caught up after joining empty: this member votes from now on");
                *state = State::Voting;
            }
        }
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
        let vote = Vote::new(3, 2);
        let rejoin = Rejoin::new(true);
        let refused = rejoin.refusal(vote, None).expect("no leader heard yet");
        assert!(!refused.vote_granted);
        assert_eq!((refused.vote, refused.last_log_id), (vote, None));
        rejoin.heard_leader(Some(40));
        rejoin.heard_leader(Some(90)); // the first leader's commit is the target
        assert!(rejoin.refusal(vote, applied(39)).is_some(), "behind");
        assert!(rejoin.refusal(vote, applied(40)).is_none(), "caught up");
        assert!(rejoin.refusal(vote, applied(0)).is_none(), "for good");
    }

    #[test]
    fn any_other_member_votes_as_usual() {
        let rejoin = Rejoin::new(false);
        assert!(rejoin.refusal(Vote::new(1, 1), None).is_none());
        rejoin.heard_leader(Some(10));
        assert!(rejoin.refusal(Vote::new(1, 1), None).is_none());
    }
}
