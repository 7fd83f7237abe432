//! Integration tests: the real service on a loopback port (in-process through `delayd::run`, or the real
//! binary where a process must die, through `common::spawn`), real files, real HTTP. All in one binary so
//! they link once; the crash soak has a binary of its own (`tests/soak.rs`) so that it never runs beside
//! these parallel tests.

#![allow(clippy::unwrap_used, reason = "tests stop at the first failure")]

#[path = "../common/mod.rs"]
mod common;
mod console;
mod deploy;
mod disk;
mod edge;
mod exactly_once;
mod listing;
mod openapi;
mod retention;
mod schedule_cli;
mod schedules;
mod sidecar_amqp;
mod sidecar_kafka;
mod sidecar_nats;
mod sidecar_redis;
mod webhook;

use common::{now_ms, parse, request, scrape, settled_message, spawn, spawn_cli, Answer};
use delayd::schedulelog::Clock;
use serde_json::{json, Value};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A tokio runtime with `workers` threads and a listener on a free loopback port.
fn runtime_and_listener(workers: usize) -> (tokio::runtime::Runtime, tokio::net::TcpListener) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    (runtime, listener)
}

/// Pulls one page of `topic`'s `queue` from `offset` (`page`: the rest of the query, `max` and
/// `wait_ms`), counting each message's id in `seen` and checking that none was delivered before it
/// was due; moves `offset` past the page. A topic that does not exist yet (404: nothing of it was
/// delivered yet) has no page.
fn pull_counting(
    base: &str,
    topic: &str,
    queue: usize,
    offset: &mut u64,
    page: &str,
    seen: &mut std::collections::BTreeMap<String, u32>,
) {
    let path = format!("/v1/topics/{topic}/queues/{queue}/messages?offset={offset}&{page}");
    let answer = request(base, "GET", &path, None, None);
    if answer.status == 404 {
        return;
    }
    assert_eq!(answer.status, 200, "{}", answer.json);
    for message in answer.json["messages"].as_array().unwrap() {
        assert!(
            parse(&message["delivered_at"]) >= parse(&message["deliver_at"]),
            "never early"
        );
        *seen
            .entry(message["id"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    *offset = answer.json["next_offset"].as_u64().unwrap();
}

/// The service running in-process on port 0.
struct Server {
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
    _dir: Option<tempfile::TempDir>,
}

impl Server {
    fn start(edit: impl FnOnce(&mut delayd::config::Config)) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let mut server = Server::start_in(dir.path(), edit);
        server._dir = Some(dir);
        server
    }

    /// A server on an existing data dir (to restart one).
    fn start_in(
        data_dir: &std::path::Path,
        edit: impl FnOnce(&mut delayd::config::Config),
    ) -> Server {
        Server::start_with_clock(data_dir, Arc::new(delayd::scheduler::SystemClock), edit)
    }

    /// A server whose time comes from `clock` (a manual clock runs hours in seconds).
    fn start_with_clock(
        data_dir: &std::path::Path,
        clock: Arc<dyn Clock>,
        edit: impl FnOnce(&mut delayd::config::Config),
    ) -> Server {
        let mut config =
            delayd::config::Config::load(None, Vec::new(), &delayd::config::Flags::default())
                .unwrap();
        config.data_dir = data_dir.to_path_buf();
        config.broker.queues_per_topic = 1;
        // How full the test machine's disk is must not decide tests that are not about it.
        config.limits.min_free_disk_bytes = 0;
        edit(&mut config);
        let (runtime, listener) = runtime_and_listener(2);
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime.block_on(delayd::run_with_clock(config, listener, clock, async {
                let _ = stopped.await;
            }))
        });
        Server {
            base,
            stop: Some(stop),
            thread: Some(thread),
            _dir: None,
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Answer {
        request(
            &self.base,
            method,
            path,
            body.map(|b| b.to_string()).as_deref(),
            None,
        )
    }

    /// Schedules `messages` in one batch request: its answer, which must be a 200 (the batch was
    /// read; each result says how its message fared).
    fn batch(&self, messages: &[Value]) -> Answer {
        let answer = self.call(
            "POST",
            "/v1/messages/batch",
            Some(json!({ "messages": messages })),
        );
        assert_eq!(answer.status, 200, "{}", answer.json);
        answer
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap().unwrap();
        }
    }
}

#[test]
fn a_message_is_invisible_before_deliver_at_and_visible_after() {
    let server = Server::start(|_| {});
    // The body and key have JSON escapes (parsed into copies), the topic none (borrowed from the request).
    let body = "order 42 \"unpaid\"\n\u{1F4E6} 5 €";
    let sent = server.call("POST", "/v1/messages", Some(json!({"topic": "orders.timeout", "body": body, "delay": "800ms", "key": "order\t42", "headers": {"traceparent": "00-abc"}})));
    assert_eq!(sent.status, 201, "{}", sent.json);
    assert_eq!(sent.json["status"], "scheduled");
    let id = sent.json["id"].as_str().unwrap().to_string();
    // Before deliver_at: not in the broker (the topic does not even exist yet).
    assert_eq!(
        server.call("GET", "/v1/topics/orders.timeout", None).status,
        404
    );
    assert_eq!(
        server.call("GET", &format!("/v1/messages/{id}"), None).json["status"],
        "scheduled"
    );
    // Long poll until it arrives.
    let pulled = server.call(
        "GET",
        "/v1/topics/orders.timeout/queues/0/messages?offset=0&wait_ms=10000",
        None,
    );
    let arrived_ms = now_ms();
    assert_eq!(pulled.status, 200, "{}", pulled.json);
    let message = &pulled.json["messages"][0];
    assert_eq!(message["id"], json!(id));
    assert_eq!(message["body"], body);
    assert_eq!(message["key"], "order\t42");
    assert_eq!(message["headers"]["traceparent"], "00-abc");
    let deliver_at = parse(&message["deliver_at"]);
    let delivered_at = parse(&message["delivered_at"]);
    assert!(delivered_at >= deliver_at, "never early");
    assert!(arrived_ms >= deliver_at);
    println!(
        "lateness: delivered {} ms after deliver_at; visible to the consumer {} ms after",
        delivered_at - deliver_at,
        arrived_ms - deliver_at
    );
    assert!(delivered_at - deliver_at < 2_000, "loosely prompt");
    let status = settled_message(&server.base, &id);
    assert_eq!(status.json["status"], "delivered");
    assert_eq!(status.json["attempts"], 1);
    // One delivery, one time, wherever it is read.
    assert_eq!(status.json["delivered_at"], message["delivered_at"]);
    // Cancelling a delivered message is a conflict.
    let cancel = server.call("DELETE", &format!("/v1/messages/{id}"), None);
    cancel.assert_problem(409, "already_delivered");
}

/// A delay is read as people write it: `1m30s` is ninety seconds, also over HTTP.
#[test]
fn a_compound_delay_is_read_as_written() {
    let server = Server::start(|_| {});
    let before = now_ms();
    let sent = server.call(
        "POST",
        "/v1/messages",
        Some(json!({"topic": "t", "body": "x", "delay": "1m30s"})),
    );
    let after = now_ms();
    assert_eq!(sent.status, 201, "{}", sent.json);
    let deliver_at = parse(&sent.json["deliver_at"]);
    assert!(
        (before + 90_000..=after + 90_000).contains(&deliver_at),
        "{before} {deliver_at} {after}"
    );
    let wrong = server.call(
        "POST",
        "/v1/messages",
        Some(json!({"topic": "t", "body": "x", "delay": "30s1m"})),
    );
    wrong.assert_problem(400, "invalid_delay");
}

#[test]
fn a_binary_body_is_pulled_as_base64_and_a_text_one_as_text() {
    let server = Server::start(|_| {});
    let sent = server.call(
        "POST",
        "/v1/messages/batch",
        Some(json!({"messages": [
            {"topic": "bin", "body_base64": "AAEC/w==", "delay": 0},
            {"topic": "bin", "body": "text", "delay": 0, "key": "k"},
        ]})),
    );
    assert_eq!(sent.status, 200, "{}", sent.json);
    let ids: Vec<String> = (0..2)
        .map(|i| {
            let id = sent.json["results"][i]["id"].as_str();
            id.unwrap_or_else(|| panic!("result {i} has no id: {}", sent.json))
                .to_string()
        })
        .collect();
    let mut messages = Vec::new();
    let mut answer = Value::Null;
    common::wait_for("both delivered", Duration::from_secs(10), || {
        let pulled = server.call(
            "GET",
            "/v1/topics/bin/queues/0/messages?offset=0&wait_ms=1000",
            None,
        );
        answer = pulled.json;
        messages = answer["messages"].as_array().cloned().unwrap_or_default();
        ids.iter()
            .all(|id| messages.iter().any(|m| m["id"] == id.as_str()))
    });
    // Each object's keys, sorted: what is there, and that nothing is there as null.
    let keys = |v: &Value| -> Vec<String> {
        let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    };
    // The answer itself: the messages, where to read next, none skipped.
    assert_eq!(
        keys(&answer),
        ["messages", "next_offset", "skipped"],
        "{answer}"
    );
    assert_eq!(
        (&answer["next_offset"], &answer["skipped"]),
        (&json!(2), &json!(0))
    );
    // The message sent `i`th.
    let sent_as = |i: usize| {
        messages
            .iter()
            .find(|m| m["id"] == ids[i].as_str())
            .unwrap()
    };
    let binary = sent_as(0);
    assert_eq!(binary["body_base64"], "AAEC/w==");
    // No key given: none in the answer (not null); no `body` beside `body_base64`.
    let binary_keys = [
        "attempt",
        "body_base64",
        "deliver_at",
        "delivered_at",
        "headers",
        "id",
        "offset",
        "topic",
    ];
    assert_eq!(keys(binary), binary_keys, "{binary}");
    let text = sent_as(1);
    assert_eq!(text["body"], "text");
    let text_keys = [
        "attempt",
        "body",
        "deliver_at",
        "delivered_at",
        "headers",
        "id",
        "key",
        "offset",
        "topic",
    ];
    assert_eq!(keys(text), text_keys, "{text}");
    assert_eq!((&text["key"], &text["attempt"]), (&json!("k"), &json!(0)));
}

#[test]
fn a_long_poll_returns_as_soon_as_a_message_arrives() {
    let server = Server::start(|_| {});
    assert_eq!(
        server
            .call(
                "POST",
                "/v1/messages",
                Some(json!({"topic": "t", "body": "first", "delay": 0}))
            )
            .status,
        201
    );
    let first = server.call(
        "GET",
        "/v1/topics/t/queues/0/messages?offset=0&wait_ms=10000",
        None,
    );
    assert_eq!(first.json["next_offset"], 1);
    let base = server.base.clone();
    let started = Instant::now();
    let poll = std::thread::spawn(move || {
        request(
            &base,
            "GET",
            "/v1/topics/t/queues/0/messages?offset=1&wait_ms=20000",
            None,
            None,
        )
    });
    // The poll is parked on an empty queue; a new message wakes it.
    assert_eq!(
        server
            .call(
                "POST",
                "/v1/messages",
                Some(json!({"topic": "t", "body": "second", "delay": "300ms"}))
            )
            .status,
        201
    );
    let answer = poll.join().unwrap();
    let answered_ms = now_ms();
    let waited = started.elapsed();
    assert_eq!(answer.json["messages"][0]["body"], "second");
    assert_eq!(answer.json["next_offset"], 2);
    println!("long poll answered after {waited:?} (message due after 300 ms; the poll would have waited 20 s)");
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    // Woken by the arrival: the answer follows the broker's store of the message closely, not a
    // polling period or the end of the wait.
    let stored_ms = parse(&answer.json["messages"][0]["delivered_at"]);
    println!(
        "answered {} ms after the message was stored",
        answered_ms - stored_ms
    );
    assert!(
        answered_ms - stored_ms < 1_000,
        "answered {} ms after the arrival",
        answered_ms - stored_ms
    );
    // A poll with nothing to wake it waits out its time and answers empty.
    let started = Instant::now();
    let empty = server.call(
        "GET",
        "/v1/topics/t/queues/0/messages?offset=2&wait_ms=300",
        None,
    );
    assert_eq!(empty.json["messages"], json!([]));
    assert!(started.elapsed() >= Duration::from_millis(300));
}

#[test]
fn batches_status_cancel_and_group_offsets() {
    let server = Server::start(|_| {});
    let batch = server.call(
        "POST",
        "/v1/messages/batch",
        Some(json!({"messages": [
            {"topic": "b", "body": "one", "delay": "1h"},
            {"topic": "b/..", "body": "bad", "delay": "1h"},
            {"topic": "b", "body_base64": "AAEC", "deliver_at": now_ms() + 3_600_000},
            {"topic": "b", "body": "level", "delay_level": 3},
        ]})),
    );
    assert_eq!(batch.status, 200);
    let results = batch.json["results"].as_array().unwrap();
    assert_eq!(results.len(), 4);
    assert_eq!(results[0]["status"], "scheduled");
    assert_eq!(results[1]["error"]["code"], "invalid_topic");
    assert_eq!(results[2]["status"], "scheduled");
    let id = results[0]["id"].as_str().unwrap();
    let cancelled = server.call("DELETE", &format!("/v1/messages/{id}"), None);
    assert_eq!(
        (cancelled.status, &cancelled.json),
        (200, &json!({"id": id, "status": "cancelled"}))
    );
    assert_eq!(
        server.call("GET", &format!("/v1/messages/{id}"), None).json["status"],
        "cancelled"
    );
    assert_eq!(
        server
            .call("DELETE", &format!("/v1/messages/{id}"), None)
            .status,
        200,
        "idempotent"
    );

    // Offsets only for a queue that exists, and not past its end.
    let put = |topic: &str, queue: u32, offset: u64| {
        server.call(
            "PUT",
            &format!("/v1/groups/g1/offsets/{topic}/{queue}"),
            Some(json!({ "offset": offset })),
        )
    };
    assert_eq!(put("offsets.t", 0, 0).status, 404, "no such topic yet");
    let sent = server.call(
        "POST",
        "/v1/messages",
        Some(json!({"topic": "offsets.t", "body": "x", "delay": 0})),
    );
    assert_eq!(sent.status, 201);
    let pulled = server.call(
        "GET",
        "/v1/topics/offsets.t/queues/0/messages?offset=0&wait_ms=10000",
        None,
    );
    assert_eq!(pulled.json["next_offset"], 1, "{}", pulled.json);
    assert_eq!(
        put("offsets.t", 1, 0).status,
        404,
        "the topic has one queue"
    );
    let past = put("offsets.t", 0, 13);
    past.assert_problem(400, "invalid_offset");
    let stored = put("offsets.t", 0, 1);
    assert_eq!(stored.status, 200, "{}", stored.json);
    let got = server.call("GET", "/v1/groups/g1/offsets/offsets.t", None);
    assert_eq!(got.json, json!({"queues": [{"queue": 0, "offset": 1}]}));
    let metrics = request(&server.base, "GET", "/metrics", None, None);
    assert_eq!(metrics.status, 200);
    assert_eq!(
        request(&server.base, "GET", "/healthz", None, None).status,
        200
    );
    assert_eq!(
        request(&server.base, "GET", "/readyz", None, None).status,
        200
    );
}

#[test]
fn every_class_of_bad_input_gets_its_code() {
    let token = "a-long-enough-test-token";
    let server = Server::start(|c| {
        c.limits.max_message_bytes = 1000;
        c.limits.max_request_bytes = 64 * 1024;
        c.auth.tokens = vec![token.to_string()];
    });
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        ("POST", "/v1/messages", "{".into(), 400, "invalid_json"),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": 5, "delay": 1}"#.into(),
            400,
            "invalid_json",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "delay": "1s", "surprise": 1}"#.into(),
            400,
            "invalid_json",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "delay": "1s", "deliver_at": 5}"#.into(),
            400,
            "conflicting_time_fields",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x"}"#.into(),
            400,
            "missing_deliver_time",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "delay": "800d"}"#.into(),
            400,
            "delay_too_long",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "delay": "soon"}"#.into(),
            400,
            "invalid_delay",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "delay": -5}"#.into(),
            400,
            "invalid_delay",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "deliver_at": 1.5}"#.into(),
            400,
            "invalid_json",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "delay": 18446744073709551615}"#.into(),
            400,
            "invalid_json",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "deliver_at": "tomorrow"}"#.into(),
            400,
            "invalid_deliver_at",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "delay_level": 19}"#.into(),
            400,
            "invalid_delay_level",
        ),
        (
            "POST",
            "/v1/messages",
            format!(
                r#"{{"topic": "t", "body": "{}", "delay": 1}}"#,
                "x".repeat(1001)
            ),
            413,
            "payload_too_large",
        ),
        (
            "POST",
            "/v1/messages",
            format!(
                r#"{{"topic": "t", "body": "{}", "delay": 1}}"#,
                "x".repeat(70_000)
            ),
            413,
            "payload_too_large",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "a/b", "body": "x", "delay": 1}"#.into(),
            400,
            "invalid_topic",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "..", "body": "x", "delay": 1}"#.into(),
            400,
            "invalid_topic",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "", "body": "x", "delay": 1}"#.into(),
            400,
            "invalid_topic",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "delay": 1, "sink": "nope"}"#.into(),
            400,
            "unknown_sink",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body_base64": "!!", "delay": 1}"#.into(),
            400,
            "invalid_body",
        ),
        (
            "POST",
            "/v1/messages",
            r#"{"topic": "t", "body": "x", "delay": 1, "headers": {"a b": "c"}}"#.into(),
            400,
            "invalid_header",
        ),
        (
            "GET",
            "/v1/messages/aaaadsgboqaaaaaaaaaaaai",
            String::new(),
            404,
            "not_found",
        ),
        (
            "GET",
            "/v1/messages/not-an-id",
            String::new(),
            404,
            "not_found",
        ),
        (
            "DELETE",
            "/v1/messages/aaaadsgboqaaaaaaaaaaaai",
            String::new(),
            404,
            "not_found",
        ),
        ("GET", "/v1/topics/nope", String::new(), 404, "not_found"),
        (
            "GET",
            "/v1/topics/t/queues/x/messages",
            String::new(),
            400,
            "invalid_queue",
        ),
        ("GET", "/v1/nothing-here", String::new(), 404, "not_found"),
        (
            "PATCH",
            "/v1/messages",
            "{}".into(),
            405,
            "method_not_allowed",
        ),
    ];
    for (method, path, body, status, code) in &cases {
        let answer = request(&server.base, method, path, Some(body), Some(token));
        assert_eq!(
            (answer.status, answer.json["code"].as_str()),
            (*status, Some(*code)),
            "{method} {path} {body:.60}: {}",
            answer.json
        );
        assert_eq!(
            answer.content_type, "application/problem+json",
            "{method} {path}"
        );
        assert_eq!(answer.json["status"], json!(status));
        assert!(answer.json["detail"]
            .as_str()
            .is_some_and(|d| !d.is_empty()));
    }
    let wrong = request(
        &server.base,
        "POST",
        "/v1/messages",
        Some(r#"{"topic":"t","body":"x","delay":1}"#),
        Some("wrong-token-wrong-token"),
    );
    wrong.assert_problem(401, "unauthorized");
    let missing = request(&server.base, "GET", "/v1/topics", None, None);
    missing.assert_problem(401, "unauthorized");
    // Operations routes stay open.
    assert_eq!(
        request(&server.base, "GET", "/healthz", None, None).status,
        200
    );
    // And a good request with the token works.
    let ok = request(
        &server.base,
        "POST",
        "/v1/messages",
        Some(r#"{"topic":"t","body":"x","delay":1}"#),
        Some(token),
    );
    assert_eq!(ok.status, 201);
}

#[test]
fn kill_nine_after_acks_then_restart_delivers_every_acknowledged_message() {
    let dir = tempfile::tempdir().unwrap();
    let mut acked = std::collections::BTreeMap::new();
    for round in 0..3 {
        let mut process = spawn(dir.path(), &[]);
        // Acknowledged messages, due 0.5–2.5 s from now, some in batches.
        for i in 0..60 {
            let delay = 500 + (i * 37) % 2000;
            let body = json!({"topic": "soak", "body": format!("r{round}-{i}"), "delay": delay})
                .to_string();
            let answer = request(&process.base, "POST", "/v1/messages", Some(&body), None);
            assert_eq!(answer.status, 201);
            acked.insert(
                answer.json["id"].as_str().unwrap().to_string(),
                format!("r{round}-{i}"),
            );
        }
        process.kill(); // SIGKILL, right after the acks
    }
    // Restart and consume until every acknowledged message arrived.
    let mut process = spawn(dir.path(), &[]);
    let mut seen = std::collections::BTreeMap::<String, u32>::new();
    let mut offsets = [0u64; 4]; // the binary runs with the default 4 queues per topic
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked.keys().any(|id| !seen.contains_key(id)) && Instant::now() < deadline {
        for (queue, offset) in offsets.iter_mut().enumerate() {
            let page = "max=1000&wait_ms=500";
            pull_counting(&process.base, "soak", queue, offset, page, &mut seen);
        }
    }
    let lost: Vec<_> = acked
        .iter()
        .filter(|(id, _)| !seen.contains_key(*id))
        .collect();
    assert!(
        lost.is_empty(),
        "acknowledged but never delivered: {lost:?}"
    );
    let duplicates: u32 = seen.values().map(|n| n - 1).sum();
    println!(
        "{} acknowledged, {} delivered, {duplicates} duplicates after 3 kill -9",
        acked.len(),
        seen.len()
    );
    // A graceful stop exits 0.
    assert!(process.terminate().success());
}

#[test]
fn the_cli_sends_tails_and_inspects() {
    let dir = tempfile::tempdir().unwrap();
    let process = spawn(dir.path(), &[]);
    let cli = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_delayd"))
            .args(args)
            .env("DELAYD_URL", &process.base)
            .output()
            .unwrap();
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).to_string(),
        )
    };
    let (ok, sent) = cli(&[
        "send",
        "--topic",
        "cli",
        "--delay",
        "200ms",
        "--key",
        "k1",
        "--header",
        "trace=abc",
        "hello from the shell",
    ]);
    assert!(ok, "{sent}");
    let sent: Value = serde_json::from_str(sent.trim()).unwrap();
    assert_eq!(sent["status"], "scheduled");
    let (ok, tailed) = cli(&[
        "tail",
        "--topic",
        "cli",
        "--from",
        "beginning",
        "--group",
        "g",
        "--count",
        "1",
    ]);
    assert!(ok, "{tailed}");
    let message: Value = serde_json::from_str(tailed.lines().next().unwrap()).unwrap();
    assert_eq!(
        (message["body"].as_str(), message["id"].as_str()),
        (Some("hello from the shell"), sent["id"].as_str())
    );
    assert_eq!(message["headers"]["trace"], "abc");
    // The group's offset was committed past the message, in the queue tail named.
    let queue = message_queue(&process.base, "cli");
    assert_eq!(message["queue"], queue);
    let offsets = request(&process.base, "GET", "/v1/groups/g/offsets/cli", None, None);
    assert_eq!(
        offsets.json["queues"],
        json!([{"queue": queue, "offset": 1}])
    );
    // The older spelling still works.
    let (ok, again) = cli(&["tail", "--topic", "cli", "--from-beginning", "--count", "1"]);
    assert!(ok, "{again}");
    assert_eq!(again.lines().next(), tailed.lines().next());
    // A bad request is reported with the problem's code and a non-zero exit.
    let (ok, _) = cli(&["send", "--topic", "a/b", "--delay", "1s", "x"]);
    assert!(!ok);
    // A topic that can never exist is refused, not waited for.
    let (ok, _) = cli(&["tail", "--topic", "a/b"]);
    assert!(!ok);
    // inspect verifies the files the server wrote.
    let segment = std::fs::read_dir(dir.path().join("schedule"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "log"))
        .unwrap();
    let (ok, dump) = cli(&["inspect", segment.to_str().unwrap()]);
    assert!(ok, "{dump}");
    assert!(
        dump.contains("topic \"cli\"") && dump.contains("1 records; clean end"),
        "{dump}"
    );
    // And the broker's: the commit log, the message's consume queue, a store's checkpoint, the group.
    let broker = dir.path().join("broker");
    let queue_file = broker.join(format!("consumequeue/cli/{queue}/{:020}", 0));
    let expected = [
        (
            broker.join(format!("commitlog/{:020}", 0)),
            "queue_offset 0 id",
        ),
        (queue_file, "1 units"),
        (
            broker.join("checkpoint"),
            "a start reads the commit log from offset",
        ),
        (broker.join("groups/g"), r#"{"cli":{"#),
        (dir.path().join("meta"), "buckets of 60 minutes"),
    ];
    for (path, says) in expected {
        let (ok, dump) = cli(&["inspect", path.to_str().unwrap()]);
        assert!(ok && dump.contains(says), "{}: {dump}", path.display());
    }
    // Known by where they are, also named from inside their directory.
    let output = Command::new(env!("CARGO_BIN_EXE_delayd"))
        .args(["inspect", "checkpoint"])
        .current_dir(&broker)
        .output()
        .unwrap();
    let dump = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && dump.contains("broker store checkpoint"),
        "{dump}"
    );
}

