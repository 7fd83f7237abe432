//! Slow-loris clients for tests of the HTTP edge: connections that send the start of a request head and
//! then stall, each reopened as soon as the server closes it, so that the pressure lasts as long as the
//! attack does. One thread polls every socket (non-blocking) and reports what the server did with them.
//! Beside them, [`until_answered`] sends a legitimate client's request through the clean 503s an
//! overloaded server answers with.

use super::{spawn_with_ulimit, Process};
use serde_json::Value;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The start of a request head that never ends.
const PARTIAL_HEAD: &[u8] = b"POST /v1/messages HTTP/1.1\r\nHost: delayd\r\nContent-Type: applica";

/// What the server did with the stalled connections.
#[derive(Debug, Default)]
pub struct Report {
    /// Connections opened (each a stalled request).
    pub opened: u64,
    /// Of those, closed by the server.
    pub closed_by_server: u64,
    /// Of those closed, the ones answered first (a 503 for a connection past the cap: the server reads
    /// a head before it answers, so a stalled one is only closed).
    pub answered: u64,
    /// Connections that could not be opened within 2 s (the server's backlog was full).
    pub connect_failures: u64,
    /// How long each closed connection stayed open, from the connect to the close seen here, in ms
    /// (including any time it waited in the server's listen backlog).
    pub held_ms: Vec<u64>,
    /// When the attack stopped: connections still open, and how many of them the server then closed
    /// within the time given to [`SlowLoris::finish`].
    pub open_at_stop: usize,
    pub closed_after_stop: usize,
}

