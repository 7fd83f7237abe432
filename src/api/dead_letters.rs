//! Dead letters over HTTP: `POST /v1/messages/{id}/requeue` makes a dead message a new attempt,
//! `POST /v1/messages/{id}/discard` puts it away (it stays dead and leaves the dead-letter list). Both
//! go through the scheduler's dead-letter operations, one at a time (scheduler/dead.rs).

use super::error::{ApiError, Problem};
use super::messages::{
    after_delay, check_disk, delay_schema, deliver_at, deliver_at_schema, parse_id,
    serialize_display, NumberOrText,
};
use super::{parse_json, AppState, RawBody};
use crate::intake::Draft;
use crate::timestamp::format_ms;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use schedulelog::MessageId;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use utoipa::ToSchema;

/// The body of a requeue: when the new attempt is due (now when neither is given).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RequeueRequest<'a> {
    #[serde(borrow)]
    #[schema(schema_with = deliver_at_schema)]
    deliver_at: Option<NumberOrText<'a>>,
    #[serde(borrow)]
    #[schema(schema_with = delay_schema)]
    delay: Option<NumberOrText<'a>>,
}

/// Requeues a dead message.
///
/// `POST /v1/messages/{id}/requeue`: a dead message becomes a new attempt, due now or at the
/// `deliver_at` / after the `delay` given, through the WAL. 200 with its status; 409 `not_dead` for a
/// message that is not dead; 404 for an unknown id.
#[utoipa::path(
    post,
    path = "/v1/messages/{id}/requeue",
    tag = "dead letters",
    params(("id" = String, Path, description = "the message's id")),
    request_body(content = Option<RequeueRequest>, content_type = "application/json",
        description = "when the new attempt is due; an empty body: now"),
    responses(
        (status = 200, description = "requeued: durable", body = Requeued),
        (status = 400, description = "`invalid_json`, `invalid_deliver_at`, `invalid_delay`, \
            `conflicting_time_fields`, `delay_too_long`", body = Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "`not_found`", body = Problem,
            content_type = "application/problem+json"),
        (status = 408, description = "`request_timeout`", body = Problem,
            content_type = "application/problem+json"),
        (status = 409, description = "`not_dead`: the message is not a dead letter; \
            `too_many_attempts`: it has had as many attempts as an id can count; \
            `not_requeueable`: an MQ source's request that was dead on arrival cannot go out as it \
            is (no target, cut to fit the log, a cancel, a migration schedule header, or it fails \
            the checks of a new message)", body = Problem,
            content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`, `storage_failed`, `shutting_down`", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`: free space is below the reserve, as for a new \
            message (nothing was written)", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn requeue(
    State(state): State<AppState>,
    Path(id): Path<String>,
    RawBody(bytes): RawBody,
) -> Result<Json<Requeued>, ApiError> {
    let id = parse_id(&id)?;
    // No body, or `null`: due now.
    let request: RequeueRequest = if bytes.iter().all(u8::is_ascii_whitespace) {
        RequeueRequest::default()
    } else {
        parse_json::<Option<RequeueRequest>>(&bytes)?.unwrap_or_default()
    };
    let now = state.clock.now_ms();
    let deliver_at_ms = match (&request.deliver_at, &request.delay) {
        (Some(at), None) => deliver_at(at)?,
        (None, Some(delay)) => after_delay(delay, now)?,
        (None, None) => now,
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "conflicting_time_fields",
                "give deliver_at or delay, not both",
            ))
        }
    };
    let max_delay = state.config.max_delay.as_ms();
    if deliver_at_ms.saturating_sub(now) > max_delay {
        return Err(ApiError::bad_request(
            "delay_too_long",
            format!("the delivery time is more than max_delay ({max_delay} ms) away"),
        ));
    }
    // A requeue writes the message again: refused like a new one while the disk is short of space
    // (counted as large as a message may be: its size is known only once it is read).
    check_disk(&state, state.config.limits.max_message_bytes)?;
    if let Some(status) = state.intake.lookup(id).await? {
        requeueable(&state, &status.message, deliver_at_ms, now)?;
    }
    let requeued = state.scheduler.requeue_dead(id, deliver_at_ms).await?;
    Ok(Json(Requeued {
        id,
        status: RequeuedState::Retrying,
        deliver_at: format_ms(requeued.deliver_at_ms),
        attempts: requeued.attempt,
    }))
}

