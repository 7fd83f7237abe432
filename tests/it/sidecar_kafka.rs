//! The Kafka sidecar end to end: the real `delayd` binary beside a real Kafka-protocol broker, `tansu`
//! (a broker written in Rust: `cargo install tansu --version 0.6.0 --locked --features libsql`, which
//! `.ci/run` does when it is missing), started by each test on a free loopback port with its own SQLite
//! file, and killed on drop. Topics are created with the admin API (tansu creates none on use). Requests
//! are produced as an application would (idempotent producer, `acks=all`); an independent consumer
//! group reads the target topic.
//!
//! A watchdog process kills a test's broker when the test process is gone, however it ended; `.ci/run`
//! checks afterwards that no `tansu broker` is left. Without `tansu` a test prints why it is skipped,
//! and fails under `CI=true`.

use super::common::sidecar::{
    assert_arrive_on_time, assert_bad_requests_dead_and_cancels_by_key_hold,
    assert_each_scheduled_once, assert_outage_loses_nothing, bad_requests_of_every_mq,
    client_runtime, publish_numbered, publish_orders, source_count as count, spawn_watchdog,
    spawn_with_config as start_delayd, Got, Mq,
};
use super::common::{free_port, now_ms, request, server_installed, wait_for, write_file, Process};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tempfile::TempDir;

const INSTALL: &str = "cargo install tansu --version 0.6.0 --locked --features libsql";

/// The topic delayd's source reads, and the target the requests name.
const SOURCE: &str = "delayd-in";
const TARGET: &str = "orders-out";

/// A `tansu` broker for one test, killed on drop; with a producer of its own.
struct Tansu {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    runtime: tokio::runtime::Runtime,
    producer: Option<FutureProducer>,
    /// The reader of [`TARGET`] behind [`Mq::read_target`].
    target_reader: Option<Reader>,
}

impl Tansu {
    /// Starts one, or says why not (and fails under CI, where it must exist).
    fn start(dir: &Path) -> Option<Tansu> {
        if !server_installed("tansu", INSTALL) {
            return None;
        }
        let runtime = client_runtime();
        let mut tansu = Tansu {
            child: None,
            port: free_port(),
            dir: dir.to_path_buf(),
            runtime,
            producer: None,
            target_reader: None,
        };
        tansu.run();
        Some(tansu)
    }

