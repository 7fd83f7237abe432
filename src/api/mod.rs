//! The HTTP API v1 (DESIGN.md §6): routes, shared state, request checks, authentication and the
//! per-request metric. Handlers live in `messages` (schedule, status, cancel, requeue, discard),
//! `listing` (listing, purge, timeline) and `consume` (the built-in broker's topics, pulls and group
//! offsets); `openapi` describes them all at `GET /openapi.json`. On a cluster follower, `forward`
//! carries requests to the leader.

mod consume;
mod dead_letters;
pub mod error;
pub mod forward;
mod listing;
pub mod member;
mod messages;
mod openapi;
mod schedules;

use crate::broker::Broker;
use crate::config::Config;
use crate::connection::ConnectionSnapshot;
use crate::scheduler::Scheduler;
use crate::timestamp::format_ms;
use axum::body::Bytes;
use axum::extract::{FromRequest, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use error::{ApiError, Problem};
use metrics_exporter_prometheus::PrometheusHandle;
use schedulelog::{Clock, ScheduleLog};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use utoipa::ToSchema;

/// What every handler gets: one `Arc`, so that a request clones one pointer, not each service's.
pub type AppState = Arc<Services>;

/// The services behind the API.
#[derive(Debug)]
pub struct Services {
    pub log: Arc<ScheduleLog>,
    pub scheduler: Arc<Scheduler>,
    pub broker: Arc<Broker>,
    /// Whether new messages are refused for want of disk space.
    pub disk: Arc<crate::disk::DiskWatch>,
    pub config: Arc<Config>,
    pub clock: Arc<dyn Clock>,
    pub metrics: PrometheusHandle,
    /// New messages' way in, shared with the MQ sources.
    pub intake: Arc<crate::intake::Intake>,
    /// Recurring schedules (schedule/).
    pub schedules: Arc<crate::schedule::Schedules>,
    /// The MQ sources' connections.
    pub sources: Vec<crate::connection::ConnectionState>,
    /// The MQ sinks' connections.
    pub sink_connections: Vec<crate::connection::ConnectionState>,
}

pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route(
            "/v1/messages",
            post(messages::schedule)
                .get(listing::list)
                .delete(listing::purge),
        )
        .route("/v1/messages/batch", post(messages::schedule_batch))
        .route(
            "/v1/messages/{id}",
            get(messages::status).delete(messages::cancel),
        )
        .route("/v1/messages/{id}/requeue", post(dead_letters::requeue))
        .route("/v1/messages/{id}/discard", post(dead_letters::discard))
        .route("/v1/stats/timeline", get(listing::timeline))
        .route("/v1/topics", get(consume::topics))
        .route("/v1/topics/{topic}", get(consume::topic))
        .route(
            "/v1/topics/{topic}/queues/{queue}/messages",
            get(consume::pull),
        )
        .route(
            "/v1/groups/{group}/offsets/{topic}/{queue}",
            put(consume::commit_offset),
        )
        .route(
            "/v1/groups/{group}/offsets/{topic}",
            get(consume::group_offsets),
        )
        .route("/v1/schedules", get(schedules::list))
        .route(
            "/v1/schedules/{id}",
            get(schedules::get)
                .put(schedules::put)
                .delete(schedules::delete),
        )
        .route("/v1/schedules/{id}/pause", post(schedules::pause))
        .route("/v1/schedules/{id}/resume", post(schedules::resume))
        .route("/v1/sources", get(sources))
        .route("/v1/sinks", get(sinks))
        // A cluster member answers it itself (member.rs); a single node is none.
        .route("/v1/cluster", get(alone))
        .route("/v1/cluster/members", post(alone))
        .route("/v1/cluster/members/{id}", delete(alone))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .merge(v1)
        .route("/ui", get(console))
        .route("/openapi.json", get(openapi::document))
        .route("/healthz", get(healthz))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this route does not take that method",
            )
        })
        .layer(middleware::from_fn(count_requests))
        .layer(axum::extract::DefaultBodyLimit::max(
            state.config.limits.max_request_bytes,
        ))
        .with_state(state)
}

/// `GET /v1/sources`: each MQ source, its kind and its connection.
#[utoipa::path(
    get,
    path = "/v1/sources",
    tag = "connections",
    responses((status = 200, description = "every MQ source", body = Sources))
)]
async fn sources(State(state): State<AppState>) -> Result<Json<Sources>, ApiError> {
    let sources = (state.config.sources.iter().zip(&state.sources))
        .map(|((_, config), connection)| {
            let mut source = SourceState::from(connection.snapshot());
            source.sink.clone_from(&config.shared.sink);
            source
        })
        .collect();
    Ok(Json(Sources { sources }))
}

