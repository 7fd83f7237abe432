//! The OpenAPI 3.1 document served at `GET /openapi.json` (DESIGN.md §13), generated from the code: each
//! operation from the `#[utoipa::path]` annotation on its handler, the request and answer schemas
//! derived on the handlers' own types where they have them, and here, as schema-only types, for the
//! answers the handlers build with `json!`. A modifier adds what the router's layers add to every route:
//! the bearer token and its 401 on `/v1`, the connection cap's 503 and the 500 of an internal failure.
//!
//! Schemathesis checks the document against the live server (`tests/schemathesis.sh`, run by
//! `.ci/run`): every answer must match what is documented here.

use super::error::Problem;
use super::messages::{BatchAnswer, BatchRequest, RequeueRequest, ScheduleRequest, Scheduled};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::sync::LazyLock;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::schema::{
    AnyOfBuilder, KnownFormat, ObjectBuilder, Schema, SchemaFormat, Type,
};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi, ToSchema};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "delayd",
        version = env!("CARGO_PKG_VERSION"),
        description = "A durable, millisecond-precise delay / scheduled-message service. Every error \
            is `application/problem+json` with a stable `code`."
    ),
    paths(
        super::messages::schedule,
        super::messages::schedule_batch,
        super::listing::list,
        super::listing::purge,
        super::messages::status,
        super::messages::cancel,
        super::messages::requeue,
        super::messages::discard,
        super::listing::timeline,
        super::consume::topics,
        super::consume::topic,
        super::consume::pull,
        super::consume::commit_offset,
        super::consume::group_offsets,
        super::sources,
        super::sinks,
        super::healthz,
        super::ready,
        super::metrics,
        super::console,
        document,
    ),
    components(schemas(
        Problem,
        ScheduleRequest,
        BatchRequest,
        RequeueRequest,
        Scheduled,
        BatchAnswer
    )),
    modifiers(&RouterLayers),
    tags(
        (name = "messages", description = "Scheduling, status and cancellation"),
        (name = "listing", description = "Messages by due time, status and topic"),
        (name = "dead letters", description = "Requeue or discard dead messages"),
        (name = "broker", description = "The built-in broker: topics, pulls, consumer group offsets"),
        (name = "connections", description = "The MQ sources and the sinks"),
        (name = "operations", description = "Probes, metrics, the console and this document"),
    )
)]
struct ApiDoc;

/// Built once, on the first request: the document does not change while the process runs.
static DOCUMENT: LazyLock<String> = LazyLock::new(|| {
    ApiDoc::openapi()
        .to_json()
        .expect("the OpenAPI document serializes")
});

/// `GET /openapi.json`: this document.
///
/// Served without a token: it tells nothing a client of the API may not know.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "the OpenAPI 3.1 document", body = serde_json::Value))
)]
pub async fn document() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
        .into_response()
}

/// The name of the security scheme every `/v1` operation requires.
const BEARER: &str = "bearerAuth";

/// What the router's layers do to every route, so that each handler's annotation need not repeat it:
/// `/v1` takes the bearer token (`authenticate`), past the connection cap the edge answers 503 (except
/// the probes and metrics, which it always answers), and an internal failure is a 500 anywhere.
struct RouterLayers;

impl Modify for RouterLayers {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme(
                BEARER,
                SecurityScheme::Http(
                    HttpBuilder::new()
                        .scheme(HttpAuthScheme::Bearer)
                        .description(Some(
                            "One of `auth.tokens`; without tokens configured, `/v1` is open",
                        ))
                        .build(),
                ),
            );
        for (path, item) in &mut openapi.paths.paths {
            let v1 = path.starts_with("/v1/");
            let probe = matches!(path.as_str(), "/healthz" | "/readyz" | "/metrics");
            for operation in operations(item) {
                let responses = &mut operation.responses.responses;
                if v1 {
                    operation.security =
                        Some(vec![SecurityRequirement::new(BEARER, Vec::<String>::new())]);
                    responses.insert(
                        "401".to_string(),
                        problem(
                            "`unauthorized`: `auth.tokens` is set and the bearer token is missing or \
                             wrong",
                        ),
                    );
                    responses
                        .entry("500".to_string())
                        .or_insert_with(|| problem("`internal`: the server log has details"));
                }
                if !probe {
                    responses.entry("503".to_string()).or_insert_with(|| {
                        problem("`overloaded`: past the connection cap; nothing was done")
                    });
                }
            }
        }
    }
}

