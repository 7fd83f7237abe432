//! The NATS JetStream sidecar end to end: the real `delayd` binary beside a real `nats-server -js`
//! (Debian's package), started by each test on a free loopback port with its own store directory, and
//! stopped on drop. Requests are published to the source stream as an application would (JetStream
//! publish, PubAck awaited); an independent consumer reads the target stream `OUT` (`orders.>`).
//!
//! Without `nats-server` a test prints why it is skipped, and fails under `CI=true`.

use super::common::sidecar::{
    assert_arrive_on_time, assert_bad_requests_dead_and_cancels_by_key_hold,
    assert_each_delivered_once, assert_outage_loses_nothing, bad_requests_of_every_mq, bodies,
    client_runtime, publish_numbered, publish_orders, source_count, source_state,
    spawn_with_config as start_delayd, Got, Mq,
};
use super::common::{
    self, assert_dead_letters, free_port, now_ms, request, server_installed, wait_for, write_file,
    Process,
};
use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// Users for the crash test: `noack` may not publish acks.
const USERS: &str = r#"authorization {
  users: [
    {user: delayd, password: secret}
    {user: noack, password: secret, permissions: {publish: {deny: ["$JS.ACK.>"]}}}
  ]
}
"#;

/// A `nats-server -js` for one test, stopped on drop; with a client of its own (user `delayd`).
struct NatsServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    runtime: tokio::runtime::Runtime,
    client: Option<async_nats::Client>,
}

impl NatsServer {
    /// Starts one, or says why not (and fails under CI, where it must exist).
    fn start(dir: &Path) -> Option<NatsServer> {
        if !server_installed("nats-server", "apt-get install -y nats-server") {
            return None;
        }
        let runtime = client_runtime();
        let mut server = NatsServer {
            child: None,
            port: free_port(),
            dir: dir.to_path_buf(),
            runtime,
            client: None,
        };
        server.run();
        Some(server)
    }