/// `GET /v1/sources`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Sources {
    sources: Vec<SourceState>,
}

/// An MQ source and its connection.
#[derive(Debug, Serialize, ToSchema)]
pub struct SourceState {
    name: String,
    kind: String,
    /// The sink its messages go to when a request names none.
    #[schema(required = true)]
    sink: Option<String>,
    connected: bool,
    /// Requests handled since the start, by outcome.
    requests: BTreeMap<String, u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    last_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, nullable = false)]
    last_error_at: Option<String>,
}

/// The cluster's routes on a single node, which is no cluster's member.
async fn alone() -> ApiError {
    ApiError::not_found("this node runs alone (no [cluster] section): it is no cluster's member")
}

/// `GET /v1/sinks`: each sink, its kind, and for an MQ sink its connection.
#[utoipa::path(
    get,
    path = "/v1/sinks",
    tag = "connections",
    responses((status = 200, description = "every sink", body = Sinks))
)]
async fn sinks(State(state): State<AppState>) -> Result<Json<Sinks>, ApiError> {
    let connections: Vec<SinkState> = (state.sink_connections.iter())
        .map(|connection| SinkState::from(connection.snapshot()))
        .collect();
    let sinks = (state.config.sinks.iter())
        .map(|(name, config)| {
            connections
                .iter()
                .find(|l| l.name == *name)
                .cloned()
                .unwrap_or_else(|| SinkState {
                    name: name.clone(),
                    kind: config.kind.name().to_string(),
                    connected: None,
                    postponed: None,
                    last_error: None,
                    last_error_at: None,
                })
        })
        .collect();
    Ok(Json(Sinks { sinks }))
}

/// `GET /v1/sinks`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Sinks {
    sinks: Vec<SinkState>,
}

/// A sink; an MQ sink also shows its connection and how many deliveries waited for it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SinkState {
    name: String,
    kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    connected: Option<bool>,
    /// Deliveries put off since the start because the MQ could not be reached (no attempt used).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    postponed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    last_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime, nullable = false)]
    last_error_at: Option<String>,
}

impl From<ConnectionSnapshot> for SourceState {
    /// Without its sink, which the config gives.
    fn from(connection: ConnectionSnapshot) -> SourceState {
        let (last_error_at, last_error) = last_error(connection.last_error);
        SourceState {
            name: connection.name,
            kind: connection.kind,
            sink: None,
            connected: connection.connected,
            requests: (connection.handled.into_iter())
                .map(|(outcome, count)| (outcome.to_string(), count))
                .collect(),
            last_error,
            last_error_at,
        }
    }
}

impl From<ConnectionSnapshot> for SinkState {
    fn from(connection: ConnectionSnapshot) -> SinkState {
        let (last_error_at, last_error) = last_error(connection.last_error);
        SinkState {
            name: connection.name,
            kind: connection.kind,
            connected: Some(connection.connected),
            postponed: Some(connection.postponed),
            last_error,
            last_error_at,
        }
    }
}

/// A connection's last error and its time, as the answers show them.
fn last_error(last: Option<(i64, String)>) -> (Option<String>, Option<String>) {
    match last {
        Some((at_ms, error)) => (Some(format_ms(at_ms)), Some(error)),
        None => (None, None),
    }
}

/// `GET /ui`: the console.
///
/// One page built into the binary. It is served without a token; the page asks for one when the API
/// answers 401. Its policy lets it load nothing from elsewhere.
#[utoipa::path(
    get,
    path = "/ui",
    tag = "operations",
    responses((status = 200, description = "the console page", body = String, content_type = "text/html"))
)]
async fn console() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src data:; form-action 'none'; frame-ancestors 'none'",
            ),
        ],
        include_str!("../ui/console.html"),
    )
        .into_response()
}