/// Every operation of a path.
fn operations(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.patch,
        &mut item.head,
        &mut item.options,
        &mut item.trace,
    ]
    .into_iter()
    .filter_map(Option::as_mut)
}

/// A response whose body is a problem.
fn problem(description: &str) -> RefOr<utoipa::openapi::Response> {
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/problem+json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name(Problem::name())))
                .build(),
        )
        .into()
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

/// An RFC 3339 time as text.
fn rfc3339() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime)))
}

/// `deliver_at`: RFC 3339 text or unix milliseconds.
pub(super) fn deliver_at_schema() -> AnyOfBuilder {
    AnyOfBuilder::new()
        .item(rfc3339())
        .item(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
                .minimum(Some(0)),
        )
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
        .item(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
                .minimum(Some(0)),
        )
        .description(Some(
            "How long from now: `1500ms`, `30s`, `30m`, `2h`, `7d`, or milliseconds",
        ))
        .examples([serde_json::json!("30s"), serde_json::json!(1500)])
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
            .item(rfc3339())
            .examples([
                serde_json::json!("1796117400000"),
                serde_json::json!("2026-12-01T09:30:00Z"),
            ])
            .into()
    }
}

impl ToSchema for TimeParam {}

// Schema only: the answers below are built with `json!` in the handlers, and these types describe
// them (schemathesis checks that they agree). They are never constructed.
#[expect(dead_code, reason = "schema-only types: never built, only described")]
mod answers {
    use super::ToSchema;
    use std::collections::BTreeMap;

    /// A message's state.
    #[derive(ToSchema)]
    #[schema(rename_all = "snake_case")]
    pub enum MessageState {
        Scheduled,
        Retrying,
        Delivered,
        Dead,
        Cancelled,
        Discarded,
    }

    /// `GET /v1/messages/{id}`: a message, the time and reason of its end, and its attempts.
    #[derive(ToSchema)]
    pub struct MessageStatus {
        id: String,
        topic: String,
        #[schema(format = DateTime)]
        deliver_at: String,
        status: MessageState,
        /// Attempts started so far.
        attempts: u16,
        #[schema(format = DateTime, nullable = false)]
        delivered_at: Option<String>,
        #[schema(format = DateTime, nullable = false)]
        dead_at: Option<String>,
        #[schema(format = DateTime, nullable = false)]
        cancelled_at: Option<String>,
        #[schema(format = DateTime, nullable = false)]
        discarded_at: Option<String>,
        /// Why it is dead or discarded, or why its last attempt is retried (for a retry, once its
        /// `retried` outcome is recorded: a moment after the new attempt, which may show first).
        #[schema(nullable = false)]
        reason: Option<String>,
        history: Vec<Attempt>,
    }

    /// What became of an attempt.
    #[derive(ToSchema)]
    #[schema(rename_all = "snake_case")]
    pub enum Outcome {
        Delivered,
        Dead,
        Cancelled,
        Retried,
        Discarded,
    }

    /// One attempt of a message; `outcome`, `at` and `reason` are null while it has none.
    #[derive(ToSchema)]
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

    /// A listing's `status`: `pending` is scheduled or retrying.
    #[derive(ToSchema)]
    #[schema(rename_all = "snake_case")]
    pub enum ListedStatus {
        Pending,
        Delivered,
        Dead,
        Cancelled,
        Discarded,
        All,
    }

    /// A message in a listing.
    #[derive(ToSchema)]
    pub struct ListedMessage {
        id: String,
        topic: String,
        #[schema(required = true)]
        key: Option<String>,
        sink: String,
        #[schema(format = DateTime)]
        deliver_at: String,
        status: MessageState,
        attempts: u16,
        #[schema(format = DateTime, nullable = false)]
        delivered_at: Option<String>,
        #[schema(format = DateTime, nullable = false)]
        dead_at: Option<String>,
        #[schema(format = DateTime, nullable = false)]
        cancelled_at: Option<String>,
        #[schema(format = DateTime, nullable = false)]
        discarded_at: Option<String>,
        #[schema(nullable = false)]
        reason: Option<String>,
    }

