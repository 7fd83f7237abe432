//! Writes to a replicated log, for the cluster layer to propose (DESIGN.md §10). Appends, cancels,
//! outcomes and application payloads submitted to a replicated [`ScheduleLog`](crate::ScheduleLog) do not go to its WAL writer:
//! they queue here, the leader's proposer forms each group of them into one normal entry
//! ([`Proposals::next_group`], assigning seqs, ids and commit times exactly as a single node's writer
//! does), proposes it, and answers its submitters with what became of it. Callers of the log do not
//! know which they talk to.
//!
//! Invariants:
//! - A submitter is answered `Ok` only by [`FormedGroup::answer`] with `Ok`, which the proposer calls
//!   once the entry is committed and applied here; every other way out (an error, the group dropped,
//!   the log closed) answers an error.
//! - Groups are formed one at a time, each from the seq the proposer says is next.

use crate::clock::Clock;
use crate::commit::{Answer, Request};
use crate::entry::{
    normal_entry_bytes, EntryBuilder, EntryPayload, PlacedOutcome, MAX_ENTRY_BYTES,
};
use crate::error::AppendError;
use crate::frame;
use crate::record::CANCEL_PAYLOAD_LEN;
use crate::SegmentMinutes;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::time::Duration;

/// A group stops taking queued submissions past this many bytes of records (one may take it over), as
/// the single node's writer's groups do.
#[cfg(not(test))]
const GROUP_TARGET_BYTES: usize = 4 << 20;
#[cfg(test)]
const GROUP_TARGET_BYTES: usize = 2 << 10;

/// The queue of a replicated log's writes (taken once, by its proposer: `ScheduleLog::proposals`).
#[derive(Debug)]
pub struct Proposals {
    pub(crate) requests: Receiver<Request>,
    pub(crate) width: SegmentMinutes,
    /// A submission that did not fit the last group: the next group starts with it.
    pub(crate) held: std::sync::Mutex<Option<Request>>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Request(..)")
    }
}

/// The bytes of record frames a submission adds to an entry.
fn record_bytes(request: &Request) -> usize {
    match request {
        Request::Append { messages, .. } => messages.iter().map(|m| m.frame.len()).sum(),
        Request::Cancel { .. } => frame::HEADER_LEN + CANCEL_PAYLOAD_LEN,
        Request::Outcomes { outcomes, .. } => outcomes_bytes(outcomes),
        Request::App {
            payload, outcomes, ..
        } => frame::HEADER_LEN + payload.len() + outcomes_bytes(outcomes),
        _ => 0,
    }
}

/// The bytes of outcome frames in an entry: each its bucket and the outcome's payload.
pub fn outcomes_bytes(outcomes: &[PlacedOutcome]) -> usize {
    (outcomes.iter())
        .map(|(_, outcome)| {
            let mut payload = Vec::new();
            outcome.encode_payload(&mut payload);
            frame::HEADER_LEN + 4 + payload.len()
        })
        .sum()
}

/// One group of submissions formed into an entry's records, waiting to be answered.
#[derive(Debug)]
#[must_use = "its submitters wait for an answer"]
pub struct FormedGroup {
    payload: EntryPayload,
    /// The seq the next group starts at, should this one be committed.
    pub next_seq: u64,
    answers: Vec<Answer>,
}

/// What [`Proposals::next_group`] found.
#[derive(Debug)]
pub enum NextGroup {
    Formed(FormedGroup),
    /// Nothing came within the wait.
    Idle,
    /// The log is closed: no submission comes any more.
    Closed,
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Answer(..)")
    }
}

impl Proposals {
    /// Waits up to `wait` for a submission, then forms it and whatever else is queued (up to a group's
    /// bytes) into one entry's records, from the seq `next_seq` gives then on, committed now by
    /// `clock`.
    pub fn next_group(
        &self,
        next_seq: impl FnOnce() -> u64,
        clock: &dyn Clock,
        wait: Duration,
    ) -> NextGroup {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let first = match held
            .take()
            .map_or_else(|| self.requests.recv_timeout(wait), Ok)
        {
            Ok(request) => request,
            Err(RecvTimeoutError::Timeout) => return NextGroup::Idle,
            Err(RecvTimeoutError::Disconnected) => return NextGroup::Closed,
        };
        // An entry is one write at most (`MAX_ENTRY_BYTES`): a submission larger than that on its own
        // is refused here, before Raft, where a refused entry would stop the member.
        let mut planned = record_bytes(&first);
        if normal_entry_bytes(planned) > MAX_ENTRY_BYTES {
            first.fail(AppendError::Refused(format!(
                "a write of {planned} bytes of records is larger than one Raft entry may be ({MAX_ENTRY_BYTES})"
            )));
            return NextGroup::Idle;
        }
        // Asked only now, after the wait: the log may have changed meanwhile.
        let created_at_ms = clock.now_ms();
        let mut builder = EntryBuilder::new(next_seq(), self.width);
        let mut answers = Vec::new();
        let mut add = |request: Request, builder: &mut EntryBuilder| match request {
            Request::Append { messages, reply } => {
                let appended = builder.append(&messages, created_at_ms);
                answers.push(Answer::Append(reply, appended));
            }
            Request::Cancel { target, reply } => {
                let seq = builder.cancel(target, created_at_ms);
                answers.push(Answer::Cancel(reply, seq));
            }
            Request::Outcomes { outcomes, reply } => {
                builder.outcomes(&outcomes);
                answers.push(Answer::Done(reply));
            }
            Request::App {
                payload,
                outcomes,
                reply,
            } => {
                // One entry: applied together, or (a crash, a lost leadership) not at all.
                builder.app(&payload);
                builder.outcomes(&outcomes);
                answers.push(Answer::Done(reply));
            }
            other => other.fail(AppendError::Refused(
                "not a write a replicated log proposes".into(),
            )),
        };
        add(first, &mut builder);
        while planned < GROUP_TARGET_BYTES {
            let Ok(request) = self.requests.try_recv() else {
                break;
            };
            let bytes = record_bytes(&request);
            if normal_entry_bytes(planned + bytes) > MAX_ENTRY_BYTES {
                *held = Some(request);
                break;
            }
            planned += bytes;
            add(request, &mut builder);
        }
        let (payload, next_seq) = builder.finish();
        NextGroup::Formed(FormedGroup {
            payload,
            next_seq,
            answers,
        })
    }
}

impl FormedGroup {
    /// The entry's payload, to propose (taken once).
    pub fn take_payload(&mut self) -> EntryPayload {
        std::mem::replace(&mut self.payload, EntryPayload::Blank)
    }

    /// Answers every submitter of the group: `Ok` once its entry is committed and applied here.
    pub fn answer(mut self, result: Result<(), AppendError>) {
        for answer in self.answers.drain(..) {
            answer.send(result.as_ref().err());
        }
    }
}

impl Drop for FormedGroup {
    /// A group dropped unanswered was not proposed (this member does not lead, as far as its proposer
    /// can tell): its submitters must not wait for ever, nor be told it worked.
    fn drop(&mut self) {
        let error = AppendError::NotLeader { leader: None };
        for answer in self.answers.drain(..) {
            answer.send(Some(&error));
        }
    }
}
