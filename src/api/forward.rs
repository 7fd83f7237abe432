//! A cluster follower's way to the leader (DESIGN.md §10, "Any node answers"): it sends a `/v1`
//! request on to the leader's client listener (its member's `api` URL) and relays the answer, so that
//! clients and load balancers need not know who leads. Which requests go is the caller's choice; this
//! module only carries them.
//!
//! - **What is sent**: the method; the path and query, after the leader's `api` URL; the body; the
//!   end-to-end headers, `Authorization` among them (the leader authenticates), and `X-Forwarded-For`
//!   as the client sent it. No address is appended to it: the edge does not keep the client's.
//!   Hop-by-hop headers (`Connection` and every header it names, `Keep-Alive`, `Proxy-*`, `TE`,
//!   `Trailer`, `Transfer-Encoding`, `Upgrade`) are dropped both ways. `Host` is the leader's,
//!   `Content-Length` that of the body sent; `Expect` is dropped (the body is in hand). The request
//!   carries [`FORWARDED_BY`]`: <this member's id>`.
//! - **The request body** is read whole before anything is sent, at most `limits.max_request_bytes`
//!   (413 `payload_too_large` past it, 408 `request_timeout` when the edge fails it for being slow, as
//!   a member that leads answers): a slow client never holds a connection to the leader, and a failure
//!   can tell whether the request was sent. **The answer streams back** as it comes (a long poll, a
//!   large listing): its status, its end-to-end headers (`Content-Length` too), its body chunk by chunk.
//!   Redirects are relayed, not followed.
//! - **Timeouts**: 2 s to connect ([`CONNECT_WITHIN`]). No limit on the whole exchange, for a long poll
//!   is held for up to its `wait_ms` (at most `broker.max_wait`); but an answer whose head has not come
//!   within `broker.max_wait` + 30 s ([`HEAD_MARGIN`]) of the request is a failure.
//! - **Failures** are problems naming the leader, `Retry-After: 1`:
//!   - not connected (refused, timed out, a bad URL, TLS): nothing was sent, `503 no_leader`;
//!   - sent, and then the connection broke or the answer's head did not come in time: a `GET` or
//!     `HEAD` changes nothing, `503 no_leader`; any other method may have taken effect on the leader,
//!     `503 write_uncertain` (resend it with an idempotency key);
//!   - once the head is relayed a failure of the body can only cut the answer short: the client's
//!     connection is closed without the body's end (its length, or its chunking, tells it so).
//! - **No loops**: a request that already carries [`FORWARDED_BY`] is not forwarded again
//!   ([`was_forwarded`]); the caller answers `503 no_leader`, so that two members that each think the
//!   other leads (during an election) do not pass a request back and forth.
//! - **Metric**: `delayd_cluster_forwarded_requests_total` counts the requests sent on to a leader,
//!   whatever came of them (not those refused before: too large, a loop). It exists at 0 from the
//!   [`Forwarder`]'s start, made after the metrics recorder is installed (`metrics::install`).

use super::error::ApiError;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use std::error::Error;
use std::time::Duration;

/// The header a forwarded request carries: the id of the member that forwarded it.
pub const FORWARDED_BY: &str = "delayd-forwarded-by";

/// How long a connection to the leader may take.
pub const CONNECT_WITHIN: Duration = Duration::from_secs(2);

/// How much longer than the longest long poll (`broker.max_wait`) the leader may take for an answer's
/// head.
pub const HEAD_MARGIN: Duration = Duration::from_secs(30);

/// A pooled connection to the leader is closed after this long unused: well below the leader's own
/// idle timeout (`limits.idle_timeout`, 60 s by default), so that a request is rarely sent on a
/// connection the leader is closing (a write would then be answered `write_uncertain`).
const POOL_IDLE_WITHIN: Duration = Duration::from_secs(20);

