//! Consumption from the built-in broker: topics, offset pulls with long polling, consumer group offsets.

use super::error::{ApiError, Problem};
use super::{AppState, JsonBody};
use crate::broker::{Broker, Stored};
use crate::names::valid_name;
use crate::timestamp::format_ms;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use utoipa::ToSchema;

/// The `{topic}` of a path.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub struct TopicPath {
    /// A topic: `[A-Za-z0-9._-]{1,200}` and not only dots, or `$dead` (the dead letters).
    #[param(
        pattern = r"^([.]*[A-Za-z0-9_-][A-Za-z0-9._-]*|\$dead)$",
        max_length = 200
    )]
    #[expect(
        dead_code,
        reason = "described, never read: the handlers take the path as text"
    )]
    topic: String,
}

/// The `{group}` of a path.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub struct GroupPath {
    /// A consumer group: `[A-Za-z0-9._-]{1,200}` and not only dots.
    #[param(pattern = "^[.]*[A-Za-z0-9_-][A-Za-z0-9._-]*$", max_length = 200)]
    #[expect(
        dead_code,
        reason = "described, never read: the handlers take the path as text"
    )]
    group: String,
}

/// The `{queue}` of a path.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub struct QueuePath {
    /// The queue's number, from 0.
    #[expect(
        dead_code,
        reason = "described, never read: the handlers take the path as text"
    )]
    queue: u32,
}

/// Runs `look` on the broker on the blocking pool: a store's lock is held through its commit-log
/// `fdatasync` (and a queue file's at a rollover), the offsets' lock through an offset commit's, and a
/// runtime worker waiting for one would stall every request and delivery scheduled on it meanwhile.
async fn off_runtime<T: Send + 'static>(
    state: &AppState,
    look: impl FnOnce(&Broker) -> T + Send + 'static,
) -> Result<T, ApiError> {
    let broker: Arc<Broker> = state.broker.clone();
    tokio::task::spawn_blocking(move || look(&broker))
        .await
        .map_err(ApiError::internal)
}

/// `(min_offset, max_offset)` of every queue of a topic; `None` for an unknown topic. Looked up at once
/// when the store's lock is free (most of the time: no hop to another thread), else on the blocking pool
/// (see [`off_runtime`]).
async fn queue_offsets(state: &AppState, topic: &str) -> Result<Option<Vec<(u64, u64)>>, ApiError> {
    if let Ok(offsets) = state.broker.queue_offsets_now(topic) {
        return Ok(offsets);
    }
    let topic = topic.to_string();
    off_runtime(state, move |broker| broker.queue_offsets(&topic)).await
}

/// The `{queue}` of a path: 400 `invalid_queue` for text that is not a whole number.
fn parse_queue(text: &str) -> Result<u32, ApiError> {
    text.parse()
        .map_err(|_| ApiError::bad_request("invalid_queue", "queue must be a whole number"))
}

/// An offset a pull or a commit names: 404 for an unknown topic or queue, 400 `invalid_offset` past
/// the queue's end (its `max_offset`, the next one to be written).
async fn check_offset(
    state: &AppState,
    topic: &str,
    queue: u32,
    offset: u64,
) -> Result<(), ApiError> {
    let offsets = queue_offsets(state, topic)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no topic {topic:?}")))?;
    let Some(&(_, max_offset)) = offsets.get(queue as usize) else {
        return Err(ApiError::not_found(format!(
            "topic {topic:?} has {} queues",
            offsets.len()
        )));
    };
    if offset > max_offset {
        return Err(ApiError::bad_request(
            "invalid_offset",
            format!("offset {offset} is past the end of the queue ({max_offset})"),
        ));
    }
    Ok(())
}

/// A topic from a path: a valid name, or the dead letters' own topic.
fn check_topic(topic: &str) -> Result<(), ApiError> {
    if valid_name(topic) || topic == crate::scheduler::DEAD_TOPIC {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            "invalid_topic",
            "topic must match [A-Za-z0-9._-]{1,200} and not be only dots",
        ))
    }
}

