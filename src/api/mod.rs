//! The HTTP API v1 (DESIGN.md §6): routes, shared state, request checks, authentication and the
//! per-request metric. Handlers live in `messages` (schedule, status, cancel) and `consume` (the built-in
//! broker's topics, pulls and group offsets).

mod consume;
pub mod error;
mod messages;

use crate::broker::Broker;
use crate::config::Config;
use crate::scheduler::Scheduler;
use axum::body::Bytes;
use axum::extract::{FromRequest, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::Router;
use error::ApiError;
use metrics_exporter_prometheus::PrometheusHandle;
use schedulelog::{Clock, ScheduleLog};
use serde::de::{DeserializeOwned, Visitor};
use serde::{Deserialize, Deserializer};
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

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
    /// Idempotency index: (topic, key) → the pending message sent with `dedup`.
    pub dedup: Arc<tokio::sync::Mutex<DedupIndex>>,
}

/// (topic, key) → message id, for messages sent with `dedup: true`.
pub type DedupIndex = std::collections::HashMap<(String, String), schedulelog::MessageId>;

/// Topic, sink and group names: `[A-Za-z0-9._-]{1,200}`, and not only dots (so no name is `.` or `..`
/// and none can leave the data dir when used as a directory name).
pub fn valid_name(name: &str) -> bool {
    (1..=200).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !name.bytes().all(|b| b == b'.')
}

pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/messages", post(messages::schedule))
        .route("/v1/messages/batch", post(messages::schedule_batch))
        .route(
            "/v1/messages/{id}",
            get(messages::status).delete(messages::cancel),
        )
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
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .merge(v1)
        .route("/healthz", get(|| async { "ok\n" }))
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

/// 200 once recovery is done (the router is served only then), as `{"status": "ready"}`; while the disk
/// is short of space (new messages refused, or a writer held up) it stays 200, for the node still
/// delivers, cancels and serves pulls (and a sidecar's failing readiness would take its whole pod out of
/// service), and says why in `"disk_full"`. 503 `storage_failed` while the log or a broker store refuses
/// writes until a restart.
async fn ready(State(state): State<AppState>) -> Response {
    if let Some(cause) = state.log.poisoned().or_else(|| state.broker.failed()) {
        let mut error = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "storage_failed", cause);
        error.retry_after_secs = Some(60);
        return error.into_response();
    }
    let mut answer = serde_json::json!({"status": "ready"});
    if let Some(cause) = state.disk.full() {
        answer["disk_full"] = serde_json::Value::String(cause);
    }
    axum::Json(answer).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
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
    let tokens = &state.config.auth.tokens;
    if tokens.is_empty() {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(given)
            if tokens
                .iter()
                .any(|t| constant_time_eq(t.as_bytes(), given.as_bytes())) =>
        {
            next.run(request).await
        }
        Some(_) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the bearer token is not valid",
        )
        .into_response(),
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send Authorization: Bearer <token>",
        )
        .into_response(),
    }
}

/// Compares without an early exit, so the time taken does not tell how much of a token matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
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
                    ApiError::too_large("the request body is larger than limits.max_request_bytes")
                } else if timed_out(&rejection) {
                    ApiError::new(
                        StatusCode::REQUEST_TIMEOUT,
                        "request_timeout",
                        "the request body did not arrive within limits.body_timeout",
                    )
                } else {
                    ApiError::bad_request("invalid_body", rejection.body_text())
                }
            })
    }
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

/// A JSON string borrowed from the request when it has no escapes (most do not), copied when it has.
#[derive(Debug)]
pub struct Text<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Text<'a>, D::Error> {
        struct TextVisitor;
        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(TextVisitor)
    }
}

/// `2026-12-01T09:30:00.000Z`: RFC 3339, UTC, milliseconds.
pub fn format_ms(unix_ms: i64) -> String {
    // Digit by digit: answers carry one per message, and `time`'s format descriptions cost 4 % of the
    // server's CPU in a batch of 1,000.
    let Ok(t) = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(unix_ms) * 1_000_000)
    else {
        return unix_ms.to_string();
    };
    let Ok(year) = u32::try_from(t.year()) else {
        return unix_ms.to_string();
    };
    if year > 9999 {
        return unix_ms.to_string();
    }
    let mut out = String::with_capacity(24);
    let mut digits = |value: u32, width: u32, then: char| {
        for place in (0..width).rev() {
            out.push(char::from(b'0' + (value / 10u32.pow(place) % 10) as u8));
        }
        out.push(then);
    };
    digits(year, 4, '-');
    digits(u32::from(u8::from(t.month())), 2, '-');
    digits(u32::from(t.day()), 2, 'T');
    digits(u32::from(t.hour()), 2, ':');
    digits(u32::from(t.minute()), 2, ':');
    digits(u32::from(t.second()), 2, '.');
    digits(u32::from(t.millisecond()), 3, 'Z');
    out
}

/// Parses an RFC 3339 time with any offset to unix milliseconds.
pub fn parse_rfc3339(text: &str) -> Option<i64> {
    let parsed =
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(parsed.unix_timestamp_nanos().div_euclid(1_000_000)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("orders.timeout"));
        assert!(valid_name("a-b_c.9"));
        assert!(!valid_name(""));
        assert!(!valid_name(".."));
        assert!(!valid_name("."));
        assert!(!valid_name("a/b"));
        assert!(!valid_name("$dead"));
        assert!(!valid_name(&"x".repeat(201)));
    }

    #[test]
    fn times() {
        assert_eq!(format_ms(1_796_117_400_123), "2026-12-01T09:30:00.123Z");
        assert_eq!(format_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_ms(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(format_ms(951_782_400_007), "2000-02-29T00:00:00.007Z");
        assert_eq!(format_ms(253_402_300_799_999), "9999-12-31T23:59:59.999Z");
        assert_eq!(format_ms(253_402_300_800_000), "253402300800000");
        assert_eq!(format_ms(i64::MIN), i64::MIN.to_string());
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let ms = (x % 253_402_300_800_000) as i64 - 62_135_596_800_000 * (x % 2) as i64;
            assert_eq!(parse_rfc3339(&format_ms(ms)), Some(ms), "{ms}");
        }
        assert_eq!(
            parse_rfc3339("2026-12-01T09:30:00.123Z"),
            Some(1_796_117_400_123)
        );
        assert_eq!(
            parse_rfc3339("2026-12-01T10:30:00+01:00"),
            Some(1_796_117_400_000)
        );
        assert_eq!(parse_rfc3339("2026-12-01 09:30"), None);
        assert_eq!(parse_rfc3339("tomorrow"), None);
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"abcd", b"abc"));
    }
}
