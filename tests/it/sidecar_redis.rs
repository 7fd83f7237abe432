//! The Redis Streams sidecar end to end: the real `delayd` binary beside a real `redis-server` (Debian's
//! package), started by each test on a free loopback port with its own directory, durable
//! (`appendfsync always`), and killed on drop. Requests are `XADD`ed to the source stream as an
//! application would; an independent reader `XREAD`s the target streams.
//!
//! Without `redis-server` a test prints why it is skipped, and fails under `CI=true`.

use super::common::{
    assert_dead_letters, assert_none_early, free_port, now_ms, request, scrape, serve_until_exit,
    server_installed, spawn, wait_for, Process,
};
use redis::Value;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` for one test, killed on drop.
struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl RedisServer {
    /// Starts one, or says why not (and fails under CI, where it must exist).
    fn start(dir: &Path) -> Option<RedisServer> {
        if !server_installed("redis-server", "apt-get install -y redis-server") {
            return None;
        }
        Some(RedisServer::start_on(free_port(), dir, &[]))
    }

    /// Starts one on `port` with its data in `dir` (again, after a stop), with extra arguments.
    fn start_on(port: u16, dir: &Path, extra: &[&str]) -> RedisServer {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--dir"])
            .arg(dir)
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = RedisServer {
            child,
            port,
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ping: redis::RedisResult<String> = server
                .client()
                .get_connection_with_timeout(Duration::from_secs(1))
                .and_then(|mut c| redis::cmd("PING").query(&mut c));
            if ping.is_ok() {
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start: {ping:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    fn connection(&self) -> redis::Connection {
        self.client()
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap()
    }

    /// Stops it (SIGKILL: what is acknowledged is on disk already) and starts it again on the same port
    /// and directory.
    fn restart(&mut self, extra: &[&str]) {
        self.stop();
        *self = RedisServer::start_on(self.port, &self.dir.clone(), extra);
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A config with a Redis source `in` (stream `delayd:in`) feeding a Redis sink `out`.
fn config(dir: &Path, redis: &RedisServer) -> PathBuf {
    config_with_sink(dir, redis, "")
}

/// [`config`] with more keys for the sink.
fn config_with_sink(dir: &Path, redis: &RedisServer, sink_keys: &str) -> PathBuf {
    let path = dir.join("delayd.toml");
    std::fs::write(
        &path,
        format!(
            "[sinks.out]\nkind = \"redis\"\nurl = \"{url}\"\nbackoff_initial = \"100ms\"\nbackoff_cap = \"1s\"\n\
             targets = [\"orders:*\", \"orders\"]\n{sink_keys}\n\
             [sources.in]\nkind = \"redis\"\nurl = \"{url}\"\nstream_key = \"delayd:in\"\nconsumer = \"node-a\"\nsink = \"out\"\n",
            url = redis.url()
        ),
    )
    .unwrap();
    path
}

fn start_delayd(data: &Path, config: &Path) -> Process {
    spawn(data, &["--config", config.to_str().unwrap()])
}

/// Publishes a request: `fields` are its headers, then its body.
fn publish(redis: &mut redis::Connection, fields: &[(&str, &str)], body: &str) -> String {
    let mut command = redis::cmd("XADD");
    command.arg("delayd:in").arg("*");
    for (name, value) in fields {
        command.arg(*name).arg(*value);
    }
    command.arg("body").arg(body);
    command.query(redis).unwrap()
}

/// One entry read from a target stream: its fields, and when it was read.
#[derive(Debug, Clone)]
struct Got {
    fields: BTreeMap<String, String>,
    at_ms: i64,
}

/// Reads `stream` from `from` until `count` entries came or `within` passed.
fn read_target(
    redis: &mut redis::Connection,
    stream: &str,
    count: usize,
    within: Duration,
) -> Vec<Got> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut last = "0".to_string();
    while got.len() < count && Instant::now() < deadline {
        let answer: Value = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(100)
            .arg("BLOCK")
            .arg(100)
            .arg("STREAMS")
            .arg(stream)
            .arg(&last)
            .query(redis)
            .unwrap();
        let at_ms = now_ms();
        let Value::Array(streams) = answer else {
            continue;
        };
        for stream in streams {
            let Value::Array(pair) = stream else { continue };
            let Some(Value::Array(entries)) = pair.get(1) else {
                continue;
            };
            for entry in entries {
                let Value::Array(parts) = entry else { continue };
                let (Some(Value::BulkString(id)), Some(Value::Array(fields))) =
                    (parts.first(), parts.get(1))
                else {
                    continue;
                };
                last = String::from_utf8(id.clone()).unwrap();
                let fields = fields
                    .chunks(2)
                    .map(|pair| match pair {
                        [Value::BulkString(n), Value::BulkString(v)] => (
                            String::from_utf8(n.clone()).unwrap(),
                            String::from_utf8(v.clone()).unwrap(),
                        ),
                        other => panic!("{other:?}"),
                    })
                    .collect();
                got.push(Got { fields, at_ms });
            }
        }
    }
    got
}

/// Entries of the source stream delivered to delayd's group and not acknowledged. The group must exist
/// (delayd's source creates it on connecting): XPENDING answers NOGROUP before.
fn pending(redis: &mut redis::Connection) -> i64 {
    let answer: Value = redis::cmd("XPENDING")
        .arg("delayd:in")
        .arg("delayd")
        .query(redis)
        .unwrap();
    match answer {
        Value::Array(parts) => match parts.first() {
            Some(Value::Int(n)) => *n,
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

/// Requests due 1–3 s ahead arrive at their target stream, none early, with the application's fields,
/// without delayd's, and with `delayd-id`, which the HTTP API knows as delivered.
#[test]
fn requests_through_redis_arrive_on_time_with_their_fields() {
    let dir = tempfile::tempdir().unwrap();
    let Some(redis) = RedisServer::start(dir.path()) else {
        return;
    };
    let delayd = start_delayd(&dir.path().join("data"), &config(dir.path(), &redis));
    let mut connection = redis.connection();
    let count = 30;
    let mut due = BTreeMap::new();
    for i in 0..count {
        let delay_ms = 1000 + i * 2000 / count;
        let published = now_ms();
        publish(
            &mut connection,
            &[
                ("delayd-delay", &format!("{delay_ms}ms")),
                ("delayd-target", "orders:out"),
                ("trace", &format!("t{i}")),
            ],
            &format!("order {i}"),
        );
        due.insert(format!("order {i}"), published + delay_ms);
    }
    // One in the delayed-message exchange's form.
    let published = now_ms();
    publish(
        &mut connection,
        &[("x-delay", "1500"), ("delayd-target", "orders:out")],
        "migrated",
    );
    due.insert("migrated".into(), published + 1500);
    let got = read_target(
        &mut connection,
        "orders:out",
        due.len(),
        Duration::from_secs(30),
    );
    assert_eq!(got.len(), due.len(), "{got:?}");
    for entry in &got {
        let body = &entry.fields["body"];
        assert!(!entry.fields.contains_key("delayd-delay"));
        assert!(!entry.fields.contains_key("delayd-target"));
        assert!(!entry.fields.contains_key("x-delay"));
        assert!(!entry.fields.contains_key("delayd-source-position"));
        if body != "migrated" {
            assert_eq!(entry.fields["trace"], format!("t{}", &body[6..]));
        }
        let id = &entry.fields["delayd-id"];
        let status = request(
            &delayd.base,
            "GET",
            &format!("/v1/messages/{id}"),
            None,
            None,
        );
        assert_eq!(status.json["status"], "delivered", "{}", status.json);
        assert_eq!(status.json["topic"], "orders:out");
    }
    assert_none_early(
        got.iter().map(|e| (e.fields["body"].as_str(), e.at_ms)),
        &due,
        "including this reader's 100 ms polls",
    );
    assert_eq!(pending(&mut connection), 0, "every request acknowledged");
    let sources = request(&delayd.base, "GET", "/v1/sources", None, None);
    assert_eq!(sources.json["sources"][0]["name"], "in");
    assert_eq!(sources.json["sources"][0]["connected"], true);
    assert_eq!(
        sources.json["sources"][0]["requests"]["scheduled"],
        due.len() as u64
    );
    let metrics = scrape(&delayd.base);
    assert_eq!(
        metrics[r#"delayd_source_messages_total{source="in",outcome="scheduled"}"#],
        due.len() as f64
    );
    assert_eq!(metrics[r#"delayd_source_connected{source="in"}"#], 1.0);
    assert_eq!(metrics[r#"delayd_sink_connected{sink="out"}"#], 1.0);
}

/// A request that cannot be scheduled is a dead letter with its reason, acknowledged, never delivered;
/// a cancel by target and key keeps its message from being delivered.
#[test]
fn bad_requests_are_dead_letters_and_cancels_by_key_hold() {
    let dir = tempfile::tempdir().unwrap();
    let Some(redis) = RedisServer::start(dir.path()) else {
        return;
    };
    let delayd = start_delayd(&dir.path().join("data"), &config(dir.path(), &redis));
    let mut connection = redis.connection();
    let bad: [(&[(&str, &str)], &str); 4] = [
        (&[("delayd-delay", "1s")], "missing_target"),
        (&[("delayd-target", "t")], "missing_deliver_time"),
        (
            &[("delayd-target", "t"), ("delayd-delay", "soon")],
            "invalid_delay",
        ),
        (
            &[
                ("delayd-target", "t"),
                ("delayd-delay", "1s"),
                ("delayd-deliver-at", "0"),
            ],
            "conflicting_time_fields",
        ),
    ];
    for (fields, _) in &bad {
        publish(&mut connection, fields, "bad");
    }
    publish(
        &mut connection,
        &[
            ("delayd-delay", "2s"),
            ("delayd-target", "orders:out"),
            ("delayd-key", "o-1"),
        ],
        "cancel me",
    );
    publish(
        &mut connection,
        &[
            ("delayd-target", "orders:out"),
            ("delayd-key", "o-1"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    publish(
        &mut connection,
        &[("delayd-delay", "2500ms"), ("delayd-target", "orders:out")],
        "sentinel",
    );
    let got = read_target(&mut connection, "orders:out", 1, Duration::from_secs(30));
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].fields["body"], "sentinel");
    // Nothing else comes: the cancelled one was due half a second before the sentinel.
    assert_eq!(
        read_target(&mut connection, "orders:out", 2, Duration::from_millis(500)).len(),
        1
    );
    assert_eq!(pending(&mut connection), 0);
    // The dead letters, with their reasons, in the broker's $dead topic.
    let codes: Vec<&str> = bad.iter().map(|(_, code)| *code).collect();
    assert_dead_letters(&delayd.base, "bad", &codes);
    let metrics = scrape(&delayd.base);
    let count = |outcome: &str| {
        metrics[&format!(r#"delayd_source_messages_total{{source="in",outcome="{outcome}"}}"#)]
    };
    assert_eq!(
        (count("dead"), count("cancelled"), count("scheduled")),
        (4.0, 1.0, 2.0)
    );
}

/// The worst moment for a crash: requests are durable in delayd and not acknowledged to Redis (here its
/// XACK is disabled, so every ack fails, and delayd is killed with SIGKILL). After both restart, Redis
/// delivers the requests again; delayd recognises them by their entry ids and schedules each once.
/// Meanwhile (Redis without XACK, then away) HTTP kept working and the source said it was down.
#[test]
fn a_crash_between_the_fsync_and_the_ack_schedules_each_request_once() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut redis) = RedisServer::start(dir.path()) else {
        return;
    };
    redis.restart(&["--rename-command", "XACK", ""]);
    let data = dir.path().join("data");
    let config = config(dir.path(), &redis);
    let mut connection = redis.connection();
    let count = 20;
    // Published before delayd starts, so that it takes them in one batch (a consumer whose acks fail
    // reads its pending requests again and again, and no new ones). The last message has a key, and a
    // cancel of that key comes just before it: delivered again, the cancel must not cancel it.
    for i in 0..count {
        let last = i == count - 1;
        if last {
            publish(
                &mut connection,
                &[
                    ("delayd-target", "orders:out"),
                    ("delayd-key", "again"),
                    ("delayd-cancel", "true"),
                ],
                "",
            );
        }
        let mut fields = vec![("delayd-delay", "3s"), ("delayd-target", "orders:out")];
        if last {
            fields.push(("delayd-key", "again"));
        }
        publish(&mut connection, &fields, &format!("once {i}"));
    }
    let mut delayd = start_delayd(&data, &config);
    // All scheduled (durable), none acknowledged.
    wait_for(
        "the requests to be scheduled",
        Duration::from_secs(30),
        || {
            scrape(&delayd.base)
                .get(r#"delayd_source_messages_total{source="in",outcome="scheduled"}"#)
                .copied()
                == Some(count as f64)
        },
    );
    assert_eq!(
        pending(&mut connection),
        count + 1,
        "the messages and the cancel"
    );
    let sources = request(&delayd.base, "GET", "/v1/sources", None, None);
    assert!(
        sources.json["sources"][0]["last_error"].as_str().is_some(),
        "{}",
        sources.json
    );
    delayd.kill();
    redis.restart(&[]);
    drop(connection);
    let mut connection = redis.connection();
    let delayd = start_delayd(&data, &config);
    let got = read_target(
        &mut connection,
        "orders:out",
        count as usize,
        Duration::from_secs(30),
    );
    assert_eq!(got.len(), count as usize);
    // Nothing more: each once.
    assert_eq!(
        read_target(
            &mut connection,
            "orders:out",
            count as usize + 1,
            Duration::from_secs(1)
        )
        .len(),
        count as usize
    );
    let mut bodies: Vec<_> = got.iter().map(|g| g.fields["body"].clone()).collect();
    bodies.sort();
    bodies.dedup();
    assert_eq!(bodies.len(), count as usize);
    wait_for("the acknowledgements", Duration::from_secs(10), || {
        pending(&mut connection) == 0
    });
    let metrics = scrape(&delayd.base);
    assert_eq!(
        metrics[r#"delayd_source_messages_total{source="in",outcome="duplicate"}"#],
        count as f64
    );
    assert_eq!(
        metrics[r#"delayd_source_messages_total{source="in",outcome="scheduled"}"#],
        0.0
    );
}

/// Redis going away mid-run: delayd keeps serving HTTP and says the source and sink are down; once Redis
/// is back, what was scheduled before and what is published after is delivered.
#[test]
fn redis_restarted_mid_run_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut redis) = RedisServer::start(dir.path()) else {
        return;
    };
    let delayd = start_delayd(&dir.path().join("data"), &config(dir.path(), &redis));
    let mut connection = redis.connection();
    publish(
        &mut connection,
        &[("delayd-delay", "6s"), ("delayd-target", "orders:out")],
        "before",
    );
    wait_for(
        "the request to be acknowledged",
        Duration::from_secs(10),
        // Scheduled first: until delayd's source has connected, its group does not exist and
        // XPENDING answers NOGROUP; once it counted the request, the group is there.
        || {
            scrape(&delayd.base)
                .get(r#"delayd_source_messages_total{source="in",outcome="scheduled"}"#)
                .copied()
                == Some(1.0)
                && pending(&mut connection) == 0
        },
    );
    redis.stop();
    wait_for("the source to notice", Duration::from_secs(20), || {
        let sources = request(&delayd.base, "GET", "/v1/sources", None, None);
        sources.json["sources"][0]["connected"] == json!(false)
    });
    // The message falls due while Redis is away: the sink fails and retries.
    wait_for("the sink to notice", Duration::from_secs(20), || {
        let sinks = request(&delayd.base, "GET", "/v1/sinks", None, None);
        sinks.json["sinks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"] == "out" && s["connected"] == json!(false))
    });
    assert_eq!(
        request(&delayd.base, "GET", "/readyz", None, None).status,
        200
    );
    let http = request(
        &delayd.base,
        "POST",
        "/v1/messages",
        Some(r#"{"topic": "http", "body": "still here", "delay": 0}"#),
        None,
    );
    assert_eq!(http.status, 201, "{}", http.json);
    redis.restart(&[]);
    let mut connection = redis.connection();
    publish(
        &mut connection,
        &[("delayd-delay", "500ms"), ("delayd-target", "orders:out")],
        "after",
    );
    let got = read_target(&mut connection, "orders:out", 2, Duration::from_secs(30));
    let mut bodies: Vec<_> = got.iter().map(|g| g.fields["body"].clone()).collect();
    bodies.sort();
    assert_eq!(bodies, ["after", "before"]);
    let sources = request(&delayd.base, "GET", "/v1/sources", None, None);
    assert_eq!(sources.json["sources"][0]["connected"], true);
}

/// Requests take effect in their order, also within one batch: a message, its cancel, then a new message
/// with the same key leaves the new one pending (and delivered), not the first.
#[test]
fn a_cancel_and_a_new_message_with_its_key_in_one_batch_keep_their_order() {
    let dir = tempfile::tempdir().unwrap();
    let Some(redis) = RedisServer::start(dir.path()) else {
        return;
    };
    let mut connection = redis.connection();
    // Published before delayd starts: it reads them in one batch.
    let keyed = |delay: &'static str| {
        [
            ("delayd-delay", delay),
            ("delayd-target", "orders:out"),
            ("delayd-key", "o-7"),
        ]
    };
    publish(&mut connection, &keyed("1s"), "first");
    publish(
        &mut connection,
        &[
            ("delayd-target", "orders:out"),
            ("delayd-key", "o-7"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    publish(&mut connection, &keyed("1500ms"), "second");
    publish(
        &mut connection,
        &[("delayd-delay", "2s"), ("delayd-target", "orders:out")],
        "sentinel",
    );
    let delayd = start_delayd(&dir.path().join("data"), &config(dir.path(), &redis));
    let got = read_target(&mut connection, "orders:out", 2, Duration::from_secs(30));
    let mut bodies: Vec<_> = got.iter().map(|g| g.fields["body"].clone()).collect();
    bodies.sort();
    assert_eq!(bodies, ["second", "sentinel"]);
    assert_eq!(
        read_target(&mut connection, "orders:out", 3, Duration::from_millis(500)).len(),
        2
    );
    let metrics = scrape(&delayd.base);
    let count = |outcome: &str| {
        metrics[&format!(r#"delayd_source_messages_total{{source="in",outcome="{outcome}"}}"#)]
    };
    assert_eq!(
        (count("scheduled"), count("cancelled"), count("duplicate")),
        (3.0, 1.0, 0.0)
    );
}

/// An idempotency key is its sink's: an HTTP message to the built-in broker with topic `orders` and key
/// `42`, and a Redis request for the target `orders` with key `42`, are two messages, and a cancel
/// through the source cancels its own only. The sink's `targets` and a header named `body` (a second
/// `body` field) are refused, through the source and through HTTP.
#[test]
fn keys_belong_to_their_sink_and_targets_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let Some(redis) = RedisServer::start(dir.path()) else {
        return;
    };
    let delayd = start_delayd(&dir.path().join("data"), &config(dir.path(), &redis));
    let mut connection = redis.connection();
    let post = |body: serde_json::Value| {
        request(
            &delayd.base,
            "POST",
            "/v1/messages",
            Some(&body.to_string()),
            None,
        )
    };
    let http =
        post(json!({"topic": "orders", "key": "42", "dedup": true, "body": "http", "delay": "2s"}));
    assert_eq!(http.status, 201, "{}", http.json);
    let http = http.json["id"].as_str().unwrap().to_string();
    publish(
        &mut connection,
        &[
            ("delayd-delay", "2s"),
            ("delayd-target", "orders"),
            ("delayd-key", "42"),
        ],
        "from redis",
    );
    let count = |outcome: &str| {
        scrape(&delayd.base)
            .get(&format!(
                r#"delayd_source_messages_total{{source="in",outcome="{outcome}"}}"#
            ))
            .copied()
            .unwrap_or(0.0)
    };
    wait_for("the request to be taken", Duration::from_secs(10), || {
        count("scheduled") + count("duplicate") == 1.0
    });
    assert_eq!(
        count("scheduled"),
        1.0,
        "not a duplicate of another sink's key"
    );
    publish(
        &mut connection,
        &[
            ("delayd-target", "orders"),
            ("delayd-key", "42"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    // Refused: outside the sink's targets.
    publish(
        &mut connection,
        &[("delayd-delay", "1s"), ("delayd-target", "sessions:x")],
        "bad",
    );
    wait_for(
        "the cancel and the refusal",
        Duration::from_secs(10),
        || count("cancelled") == 1.0 && count("dead") == 1.0,
    );
    assert_dead_letters(&delayd.base, "bad", &["forbidden_target"]);
    // The HTTP message is delivered; the cancelled Redis one never reaches its stream.
    wait_for("the HTTP message", Duration::from_secs(10), || {
        request(
            &delayd.base,
            "GET",
            &format!("/v1/messages/{http}"),
            None,
            None,
        )
        .json["status"]
            == "delivered"
    });
    assert!(read_target(&mut connection, "orders", 1, Duration::from_millis(500)).is_empty());
    for (body, code) in [
        (
            json!({"sink": "out", "topic": "sessions", "body": "b", "delay": 0}),
            "forbidden_target",
        ),
        (
            json!({"sink": "out", "topic": "orders:out", "body": "b", "delay": 0, "headers": {"body": "x"}}),
            "invalid_header",
        ),
    ] {
        let refused = post(body);
        assert_eq!(
            (refused.status, refused.json["code"].as_str()),
            (400, Some(code)),
            "{}",
            refused.json
        );
    }
}

/// A source's start reads back only what it has not acknowledged: while it has nothing unacknowledged,
/// its mark follows the log's end however many messages others add (here through HTTP), so a restart
/// reads little whatever the store holds. A mark that cannot be read stops the start with an error
/// naming its file, rather than a read of the whole store.
#[test]
fn an_idle_sources_mark_follows_the_log_and_a_damaged_one_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let Some(redis) = RedisServer::start(dir.path()) else {
        return;
    };
    let data = dir.path().join("data");
    let config = config(dir.path(), &redis);
    let mut delayd = start_delayd(&data, &config);
    let messages: Vec<_> = (0..500)
        .map(|i| json!({"topic": "http", "body": format!("m{i}"), "delay": "1h"}))
        .collect();
    let batch = request(
        &delayd.base,
        "POST",
        "/v1/messages/batch",
        Some(&json!({ "messages": messages }).to_string()),
        None,
    );
    assert_eq!(batch.status, 200, "{}", batch.json);
    let mark = data.join("sources/in");
    let below = || {
        let text = std::fs::read_to_string(&mark).unwrap_or_default();
        serde_json::from_str::<serde_json::Value>(&text).ok()?["below"].as_u64()
    };
    // Saved when the log's end moved and the last save is 10 s old.
    wait_for(
        "the mark to follow the log",
        Duration::from_secs(40),
        || below().is_some_and(|below| below >= 500),
    );
    delayd.kill();
    std::fs::write(&mark, "not a mark").unwrap();
    let (status, stderr) = serve_until_exit(
        &data,
        &["--config", config.to_str().unwrap()],
        &[("DELAYD_MIN_FREE_DISK_BYTES", "0")],
        "",
        Duration::from_secs(60),
    );
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{stderr}");
    assert!(
        stderr.contains(&mark.display().to_string()) && stderr.contains("unreadable"),
        "{stderr}"
    );
}

/// Redis away for longer than the sink's whole backoff series (3 attempts, 100 and 200 ms apart) kills
/// nothing: the messages due meanwhile wait for it without spending attempts, and every one is delivered
/// once it is back. `GET /v1/sinks` counts them as postponed.
#[test]
fn an_outage_longer_than_the_backoff_series_kills_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut redis) = RedisServer::start(dir.path()) else {
        return;
    };
    let config = config_with_sink(dir.path(), &redis, "max_attempts = 3\n");
    let delayd = start_delayd(&dir.path().join("data"), &config);
    let mut connection = redis.connection();
    let count = 20;
    for i in 0..count {
        publish(
            &mut connection,
            &[("delayd-delay", "2s"), ("delayd-target", "orders:out")],
            &format!("m{i}"),
        );
    }
    wait_for("the requests", Duration::from_secs(10), || {
        scrape(&delayd.base)
            .get(r#"delayd_source_messages_total{source="in",outcome="scheduled"}"#)
            .copied()
            == Some(count as f64)
            && pending(&mut connection) == 0
    });
    redis.stop();
    let sink = || {
        let sinks = request(&delayd.base, "GET", "/v1/sinks", None, None);
        let sinks = sinks.json["sinks"].as_array().unwrap().clone();
        sinks.into_iter().find(|s| s["name"] == "out").unwrap()
    };
    // Due meanwhile: each waits, again and again, for longer than three attempts would take.
    wait_for("every message to wait", Duration::from_secs(20), || {
        sink()["postponed"].as_u64().is_some_and(|n| n >= 3 * count)
    });
    let away = sink();
    assert_eq!(away["connected"], false, "{away}");
    assert!(away["last_error"].as_str().is_some(), "{away}");
    // The metric counts those, and the messages held unread meanwhile.
    let metric = scrape(&delayd.base)
        .get(r#"delayd_messages_postponed_total{sink="out"}"#)
        .copied();
    let counted = away["postponed"].as_u64().unwrap() as f64;
    assert!(
        metric.is_some_and(|n| n >= counted),
        "{metric:?} < {counted}"
    );
    redis.restart(&[]);
    let mut connection = redis.connection();
    let got = read_target(
        &mut connection,
        "orders:out",
        count as usize,
        Duration::from_secs(30),
    );
    assert_eq!(
        got.len(),
        count as usize,
        "every message delivered, none dead"
    );
    for entry in &got {
        let id = &entry.fields["delayd-id"];
        let status = request(
            &delayd.base,
            "GET",
            &format!("/v1/messages/{id}"),
            None,
            None,
        );
        assert_eq!(status.json["status"], "delivered", "{}", status.json);
        assert_eq!(
            status.json["attempts"], 1,
            "no attempt spent waiting: {}",
            status.json
        );
    }
    wait_for("the sink to be up", Duration::from_secs(10), || {
        sink()["connected"] == true
    });
}

/// What `GET /v1/sinks` says of the sink's connection is true without a delivery: connected once delayd
/// checked Redis at its start, disconnected within seconds of Redis going away, connected again once it
/// is back (delayd checks an idle sink every 2 s).
#[test]
fn the_sinks_state_follows_redis_without_deliveries() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut redis) = RedisServer::start(dir.path()) else {
        return;
    };
    let delayd = start_delayd(&dir.path().join("data"), &config(dir.path(), &redis));
    let connected = || {
        let sinks = request(&delayd.base, "GET", "/v1/sinks", None, None);
        let sinks = sinks.json["sinks"].as_array().unwrap().clone();
        let out = sinks.into_iter().find(|s| s["name"] == "out").unwrap();
        out["connected"].as_bool().unwrap()
    };
    wait_for(
        "the sink to be connected",
        Duration::from_secs(10),
        connected,
    );
    redis.stop();
    wait_for(
        "the sink to be disconnected",
        Duration::from_secs(10),
        || !connected(),
    );
    redis.restart(&[]);
    wait_for(
        "the sink to be connected again",
        Duration::from_secs(10),
        connected,
    );
    assert_eq!(
        scrape(&delayd.base)[r#"delayd_sink_connected{sink="out"}"#],
        1.0
    );
}

/// A request that cannot be scheduled is a dead letter where every other one is: a dead message with an
/// id the API finds and lists, requeued once fixed (here: a missing delivery time, which a requeue
/// supplies), with its headers kept: one with a control character escaped, one that is not UTF-8
/// base64-encoded as `NAME.base64`, the reason naming both, and with the key it gave. What cannot go
/// out as it is cannot be requeued (409 `not_requeueable`): one without a target, a cancel, one with a
/// migration schedule header its target would read again, one cut to fit the log, one whose header a
/// new message may not have.
#[test]
fn a_sources_dead_letter_is_found_listed_and_requeued() {
    let dir = tempfile::tempdir().unwrap();
    let Some(redis) = RedisServer::start(dir.path()) else {
        return;
    };
    let delayd = start_delayd(&dir.path().join("data"), &config(dir.path(), &redis));
    let mut connection = redis.connection();
    let _: String = redis::cmd("XADD")
        .arg("delayd:in")
        .arg("*")
        .arg("delayd-target")
        .arg("orders:out")
        .arg("delayd-key")
        .arg("k-1")
        .arg("trace")
        .arg("a\u{1b}b")
        .arg("bin")
        .arg(&[0xffu8, 0x00][..])
        .arg("body")
        .arg("no time")
        .query(&mut connection)
        .unwrap();
    publish(&mut connection, &[("delayd-delay", "1s")], "no target");
    let refused_targets = ["orders:cancel", "orders:x", "orders:big", "orders:name"];
    publish(
        &mut connection,
        &[
            ("delayd-target", "orders:cancel"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    publish(
        &mut connection,
        &[("delayd-target", "orders:x"), ("x-delay", "soon")],
        "x",
    );
    publish(
        &mut connection,
        &[("delayd-target", "orders:big"), ("delayd-delay", "1s")],
        &"b".repeat((1 << 20) + 1),
    );
    publish(
        &mut connection,
        &[
            ("delayd-target", "orders:name"),
            ("delayd-delay", "1s"),
            ("bad name", "v"),
        ],
        "n",
    );
    // Listed as dead, by their targets.
    let dead = |topic: &str| {
        let listed = request(&delayd.base, "GET", "/v1/messages?status=dead", None, None);
        let messages = listed.json["messages"].as_array().unwrap().clone();
        messages.into_iter().find(|m| m["topic"] == topic)
    };
    wait_for("the dead letters listed", Duration::from_secs(10), || {
        dead("orders:out").is_some()
            && dead("").is_some()
            && refused_targets.iter().all(|t| dead(t).is_some())
    });
    let no_time = dead("orders:out").unwrap();
    assert_eq!(no_time["key"], "k-1");
    let reason = no_time["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("invalid_header")
            && reason.contains("bin.base64")
            && reason.contains("escaped"),
        "{reason}"
    );
    let id = no_time["id"].as_str().unwrap();
    let requeued = request(
        &delayd.base,
        "POST",
        &format!("/v1/messages/{id}/requeue"),
        Some("{}"),
        None,
    );
    assert_eq!(requeued.status, 200, "{}", requeued.json);
    let got = read_target(&mut connection, "orders:out", 1, Duration::from_secs(10));
    assert_eq!(got.len(), 1);
    let fields = &got[0].fields;
    assert_eq!(fields["body"], "no time");
    assert_eq!(fields["trace"], "a\\u{1b}b");
    assert_eq!(fields["bin.base64"], "/wA=");
    assert_eq!(fields["delayd-id"], id);
    for topic in [""].iter().chain(&refused_targets) {
        let letter = dead(topic).unwrap();
        let refused = request(
            &delayd.base,
            "POST",
            &format!("/v1/messages/{}/requeue", letter["id"].as_str().unwrap()),
            Some("{}"),
            None,
        );
        assert_eq!(
            (refused.status, refused.json["code"].as_str()),
            (409, Some("not_requeueable")),
            "{topic}: {}",
            refused.json
        );
        assert_eq!(dead(topic).unwrap()["id"], letter["id"], "still dead");
    }
}