    /// Starts the process on its port and store directory (again, after a stop) and waits until
    /// JetStream answers.
    fn run(&mut self) {
        let config = self.dir.join("nats.conf");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\njetstream {{ store_dir: {store:?} }}\n{USERS}",
                port = self.port,
                store = self.dir.join("nats").display().to_string()
            ),
        )
        .unwrap();
        self.child = Some(
            Command::new("nats-server")
                .arg("-c")
                .arg(&config)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let url = format!("nats://127.0.0.1:{}", self.port);
        let deadline = Instant::now() + Duration::from_secs(20);
        self.client = Some(loop {
            let ready = self.runtime.block_on(async {
                let client = async_nats::ConnectOptions::with_user_and_password(
                    "delayd".into(),
                    "secret".into(),
                )
                .connect(&url)
                .await?;
                // JetStream's account info (raw: this client's typed answer wants newer fields).
                let info = client.request("$JS.API.INFO", "".into()).await?;
                let info: serde_json::Value = serde_json::from_slice(&info.payload)?;
                if info.get("error").is_some() {
                    return Err(format!("JetStream is not ready: {info}").into());
                }
                Ok::<_, async_nats::Error>(client)
            });
            match ready {
                Ok(client) => break client,
                Err(e) => assert!(Instant::now() < deadline, "nats-server did not start: {e}"),
            }
            std::thread::sleep(Duration::from_millis(20));
        });
    }

    fn url(&self, user: &str) -> String {
        format!("nats://{user}:secret@127.0.0.1:{}", self.port)
    }

    fn jetstream(&self) -> jetstream::Context {
        let _runtime = self.runtime.enter();
        jetstream::new(self.client.clone().unwrap())
    }

    /// Makes the stream `name` over the subjects `subject`, unless it exists.
    fn create_stream(&self, name: &str, subject: &str) {
        let js = self.jetstream();
        self.runtime
            .block_on(js.get_or_create_stream(stream::Config {
                name: name.into(),
                subjects: vec![subject.into()],
                ..Default::default()
            }))
            .unwrap();
    }

    /// The target stream the sink publishes to.
    fn create_target_stream(&self) {
        self.create_stream("OUT", "orders.>");
    }

    /// Requests delivered to delayd's consumer and not acknowledged, and requests not yet delivered;
    /// `None` before delayd made its consumer.
    fn unacknowledged(&self) -> Option<(usize, u64)> {
        let js = self.jetstream();
        self.runtime.block_on(async {
            let mut consumer: consumer::PullConsumer =
                js.get_consumer_from_stream("delayd", "DELAYS").await.ok()?;
            let info = consumer.info().await.unwrap();
            Some((info.num_ack_pending, info.num_pending))
        })
    }

    /// Whether JetStream has a stream of this name.
    fn stream_exists(&self, name: &str) -> bool {
        let js = self.jetstream();
        self.runtime.block_on(js.get_stream(name)).is_ok()
    }

    fn delete_stream(&self, name: &str) {
        let js = self.jetstream();
        self.runtime.block_on(js.delete_stream(name)).unwrap();
    }

    /// [`NatsServer::start`], with the target stream and the source stream made, for requests
    /// published before delayd first runs.
    fn start_with_streams(dir: &Path) -> Option<NatsServer> {
        let nats = NatsServer::start(dir)?;
        nats.create_target_stream();
        nats.create_source_stream();
        Some(nats)
    }

    /// The source stream as delayd creates it, for requests published before delayd first runs.
    fn create_source_stream(&self) {
        self.create_stream("DELAYS", "delayd.>");
    }

    /// Publishes a request on `subject` of the source stream and waits for its PubAck.
    fn publish_on(&self, subject: &str, headers: &[(&str, &str)], body: &str) {
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in headers {
            map.append(*name, *value);
        }
        let js = self.jetstream();
        self.runtime
            .block_on(async {
                js.publish_with_headers(subject.to_string(), map, body.to_string().into())
                    .await?
                    .await
            })
            .unwrap();
    }

    /// A core NATS subscription on `subject`, registered with the server once this returns: it sees
    /// what the sink publishes there as it arrives.
    fn subscribe(&self, subject: &str) -> async_nats::Subscriber {
        let client = self.client.clone().unwrap();
        self.runtime.block_on(async {
            let subscriber = client.subscribe(subject.to_string()).await.unwrap();
            client.flush().await.unwrap();
            subscriber
        })
    }

    /// What `subscriber` receives, each timed at its arrival, until `enough` holds for what came
    /// (panics when it does not within `within`).
    fn receive_until(
        &self,
        subscriber: &mut async_nats::Subscriber,
        within: Duration,
        mut enough: impl FnMut(&[Got<String>]) -> bool,
    ) -> Vec<Got<String>> {
        self.runtime.block_on(async {
            let deadline = tokio::time::Instant::now() + within;
            let mut got = Vec::new();
            while !enough(&got) {
                let message = tokio::time::timeout_at(deadline, subscriber.next())
                    .await
                    .unwrap_or_else(|_| panic!("not enough within {within:?}: {got:#?}"))
                    .unwrap();
                let at_ms = now_ms();
                let mut headers = BTreeMap::new();
                for (name, values) in message.headers.iter().flat_map(|h| h.iter()) {
                    let values: Vec<&str> = values.iter().map(|v| v.as_str()).collect();
                    headers.insert(name.to_string(), values.join(","));
                }
                got.push(Got {
                    headers,
                    body: String::from_utf8(message.payload.to_vec()).unwrap(),
                    at_ms,
                    mq: message.subject.to_string(),
                });
            }
            got
        })
    }
}

/// Requests are published to `delayd.in` (stream `DELAYS`); the target is the stream `OUT`
/// (`orders.>`), and a message read from it carries its subject.
impl Mq for NatsServer {
    type Own = String;

    fn target(&self) -> String {
        "orders.out".into()
    }

    /// Publishes a request to the source stream (`delayd.in`) and waits for its PubAck.
    fn publish(&mut self, headers: &[(&str, &str)], body: &str) {
        self.publish_on("delayd.in", headers, body);
    }

