//! The HTTP edge: accepts connections and serves the API router on them within limits, so that slow or
//! numerous clients cannot take the descriptors, memory or time that storage and deliveries need.
//!
//! - **Timeouts** ([`Timeouts`], per connection in `connection`): a request's head must arrive within
//!   `limits.header_timeout` (10 s), its body within `limits.body_timeout` (30 s) of the head (else 408
//!   `request_timeout` and the connection closes), and a connection with nothing in flight closes after
//!   `limits.idle_timeout` (60 s) without traffic. A request being handled has no timeout of the edge's:
//!   a long poll waits as long as it asked (at most `broker.max_wait`).
//! - **A connection cap**: at most `max_connections` connections are served at once, fewer when the
//!   open-file limit requires ([`fds`]). Past it a new connection is still accepted, answered 503
//!   `overloaded` with `Retry-After: 1` and closed; its `/healthz`, `/readyz` and `/metrics` are answered
//!   as usual, so that an orchestrator does not restart or unlist a node for being busy, and monitoring
//!   sees it busy rather than down. One log line marks each episode of refusals (and one its end), not
//!   each connection. Refusing takes a descriptor too, for at most [`REFUSAL_WITHIN`]: at most
//!   [`fds::REFUSAL_SLOTS`] at once, and while all are taken new connections wait in the listen backlog.
//! - **Descriptors for storage**: the cap is recomputed every second from the descriptors open, so that
//!   HTTP connections never take the last `limits.reserved_fds` of them (see [`fds`]).
//! - **Graceful stop**: when `shutdown` completes, no connection is accepted and no new request taken;
//!   requests in flight are answered, then [`serve`] returns once every connection has closed.
//!
//! Metrics: `delayd_http_connections`, `delayd_http_connections_max`,
//! `delayd_http_connections_refused_total`, `delayd_http_timeouts_total{phase}`, `delayd_open_fds`,
//! `delayd_max_fds`.

mod connection;
pub mod fds;

use crate::api::error::ApiError;
use crate::config::Config;
use axum::http::{header, HeaderValue, Method, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use connection::{End, Expired, TimedBody};
use http_body_util::BodyExt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::ServiceExt;

/// A refused connection is closed within this long, whatever its client does.
pub const REFUSAL_WITHIN: Duration = Duration::from_secs(1);

/// A refused connection's request head must arrive within this long (or `limits.header_timeout` if
/// shorter). A client sends its head right behind the handshake's last ACK, so it is there when the
/// connection is accepted, and this costs a real client nothing (but a lost packet); a stalled one
/// holds a refusal slot for a tenth of a second. That keeps the backlog short under a slow-loris
/// attack: real clients are accepted promptly, to a slot or to a clean 503, instead of queueing behind
/// stalled connections (a readiness probe has a second, by default, to be answered).
const REFUSAL_HEAD_WITHIN: Duration = Duration::from_millis(100);

/// Of a refused request's body, at most this much is read (and dropped) before the answer: closing a
/// socket with unread bytes resets it, and the client could lose the 503 it was sent.
const REFUSAL_DRAIN_BYTES: usize = 64 << 10;

/// How long a connection may take for each part of its request cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From a request's first byte (or the connection's start) to its complete head.
    pub header: Duration,
    /// From a request's head to the end of its body.
    pub body: Duration,
    /// With nothing in flight, without traffic.
    pub idle: Duration,
}

/// The edge's settings (from `limits.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub timeouts: Timeouts,
    pub max_connections: usize,
    /// Descriptors left free for everything that is not an HTTP connection.
    pub reserved_fds: u64,
}

impl Limits {
    pub fn from_config(config: &Config) -> Limits {
        Limits {
            timeouts: Timeouts {
                header: config.limits.header_timeout.0,
                body: config.limits.body_timeout.0,
                idle: config.limits.idle_timeout.0,
            },
            max_connections: config.limits.max_connections,
            reserved_fds: config.reserved_fds(),
        }
    }
}

/// What [`serve`] reports once it is about to accept connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ready {
    pub address: SocketAddr,
    /// The connection cap as the open-file limit allows it now (it is recomputed every second).
    pub max_connections: usize,
}