impl Report {
    /// The `q` quantile of [`Report::held_ms`] (0.0..=1.0).
    pub fn held_quantile(&self, q: f64) -> u64 {
        let mut held = self.held_ms.clone();
        held.sort_unstable();
        held.get(((held.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0)
    }
}

/// A running attack; dropping it stops it (pass or fail) and closes its sockets.
#[derive(Debug)]
pub struct SlowLoris {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Report>>,
    drain_within: Arc<std::sync::Mutex<Duration>>,
}

struct Held {
    stream: TcpStream,
    since: Instant,
    answered: bool,
}

impl SlowLoris {
    /// Keeps `connections` stalled connections open to `address`.
    pub fn start(address: SocketAddr, connections: usize) -> SlowLoris {
        let stop = Arc::new(AtomicBool::new(false));
        let drain_within = Arc::new(std::sync::Mutex::new(Duration::ZERO));
        let thread = {
            let (stop, drain_within) = (stop.clone(), drain_within.clone());
            std::thread::spawn(move || attack(address, connections, &stop, &drain_within))
        };
        SlowLoris {
            stop,
            thread: Some(thread),
            drain_within,
        }
    }

    /// Stops opening connections, then waits up to `within` for the server to close those still
    /// open, and reports.
    pub fn finish(mut self, within: Duration) -> Report {
        *self.drain_within.lock().unwrap() = within;
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for SlowLoris {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Whether the server closed `held` (reading what it sent meanwhile).
fn closed(held: &mut Held) -> bool {
    let mut buffer = [0u8; 1024];
    loop {
        match held.stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => held.answered = true,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return true, // reset
        }
    }
}

fn attack(
    address: SocketAddr,
    connections: usize,
    stop: &AtomicBool,
    drain_within: &std::sync::Mutex<Duration>,
) -> Report {
    let mut report = Report::default();
    let mut held: Vec<Option<Held>> = (0..connections).map(|_| None).collect();
    let note = |held: Held, report: &mut Report| {
        report.closed_by_server += 1;
        report.answered += u64::from(held.answered);
        report.held_ms.push(held.since.elapsed().as_millis() as u64);
    };
    while !stop.load(Ordering::Relaxed) {
        for slot in held.iter_mut() {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            if let Some(h) = slot {
                if closed(h) {
                    note(slot.take().unwrap(), &mut report);
                }
                continue;
            }
            let since = Instant::now();
            match TcpStream::connect_timeout(&address, Duration::from_secs(2)) {
                Ok(mut stream) => {
                    report.opened += 1;
                    let _ = stream.write_all(PARTIAL_HEAD);
                    stream.set_nonblocking(true).unwrap();
                    *slot = Some(Held {
                        stream,
                        since,
                        answered: false,
                    });
                }
                Err(_) => report.connect_failures += 1,
            }
        }
        // Polling pace of the attack (the sockets are non-blocking); not a synchronisation.
        std::thread::sleep(Duration::from_millis(20));
    }
    report.open_at_stop = held.iter().flatten().count();
    let deadline = Instant::now() + *drain_within.lock().unwrap();
    loop {
        for slot in held.iter_mut() {
            if slot.as_mut().is_some_and(closed) {
                note(slot.take().unwrap(), &mut report);
                report.closed_after_stop += 1;
            }
        }
        if held.iter().all(Option::is_none) || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    report
}

/// What [`until_answered`] met on the way to an answer, for the caller to count.
pub enum Met {
    /// A transport error: the request is given up.
    Error(ureq::Error),
    /// A clean 503 `overloaded` with `Retry-After`: retried.
    Overloaded,
    /// A 2xx answer.
    Success,
    /// `go_on` said to stop before an answer came.
    GaveUp,
}

/// Sends until answered with anything but a clean 503 `overloaded` (with `Retry-After`), each of
/// those retried after `pause` (sooner than the Retry-After second: the tests want pressure, not
/// politeness), for as long as `go_on` holds; tells `met` what it met. The answer's status and JSON;
/// None after a transport error or once `go_on` stopped it.
pub fn until_answered(
    mut send: impl FnMut() -> Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    mut go_on: impl FnMut() -> bool,
    pause: Duration,
    mut met: impl FnMut(Met),
) -> Option<(u16, Value)> {
    while go_on() {
        let mut response = match send() {
            Ok(response) => response,
            Err(error) => {
                met(Met::Error(error));
                return None;
            }
        };
        let status = response.status().as_u16();
        let retry_after = response.headers().get("retry-after").is_some();
        let body: Value = response.body_mut().read_json().unwrap_or(Value::Null);
        if status == 503 && body["code"] == "overloaded" && retry_after {
            met(Met::Overloaded);
            std::thread::sleep(pause);
            continue;
        }
        if (200..300).contains(&status) {
            met(Met::Success);
        }
        return Some((status, body));
    }
    met(Met::GaveUp);
    None
}

/// The real binary as the slow-loris tests attack it: under `ulimit -n 256` (soft and hard), with 64
/// descriptors reserved for storage and a 1 s header timeout. (The broker's segments are the default
/// ones: it keeps each commit-log segment open until retention deletes it, so small ones would take
/// this limit's descriptors by themselves, whatever the HTTP edge does.)
pub fn spawn_with_256_fds(dir: &Path) -> Process {
    spawn_with_ulimit(
        dir,
        &[],
        &[
            ("DELAYD_MIN_FREE_DISK_BYTES", "0"),
            ("DELAYD_RESERVED_FDS", "64"),
            ("DELAYD_HEADER_TIMEOUT", "1s"),
        ],
        "-n 256",
    )
}

/// Posts `messages` to the server at `base` through `client` as a legitimate producer does: one
/// alone, more as a batch.
pub fn post_messages(
    client: &ureq::Agent,
    base: &str,
    messages: &[Value],
) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
    if let [message] = messages {
        client
            .post(&format!("{base}/v1/messages"))
            .send_json(message)
    } else {
        client
            .post(&format!("{base}/v1/messages/batch"))
            .send_json(serde_json::json!({ "messages": messages }))
    }
}

/// What a producer's answered post (see [`until_answered`]) acknowledged: a batch's results (200), or
/// the one message's answer (201). None where nothing came (a transport error, recorded already) or
/// another answer, which is given to `other`.
pub fn acknowledged(
    answer: Option<(u16, Value)>,
    other: impl FnOnce(String),
) -> Option<Vec<Value>> {
    match answer {
        Some((200 | 201, answer)) => Some(
            answer["results"]
                .as_array()
                .cloned()
                .unwrap_or_else(|| vec![answer]),
        ),
        Some((status, answer)) => {
            other(format!("{status}: {answer}"));
            None
        }
        None => None,
    }
}
