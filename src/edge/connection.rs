//! One HTTP connection: hyper's HTTP/1.1 server driven under a watchdog that enforces the header and
//! idle timeouts, and request bodies that must arrive within the body timeout.
//!
//! A connection is always in one [`Phase`]:
//! - **Head**: waiting for a request's head (request line and headers), since the connection opened or
//!   since the first byte of a request after an idle spell. It must be complete within
//!   `header_timeout`, however the bytes trickle in (a slow-loris client sends a byte now and then).
//! - **Busy**: a request is being handled (hyper called the service and its future is alive). No
//!   connection timeout: the body has its own deadline ([`TimedBody`]), and a handler's own wait is
//!   bounded (a long poll by `broker.max_wait`).
//! - **Idle**: nothing in flight, since the response was handed to hyper or the last byte of it was
//!   written. Past `idle_timeout` without traffic the connection is closed: a keep-alive connection
//!   nobody uses, or a client that does not read its response.
//!
//! Why not hyper's own `header_read_timeout`: hyper arms it whenever it waits for a request head, which
//! includes the whole idle time of a keep-alive connection, so it would close idle connections after
//! the header timeout and no idle timeout could be longer; it also does not see a client that stops
//! reading. The phases are changed only from inside the connection's future (the socket wrapper and
//! the service run in it), and the watchdog re-arms its one timer after each poll of that future, so a
//! change of phase is never missed and nothing is polled on a clock.

use super::Timeouts;
use axum::body::Bytes;
use axum::http::{header, HeaderValue, Request, Response};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// Where a connection is in its request cycle (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Head { since: Instant },
    Busy { requests: u32 },
    Idle { since: Instant },
}

/// Which timeout ended a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expired {
    Header,
    Idle,
}

/// A connection's phase, shared by its socket wrapper, its service and its watchdog (all in one task:
/// the lock is never contended).
#[derive(Debug)]
pub(super) struct Activity {
    phase: Mutex<Phase>,
    /// A request body missed its deadline: the connection closes after this response (the rest of the
    /// body is unread, so the connection cannot carry another request).
    close_after_response: AtomicBool,
    /// A request has begun on it: hyper has written to it, or may be writing.
    served: AtomicBool,
}

impl Activity {
    /// A connection opened at `now`: its first request's head is due within the header timeout.
    pub(super) fn new(now: Instant) -> Activity {
        Activity {
            phase: Mutex::new(Phase::Head { since: now }),
            close_after_response: AtomicBool::new(false),
            served: AtomicBool::new(false),
        }
    }

    fn phase(&self) -> std::sync::MutexGuard<'_, Phase> {
        // A panic while holding this lock cannot leave the phase half-changed: recover it.
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes arrived: after an idle spell, the next request has started.
    fn read(&self, now: Instant) {
        let mut phase = self.phase();
        if let Phase::Idle { .. } = *phase {
            *phase = Phase::Head { since: now };
        }
    }

    /// Bytes of a response went out: a client reading a large response is not idle.
    fn wrote(&self, now: Instant) {
        if let Phase::Idle { since } = &mut *self.phase() {
            *since = now;
        }
    }

    /// hyper called the service: a request's head is complete.
    fn begin_request(self: &Arc<Self>) -> InFlight {
        self.served.store(true, Ordering::Relaxed);
        let mut phase = self.phase();
        *phase = match *phase {
            Phase::Busy { requests } => Phase::Busy {
                requests: requests + 1,
            },
            Phase::Head { .. } | Phase::Idle { .. } => Phase::Busy { requests: 1 },
        };
        InFlight(self.clone())
    }

    fn end_request(&self, now: Instant) {
        let mut phase = self.phase();
        if let Phase::Busy { requests } = *phase {
            *phase = if requests > 1 {
                Phase::Busy {
                    requests: requests - 1,
                }
            } else {
                Phase::Idle { since: now }
            };
        }
    }

    /// When the current phase times out, and as what; `None` while a request is in flight.
    pub(super) fn deadline(&self, timeouts: &Timeouts) -> Option<(Instant, Expired)> {
        match *self.phase() {
            Phase::Head { since } => Some((since + timeouts.header, Expired::Header)),
            Phase::Idle { since } => Some((since + timeouts.idle, Expired::Idle)),
            Phase::Busy { .. } => None,
        }
    }

    #[cfg(test)]
    fn is_busy(&self) -> bool {
        matches!(*self.phase(), Phase::Busy { .. })
    }

    /// No request has begun on this connection yet: nothing was written to it.
    fn never_served(&self) -> bool {
        !self.served.load(Ordering::Relaxed)
    }
}

/// A request in flight; dropped when its service future ends (answered, or dropped by hyper).
#[derive(Debug)]
pub(super) struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end_request(Instant::now());
    }
}

/// The socket, reporting traffic to the connection's [`Activity`].
#[derive(Debug)]
pub(super) struct WatchedIo {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl WatchedIo {
    pub(super) fn new(stream: TcpStream, activity: Arc<Activity>) -> WatchedIo {
        WatchedIo { stream, activity }
    }

    /// Counts a write that moved bytes as traffic.
    fn note_written(&self, result: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote(Instant::now());
        }
        result
    }
}