    /// Starts the process on its port and database (again, after a stop) and waits until it answers.
    fn run(&mut self) {
        let listener = format!("tcp://127.0.0.1:{}", self.port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("tansu.log"))
            .unwrap();
        let child = Command::new("tansu")
            .args(["broker", "--listener-url", &listener])
            .args(["--advertised-listener-url", &listener])
            // A file path in the URL is taken relative to the working directory.
            .args(["--storage-engine", "sqlite://tansu.db"])
            .current_dir(&self.dir)
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        watch(child.id());
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let probe: rdkafka::consumer::BaseConsumer = self.config().create().unwrap();
            if probe
                .fetch_metadata(None, Duration::from_millis(500))
                .is_ok()
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "tansu did not start: {}",
                std::fs::read_to_string(self.dir.join("tansu.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.producer = Some(self.new_producer());
    }

    /// A producer as an application's: idempotent, `acks=all`.
    fn new_producer(&self) -> FutureProducer {
        self.config()
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .create()
            .unwrap()
    }

    fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", format!("127.0.0.1:{}", self.port))
            .set("log_level", "3");
        config
    }

    fn url(&self) -> String {
        format!("kafka://127.0.0.1:{}", self.port)
    }

    /// Creates topics with their partition counts.
    fn create_topics(&self, topics: &[(&str, i32)]) {
        let admin: AdminClient<_> = self.config().create().unwrap();
        let new: Vec<NewTopic> = topics
            .iter()
            .map(|(name, partitions)| NewTopic::new(name, *partitions, TopicReplication::Fixed(1)))
            .collect();
        let created = self
            .runtime
            .block_on(admin.create_topics(&new, &AdminOptions::new()))
            .unwrap();
        for one in created {
            one.unwrap();
        }
    }

    /// Deletes a topic and makes it again, with tansu's own command, and a new producer: a librdkafka
    /// client (2.x) that knew the topic crashes on tansu's metadata answer for the deleted topic
    /// (SIGSEGV in `rd_kafka_metadata_cache_find`), so none may be running.
    fn make_again(&mut self, topic: &str, partitions: u32) {
        self.producer = None;
        let broker = format!("tcp://127.0.0.1:{}", self.port);
        let partitions = partitions.to_string();
        for args in [
            vec!["topic", "delete", "--broker", &broker, topic],
            vec![
                "topic",
                "create",
                "--broker",
                &broker,
                "--partitions",
                &partitions,
                topic,
            ],
        ] {
            let output = Command::new("tansu").args(&args).output().unwrap();
            assert!(output.status.success(), "tansu {args:?}: {output:?}");
        }
        self.producer = Some(self.new_producer());
    }

    /// Produces a request and waits for its delivery report.
    fn produce(&self, topic: &str, key: Option<&str>, headers: &[(&str, &str)], body: &str) {
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(topic).payload(body).headers(owned);
        if let Some(key) = key {
            record = record.key(key);
        }
        let producer = self.producer.as_ref().unwrap();
        self.runtime
            .block_on(producer.send(record, Duration::from_secs(10)))
            .map_err(|(e, _)| e)
            .unwrap();
    }

    /// A consumer in a group of its own reading `topic` from its start, on the runtime's thread from
    /// now on (so that a record's arrival time is when it came); returns once it was assigned the
    /// topic's partitions.
    fn reader(&self, topic: &str) -> Reader {
        let _runtime = self.runtime.enter();
        let consumer: StreamConsumer = self
            .config()
            .set("group.id", format!("reader-{}", free_port()))
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", "10")
            .set("enable.partition.eof", "false")
            .create()
            .unwrap();
        consumer.subscribe(&[topic]).unwrap();
        let got: Arc<Mutex<Vec<Record>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (assigned_tx, assigned) = std::sync::mpsc::channel();
        let (done_tx, done) = std::sync::mpsc::channel();
        let (into, stopped) = (got.clone(), stop.clone());
        self.runtime.spawn(async move {
            let mut assigned_tx = Some(assigned_tx);
            while !stopped.load(Ordering::Relaxed) {
                let next = tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await;
                if consumer.assignment().is_ok_and(|a| a.count() > 0) {
                    if let Some(tx) = assigned_tx.take() {
                        let _ = tx.send(());
                    }
                }
                // A transient consumer error (the broker restarting) is not a record.
                let Ok(Ok(message)) = next else { continue };
                let headers = message
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| {
                                let value = h.value.unwrap_or_default().to_vec();
                                (h.key.to_string(), String::from_utf8(value).unwrap())
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let payload = message.payload().unwrap_or_default().to_vec();
                into.lock().unwrap().push(Got {
                    headers,
                    body: String::from_utf8(payload).unwrap(),
                    at_ms: now_ms(),
                    mq: message
                        .key()
                        .map(|k| String::from_utf8(k.to_vec()).unwrap()),
                });
            }
            // Closed (leaving its group) while the broker is still there.
            drop(consumer);
            let _ = done_tx.send(());
        });
        assigned
            .recv_timeout(Duration::from_secs(30))
            .expect("the reader was assigned the target's partitions");
        Reader { got, stop, done }
    }

    /// Reads [`TARGET`] from now on: what [`Mq::read_target`] returns is timed as it arrived.
    fn follow_target(&mut self) {
        self.target_reader = Some(self.reader(TARGET));
    }

    /// Sends the broker a signal (`-STOP`, `-CONT`).
    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        assert!(Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap()
            .success());
    }
}

/// Requests are produced to [`SOURCE`], a key as the record key; the target is [`TARGET`], and a
/// record read from it carries its key. Offsets are committed in the background, unchecked.
impl Mq for Tansu {
    type Own = Option<String>;

    fn target(&self) -> String {
        TARGET.into()
    }

    fn publish(&mut self, headers: &[(&str, &str)], body: &str) {
        self.produce(SOURCE, None, headers, body);
    }