    /// `GET /v1/messages`: a page; `next_cursor` is null after the last.
    #[derive(ToSchema)]
    pub struct MessagePage {
        messages: Vec<ListedMessage>,
        #[schema(required = true)]
        next_cursor: Option<String>,
    }

    /// `DELETE /v1/messages`: how many were cancelled, and how many were being delivered and left alone.
    #[derive(ToSchema)]
    pub struct Purged {
        cancelled: u64,
        in_flight: u64,
    }

    /// One bucket of the timeline.
    #[derive(ToSchema)]
    pub struct Bucket {
        #[schema(format = DateTime)]
        start: String,
        start_ms: i64,
        /// Messages filed in it.
        total: u64,
        /// Of those, the ones not finished.
        pending: u64,
    }

    /// `GET /v1/stats/timeline`.
    #[derive(ToSchema)]
    pub struct Timeline {
        /// The buckets' width.
        segment_minutes: u32,
        buckets: Vec<Bucket>,
    }

    #[derive(ToSchema)]
    #[schema(rename_all = "snake_case")]
    pub enum RequeuedState {
        Retrying,
    }

    /// `POST /v1/messages/{id}/requeue`: the new attempt.
    #[derive(ToSchema)]
    pub struct Requeued {
        id: String,
        #[schema(inline)]
        status: RequeuedState,
        #[schema(format = DateTime)]
        deliver_at: String,
        attempts: u16,
    }

    #[derive(ToSchema)]
    #[schema(rename_all = "snake_case")]
    pub enum DiscardedState {
        Discarded,
    }

    /// `POST /v1/messages/{id}/discard`.
    #[derive(ToSchema)]
    pub struct Discarded {
        id: String,
        #[schema(inline)]
        status: DiscardedState,
    }

    #[derive(ToSchema)]
    #[schema(rename_all = "snake_case")]
    pub enum CancelledState {
        Cancelled,
    }

    /// `DELETE /v1/messages/{id}`.
    #[derive(ToSchema)]
    pub struct Cancelled {
        id: String,
        #[schema(inline)]
        status: CancelledState,
    }

    /// An MQ source and its connection.
    #[derive(ToSchema)]
    pub struct SourceState {
        name: String,
        kind: String,
        /// The sink its messages go to when a request names none.
        #[schema(required = true)]
        sink: Option<String>,
        connected: bool,
        /// Requests handled since the start, by outcome.
        requests: BTreeMap<String, u64>,
        #[schema(nullable = false)]
        last_error: Option<String>,
        #[schema(format = DateTime, nullable = false)]
        last_error_at: Option<String>,
    }

    /// `GET /v1/sources`.
    #[derive(ToSchema)]
    pub struct Sources {
        sources: Vec<SourceState>,
    }

    /// A sink; an MQ sink also shows its connection and how many deliveries waited for it.
    #[derive(ToSchema)]
    pub struct SinkState {
        name: String,
        kind: String,
        #[schema(nullable = false)]
        connected: Option<bool>,
        /// Deliveries put off since the start because the MQ could not be reached (no attempt used).
        #[schema(nullable = false)]
        postponed: Option<u64>,
        #[schema(nullable = false)]
        last_error: Option<String>,
        #[schema(format = DateTime, nullable = false)]
        last_error_at: Option<String>,
    }

    /// `GET /v1/sinks`.
    #[derive(ToSchema)]
    pub struct Sinks {
        sinks: Vec<SinkState>,
    }

    #[derive(ToSchema)]
    #[schema(rename_all = "snake_case")]
    pub enum ReadyState {
        Ready,
    }

    /// `GET /readyz`: `disk_full` says why new messages are refused, while they are.
    #[derive(ToSchema)]
    pub struct Ready {
        #[schema(inline)]
        status: ReadyState,
        #[schema(nullable = false)]
        disk_full: Option<String>,
    }
}

pub use answers::*;
