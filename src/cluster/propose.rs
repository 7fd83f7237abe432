//! Writes through Raft (DESIGN.md §10): on the leader, appends, cancels and outcomes are formed into one entry per
//! group commit, as a single node's WAL writer forms one write per group, and proposed; their
//! submitters are answered once the entry is committed and applied.
//!
//! Invariants:
//! - One proposal at a time: the next entry's seqs start where the log's handed-in entries end
//!   (`ScheduleLog::next_entry_seq`), which holds only once the proposal before it was appended or
//!   refused. Requests that come meanwhile form the next group.
//! - A submitter is answered `Ok` only after its entry is applied on this member (openraft's
//!   `client_write`); a failed proposal answers every submitter of its group with the same error, and
//!   the entry may still be committed later by another leader (the answer is then unknown, as for any
//!   timed-out write: idempotency keys are for that).

use super::{Proposal, TypeConfig};
use schedulelog::{
    Appended, Clock, EncodedMessage, EntryBuilder, Location, PlacedOutcome, ScheduleLog,
};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// A group stops taking queued requests past this many bytes of records (one request may take it
/// over), as the single node's writer does.
const GROUP_TARGET_BYTES: usize = 4 << 20;

/// Requests waiting to be formed into entries, at most.
const QUEUE: usize = 4096;

/// Why a write through Raft failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProposeError {
    /// This member does not lead: the write goes to `leader` (unknown while there is none).
    #[error("not the leader (the leader is {leader:?})")]
    NotLeader { leader: Option<u64> },
    /// Too many writes are waiting to be proposed.
    #[error("overloaded: too many writes are waiting to be proposed")]
    Overloaded,
    /// Raft or the log failed; the write's fate is unknown.
    #[error("the write through Raft failed: {0}")]
    Failed(String),
}

enum Request {
    Append {
        messages: Vec<EncodedMessage>,
        reply: oneshot::Sender<Result<Vec<Appended>, ProposeError>>,
    },
    Cancel {
        target: Location,
        reply: oneshot::Sender<Result<u64, ProposeError>>,
    },
    Outcomes {
        outcomes: Vec<PlacedOutcome>,
        reply: oneshot::Sender<Result<(), ProposeError>>,
    },
}

/// What a formed group's submitters are told once its entry is applied.
enum Answer {
    Append(
        oneshot::Sender<Result<Vec<Appended>, ProposeError>>,
        Vec<Appended>,
    ),
    Cancel(oneshot::Sender<Result<u64, ProposeError>>, u64),
    Outcomes(oneshot::Sender<Result<(), ProposeError>>),
}

impl Answer {
    fn send(self, error: Option<&ProposeError>) {
        match (self, error) {
            (Answer::Append(reply, appended), None) => drop(reply.send(Ok(appended))),
            (Answer::Cancel(reply, seq), None) => drop(reply.send(Ok(seq))),
            (Answer::Outcomes(reply), None) => drop(reply.send(Ok(()))),
            (Answer::Append(reply, _), Some(e)) => drop(reply.send(Err(e.clone()))),
            (Answer::Cancel(reply, _), Some(e)) => drop(reply.send(Err(e.clone()))),
            (Answer::Outcomes(reply), Some(e)) => drop(reply.send(Err(e.clone()))),
        }
    }
}

/// The handle writers submit to; the forming task ends when the last handle is dropped.
#[derive(Debug, Clone)]
pub struct Proposer {
    requests: mpsc::Sender<Request>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Request::Append { messages, .. } => write!(f, "Append({} messages)", messages.len()),
            Request::Cancel { target, .. } => write!(f, "Cancel({target:?})"),
            Request::Outcomes { outcomes, .. } => write!(f, "Outcomes({})", outcomes.len()),
        }
    }
}

impl Proposer {
    /// Starts forming entries for `raft` from `log`'s next seq on, committed at `clock`'s time.
    pub fn start(
        raft: openraft::Raft<TypeConfig>,
        log: Arc<ScheduleLog>,
        clock: Arc<dyn Clock>,
    ) -> Proposer {
        let (requests, queue) = mpsc::channel(QUEUE);
        tokio::spawn(form(raft, log, clock, queue));
        Proposer { requests }
    }

    /// Appends messages through Raft: answered once their entry is applied here.
    pub async fn append(
        &self,
        messages: Vec<EncodedMessage>,
    ) -> Result<Vec<Appended>, ProposeError> {
        let (reply, answer) = oneshot::channel();
        self.submit(Request::Append { messages, reply })?;
        answer.await.unwrap_or_else(|_| Err(gone()))
    }

    /// Cancels the attempt at `target` through Raft: the tombstone's seq once applied.
    pub async fn cancel(&self, target: Location) -> Result<u64, ProposeError> {
        let (reply, answer) = oneshot::channel();
        self.submit(Request::Cancel { target, reply })?;
        answer.await.unwrap_or_else(|_| Err(gone()))
    }

    /// Records outcomes through Raft, so that every member's dispatch logs hold them: answered once
    /// applied here.
    pub async fn record_outcomes(&self, outcomes: Vec<PlacedOutcome>) -> Result<(), ProposeError> {
        let (reply, answer) = oneshot::channel();
        self.submit(Request::Outcomes { outcomes, reply })?;
        answer.await.unwrap_or_else(|_| Err(gone()))
    }

    fn submit(&self, request: Request) -> Result<(), ProposeError> {
        self.requests.try_send(request).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ProposeError::Overloaded,
            mpsc::error::TrySendError::Closed(_) => gone(),
        })
    }
}

fn gone() -> ProposeError {
    ProposeError::Failed("the proposer stopped".into())
}

/// The forming task: a group of whatever is queued, one entry, one proposal at a time.
async fn form(
    raft: openraft::Raft<TypeConfig>,
    log: Arc<ScheduleLog>,
    clock: Arc<dyn Clock>,
    mut queue: mpsc::Receiver<Request>,
) {
    while let Some(first) = queue.recv().await {
        let next_seq = match log.next_entry_seq() {
            Ok(seq) => seq,
            Err(e) => {
                let error = ProposeError::Failed(e.to_string());
                answer_one(first, &error);
                continue;
            }
        };
        let mut builder = EntryBuilder::new(next_seq, log.segment_minutes());
        let mut answers = Vec::new();
        let created_at_ms = clock.now_ms();
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
                answers.push(Answer::Outcomes(reply));
            }
        };
        add(first, &mut builder);
        while builder.len() < GROUP_TARGET_BYTES {
            match queue.try_recv() {
                Ok(request) => add(request, &mut builder),
                Err(_) => break,
            }
        }
        let schedulelog::EntryPayload::Normal(frames) = builder.finish().0 else {
            unreachable!("a builder makes normal entries");
        };
        let error = match raft.client_write(Proposal { frames }).await {
            Ok(_) => None,
            Err(e) => Some(match e.forward_to_leader() {
                Some(forward) => ProposeError::NotLeader {
                    leader: forward.leader_id,
                },
                None => ProposeError::Failed(e.to_string()),
            }),
        };
        for answer in answers {
            answer.send(error.as_ref());
        }
    }
}

fn answer_one(request: Request, error: &ProposeError) {
    match request {
        Request::Append { reply, .. } => drop(reply.send(Err(error.clone()))),
        Request::Cancel { reply, .. } => drop(reply.send(Err(error.clone()))),
        Request::Outcomes { reply, .. } => drop(reply.send(Err(error.clone()))),
    }
}