/// Why the node refuses writes until a restart (a poisoned log, or a failed broker store), if it does.
/// The broker's stores are asked on the blocking pool: their locks are held through commit-log syncs,
/// which a runtime worker must not wait for.
async fn storage_failure(log: &ScheduleLog, broker: &Arc<Broker>) -> Option<String> {
    if let Some(cause) = log.poisoned() {
        return Some(cause);
    }
    let broker = broker.clone();
    match tokio::task::spawn_blocking(move || broker.failed()).await {
        Ok(failed) => failed,
        Err(e) if e.is_cancelled() => None, // the runtime is shutting down
        Err(e) => Some(format!("asking the broker whether it failed: {e}")),
    }
}

/// `GET /healthz`: 200 while the process runs.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "the process runs", body = String, content_type = "text/plain"))
)]
async fn healthz() -> &'static str {
    "ok\n"
}

/// `GET /readyz`: whether the node is ready.
///
/// 200 once recovery is done (the router is served only then), as `{"status": "ready"}`; while the disk
/// is short of space (new messages refused, or a writer held up) it stays 200, for the node still
/// delivers, cancels and serves pulls (and a sidecar's failing readiness would take its whole pod out of
/// service), and says why in `"disk_full"`. 503 `storage_failed` while the log or a broker store refuses
/// writes until a restart.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "ready: recovery is done", body = Ready),
        (status = 503, description = "`storage_failed`: no writes until a restart", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
async fn ready(State(state): State<AppState>) -> Response {
    if let Some(cause) = storage_failure(&state.log, &state.broker).await {
        let mut error = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "storage_failed", cause);
        error.retry_after_secs = Some(60);
        return error.into_response();
    }
    Json(Ready {
        status: ReadyState::Ready,
        disk_full: state.disk.full(),
    })
    .into_response()
}

/// `GET /readyz`: `disk_full` says why new messages are refused, while they are.
#[derive(Debug, Serialize, ToSchema)]
pub struct Ready {
    #[schema(inline)]
    status: ReadyState,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    disk_full: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReadyState {
    Ready,
}

/// `GET /metrics`: the Prometheus text format.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((status = 200, description = "every metric", body = String, content_type = "text/plain"))
)]
async fn metrics(State(state): State<AppState>) -> Response {
    render_metrics(&state.log, &state.broker, &state.metrics).await
}

/// The Prometheus text of every metric.
async fn render_metrics(
    log: &ScheduleLog,
    broker: &Arc<Broker>,
    handle: &PrometheusHandle,
) -> Response {
    // Read at each scrape: 1 exactly when /readyz answers `storage_failed`.
    let failed = storage_failure(log, broker).await.is_some();
    metrics::gauge!("delayd_storage_failed").set(if failed { 1.0 } else { 0.0 });
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response()
}

/// `delayd_http_requests_total{route, status}`: the route pattern, never the path (ids are unbounded).
async fn count_requests(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let started = Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("delayd_http_requests_total", "route" => route.clone(), "status" => status)
        .increment(1);
    metrics::histogram!("delayd_http_request_seconds", "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// Bearer-token check for `/v1/*` when `auth.tokens` is set.
async fn authenticate(State(state): State<AppState>, request: Request, next: Next) -> Response {
    match check_token(&state.config.auth.tokens, &request) {
        Ok(()) => next.run(request).await,
        Err(refused) => refused.into_response(),
    }
}

/// Whether `request` carries one of `tokens` as its bearer token (any request does when there are
/// none: authentication is off).
fn check_token(tokens: &[String], request: &Request) -> Result<(), ApiError> {
    if tokens.is_empty() {
        return Ok(());
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    match given {
        Some(given)
            if tokens
                .iter()
                .any(|t| constant_time_eq(t.as_bytes(), given.as_bytes())) =>
        {
            Ok(())
        }
        Some(_) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the bearer token is not valid",
        )),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send Authorization: Bearer <token>",
        )),
    }
}

/// The token of an `Authorization: Bearer <token>` value. The scheme is matched without regard to case
/// (RFC 9110 §11.1: `bearer` and `BEARER` are `Bearer`), and any run of spaces may follow it.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
}

/// Compares without an early exit, so the time taken does not tell how much of a token matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

/// Query parameters, or 400 `invalid_query` with serde's explanation (an unknown or malformed one).
/// Taken as a `Result` by handlers, so that they check their path first.
pub fn query_params<T>(
    query: Result<axum::extract::Query<T>, axum::extract::rejection::QueryRejection>,
) -> Result<T, ApiError> {
    query
        .map(|axum::extract::Query(q)| q)
        .map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))
}

/// Items a listing page holds by default, and at most.
pub const PAGE_DEFAULT: usize = 100;
pub const PAGE_MAX: usize = 1000;