/// The queue of a topic that holds its only message.
fn message_queue(base: &str, topic: &str) -> u64 {
    let info = request(base, "GET", &format!("/v1/topics/{topic}"), None, None);
    info.json["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["max_offset"] == 1)
        .unwrap()["queue"]
        .as_u64()
        .unwrap()
}

#[test]
fn dedup_keys_return_the_pending_message_even_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), |_| {});
    let message = json!({"topic": "orders.timeout", "body": "cancel order 42", "delay": "1h", "key": "order-42", "dedup": true});
    // Eight producers retrying at once: one message.
    let base = server.base.clone();
    let answers: Vec<Answer> = (0..8)
        .map(|_| {
            let (base, body) = (base.clone(), message.to_string());
            std::thread::spawn(move || request(&base, "POST", "/v1/messages", Some(&body), None))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert_eq!(answers.iter().filter(|a| a.status == 201).count(), 1);
    let id = answers.iter().find(|a| a.status == 201).unwrap().json["id"].clone();
    for answer in answers.iter().filter(|a| a.status != 201) {
        assert_eq!(
            (answer.status, &answer.json["id"], &answer.json["duplicate"]),
            (200, &id, &json!(true))
        );
    }
    // Another topic with the same key is another message.
    let other = server.call(
        "POST",
        "/v1/messages",
        Some(
            json!({"topic": "other", "body": "x", "delay": "1h", "key": "order-42", "dedup": true}),
        ),
    );
    assert_eq!(other.status, 201);
    assert_ne!(other.json["id"], id);
    drop(server);

    let server = Server::start_in(dir.path(), |_| {});
    let again = server.call("POST", "/v1/messages", Some(message.clone()));
    assert_eq!(
        (again.status, &again.json["id"]),
        (200, &id),
        "the key holds across a restart"
    );
    // Once the message is no longer pending, the key is free again.
    assert_eq!(
        server
            .call(
                "DELETE",
                &format!("/v1/messages/{}", id.as_str().unwrap()),
                None
            )
            .status,
        200
    );
    let fresh = server.call("POST", "/v1/messages", Some(message));
    assert_eq!(fresh.status, 201);
    assert_ne!(fresh.json["id"], id);
    // dedup needs a key, and goes one message at a time.
    let keyless = server.call(
        "POST",
        "/v1/messages",
        Some(json!({"topic": "t", "body": "x", "delay": 1, "dedup": true})),
    );
    keyless.assert_problem(400, "invalid_key");
    let batch = server.call("POST", "/v1/messages/batch", Some(json!({"messages": [{"topic": "t", "body": "x", "delay": 1, "key": "k", "dedup": true}]})));
    assert_eq!(
        batch.json["results"][0]["error"]["code"],
        "dedup_not_in_batch"
    );
}

/// Dashboards, `rate()` and absence alerts need every series with a bounded label set to exist at 0 from
/// the start, for every configured sink: on a fresh data dir and after a restart, before any message.
#[test]
fn every_bounded_series_exists_at_zero_from_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::write_file(
        dir.path(),
        "delayd.toml",
        "[sinks.billing]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/hooks\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n",
    );
    let data_dir = dir.path().join("data");
    let mut at_zero = Vec::new();
    for sink in ["broker", "billing"] {
        at_zero.push(format!(
            r#"delayd_messages_received_total{{sink="{sink}"}}"#
        ));
        for outcome in ["ok", "retry", "dead"] {
            at_zero.push(format!(
                r#"delayd_messages_delivered_total{{sink="{sink}",outcome="{outcome}"}}"#
            ));
        }
    }
    // No rollover yet: both WAL file counters at 0.
    for from in ["spare", "new"] {
        at_zero.push(format!(r#"delayd_wal_files_total{{from="{from}"}}"#));
    }
    let unlabelled = [
        "delayd_messages_cancelled_total",
        "delayd_messages_requeued_total",
        "delayd_messages_discarded_total",
        "delayd_wal_poisoned_total",
        "delayd_read_errors_total",
        "delayd_log_corruptions_total",
        "delayd_log_torn_tails_total",
        "delayd_wal_bytes_written_total",
        "delayd_pending_messages",
        "delayd_wheel_entries",
        "delayd_segments",
        "delayd_unreadable_messages",
    ];
    for run in ["fresh", "restarted"] {
        let process = spawn(&data_dir, &["--config", config.to_str().unwrap()]);
        let series = scrape(&process.base);
        for name in &at_zero {
            assert_eq!(series.get(name), Some(&0.0), "{run}: {name} in {series:#?}");
        }
        for name in unlabelled {
            assert!(series.contains_key(name), "{run}: {name} in {series:#?}");
        }
        // No series for a sink nobody named: that lane's appear with a message naming one.
        assert!(
            !series.keys().any(|name| name.contains("(unknown)")),
            "{run}: {series:#?}"
        );
        // The restart finds a pending message in the data dir, but nothing counted it in this process.
        let sent = request(
            &process.base,
            "POST",
            "/v1/messages",
            Some(r#"{"topic": "later", "body": "x", "delay": "1h"}"#),
            None,
        );
        assert_eq!(sent.status, 201);
        assert_eq!(
            scrape(&process.base).get(r#"delayd_messages_received_total{sink="broker"}"#),
            Some(&1.0)
        );
    }
}

/// Schedules one message per body, due at `at_ms`, each with its own key (so they spread over the
/// topic's queues).
fn send_due_at(base: &str, topic: &str, bodies: &[String], at_ms: i64) {
    let messages: Vec<Value> = bodies
        .iter()
        .map(|b| json!({"topic": topic, "body": b, "key": b, "deliver_at": at_ms}))
        .collect();
    let answer = request(
        base,
        "POST",
        "/v1/messages/batch",
        Some(&json!({ "messages": messages }).to_string()),
        None,
    );
    assert_eq!(answer.status, 200, "{}", answer.json);
    assert!(answer.json["results"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["status"] == "scheduled"));
}

/// `delayd tail ARGS` against `base`, once it reported where it starts (its first line on stderr,
/// which contains `start`): only then is a message the test sends "after tail started".
fn start_tail(base: &str, args: &[&str], start: &str, deadline: Instant) -> common::Background {
    let mut tail_args = vec!["tail"];
    tail_args.extend(args);
    let tail = spawn_cli(base, &tail_args);
    let started = tail
        .stderr
        .next_before(deadline)
        .expect("tail reports its start");
    assert!(started.contains(start), "{started}");
    tail
}

/// The tail prints a message for each of the `sent` bodies (in any order), then exits by itself,
/// successfully, having printed nothing more.
fn assert_tail_prints(tail: &mut common::Background, mut sent: Vec<String>, deadline: Instant) {
    let count = sent.len();
    let mut bodies: Vec<String> = (0..count)
        .map(|i| {
            let line = tail
                .stdout
                .next_before(deadline)
                .unwrap_or_else(|| panic!("tail printed {i} of {count} messages"));
            let message: Value = serde_json::from_str(&line).unwrap();
            message["body"].as_str().unwrap().to_string()
        })
        .collect();
    bodies.sort();
    sent.sort();
    assert_eq!(bodies, sent);
    let (rest, status) = tail.finish_before(deadline);
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert!(rest.is_empty(), "{rest:?}");
}

/// A new group on a topic that does not exist yet misses nothing: every queue starts at offset 0, however
/// late tail learns that the topic exists (here: a whole batch is delivered at once, and tail's discovery
/// comes after the first delivery).
#[test]
fn tail_of_a_topic_that_does_not_exist_yet_prints_its_first_messages() {
    let dir = tempfile::tempdir().unwrap();
    let process = spawn(dir.path(), &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let args = [
        "--topic",
        "fresh.topic",
        "--group",
        "fresh-group",
        "--count",
        "20",
    ];
    let mut tail = start_tail(&process.base, &args, "does not exist yet", deadline);
    let sent: Vec<String> = (0..20).map(|i| format!("m{i:02}")).collect();
    send_due_at(&process.base, "fresh.topic", &sent, now_ms() + 300);
    assert_tail_prints(&mut tail, sent, deadline);
    // The group committed every queue past what was printed.
    let committed = request(
        &process.base,
        "GET",
        "/v1/groups/fresh-group/offsets/fresh.topic",
        None,
        None,
    );
    let queues = committed.json["queues"].as_array().unwrap();
    let total: u64 = queues.iter().map(|q| q["offset"].as_u64().unwrap()).sum();
    assert_eq!(total, 20, "{}", committed.json);
}

/// `--from end` on a topic that exists prints only what arrives after tail started.
#[test]
fn tail_from_end_prints_only_what_arrives_after_it_started() {
    let dir = tempfile::tempdir().unwrap();
    let process = spawn(dir.path(), &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let old: Vec<String> = (0..5).map(|i| format!("old{i}")).collect();
    send_due_at(&process.base, "busy.topic", &old, now_ms());
    // Wait until the five are in the broker (the topic API has no change notification: poll it).
    loop {
        let info = request(&process.base, "GET", "/v1/topics/busy.topic", None, None);
        let stored: u64 = info.json["queues"]
            .as_array()
            .map(|qs| qs.iter().map(|q| q["max_offset"].as_u64().unwrap()).sum())
            .unwrap_or(0);
        if stored == 5 {
            break;
        }
        assert!(Instant::now() < deadline, "{}", info.json);
        std::thread::sleep(Duration::from_millis(20));
    }
    let args = ["--topic", "busy.topic", "--from", "end", "--count", "3"];
    let mut tail = start_tail(&process.base, &args, "from queue:offset", deadline);
    let new: Vec<String> = (0..3).map(|i| format!("new{i}")).collect();
    send_due_at(&process.base, "busy.topic", &new, now_ms());
    assert_tail_prints(&mut tail, new, deadline);
}