fn check_group(group: &str) -> Result<(), ApiError> {
    if valid_name(group) {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            "invalid_group",
            "group must match [A-Za-z0-9._-]{1,200} and not be only dots",
        ))
    }
}

/// The built-in broker's topics and their queue counts.
#[utoipa::path(
    get,
    path = "/v1/topics",
    tag = "broker",
    responses((status = 200, description = "every topic", body = Topics, links(
        ("topic" = (
            operation_id = "topic",
            parameters(("topic" = "$response.body#/topics/0/name"))
        ))
    )))
)]
pub async fn topics(State(state): State<AppState>) -> Result<Json<Topics>, ApiError> {
    let topics = off_runtime(&state, Broker::topics)
        .await?
        .into_iter()
        .map(|(name, queues)| TopicSummary { name, queues })
        .collect();
    Ok(Json(Topics { topics }))
}

/// `GET /v1/topics`.
#[derive(Serialize, ToSchema)]
pub struct Topics {
    topics: Vec<TopicSummary>,
}

/// A topic and how many queues it has.
#[derive(Serialize, ToSchema)]
pub struct TopicSummary {
    name: String,
    queues: u32,
}

/// A topic's queues and their offsets.
#[utoipa::path(
    get,
    path = "/v1/topics/{topic}",
    tag = "broker",
    params(TopicPath),
    responses(
        (status = 200, description = "the topic", body = Topic, links(
            ("pull" = (operation_id = "pull", parameters(
                ("topic" = "$response.body#/name"), ("queue" = "$response.body#/queues/0/queue")
            )))
        )),
        (status = 400, description = "`invalid_topic`", body = Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no message was delivered to this topic yet",
            body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn topic(
    State(state): State<AppState>,
    Path(topic): Path<String>,
) -> Result<Json<Topic>, ApiError> {
    check_topic(&topic)?;
    let queues = queue_offsets(&state, &topic).await?.ok_or_else(|| {
        ApiError::not_found(format!(
            "no topic {topic:?} (a topic exists once a message was delivered to it)"
        ))
    })?;
    let queues = (0..)
        .zip(queues)
        .map(|(queue, (min_offset, max_offset))| QueueOffsets {
            queue,
            min_offset,
            max_offset,
        })
        .collect();
    Ok(Json(Topic {
        name: topic,
        queues,
    }))
}

/// `GET /v1/topics/{topic}`.
#[derive(Serialize, ToSchema)]
pub struct Topic {
    name: String,
    queues: Vec<QueueOffsets>,
}

/// A queue's offsets: its oldest message kept, and the next offset to be written.
#[derive(Serialize, ToSchema)]
pub struct QueueOffsets {
    queue: u32,
    min_offset: u64,
    max_offset: u64,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PullQuery {
    /// The first offset to read (default 0); below the queue's `min_offset` the answer starts there.
    #[serde(default)]
    offset: u64,
    /// Messages at most, 1 to `broker.max_pull_messages` (default 32).
    #[serde(default = "default_max")]
    #[param(minimum = 1)]
    max: usize,
    /// With nothing at `offset`, wait this long for a message, at most `broker.max_wait`.
    #[serde(default)]
    wait_ms: u64,
}

fn default_max() -> usize {
    32
}

/// A delivered message as a consumer reads it: `body` when it is UTF-8, else `body_base64`.
// Borrowed from the stored message: a pull answers up to `broker.max_pull_messages` of them, and a
// `Value` tree would cost several allocations for each.
#[derive(Serialize, ToSchema)]
pub struct PulledMessage<'a> {
    offset: u64,
    #[schema(value_type = String)]
    id: &'a str,
    #[schema(value_type = String)]
    topic: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, nullable = false)]
    key: Option<&'a str>,
    #[schema(value_type = BTreeMap<String, String>)]
    headers: &'a BTreeMap<String, String>,
    #[schema(format = DateTime)]
    deliver_at: String,
    #[schema(format = DateTime)]
    delivered_at: String,
    attempt: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, nullable = false)]
    body: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, content_encoding = "base64")]
    body_base64: Option<String>,
}