/// Why the edge could not start.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error(
        "the open-file limit (RLIMIT_NOFILE) of {soft} leaves room for {cap} HTTP connections beside the \
         {open} descriptors open, limits.reserved_fds ({reserved}) and {slots} for refusals: raise it \
         (ulimit -n, LimitNOFILE= under systemd) or lower limits.reserved_fds",
        slots = fds::REFUSAL_SLOTS
    )]
    TooFewDescriptors {
        soft: u64,
        open: u64,
        reserved: u64,
        cap: usize,
    },
    #[error("reading the open-file limit: {0}")]
    Limit(io::Error),
    #[error("the listener's address: {0}")]
    Address(io::Error),
}

/// What the accept loop, the connections and the budget refresher share.
#[derive(Debug)]
struct Edge {
    budget: fds::Budget,
    /// Connections being served (not counting refusals).
    open: AtomicUsize,
    /// The connection cap now.
    cap: AtomicUsize,
    /// One permit per refused connection being answered.
    refusing: Arc<Semaphore>,
    /// Notified whenever a served connection closes (a graceful stop waits for the last).
    closed: Notify,
    connections: metrics::Gauge,
}

impl Edge {
    /// A served connection, if the cap allows one more (only the accept loop opens connections).
    fn try_open(self: &Arc<Self>) -> Option<OpenConnection> {
        if self.open.load(Ordering::Acquire) >= self.cap.load(Ordering::Acquire) {
            return None;
        }
        self.open.fetch_add(1, Ordering::AcqRel);
        self.connections.increment(1.0);
        Some(OpenConnection(self.clone()))
    }

    fn at_cap(&self) -> bool {
        self.open.load(Ordering::Acquire) >= self.cap.load(Ordering::Acquire)
    }

    /// Measures the descriptors open and sets the cap from them.
    fn refresh_cap(&self) -> Result<usize, EdgeError> {
        let soft = fds::soft_limit().map_err(EdgeError::Limit)?;
        let ours = (self.open.load(Ordering::Acquire)
            + (fds::REFUSAL_SLOTS - self.refusing.available_permits())) as u64
            + 1; // the listener
        let open = match fds::open_count() {
            Ok(open) => open,
            Err(e) => {
                // Probably EMFILE: no new connection until the count can be read again (a cap
                // computed as if nothing else were open would hand storage's descriptors to HTTP).
                let cap = self
                    .cap
                    .load(Ordering::Acquire)
                    .min(self.open.load(Ordering::Acquire));
                self.cap.store(cap, Ordering::Release);
                metrics::gauge!("delayd_http_connections_max").set(cap as f64);
                tracing::debug!(error = %e, cap, "counting open descriptors failed; no new connections");
                return Ok(cap);
            }
        };
        // Without /proc/self/fd the reserve alone stands for everything else.
        let other = open.map_or(0, |n| n.saturating_sub(ours));
        let cap = self.budget.cap(soft, other);
        self.cap.store(cap, Ordering::Release);
        metrics::gauge!("delayd_http_connections_max").set(cap as f64);
        metrics::gauge!("delayd_max_fds").set(soft as f64);
        if let Some(open) = open {
            metrics::gauge!("delayd_open_fds").set(open as f64);
        }
        Ok(cap)
    }

    fn check_at_start(&self) -> Result<usize, EdgeError> {
        let cap = self.refresh_cap()?;
        if cap < fds::MIN_CONNECTIONS.min(self.budget.max_connections) {
            return Err(EdgeError::TooFewDescriptors {
                soft: fds::soft_limit().map_err(EdgeError::Limit)?,
                open: fds::open_count().ok().flatten().unwrap_or(0),
                reserved: self.budget.reserved,
                cap,
            });
        }
        Ok(cap)
    }

    /// Waits until every served connection has closed and every refusal ended.
    async fn drained(&self) {
        loop {
            let closed = self.closed.notified();
            let mut closed = pin!(closed);
            closed.as_mut().enable();
            if self.open.load(Ordering::Acquire) == 0 {
                break;
            }
            closed.await;
        }
        // Refusals end within REFUSAL_WITHIN; each holds a permit until then.
        let _all = self.refusing.acquire_many(fds::REFUSAL_SLOTS as u32).await;
    }
}

/// A served connection's place under the cap, given back when it closes.
#[derive(Debug)]
struct OpenConnection(Arc<Edge>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.connections.decrement(1.0);
        self.0.closed.notify_waiters();
    }
}

