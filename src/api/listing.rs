//! Listing, purging and counting messages by due time (DESIGN.md §13): `GET /v1/messages`,
//! `DELETE /v1/messages` and `GET /v1/stats/timeline`.
//!
//! Each reads only the buckets in its range (schedulelog's listing.rs says how). A purge cancels what a
//! listing of the topic's pending messages finds, page by page, each cancel as durable as a `DELETE` of
//! one id; it needs a topic, so that one request cannot empty the whole node.

use super::error::{ApiError, Problem};
use super::messages::{rfc3339_schema, Described, MessageState};
use super::{page_limit, query_params, AppState, PAGE_MAX};
use crate::scheduler::{CancelError, Cancelled};
use crate::timestamp::format_ms;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::Json;
use schedulelog::{ListCursor, ListPage, ListQuery, StatusFilter};
use serde::{Deserialize, Serialize};
use utoipa::openapi::schema::{AnyOfBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::RefOr;
use utoipa::ToSchema;

/// Records a page looks at, at most (a topic filter reads each): a sparse topic gets short pages with a
/// cursor rather than one slow answer.
const SCAN_LIMIT: usize = 10_000;
/// Cancels a purge runs at once.
const PURGE_CONCURRENCY: usize = 32;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// Only this topic's messages.
    topic: Option<String>,
    /// `pending` (the default: scheduled or retrying), `scheduled`, `retrying`, `delivered`, `dead`,
    /// `cancelled`, `discarded` or `all`: the statuses a message shows, and their union `pending`.
    #[param(value_type = Option<ListedStatus>, inline)]
    status: Option<String>,
    /// Due at or after this time: unix milliseconds or RFC 3339.
    #[param(value_type = Option<TimeParam>, inline)]
    from: Option<String>,
    /// Due before this time: unix milliseconds or RFC 3339.
    #[param(value_type = Option<TimeParam>, inline)]
    to: Option<String>,
    /// Messages in a page, 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<usize>,
    /// Where the page starts: the previous page's `next_cursor`.
    #[param(pattern = "^[0-9A-Fa-f]{32}$")]
    cursor: Option<String>,
}

/// A listing's `status` values and what each lists: the parameter's documented values and the ones
/// `status_param` reads, so that the two cannot differ.
const STATUSES: [(&str, StatusFilter); 8] = [
    ("pending", StatusFilter::Pending),
    ("scheduled", StatusFilter::Scheduled),
    ("retrying", StatusFilter::Retrying),
    ("delivered", StatusFilter::Delivered),
    ("dead", StatusFilter::Dead),
    ("cancelled", StatusFilter::Cancelled),
    ("discarded", StatusFilter::Discarded),
    ("all", StatusFilter::Any),
];

/// A listing's `status` parameter: one of [`STATUSES`].
pub struct ListedStatus;

impl utoipa::PartialSchema for ListedStatus {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(
                "A listing's `status`: `pending` is scheduled or retrying.",
            ))
            .enum_values(Some(STATUSES.map(|(name, _)| name)))
            .into()
    }
}

impl ToSchema for ListedStatus {}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RangeParams {
    topic: Option<String>,
    from: Option<String>,
    to: Option<String>,
}

/// `from` and `to` query parameters: messages due in `[from, to)`.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[expect(
    dead_code,
    reason = "described, never read: the handlers read `RangeParams`"
)]
pub struct DueRange {
    /// Due at or after this time: unix milliseconds or RFC 3339.
    #[param(value_type = Option<TimeParam>, inline)]
    from: Option<String>,
    /// Due before this time: unix milliseconds or RFC 3339.
    #[param(value_type = Option<TimeParam>, inline)]
    to: Option<String>,
}

/// A `from` / `to` query parameter: unix milliseconds or an RFC 3339 time.
pub struct TimeParam;

impl utoipa::PartialSchema for TimeParam {
    fn schema() -> RefOr<Schema> {
        AnyOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some("^[0-9]+$")),
            )
            .item(rfc3339_schema())
            .examples([
                serde_json::json!("1796117400000"),
                serde_json::json!("2026-12-01T09:30:00Z"),
            ])
            .into()
    }
}

impl ToSchema for TimeParam {}

/// A `from` / `to` parameter: unix milliseconds or an RFC 3339 time; `default` when absent.
fn time_param(name: &str, value: Option<&str>, default: i64) -> Result<i64, ApiError> {
    let Some(text) = value else {
        return Ok(default);
    };
    crate::intake::deliver_at_from_text(text).map_err(|_| {
        ApiError::bad_request(
            "invalid_query",
            format!("{name} {text:?} is neither unix milliseconds nor an RFC 3339 time"),
        )
    })
}

