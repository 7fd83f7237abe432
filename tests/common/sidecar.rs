//! What the sidecar tests do the same way over every MQ (Redis Streams, NATS JetStream, RabbitMQ, Kafka):
//! an MQ behind [`Mq`] (publish a request as an application would, read the target as an independent
//! reader, stop and restart the server), delayd's state as the API and the metrics tell it, and the
//! scenarios each MQ's file runs: requests arriving on time, bad requests as dead letters beside a cancel
//! by key, each request delivered once after a crash, and the MQ going away and coming back.
//!
//! Each MQ's file keeps what is its own: its server, its config, its forms of a request (migration
//! headers, exchanges, record keys) and how it acknowledges.

use super::{
    assert_dead_letters, assert_none_early, now_ms, request, scrape, settled_message, spawn,
    wait_for, Process,
};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A message read from an MQ's target: its headers, its body, when it was read (unix ms), and what the
/// MQ adds (`M`: a NATS subject, a Kafka record key, AMQP properties).
#[derive(Debug, Clone)]
pub struct Got<M = ()> {
    pub headers: BTreeMap<String, String>,
    pub body: String,
    pub at_ms: i64,
    pub mq: M,
}

impl<M> Got<M> {
    /// The `delayd-id` it was delivered under.
    pub fn id(&self) -> &str {
        &self.headers["delayd-id"]
    }
}

/// One MQ with delayd's source and sink on it, as a test drives it.
pub trait Mq {
    /// What a message read from the target carries beside its headers and body.
    type Own: Clone + Debug;

    /// The target the requests name (`delayd-target`), which [`Mq::read_target`] reads.
    fn target(&self) -> String;

    /// Publishes a request to the source as an application would, and waits until the MQ has it.
    fn publish(&mut self, headers: &[(&str, &str)], body: &str);

    /// Publishes a request with a key: in `delayd-key`, or where the MQ has keys of its own.
    fn publish_keyed(&mut self, key: &str, headers: &[(&str, &str)], body: &str) {
        let mut headers = headers.to_vec();
        headers.push(("delayd-key", key));
        self.publish(&headers, body);
    }

    /// Everything the target received since the test began, once there are `count` messages or
    /// `within` passed.
    fn read_target(&mut self, count: usize, within: Duration) -> Vec<Got<Self::Own>>;

    /// Whether every request published was acknowledged to the MQ (true where the MQ does not say).
    fn all_acknowledged(&mut self) -> bool;

    /// Takes the server away (the test's clients with it).
    fn stop(&mut self);

    /// Starts the server again on the same port and data, and reconnects the test's clients.
    fn restart(&mut self);

    /// Whether delayd's source reports the MQ gone (a Kafka consumer retries without saying so).
    fn source_notices_outage(&self) -> bool {
        true
    }
}

/// A runtime of one worker for a test's own MQ client, beside the blocking test.
pub fn client_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Starts `command` in a process group of its own, which a watchdog can kill whole, without stdio.
pub fn spawn_in_own_group(command: &mut Command) -> Child {
    command
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Runs the shell `script` as a watchdog in a process group of its own, detached from this test
/// process, which it is meant to outlive (to kill a server once the test process is gone, however it
/// ended).
#[expect(
    clippy::zombie_processes,
    reason = "the watchdog must outlive this process; init takes it over"
)]
pub fn spawn_watchdog(script: &str) {
    spawn_in_own_group(Command::new("sh").args(["-c", script]));
}

/// `delayd serve --config CONFIG` on `data`.
pub fn spawn_with_config(data: &Path, config: &Path) -> Process {
    spawn(data, &["--config", config.to_str().unwrap()])
}

/// `delayd_source_messages_total` of the source `in` for `outcome` (0 before the series exists).
pub fn source_count(base: &str, outcome: &str) -> f64 {
    scrape(base)
        .get(&format!(
            r#"delayd_source_messages_total{{source="in",outcome="{outcome}"}}"#
        ))
        .copied()
        .unwrap_or(0.0)
}

/// The source as `GET /v1/sources` describes it (the tests configure one).
pub fn source_state(base: &str) -> Value {
    request(base, "GET", "/v1/sources", None, None).json["sources"][0].clone()
}

/// The sink `out` as `GET /v1/sinks` describes it.
pub fn sink_state(base: &str) -> Value {
    let sinks = request(base, "GET", "/v1/sinks", None, None);
    let sinks = sinks.json["sinks"].as_array().unwrap().clone();
    sinks.into_iter().find(|s| s["name"] == "out").unwrap()
}

/// The sorted bodies of `got`.
pub fn bodies<M>(got: &[Got<M>]) -> Vec<String> {
    let mut bodies: Vec<_> = got.iter().map(|g| g.body.clone()).collect();
    bodies.sort();
    bodies
}