    /// Reads the target stream from its start until `count` messages came or `within` passed.
    fn read_target(&mut self, count: usize, within: Duration) -> Vec<Got<String>> {
        let js = self.jetstream();
        self.runtime.block_on(async {
            let stream = js.get_stream("OUT").await.unwrap();
            let reader: consumer::PullConsumer = stream
                .create_consumer(consumer::pull::Config {
                    ack_policy: consumer::AckPolicy::None,
                    inactive_threshold: Duration::from_secs(30),
                    ..Default::default()
                })
                .await
                .unwrap();
            let mut messages = reader.messages().await.unwrap();
            let deadline = tokio::time::Instant::now() + within;
            let mut got = Vec::new();
            while got.len() < count {
                let Ok(Some(message)) = tokio::time::timeout_at(deadline, messages.next()).await
                else {
                    break;
                };
                let message = message.unwrap();
                let at_ms = now_ms();
                let mut headers = BTreeMap::new();
                for (name, values) in message.headers.iter().flat_map(|h| h.iter()) {
                    let values: Vec<&str> = values.iter().map(|v| v.as_str()).collect();
                    headers.insert(name.to_string(), values.join(","));
                }
                got.push(Got {
                    headers,
                    body: String::from_utf8(message.payload.to_vec()).unwrap(),
                    at_ms,
                    mq: message.subject.to_string(),
                });
            }
            got
        })
    }

    fn all_acknowledged(&mut self) -> bool {
        self.unacknowledged() == Some((0, 0))
    }