impl AsyncRead for WatchedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.read(Instant::now());
        }
        result
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.note_written(result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.note_written(result)
    }

    fn is_write_vectored(&self) -> bool {
        // hyper writes a response's head and body in one call when it can.
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// A request body that must be complete by a deadline; past it, it fails with an `io::Error` of kind
/// `TimedOut` (which `api::RawBody` answers with 408 `request_timeout`). The timer is created only if
/// the body is read while it is still arriving: small bodies arrive with their head and cost nothing.
#[derive(Debug)]
pub(super) struct TimedBody {
    inner: Incoming,
    deadline: Instant,
    timer: Option<Pin<Box<Sleep>>>,
    activity: Arc<Activity>,
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                this.activity
                    .close_after_response
                    .store(true, Ordering::Relaxed);
                Poll::Ready(Some(Err(Box::new(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the request body did not arrive within limits.body_timeout",
                )))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// How a connection ended.
#[derive(Debug)]
pub(super) enum End {
    /// The client closed it, hyper finished it (keep-alive off, or a graceful stop), or it failed.
    Closed(Result<(), hyper::Error>),
    /// A timeout closed it.
    Expired(Expired),
    /// A graceful stop found it before its first request.
    Stopped,
}

/// Serves `stream` with `handle` (called once per request with its body timed) until the client
/// closes it, a timeout ends it, or `stop` fires. Then no new request is taken: a request in flight is
/// finished and answered, and the connection closed after it; a connection between requests or in the
/// middle of a head is closed at once (hyper's graceful shutdown does that for a connection that has
/// served a request; one that has not is dropped here, for hyper would wait for its first head).
pub(super) async fn serve<H, F>(
    stream: TcpStream,
    timeouts: Timeouts,
    keep_alive: bool,
    handle: H,
    stop: impl Future<Output = ()>,
) -> End
where
    H: Fn(Request<TimedBody>) -> F + Send + 'static,
    F: Future<Output = Response<axum::body::Body>> + Send + 'static,
{
    let activity = Arc::new(Activity::new(Instant::now()));
    let io = hyper_util::rt::TokioIo::new(WatchedIo::new(stream, activity.clone()));
    let for_service = activity.clone();
    let body_timeout = timeouts.body;
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let in_flight = for_service.begin_request();
        let deadline = Instant::now() + body_timeout;
        let activity = for_service.clone();
        let request = request.map(|inner| TimedBody {
            inner,
            deadline,
            timer: None,
            activity: activity.clone(),
        });
        let answer = handle(request);
        async move {
            let mut response = answer.await;
            if activity.close_after_response.load(Ordering::Relaxed) {
                metrics::counter!("delayd_http_timeouts_total", "phase" => "body").increment(1);
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            drop(in_flight);
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let mut conn = pin!(hyper::server::conn::http1::Builder::new()
        .keep_alive(keep_alive)
        .serve_connection(io, service));
    let mut stop = pin!(stop);
    let mut stopping = false;
    let mut timer = pin!(tokio::time::sleep_until(Instant::now()));
    std::future::poll_fn(|cx| {
        if !stopping && stop.as_mut().poll(cx).is_ready() {
            stopping = true;
            if activity.never_served() {
                return Poll::Ready(End::Stopped);
            }
            conn.as_mut().graceful_shutdown();
        }
        if let Poll::Ready(result) = conn.as_mut().poll(cx) {
            return Poll::Ready(End::Closed(result));
        }
        // The poll above may have changed the phase: arm the timer for the phase as it is now.
        let Some((deadline, expired)) = activity.deadline(&timeouts) else {
            return Poll::Pending;
        };
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(End::Expired(expired)),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn timeouts() -> Timeouts {
        Timeouts {
            header: Duration::from_secs(10),
            body: Duration::from_secs(30),
            idle: Duration::from_secs(60),
        }
    }

    #[test]
    fn phases_and_their_deadlines() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let activity = Arc::new(Activity::new(t0));
        let timeouts = timeouts();
        // A new connection: its first head is due within the header timeout, bytes or not.
        assert_eq!(
            activity.deadline(&timeouts),
            Some((t0 + 10 * s, Expired::Header))
        );
        activity.read(t0 + s);
        assert_eq!(
            activity.deadline(&timeouts),
            Some((t0 + 10 * s, Expired::Header)),
            "a trickle of header bytes does not extend it"
        );
        // A request in flight has no connection deadline (a long poll waits as long as it asks).
        let request = activity.begin_request();
        assert_eq!(activity.deadline(&timeouts), None);
        activity.read(t0 + 2 * s);
        assert_eq!(activity.deadline(&timeouts), None, "body bytes");
        drop(request);
        // Answered: idle, and writing the response counts as traffic.
        let idle_from = activity.deadline(&timeouts).unwrap();
        assert_eq!(idle_from.1, Expired::Idle);
        activity.wrote(t0 + 90 * s);
        assert_eq!(
            activity.deadline(&timeouts),
            Some((t0 + 150 * s, Expired::Idle))
        );
        // The next request's first byte starts its header deadline.
        activity.read(t0 + 100 * s);
        assert_eq!(
            activity.deadline(&timeouts),
            Some((t0 + 110 * s, Expired::Header))
        );
        activity.wrote(t0 + 105 * s);
        assert_eq!(
            activity.deadline(&timeouts),
            Some((t0 + 110 * s, Expired::Header)),
            "writes only count while idle"
        );
        let (a, b) = (activity.begin_request(), activity.begin_request());
        drop(a);
        assert!(activity.is_busy(), "one of two still in flight");
        drop(b);
        assert!(!activity.is_busy());
    }
}