/// A run of refused connections: logged when it starts and when it ends.
#[derive(Debug)]
struct Episode {
    since: Instant,
    refused: u64,
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes (see the module doc), then
/// returns once every connection has closed. `on_ready` is called once, just before the first accept.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    on_ready: impl FnOnce(&Ready),
    shutdown: impl Future<Output = ()>,
) -> Result<(), EdgeError> {
    let edge = Arc::new(Edge {
        budget: fds::Budget {
            max_connections: limits.max_connections,
            reserved: limits.reserved_fds,
        },
        open: AtomicUsize::new(0),
        cap: AtomicUsize::new(0),
        refusing: Arc::new(Semaphore::new(fds::REFUSAL_SLOTS)),
        closed: Notify::new(),
        connections: metrics::gauge!("delayd_http_connections"),
    });
    let cap = edge.check_at_start()?;
    let address = listener.local_addr().map_err(EdgeError::Address)?;
    let soft = fds::soft_limit().map_err(EdgeError::Limit)?;
    if cap < limits.max_connections {
        tracing::warn!(
            max_connections = cap,
            configured = limits.max_connections,
            fd_limit = soft,
            reserved_fds = limits.reserved_fds,
            "the open-file limit allows fewer connections than limits.max_connections"
        );
    }
    tracing::info!(
        %address,
        max_connections = cap,
        fd_limit = soft,
        fds_open = fds::open_count().ok().flatten().unwrap_or(0),
        reserved_fds = limits.reserved_fds,
        header_timeout = ?limits.timeouts.header,
        body_timeout = ?limits.timeouts.body,
        idle_timeout = ?limits.timeouts.idle,
        "serving HTTP"
    );
    let refresher = tokio::spawn({
        let edge = edge.clone();
        async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(error) = edge.refresh_cap() {
                    tracing::warn!(%error, "the connection cap was not recomputed");
                }
            }
        }
    });
    let refusal_timeouts = Timeouts {
        header: limits.timeouts.header.min(REFUSAL_HEAD_WITHIN),
        body: limits.timeouts.body.min(REFUSAL_WITHIN),
        idle: limits.timeouts.idle.min(REFUSAL_WITHIN),
    };
    on_ready(&Ready {
        address,
        max_connections: cap,
    });

    let (stop_sender, stop_receiver) = watch::channel(false);
    let stopped = move || {
        let mut stop = stop_receiver.clone();
        async move {
            // Also fine when the sender is gone: that is a stop too.
            let _ = stop.wait_for(|stop| *stop).await;
        }
    };
    let mut shutdown = pin!(shutdown);
    let mut episode: Option<Episode> = None;
    let mut accept_failures = AcceptFailures::default();
    loop {
        // At the cap, a connection is accepted only with a refusal slot in hand, so the edge's
        // descriptors stay within cap + REFUSAL_SLOTS; meanwhile new connections wait in the backlog.
        let slot = if edge.at_cap() {
            // Created before the wait: a close from here on wakes it (a close just before it only
            // costs the wait for a refusal slot).
            let closed = edge.closed.notified();
            tokio::select! {
                permit = edge.refusing.clone().acquire_owned() => permit.ok(),
                // A served connection closed: there may be room under the cap; look again.
                () = closed => continue,
                () = &mut shutdown => break,
            }
        } else {
            None
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(error) => {
                accept_failed(error, &mut accept_failures).await;
                continue;
            }
        };
        if let Some(open) = edge.try_open() {
            drop(slot);
            let cap = edge.cap.load(Ordering::Acquire);
            let open_now = edge.open.load(Ordering::Acquire);
            // Hysteresis: an episode ends only well below the cap, so that a count hovering at the
            // cap does not log a line per connection.
            if episode.is_some() && open_now + cap / 10 < cap {
                if let Some(ended) = episode.take() {
                    tracing::info!(
                        refused = ended.refused,
                        lasted = ?ended.since.elapsed(),
                        connections = open_now,
                        "below the connection cap again"
                    );
                }
            }
            let (router, stop) = (router.clone(), stopped());
            tokio::spawn(async move {
                let handle = move |request: Request<TimedBody>| {
                    let router = router.clone();
                    async move { answer(router, request).await }
                };
                let end = connection::serve(stream, limits.timeouts, true, handle, stop).await;
                count(end);
                drop(open);
            });
            continue;
        }
        metrics::counter!("delayd_http_connections_refused_total").increment(1);
        match &mut episode {
            Some(episode) => episode.refused += 1,
            None => {
                tracing::warn!(
                    connections = edge.open.load(Ordering::Acquire),
                    max_connections = edge.cap.load(Ordering::Acquire),
                    "connection cap reached: new connections are answered 503 overloaded until some \
                     close (limits.max_connections, or fewer while file descriptors are short: \
                     delayd_http_connections_max)"
                );
                episode = Some(Episode {
                    since: Instant::now(),
                    refused: 1,
                });
            }
        }
        // Taken before the accept at the cap; otherwise the cap fell in the meantime.
        let Some(permit) = slot.or_else(|| edge.refusing.clone().try_acquire_owned().ok()) else {
            drop(stream);
            continue;
        };
        let (router, stop) = (router.clone(), stopped());
        tokio::spawn(refuse(stream, permit, router, refusal_timeouts, stop));
    }
    drop(listener);
    tracing::info!(
        connections = edge.open.load(Ordering::Acquire),
        "no new connections; answering the requests in flight"
    );
    stop_sender.send_replace(true);
    edge.drained().await;
    refresher.abort();
    Ok(())
}