impl<'a> From<&'a Stored> for PulledMessage<'a> {
    fn from(stored: &'a Stored) -> Self {
        let meta = &stored.meta;
        // `body` when it is UTF-8, else `body_base64`.
        let body = std::str::from_utf8(&stored.body).ok();
        PulledMessage {
            offset: stored.offset,
            id: &meta.id,
            topic: &meta.topic,
            key: meta.key.as_deref(),
            headers: &meta.headers,
            deliver_at: format_ms(meta.deliver_at_ms),
            delivered_at: format_ms(meta.delivered_at_ms),
            attempt: meta.attempt,
            body,
            body_base64: body
                .is_none()
                .then(|| base64::engine::general_purpose::STANDARD.encode(&stored.body)),
        }
    }
}

/// `GET /v1/topics/{topic}/queues/{queue}/messages`: `next_offset` is where to read next;
/// `skipped`, how many messages below the queue's `min_offset` were passed over.
#[derive(Serialize, ToSchema)]
pub struct Pulled<'a> {
    messages: Vec<PulledMessage<'a>>,
    next_offset: u64,
    skipped: u64,
}

/// Reads a queue from an offset.
///
/// With nothing at `offset`, waits up to `wait_ms` for a message (long polling, woken by the arrival).
#[utoipa::path(
    get,
    path = "/v1/topics/{topic}/queues/{queue}/messages",
    tag = "broker",
    params(TopicPath, QueuePath, PullQuery),
    responses(
        (status = 200, description = "the messages from `offset` on",
            body = Pulled),
        (status = 400, description = "`invalid_topic`, `invalid_queue`, `invalid_query`, \
            `invalid_offset` (past the queue's end)", body = Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such topic or queue", body = Problem,
            content_type = "application/problem+json"),
    )
)]
pub async fn pull(
    State(state): State<AppState>,
    Path((topic, queue)): Path<(String, String)>,
    query: Result<Query<PullQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    check_topic(&topic)?;
    let queue = parse_queue(&queue)?;
    let query = super::query_params(query)?;
    let max_pull = state.config.broker.max_pull_messages;
    if query.max == 0 || query.max > max_pull {
        return Err(ApiError::bad_request(
            "invalid_query",
            format!("max must be between 1 and {max_pull}"),
        ));
    }
    let max_wait = state.config.broker.max_wait.0;
    let wait = Duration::from_millis(query.wait_ms);
    if wait > max_wait {
        return Err(ApiError::bad_request(
            "invalid_query",
            format!("wait_ms must be at most {}", max_wait.as_millis()),
        ));
    }
    // A long poll on a topic that does not exist yet waits for the next delivery to any topic, then
    // answers with what is there (the first message may have gone to another queue).
    let mut wait = wait;
    if queue_offsets(&state, &topic).await?.is_none() && !wait.is_zero() {
        // Listening before the second look: an arrival in between is not missed.
        let notified = state.broker.arrivals();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if queue_offsets(&state, &topic).await?.is_none() {
            let _ = tokio::time::timeout(wait, notified).await;
        }
        wait = Duration::ZERO;
    }
    check_offset(&state, &topic, queue, query.offset).await?;
    let pulled = state
        .broker
        .pull(&topic, queue, query.offset, query.max, wait)
        .await
        .map_err(ApiError::from)?;
    let (from, messages) = pulled.map_or((query.offset, Vec::new()), |p| (p.from, p.messages));
    // Below min_offset (retention deleted those messages) the answer starts at min_offset and says how
    // many were skipped; next_offset moves past them even when nothing is there yet.
    let next_offset = messages.last().map_or(from, |m| m.offset + 1);
    Ok(Json(Pulled {
        messages: messages.iter().map(PulledMessage::from).collect(),
        next_offset,
        skipped: from.saturating_sub(query.offset),
    })
    .into_response())
}

/// A consumer group's offset in a queue: where it reads next.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OffsetBody {
    offset: u64,
}