    fn publish_keyed(&mut self, key: &str, headers: &[(&str, &str)], body: &str) {
        self.produce(SOURCE, Some(key), headers, body);
    }

    fn read_target(&mut self, count: usize, within: Duration) -> Vec<Got<Option<String>>> {
        if self.target_reader.is_none() {
            self.follow_target();
        }
        self.target_reader.as_mut().unwrap().read(count, within)
    }

    fn all_acknowledged(&mut self) -> bool {
        true
    }

    /// Kills it (its readers leave their groups first, while it is there).
    fn stop(&mut self) {
        self.target_reader = None;
        self.producer = None;
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills it and starts it again on the same port and database.
    fn restart(&mut self) {
        self.stop();
        self.run();
    }

    fn source_notices_outage(&self) -> bool {
        false
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A process that waits for this test process to end (or the broker to die), then kills the broker:
/// a test process killed outright leaves none behind.
fn watch(broker: u32) {
    let script = format!(
        "while kill -0 {test} 2>/dev/null && kill -0 {broker} 2>/dev/null; do sleep 0.2; done; \
         kill -9 {broker} 2>/dev/null; true",
        test = std::process::id(),
    );
    spawn_watchdog(&script);
}

/// A record read from a target topic carries its key.
type Record = Got<Option<String>>;

struct Reader {
    got: Arc<Mutex<Vec<Record>>>,
    stop: Arc<AtomicBool>,
    done: std::sync::mpsc::Receiver<()>,
}

impl Reader {
    /// Waits until records with `count` different bodies came, or `within` passed; everything read so
    /// far (repeated deliveries too).
    fn read_distinct(&mut self, count: usize, within: Duration) -> Vec<Record> {
        let deadline = Instant::now() + within;
        loop {
            let got = self.got.lock().unwrap().clone();
            let distinct: std::collections::BTreeSet<&String> =
                got.iter().map(|g| &g.body).collect();
            if distinct.len() >= count || Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until `count` records came in all, or `within` passed; everything read so far.
    fn read(&mut self, count: usize, within: Duration) -> Vec<Record> {
        let deadline = Instant::now() + within;
        while self.got.lock().unwrap().len() < count && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.got.lock().unwrap().clone()
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.done.recv_timeout(Duration::from_secs(10));
    }
}

/// A config with a Kafka source `in` (topic `delayd-in`, consumer `node`) feeding a Kafka sink `out`.
fn config(dir: &Path, tansu: &Tansu, node: &str) -> PathBuf {
    let text = format!(
        "[sinks.out]\nkind = \"kafka\"\nurl = \"{url}\"\nbackoff_initial = \"100ms\"\nbackoff_cap = \"1s\"\n\n\
         [sources.in]\nkind = \"kafka\"\nurl = \"{url}\"\ntopics = [\"delayd-in\"]\nsink = \"out\"\nconsumer = \"{node}\"\n",
        url = tansu.url()
    );
    write_file(dir, &format!("delayd-{node}.toml"), &text)
}

/// Waits until delayd's source consumes (its group joined and given the partitions: a Kafka consumer
/// takes seconds to join), by a request that changes nothing: a cancel of a key nothing has.
fn wait_until_consuming(tansu: &Tansu, base: &str) {
    tansu.produce(
        "delayd-in",
        None,
        &[
            ("delayd-target", "warm-up"),
            ("delayd-key", "warm-up"),
            ("delayd-cancel", "true"),
        ],
        "",
    );
    // Joining takes tansu a few seconds, and longer while other tests' brokers share the cores.
    wait_for("the source to consume", Duration::from_secs(120), || {
        count(base, "cancelled") >= 1.0
    });
}

/// delayd as the consumer `node` (see [`config`]), its data in `dir`'s `NODE`.
fn start_node(dir: &Path, tansu: &Tansu, node: &str) -> Process {
    start_delayd(&dir.join(node), &config(dir, tansu, node))
}

/// A test's directory, a `tansu` in it with `topics` (name, partitions), and delayd on it (the
/// consumer `a`) once it consumes; None without tansu. (Bound in this order, delayd is dropped first
/// and the directory last.)
fn tansu_and_delayd(topics: &[(&str, i32)]) -> Option<(TempDir, Tansu, Process)> {
    let dir = tempfile::tempdir().unwrap();
    let tansu = Tansu::start(dir.path())?;
    tansu.create_topics(topics);
    let delayd = start_node(dir.path(), &tansu, "a");
    wait_until_consuming(&tansu, &delayd.base);
    Some((dir, tansu, delayd))
}

/// Requests due 1–3 s ahead arrive at their target topic, none early, with the application's headers,
/// without delayd's or the migration ones, with `delayd-id` (which the HTTP API knows as delivered) and
/// with their record key; etf1/kafka-message-scheduler's headers are honoured.
#[test]
fn requests_through_kafka_arrive_on_time_with_their_headers_and_key() {
    let Some((_dir, mut tansu, delayd)) = tansu_and_delayd(&[(SOURCE, 2), (TARGET, 2)]) else {
        return;
    };
    tansu.follow_target();
    let mut due = publish_orders(&mut tansu, 20, true);
    // One in etf1/kafka-message-scheduler's form: unix seconds, a target topic and key.
    let epoch_s = now_ms() / 1000 + 2;
    tansu.publish(
        &[
            ("scheduler-epoch", &epoch_s.to_string()),
            ("scheduler-target-topic", TARGET),
            ("scheduler-target-key", "migrated-key"),
        ],
        "migrated",
    );
    due.insert("migrated".into(), epoch_s * 1000);
    let consumed = [
        "scheduler-epoch",
        "scheduler-target-topic",
        "scheduler-target-key",
    ];
    let how = "as the reader received them";
    assert_arrive_on_time(
        &mut tansu,
        &delayd.base,
        &due,
        &consumed,
        how,
        |record, status| {
            let key = record.mq.as_deref();
            match record.body.strip_prefix("order ") {
                Some(i) => assert_eq!(key, Some(format!("k{i}").as_str())),
                None => assert_eq!(key, Some("migrated-key")),
            }
            assert_eq!(status["topic"], TARGET);
        },
    );
}

/// A request that cannot be scheduled is a dead letter with its reason, never delivered; a cancel by
/// target and key (the record key standing for `delayd-key`) keeps its message from being delivered.
#[test]
fn bad_requests_are_dead_letters_and_cancels_by_key_hold() {
    let Some((_dir, mut tansu, delayd)) = tansu_and_delayd(&[(SOURCE, 1), (TARGET, 1)]) else {
        return;
    };
    tansu.follow_target();
    let mut bad = bad_requests_of_every_mq("t");
    bad.push((
        vec![("delayd-target", "t"), ("scheduler-epoch", "tomorrow")],
        "invalid_deliver_at",
    ));
    // Two cancels: the warm-up's and the test's.
    let counts = (4.0, 2.0, 2.0);
    assert_bad_requests_dead_and_cancels_by_key_hold(&mut tansu, &delayd.base, &bad, counts);
}

/// A crash in the middle of a backlog: the broker is frozen (SIGSTOP) while delayd takes it, then delayd
/// and the broker are killed (SIGKILL) and started again. delayd gets its partitions back at once
/// (static membership) and resumes from the last committed offset; every request is delivered, none
/// early, none scheduled twice (a request read again after a commit that did not land is recognised by
/// its topic, partition and offset). The freeze does not reliably leave a durable batch uncommitted
/// here (tansu fetches little ahead), so the test prints how many were read again rather than requiring
/// some: the Redis and NATS tests force that moment for the mechanism the sources share.
#[test]
fn a_kill_with_the_broker_frozen_loses_nothing_and_schedules_each_request_once() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut tansu) = Tansu::start(dir.path()) else {
        return;
    };
    tansu.create_topics(&[("delayd-in", 2), ("orders-out", 2)]);
    let total = 3000;
    let due_at = now_ms() + 20_000;
    let due = due_at.to_string();
    // No record keys: a key would stand for delayd-key, and one pending message per key would hide a
    // request scheduled twice.
    for i in 0..total {
        tansu.produce(
            "delayd-in",
            None,
            &[("delayd-deliver-at", &due), ("delayd-target", "orders-out")],
            &format!("order {i}"),
        );
    }
    let mut delayd = start_node(dir.path(), &tansu, "a");
    wait_for("a third to be scheduled", Duration::from_secs(60), || {
        count(&delayd.base, "scheduled") >= 1000.0
    });
    tansu.signal("-STOP");
    // delayd finishes the batch in hand (it had fetched more than it took), and its commit after it
    // goes unanswered: once the count stands still, a durable batch is not committed.
    let mut last = (count(&delayd.base, "scheduled"), Instant::now());
    wait_for("the source to stand still", Duration::from_secs(30), || {
        let now = count(&delayd.base, "scheduled");
        if now != last.0 {
            last = (now, Instant::now());
        }
        last.1.elapsed() >= Duration::from_millis(500)
    });
    // Both killed: the commit waiting in the frozen broker's socket is lost with it.
    delayd.kill();
    tansu.restart();
    delayd = start_node(dir.path(), &tansu, "a");
    let restarted = Instant::now();
    wait_for(
        "the restarted source to take requests",
        Duration::from_secs(40),
        || count(&delayd.base, "scheduled") + count(&delayd.base, "duplicate") > 0.0,
    );
    println!(
        "restart to the first request taken: {} ms (a killed member's session timeout is 45 s)",
        restarted.elapsed().as_millis()
    );
    let mut reader = tansu.reader("orders-out");
    let got = reader.read_distinct(total, Duration::from_secs(90));
    assert_each_scheduled_once(&got, total);
    for record in &got {
        assert!(record.at_ms >= due_at, "{} early", record.body);
    }
    let recognised = count(&delayd.base, "duplicate");
    println!(
        "{} records for {total} requests; after the restart {} scheduled, {recognised} read again and recognised",
        got.len(),
        count(&delayd.base, "scheduled"),
    );
}

/// Two delayd sharing one consumer group while requests flow: the second joining mid-stream rebalances
/// the partitions; both take a share, nothing is lost and nothing is scheduled twice.
#[test]
fn a_rebalance_between_two_nodes_loses_nothing_and_schedules_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    let Some(tansu) = Tansu::start(dir.path()) else {
        return;
    };
    tansu.create_topics(&[("delayd-in", 4), ("orders-out", 2)]);
    let mut reader = tansu.reader("orders-out");
    let a = start_node(dir.path(), &tansu, "a");
    wait_until_consuming(&tansu, &a.base);
    let mut produced = 0;
    let mut produce = || {
        let due = (now_ms() + 12_000).to_string();
        tansu.produce(
            "delayd-in",
            None,
            &[("delayd-deliver-at", &due), ("delayd-target", "orders-out")],
            &format!("order {produced}"),
        );
        produced += 1;
    };
    for _ in 0..300 {
        produce();
    }
    let b = start_node(dir.path(), &tansu, "b");
    // b takes a share only of what comes after its join (until then a takes everything), and a join
    // takes tansu seconds: requests keep coming, paced, until b has taken some.
    let deadline = Instant::now() + Duration::from_secs(120);
    while count(&b.base, "scheduled") == 0.0 {
        assert!(Instant::now() < deadline, "b took no share within 120 s");
        produce();
        std::thread::sleep(Duration::from_millis(20));
    }
    for _ in 0..300 {
        produce();
    }
    let total = produced;
    let got = reader.read_distinct(total, Duration::from_secs(60));
    assert_each_scheduled_once(&got, total);
    println!(
        "scheduled by a: {}, by b: {}; records read: {}",
        count(&a.base, "scheduled"),
        count(&b.base, "scheduled"),
        got.len()
    );
    assert!(count(&a.base, "scheduled") > 0.0 && count(&b.base, "scheduled") > 0.0);
}

/// The broker killed and started again: delayd keeps serving HTTP, says the sink is down (its due
/// message cannot be produced), and afterwards takes and delivers again; the message due while the
/// broker was away is delivered late, not lost.
#[test]
fn the_broker_restarted_mid_run_loses_nothing() {
    let Some((_dir, mut tansu, delayd)) = tansu_and_delayd(&[(SOURCE, 1), (TARGET, 1)]) else {
        return;
    };
    assert_outage_loses_nothing(&mut tansu, &delayd.base, "3s");
}

/// Static membership: delayd killed (SIGKILL) and started again under the same `consumer` takes
/// requests again as soon as it has joined, not after the 45 s session timeout for which the broker
/// holds a killed member's partitions otherwise.
#[test]
fn a_node_killed_and_restarted_gets_its_partitions_back_at_once() {
    let Some((dir, tansu, mut delayd)) = tansu_and_delayd(&[("delayd-in", 2)]) else {
        return;
    };
    delayd.kill();
    delayd = start_node(dir.path(), &tansu, "a");
    let restarted = Instant::now();
    wait_until_consuming(&tansu, &delayd.base);
    let took = restarted.elapsed();
    println!(
        "restart (broker up) to the first request taken: {} ms",
        took.as_millis()
    );
    assert!(
        took < Duration::from_secs(40),
        "{took:?}: the session timeout held the partitions"
    );
}

/// A topic deleted and made again starts its offsets at 0 again (here while delayd is stopped: delayd's
/// librdkafka would crash on tansu's answers about a deleted topic, see `Tansu::make_again`). Its
/// records are new requests, in a new order: a cancel at offset 0 of the new topic cancels the message a
/// request at offset 4 of the old one gave its key (ordered by offset alone, it looked older and was
/// skipped), and its requests are scheduled, not taken for the old topic's.
#[test]
fn a_topic_made_again_starts_a_new_order_of_positions() {
    // The target is made after the topic is made again: tansu answers Unknown topic for topics made
    // before a deletion.
    let Some((dir, mut tansu, mut delayd)) = tansu_and_delayd(&[("delayd-in", 1)]) else {
        return;
    };
    // delayd committed in the partition (the warm-up): a group without a committed offset for it after
    // the restart means the topic was made again.
    wait_for("a commit", Duration::from_secs(30), || {
        std::fs::read_to_string(dir.path().join("a/sources/in~kafka-epochs"))
            .is_ok_and(|epochs| epochs.contains("\"committed\":true"))
    });
    // Due after the restart (a consumer takes seconds to join); the keyed one later still.
    publish_numbered(&mut tansu, 3, "20s", "old");
    tansu.produce(
        "delayd-in",
        Some("k"),
        &[("delayd-delay", "60s"), ("delayd-target", "orders-out")],
        "old keyed",
    );
    wait_for("the old requests", Duration::from_secs(30), || {
        count(&delayd.base, "scheduled") == 4.0
    });
    // Killed at once: their offsets are committed once the source has been idle for a receive (1 s),
    // so the old requests' positions are still unacknowledged (read back from the log at the start),
    // where the new topic's offsets 0..3 must not be taken for them.
    delayd.kill();
    tansu.make_again("delayd-in", 1);
    tansu.create_topics(&[("orders-out", 1)]);
    tansu.produce(
        "delayd-in",
        Some("k"),
        &[("delayd-target", "orders-out"), ("delayd-cancel", "true")],
        "",
    );
    publish_numbered(&mut tansu, 3, "1s", "new");
    let delayd = start_node(dir.path(), &tansu, "a");
    wait_for("the cancel", Duration::from_secs(120), || {
        count(&delayd.base, "cancelled") == 1.0
    });
    // Read through delayd's listing: a new reader of the target does not join its group on tansu
    // after a topic was made again.
    let listed = |status: &str| {
        let path = format!("/v1/messages?topic=orders-out&status={status}");
        let answer = request(&delayd.base, "GET", &path, None, None);
        answer.json["messages"].as_array().unwrap().len()
    };
    wait_for("every request delivered", Duration::from_secs(60), || {
        listed("delivered") == 6
    });
    assert_eq!(listed("cancelled"), 1, "the old keyed one");
    assert_eq!(count(&delayd.base, "scheduled"), 3.0);
    assert_eq!(count(&delayd.base, "duplicate"), 0.0);
}
