//! Status lookups: [`ScheduleLog::lookup`] finds a message by id and follows its attempts to the
//! current one, with what became of each.
//!
//! Invariants: each hop moves to a later attempt, so a corrupt cycle ends after `u16::MAX` hops; the
//! outcome that decides an attempt's state is chosen by [`deciding`] alone, which listing.rs (through
//! [`state_of`]) and view.rs `effect` agree with.

use super::ScheduleLog;
use crate::error::Result;
use crate::id::{Location, MessageId};
use crate::record::{Message, Outcome, OutcomeKind};

/// The state of a message, as a status lookup reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageState {
    /// Waiting for its time (or for a retry when `attempt > 0`).
    Pending,
    Delivered {
        at_ms: i64,
    },
    Dead {
        at_ms: i64,
        reason: String,
    },
    Cancelled {
        at_ms: i64,
    },
    /// Dead, and put away by an operator (out of the dead-letter list); `reason` is why it died.
    Discarded {
        at_ms: i64,
        reason: String,
    },
}

/// One attempt of a message and what became of it, as a lookup found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub attempt: u16,
    pub location: Location,
    pub deliver_at_ms: i64,
    /// The outcome that decided it (a `retried` one for an attempt a later one replaced); `None` while
    /// it is pending, or when it was retried without its `retried` outcome recorded.
    pub outcome: Option<Outcome>,
}

/// A message's current attempt and what became of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageStatus {
    /// The current (latest) attempt.
    pub message: Message,
    pub location: Location,
    pub state: MessageState,
    /// Why the previous attempt was retried, if that is known: `None` for a first attempt, and for an
    /// attempt found through the first attempt's pointer because the `retried` outcome before it was
    /// never recorded (the reason was in that outcome).
    pub last_retry_reason: Option<String>,
    /// Earlier attempts that have no outcome although a later attempt exists: the dispatcher wrote the
    /// retry but failed to record its `retried` outcome (a poisoned log, a shutdown). Until something is
    /// recorded for them they count as pending and a restart loads them again, so a cancel must cancel
    /// them too. Empty in the normal case.
    pub orphaned: Vec<Location>,
    /// Every attempt from the first to the current one.
    pub history: Vec<Attempt>,
}

impl ScheduleLog {
    /// Finds a message by id and follows its retries to the current attempt.
    ///
    /// Each attempt's `retried` outcome leads to the next one. The replayer also files a pointer to every
    /// later attempt under the first one (replay.rs), read with the first attempt's outcomes at no extra
    /// cost: where the chain ends at an attempt older than the newest pointer (the `retried` outcome
    /// was never recorded), the lookup goes on from the newest attempt, and the attempt it left is
    /// reported in [`MessageStatus::orphaned`] if nothing was recorded for it.
    pub fn lookup(&self, id: MessageId) -> Result<Option<MessageStatus>> {
        let mut location = id.first;
        let mut last_retry_reason = None;
        let mut orphaned = Vec::new();
        let mut history = Vec::new();
        // (attempt, where it lives) for every later attempt, from the pointers under the first one.
        let mut later: Vec<(u16, Location)> = Vec::new();
        // Each hop moves to a later attempt; attempts are u16, so this bounds a corrupt cycle.
        for hop in 0..=u16::MAX {
            let Some((message, _)) = self.find(location)? else {
                return Ok(None);
            };
            if message.id != id {
                return Ok(None);
            }
            // (Retired between reading the record and its outcomes: gone.)
            let Some(outcomes) = self.outcomes_of(location)? else {
                return Ok(None);
            };
            let (pointers, outcomes): (Vec<Outcome>, Vec<Outcome>) =
                outcomes.into_iter().partition(|o| {
                    o.attempt > message.attempt && matches!(o.kind, OutcomeKind::Retried { .. })
                });
            if hop == 0 {
                later = pointers
                    .into_iter()
                    .filter_map(|o| match o.kind {
                        OutcomeKind::Retried { next, .. } => Some((o.attempt, next)),
                        _ => None,
                    })
                    .collect();
            }
            let outcome = deciding(&outcomes).cloned();
            history.push(Attempt {
                attempt: message.attempt,
                location,
                deliver_at_ms: message.deliver_at_ms,
                outcome: outcome.clone(),
            });
            if let Some(OutcomeKind::Retried { next, reason }) = outcome.map(|o| o.kind) {
                location = next;
                last_retry_reason = Some(reason);
                continue;
            }
            let state = state_of(&outcomes);
            // A later attempt exists, so this one was retried although its `retried` outcome is
            // missing: the later attempt is the current one, whatever was recorded here.
            let newest = later
                .iter()
                .filter(|(attempt, _)| *attempt > message.attempt)
                .max_by_key(|(attempt, at)| (*attempt, at.seq));
            if let Some(&(_, next)) = newest {
                // (The first attempt is never orphaned: the pointers filed under it are outcomes of
                // its seq, so the loader counts it finished.)
                if state == MessageState::Pending && location != id.first {
                    orphaned.push(location);
                }
                location = next;
                last_retry_reason = None;
                continue;
            }
            return Ok(Some(MessageStatus {
                message,
                location,
                state,
                last_retry_reason,
                orphaned,
                history,
            }));
        }
        Ok(None)
    }
}

/// The outcome that decides an attempt's state, of those recorded for it (oldest first, the pointers to
/// later attempts left out): a `retried` one leads on to the next attempt whatever else was recorded (a
/// cancel that raced the retry); then a discard (it follows a `dead`); otherwise the first recorded.
/// view.rs `effect` reads outcome kinds the same way.
fn deciding(outcomes: &[Outcome]) -> Option<&Outcome> {
    let find = |kind: fn(&OutcomeKind) -> bool| outcomes.iter().find(|o| kind(&o.kind));
    find(|k| matches!(k, OutcomeKind::Retried { .. }))
        .or_else(|| find(|k| matches!(k, OutcomeKind::Discarded)))
        .or(outcomes.first())
}

/// The state an attempt's outcomes (oldest first, the pointers to later attempts left out) give it, when
/// none of them is `retried` (that one leads to the next attempt instead).
pub(crate) fn state_of(outcomes: &[Outcome]) -> MessageState {
    let Some(outcome) = deciding(outcomes) else {
        return MessageState::Pending;
    };
    let at_ms = outcome.at_ms;
    match &outcome.kind {
        OutcomeKind::Delivered => MessageState::Delivered { at_ms },
        OutcomeKind::Dead { reason } => MessageState::Dead {
            at_ms,
            reason: reason.clone(),
        },
        OutcomeKind::Cancelled => MessageState::Cancelled { at_ms },
        OutcomeKind::Discarded => MessageState::Discarded {
            at_ms,
            reason: outcomes
                .iter()
                .find_map(|o| match &o.kind {
                    OutcomeKind::Dead { reason } => Some(reason.clone()),
                    _ => None,
                })
                .unwrap_or_default(),
        },
        // Not reached for an attempt a lookup or a listing reports: both move past retried ones.
        OutcomeKind::Retried { .. } => MessageState::Pending,
    }
}
