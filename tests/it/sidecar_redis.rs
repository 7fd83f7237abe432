//! The Redis Streams sidecar end to end: the real `delayd` binary beside a real `redis-server` (Debian's
//! package), started by each test on a free loopback port with its own directory, durable
//! (`appendfsync always`), and killed on drop (common/redis_server.rs). Requests are `XADD`ed to the source stream as an
//! application would; an independent reader `XREAD`s the target streams.
//!
//! Without `redis-server` a test prints why it is skipped, and fails under `CI=true`.

use super::common::redis_server::{RedisServer, TARGET};
use super::common::sidecar::{
    assert_arrive_on_time, assert_bad_requests_dead_and_cancels_by_key_hold,
    assert_each_delivered_once, assert_outage_loses_nothing, bad_requests_of_every_mq, bodies,
    publish_numbered, publish_orders, sink_state, source_count, source_state,
    spawn_with_config as start_delayd, Mq,
};
use super::common::{
    assert_dead_letters, get_message, now_ms, request, scrape, serve_until_exit, settled_message,
    wait_for, write_file, Process,
};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tempfile::TempDir;

/// A config with a Redis source `in` (stream `delayd:in`) feeding a Redis sink `out`.
fn config(dir: &Path, redis: &RedisServer) -> PathBuf {
    config_with_sink(dir, redis, "")
}

/// [`config`] with more keys for the sink.
fn config_with_sink(dir: &Path, redis: &RedisServer, sink_keys: &str) -> PathBuf {
    let text = format!(
        "[sinks.out]\nkind = \"redis\"\nurl = \"{url}\"\nbackoff_initial = \"100ms\"\nbackoff_cap = \"1s\"\n\
         targets = [\"orders:*\", \"orders\"]\n{sink_keys}\n\
         [sources.in]\nkind = \"redis\"\nurl = \"{url}\"\nstream_key = \"delayd:in\"\nconsumer = \"node-a\"\nsink = \"out\"\n",
        url = redis.url()
    );
    write_file(dir, "delayd.toml", &text)
}

/// A test's directory, a `redis-server` in it, and delayd on it with [`config`]; None without
/// redis-server. (Bound in this order, delayd is dropped first and the directory last.)
fn redis_and_delayd() -> Option<(TempDir, RedisServer, Process)> {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start(dir.path())?;
    let delayd = start_delayd(&dir.path().join("data"), &config(dir.path(), &redis));
    Some((dir, redis, delayd))
}

/// Requests due 1–3 s ahead arrive at their target stream, none early, with the application's fields,
/// without delayd's, and with `delayd-id`, which the HTTP API knows as delivered.
#[test]
fn requests_through_redis_arrive_on_time_with_their_fields() {
    let Some((_dir, mut redis, delayd)) = redis_and_delayd() else {
        return;
    };
    let mut due = publish_orders(&mut redis, 30, false);
    // One in the delayed-message exchange's form.
    let published = now_ms();
    redis.publish(
        &[("x-delay", "1500"), ("delayd-target", TARGET)],
        "migrated",
    );
    due.insert("migrated".into(), published + 1500);
    let consumed = ["x-delay"];
    let how = "including this reader's 100 ms polls";
    assert_arrive_on_time(
        &mut redis,
        &delayd.base,
        &due,
        &consumed,
        how,
        |_, status| {
            assert_eq!(status["topic"], TARGET);
        },
    );
    let sources = request(&delayd.base, "GET", "/v1/sources", None, None);
    assert_eq!(
        sources.json["sources"][0]["requests"]["scheduled"],
        due.len() as u64
    );
}

