//! Scheduling, status and cancellation of messages.
//!
//! Every field of a request is checked before anything is written; a message is acknowledged (201) only
//! after the group commit that holds it returned from `fdatasync`.
//!
//! A cancel (`DELETE`) answers 200 only when no attempt of the message will start afterwards, and its
//! tombstone is durable; while an attempt is being delivered it answers 409 `delivery_in_flight` and
//! writes nothing (the scheduler's registry.rs keeps this true). Repeating a DELETE is safe.
//!
//! The idempotency index (`dedup`) holds a key only while its message is pending: the scheduler reports
//! each finished one (delivered, dead, cancelled) and the intake drops it from the index (intake.rs).

use super::error::{ApiError, Problem};
use super::{parse_json, AppState, RawBody};
use crate::intake::{Draft, Keyed, MessageKey};
use crate::timestamp::{format_ms, parse_rfc3339};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use schedulelog::{Appended, MessageId, OutcomeKind};
use serde::de::{Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use utoipa::openapi::schema::{AnyOfBuilder, KnownFormat, ObjectBuilder, SchemaFormat, Type};
use utoipa::ToSchema;

/// `deliver_at` (RFC 3339 or unix milliseconds) and `delay` (`"30s"`-style or milliseconds): a number
/// or a string. Read by a visitor: serde's untagged enums buffer every value before trying each variant.
#[derive(Debug)]
pub enum NumberOrText<'a> {
    Number(i64),
    Text(Cow<'a, str>),
}

impl<'de: 'a, 'a> Deserialize<'de> for NumberOrText<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<NumberOrText<'a>, D::Error> {
        struct NumberOrTextVisitor;
        impl<'de> Visitor<'de> for NumberOrTextVisitor {
            type Value = NumberOrText<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an integer or a string")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(NumberOrText::Number(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                i64::try_from(v)
                    .map(NumberOrText::Number)
                    .map_err(|_| E::custom(format!("{v} is out of range")))
            }
            fn visit_borrowed_str<E: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Self::Value, E> {
                Ok(NumberOrText::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(NumberOrText::Text(Cow::Owned(v.to_string())))
            }
        }
        deserializer.deserialize_any(NumberOrTextVisitor)
    }
}

/// A JSON string borrowed from the request when it has no escapes (most do not), copied when it has.
/// (A bare `Option<Cow<str>>` field would always be copied: serde borrows a `Cow` only when it is the
/// field's whole type, which it is here.)
#[derive(Debug, Deserialize)]
#[serde(transparent)]
pub struct Text<'a>(#[serde(borrow)] pub Cow<'a, str>);

/// One message to schedule: exactly one of `deliver_at`, `delay` and `delay_level`, and exactly one of
/// `body` and `body_base64`.
// Borrows its strings from the request body where it can.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScheduleRequest<'a> {
    /// `[A-Za-z0-9._-]{1,200}`, not only dots; for an MQ sink, the target (1 to 255 bytes, no
    /// whitespace or control characters).
    #[serde(borrow)]
    #[schema(value_type = String, examples("orders.timeout"))]
    topic: Text<'a>,
    /// The body as UTF-8 text (at most `limits.max_message_bytes`).
    #[serde(borrow)]
    #[schema(value_type = Option<String>)]
    body: Option<Text<'a>>,
    /// The body's bytes in standard base64.
    #[serde(borrow)]
    #[schema(value_type = Option<String>, content_encoding = "base64")]
    body_base64: Option<Text<'a>>,
    #[serde(borrow)]
    #[schema(schema_with = deliver_at_schema)]
    deliver_at: Option<NumberOrText<'a>>,
    #[serde(borrow)]
    #[schema(schema_with = delay_schema)]
    delay: Option<NumberOrText<'a>>,
    /// A delay from the `delay_levels` table, counted from 1 (RocketMQ's 18 levels by default).
    #[schema(minimum = 1)]
    delay_level: Option<i64>,
    /// 1 to 1024 bytes; the same key always lands in the same queue.
    #[serde(borrow)]
    #[schema(value_type = Option<String>)]
    key: Option<Text<'a>>,
    /// At most 64; names match `[A-Za-z0-9._-]{1,256}`, values have no control characters.
    #[serde(default)]
    headers: BTreeMap<String, String>,
    /// The sink that delivers it (default `broker`).
    #[serde(borrow)]
    #[schema(value_type = Option<String>)]
    sink: Option<Text<'a>>,
    /// With a key: while a message with this topic and key is pending, return it instead of adding one.
    #[serde(default)]
    dedup: bool,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest<'a> {
    /// At most `limits.max_batch_messages`.
    // Kept raw, so that each message is parsed on its own, straight into a request, with its own error.
    #[serde(borrow)]
    #[schema(value_type = Vec<ScheduleRequest>)]
    messages: Vec<&'a RawValue>,
}