/// Publishes `count` requests `order I` due 1–3 s ahead, each with a header `trace: tI` (and with
/// `keyed`, the key `kI`); returns when each is due.
pub fn publish_orders(mq: &mut impl Mq, count: i64, keyed: bool) -> BTreeMap<String, i64> {
    let target = mq.target();
    let mut due = BTreeMap::new();
    for i in 0..count {
        let delay_ms = 1000 + i * 2000 / count;
        let published = now_ms();
        let delay = format!("{delay_ms}ms");
        let trace = format!("t{i}");
        let headers = [
            ("delayd-delay", delay.as_str()),
            ("delayd-target", target.as_str()),
            ("trace", trace.as_str()),
        ];
        let body = format!("order {i}");
        if keyed {
            mq.publish_keyed(&format!("k{i}"), &headers, &body);
        } else {
            mq.publish(&headers, &body);
        }
        due.insert(body, published + delay_ms);
    }
    due
}

/// Publishes `count` requests for the target due `delay` ahead, without keys, with the bodies
/// `PREFIX 0`, `PREFIX 1`, ...
pub fn publish_numbered(mq: &mut impl Mq, count: usize, delay: &str, prefix: &str) {
    let target = mq.target();
    for i in 0..count {
        mq.publish(
            &[("delayd-delay", delay), ("delayd-target", &target)],
            &format!("{prefix} {i}"),
        );
    }
}

/// The headers of a request that delayd consumes on every MQ: none reaches the target.
const CONSUMED_ON_EVERY_MQ: [&str; 3] = ["delayd-delay", "delayd-target", "delayd-source-position"];