/// Whether `request` was forwarded to this member by another one. Such a request is not forwarded
/// again: the caller answers `503 no_leader`.
pub fn was_forwarded(request: &Request) -> bool {
    request.headers().contains_key(FORWARDED_BY)
}

/// Sends requests on to the leader, one HTTP client (and its connection pool) for every leader.
#[derive(Debug, Clone)]
pub struct Forwarder {
    client: reqwest::Client,
    /// This member's id, sent in [`FORWARDED_BY`].
    node_id: u64,
    max_request_bytes: usize,
    /// From sending a request to the end of its answer's head.
    head_within: Duration,
    forwarded: metrics::Counter,
}

impl Forwarder {
    /// `node_id`: this member's; `max_request_bytes`: `limits.max_request_bytes`; `max_wait`:
    /// `broker.max_wait`, the longest a long poll holds a request. Fails only if the HTTP client cannot
    /// be built (its TLS roots).
    pub fn new(
        node_id: u64,
        max_request_bytes: usize,
        max_wait: Duration,
    ) -> Result<Forwarder, reqwest::Error> {
        let head_within = max_wait.saturating_add(HEAD_MARGIN);
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_WITHIN)
            // A leader that stops sending a body it began is given up on too (the client's
            // connection is then cut).
            .read_timeout(head_within)
            .pool_idle_timeout(POOL_IDLE_WITHIN)
            .redirect(reqwest::redirect::Policy::none())
            // Members talk directly: an `HTTP_PROXY` meant for the outside world is not for them.
            .no_proxy()
            .build()?;
        let forwarded = metrics::counter!("delayd_cluster_forwarded_requests_total");
        forwarded.increment(0);
        Ok(Forwarder {
            client,
            node_id,
            max_request_bytes,
            head_within,
            forwarded,
        })
    }

    /// Sends `request` to the leader, member `leader_id` whose client listener is `leader_api`
    /// (`http://host:port`), and relays its answer; a failure is answered as a problem (see the module's
    /// doc). The request's URI is the one it arrived with (not stripped by a nested router).
    pub async fn forward(&self, leader_id: u64, leader_api: &str, request: Request) -> Response {
        let leader = Leader {
            id: leader_id,
            api: leader_api,
        };
        let (parts, body) = request.into_parts();
        let had_body = parts.headers.contains_key(header::CONTENT_LENGTH)
            || parts.headers.contains_key(header::TRANSFER_ENCODING);
        let body = match read_body(body, self.max_request_bytes).await {
            Ok(body) => body,
            Err(error) => return error.into_response(),
        };
        let mut headers = parts.headers;
        drop_hop_by_hop(&mut headers);
        for name in [header::HOST, header::CONTENT_LENGTH, header::EXPECT] {
            headers.remove(name);
        }
        headers.insert(FORWARDED_BY, HeaderValue::from(self.node_id));
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let url = format!("{}{path}", leader_api.trim_end_matches('/'));
        let mut sending = (self.client)
            .request(parts.method.clone(), &url)
            .headers(headers);
        // An empty body is sent as it came: declared (`Content-Length: 0`), or not at all.
        if had_body || !body.is_empty() {
            sending = sending.body(body);
        }
        self.forwarded.increment(1);
        let answer = match tokio::time::timeout(self.head_within, sending.send()).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(error)) => {
                // Its URL is the leader's, which the problem names already.
                let sent = !(error.is_connect() || error.is_builder());
                let cause = causes(&error.without_url());
                tracing::debug!(leader = leader.id, %url, sent, error = %cause, "forwarding failed");
                return if sent {
                    leader.failed(&parts.method, &cause)
                } else {
                    leader.unreached(&cause)
                }
                .into_response();
            }
            Err(_elapsed) => {
                let cause = format!(
                    "it did not answer within {} s",
                    self.head_within.as_secs_f64()
                );
                tracing::debug!(leader = leader.id, %url, "the leader did not answer in time");
                return leader.failed(&parts.method, &cause).into_response();
            }
        };
        relay(answer, leader.id)
    }

    /// For tests: a shorter wait for an answer's head.
    #[cfg(test)]
    fn with_head_within(mut self, head_within: Duration) -> Forwarder {
        self.head_within = head_within;
        self
    }
}