/// Reads a batch whose every message parses, and has at most `max` of them, in one pass into requests.
/// [`BatchRequest`] reads each message twice (once to find where it ends, once to parse it), and
/// scanning 1 KiB bodies twice for escapes cost ~5 % of the server's CPU; a batch that does not parse
/// this way takes that path, for its errors (and its 413). Stopping at `max + 1` messages keeps an
/// oversized batch of tiny messages (a 16 MiB body holds a million) from being built before its 413.
///
/// One visitor reads both levels: the body as a map ([`plain_batch`]), whose `messages` value it reads
/// again, as a seed, as a sequence. (serde_json calls `visit_map` only for an object and `visit_seq`
/// only for an array, so neither level takes what the other would.)
struct PlainBatch {
    max: usize,
}

impl<'de> serde::de::DeserializeSeed<'de> for PlainBatch {
    type Value = Vec<ScheduleRequest<'de>>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for PlainBatch {
    type Value = Vec<ScheduleRequest<'de>>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(r#"{"messages": [...]}, and its array of messages"#)
    }

    /// The batch: a `messages` field and no other.
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        use serde::de::Error;
        let mut messages = None;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key != "messages" || messages.is_some() {
                return Err(A::Error::custom("not a plain batch"));
            }
            messages = Some(map.next_value_seed(PlainBatch { max: self.max })?);
        }
        messages.ok_or_else(|| A::Error::missing_field("messages"))
    }

    /// Its `messages`: an error past `max` of them.
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        use serde::de::Error;
        let mut messages = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.max));
        while let Some(message) = seq.next_element()? {
            if messages.len() == self.max {
                return Err(A::Error::custom("too many messages"));
            }
            messages.push(message);
        }
        Ok(messages)
    }
}

/// A whole body read by [`PlainBatch`].
fn plain_batch(bytes: &[u8], max: usize) -> serde_json::Result<Vec<ScheduleRequest<'_>>> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let messages = (&mut deserializer).deserialize_map(PlainBatch { max })?;
    deserializer.end()?;
    Ok(messages)
}

/// Each message of a batch request parsed, or why it is not; a 400 for a body that is not a batch, a
/// 413 for a batch of more than `max` messages.
fn parse_batch(
    bytes: &[u8],
    max: usize,
) -> Result<Vec<Result<ScheduleRequest<'_>, ApiError>>, ApiError> {
    if let Ok(messages) = plain_batch(bytes, max) {
        return Ok(messages.into_iter().map(Ok).collect());
    }
    let too_large = || ApiError::too_large(format!("a batch holds at most {max} messages"));
    let batch: BatchRequest = parse_json(bytes)?;
    if batch.messages.len() > max {
        return Err(too_large());
    }
    Ok(batch
        .messages
        .iter()
        .map(|raw| {
            serde_json::from_str(raw.get()).map_err(|e| {
                ApiError::bad_request(
                    "invalid_json",
                    format!("the message is not the expected JSON: {e}"),
                )
            })
        })
        .collect())
}

/// `deliver_at`: unix milliseconds or an RFC 3339 time.
pub(super) fn deliver_at(at: &NumberOrText<'_>) -> Result<i64, ApiError> {
    match at {
        NumberOrText::Number(ms) if *ms >= 0 => Ok(*ms),
        NumberOrText::Number(_) => Err(ApiError::bad_request(
            "invalid_deliver_at",
            "deliver_at must not be negative",
        )),
        NumberOrText::Text(text) => parse_rfc3339(text).ok_or_else(|| {
            ApiError::bad_request(
                "invalid_deliver_at",
                format!("deliver_at {text:?} is not an RFC 3339 time such as 2026-12-01T09:30:00Z"),
            )
        }),
    }
}

/// `delay` (milliseconds, or `"30s"`-style) from `now_ms`.
pub(super) fn after_delay(delay: &NumberOrText<'_>, now_ms: i64) -> Result<i64, ApiError> {
    let delay = match delay {
        NumberOrText::Number(ms) => {
            let ms = u64::try_from(*ms).map_err(|_| {
                ApiError::bad_request("invalid_delay", "delay must not be negative")
            })?;
            std::time::Duration::from_millis(ms)
        }
        NumberOrText::Text(text) => crate::config::parse_duration(text)
            .map_err(|e| ApiError::bad_request("invalid_delay", e))?,
    };
    Ok(now_ms.saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX)))
}

