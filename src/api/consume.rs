//! Consumption from the built-in broker: topics, offset pulls with long polling, consumer group offsets.

use super::error::ApiError;
use super::{AppState, JsonBody};
use crate::broker::Stored;
use crate::format::{format_ms, valid_name};
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;

fn check_name(kind: &'static str, name: &str) -> Result<(), ApiError> {
    if valid_name(name) || (kind == "topic" && name == crate::scheduler::DEAD_TOPIC) {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            if kind == "topic" {
                "invalid_topic"
            } else {
                "invalid_group"
            },
            format!("{kind} must match [A-Za-z0-9._-]{{1,200}} and not be only dots"),
        ))
    }
}

pub async fn topics(State(state): State<AppState>) -> Json<Value> {
    let topics: Vec<Value> = state
        .broker
        .topics()
        .into_iter()
        .map(|(name, queues)| json!({"name": name, "queues": queues}))
        .collect();
    Json(json!({"topics": topics}))
}

pub async fn topic(
    State(state): State<AppState>,
    Path(topic): Path<String>,
) -> Result<Json<Value>, ApiError> {
    check_name("topic", &topic)?;
    let queues = state.broker.queue_offsets(&topic).ok_or_else(|| {
        ApiError::not_found(format!(
            "no topic {topic:?} (a topic exists once a message was delivered to it)"
        ))
    })?;
    let queues: Vec<Value> = queues
        .iter()
        .enumerate()
        .map(|(i, (min, max))| json!({"queue": i, "min_offset": min, "max_offset": max}))
        .collect();
    Ok(Json(json!({"name": topic, "queues": queues})))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PullQuery {
    #[serde(default)]
    offset: u64,
    #[serde(default = "default_max")]
    max: usize,
    #[serde(default)]
    wait_ms: u64,
}

fn default_max() -> usize {
    32
}

fn message_json(stored: &Stored) -> Value {
    let meta = &stored.meta;
    let mut value = json!({
        "offset": stored.offset,
        "id": meta.id,
        "topic": meta.topic,
        "headers": meta.headers,
        "deliver_at": format_ms(meta.deliver_at_ms),
        "delivered_at": format_ms(meta.delivered_at_ms),
        "attempt": meta.attempt,
    });
    if let Some(key) = &meta.key {
        value["key"] = json!(key);
    }
    match std::str::from_utf8(&stored.body) {
        Ok(text) => value["body"] = json!(text),
        Err(_) => {
            value["body_base64"] =
                json!(base64::engine::general_purpose::STANDARD.encode(&stored.body))
        }
    }
    value
}

pub async fn pull(
    State(state): State<AppState>,
    Path((topic, queue)): Path<(String, String)>,
    query: Result<Query<PullQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    check_name("topic", &topic)?;
    let queue: u32 = queue
        .parse()
        .map_err(|_| ApiError::bad_request("invalid_queue", "queue must be a whole number"))?;
    let Query(query) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
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
    if state.broker.queue_offsets(&topic).is_none() && !wait.is_zero() {
        // Listening before the second look: an arrival in between is not missed.
        let notified = state.broker.arrivals();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if state.broker.queue_offsets(&topic).is_none() {
            let _ = tokio::time::timeout(wait, notified).await;
        }
        wait = Duration::ZERO;
    }
    let Some(offsets) = state.broker.queue_offsets(&topic) else {
        return Err(ApiError::not_found(format!("no topic {topic:?}")));
    };
    let Some(&(_, max_offset)) = offsets.get(queue as usize) else {
        return Err(ApiError::not_found(format!(
            "topic {topic:?} has {} queues",
            offsets.len()
        )));
    };
    if query.offset > max_offset {
        return Err(ApiError::bad_request(
            "invalid_offset",
            format!(
                "offset {} is past the end of the queue ({max_offset})",
                query.offset
            ),
        ));
    }
    let pulled = state
        .broker
        .pull(&topic, queue, query.offset, query.max, wait)
        .await
        .map_err(ApiError::from)?;
    let (from, messages) = pulled.map_or((query.offset, Vec::new()), |p| (p.from, p.messages));
    // Below min_offset (retention deleted those messages) the answer starts at min_offset and says how
    // many were skipped; next_offset moves past them even when nothing is there yet.
    let next_offset = messages.last().map_or(from, |m| m.offset + 1);
    let messages: Vec<Value> = messages.iter().map(message_json).collect();
    Ok(Json(json!({
        "messages": messages,
        "next_offset": next_offset,
        "skipped": from.saturating_sub(query.offset),
    }))
    .into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffsetBody {
    offset: u64,
}

pub async fn commit_offset(
    State(state): State<AppState>,
    Path((group, topic, queue)): Path<(String, String, String)>,
    JsonBody(body): JsonBody<OffsetBody>,
) -> Result<Json<Value>, ApiError> {
    check_name("group", &group)?;
    check_name("topic", &topic)?;
    let queue: u32 = queue
        .parse()
        .map_err(|_| ApiError::bad_request("invalid_queue", "queue must be a whole number"))?;
    // Only a queue that exists, and not past its end: a typo would otherwise be kept for ever.
    let offsets = state
        .broker
        .queue_offsets(&topic)
        .ok_or_else(|| ApiError::not_found(format!("no topic {topic:?}")))?;
    let Some(&(_, max_offset)) = offsets.get(queue as usize) else {
        return Err(ApiError::not_found(format!(
            "topic {topic:?} has {} queues",
            offsets.len()
        )));
    };
    if body.offset > max_offset {
        return Err(ApiError::bad_request(
            "invalid_offset",
            format!(
                "offset {} is past the end of the queue ({max_offset})",
                body.offset
            ),
        ));
    }
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
        Err(crate::broker::CommitError::Broker(e)) => return Err(e.into()),
    }
    Ok(Json(
        json!({"group": group, "topic": topic, "queue": queue, "offset": body.offset}),
    ))
}

pub async fn group_offsets(
    State(state): State<AppState>,
    Path((group, topic)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    check_name("group", &group)?;
    check_name("topic", &topic)?;
    let queues: Vec<Value> = state
        .broker
        .group_offsets(&group, &topic)
        .into_iter()
        .map(|(queue, offset)| json!({"queue": queue, "offset": offset}))
        .collect();
    Ok(Json(json!({"queues": queues})))
}