/// The router's answer to a request.
async fn answer(router: Router, request: Request<TimedBody>) -> Response<axum::body::Body> {
    match router.oneshot(request.map(axum::body::Body::new)).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// Answers a connection past the cap: its health and readiness probes and metric scrapes as usual,
/// everything else 503 `overloaded`; then closes it, within [`REFUSAL_WITHIN`].
async fn refuse(
    stream: TcpStream,
    permit: OwnedSemaphorePermit,
    router: Router,
    timeouts: Timeouts,
    stop: impl Future<Output = ()>,
) {
    let handle = move |request: Request<TimedBody>| {
        let router = router.clone();
        async move {
            let probe = matches!(request.uri().path(), "/healthz" | "/readyz" | "/metrics")
                && matches!(*request.method(), Method::GET | Method::HEAD);
            if probe {
                return answer(router, request).await;
            }
            let _ = http_body_util::Limited::new(request.into_body(), REFUSAL_DRAIN_BYTES)
                .collect()
                .await;
            overloaded()
        }
    };
    let end = tokio::time::timeout(
        REFUSAL_WITHIN,
        connection::serve(stream, timeouts, false, handle, stop),
    )
    .await;
    if let Ok(end) = end {
        count(end);
    }
    drop(permit);
}

/// 503 `overloaded` for a connection past the cap.
fn overloaded() -> Response<axum::body::Body> {
    let mut response = ApiError {
        retry_after_secs: Some(1),
        ..ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            "too many connections are open; nothing was done, try again after Retry-After",
        )
    }
    .into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Counts the timeouts that ended a connection.
fn count(end: End) {
    match end {
        End::Expired(Expired::Header) => {
            metrics::counter!("delayd_http_timeouts_total", "phase" => "header").increment(1);
        }
        End::Expired(Expired::Idle) => {
            metrics::counter!("delayd_http_timeouts_total", "phase" => "idle").increment(1);
        }
        End::Closed(Err(error)) => tracing::debug!(%error, "connection failed"),
        End::Closed(Ok(())) | End::Stopped => {}
    }
}

/// Failed accepts other than a connection that died in the backlog (out of descriptors or memory):
/// logged at most once a minute, with how many there were.
#[derive(Debug, Default)]
struct AcceptFailures {
    logged_at: Option<Instant>,
    unlogged: u64,
}

/// An accept that failed: a connection that died in the backlog is nothing; anything else is counted
/// (see [`AcceptFailures`]) and retried after a pause, during which new connections wait in the backlog.
async fn accept_failed(error: io::Error, failures: &mut AcceptFailures) {
    if matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
    ) {
        return;
    }
    failures.unlogged += 1;
    if failures
        .logged_at
        .is_none_or(|at| at.elapsed() >= Duration::from_secs(60))
    {
        tracing::error!(
            %error,
            failures = failures.unlogged,
            "accepting connections fails (counting the failures since the last such line, at most one a \
             minute); retrying every 100 ms, new connections wait in the backlog"
        );
        failures.logged_at = Some(Instant::now());
        failures.unlogged = 0;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
}