/// Checks a request and turns it into a message for the log.
fn validate<'a>(
    state: &AppState,
    request: &'a ScheduleRequest<'_>,
    now_ms: i64,
) -> Result<Draft<'a>, ApiError> {
    let config = &state.config;
    let deliver_at_ms = match (&request.deliver_at, &request.delay, request.delay_level) {
        (Some(at), None, None) => deliver_at(at)?,
        (None, Some(delay), None) => after_delay(delay, now_ms)?,
        (None, None, Some(level)) => {
            let levels = &config.delay_levels;
            let index = usize::try_from(level)
                .ok()
                .filter(|l| (1..=levels.len()).contains(l))
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "invalid_delay_level",
                        format!("delay_level must be between 1 and {}", levels.len()),
                    )
                })?;
            now_ms.saturating_add(levels[index - 1].as_ms())
        }
        (None, None, None) => {
            return Err(ApiError::bad_request(
                "missing_deliver_time",
                "give one of deliver_at, delay or delay_level",
            ))
        }
        _ => {
            return Err(ApiError::bad_request(
                "conflicting_time_fields",
                "give exactly one of deliver_at, delay or delay_level",
            ))
        }
    };
    let body: Cow<'a, [u8]> = match (&request.body, &request.body_base64) {
        (Some(text), None) => Cow::Borrowed(text.0.as_bytes()),
        (None, Some(encoded)) => Cow::Owned(
            base64::engine::general_purpose::STANDARD
                .decode(encoded.0.as_bytes())
                .map_err(|e| {
                    ApiError::bad_request("invalid_body", format!("body_base64 is not base64: {e}"))
                })?,
        ),
        (None, None) => {
            return Err(ApiError::bad_request(
                "invalid_body",
                "give body or body_base64",
            ))
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "invalid_body",
                "give body or body_base64, not both",
            ))
        }
    };
    // Where an MQ source's request was (a redelivered request would be taken for a message over HTTP
    // that claims its position), and a request's refusal (the message would be dead at once): delayd's
    // own.
    let own = [
        crate::source::POSITION_HEADER,
        crate::scheduler::DEAD_ON_ARRIVAL_HEADER,
    ];
    if let Some(name) =
        (request.headers.keys()).find(|n| own.iter().any(|o| n.eq_ignore_ascii_case(o)))
    {
        return Err(ApiError::bad_request(
            "invalid_header",
            format!("{name} is delayd's own header"),
        ));
    }
    let draft = Draft {
        deliver_at_ms,
        topic: &request.topic.0,
        key: request.key.as_ref().map(|k| &*k.0),
        headers: request
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect(),
        sink: request.sink.as_ref().map_or("broker", |s| &*s.0),
        body,
        dedup: request.dedup,
    };
    draft.check(&state.intake.admission, now_ms)?;
    Ok(draft)
}

/// A scheduled message: the answer of `POST /v1/messages`, and a batch's result.
// Typed and borrowed, not a `Value`: a batch answers thousands.
#[derive(Debug, Serialize, ToSchema)]
pub struct Scheduled<'a> {
    #[serde(serialize_with = "serialize_display")]
    #[schema(value_type = String)]
    id: MessageId,
    #[schema(value_type = String)]
    topic: &'a str,
    #[schema(format = DateTime)]
    deliver_at: String,
    status: Waiting,
    /// Present (`true`) when a `dedup` request found this message pending and added none.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    duplicate: bool,
}

/// How a pending message waits: its first attempt, or a retry.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Waiting {
    Scheduled,
    Retrying,
}

/// One result of a batch, in request order.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum BatchResult<'a> {
    Scheduled(Scheduled<'a>),
    Error { error: Problem },
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BatchAnswer<'a> {
    results: Vec<BatchResult<'a>>,
}

impl BatchAnswer<'_> {
    /// The answer as serde_json writes it, written by hand: a batch answers thousands of messages, and
    /// serde_json's escaping of each of their strings cost ~6 % of the server's CPU. Of a scheduled
    /// message's strings only the topic can need escaping (an MQ target may hold `"` or `\`), and a batch
    /// mostly repeats one, so each distinct topic in a row is escaped once; ids (`[a-z2-7]`) and times
    /// (digits and `-T:.Z`) never need it. Errors are rare and written by serde_json.
    ///
    /// The bytes are those `serde_json::to_vec(self)` gives (the test
    /// `a_batch_answer_is_written_as_serde_json_writes_it`), so the schema derived from this type
    /// documents them.
    fn to_json(&self) -> Vec<u8> {
        use std::io::Write;
        let mut out = Vec::with_capacity(32 + self.results.len() * 128);
        out.extend_from_slice(br#"{"results":["#);
        let mut topic: Option<(&str, Vec<u8>)> = None;
        for (i, result) in self.results.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let BatchResult::Scheduled(one) = result else {
                serde_json::to_writer(&mut out, result).expect("a problem serializes");
                continue;
            };
            if topic.as_ref().is_none_or(|(last, _)| *last != one.topic) {
                let escaped = serde_json::to_vec(one.topic).expect("a str serializes");
                topic = Some((one.topic, escaped));
            }
            let (_, escaped) = topic.as_ref().expect("set above");
            // Writes to a Vec do not fail.
            let _ = write!(out, r#"{{"id":"{}","topic":"#, one.id);
            out.extend_from_slice(escaped);
            out.extend_from_slice(br#","deliver_at":""#);
            out.extend_from_slice(one.deliver_at.as_bytes());
            out.extend_from_slice(match one.status {
                Waiting::Scheduled => br#"","status":"scheduled""#.as_slice(),
                Waiting::Retrying => br#"","status":"retrying""#.as_slice(),
            });
            if one.duplicate {
                out.extend_from_slice(br#","duplicate":true"#);
            }
            out.push(b'}');
        }
        out.extend_from_slice(b"]}");
        out
    }
}

/// Writes a value's `Display` form as a JSON string without an intermediate `String`.
pub(super) fn serialize_display<S: serde::Serializer>(
    value: &impl std::fmt::Display,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_str(value)
}

fn scheduled<'a>(appended: &Appended, topic: &'a str) -> Scheduled<'a> {
    Scheduled {
        id: appended.id,
        topic,
        deliver_at: format_ms(appended.deliver_at_ms),
        status: Waiting::Scheduled,
        duplicate: false,
    }
}

