//! Membership changes (DESIGN.md §10), run on the leader: a member is added as a learner, made a
//! voter once it has caught up (openraft's joint consensus: the joint config, then the new one), or
//! removed.
//!
//! Invariants:
//! - A member is promoted only once the leader knows it holds the log up to the entry that added it:
//!   a voter that is far behind would make the next writes wait for it.
//! - A member that never answered within the wait is taken out again, so that a typo in an address
//!   leaves nothing behind; one that answered and is still catching up stays a learner, and adding
//!   it again promotes it once it has.
//! - A removal is refused when it would leave no voter, or voters of which no majority answered the
//!   leader lately (the joint config needs a majority of the new voters too: the change could not
//!   commit, and the cluster would stop).

use super::node::Node;
use super::Member;
use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
use openraft::ChangeMembers;
use std::collections::BTreeSet;
use std::time::Duration;

/// How long adding a member waits for it to catch up, at most: within a forwarded request's time.
pub const CATCH_UP_WITHIN: Duration = Duration::from_secs(20);

/// Why a membership change was not made.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    /// The change makes no sense as asked (a member that is one already, an address another has).
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    /// The member to add never answered the leader.
    #[error("{0}")]
    Unreachable(String),
    /// The member to add answers and is catching up: it stays a learner.
    #[error("{0}")]
    CatchingUp(String),
    /// This member does not lead (any more), or Raft refused for a reason of its own.
    #[error("{0}")]
    NotLeader(String),
}

/// Adds member `id` at `member`'s addresses: a learner first, a voter once it has caught up
/// (within `within`).
pub async fn add(
    node: &Node,
    id: u64,
    member: Member,
    within: Duration,
) -> Result<(), MembershipError> {
    let raft = node.raft();
    let metrics = raft.metrics().borrow().clone();
    let membership = metrics.membership_config.membership().clone();
    if membership.voter_ids().any(|voter| voter == id) {
        return Err(MembershipError::Conflict(format!(
            "member {id} is a voter already"
        )));
    }
    for (other, known) in membership.nodes() {
        if *other != id && (known.api == member.api || known.peer == member.peer) {
            return Err(MembershipError::Conflict(format!(
                "member {other} has that address already (api {}, peer {})",
                known.api, known.peer
            )));
        }
    }
    let started = std::time::Instant::now();
    let added = raft
        .add_learner(id, member.clone(), false)
        .await
        .map_err(refused)?;
    let target = added.log_id.index;
    tracing::info!(member = id, peer = %member.peer, "added a learner; waiting for it to catch up");
    let deadline = tokio::time::Instant::now() + within;
    let mut watch = raft.metrics();
    loop {
        if !node.leads() {
            return Err(MembershipError::NotLeader(format!(
                "this member stopped leading while member {id} caught up: it is a learner; add it again (through any member) to make it a voter"
            )));
        }
        let matched = (watch.borrow_and_update().replication.as_ref())
            .and_then(|replication| replication.get(&id).cloned().flatten());
        if matched.is_some_and(|m| m.index >= target) {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            // Any answer since it was added counts (a snapshot's chunks too, while `matched` says
            // nothing yet).
            if matched.is_some() || node.answered_since(id, started) {
                return Err(MembershipError::CatchingUp(format!(
                    "member {id} is a learner, catching up (at entry {}, the leader at {}): add it again to make it a voter once it has",
                    matched.map_or(0, |m| m.index),
                    raft.metrics().borrow().last_log_index.unwrap_or(0)
                )));
            }
            let taken_out = raft
                .change_membership(ChangeMembers::RemoveNodes(BTreeSet::from([id])), false)
                .await;
            if let Err(error) = taken_out {
                return Err(MembershipError::Unreachable(format!(
                    "member {id} at peer {} did not answer within {within:?}, and taking it out again failed ({}): it is a learner; remove it (DELETE /v1/cluster/members/{id}) or start it",
                    member.peer,
                    refused(error)
                )));
            }
            return Err(MembershipError::Unreachable(format!(
                "member {id} at peer {} did not answer within {within:?}: is it running, with this cluster's secret and `join = true`? It was not added",
                member.peer
            )));
        }
        if tokio::time::timeout_at(deadline, watch.changed())
            .await
            .is_ok_and(|changed| changed.is_err())
        {
            return Err(MembershipError::NotLeader("Raft stopped".into()));
        }
    }
    raft.change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), false)
        .await
        .map_err(refused)?;
    tracing::info!(member = id, "made a voter");
    Ok(())
}

/// Removes member `id`, a voter or a learner.
pub async fn remove(node: &Node, id: u64) -> Result<(), MembershipError> {
    let raft = node.raft();
    let membership = raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .clone();
    if membership.get_node(&id).is_none() {
        return Err(MembershipError::NotFound(format!(
            "member {id} is not a member of the cluster"
        )));
    }
    let voters: BTreeSet<u64> = membership.voter_ids().collect();
    let change = match voters.contains(&id) {
        true => {
            let left: Vec<u64> = voters.iter().copied().filter(|v| *v != id).collect();
            if left.is_empty() {
                return Err(MembershipError::Conflict(format!(
                    "member {id} is the cluster's only voter: the last voter cannot be removed"
                )));
            }
            let answering = left
                .iter()
                .filter(|v| **v == node.id() || node.answered_lately(**v))
                .count();
            if answering * 2 <= left.len() {
                return Err(MembershipError::Conflict(format!(
                    "removing member {id} would leave voters {left:?}, of which only {answering} answered the leader lately: no majority could take the change (bring the others back first)"
                )));
            }
            ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        }
        false => ChangeMembers::RemoveNodes(BTreeSet::from([id])),
    };
    raft.change_membership(change, false)
        .await
        .map_err(refused)?;
    tracing::info!(member = id, "removed from the cluster");
    Ok(())
}

fn refused(error: RaftError<u64, ClientWriteError<u64, Member>>) -> MembershipError {
    match error {
        RaftError::APIError(ClientWriteError::ForwardToLeader(to)) => {
            MembershipError::NotLeader(format!(
                "this member no longer leads (the leader: {:?})",
                to.leader_id
            ))
        }
        RaftError::APIError(ClientWriteError::ChangeMembershipError(
            ChangeMembershipError::InProgress(_),
        )) => MembershipError::Conflict(
            "another membership change is under way: try again once it is done".into(),
        ),
        RaftError::APIError(ClientWriteError::ChangeMembershipError(other)) => {
            MembershipError::Conflict(other.to_string())
        }
        RaftError::Fatal(fatal) => MembershipError::NotLeader(format!("Raft stopped: {fatal}")),
    }
}
