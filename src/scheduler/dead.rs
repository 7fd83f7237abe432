//! Dead letters: a dead message made a new attempt (requeue), or put away (discard).
//!
//! - A requeue writes the next attempt through the WAL, as a retry does (the same id, the attempt number
//!   one up, the replayer's pointer under the first attempt), and then records a `retried` outcome for
//!   the dead attempt: a lookup follows it to the new attempt, and the status keeps the count of
//!   attempts and the reason it died. Once the new attempt is written the requeue has happened: the
//!   outcome is tried again for a few seconds if it cannot be recorded (a full disk), and should it
//!   still fail the requeue is answered as done and the failure logged. The pointer then leads lookups
//!   (and a second requeue, which finds the message pending) to the new attempt; only a listing of dead
//!   letters still shows the old attempt of a message that had been retried before it died.
//! - A discard records a `discarded` outcome: the message stays dead (never delivered) and leaves the
//!   dead-letter list.
//! - Both run one at a time, so that two requeues of one message cannot make two attempts: the second
//!   looks it up after the first recorded its outcome, and finds it pending.
//! - The new attempt carries no idempotency key claim (`dedup` off): the key was let go when it died.
//! - A source's request that was dead on arrival is requeued as a message like any other (its mark,
//!   the `delayd-dead-on-arrival` header, is left behind); the HTTP edge first checks that it would be
//!   taken now (api/messages.rs).

use super::SchedulerState;
use schedulelog::{
    AppendError, MessageId, MessageState, MessageStatus, NewMessage, Outcome, OutcomeKind,
};
use std::sync::Arc;

/// Why a dead letter was not requeued or discarded.
#[derive(Debug, thiserror::Error)]
pub enum DeadLetterError {
    #[error("no message has this id (or it was retired after its retention)")]
    NotFound,
    /// Only a dead message can be requeued or discarded; this says what it is.
    #[error("the message is {0}, not dead")]
    NotDead(&'static str),
    #[error("the message has had as many attempts as an id can count")]
    TooManyAttempts,
    #[error("looking the message up failed: {0}")]
    Lookup(#[from] schedulelog::Error),
    #[error(transparent)]
    Append(#[from] AppendError),
    #[error("the task ended without an answer: {0}")]
    Interrupted(String),
}

/// A requeued message's new attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requeued {
    pub attempt: u16,
    pub deliver_at_ms: i64,
}

async fn dead(
    shared: &SchedulerState,
    id: MessageId,
) -> Result<(MessageStatus, String), DeadLetterError> {
    let log = shared.log.clone();
    let status = tokio::task::spawn_blocking(move || log.lookup(id))
        .await
        .map_err(|e| DeadLetterError::Interrupted(e.to_string()))??
        .ok_or(DeadLetterError::NotFound)?;
    match &status.state {
        MessageState::Dead { reason, .. } => {
            let reason = reason.clone();
            Ok((status, reason))
        }
        // The words a lookup of the message shows.
        MessageState::Pending if status.message.attempt == 0 => {
            Err(DeadLetterError::NotDead("scheduled"))
        }
        MessageState::Pending => Err(DeadLetterError::NotDead("retrying")),
        MessageState::Delivered { .. } => Err(DeadLetterError::NotDead("delivered")),
        MessageState::Cancelled { .. } => Err(DeadLetterError::NotDead("cancelled")),
        MessageState::Discarded { .. } => Err(DeadLetterError::NotDead("discarded")),
    }
}

async fn record(
    shared: &SchedulerState,
    status: &MessageStatus,
    kind: OutcomeKind,
) -> Result<(), DeadLetterError> {
    let outcome = Outcome {
        seq: status.location.seq,
        at_ms: shared.clock.now_ms(),
        attempt: status.message.attempt,
        kind,
    };
    let (log, bucket) = (shared.log.clone(), status.location.bucket);
    tokio::task::spawn_blocking(move || log.record_outcomes(&[(bucket, outcome)]))
        .await
        .map_err(|e| DeadLetterError::Interrupted(e.to_string()))??;
    Ok(())
}

/// Makes a dead message a new attempt due at `deliver_at_ms`.
pub(crate) async fn requeue(
    shared: Arc<SchedulerState>,
    id: MessageId,
    deliver_at_ms: i64,
) -> Result<Requeued, DeadLetterError> {
    let _one_at_a_time = shared.dead_letter_ops.lock().await;
    let (status, reason) = dead(&shared, id).await?;
    let m = &status.message;
    let attempt = m
        .attempt
        .checked_add(1)
        .ok_or(DeadLetterError::TooManyAttempts)?;
    let next = NewMessage {
        deliver_at_ms,
        topic: m.topic.clone(),
        key: m.key.clone(),
        // Requeued, a request that was dead on arrival is delivered like any message.
        headers: (m.headers.iter())
            .filter(|(name, _)| name != super::DEAD_ON_ARRIVAL_HEADER)
            .cloned()
            .collect(),
        sink: m.sink.clone(),
        body: m.body.clone(),
        retry_of: Some((id, attempt)),
        dedup: false,
    };
    // A stored message encodes again: it passed the same limits.
    let encoded = next
        .encode()
        .map_err(|e| DeadLetterError::Interrupted(e.to_string()))?;
    let appended = shared
        .log
        .append(vec![encoded])
        .await?
        .pop()
        .ok_or_else(|| DeadLetterError::Interrupted("an append returned no location".into()))?;
    let kind = OutcomeKind::Retried {
        next: appended.location,
        reason: format!("requeued; it had died: {reason}"),
    };
    let mut pause = std::time::Duration::from_millis(100);
    for try_number in 1.. {
        match record(&shared, &status, kind.clone()).await {
            Ok(()) => break,
            Err(error) if try_number < 6 && shared.log.poisoned().is_none() => {
                tracing::warn!(%id, %error, "recording a requeue's outcome failed; trying again");
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            Err(error) => {
                tracing::error!(%id, %error, "recording a requeue's outcome failed; the new attempt is written and will be delivered, but the dead-letter list may still show the old one");
                break;
            }
        }
    }
    metrics::counter!("delayd_messages_requeued_total").increment(1);
    Ok(Requeued {
        attempt,
        deliver_at_ms,
    })
}

/// Puts a dead message away: it stays dead and leaves the dead-letter list.
pub(crate) async fn discard(
    shared: Arc<SchedulerState>,
    id: MessageId,
) -> Result<(), DeadLetterError> {
    let _one_at_a_time = shared.dead_letter_ops.lock().await;
    let (status, _) = dead(&shared, id).await?;
    record(&shared, &status, OutcomeKind::Discarded).await?;
    metrics::counter!("delayd_messages_discarded_total").increment(1);
    Ok(())
}