fn count_received(sink: &str, count: u64) {
    metrics::counter!("delayd_messages_received_total", "sink" => sink.to_string())
        .increment(count);
}

/// 507 while free disk space is below the reserve (or a request of `bytes` would take it there):
/// new messages wait, what is stored keeps moving.
pub(super) fn check_disk(state: &AppState, bytes: usize) -> Result<(), ApiError> {
    state.disk.admit(bytes).map_err(|_| {
        ApiError::disk_full(
            "the disk is nearly full; new messages are refused until space is freed (nothing was stored)",
        )
    })
}

/// Schedules one message, answered once it is durable (after the WAL's `fdatasync`).
#[utoipa::path(
    post,
    path = "/v1/messages",
    tag = "messages",
    request_body(content = ScheduleRequest, content_type = "application/json"),
    responses(
        (status = 201, description = "scheduled: durable", body = Scheduled, links(
            ("status" = (operation_id = "status", parameters(("id" = "$response.body#/id")))),
            ("cancel" = (operation_id = "cancel", parameters(("id" = "$response.body#/id")))),
        )),
        (status = 200, description = "`dedup` with a key whose message is pending: that message, \
            `duplicate: true`; nothing was added", body = Scheduled),
        (status = 400, description = "`invalid_json`, `invalid_body`, `missing_deliver_time`, \
            `conflicting_time_fields`, `invalid_deliver_at`, `invalid_delay`, `invalid_delay_level`, \
            `delay_too_long`, `invalid_topic`, `invalid_target`, `invalid_key`, `invalid_header`, \
            `unknown_sink`", body = Problem, content_type = "application/problem+json"),
        (status = 408, description = "`request_timeout`: the body did not arrive within \
            `limits.body_timeout`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`: a body over `limits.max_message_bytes`, \
            or a request over `limits.max_request_bytes`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`, `storage_failed`, `shutting_down`: nothing \
            was acknowledged", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`: nothing was stored", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn schedule(
    State(state): State<AppState>,
    RawBody(bytes): RawBody,
) -> Result<Response, ApiError> {
    state.intake.start_pruning();
    check_disk(&state, bytes.len())?;
    let request: ScheduleRequest = parse_json(&bytes)?;
    let message = validate(&state, &request, state.clock.now_ms())?;
    let encoded = message.encode()?;
    let appended = match (message.dedup, message.key) {
        (true, Some(key)) => match state
            .intake
            .schedule_keyed(
                &MessageKey {
                    sink: message.sink.to_string(),
                    topic: message.topic.to_string(),
                    key: key.to_string(),
                },
                encoded,
            )
            .await?
        {
            Keyed::Scheduled(appended) => appended,
            Keyed::Pending(existing, status) => {
                return Ok(Json(duplicate(existing, &status)).into_response());
            }
        },
        _ => state
            .intake
            .schedule(vec![encoded])
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| ApiError::internal("an append returned no id"))?,
    };
    count_received(message.sink, 1);
    Ok((
        StatusCode::CREATED,
        Json(scheduled(&appended, message.topic)),
    )
        .into_response())
}

/// The answer for an existing pending message returned again.
fn duplicate(id: MessageId, status: &schedulelog::MessageStatus) -> Scheduled<'_> {
    Scheduled {
        id,
        topic: &status.message.topic,
        deliver_at: format_ms(status.message.deliver_at_ms),
        status: if status.message.attempt == 0 {
            Waiting::Scheduled
        } else {
            Waiting::Retrying
        },
        duplicate: true,
    }
}

/// Schedules many messages at once.
///
/// Each is checked on its own, and the valid ones are made durable by one group commit. The results
/// are in request order.
#[utoipa::path(
    post,
    path = "/v1/messages/batch",
    tag = "messages",
    request_body(content = BatchRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "each message's result: scheduled, or its problem",
            body = BatchAnswer),
        (status = 400, description = "`invalid_json`: the body is not a batch (a message's own \
            errors are in its result)", body = Problem, content_type = "application/problem+json"),
        (status = 408, description = "`request_timeout`", body = Problem,
            content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`: over `limits.max_request_bytes` or \
            `limits.max_batch_messages`", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "the group commit failed (`overloaded`, `storage_failed`, \
            `shutting_down`): every result is a problem; nothing was acknowledged", body = BatchAnswer,
            headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`, nothing was stored: a problem when the disk is \
            below its reserve, or every result a problem when a write found it full", content(
            (Problem = "application/problem+json"), (BatchAnswer = "application/json")),
            headers(("Retry-After" = u32))),
    )
)]
pub async fn schedule_batch(
    State(state): State<AppState>,
    RawBody(bytes): RawBody,
) -> Result<Response, ApiError> {
    check_disk(&state, bytes.len())?;
    // Parsed first and kept: the results borrow their sink and topic from them.
    let requests = parse_batch(&bytes, state.config.limits.max_batch_messages)?;
    let now = state.clock.now_ms();
    // Validate each; the valid ones go to the log together, in one group commit.
    // (sink, topic) of each valid message, or why it is not.
    let mut results: Vec<Result<(&str, &str), ApiError>> = Vec::with_capacity(requests.len());
    let mut encoded = Vec::new();
    for request in &requests {
        let checked = request
            .as_ref()
            .map_err(ApiError::clone)
            .and_then(|request| validate(&state, request, now))
            .and_then(|message| {
                if message.dedup {
                    Err(ApiError::bad_request(
                        "dedup_not_in_batch",
                        "send messages with dedup one at a time (POST /v1/messages)",
                    ))
                } else {
                    Ok((message.encode()?, message.sink, message.topic))
                }
            });
        results.push(checked.map(|(one, sink, topic)| {
            encoded.push(one);
            (sink, topic)
        }));
    }
    let appended = if encoded.is_empty() {
        Ok(Vec::new())
    } else {
        state.intake.schedule(encoded).await.map_err(ApiError::from)
    };
    let mut appended = match appended {
        Ok(appended) => appended.into_iter(),
        Err(error) => {
            let results = results
                .iter()
                .map(|r| BatchResult::Error {
                    error: match r {
                        Ok(_) => error.problem(),
                        Err(e) => e.problem(),
                    },
                })
                .collect();
            let mut answer = (error.status, Json(BatchAnswer { results })).into_response();
            if let Some(secs) = error.retry_after_secs {
                answer
                    .headers_mut()
                    .insert(axum::http::header::RETRY_AFTER, secs.into());
            }
            return Ok(answer);
        }
    };
    let mut answers = Vec::with_capacity(results.len());
    let mut received: HashMap<&str, u64> = HashMap::new();
    for result in &results {
        match result {
            Ok((sink, topic)) => {
                *received.entry(sink).or_default() += 1;
                let Some(one) = appended.next() else {
                    return Err(ApiError::internal(
                        "a batch append returned fewer ids than messages",
                    ));
                };
                answers.push(BatchResult::Scheduled(scheduled(&one, topic)));
            }
            Err(e) => answers.push(BatchResult::Error { error: e.problem() }),
        }
    }
    for (sink, count) in received {
        count_received(sink, count);
    }
    let answer = BatchAnswer { results: answers };
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        )],
        answer.to_json(),
    )
        .into_response())
}

/// Finds a message by id off the async threads.
async fn lookup(
    state: &AppState,
    id: MessageId,
) -> Result<Option<schedulelog::MessageStatus>, ApiError> {
    let log = state.log.clone();
    tokio::task::spawn_blocking(move || log.lookup(id))
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::from)
}

/// Parses an id and finds its message (following retries), off the async threads: a 404 for text that
/// is not an id, for an unknown id and for one retired after its retention.
async fn find(
    state: &AppState,
    text: &str,
) -> Result<(MessageId, schedulelog::MessageStatus), ApiError> {
    let id = parse_id(text)?;
    let status = lookup(state, id).await?.ok_or_else(|| {
        ApiError::not_found("no message has this id (or it was retired after its retention)")
    })?;
    Ok((id, status))
}

/// A message's status and the history of its attempts.
#[utoipa::path(
    get,
    path = "/v1/messages/{id}",
    tag = "messages",
    params(("id" = String, Path, description = "the message's id")),
    responses(
        (status = 200, description = "the message", body = MessageStatus),
        (status = 404, description = "`not_found`: no message has this id, or it was retired \
            after its retention", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`: acknowledged moments ago, not filed yet",
            body = Problem, content_type = "application/problem+json", headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`: recent writes cannot be filed", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn status(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<MessageStatus>, ApiError> {
    state.intake.start_pruning();
    let (id, status) = find(&state, &id).await?;
    let message = &status.message;
    let mut described = Described::new(&status.state, message.attempt);
    if let (Some(reason), schedulelog::MessageState::Pending) =
        (&status.last_retry_reason, &status.state)
    {
        described.reason = Some(reason.clone());
    }
    let history = (status.history.iter())
        .map(|a| {
            let outcome = a.outcome.as_ref();
            Attempt {
                attempt: a.attempt,
                deliver_at: format_ms(a.deliver_at_ms),
                outcome: outcome.map(|o| Outcome::of(&o.kind)),
                at: outcome.map(|o| format_ms(o.at_ms)),
                reason: outcome.and_then(|o| match &o.kind {
                    OutcomeKind::Dead { reason } | OutcomeKind::Retried { reason, .. } => {
                        Some(reason.clone())
                    }
                    _ => None,
                }),
            }
        })
        .collect();
    let Described {
        status,
        attempts,
        delivered_at,
        dead_at,
        cancelled_at,
        discarded_at,
        reason,
    } = described;
    Ok(Json(MessageStatus {
        id,
        topic: message.topic.clone(),
        deliver_at: format_ms(message.deliver_at_ms),
        status,
        attempts,
        delivered_at,
        dead_at,
        cancelled_at,
        discarded_at,
        reason,
        history,
    }))
}

/// `GET /v1/messages/{id}`: a message, the time and reason of its end, and its attempts.
#[derive(Debug, Serialize, ToSchema)]
pub struct MessageStatus {
    #[serde(serialize_with = "serialize_display")]
    #[schema(value_type = String)]
    id: MessageId,
    topic: String,
    #[schema(format = DateTime)]
    deliver_at: String,
    status: MessageState,
    /// How many attempts were made: each one delivered, retried, dead or discarded (`attempt` numbers one, 0 first).
    attempts: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, nullable = false)]
    delivered_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, nullable = false)]
    dead_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, nullable = false)]
    cancelled_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, nullable = false)]
    discarded_at: Option<String>,
    /// Why it is dead or discarded, or why its last attempt is retried (for a retry, once its
    /// `retried` outcome is recorded: a moment after the new attempt, which may show first).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    reason: Option<String>,
    history: Vec<Attempt>,
}

/// A message's state.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MessageState {
    Scheduled,
    Retrying,
    Delivered,
    Dead,
    Cancelled,
    Discarded,
}

/// One attempt of a message; `outcome`, `at` and `reason` are null while it has none.
#[derive(Debug, Serialize, ToSchema)]
pub struct Attempt {
    attempt: u16,
    #[schema(format = DateTime)]
    deliver_at: String,
    #[schema(required = true)]
    outcome: Option<Outcome>,
    #[schema(format = DateTime, required = true)]
    at: Option<String>,
    #[schema(required = true)]
    reason: Option<String>,
}

/// What became of an attempt.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Delivered,
    Dead,
    Cancelled,
    Retried,
    Discarded,
}

impl Outcome {
    fn of(kind: &OutcomeKind) -> Outcome {
        match kind {
            OutcomeKind::Delivered => Outcome::Delivered,
            OutcomeKind::Dead { .. } => Outcome::Dead,
            OutcomeKind::Cancelled => Outcome::Cancelled,
            OutcomeKind::Retried { .. } => Outcome::Retried,
            OutcomeKind::Discarded => Outcome::Discarded,
        }
    }
}

/// A message's `status`, its `attempts` (made so far) and when and why it ended: the fields
/// [`MessageStatus`] and a listing's `ListedMessage` share.
pub(super) struct Described {
    pub status: MessageState,
    pub attempts: u16,
    pub delivered_at: Option<String>,
    pub dead_at: Option<String>,
    pub cancelled_at: Option<String>,
    pub discarded_at: Option<String>,
    pub reason: Option<String>,
}

impl Described {
    /// An attempt numbered `attempt` in `state`.
    pub fn new(state: &schedulelog::MessageState, attempt: u16) -> Described {
        use schedulelog::MessageState as S;
        let mut described = Described {
            status: MessageState::Scheduled,
            attempts: attempt,
            delivered_at: None,
            dead_at: None,
            cancelled_at: None,
            discarded_at: None,
            reason: None,
        };
        match state {
            S::Pending if attempt == 0 => {}
            S::Pending => described.status = MessageState::Retrying,
            S::Delivered { at_ms } => {
                described.status = MessageState::Delivered;
                described.attempts = attempt + 1;
                described.delivered_at = Some(format_ms(*at_ms));
            }
            S::Dead { at_ms, reason } => {
                described.status = MessageState::Dead;
                described.attempts = attempt + 1;
                described.dead_at = Some(format_ms(*at_ms));
                described.reason = Some(reason.clone());
            }
            S::Cancelled { at_ms } => {
                described.status = MessageState::Cancelled;
                described.cancelled_at = Some(format_ms(*at_ms));
            }
            S::Discarded { at_ms, reason } => {
                described.status = MessageState::Discarded;
                described.attempts = attempt + 1;
                described.discarded_at = Some(format_ms(*at_ms));
                described.reason = Some(reason.clone());
            }
        }
        described
    }
}

/// `deliver_at`: RFC 3339 text or unix milliseconds.
pub(super) fn deliver_at_schema() -> AnyOfBuilder {
    AnyOfBuilder::new()
        .item(rfc3339_schema())
        .item(milliseconds_schema())
        .description(Some(
            "When to deliver: an RFC 3339 time with any offset (`2026-12-01T09:30:00Z`) or unix \
             milliseconds; a time in the past is delivered at once",
        ))
        .examples([
            serde_json::json!("2026-12-01T09:30:00Z"),
            serde_json::json!(1_796_117_400_000_i64),
        ])
}

/// `delay`: `"30s"`-style text or milliseconds.
pub(super) fn delay_schema() -> AnyOfBuilder {
    AnyOfBuilder::new()
        .item(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some("^[0-9]+(ms|s|m|h|d)$")),
        )
        .item(milliseconds_schema())
        .description(Some(
            "How long from now: `1500ms`, `30s`, `30m`, `2h`, `7d`, or milliseconds",
        ))
        .examples([serde_json::json!("30s"), serde_json::json!(1500)])
}

/// Milliseconds, since the epoch or from now: a whole number, not negative.
fn milliseconds_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
        .minimum(Some(0))
}

/// An RFC 3339 time as text.
pub(super) fn rfc3339_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime)))
}

/// A message id from a path: 404 for text that is not one.
pub(super) fn parse_id(text: &str) -> Result<MessageId, ApiError> {
    text.parse()
        .map_err(|_| ApiError::not_found(format!("{text:?} is not a message id")))
}

/// Cancels a message.
///
/// `DELETE /v1/messages/{id}`: 200 `cancelled` (also for a message cancelled before), 409
/// `already_delivered` / `already_dead`, 409 `delivery_in_flight` (with `Retry-After`) while an attempt
/// is being delivered, 404 for an unknown id; 503/507 when the tombstone could not be written (nothing
/// was cancelled).
#[utoipa::path(
    delete,
    path = "/v1/messages/{id}",
    tag = "messages",
    params(("id" = String, Path, description = "the message's id")),
    responses(
        (status = 200, description = "cancelled (now or before): no attempt starts afterwards",
            body = Cancelled),
        (status = 404, description = "`not_found`", body = Problem,
            content_type = "application/problem+json"),
        (status = 409, description = "`already_delivered`, `already_dead`; `delivery_in_flight` (with \
            `Retry-After`): an attempt is being delivered, nothing was written", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
        (status = 503, description = "`overloaded`, `storage_failed`, `shutting_down`: nothing was \
            cancelled", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`: nothing was cancelled", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Cancelled>, ApiError> {
    state.intake.start_pruning();
    let id = parse_id(&id)?;
    if state.scheduler.cancel(id).await? == crate::scheduler::Cancelled::Now {
        metrics::counter!("delayd_messages_cancelled_total").increment(1);
    }
    Ok(Json(Cancelled {
        id,
        status: CancelledState::Cancelled,
    }))
}

/// `DELETE /v1/messages/{id}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Cancelled {
    #[serde(serialize_with = "serialize_display")]
    #[schema(value_type = String)]
    id: MessageId,
    #[schema(inline)]
    status: CancelledState,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CancelledState {
    Cancelled,
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedulelog::{Bucket, Location};

    fn id(seq: u64) -> MessageId {
        MessageId::new(Location {
            bucket: Bucket::from_start_minute(29_000_000),
            seq,
        })
    }

    /// A batch result for a scheduled message (not the module's `scheduled`, which takes an append).
    fn scheduled_result(
        seq: u64,
        topic: &str,
        status: Waiting,
        duplicate: bool,
    ) -> BatchResult<'_> {
        BatchResult::Scheduled(Scheduled {
            id: id(seq),
            topic,
            deliver_at: format_ms(1_796_000_000_000 + seq as i64),
            status,
            duplicate,
        })
    }

    #[test]
    fn a_batch_answer_is_written_as_serde_json_writes_it() {
        let problem = || {
            ApiError::bad_request("invalid_topic", "a \"topic\" must match [A-Za-z0-9._-]")
                .problem()
        };
        let answers = [
            BatchAnswer { results: vec![] },
            BatchAnswer {
                results: vec![BatchResult::Error { error: problem() }],
            },
            BatchAnswer {
                results: vec![
                    scheduled_result(1, "orders", Waiting::Scheduled, false),
                    scheduled_result(2, "orders", Waiting::Scheduled, false),
                    BatchResult::Error { error: problem() },
                    // An MQ target may hold what JSON escapes; the topic changes and changes back.
                    scheduled_result(3, "a \"queue\" \\ \u{1}", Waiting::Scheduled, false),
                    scheduled_result(4, "orders", Waiting::Retrying, true),
                    scheduled_result(5, "orders", Waiting::Scheduled, false),
                ],
            },
        ];
        for answer in &answers {
            assert_eq!(
                String::from_utf8(answer.to_json()).unwrap(),
                serde_json::to_string(answer).unwrap()
            );
        }
    }

    #[test]
    fn a_string_without_escapes_is_borrowed_from_the_request() {
        let plain: Text = serde_json::from_str(r#""orders""#).unwrap();
        assert!(matches!(plain.0, Cow::Borrowed("orders")));
        let escaped: Text = serde_json::from_str(r#""a\"b""#).unwrap();
        assert!(matches!(escaped.0, Cow::Owned(ref text) if text == "a\"b"));
        let request: ScheduleRequest =
            serde_json::from_str(r#"{"topic":"t","key":"k","sink":"s\u0031"}"#).unwrap();
        assert!(matches!(request.topic.0, Cow::Borrowed("t")));
        assert!(matches!(request.key, Some(Text(Cow::Borrowed("k")))));
        assert!(matches!(request.sink, Some(Text(Cow::Owned(ref sink)))  if sink == "s1"));
        assert!(serde_json::from_str::<Text>("1").is_err());
    }

    /// Each message's outcome as the per-message path gives it: the request's debug form, or the error.
    fn one_by_one(body: &str) -> Vec<Result<String, String>> {
        let batch: BatchRequest = serde_json::from_str(body).unwrap();
        batch
            .messages
            .iter()
            .map(|raw| {
                serde_json::from_str::<ScheduleRequest>(raw.get())
                    .map(|r| format!("{r:?}"))
                    .map_err(|e| e.to_string())
            })
            .collect()
    }

    fn parsed(body: &str, max: usize) -> Result<Vec<Result<String, String>>, String> {
        parse_batch(body.as_bytes(), max)
            .map(|all| {
                all.into_iter()
                    .map(|r| r.map(|r| format!("{r:?}")).map_err(|e| e.problem().detail))
                    .collect()
            })
            .map_err(|e| format!("{} {}", e.status, e.problem().code))
    }

    #[test]
    fn a_batch_is_parsed_in_one_pass_or_message_by_message_with_the_same_result() {
        let good = r#"{"messages":[
            {"topic":"a","body":"x\"y","deliver_at":1796000000000},
            {"topic":"b","body_base64":"eHk=","delay":"5s","key":"k","headers":{"h":"v"}}]}"#;
        let results = parsed(good, 10).unwrap();
        assert_eq!(
            results,
            one_by_one(good)
                .into_iter()
                .map(|r| r.map_err(|e| format!("the message is not the expected JSON: {e}")))
                .collect::<Vec<_>>()
        );
        assert!(results.iter().all(Result::is_ok));
        // That came from the one pass, which takes exactly `max` messages.
        let one_pass = |body: &str, max| {
            plain_batch(body.as_bytes(), max)
                .map(|all| all.iter().map(|r| Ok(format!("{r:?}"))).collect::<Vec<_>>())
        };
        assert_eq!(one_pass(good, 2).unwrap(), results);

        // What the one pass does not take, the per-message path answers as it always did.
        for body in [
            r#"{"messages":[],"other":1}"#,
            r#"{"messages":[],"messages":[]}"#,
            r#"{"messages":null}"#,
            r#"{"messages":[]} x"#,
            r#"{}"#,
        ] {
            assert!(one_pass(body, 10).is_err(), "{body}");
            assert_eq!(
                parsed(body, 10),
                Err("400 Bad Request invalid_json".into()),
                "{body}"
            );
        }
        for body in [r#"{"messages":[]}"#, r#"{"mess\u0061ges":[]}"#] {
            assert_eq!(one_pass(body, 10).unwrap(), []);
            assert_eq!(parsed(body, 10), Ok(vec![]));
        }

        // One message that does not parse fails alone; the others are still parsed.
        let mixed =
            r#"{"messages":[{"topic":"a","body":"x","delay":1},{"topic":"a","bogus":1},7]}"#;
        let results = parsed(mixed, 10).unwrap();
        assert!(results[0].is_ok());
        assert!(results[1]
            .as_ref()
            .unwrap_err()
            .contains("unknown field `bogus`"));
        assert!(results[2]
            .as_ref()
            .unwrap_err()
            .contains("expected struct ScheduleRequest"));

        // The one pass stops at the first message past the limit, and the batch gets its 413.
        let capped = plain_batch(good.as_bytes(), 1);
        assert!(capped
            .unwrap_err()
            .to_string()
            .contains("too many messages"));
        assert_eq!(
            parsed(good, 1),
            Err("413 Payload Too Large payload_too_large".into())
        );
        assert_eq!(
            parsed(mixed, 2),
            Err("413 Payload Too Large payload_too_large".into())
        );
        assert_eq!(
            parsed(r#"{"messages":{}}"#, 10),
            Err("400 Bad Request invalid_json".into())
        );
        assert_eq!(parsed("[]", 10), Err("400 Bad Request invalid_json".into()));
    }
}