/// The leader a request goes to, as problems name it.
#[derive(Debug, Clone, Copy)]
struct Leader<'a> {
    id: u64,
    api: &'a str,
}

impl Leader<'_> {
    /// Nothing was sent.
    fn unreached(&self, cause: &str) -> ApiError {
        ApiError::no_leader(format!(
            "the leader, member {} at {}, cannot be reached: {cause}; nothing was sent, retry shortly",
            self.id, self.api
        ))
    }

    /// The request was sent (or may have been), and no answer came.
    fn failed(&self, method: &Method, cause: &str) -> ApiError {
        if matches!(*method, Method::GET | Method::HEAD) {
            ApiError::no_leader(format!(
                "the leader, member {} at {}, did not answer: {cause}; a {method} changes nothing, \
                 retry shortly",
                self.id, self.api
            ))
        } else {
            ApiError::write_uncertain(format!(
                "the connection to the leader, member {} at {}, failed after the request was sent: \
                 {cause}; it may still take effect: resend it with an idempotency key (dedup)",
                self.id, self.api
            ))
        }
    }
}

/// The request body, whole; 413 past `max_bytes`, 408 when the edge failed it for its slowness.
async fn read_body(body: Body, max_bytes: usize) -> Result<Bytes, ApiError> {
    match Limited::new(body, max_bytes).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(super::body_too_large()),
        Err(error) if super::timed_out(&*error) => Err(super::body_timed_out()),
        Err(error) => Err(ApiError::bad_request(
            "invalid_body",
            format!("the request body could not be read: {error}"),
        )),
    }
}

/// The leader's answer as this member's: its status, its end-to-end headers, its body streamed.
fn relay(mut answer: reqwest::Response, leader_id: u64) -> Response {
    let status = answer.status();
    let mut headers = std::mem::take(answer.headers_mut());
    drop_hop_by_hop(&mut headers);
    let chunks = futures_util::stream::unfold(Some(answer), move |answer| async move {
        let mut answer = answer?;
        match answer.chunk().await {
            Ok(Some(chunk)) => Some((Ok(chunk), Some(answer))),
            Ok(None) => None,
            // The head is gone already: the error ends the body, and the client's connection.
            Err(error) => {
                tracing::debug!(leader = leader_id, error = %causes(&error), "the leader's answer broke off");
                Some((Err(error), None))
            }
        }
    });
    let mut response = Response::new(Body::from_stream(chunks));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// Removes the headers that describe one connection rather than the message (RFC 9110 §7.6.1): the
/// standard ones and those the `Connection` header names.
fn drop_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = (headers.get_all(header::CONNECTION).iter())
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    let standard: Vec<HeaderName> = (headers.keys())
        .filter(|name| {
            matches!(
                name.as_str(),
                "connection" | "keep-alive" | "te" | "trailer" | "transfer-encoding" | "upgrade"
            ) || name.as_str().starts_with("proxy-")
        })
        .cloned()
        .collect();
    for name in named.into_iter().chain(standard) {
        headers.remove(name);
    }
}