/// `POST /v1/messages/{id}/requeue`: the new attempt.
#[derive(Debug, Serialize, ToSchema)]
pub struct Requeued {
    #[serde(serialize_with = "serialize_display")]
    #[schema(value_type = String)]
    id: MessageId,
    #[schema(inline)]
    status: RequeuedState,
    #[schema(format = DateTime)]
    deliver_at: String,
    /// How many attempts were made: each one delivered, retried, dead or discarded (`attempt` numbers one, 0 first).
    attempts: u16,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RequeuedState {
    Retrying,
}

/// Whether a dead message may go out as it is. A message taken over HTTP was checked when it was; a
/// source's request that was dead on arrival (`delayd-dead-on-arrival`) never was: it must pass the
/// checks of a new message now (its target, under the sink's current `targets`; its body's size; its
/// headers), name a target, have been stored whole (one cut to fit the log, `delayd-body-bytes`, never
/// goes out), not be a cancel, and carry no migration header its target would read as a schedule
/// (`x-delay`, `Nats-Schedule`, `scheduler-*`). 409 `not_requeueable` says why not.
fn requeueable(
    state: &AppState,
    message: &schedulelog::Message,
    deliver_at_ms: i64,
    now_ms: i64,
) -> Result<(), ApiError> {
    let value = |name: &str| {
        (message.headers.iter())
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim())
    };
    if value(crate::scheduler::DEAD_ON_ARRIVAL_HEADER).is_none() {
        return Ok(());
    }
    let refuse = |why: String| {
        Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_requeueable",
            format!("this request of an MQ source cannot go out as it is: {why}; publish it again"),
        ))
    };
    if message.topic.is_empty() {
        return refuse("it named no target (delayd-target)".into());
    }
    if value(crate::scheduler::BODY_BYTES_HEADER).is_some() {
        return refuse("it was cut to fit the log".into());
    }
    if value("delayd-cancel").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return refuse("it is a cancel, not a message".into());
    }
    // Taken, the request would have had these read and removed; sent on, its target would read them
    // again (a delayed-message exchange would delay it once more). (`delayd-*` never goes out.)
    let scheduling = |name: &str| {
        let lower = name.to_ascii_lowercase();
        lower == "x-delay" || lower.starts_with("nats-schedule") || lower.starts_with("scheduler-")
    };
    if let Some((name, _)) = message.headers.iter().find(|(name, _)| scheduling(name)) {
        return refuse(format!(
            "it carries {name}, which its target would read again"
        ));
    }
    let draft = Draft {
        deliver_at_ms,
        topic: &message.topic,
        key: message.key.as_deref(),
        headers: (message.headers.iter())
            .filter(|(name, _)| name != crate::scheduler::DEAD_ON_ARRIVAL_HEADER)
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect(),
        sink: &message.sink,
        body: Cow::Borrowed(&message.body),
        dedup: false,
    };
    match draft.check(&state.intake.admission, now_ms) {
        Ok(()) => Ok(()),
        Err(rejection) => refuse(rejection.to_string()),
    }
}

/// Discards a dead message.
///
/// `POST /v1/messages/{id}/discard`: a dead message is put away (it stays dead, and leaves the
/// dead-letter list). 200; 409 `not_dead`; 404 for an unknown id.
#[utoipa::path(
    post,
    path = "/v1/messages/{id}/discard",
    tag = "dead letters",
    params(("id" = String, Path, description = "the message's id")),
    responses(
        (status = 200, description = "discarded: durable", body = Discarded),
        (status = 404, description = "`not_found`", body = Problem,
            content_type = "application/problem+json"),
        (status = 409, description = "`not_dead`: the message is not a dead letter", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`, `storage_failed`, `shutting_down`", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn discard(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Discarded>, ApiError> {
    let id = parse_id(&id)?;
    state.scheduler.discard_dead(id).await?;
    Ok(Json(Discarded {
        id,
        status: DiscardedState::Discarded,
    }))
}

/// `POST /v1/messages/{id}/discard`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Discarded {
    #[serde(serialize_with = "serialize_display")]
    #[schema(value_type = String)]
    id: MessageId,
    #[schema(inline)]
    status: DiscardedState,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DiscardedState {
    Discarded,
}