/// The `status` parameter (default `pending`).
fn status_param(value: Option<&str>) -> Result<StatusFilter, ApiError> {
    let wanted = value.unwrap_or("pending");
    let found = STATUSES.iter().find(|(name, _)| *name == wanted);
    found.map(|&(_, filter)| filter).ok_or_else(|| {
        ApiError::bad_request(
            "invalid_query",
            format!(
                "status {wanted:?} is not one of pending (scheduled or retrying), {}",
                STATUSES[1..]
                    .iter()
                    .map(|(name, _)| *name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    })
}

/// Runs a listing off the async threads.
async fn list_page(state: &AppState, query: ListQuery) -> Result<ListPage, ApiError> {
    let log = state.log.clone();
    tokio::task::spawn_blocking(move || log.list(&query))
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::from)
}

/// Lists messages by due time, status and topic.
///
/// `GET /v1/messages?topic=&status=&from=&to=&limit=&cursor=`: messages due in `[from, to)`, oldest due
/// first, `limit` (default 100, at most 1000) at a time; `next_cursor` is where the next page starts
/// (`null`: no more). A page may hold fewer than `limit` and still have a next one.
#[utoipa::path(
    get,
    path = "/v1/messages",
    tag = "listing",
    params(ListParams),
    responses(
        (status = 200, description = "a page of messages, oldest due first",
            body = MessagePage),
        (status = 400, description = "`invalid_query`, `invalid_cursor`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`: recent writes are not filed yet", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`: recent writes cannot be filed", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn list(
    State(state): State<AppState>,
    params: Result<Query<ListParams>, QueryRejection>,
) -> Result<Json<MessagePage>, ApiError> {
    let params = query_params(params)?;
    let limit = page_limit(params.limit)?;
    let after = match params.cursor.as_deref() {
        Some(text) => Some(
            text.parse::<ListCursor>()
                .map_err(|e| ApiError::bad_request("invalid_cursor", e.to_string()))?,
        ),
        None => None,
    };
    let query = ListQuery {
        from_ms: time_param("from", params.from.as_deref(), i64::MIN)?,
        to_ms: time_param("to", params.to.as_deref(), i64::MAX)?,
        status: status_param(params.status.as_deref())?,
        topic: params.topic,
        limit,
        scan_limit: SCAN_LIMIT,
        after,
    };
    let page = list_page(&state, query).await?;
    let messages = (page.messages.into_iter())
        .map(|listed| {
            let m = listed.message;
            let Described {
                status,
                attempts,
                delivered_at,
                dead_at,
                cancelled_at,
                discarded_at,
                reason,
            } = Described::new(&listed.state, m.attempt);
            ListedMessage {
                id: m.id.to_string(),
                topic: m.topic,
                key: m.key,
                sink: m.sink,
                deliver_at: format_ms(m.deliver_at_ms),
                status,
                attempts,
                delivered_at,
                dead_at,
                cancelled_at,
                discarded_at,
                reason,
            }
        })
        .collect();
    Ok(Json(MessagePage {
        messages,
        next_cursor: page.next.map(|c| c.to_string()),
    }))
}

/// `GET /v1/messages`: a page; `next_cursor` is null after the last.
#[derive(Serialize, ToSchema)]
pub struct MessagePage {
    messages: Vec<ListedMessage>,
    #[schema(required = true)]
    next_cursor: Option<String>,
}

/// A message in a listing.
#[derive(Serialize, ToSchema)]
pub struct ListedMessage {
    id: String,
    topic: String,
    /// Absent without a key, as in a pull.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    key: Option<String>,
    sink: String,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    reason: Option<String>,
}

/// Cancels a topic's pending messages due in a range.
///
/// `DELETE /v1/messages?topic=&from=&to=`: cancels every pending message of the topic due in
/// `[from, to)`, each durably, and answers how many (`cancelled`), and how many were being delivered
/// right then and were left alone (`in_flight`). 400 `topic_required` without a topic.
#[utoipa::path(
    delete,
    path = "/v1/messages",
    tag = "listing",
    params(
        ("topic" = String, Query, description = "the topic whose pending messages are cancelled",
            min_length = 1),
        DueRange,
    ),
    responses(
        (status = 200, description = "how many were cancelled, each durably",
            body = Purged),
        (status = 400, description = "`topic_required`, `invalid_query`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`, `storage_failed`, `shutting_down`: the \
            detail says how many were cancelled before", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`: the detail says how many were cancelled before",
            body = Problem, content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn purge(
    State(state): State<AppState>,
    params: Result<Query<RangeParams>, QueryRejection>,
) -> Result<Json<Purged>, ApiError> {
    let params = query_params(params)?;
    let Some(topic) = params.topic.filter(|t| !t.is_empty()) else {
        return Err(ApiError::bad_request(
            "topic_required",
            "a purge needs a topic (DELETE /v1/messages?topic=...&from=...&to=...)",
        ));
    };
    let mut query = ListQuery {
        from_ms: time_param("from", params.from.as_deref(), i64::MIN)?,
        to_ms: time_param("to", params.to.as_deref(), i64::MAX)?,
        status: StatusFilter::Pending,
        topic: Some(topic),
        limit: PAGE_MAX,
        scan_limit: 10 * SCAN_LIMIT,
        after: None,
    };
    let (mut cancelled, mut in_flight) = (0u64, 0u64);
    loop {
        let page = list_page(&state, query.clone()).await?;
        let mut running = tokio::task::JoinSet::new();
        let mut failure = None;
        let before = cancelled;
        for listed in page.messages {
            if running.len() >= PURGE_CONCURRENCY {
                tally(
                    running.join_next().await,
                    &mut cancelled,
                    &mut in_flight,
                    &mut failure,
                );
            }
            let scheduler = state.scheduler.clone();
            running.spawn(async move { scheduler.cancel(listed.message.id).await });
        }
        while let Some(done) = running.join_next().await {
            tally(Some(done), &mut cancelled, &mut in_flight, &mut failure);
        }
        metrics::counter!("delayd_messages_cancelled_total").increment(cancelled - before);
        if let Some(mut error) = failure {
            error.detail = format!(
                "{} ({cancelled} messages were cancelled before this)",
                error.detail
            );
            return Err(error);
        }
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    Ok(Json(Purged {
        cancelled,
        in_flight,
    }))
}

/// `DELETE /v1/messages`: how many were cancelled, and how many were being delivered and left alone.
#[derive(Serialize, ToSchema)]
pub struct Purged {
    cancelled: u64,
    in_flight: u64,
}

/// Counts one cancel of a purge; the first failure that is not the message's own state is kept.
fn tally(
    done: Option<Result<Result<Cancelled, CancelError>, tokio::task::JoinError>>,
    cancelled: &mut u64,
    in_flight: &mut u64,
    failure: &mut Option<ApiError>,
) {
    match done {
        None => {}
        Some(Ok(Ok(Cancelled::Now))) => *cancelled += 1,
        // Finished meanwhile, or cancelled by someone else: nothing left to purge.
        Some(Ok(Ok(Cancelled::Already)))
        | Some(Ok(Err(
            CancelError::AlreadyDelivered | CancelError::AlreadyDead | CancelError::NotFound,
        ))) => {}
        Some(Ok(Err(CancelError::InFlight))) => *in_flight += 1,
        Some(Ok(Err(error))) => {
            failure.get_or_insert(ApiError::from(error));
        }
        Some(Err(error)) => {
            failure.get_or_insert(ApiError::internal(error));
        }
    }
}

/// Counts pending messages per bucket of due time.
///
/// `GET /v1/stats/timeline?from=&to=`: every bucket with messages due in `[from, to)`, with how many it
/// holds and how many are pending (from the indexes and dispatch logs; no record is read).
#[utoipa::path(
    get,
    path = "/v1/stats/timeline",
    tag = "listing",
    params(DueRange),
    responses(
        (status = 200, description = "pending messages per bucket", body = Timeline),
        (status = 400, description = "`invalid_query`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`: recent writes are not filed yet", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`: recent writes cannot be filed", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn timeline(
    State(state): State<AppState>,
    params: Result<Query<RangeParams>, QueryRejection>,
) -> Result<Json<Timeline>, ApiError> {
    let params = query_params(params)?;
    if params.topic.is_some() {
        return Err(ApiError::bad_request(
            "invalid_query",
            "the timeline counts every topic; it takes from and to",
        ));
    }
    let from = time_param("from", params.from.as_deref(), i64::MIN)?;
    let to = time_param("to", params.to.as_deref(), i64::MAX)?;
    let log = state.log.clone();
    let counts = tokio::task::spawn_blocking(move || log.timeline(from, to))
        .await
        .map_err(ApiError::internal)??;
    let buckets = counts
        .iter()
        .map(|c| Bucket {
            start: format_ms(c.bucket.start_ms()),
            start_ms: c.bucket.start_ms(),
            total: c.total,
            pending: c.pending,
        })
        .collect();
    Ok(Json(Timeline {
        segment_minutes: state.log.segment_minutes().get(),
        buckets,
    }))
}

/// `GET /v1/stats/timeline`.
#[derive(Serialize, ToSchema)]
pub struct Timeline {
    /// The buckets' width.
    segment_minutes: u16,
    buckets: Vec<Bucket>,
}

/// One bucket of the timeline.
#[derive(Serialize, ToSchema)]
pub struct Bucket {
    #[schema(format = DateTime)]
    start: String,
    start_ms: i64,
    /// Messages filed in it.
    total: u64,
    /// Of those, the ones not finished.
    pending: u64,
}