/// A request that cannot be scheduled is a dead letter with its reason, acknowledged, never delivered;
/// a cancel by target and key keeps its message from being delivered.
#[test]
fn bad_requests_are_dead_letters_and_cancels_by_key_hold() {
    let Some((_dir, mut redis, delayd)) = redis_and_delayd() else {
        return;
    };
    let mut bad = bad_requests_of_every_mq("t");
    bad.push((
        vec![
            ("delayd-target", "t"),
            ("delayd-delay", "1s"),
            ("delayd-deliver-at", "0"),
        ],
        "conflicting_time_fields",
    ));
    let counts = (4.0, 1.0, 2.0);
    assert_bad_requests_dead_and_cancels_by_key_hold(&mut redis, &delayd.base, &bad, counts);
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
    redis.restart_with(&["--rename-command", "XACK", ""]);
    let data = dir.path().join("data");
    let config = config(dir.path(), &redis);
    let count = 20;
    // Published before delayd starts, so that it takes them in one batch (a consumer whose acks fail
    // reads its pending requests again and again, and no new ones). The last message has a key, and a
    // cancel of that key comes just before it: delivered again, the cancel must not cancel it.
    for i in 0..count {
        let last = i == count - 1;
        if last {
            redis.publish(
                &[
                    ("delayd-target", TARGET),
                    ("delayd-key", "again"),
                    ("delayd-cancel", "true"),
                ],
                "",
            );
        }
        let mut fields = vec![("delayd-delay", "3s"), ("delayd-target", TARGET)];
        if last {
            fields.push(("delayd-key", "again"));
        }
        redis.publish(&fields, &format!("once {i}"));
    }
    let mut delayd = start_delayd(&data, &config);
    // All scheduled (durable), none acknowledged.
    wait_for(
        "the requests to be scheduled",
        Duration::from_secs(30),
        || source_count(&delayd.base, "scheduled") == f64::from(count),
    );
    assert_eq!(
        redis.pending(),
        1 + i64::from(count),
        "the messages and the cancel"
    );
    let source = source_state(&delayd.base);
    assert!(source["last_error"].as_str().is_some(), "{source}");
    delayd.kill();
    redis.restart();
    let delayd = start_delayd(&data, &config);
    assert_each_delivered_once(&mut redis, count as usize);
    wait_for("the acknowledgements", Duration::from_secs(10), || {
        redis.pending() == 0
    });
    let metrics = scrape(&delayd.base);
    assert_eq!(
        metrics[r#"delayd_source_messages_total{source="in",outcome="duplicate"}"#],
        f64::from(count)
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
    let Some((_dir, mut redis, delayd)) = redis_and_delayd() else {
        return;
    };
    assert_outage_loses_nothing(&mut redis, &delayd.base, "6s");
}

/// Requests take effect in their order, also within one batch: a message, its cancel, then a new message
/// with the same key leaves the new one pending (and delivered), not the first.
#[test]
fn a_cancel_and_a_new_message_with_its_key_in_one_batch_keep_their_order() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut redis) = RedisServer::start(dir.path()) else {
        return;
    };
    // Published before delayd starts: it reads them in one batch.
    let keyed = |delay: &'static str| {
        [
            ("delayd-delay", delay),
            ("delayd-target", TARGET),
            ("delayd-key", "o-7"),
        ]
    };
    redis.publish(&keyed("1s"), "first");
    redis.publish(
        &[
            ("delayd-target", TARGET),
            ("delayd-key", "o-7"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    redis.publish(&keyed("1500ms"), "second");
    redis.publish(
        &[("delayd-delay", "2s"), ("delayd-target", TARGET)],
        "sentinel",
    );
    let delayd = start_delayd(&dir.path().join("data"), &config(dir.path(), &redis));
    let got = redis.read_target(2, Duration::from_secs(30));
    assert_eq!(bodies(&got), ["second", "sentinel"]);
    assert_eq!(redis.read_target(3, Duration::from_millis(500)).len(), 2);
    let count = |outcome| source_count(&delayd.base, outcome);
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
    let Some((_dir, mut redis, delayd)) = redis_and_delayd() else {
        return;
    };
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
    redis.publish(
        &[
            ("delayd-delay", "2s"),
            ("delayd-target", "orders"),
            ("delayd-key", "42"),
        ],
        "from redis",
    );
    let count = |outcome| source_count(&delayd.base, outcome);
    wait_for("the request to be taken", Duration::from_secs(10), || {
        count("scheduled") + count("duplicate") == 1.0
    });
    assert_eq!(
        count("scheduled"),
        1.0,
        "not a duplicate of another sink's key"
    );
    redis.publish(
        &[
            ("delayd-target", "orders"),
            ("delayd-key", "42"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    // Refused: outside the sink's targets.
    redis.publish(
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
        get_message(&delayd.base, &http).json["status"] == "delivered"
    });
    assert!(redis
        .read("orders", 1, Duration::from_millis(500))
        .is_empty());
    for (body, code) in [
        (
            json!({"sink": "out", "topic": "sessions", "body": "b", "delay": 0}),
            "forbidden_target",
        ),
        (
            json!({"sink": "out", "topic": TARGET, "body": "b", "delay": 0, "headers": {"body": "x"}}),
            "invalid_header",
        ),
    ] {
        let refused = post(body);
        refused.assert_problem(400, code);
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
    let count = 20;
    publish_numbered(&mut redis, count as usize, "2s", "m");
    wait_for("the requests", Duration::from_secs(10), || {
        source_count(&delayd.base, "scheduled") == count as f64 && redis.pending() == 0
    });
    redis.stop();
    let sink = || sink_state(&delayd.base);
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
    redis.restart();
    let got = redis.read_target(count as usize, Duration::from_secs(30));
    assert_eq!(
        got.len(),
        count as usize,
        "every message delivered, none dead"
    );
    for entry in &got {
        let status = settled_message(&delayd.base, entry.id());
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
    let Some((_dir, mut redis, delayd)) = redis_and_delayd() else {
        return;
    };
    let connected = || sink_state(&delayd.base)["connected"].as_bool().unwrap();
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
    redis.restart();
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
    let Some((_dir, mut redis, delayd)) = redis_and_delayd() else {
        return;
    };
    let _: String = redis::cmd("XADD")
        .arg("delayd:in")
        .arg("*")
        .arg("delayd-target")
        .arg(TARGET)
        .arg("delayd-key")
        .arg("k-1")
        .arg("trace")
        .arg("a\u{1b}b")
        .arg("bin")
        .arg(&[0xffu8, 0x00][..])
        .arg("body")
        .arg("no time")
        .query(&mut redis.connection())
        .unwrap();
    redis.publish(&[("delayd-delay", "1s")], "no target");
    let refused_targets = ["orders:cancel", "orders:x", "orders:big", "orders:name"];
    redis.publish(
        &[
            ("delayd-target", "orders:cancel"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    redis.publish(&[("delayd-target", "orders:x"), ("x-delay", "soon")], "x");
    redis.publish(
        &[("delayd-target", "orders:big"), ("delayd-delay", "1s")],
        &"b".repeat((1 << 20) + 1),
    );
    redis.publish(
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
        dead(TARGET).is_some()
            && dead("").is_some()
            && refused_targets.iter().all(|t| dead(t).is_some())
    });
    let no_time = dead(TARGET).unwrap();
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
    let got = redis.read_target(1, Duration::from_secs(10));
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body, "no time");
    let fields = &got[0].headers;
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