/// Stores a consumer group's offset in a queue, durably.
#[utoipa::path(
    put,
    path = "/v1/groups/{group}/offsets/{topic}/{queue}",
    tag = "broker",
    params(GroupPath, TopicPath, QueuePath),
    request_body(content = OffsetBody, content_type = "application/json"),
    responses(
        (status = 200, description = "stored", body = CommittedOffset),
        (status = 400, description = "`invalid_json`, `invalid_group`, `invalid_topic`, \
            `invalid_queue`, `invalid_offset` (past the queue's end)", body = Problem,
            content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such topic or queue", body = Problem,
            content_type = "application/problem+json"),
        (status = 408, description = "`request_timeout`", body = Problem,
            content_type = "application/problem+json"),
        (status = 409, description = "`too_many_groups`: a new group past `broker.max_groups`",
            body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`no_leader`, `write_uncertain` (a cluster member: the commit \
            was not proposed, or no quorum took it in time)", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn commit_offset(
    State(state): State<AppState>,
    Path((group, topic, queue)): Path<(String, String, String)>,
    JsonBody(body): JsonBody<OffsetBody>,
) -> Result<Json<CommittedOffset>, ApiError> {
    check_group(&group)?;
    check_topic(&topic)?;
    let queue = parse_queue(&queue)?;
    // Only a queue that exists, and not past its end: a typo would otherwise be kept for ever.
    check_offset(&state, &topic, queue, body.offset).await?;
    let broker = state.broker.clone();
    let max_groups = state.config.broker.max_groups;
    let (g, t) = (group.clone(), topic.clone());
    let committed = tokio::task::spawn_blocking(move || {
        broker.commit_offset(&g, &t, queue, body.offset, max_groups)
    })
    .await
    .map_err(ApiError::internal)?;
    match committed {
        Ok(()) => {}
        Err(crate::broker::CommitError::TooManyGroups { max }) => {
            return Err(ApiError::new(
                axum::http::StatusCode::CONFLICT,
                "too_many_groups",
                format!(
                "there are {max} consumer groups already (broker.max_groups); this is a new one"
            ),
            ))
        }
        Err(crate::broker::CommitError::Invalid(detail)) => {
            return Err(ApiError::bad_request("invalid_offset", detail))
        }
        Err(crate::broker::CommitError::Broker(e)) => return Err(e.into()),
    }
    Ok(Json(CommittedOffset {
        group,
        topic,
        queue,
        offset: body.offset,
    }))
}

/// `PUT /v1/groups/{group}/offsets/{topic}/{queue}`: what was stored.
#[derive(Serialize, ToSchema)]
pub struct CommittedOffset {
    group: String,
    topic: String,
    queue: u32,
    offset: u64,
}

/// A consumer group's offsets in a topic's queues.
#[utoipa::path(
    get,
    path = "/v1/groups/{group}/offsets/{topic}",
    tag = "broker",
    params(GroupPath, TopicPath),
    responses(
        (status = 200, description = "the queues the group has an offset in",
            body = GroupOffsets),
        (status = 400, description = "`invalid_group`, `invalid_topic`", body = Problem,
            content_type = "application/problem+json"),
    )
)]
pub async fn group_offsets(
    State(state): State<AppState>,
    Path((group, topic)): Path<(String, String)>,
) -> Result<Json<GroupOffsets>, ApiError> {
    check_group(&group)?;
    check_topic(&topic)?;
    let queues = off_runtime(&state, move |broker| broker.group_offsets(&group, &topic))
        .await?
        .into_iter()
        .map(|(queue, offset)| GroupOffset { queue, offset })
        .collect();
    Ok(Json(GroupOffsets { queues }))
}

/// `GET /v1/groups/{group}/offsets/{topic}`.
#[derive(Serialize, ToSchema)]
pub struct GroupOffsets {
    queues: Vec<GroupOffset>,
}

/// A consumer group's offset in one queue.
#[derive(Serialize, ToSchema)]
pub struct GroupOffset {
    queue: u32,
    offset: u64,
}
