//! The HTTP edge under slow and numerous clients (`src/edge`): the header, body and idle timeouts, the
//! connection cap with its 503 and its one log line per episode, slow-loris clients against the real
//! binary under a low open-file limit (storage keeps working, every message is delivered on time), the
//! readiness line, and a start refused for too few file descriptors.
//!
//! Timeouts are what these tests measure, so some of them let time pass; they never sleep to wait for
//! something to happen, and their upper bounds leave room for a busy machine.

use super::*;
use common::slowloris::{self, Met, SlowLoris};
use common::{agent, serve_until_exit, spawn_with_env, spawn_with_ulimit};
use std::collections::{HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// One raw HTTP/1.1 connection, for what a client library will not do: stall, trickle, hold it open.
struct Raw {
    stream: TcpStream,
    /// Bytes read and not yet taken by [`Raw::response`].
    buffer: Vec<u8>,
}

/// A response read off a [`Raw`] connection.
#[derive(Debug)]
struct RawResponse {
    status: u16,
    /// The head, lowercased.
    head: String,
    json: Value,
}

impl Raw {
    fn connect(base: &str) -> Raw {
        let stream = TcpStream::connect(base.strip_prefix("http://").unwrap()).unwrap();
        // Reads return every 20 ms, so that each wait below can keep to its deadline.
        stream
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        Raw {
            stream,
            buffer: Vec::new(),
        }
    }

    fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Reads more; Ok(false) once the server closed the connection.
    fn read_more(&mut self) -> std::io::Result<bool> {
        let mut chunk = [0u8; 4096];
        match self.stream.read(&mut chunk) {
            Ok(0) => Ok(false),
            Ok(n) => {
                self.buffer.extend_from_slice(&chunk[..n]);
                Ok(true)
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Ok(true),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The next response, or None when the connection closed or `deadline` passed first.
    fn response(&mut self, deadline: Instant) -> Option<RawResponse> {
        while Instant::now() < deadline {
            if let Some(end) = self.buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buffer[..end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if self.buffer.len() >= end + 4 + length {
                    let body: Vec<u8> = self.buffer.drain(..end + 4 + length).collect();
                    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
                    return Some(RawResponse {
                        status,
                        head,
                        json: serde_json::from_slice(&body[end + 4..]).unwrap_or(Value::Null),
                    });
                }
            }
            if !self.read_more().unwrap() {
                return None;
            }
        }
        None
    }

    /// Whether the server closes the connection before `deadline` (whatever it sends first is kept).
    fn closed_before(&mut self, deadline: Instant) -> bool {
        while Instant::now() < deadline {
            if !self.read_more().unwrap_or(false) {
                return true;
            }
        }
        false
    }
}

fn seconds(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// A stalled head is closed after the header timeout, however its bytes trickle in; a keep-alive
/// connection between requests is not (its idle timeout is longer), and is closed after that.
#[test]
fn heads_must_arrive_within_the_header_timeout_and_idle_connections_last_longer() {
    let server = Server::start(|c| {
        c.limits.header_timeout = config_ms(1_000);
        c.limits.idle_timeout = config_ms(3_000);
    });
    // Silent: no byte at all.
    let mut silent = Raw::connect(&server.base);
    let started = Instant::now();
    // A head trickling in a byte every 100 ms: it would take 4 s.
    let mut trickle = Raw::connect(&server.base);
    let head = b"GET /healthz HTTP/1.1\r\nHost: delayd\r\nX-Slow: aaaaaaaa\r\n\r\n";
    let mut writer = trickle.stream.try_clone().unwrap();
    let trickler = std::thread::spawn(move || {
        for byte in head {
            if writer.write_all(&[*byte]).is_err() {
                return; // closed by the server
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    // A keep-alive connection: a request, then 1.5 s of nothing (past the header timeout), then another.
    let mut kept = Raw::connect(&server.base);
    let get = b"GET /healthz HTTP/1.1\r\nHost: delayd\r\n\r\n";
    kept.send(get).unwrap();
    assert_eq!(
        kept.response(Instant::now() + seconds(5.0)).unwrap().status,
        200
    );
    let first_answer = Instant::now();

    assert!(silent.closed_before(started + seconds(3.0)));
    let silent_after = started.elapsed();
    assert!(trickle.closed_before(started + seconds(3.0)));
    let trickle_after = started.elapsed();
    assert!(
        trickle.buffer.is_empty(),
        "closed without an answer: {:?}",
        String::from_utf8_lossy(&trickle.buffer)
    );
    trickler.join().unwrap();
    for (what, after) in [("silent", silent_after), ("trickling", trickle_after)] {
        assert!(
            after >= seconds(0.9) && after < seconds(3.0),
            "{what} head closed after {after:?}"
        );
    }

    // 1.5 s after the first answer (past the header timeout), the idle connection is still open.
    std::thread::sleep((first_answer + seconds(1.5)).saturating_duration_since(Instant::now()));
    kept.send(get).unwrap();
    let answered = Instant::now();
    assert_eq!(
        kept.response(answered + seconds(5.0))
            .expect("an idle keep-alive connection outlives the header timeout")
            .status,
        200
    );
    assert!(kept.closed_before(answered + seconds(6.0)));
    let idle_after = answered.elapsed();
    assert!(
        idle_after >= seconds(2.9) && idle_after < seconds(6.0),
        "idle connection closed after {idle_after:?}"
    );
}

fn config_ms(ms: u64) -> delayd::config::Millis {
    delayd::config::Millis(Duration::from_millis(ms))
}

/// A body slower than the body timeout is answered 408 `request_timeout` and its connection closed,
/// nothing stored; a slow body that completes in time is accepted.
#[test]
fn a_request_body_must_arrive_within_the_body_timeout() {
    let server = Server::start(|c| c.limits.body_timeout = config_ms(1_000));
    let message = json!({"topic": "edge.body", "body": "slow", "delay": "1h"}).to_string();
    let head = |length: usize| {
        format!(
            "POST /v1/messages HTTP/1.1\r\nHost: delayd\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        )
    };
    // Too slow: a byte every 100 ms would take seconds.
    let mut slow = Raw::connect(&server.base);
    slow.send(head(message.len()).as_bytes()).unwrap();
    let sent_head = Instant::now();
    let mut writer = slow.stream.try_clone().unwrap();
    let body = message.clone().into_bytes();
    let trickler = std::thread::spawn(move || {
        for byte in body {
            if writer.write_all(&[byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let answer = slow
        .response(sent_head + seconds(5.0))
        .expect("an answer to the slow body");
    let after = sent_head.elapsed();
    assert_eq!(
        (answer.status, answer.json["code"].as_str()),
        (408, Some("request_timeout")),
        "{answer:?}"
    );
    assert!(answer
        .head
        .contains("content-type: application/problem+json"));
    assert!(answer.head.contains("connection: close"), "{}", answer.head);
    assert!(
        after >= seconds(0.9) && after < seconds(3.0),
        "answered after {after:?}"
    );
    assert!(slow.closed_before(Instant::now() + seconds(3.0)));
    trickler.join().unwrap();

    // Slow but in time: the body in five parts over about half a second.
    let mut in_time = Raw::connect(&server.base);
    in_time.send(head(message.len()).as_bytes()).unwrap();
    for part in message.as_bytes().chunks(message.len().div_ceil(5)) {
        std::thread::sleep(Duration::from_millis(100));
        in_time.send(part).unwrap();
    }
    let answer = in_time.response(Instant::now() + seconds(5.0)).unwrap();
    assert_eq!(answer.status, 201, "{answer:?}");
    // Only that one was stored.
    let id = answer.json["id"].as_str().unwrap();
    assert_eq!(
        server.call("GET", &format!("/v1/messages/{id}"), None).json["status"],
        "scheduled"
    );
}

/// Counts the lines of a log that contain `needle`.
fn lines_with(log: &str, needle: &str) -> usize {
    log.lines().filter(|l| l.contains(needle)).count()
}

/// Waits until the child's log has `count` lines with `needle`, then returns that log.
fn wait_for_log(process: &common::Process, needle: &str, count: usize) -> String {
    let deadline = Instant::now() + seconds(10.0);
    loop {
        let log = process.stdout_so_far();
        if lines_with(&log, needle) >= count || Instant::now() > deadline {
            return log;
        }
        // The log is a file the test's reader thread appends to; no event to wait on.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// With `limits.max_connections` connections open, the next ones are answered 503 `overloaded` with
/// `Retry-After` and closed (their readiness probe is answered as usual), with one log line per
/// episode; below the cap again, connections are served.
#[test]
fn past_the_connection_cap_new_connections_get_503_and_one_log_line_per_episode() {
    const CAP: usize = 4;
    const REACHED: &str = "connection cap reached";
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_with_env(
        dir.path(),
        &[],
        &[
            ("DELAYD_MIN_FREE_DISK_BYTES", "0"),
            ("DELAYD_MAX_CONNECTIONS", "4"),
            ("RUST_LOG", "info"),
        ],
    );
    let get = b"GET /healthz HTTP/1.1\r\nHost: delayd\r\n\r\n";
    // Each step's own deadline: on a busy machine the whole test may take longer than one would.
    let within = || Instant::now() + seconds(30.0);
    // The cap's worth of keep-alive connections, each answered (so each is being served).
    let mut held: Vec<Raw> = (0..CAP)
        .map(|_| {
            let mut raw = Raw::connect(&process.base);
            raw.send(get).unwrap();
            assert_eq!(raw.response(within()).unwrap().status, 200);
            raw
        })
        .collect();
    let refused_request = |path: &str| {
        let mut raw = Raw::connect(&process.base);
        raw.send(format!("GET {path} HTTP/1.1\r\nHost: delayd\r\n\r\n").as_bytes())
            .unwrap();
        let answer = raw.response(within()).expect("an answer past the cap");
        assert!(raw.closed_before(within()), "closed after the answer");
        answer
    };
    for _ in 0..3 {
        let answer = refused_request("/v1/topics");
        assert_eq!(
            (answer.status, answer.json["code"].as_str()),
            (503, Some("overloaded")),
            "{answer:?}"
        );
        assert!(answer.head.contains("retry-after: 1"), "{}", answer.head);
        assert!(answer.head.contains("application/problem+json"));
    }
    let probe = refused_request("/readyz");
    assert_eq!(
        (probe.status, &probe.json),
        (200, &json!({"status": "ready"})),
        "a readiness probe past the cap is answered"
    );
    // So is a scrape: monitoring sees the node busy, not down (and sees the refusals).
    let scraped = refused_request("/metrics");
    assert_eq!(scraped.status, 200, "{scraped:?}");
    let log = wait_for_log(&process, REACHED, 1);
    assert_eq!(
        lines_with(&log, REACHED),
        1,
        "one line for 4 refusals:\n{log}"
    );

    // Two close: the next connection is served (it may take the server a moment to see the closes).
    held.truncate(CAP - 2);
    let deadline = within();
    let served = loop {
        let answer = agent(seconds(10.0))
            .get(&format!("{}/v1/sinks", process.base))
            .call()
            .unwrap();
        if answer.status() == 200 {
            break answer;
        }
        assert!(Instant::now() < deadline, "never below the cap again");
        // The server sees the two closes in a moment; meanwhile this is refused.
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(served);
    let series = scrape(&process.base);
    assert!(
        series["delayd_http_connections_refused_total"] >= 4.0,
        "{series:#?}"
    );
    assert_eq!(series["delayd_http_connections_max"], CAP as f64);
    let log = wait_for_log(&process, "below the connection cap again", 1);
    assert_eq!(lines_with(&log, REACHED), 1, "{log}");

    // Back at the cap: a second episode, a second line. (Not /healthz: past the cap, that is answered.)
    let mut again: Vec<Raw> = (0..CAP)
        .map(|_| {
            let mut raw = Raw::connect(&process.base);
            raw.send(b"GET /v1/topics HTTP/1.1\r\nHost: delayd\r\n\r\n")
                .unwrap();
            raw
        })
        .collect();
    let answers: Vec<u16> = again
        .iter_mut()
        .map(|raw| raw.response(within()).unwrap().status)
        .collect();
    assert!(answers.contains(&503), "{answers:?}");
    let log = wait_for_log(&process, REACHED, 2);
    assert_eq!(lines_with(&log, REACHED), 2, "{log}");
}

/// `delayd serve` says it is ready once storage is open and connections are accepted: after the
/// address line and the "recovery done" log line, and `/readyz` agrees at once. It starts with its soft
/// open-file limit raised to the hard one (with a soft limit of 200 and the default reserve of 256
/// descriptors for storage, it could not start otherwise).
#[test]
fn serve_prints_readiness_once_storage_is_open_and_raises_its_fd_limit() {
    let dir = tempfile::tempdir().unwrap();
    let hard = rlimit::getrlimit(rlimit::Resource::NOFILE).unwrap().1;
    assert!(
        hard >= 2048,
        "the test needs a hard open-file limit of 2048 or more, not {hard}"
    );
    let process = spawn_with_ulimit(
        dir.path(),
        &[],
        &[("DELAYD_MIN_FREE_DISK_BYTES", "0"), ("RUST_LOG", "info")],
        "-S -n 200",
    );
    let deadline = Instant::now() + seconds(10.0);
    let mut before = Vec::new();
    let ready = loop {
        let line = process
            .next_line_before(deadline)
            .expect("a readiness line");
        if line.starts_with("delayd ready on ") {
            break line;
        }
        before.push(line);
    };
    assert_eq!(ready, format!("delayd ready on {}", process.base));
    assert!(
        before.iter().any(|l| l.contains("recovery done")),
        "storage was open first: {before:#?}"
    );
    assert!(
        before
            .iter()
            .any(|l| l.contains("raised the open-file limit") && l.contains(&format!("to={hard}"))),
        "{before:#?}"
    );
    let readyz = request(&process.base, "GET", "/readyz", None, None);
    assert_eq!(readyz.status, 200);
    assert_eq!(scrape(&process.base)["delayd_max_fds"], hard as f64);
}

/// An open-file limit too low to serve beside storage's reserve is refused at start, clearly.
#[test]
fn a_start_with_too_few_file_descriptors_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let (status, stderr) = serve_until_exit(
        dir.path(),
        &[],
        &[("DELAYD_MIN_FREE_DISK_BYTES", "0")],
        "-n 128",
        seconds(30.0),
    );
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{stderr}");
    assert!(
        stderr.contains("open-file limit (RLIMIT_NOFILE) of 128")
            && stderr.contains("limits.reserved_fds (256)"),
        "{stderr}"
    );
}

/// What the legitimate clients of the slow-loris test saw.
#[derive(Debug, Default)]
struct Legitimate {
    /// Acknowledged message id → its due time (ms).
    acked: HashMap<String, i64>,
    answered_2xx: u64,
    /// 503 `overloaded` with `Retry-After`, each retried.
    overloaded: u64,
    probes_ready: u64,
    /// Anything else: the test fails on it.
    other: Vec<String>,
}

/// Records something the slow-loris test fails on.
fn record_other(legit: &Mutex<Legitimate>, what: String) {
    legit.lock().unwrap().other.push(what);
}

/// [`slowloris::until_answered`] for up to a minute, counted in `legit` (a minute without an answer
/// too).
fn until_answered(
    legit: &Mutex<Legitimate>,
    request: impl FnMut() -> Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Option<(u16, Value)> {
    let deadline = Instant::now() + seconds(60.0);
    let go_on = || Instant::now() < deadline;
    // The answer said to come back in a second; a tenth of it keeps the test short.
    let pause = Duration::from_millis(100);
    slowloris::until_answered(request, go_on, pause, |met| {
        let mut seen = legit.lock().unwrap();
        match met {
            Met::Error(error) => seen.other.push(error.to_string()),
            Met::Overloaded => seen.overloaded += 1,
            Met::Success => seen.answered_2xx += 1,
            Met::GaveUp => seen.other.push("never answered".into()),
        }
    })
}

/// Slow-loris clients against the real binary under a low open-file limit (256, soft and hard): they
/// hold more connections than the limit allows, and keep reopening them. Meanwhile producers (on fresh
/// connections, and on keep-alive ones), a consumer and a readiness probe get 2xx or a clean 503;
/// every acknowledged message is delivered, none early; `/readyz` answers 200 throughout; storage
/// never runs out of descriptors; the stalled connections are closed after the header timeout.
#[test]
fn slow_loris_clients_against_a_low_fd_limit_leave_storage_and_requests_working() {
    const ATTACKERS: usize = 300;
    const HEADER_TIMEOUT_S: f64 = 1.0;
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let process = slowloris::spawn_with_256_fds(dir.path());
    let address = process
        .base
        .strip_prefix("http://")
        .unwrap()
        .parse()
        .unwrap();
    let attack = SlowLoris::start(address, ATTACKERS);
    let legit = Arc::new(Mutex::new(Legitimate::default()));
    let base = process.base.clone();
    let stop_probing = Arc::new(AtomicBool::new(false));
    let prober = {
        let (legit, base, stop) = (legit.clone(), base.clone(), stop_probing.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // A fresh connection each time, as an orchestrator's probe.
                match agent(seconds(30.0)).get(&format!("{base}/readyz")).call() {
                    Ok(r) if r.status() == 200 => legit.lock().unwrap().probes_ready += 1,
                    Ok(r) => record_other(&legit, format!("/readyz {}", r.status())),
                    Err(e) => record_other(&legit, format!("/readyz {e}")),
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // Producers: two on a fresh connection per request, one on a keep-alive connection, one sending
    // batches of 20 on a keep-alive connection; each message due 1.5 s after it is sent.
    let producers: Vec<_> = (0..4)
        .map(|p| {
            let (legit, base) = (legit.clone(), base.clone());
            std::thread::spawn(move || {
                let kept = agent(seconds(30.0));
                let (requests, per_request) = match p {
                    0 | 1 => (15, 1),
                    2 => (50, 1),
                    _ => (10, 20),
                };
                for r in 0..requests {
                    let messages: Vec<Value> = (0..per_request)
                        .map(|m| json!({"topic": "edge.loris", "body": format!("p{p}-{r}-{m}"), "delay": 1500}))
                        .collect();
                    let answer = until_answered(&legit, || {
                        let client = if p < 2 { agent(seconds(30.0)) } else { kept.clone() };
                        slowloris::post_messages(&client, &base, &messages)
                    });
                    let other = |what| record_other(&legit, what);
                    let Some(results) = slowloris::acknowledged(answer, other) else {
                        return;
                    };
                    let mut seen = legit.lock().unwrap();
                    for result in results {
                        let id = result["id"].as_str().unwrap().to_string();
                        seen.acked.insert(id, parse(&result["deliver_at"]));
                    }
                }
            })
        })
        .collect();
    for producer in producers {
        producer.join().unwrap();
    }
    let produced_in = started.elapsed();
    // The consumer, on a keep-alive connection, while the attack goes on.
    let expected: HashMap<String, i64> = legit.lock().unwrap().acked.clone();
    let consumer = agent(seconds(30.0));
    let mut offsets = [0u64; 4];
    let mut lateness_ms: Vec<i64> = Vec::new();
    let mut early = Vec::new();
    let mut seen = HashSet::new();
    let deadline = Instant::now() + seconds(60.0);
    while expected.keys().any(|id| !seen.contains(id)) && Instant::now() < deadline {
        for (queue, offset) in offsets.iter_mut().enumerate() {
            let path = format!(
                "{base}/v1/topics/edge.loris/queues/{queue}/messages?offset={offset}&max=512&wait_ms=200"
            );
            let answer = match until_answered(&legit, || consumer.get(&path).call()) {
                Some((200, answer)) => answer,
                // The topic exists once the first delivery is stored.
                Some((404, _)) => continue,
                Some((status, answer)) => {
                    record_other(&legit, format!("{status}: {answer}"));
                    continue;
                }
                None => continue,
            };
            for message in answer["messages"].as_array().unwrap() {
                let (due, delivered) = (
                    parse(&message["deliver_at"]),
                    parse(&message["delivered_at"]),
                );
                if delivered < due {
                    early.push(message.clone());
                }
                lateness_ms.push(delivered - due);
                seen.insert(message["id"].as_str().unwrap().to_string());
            }
            *offset = answer["next_offset"].as_u64().unwrap();
        }
    }
    stop_probing.store(true, Ordering::Relaxed);
    prober.join().unwrap();
    let attacked_for = started.elapsed();
    // Stalled connections still open must be closed within the header timeout (plus a refusal's
    // half second, and time for a busy machine).
    let report = attack.finish(seconds(HEADER_TIMEOUT_S + 3.0));
    let series = scrape(&process.base);
    let legit = legit.lock().unwrap();
    lateness_ms.sort_unstable();
    let quantile = |q: f64| lateness_ms[((lateness_ms.len() - 1) as f64 * q).round() as usize];
    println!(
        "slow loris ({ATTACKERS} stalled connections kept open, fd limit 256, cap {}): {} opened, {} closed by the server \
         (held p50 {} ms, max {} ms; {} answered); {} legitimate 2xx, {} clean 503 retried, {} probes 200; \
         {} messages acknowledged in {:.1} s, all delivered; lateness p50 {} ms, p99 {} ms, max {} ms; attack {:.1} s",
        series["delayd_http_connections_max"],
        report.opened,
        report.closed_by_server,
        report.held_quantile(0.5),
        report.held_quantile(1.0),
        report.answered,
        legit.answered_2xx,
        legit.overloaded,
        legit.probes_ready,
        expected.len(),
        produced_in.as_secs_f64(),
        quantile(0.5),
        quantile(0.99),
        quantile(1.0),
        attacked_for.as_secs_f64(),
    );
    assert!(
        legit.other.is_empty(),
        "not 2xx nor a clean 503: {:?}",
        legit.other
    );
    assert_eq!(expected.len(), 2 * 15 + 50 + 10 * 20);
    let lost: Vec<_> = expected.keys().filter(|id| !seen.contains(*id)).collect();
    assert!(lost.is_empty(), "acknowledged, never delivered: {lost:?}");
    assert!(early.is_empty(), "delivered early: {early:?}");
    assert!(legit.probes_ready > 0);
    // The attack did press: more stalled connections than the limit allows, refusals, header timeouts.
    assert!(
        series["delayd_http_connections_max"] < ATTACKERS as f64,
        "{series:#?}"
    );
    assert!(series["delayd_http_connections_refused_total"] > 0.0);
    assert!(
        series[r#"delayd_http_timeouts_total{phase="header"}"#] >= ATTACKERS as f64,
        "{series:#?}"
    );
    assert_eq!(series["delayd_max_fds"], 256.0);
    assert_eq!(
        report.closed_after_stop, report.open_at_stop,
        "every stalled connection is closed by the server: {report:?}"
    );
    // Storage never ran out of descriptors.
    assert_eq!(series["delayd_read_errors_total"], 0.0);
    assert_eq!(series["delayd_wal_poisoned_total"], 0.0);
    let log = process.stdout_so_far() + &process.output_tail(1000);
    assert!(
        !log.contains("os error 24") && !log.contains("Too many open files"),
        "{log}"
    );
}