/// An error and its causes, in one line: `what: why: why`.
fn causes(error: &reqwest::Error) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(error) = cause {
        let text = error.to_string();
        // hyper's errors repeat their cause in their own text.
        if !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = error.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::routing::get;
    use axum::Router;
    use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;
    use tokio::sync::{mpsc, oneshot};

    /// The follower's id, in every test.
    const FOLLOWER_ID: u64 = 3;
    /// The leader's id, in every test.
    const LEADER_ID: u64 = 2;
    /// How long a test waits for something that should come at once.
    const PATIENCE: Duration = Duration::from_secs(10);

    async fn listener() -> (TcpListener, String) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        (listener, url)
    }

    /// Serves `router` on a port of its own (until the test's runtime ends); its URL.
    async fn serve(router: Router) -> String {
        let (listener, url) = listener().await;
        tokio::spawn(async move { axum::serve(listener, router).await });
        url
    }

    /// A follower's router: everything goes to the leader at `leader_api`, unless it came forwarded.
    fn follower_router(forwarder: Forwarder, leader_api: String) -> Router {
        Router::new().fallback(move |request: Request| async move {
            if was_forwarded(&request) {
                return ApiError::no_leader("a forwarded request is not forwarded again")
                    .into_response();
            }
            forwarder.forward(LEADER_ID, &leader_api, request).await
        })
    }

    /// A follower in front of the leader at `leader_api`, with a metrics recorder of its own.
    struct Follower {
        url: String,
        metrics: PrometheusHandle,
    }

    impl Follower {
        async fn start(leader_api: &str) -> Follower {
            Follower::start_with(leader_api, |f| f).await
        }

        async fn start_with(
            leader_api: &str,
            configure: impl FnOnce(Forwarder) -> Forwarder,
        ) -> Follower {
            let (forwarder, metrics) = forwarder_with_own_metrics(1024);
            let router = follower_router(configure(forwarder), leader_api.to_string());
            Follower {
                url: serve(router).await,
                metrics,
            }
        }

        /// `delayd_cluster_forwarded_requests_total` as this follower's recorder renders it.
        fn forwarded(&self) -> u64 {
            let rendered = self.metrics.render();
            (rendered.lines())
                .find_map(|line| line.strip_prefix("delayd_cluster_forwarded_requests_total "))
                .unwrap_or_else(|| panic!("the counter in\n{rendered}"))
                .parse()
                .unwrap()
        }
    }

    /// A forwarder whose counter lives in a recorder of the test's own, not the process's.
    fn forwarder_with_own_metrics(max_request_bytes: usize) -> (Forwarder, PrometheusHandle) {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let forwarder = metrics::with_local_recorder(&recorder, || {
            Forwarder::new(FOLLOWER_ID, max_request_bytes, Duration::from_secs(30)).unwrap()
        });
        (forwarder, handle)
    }

    fn client() -> reqwest::Client {
        reqwest::Client::builder().no_proxy().build().unwrap()
    }

    /// A leader that answers every request with what it received, as JSON.
    fn echo_leader() -> Router {
        Router::new().fallback(|request: Request| async move {
            let (parts, body) = request.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for (name, value) in &parts.headers {
                let value = value.to_str().unwrap().to_string();
                headers.entry(name.to_string()).or_default().push(value);
            }
            let echo = serde_json::json!({
                "method": parts.method.as_str(),
                "path": parts.uri.path(),
                "query": parts.uri.query(),
                "headers": headers,
                "body": String::from_utf8_lossy(&body),
            });
            (
                [("x-echo-method", parts.method.to_string())],
                axum::Json(echo),
            )
        })
    }

    /// Each method's path, query, body and end-to-end headers reach the leader, its answer the client.
    #[tokio::test]
    async fn a_request_reaches_the_leader_whole() {
        let leader = serve(echo_leader()).await;
        let follower = Follower::start(&leader).await;
        let client = client();
        for method in [Method::GET, Method::POST, Method::PUT, Method::DELETE] {
            let body = format!(r#"{{"by": "{method}"}}"#);
            let answer = (client.request(
                method.clone(),
                format!("{}/v1/messages/a%2Fb?topic=t&from=1%202", follower.url),
            ))
            .bearer_auth("t0k")
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-forwarded-for", "203.0.113.7")
            .header("traceparent", "00-abc-def-01")
            .body(body.clone())
            .send()
            .await
            .unwrap();
            assert_eq!(answer.status(), StatusCode::OK);
            assert_eq!(answer.headers()["x-echo-method"], method.as_str());
            let echo: serde_json::Value = answer.json().await.unwrap();
            assert_eq!(echo["method"], method.as_str());
            assert_eq!(echo["path"], "/v1/messages/a%2Fb");
            assert_eq!(echo["query"], "topic=t&from=1%202");
            assert_eq!(echo["body"], body.as_str());
            let seen = &echo["headers"];
            assert_eq!(seen["authorization"], serde_json::json!(["Bearer t0k"]));
            assert_eq!(
                seen["content-type"],
                serde_json::json!(["application/json"])
            );
            assert_eq!(
                seen["content-length"],
                serde_json::json!([body.len().to_string()])
            );
            assert_eq!(seen["traceparent"], serde_json::json!(["00-abc-def-01"]));
            assert_eq!(seen["x-forwarded-for"], serde_json::json!(["203.0.113.7"]));
            assert_eq!(
                seen[FORWARDED_BY],
                serde_json::json!([FOLLOWER_ID.to_string()])
            );
            assert_eq!(
                seen["host"],
                serde_json::json!([leader.trim_start_matches("http://")])
            );
        }
        // A HEAD: the leader's head, no body.
        let answer = client
            .head(format!("{}/v1/topics", follower.url))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        assert_eq!(answer.headers()["x-echo-method"], "HEAD");
        assert_eq!(answer.bytes().await.unwrap(), "");
        // A GET without a body is sent without one.
        let echo: serde_json::Value = (client.get(format!("{}/v1/topics", follower.url)))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(echo["body"], "");
        assert!(echo["headers"].get("content-length").is_none(), "{echo}");
        assert!(echo["query"].is_null(), "{echo}");
        assert_eq!(follower.forwarded(), 6);
    }

    /// Headers that describe a connection stay on it, in both directions.
    #[tokio::test]
    async fn hop_by_hop_headers_are_dropped_both_ways() {
        let leader = Router::new()
            .route(
                "/v1/teapot",
                get(|| async {
                    (
                        StatusCode::IM_A_TEAPOT,
                        [
                            ("x-custom", "kept"),
                            ("retry-after", "7"),
                            ("connection", "x-leader-private"),
                            ("x-leader-private", "1"),
                            ("keep-alive", "timeout=5"),
                            ("proxy-authenticate", "Basic"),
                        ],
                        "short and stout",
                    )
                }),
            )
            .merge(echo_leader());
        let leader = serve(leader).await;
        let follower = Follower::start(&leader).await;
        let client = client();
        let echo: serde_json::Value = (client.post(format!("{}/v1/messages", follower.url)))
            .header(header::CONNECTION, "keep-alive, x-client-private")
            .header("x-client-private", "1")
            .header("keep-alive", "timeout=5")
            .header("proxy-authorization", "Basic dXNlcjpwYXNz")
            .header("proxy-connection", "keep-alive")
            .header(header::TE, "trailers")
            .header("x-end-to-end", "kept")
            .body("{}")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let seen = echo["headers"].as_object().unwrap();
        for name in [
            "connection",
            "x-client-private",
            "keep-alive",
            "proxy-authorization",
            "proxy-connection",
            "te",
        ] {
            assert!(
                !seen.contains_key(name),
                "{name} reached the leader: {echo}"
            );
        }
        assert_eq!(seen["x-end-to-end"], serde_json::json!(["kept"]));

        let answer = client
            .get(format!("{}/v1/teapot", follower.url))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::IM_A_TEAPOT);
        let headers = answer.headers().clone();
        assert_eq!(headers["x-custom"], "kept");
        assert_eq!(headers[header::RETRY_AFTER], "7");
        assert_eq!(headers[header::CONTENT_LENGTH], "15");
        for name in ["x-leader-private", "keep-alive", "proxy-authenticate"] {
            assert!(
                !headers.contains_key(name),
                "{name} reached the client: {headers:?}"
            );
        }
        assert!(
            headers
                .get_all(header::CONNECTION)
                .iter()
                .all(|v| v != "x-leader-private"),
            "{headers:?}"
        );
        assert_eq!(answer.text().await.unwrap(), "short and stout");
    }

    /// An answer's body is relayed as it comes: its first piece reaches the client while the leader
    /// still holds the rest.
    #[tokio::test]
    async fn an_answer_streams_through() {
        let (pieces, held) = mpsc::channel::<Bytes>(4);
        let held = Arc::new(Mutex::new(Some(held)));
        let leader = Router::new()
            .route(
                "/v1/messages",
                get(
                    |State(held): State<Arc<Mutex<Option<mpsc::Receiver<Bytes>>>>>| async move {
                        let held = held.lock().unwrap().take().expect("one request");
                        let stream = futures_util::stream::unfold(held, |mut held| async move {
                            let piece = held.recv().await?;
                            Some((Ok::<_, std::io::Error>(piece), held))
                        });
                        Body::from_stream(stream)
                    },
                ),
            )
            .with_state(held);
        let leader = serve(leader).await;
        let follower = Follower::start(&leader).await;
        pieces.send(Bytes::from_static(b"first,")).await.unwrap();
        let read_first = async {
            let mut answer = client()
                .get(format!("{}/v1/messages", follower.url))
                .send()
                .await
                .unwrap();
            assert_eq!(answer.status(), StatusCode::OK);
            let mut received = Vec::new();
            while received != b"first," {
                let chunk = answer.chunk().await.unwrap().expect("more before the end");
                received.extend_from_slice(&chunk);
            }
            answer
        };
        let answer = tokio::time::timeout(PATIENCE, read_first)
            .await
            .expect("the first piece arrives while the leader holds the rest");
        pieces.send(Bytes::from_static(b"second")).await.unwrap();
        drop(pieces);
        assert_eq!(answer.text().await.unwrap(), "second");
    }

    /// A long poll is held on the leader for as long as it waits, and its answer relayed.
    #[tokio::test]
    async fn a_long_poll_is_held_through() {
        let (arrived, mut arrivals) = mpsc::unbounded_channel::<()>();
        let (release, released) = oneshot::channel::<()>();
        let released = Arc::new(Mutex::new(Some(released)));
        let leader = Router::new().route(
            "/v1/topics/{topic}/queues/{queue}/messages",
            get(move || async move {
                arrived.send(()).unwrap();
                let released = released.lock().unwrap().take().expect("one poll");
                released.await.unwrap();
                axum::Json(serde_json::json!({"messages": [{"offset": 0}], "next_offset": 1}))
            }),
        );
        let leader = serve(leader).await;
        let follower = Follower::start(&leader).await;
        let poll = tokio::spawn(
            client()
                .get(format!(
                    "{}/v1/topics/t/queues/0/messages?offset=0&wait_ms=30000",
                    follower.url
                ))
                .send(),
        );
        tokio::time::timeout(PATIENCE, arrivals.recv())
            .await
            .expect("the poll reaches the leader")
            .unwrap();
        release.send(()).unwrap();
        let answer = poll.await.unwrap().unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        let body: serde_json::Value = answer.json().await.unwrap();
        assert_eq!(body["next_offset"], 1);
    }

    /// Every `Connection` header's tokens name headers to drop, in any case and spacing.
    #[test]
    fn the_headers_connection_names_are_dropped() {
        let mut headers = HeaderMap::new();
        headers.append(
            header::CONNECTION,
            HeaderValue::from_static("X-One ,keep-alive"),
        );
        headers.append(header::CONNECTION, HeaderValue::from_static("x-two"));
        for name in [
            "x-one",
            "x-two",
            "x-three",
            "upgrade",
            "trailer",
            "transfer-encoding",
        ] {
            headers.insert(name, HeaderValue::from_static("1"));
        }
        drop_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-three"]);
    }

    /// The answer's head may take the longest long poll and a margin, and no more.
    #[test]
    fn the_head_may_take_the_longest_long_poll_and_a_margin() {
        let forwarder = Forwarder::new(1, 1024, Duration::from_secs(30)).unwrap();
        assert_eq!(forwarder.head_within, Duration::from_secs(60));
    }

    /// A problem's parts, as the client got them.
    async fn problem_of(
        answer: reqwest::Response,
    ) -> (StatusCode, Option<String>, serde_json::Value) {
        let status = answer.status();
        let content_type = answer.headers()[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(content_type, "application/problem+json");
        let retry_after =
            (answer.headers().get(header::RETRY_AFTER)).map(|v| v.to_str().unwrap().to_string());
        (status, retry_after, answer.json().await.unwrap())
    }

    /// With the leader down nothing is sent, whatever the method: 503 no_leader.
    #[tokio::test]
    async fn a_leader_that_is_down_is_no_leader() {
        let (closed, leader) = listener().await;
        drop(closed);
        let follower = Follower::start(&leader).await;
        let client = client();
        for method in [Method::GET, Method::POST] {
            let answer = (client.request(method, format!("{}/v1/messages", follower.url)))
                .body("{}")
                .send()
                .await
                .unwrap();
            let (status, retry_after, problem) = problem_of(answer).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(retry_after.as_deref(), Some("1"));
            assert_eq!(problem["code"], "no_leader");
            let detail = problem["detail"].as_str().unwrap();
            assert!(
                detail.contains(&format!("member {LEADER_ID} at {leader}"))
                    && detail.contains("nothing was sent"),
                "{detail}"
            );
        }
        assert_eq!(follower.forwarded(), 2);
    }

    /// A leader that reads each request whole, reports it, and hangs up without an answer.
    async fn leader_that_hangs_up() -> (String, mpsc::UnboundedReceiver<String>) {
        let (listener, url) = listener().await;
        let (read, requests) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let (mut connection, _) = listener.accept().await.unwrap();
                let request = read_request(&mut connection).await;
                drop(connection);
                let _ = read.send(request);
            }
        });
        (url, requests)
    }

    /// A request's head and its `Content-Length` of body.
    async fn read_request(connection: &mut tokio::net::TcpStream) -> String {
        let mut request = Vec::new();
        let mut buffer = [0; 4096];
        loop {
            let read = connection.read(&mut buffer).await.unwrap();
            request.extend_from_slice(&buffer[..read]);
            let text = String::from_utf8_lossy(&request);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = (head.lines())
                    .find_map(|line| {
                        line.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap())
                    })
                    .unwrap_or(0);
                if body.len() >= length {
                    return text.into_owned();
                }
            }
            assert!(read > 0, "the request ended early: {text}");
        }
    }

    /// A write whose connection broke once it was sent may have been done: 503 write_uncertain; a read
    /// is simply not answered: 503 no_leader.
    #[tokio::test]
    async fn a_connection_lost_after_sending_leaves_a_write_uncertain() {
        let (leader, mut requests) = leader_that_hangs_up().await;
        let follower = Follower::start(&leader).await;
        let client = client();
        for (method, code) in [
            (Method::POST, "write_uncertain"),
            (Method::DELETE, "write_uncertain"),
            (Method::GET, "no_leader"),
        ] {
            let answer = (client
                .request(method.clone(), format!("{}/v1/messages/x", follower.url)))
            .body(r#"{"topic": "t"}"#)
            .send()
            .await
            .unwrap();
            let request = requests.recv().await.unwrap();
            assert!(
                request.starts_with(&format!("{method} /v1/messages/x HTTP/1.1")),
                "{request}"
            );
            assert!(
                request.ends_with(r#"{"topic": "t"}"#),
                "the leader read it all: {request}"
            );
            let (status, retry_after, problem) = problem_of(answer).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{problem}");
            assert_eq!(retry_after.as_deref(), Some("1"));
            assert_eq!(problem["code"], code, "{method}: {problem}");
            let detail = problem["detail"].as_str().unwrap();
            assert!(
                detail.contains(&format!("member {LEADER_ID} at {leader}")),
                "{detail}"
            );
        }
        assert_eq!(follower.forwarded(), 3);
    }

    /// A leader that takes a request and never answers: past the head's deadline a write is uncertain,
    /// a read not answered.
    #[tokio::test]
    async fn an_answer_whose_head_does_not_come_is_a_failure() {
        let (arrived, mut arrivals) = mpsc::unbounded_channel::<()>();
        let leader = Router::new().fallback(move || async move {
            arrived.send(()).unwrap();
            std::future::pending::<()>().await;
        });
        let leader = serve(leader).await;
        let follower =
            Follower::start_with(&leader, |f| f.with_head_within(Duration::from_millis(300))).await;
        let client = client();
        for (method, code) in [(Method::PUT, "write_uncertain"), (Method::GET, "no_leader")] {
            let answer = (client
                .request(method, format!("{}/v1/groups/g/offsets/t/0", follower.url)))
            .body(r#"{"offset": 1}"#)
            .send()
            .await
            .unwrap();
            arrivals.recv().await.unwrap();
            let (status, _, problem) = problem_of(answer).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(problem["code"], code);
            assert!(
                problem["detail"]
                    .as_str()
                    .unwrap()
                    .contains("did not answer within 0.3 s"),
                "{problem}"
            );
        }
    }

    /// A body over `max_request_bytes` is refused before anything is sent.
    #[tokio::test]
    async fn a_body_too_large_is_refused_here() {
        let leader = serve(echo_leader()).await;
        let follower = Follower::start(&leader).await;
        let client = client();
        let answer = (client.post(format!("{}/v1/messages", follower.url)))
            .body(vec![b'x'; 1025])
            .send()
            .await
            .unwrap();
        let (status, _, problem) = problem_of(answer).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(problem["code"], "payload_too_large");
        assert_eq!(follower.forwarded(), 0);
        // At the limit it goes.
        let echo: serde_json::Value = (client.post(format!("{}/v1/messages", follower.url)))
            .body(vec![b'x'; 1024])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(echo["body"].as_str().unwrap().len(), 1024);
        assert_eq!(follower.forwarded(), 1);
    }

    /// Two members that each think the other leads do not pass a request back and forth: the second
    /// refuses it, and the first relays the refusal.
    #[tokio::test]
    async fn a_forwarded_request_is_not_forwarded_again() {
        let (listener_a, url_a) = listener().await;
        let (listener_b, url_b) = listener().await;
        let (forwarder_a, metrics_a) = forwarder_with_own_metrics(1024);
        let (forwarder_b, metrics_b) = forwarder_with_own_metrics(1024);
        let router_a = follower_router(forwarder_a, url_b.clone());
        let router_b = follower_router(forwarder_b, url_a.clone());
        tokio::spawn(async move { axum::serve(listener_a, router_a).await });
        tokio::spawn(async move { axum::serve(listener_b, router_b).await });
        let a = Follower {
            url: url_a,
            metrics: metrics_a,
        };
        let b = Follower {
            url: url_b,
            metrics: metrics_b,
        };
        let client = client();
        let answer = (client.post(format!("{}/v1/messages", a.url)))
            .body("{}")
            .send()
            .await
            .unwrap();
        let (status, retry_after, problem) = problem_of(answer).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(retry_after.as_deref(), Some("1"));
        assert_eq!(problem["code"], "no_leader");
        assert_eq!((a.forwarded(), b.forwarded()), (1, 0));
        // However it came by the header.
        let answer = (client.get(format!("{}/v1/topics", b.url)))
            .header(FORWARDED_BY, "9")
            .send()
            .await
            .unwrap();
        assert_eq!(problem_of(answer).await.2["code"], "no_leader");
        assert_eq!(b.forwarded(), 0);
    }
}