    /// Stops it gracefully (SIGTERM: JetStream flushes its store) and waits.
    fn stop(&mut self) {
        self.client = None;
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    fn restart(&mut self) {
        self.stop();
        self.run();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A config with a NATS source `in` (stream `DELAYS`, subjects `delayd.>`) feeding a NATS sink `out`,
/// both as `user`.
fn config(dir: &Path, nats: &NatsServer, user: &str, ack_wait: &str) -> PathBuf {
    let text = format!(
        "[sinks.out]\nkind = \"nats\"\nurl = \"{url}\"\nbackoff_initial = \"100ms\"\nbackoff_cap = \"1s\"\n\n\
         [sources.in]\nkind = \"nats\"\nurl = \"{url}\"\nstream = \"DELAYS\"\nsubject = \"delayd.>\"\n\
         group = \"delayd\"\nack_wait = \"{ack_wait}\"\nsink = \"out\"\n",
        url = nats.url(user)
    );
    write_file(dir, &format!("delayd-{user}.toml"), &text)
}

/// delayd on `dir`'s `data` with [`config`] as `user`.
fn start_delayd_as(dir: &Path, nats: &NatsServer, user: &str, ack_wait: &str) -> Process {
    start_delayd(&dir.join("data"), &config(dir, nats, user, ack_wait))
}

/// A test's directory, a `nats-server` in it with both streams, and delayd on it as the user `delayd`
/// (whose acks pass); None without nats-server. (Bound in this order, delayd is dropped first and the
/// directory last.)
fn nats_and_delayd() -> Option<(TempDir, NatsServer, Process)> {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_with_streams(dir.path())?;
    let delayd = start_delayd_as(dir.path(), &nats, "delayd", "60s");
    Some((dir, nats, delayd))
}

/// delayd as the user `noack` (`ack_wait` 2 s), once it scheduled the `count` requests published
/// before it started and failed to acknowledge them: they are durable in delayd and not in JetStream.
fn start_delayd_whose_acks_fail(dir: &Path, nats: &NatsServer, count: u32) -> Process {
    let delayd = start_delayd_as(dir, nats, "noack", "2s");
    wait_for(
        "the requests to be scheduled",
        Duration::from_secs(30),
        || source_count(&delayd.base, "scheduled") == f64::from(count),
    );
    wait_for("the failed ack", Duration::from_secs(30), || {
        source_state(&delayd.base)["last_error"].as_str().is_some()
    });
    delayd
}

/// RFC 3339 (UTC, whole seconds) for unix ms.
fn rfc3339(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(ms / 1000)
        .unwrap()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

/// Requests due 1–3 s ahead arrive at their target subject, none early, with the application's headers,
/// without delayd's, with `delayd-id` = `Nats-Msg-Id`, which the HTTP API knows as delivered; a request
/// in NATS 2.12's form (`Nats-Schedule: @at ...`, `Nats-Schedule-Target`) too.
#[test]
fn requests_through_nats_arrive_on_time_with_their_headers() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut nats) = NatsServer::start(dir.path()) else {
        return;
    };
    nats.create_target_stream();
    let delayd = start_delayd_as(dir.path(), &nats, "delayd", "60s");
    // delayd creates the source stream.
    wait_for("the source to connect", Duration::from_secs(30), || {
        source_state(&delayd.base)["connected"] == true
    });
    let mut due = publish_orders(&mut nats, 30, false);
    // One in NATS 2.12's message-scheduling form, due at a whole second 2–3 s ahead.
    let at_ms = (now_ms() / 1000 + 3) * 1000;
    nats.publish(
        &[
            ("Nats-Schedule", &format!("@at {}", rfc3339(at_ms))),
            ("Nats-Schedule-Target", "orders.migrated"),
        ],
        "migrated",
    );
    due.insert("migrated".into(), at_ms);
    let consumed = ["Nats-Schedule", "Nats-Schedule-Target"];
    let how = "as this consumer received them";
    assert_arrive_on_time(
        &mut nats,
        &delayd.base,
        &due,
        &consumed,
        how,
        |message, status| {
            let subject = &message.mq;
            if message.body == "migrated" {
                assert_eq!(subject, "orders.migrated");
            } else {
                assert_eq!(subject, "orders.out");
            }
            assert_eq!(message.headers["Nats-Msg-Id"], message.id());
            assert_eq!(status["topic"], subject.as_str());
        },
    );
    assert_eq!(source_state(&delayd.base)["kind"], "nats");
}

/// A request that cannot be scheduled is a dead letter with its reason, acknowledged, never delivered;
/// a cancel by target and key keeps its message from being delivered.
#[test]
fn bad_nats_requests_are_dead_letters_and_cancels_by_key_hold() {
    let Some((_dir, mut nats, delayd)) = nats_and_delayd() else {
        return;
    };
    let mut bad = bad_requests_of_every_mq("orders.out");
    bad.extend([
        // Published with delayd's rights, it would delete the source's own stream.
        (
            vec![
                ("delayd-delay", "1s"),
                ("delayd-target", "$JS.API.STREAM.DELETE.DELAYS"),
            ],
            "forbidden_target",
        ),
        (
            vec![
                ("delayd-target", "orders.out"),
                ("delayd-delay", "1s"),
                ("Nats-Schedule", "@at 2026-01-01T00:00:00Z"),
            ],
            "conflicting_time_fields",
        ),
        // Recurring forms (on a subject of their own, as a schedule is the subject's) that are refused.
        (
            vec![
                ("Nats-Schedule-Target", "orders.out"),
                ("Nats-Schedule", "0 9 * * *"),
            ],
            "invalid_cron",
        ),
        (
            vec![
                ("Nats-Schedule-Target", "orders.out"),
                ("Nats-Schedule", "@every 5m"),
                ("Nats-Schedule-Time-Zone", "Europe/Berlin"),
            ],
            "invalid_tz",
        ),
    ]);
    let counts = (bad.len() as f64, 1.0, 2.0);
    assert_bad_requests_dead_and_cancels_by_key_hold(&mut nats, &delayd.base, &bad, counts);
    // The same through HTTP: refused.
    let sent = request(
        &delayd.base,
        "POST",
        "/v1/messages",
        Some(
            r#"{"topic": "$JS.API.STREAM.DELETE.DELAYS", "sink": "out", "body": "b", "delay": 0}"#,
        ),
        None,
    );
    sent.assert_problem(400, "forbidden_target");
    assert!(
        nats.stream_exists("DELAYS"),
        "the source's stream is still there"
    );
    // A subject no stream captures has no responders: retried, and the reason says why.
    let sent = request(
        &delayd.base,
        "POST",
        "/v1/messages",
        Some(r#"{"topic": "nowhere.x", "sink": "out", "body": "b", "delay": 0}"#),
        None,
    );
    assert_eq!(sent.status, 201, "{}", sent.json);
    let path = format!("/v1/messages/{}", sent.json["id"].as_str().unwrap());
    wait_for("the retry's reason", Duration::from_secs(10), || {
        let status = request(&delayd.base, "GET", &path, None, None);
        status.json["status"] == "retrying"
            && status.json["reason"]
                .as_str()
                .is_some_and(|r| r.contains("no stream captures"))
    });
    // A wildcard is never a publish subject: dead at once.
    let sent = request(
        &delayd.base,
        "POST",
        "/v1/messages",
        Some(r#"{"topic": "orders.*", "sink": "out", "body": "b", "delay": 0}"#),
        None,
    );
    assert_eq!(sent.status, 201, "{}", sent.json);
    let path = format!("/v1/messages/{}", sent.json["id"].as_str().unwrap());
    wait_for("the wildcard to be dead", Duration::from_secs(10), || {
        request(&delayd.base, "GET", &path, None, None).json["status"] == "dead"
    });
}

/// The worst moment for a crash: requests are durable in delayd and not acknowledged to JetStream (here
/// delayd's NATS user may not publish acks, so every ack fails, and delayd is killed with SIGKILL).
/// Restarted as a user that may, delayd gets the requests again once their `ack_wait` passed, recognises
/// them by their stream sequences and schedules each once.
#[test]
fn a_crash_between_the_fsync_and_the_jetstream_ack_schedules_each_request_once() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut nats) = NatsServer::start_with_streams(dir.path()) else {
        return;
    };
    let count = 20;
    publish_numbered(&mut nats, count as usize, "3s", "once");
    let mut delayd = start_delayd_whose_acks_fail(dir.path(), &nats, count);
    // The acks failed (denied, then timed out), and none is recorded.
    assert_eq!(nats.unacknowledged(), Some((count as usize, 0)));
    delayd.kill();
    let delayd = start_delayd_as(dir.path(), &nats, "delayd", "2s");
    wait_for(
        "the redelivered requests to be recognised",
        Duration::from_secs(30),
        // At least: a request whose ack_wait ran out again before its ack (a busy machine) comes once more.
        || source_count(&delayd.base, "duplicate") >= f64::from(count),
    );
    assert_each_delivered_once(&mut nats, count as usize);
    wait_for("the acknowledgements", Duration::from_secs(10), || {
        nats.all_acknowledged()
    });
    assert_eq!(source_count(&delayd.base, "scheduled"), 0.0);
}

/// A stream deleted and made again starts its sequences at 1 again. Its requests are new ones: neither
/// taken for redeliveries of the old stream's requests still unacknowledged (here durable in delayd,
/// never acknowledged, delayd killed, and the stream made again meanwhile) nor ordered against them (a
/// cancel in the new stream cancels the message an old request gave its key).
#[test]
fn a_stream_made_again_starts_a_new_order_of_positions() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut nats) = NatsServer::start_with_streams(dir.path()) else {
        return;
    };
    // Due after the restart (the failed acks take seconds), the keyed one first.
    publish_numbered(&mut nats, 3, "15s", "old");
    nats.publish(
        &[
            ("delayd-delay", "14s"),
            ("delayd-target", "orders.out"),
            ("delayd-key", "k"),
        ],
        "old keyed",
    );
    let mut delayd = start_delayd_whose_acks_fail(dir.path(), &nats, 4);
    delayd.kill();
    nats.delete_stream("DELAYS");
    nats.create_source_stream();
    // Sequences 1 to 4 again: the cancel, then three new requests.
    nats.publish(
        &[
            ("delayd-target", "orders.out"),
            ("delayd-key", "k"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    publish_numbered(&mut nats, 3, "1s", "new");
    let delayd = start_delayd_as(dir.path(), &nats, "delayd", "2s");
    let got = nats.read_target(6, Duration::from_secs(60));
    // (The cancelled one was due a second before the old ones.)
    assert_eq!(
        bodies(&got),
        ["new 0", "new 1", "new 2", "old 0", "old 1", "old 2"]
    );
    assert_eq!(nats.read_target(7, Duration::from_millis(500)).len(), 6);
    assert_eq!(
        (
            source_count(&delayd.base, "scheduled"),
            source_count(&delayd.base, "cancelled"),
            source_count(&delayd.base, "duplicate")
        ),
        (3.0, 1.0, 0.0)
    );
}

/// nats-server going away mid-run: delayd keeps serving HTTP and says the source and sink are down; once
/// the server is back (same port, same store), what was scheduled before and what is published after is
/// delivered.
#[test]
fn nats_restarted_mid_run_loses_nothing() {
    let Some((_dir, mut nats, delayd)) = nats_and_delayd() else {
        return;
    };
    assert_outage_loses_nothing(&mut nats, &delayd.base, "6s");
}

/// The schedules as `GET /v1/schedules` lists them.
fn schedules(base: &str) -> Vec<serde_json::Value> {
    let listed = request(base, "GET", "/v1/schedules", None, None);
    assert_eq!(listed.status, 200, "{}", listed.json);
    listed.json["schedules"].as_array().unwrap().clone()
}

/// The one schedule there is.
fn only_schedule(base: &str) -> serde_json::Value {
    let listed = schedules(base);
    assert_eq!(listed.len(), 1, "{listed:?}");
    listed[0].clone()
}

/// The nominal fire time of each firing of `id` in `got` with `body` (RFC 3339 in `delayd-fire-at`,
/// as unix ms), checking that each arrived on `orders.tick` no earlier than it, with the request's
/// headers passed on and the ones delayd read taken off.
fn fire_times(got: &[Got<String>], id: &str, body: &str) -> Vec<i64> {
    let mut times = Vec::new();
    for firing in got.iter().filter(|g| g.body == body) {
        assert_eq!(firing.mq, "orders.tick");
        assert_eq!(firing.headers["delayd-schedule"], id, "{firing:?}");
        let fire_at = common::parse(&serde_json::json!(firing.headers["delayd-fire-at"]));
        assert!(
            firing.at_ms >= fire_at,
            "a firing arrived {} ms before its fire time: {firing:?}",
            fire_at - firing.at_ms
        );
        for read in [
            "Nats-Schedule",
            "Nats-Schedule-Target",
            "Nats-Schedule-Time-Zone",
        ] {
            assert!(!firing.headers.contains_key(read), "{read} in {firing:?}");
        }
        assert_eq!(firing.headers["trace"], "t1", "{firing:?}");
        times.push(fire_at);
    }
    let distinct: std::collections::BTreeSet<i64> = times.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        times.len(),
        "one firing per fire time: {times:?}"
    );
    times
}

/// ADR-51's recurring forms: `Nats-Schedule: @every 1s` on `delayd.in.tick` makes one schedule for
/// that subject, whose firings (`delayd-schedule`, `delayd-fire-at`) arrive at the target, none
/// before its fire time; the next request on the subject (a 6-field cron in a zone) replaces it, and
/// one with a bad cron is a dead letter that leaves it as it is.
#[test]
fn a_recurring_request_makes_the_subjects_schedule_and_the_next_one_replaces_it() {
    let Some((_dir, nats, delayd)) = nats_and_delayd() else {
        return;
    };
    let base = &delayd.base;
    let id = "nats.in.delayd.in.tick";
    let mut arrivals = nats.subscribe("orders.tick");
    nats.publish_on(
        "delayd.in.tick",
        &[
            ("Nats-Schedule", "@every 1s"),
            ("Nats-Schedule-Target", "orders.tick"),
            ("trace", "t1"),
        ],
        "tick",
    );
    let ticks = nats.receive_until(&mut arrivals, Duration::from_secs(30), |got| got.len() >= 3);
    let tick_times = fire_times(&ticks, id, "tick");
    assert_eq!(tick_times.len(), 3, "{ticks:?}");
    let schedule = only_schedule(base);
    assert_eq!(
        (
            &schedule["id"],
            &schedule["every"],
            &schedule["cron"],
            &schedule["topic"],
            &schedule["sink"],
            &schedule["body"]
        ),
        (
            &serde_json::json!(id),
            &serde_json::json!("1s"),
            &serde_json::Value::Null,
            &serde_json::json!("orders.tick"),
            &serde_json::json!("out"),
            &serde_json::json!("tick")
        ),
        "{schedule}"
    );
    // An interval: its fire times are whole periods apart.
    assert!(tick_times.windows(2).all(|w| (w[1] - w[0]) % 1000 == 0));
    wait_for("the request acknowledged", Duration::from_secs(10), || {
        nats.unacknowledged() == Some((0, 0))
    });

    // The next request on the subject replaces the schedule: a cron with seconds, in a zone.
    nats.publish_on(
        "delayd.in.tick",
        &[
            ("Nats-Schedule", "*/2 * * * * *"),
            ("Nats-Schedule-Time-Zone", "Europe/Berlin"),
            ("Nats-Schedule-Target", "orders.tick"),
            ("trace", "t1"),
        ],
        "tock",
    );
    wait_for("the replacement", Duration::from_secs(30), || {
        only_schedule(base)["cron"] == "*/2 * * * * *"
    });
    let replaced_ms = now_ms();
    let schedule = only_schedule(base);
    assert_eq!(
        (&schedule["id"], &schedule["tz"], &schedule["every"]),
        (
            &serde_json::json!(id),
            &serde_json::json!("Europe/Berlin"),
            &serde_json::Value::Null
        )
    );
    let after = nats.receive_until(&mut arrivals, Duration::from_secs(30), |got| {
        got.iter().filter(|g| g.body == "tock").count() >= 2
    });
    // The interval's firings still arriving were due before the replacement.
    for tick in fire_times(&after, id, "tick") {
        assert!(tick <= replaced_ms, "a tick due after the replacement");
    }
    let tock_times = fire_times(&after, id, "tock");
    // Every other second of Berlin's wall clock (an offset of whole hours): even UTC seconds.
    assert!(tock_times.iter().all(|at| at % 2000 == 0), "{tock_times:?}");

    // A bad cron on the subject is a dead letter; the schedule stays as it was.
    nats.publish_on(
        "delayd.in.tick",
        &[
            ("Nats-Schedule", "0 0 99 * * *"),
            ("Nats-Schedule-Target", "orders.tick"),
        ],
        "bad",
    );
    assert_dead_letters(base, "bad", &["invalid_cron"]);
    let schedule = only_schedule(base);
    assert_eq!(
        (&schedule["cron"], &schedule["body"]),
        (
            &serde_json::json!("*/2 * * * * *"),
            &serde_json::json!("tock")
        )
    );
    wait_for(
        "every request acknowledged",
        Duration::from_secs(10),
        || nats.unacknowledged() == Some((0, 0)),
    );
    assert_eq!(
        (
            source_count(base, "recurring"),
            source_count(base, "dead"),
            source_count(base, "scheduled")
        ),
        (2.0, 1.0, 0.0)
    );
}

/// A recurring request durable in delayd and never acknowledged (delayd's acks fail, then it is
/// killed) comes again after the restart and changes nothing: the schedule keeps the definition it
/// was made with (its `created_at`, from which an interval counts its phase).
#[test]
fn a_recurring_request_delivered_again_after_a_crash_is_put_once() {
    let dir = tempfile::tempdir().unwrap();
    let Some(nats) = NatsServer::start_with_streams(dir.path()) else {
        return;
    };
    nats.publish_on(
        "delayd.in.tick",
        &[
            ("Nats-Schedule", "@every 1h"),
            ("Nats-Schedule-Target", "orders.tick"),
        ],
        "hourly",
    );
    let mut delayd = start_delayd_as(dir.path(), &nats, "noack", "2s");
    wait_for("the schedule put", Duration::from_secs(30), || {
        source_count(&delayd.base, "recurring") == 1.0
    });
    wait_for("the failed ack", Duration::from_secs(30), || {
        source_state(&delayd.base)["last_error"].as_str().is_some()
    });
    let made = only_schedule(&delayd.base);
    assert_eq!(made["id"], "nats.in.delayd.in.tick", "{made}");
    assert_eq!(nats.unacknowledged(), Some((1, 0)));
    delayd.kill();
    let delayd = start_delayd_as(dir.path(), &nats, "delayd", "2s");
    wait_for("the redelivery recognised", Duration::from_secs(30), || {
        source_count(&delayd.base, "duplicate") >= 1.0
    });
    wait_for("the acknowledgement", Duration::from_secs(10), || {
        nats.unacknowledged() == Some((0, 0))
    });
    assert_eq!(source_count(&delayd.base, "recurring"), 0.0);
    let kept = only_schedule(&delayd.base);
    assert_eq!(
        (&kept["created_at"], &kept["every"], &kept["fired"]),
        (&made["created_at"], &made["every"], &made["fired"]),
        "{kept}"
    );
}