/// A listing's `limit` parameter: [`PAGE_DEFAULT`] when absent, 400 `invalid_query` outside 1 to
/// [`PAGE_MAX`].
pub fn page_limit(limit: Option<usize>) -> Result<usize, ApiError> {
    let limit = limit.unwrap_or(PAGE_DEFAULT);
    match (1..=PAGE_MAX).contains(&limit) {
        true => Ok(limit),
        false => Err(ApiError::bad_request(
            "invalid_query",
            format!("limit must be between 1 and {PAGE_MAX}"),
        )),
    }
}

/// A JSON request body whose failures are problem+json: 413 over the size limit, 400 `invalid_json`
/// with serde's explanation for malformed JSON or wrong types.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let RawBody(bytes) = RawBody::from_request(request, state).await?;
        parse_json(&bytes).map(JsonBody)
    }
}

/// A request body as bytes, for handlers that parse it in place with [`parse_json`] (borrowing from
/// it); 413 over the size limit as with [`JsonBody`], 408 `request_timeout` when it did not arrive within
/// `limits.body_timeout` (the edge fails the body then).
#[derive(Debug)]
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        Bytes::from_request(request, state)
            .await
            .map(RawBody)
            .map_err(|rejection| {
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    body_too_large()
                } else if timed_out(&rejection) {
                    body_timed_out()
                } else {
                    ApiError::bad_request("invalid_body", rejection.body_text())
                }
            })
    }
}

/// 413 for a request body over `limits.max_request_bytes`.
fn body_too_large() -> ApiError {
    ApiError::too_large("the request body is larger than limits.max_request_bytes")
}

/// 408 for a request body the edge failed for not arriving in time.
fn body_timed_out() -> ApiError {
    ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "request_timeout",
        "the request body did not arrive within limits.body_timeout",
    )
}

/// Whether an error was caused by an I/O timeout (the edge's body deadline).
fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if error
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        cause = error.source();
    }
    false
}

/// Parses a JSON body; 400 `invalid_json` with serde's explanation for malformed JSON or wrong types.
pub fn parse_json<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            format!("the body is not the expected JSON: {e}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection's state, in every state, is what `/v1/sources` and `/v1/sinks` show of it.
    #[test]
    fn a_links_state_is_shown_whole() {
        let source = crate::connection::ConnectionState::new("source", "in", "redis");
        let sink = crate::connection::ConnectionState::new("sink", "out", "nats");
        let shown = |source: &crate::connection::ConnectionState,
                     sink: &crate::connection::ConnectionState| {
            let source = serde_json::to_value(SourceState::from(source.snapshot())).unwrap();
            let sink = serde_json::to_value(SinkState::from(sink.snapshot())).unwrap();
            (source, sink)
        };
        let (source_json, sink_json) = shown(&source, &sink);
        assert_eq!(
            source_json,
            serde_json::json!({"name": "in", "kind": "redis", "sink": null, "connected": false, "requests": {}})
        );
        assert_eq!(
            sink_json,
            serde_json::json!({"name": "out", "kind": "nats", "connected": false, "postponed": 0})
        );
        source.down(1_796_117_400_000, "refused");
        source.handled("scheduled", 2);
        sink.unreachable(1_796_117_400_000, "refused", 3);
        source.up();
        let (source_json, sink_json) = shown(&source, &sink);
        let at = format_ms(1_796_117_400_000);
        assert_eq!(
            source_json,
            serde_json::json!({"name": "in", "kind": "redis", "sink": null, "connected": true,
                "requests": {"scheduled": 2}, "last_error": "refused", "last_error_at": at})
        );
        assert_eq!(
            sink_json,
            serde_json::json!({"name": "out", "kind": "nats", "connected": false, "postponed": 3,
                "last_error": "refused", "last_error_at": at})
        );
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"abcd", b"abc"));
    }

    #[test]
    fn the_bearer_scheme_is_matched_without_regard_to_case() {
        assert_eq!(bearer_token("Bearer t0k"), Some("t0k"));
        assert_eq!(bearer_token("bearer t0k"), Some("t0k"));
        assert_eq!(bearer_token("BEARER   t0k"), Some("t0k"));
        assert_eq!(bearer_token("Basic dXNlcjpwYXNz"), None);
        assert_eq!(bearer_token("Bearer"), None);
        assert_eq!(bearer_token("Bearert0k"), None);
    }
}
