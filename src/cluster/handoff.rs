//! Handing an election to the member with the longer log.
//!
//! openraft 0.9.25 lets each follower stand for election when its own timer runs out (1.5 to 2
//! election timeouts after the last heartbeat, `super::raft_config`). When the first to stand is the
//! follower that had not yet received the leader's last entries, the others refuse it (a voter
//! refuses a candidate whose log is shorter than its own), and then:
//! - the refused candidate waits two election timeouts more before it stands again, and keeps that
//!   longer wait for every later election until it stands once more (so a member that lost one
//!   election this way is slow in the next too);
//! - the member with the longer log stands only when its own timer runs out, into the term the
//!   refused candidate took: the candidate refuses it (it voted for itself in that term), and it wins
//!   only at its timer after that.
//!
//! Measured over 12 leader kills under load (tests/cluster.rs, a 1 s election timeout), this made
//! the failover's median 3.9 s and its worst 6.4 s, against 1.9 s when the longer log stood first.
//!
//! So a member that refuses a candidate because its own log is longer stands at once itself, as soon
//! as it has not heard from a leader for an election timeout, in a term above the refused candidate's
//! (that candidate then votes for it: its vote is not committed, and this log is longer). openraft's
//! own timers stay as they are, the fallback for every other case.
//!
//! Invariants:
//! - A member stands here only when it has not heard from any leader for an election timeout
//!   (openraft's leader lease, the longest election timeout): an append it accepted is a leader's
//!   word. So a leader's delivery lease (node.rs: a majority's heartbeat round sent at most then, plus
//!   half an election timeout) has ended before this member can be elected, as with openraft's own
//!   elections: the refused candidate stood by its own timer, later still.
//! - A leader that speaks after the refusal cancels the hand-off: a leader exists.
//! - A refusal leads to a few campaigns at most; nothing here loops on its own.

use super::TypeConfig;
use openraft::{Raft, ServerState};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Campaigns one refusal may start: one that only reaches the refused candidate's term (which it
/// refuses), one above it, and one more for an answer that came late.
const MAX_CAMPAIGNS: usize = 3;

/// What this member's Raft service saw that bears on a hand-off (network.rs reports it).
#[derive(Debug)]
pub struct Handoff {
    /// When this member last accepted an append (a heartbeat included) from a leader; at first, when
    /// it started (it may have acknowledged a leader's heartbeat just before a restart).
    heard: Mutex<Instant>,
    /// The term of the last candidate refused for a log shorter than this member's, and when.
    refused: tokio::sync::watch::Sender<Option<(u64, Instant)>>,
}

impl Default for Handoff {
    fn default() -> Handoff {
        Handoff {
            heard: Mutex::new(Instant::now()),
            refused: tokio::sync::watch::channel(None).0,
        }
    }
}

impl Handoff {
    /// This member accepted an append from a leader (its answer was not "a higher vote").
    pub fn heard_leader(&self) {
        *self.heard.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// This member refused a candidate in `term` whose log is shorter than its own.
    pub fn refused_shorter(&self, term: u64) {
        self.refused.send_replace(Some((term, Instant::now())));
    }

    fn heard(&self) -> Instant {
        *self.heard.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Stands for election after each refusal, as the module doc says; runs until aborted (the member's
/// shutdown aborts it) or Raft refuses a campaign because it stopped. `quiet`: the election timeout,
/// how long no leader must have been heard from (at least the longest election timeout, openraft's
/// leader lease, for the delivery lease's margin: node.rs).
pub async fn run(
    raft: Raft<TypeConfig>,
    handoff: std::sync::Arc<Handoff>,
    id: u64,
    quiet: Duration,
) {
    let mut refused = handoff.refused.subscribe();
    loop {
        if refused.changed().await.is_err() {
            return;
        }
        let Some((term, refused_at)) = *refused.borrow_and_update() else {
            continue;
        };
        // A leader heard from after the refusal: one leads, nothing to hand over.
        let led_since = || handoff.heard() > refused_at;
        tokio::time::sleep_until((handoff.heard() + quiet).into()).await;
        for _ in 0..MAX_CAMPAIGNS {
            let (state, before) = {
                let metrics = raft.metrics();
                let metrics = metrics.borrow();
                (metrics.state, metrics.vote.leader_id().term)
            };
            if led_since() || matches!(state, ServerState::Leader | ServerState::Shutdown) {
                break;
            }
            tracing::info!(
                member = id,
                refused_term = term,
                "refused a candidate with a shorter log, and no leader has spoken for an election timeout: standing for election"
            );
            if raft.trigger().elect().await.is_err() {
                return; // Raft stopped
            }
            // The campaign's term, once Raft took it up: the term after this member's vote.
            let campaign = raft
                .wait(Some(quiet / 2))
                .metrics(|m| m.vote.leader_id().term > before, "a campaign begun")
                .await;
            let Ok(campaign) = campaign else { continue };
            let campaign = campaign.vote.leader_id().term;
            if campaign <= term {
                // The refused candidate voted for itself in its term: it refuses this campaign
                // (and openraft takes no other's vote of the same term in answer). One above, at once.
                continue;
            }
            // Elected, or refused by another's vote of a later term, which the next campaign goes above.
            let answered = raft
                .wait(Some(quiet / 2))
                .metrics(
                    |m| {
                        m.state == ServerState::Leader
                            || (m.vote.leader_id().node_id != id
                                && m.vote.leader_id().term > campaign)
                    },
                    "a campaign answered",
                )
                .await;
            if answered.is_ok_and(|m| m.state == ServerState::Leader) {
                break;
            }
        }
    }
}