/// The messages `due` (body → unix ms) arrive at the target, none early, each without the headers
/// delayd consumes (those of [`CONSUMED_ON_EVERY_MQ`], and the MQ's own forms in `consumed`), an
/// `order I` with its `trace: tI`, and with a `delayd-id` the HTTP API knows as delivered (`check`
/// checks what the MQ adds, against that status); every request is acknowledged and counted as
/// scheduled, and the source and the sink are connected. `how` says how arrivals were timed. Returns
/// what arrived.
pub fn assert_arrive_on_time<M: Mq>(
    mq: &mut M,
    base: &str,
    due: &BTreeMap<String, i64>,
    consumed: &[&str],
    how: &str,
    mut check: impl FnMut(&Got<M::Own>, &Value),
) -> Vec<Got<M::Own>> {
    let got = mq.read_target(due.len(), Duration::from_secs(30));
    assert_eq!(got.len(), due.len(), "{got:?}");
    for message in &got {
        for name in CONSUMED_ON_EVERY_MQ.iter().chain(consumed) {
            assert!(
                !message.headers.contains_key(*name),
                "{name} in {message:?}"
            );
        }
        if let Some(i) = message.body.strip_prefix("order ") {
            assert_eq!(message.headers["trace"], format!("t{i}"), "{message:?}");
        }
        let status = settled_message(base, message.id());
        assert_eq!(status.json["status"], "delivered", "{}", status.json);
        check(message, &status.json);
    }
    assert_none_early(got.iter().map(|m| (m.body.as_str(), m.at_ms)), due, how);
    wait_for(
        "every request acknowledged",
        Duration::from_secs(10),
        || mq.all_acknowledged(),
    );
    let source = source_state(base);
    assert_eq!(source["name"], "in", "{source}");
    assert_eq!(source["connected"], true, "{source}");
    let metrics = scrape(base);
    assert_eq!(
        metrics[r#"delayd_source_messages_total{source="in",outcome="scheduled"}"#],
        due.len() as f64
    );
    assert_eq!(metrics[r#"delayd_source_connected{source="in"}"#], 1.0);
    assert_eq!(metrics[r#"delayd_sink_connected{sink="out"}"#], 1.0);
    got
}

/// The bad requests every MQ's source refuses alike, as (headers, the dead letter's code): one without
/// a target, one without a delivery time for `target`, one whose delay is not one.
pub fn bad_requests_of_every_mq(target: &str) -> Vec<(Vec<(&str, &str)>, &'static str)> {
    vec![
        (vec![("delayd-delay", "1s")], "missing_target"),
        (vec![("delayd-target", target)], "missing_deliver_time"),
        (
            vec![("delayd-target", target), ("delayd-delay", "soon")],
            "invalid_delay",
        ),
    ]
}

/// Publishes the `bad` requests (headers, the dead letter's code) with the body `bad`, then
/// [`assert_dead_letters_and_cancel_by_key`] with their codes.
pub fn assert_bad_requests_dead_and_cancels_by_key_hold(
    mq: &mut impl Mq,
    base: &str,
    bad: &[(Vec<(&str, &str)>, &str)],
    counts: (f64, f64, f64),
) {
    for (headers, _) in bad {
        mq.publish(headers, "bad");
    }
    let codes: Vec<&str> = bad.iter().map(|(_, code)| *code).collect();
    assert_dead_letters_and_cancel_by_key(mq, base, &codes, counts);
}

/// After the caller published its bad requests (body `bad`, one for each code in `codes`): a message
/// keyed `o-1`, its cancel by target and key, and a sentinel due half a second after it. Only the
/// sentinel arrives, every request is acknowledged, the bad ones are dead letters with their codes, and
/// the source counts `(dead, cancelled, scheduled)` as `counts`.
pub fn assert_dead_letters_and_cancel_by_key(
    mq: &mut impl Mq,
    base: &str,
    codes: &[&str],
    counts: (f64, f64, f64),
) {
    let target = mq.target();
    let target = target.as_str();
    mq.publish_keyed(
        "o-1",
        &[("delayd-delay", "2s"), ("delayd-target", target)],
        "cancel me",
    );
    mq.publish(
        &[
            ("delayd-target", target),
            ("delayd-key", "o-1"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    mq.publish(
        &[("delayd-delay", "2500ms"), ("delayd-target", target)],
        "sentinel",
    );
    let got = mq.read_target(1, Duration::from_secs(30));
    assert_eq!(bodies(&got), ["sentinel"]);
    // Nothing else comes: the cancelled one was due half a second before the sentinel.
    assert_eq!(mq.read_target(2, Duration::from_millis(500)).len(), 1);
    wait_for(
        "every request acknowledged",
        Duration::from_secs(10),
        || mq.all_acknowledged(),
    );
    assert_dead_letters(base, "bad", codes);
    let count = |outcome| source_count(base, outcome);
    assert_eq!(
        (count("dead"), count("cancelled"), count("scheduled")),
        counts
    );
}

/// Each body read with the ids it came under: a body under two ids was scheduled twice; one id read
/// twice is a delivery repeated (in flight at a kill).
pub fn ids_by_body<M>(got: &[Got<M>]) -> BTreeMap<String, BTreeSet<String>> {
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for message in got {
        ids.entry(message.body.clone())
            .or_default()
            .insert(message.id().to_string());
    }
    ids
}

/// Asserts that `total` different bodies were read, each under one id (delivered, none scheduled
/// twice).
pub fn assert_each_scheduled_once<M>(got: &[Got<M>], total: usize) {
    let ids = ids_by_body(got);
    assert_eq!(ids.len(), total, "every request delivered");
    let twice: Vec<_> = ids.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(twice.is_empty(), "scheduled twice: {twice:?}");
}

/// Exactly `count` messages with different bodies reach the target: they come, and nothing more
/// within a second.
pub fn assert_each_delivered_once(mq: &mut impl Mq, count: usize) {
    let got = mq.read_target(count, Duration::from_secs(30));
    assert_eq!(got.len(), count);
    assert_eq!(
        mq.read_target(count + 1, Duration::from_secs(1)).len(),
        count,
        "nothing more: each once"
    );
    let mut distinct = bodies(&got);
    distinct.dedup();
    assert_eq!(distinct.len(), count);
}

/// The MQ going away mid-run loses nothing: a request due `before_delay` ahead is taken and
/// acknowledged; the MQ stops; the source (where it reports it) and the sink say they are down while
/// delayd keeps serving HTTP; once the MQ is back, the request due meanwhile and one published after
/// are both delivered, and the source and the sink are up again.
pub fn assert_outage_loses_nothing(mq: &mut impl Mq, base: &str, before_delay: &str) {
    let target = mq.target();
    mq.publish(
        &[("delayd-delay", before_delay), ("delayd-target", &target)],
        "before",
    );
    // Scheduled first: a Redis group, a NATS consumer exists once the source counted a request.
    wait_for(
        "the request to be acknowledged",
        Duration::from_secs(20),
        || source_count(base, "scheduled") == 1.0 && mq.all_acknowledged(),
    );
    mq.stop();
    if mq.source_notices_outage() {
        wait_for("the source to notice", Duration::from_secs(20), || {
            source_state(base)["connected"] == false
        });
    }
    // The message falls due while the MQ is away: the sink fails and retries.
    wait_for("the sink to notice", Duration::from_secs(60), || {
        sink_state(base)["connected"] == false
    });
    assert_eq!(request(base, "GET", "/readyz", None, None).status, 200);
    let http = request(
        base,
        "POST",
        "/v1/messages",
        Some(r#"{"topic": "http", "body": "still here", "delay": 0}"#),
        None,
    );
    assert_eq!(http.status, 201, "{}", http.json);
    mq.restart();
    mq.publish(
        &[("delayd-delay", "500ms"), ("delayd-target", &target)],
        "after",
    );
    let got = mq.read_target(2, Duration::from_secs(60));
    assert_eq!(bodies(&got), ["after", "before"]);
    if mq.source_notices_outage() {
        wait_for("the source to reconnect", Duration::from_secs(20), || {
            source_state(base)["connected"] == true
        });
    }
    wait_for("the sink to be up", Duration::from_secs(20), || {
        sink_state(base)["connected"] == true
    });
}
