//! The AMQP (RabbitMQ) sidecar end to end: the real `delayd` binary beside a real RabbitMQ (Debian's
//! package, 3.10). RabbitMQ takes ~11 s to start, so this test binary starts one, once, shared by the
//! tests (each with its own queues and its own delayd); the restart test starts a private one.
//!
//! Each server runs as the `rabbitmq` user on free loopback ports (AMQP, distribution, and an epmd of
//! its own through `ERL_EPMD_PORT`), with its own node name, data and log directories and an empty
//! plugins file (no management plugin, no fixed ports), in a process group of its own. A watchdog
//! process kills that group and that epmd when the test process is gone, however it ended (the shared
//! server is never dropped); a private server is also killed on drop. `.ci/run` checks afterwards that
//! no `delayd-test-` node is left.
//!
//! Requests are published to the source queue as an application would; an independent consumer reads
//! the target queues. Without RabbitMQ a test prints why it is skipped, and fails under `CI=true`.

use super::common::sidecar::{
    assert_arrive_on_time, assert_dead_letters_and_cancel_by_key, assert_each_scheduled_once,
    assert_outage_loses_nothing, ids_by_body, publish_orders, source_count, spawn_in_own_group,
    spawn_watchdog, spawn_with_config as start_delayd, Got, Mq,
};
use super::common::{
    free_port, get_message, now_ms, request, scrape, server_installed, wait_for, write_file,
    Process,
};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};
use serde_json::json;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tempfile::TempDir;

const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// Whether RabbitMQ is installed (see [`server_installed`]).
fn installed() -> bool {
    server_installed(SERVER, "apt-get install -y rabbitmq-server")
}

fn id_of(flag: &str) -> u32 {
    let out = Command::new("id")
        .args([flag, "rabbitmq"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// One RabbitMQ node.
#[derive(Debug)]
struct Rabbit {
    child: Child,
    port: u16,
    epmd_port: u16,
    dir: PathBuf,
    /// The watchdog removes `dir` too (the shared node's, which no guard drops).
    remove_dir: bool,
}

impl Rabbit {
    /// Starts a node with its files in `dir` (made and given to the `rabbitmq` user) on free ports;
    /// with `remove_dir`, `dir` is removed once this test process is gone.
    fn start(dir: &Path, remove_dir: bool) -> Rabbit {
        std::fs::create_dir_all(dir).unwrap();
        let (uid, gid) = (id_of("-u"), id_of("-g"));
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).unwrap();
        std::fs::write(dir.join("enabled_plugins"), "").unwrap();
        std::os::unix::fs::chown(dir.join("enabled_plugins"), Some(uid), Some(gid)).unwrap();
        Rabbit::start_on(dir, free_port(), free_port(), free_port(), remove_dir)
    }

    /// Starts it (again) with these ports and files; waits until it takes connections.
    fn start_on(dir: &Path, port: u16, dist_port: u16, epmd_port: u16, remove_dir: bool) -> Rabbit {
        let started = Instant::now();
        let (uid, gid) = (id_of("-u"), id_of("-g"));
        let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
        let mut command = Command::new(SERVER);
        command
            .current_dir(dir)
            .env("HOME", dir)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env("ERL_EPMD_PORT", epmd_port.to_string())
            .env("RABBITMQ_NODENAME", format!("delayd-test-{port}@localhost"))
            .env("RABBITMQ_MNESIA_BASE", path("mnesia"))
            .env("RABBITMQ_LOG_BASE", path("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins"))
            // None of the machine's own configuration.
            .env("RABBITMQ_CONFIG_FILE", path("rabbitmq"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", path("advanced.config"))
            .env("RABBITMQ_CONF_ENV_FILE", path("rabbitmq-env.conf"))
            .uid(uid)
            .gid(gid);
        let child = spawn_in_own_group(&mut command);
        let rabbit = Rabbit {
            child,
            port,
            epmd_port,
            dir: dir.to_path_buf(),
            remove_dir,
        };
        rabbit.watch();
        let deadline = Instant::now() + Duration::from_secs(90);
        let runtime = runtime();
        loop {
            let connected = runtime.block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(2),
                    Connection::connect(&rabbit.url(), ConnectionProperties::default()),
                )
                .await
            });
            if let Ok(Ok(connection)) = connected {
                runtime.block_on(async {
                    let _ = connection.close(200, ShortString::from("ready")).await;
                });
                println!(
                    "RabbitMQ (port {port}) took {} ms to start",
                    started.elapsed().as_millis()
                );
                return rabbit;
            }
            assert!(
                Instant::now() < deadline,
                "RabbitMQ did not start in 90 s: see {}",
                dir.join("log").display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A process that waits for this test process to end (or this node's group leader to die), then
    /// kills the node's process group and its epmd.
    fn watch(&self) {
        let script = format!(
            "while kill -0 {test} 2>/dev/null && kill -0 {group} 2>/dev/null; do sleep 0.2; done; \
             kill -9 -{group} 2>/dev/null; \
             for i in $(seq 50); do ERL_EPMD_PORT={epmd} epmd -kill >/dev/null 2>&1 && break; sleep 0.1; done; \
             if [ -n \"{remove}\" ] && ! kill -0 {test} 2>/dev/null; then rm -rf \"{remove}\"; fi; true",
            test = std::process::id(),
            group = self.child.id(),
            epmd = self.epmd_port,
            remove = if self.remove_dir { self.dir.to_str().unwrap() } else { "" },
        );
        spawn_watchdog(&script);
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// SIGKILL to the node's whole group (the script, the VM and its helpers) and its epmd.
    fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.wait();
        // epmd refuses while it still lists the node, which it drops once it sees the VM's socket close.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let killed = Command::new("epmd")
                .arg("-kill")
                .env("ERL_EPMD_PORT", self.epmd_port.to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if killed.is_ok_and(|s| s.success()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Killed (what was confirmed is on disk) and started again with the same AMQP port, node name and
    /// files. Its epmd and distribution ports are new: the old node's watchdog, which may yet kill the
    /// old epmd, must not touch the new one.
    fn restart(&mut self) {
        self.stop();
        *self = Rabbit::start_on(
            &self.dir.clone(),
            self.port,
            free_port(),
            free_port(),
            self.remove_dir,
        );
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The node the tests share, started by the first that needs it; None when RabbitMQ is not installed.
fn shared() -> Option<&'static Rabbit> {
    static SHARED: OnceLock<Option<Rabbit>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            installed().then(|| {
                let dir = tempfile::tempdir().unwrap().keep();
                Rabbit::start(&dir, true)
            })
        })
        .as_ref()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A blocking AMQP client for the tests: the application publishing requests and the consumer of the
/// targets, independent of delayd.
struct Client {
    runtime: tokio::runtime::Runtime,
    _connection: Connection,
    channel: Channel,
}

/// What a message read from a target queue carries beside its headers and body.
#[derive(Debug, Clone)]
struct Properties {
    message_id: Option<String>,
    delivery_mode: Option<u8>,
}

fn header(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
        other => format!("{other:?}"),
    }
}

impl Client {
    fn new(url: &str) -> Client {
        let runtime = runtime();
        let (connection, channel) = runtime.block_on(async {
            let connection = Connection::connect(url, ConnectionProperties::default())
                .await
                .unwrap();
            let channel = connection.create_channel().await.unwrap();
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            (connection, channel)
        });
        Client {
            runtime,
            _connection: connection,
            channel,
        }
    }

    fn declare(&self, queue: &str) {
        self.runtime
            .block_on(self.channel.queue_declare(
                queue.into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            ))
            .unwrap();
    }

    /// Messages ready in `queue`: not delivered to a consumer. One delivered and not acknowledged is
    /// not counted while its consumer's connection lives; see [`Client::unacked_after_stop`].
    fn depth(&self, queue: &str) -> u32 {
        self.declare_passive(queue).0
    }

    /// After delayd is killed: the broker requeues what its consumer held unacknowledged once it sees
    /// the connection gone (the queue has no consumer left); then every message left is one delayd
    /// never acknowledged.
    fn unacked_after_stop(&self, queue: &str) -> u32 {
        wait_for(
            "the broker to drop delayd's consumer",
            Duration::from_secs(30),
            || self.declare_passive(queue).1 == 0,
        );
        self.depth(queue)
    }

    /// (messages ready, consumers) of `queue`.
    fn declare_passive(&self, queue: &str) -> (u32, u32) {
        let declared = self
            .runtime
            .block_on(self.channel.queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            ))
            .unwrap();
        (declared.message_count(), declared.consumer_count())
    }

    fn fanout_to(&self, exchange: &str, queue: &str) {
        self.runtime.block_on(async {
            self.channel
                .exchange_declare(
                    exchange.into(),
                    ExchangeKind::Fanout,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
            self.bind(queue, exchange, "").await;
        });
    }

    async fn bind(&self, queue: &str, exchange: &str, routing_key: &str) {
        self.channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                routing_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }

    fn bind_direct(&self, queue: &str, routing_key: &str) {
        self.runtime
            .block_on(self.bind(queue, "amq.direct", routing_key));
    }

    /// Publishes a persistent message and waits for the broker's confirm.
    fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &[(&str, AMQPValue)],
        body: &str,
        message_id: Option<&str>,
    ) {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert((*name).into(), value.clone());
        }
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(table);
        if let Some(id) = message_id {
            properties = properties.with_message_id(id.into());
        }
        let confirm = self.runtime.block_on(async {
            self.channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap()
        });
        assert!(confirm.is_ack());
    }

    fn consume(&self, queue: &str) -> Consumer {
        self.runtime
            .block_on(self.channel.basic_consume(
                queue.into(),
                format!("test-{queue}").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ))
            .unwrap()
    }

    /// Reads (and acknowledges) until `count` messages came or `within` passed.
    fn read(
        &self,
        consumer: &mut Consumer,
        count: usize,
        within: Duration,
    ) -> Vec<Got<Properties>> {
        use futures_core::Stream;
        let deadline = Instant::now() + within;
        let mut got = Vec::new();
        while got.len() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let next = self.runtime.block_on(async {
                tokio::time::timeout(
                    left,
                    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *consumer).poll_next(cx)),
                )
                .await
            });
            let Ok(Some(delivery)) = next else { break };
            let delivery = delivery.unwrap();
            let at_ms = now_ms();
            let headers = delivery
                .properties
                .headers()
                .as_ref()
                .map(|t| {
                    t.inner()
                        .iter()
                        .map(|(n, v)| (n.as_str().to_string(), header(v)))
                        .collect()
                })
                .unwrap_or_default();
            got.push(Got {
                headers,
                body: String::from_utf8(delivery.data.clone()).unwrap(),
                at_ms,
                mq: Properties {
                    message_id: delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|m| m.as_str().to_string()),
                    delivery_mode: *delivery.properties.delivery_mode(),
                },
            });
            self.runtime
                .block_on(delivery.ack(BasicAckOptions::default()))
                .unwrap();
        }
        got
    }
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

/// A config with an AMQP source `in` (queue `in_queue`) feeding an AMQP sink `out` (default exchange).
fn config(dir: &Path, url: &str, in_queue: &str) -> PathBuf {
    let text = format!(
        "[sinks.out]\nkind = \"amqp\"\nurl = \"{url}\"\nexchange = \"\"\nexchanges = [\"amq.direct\"]\n\
         backoff_initial = \"100ms\"\nbackoff_cap = \"1s\"\n\n\
         [sources.in]\nkind = \"amqp\"\nurl = \"{url}\"\nqueue = \"{in_queue}\"\nsink = \"out\"\nbatch = 64\n"
    );
    write_file(dir, "delayd.toml", &text)
}

/// delayd with [`config`] for `in_queue` on the node at `url`, its data in `dir`'s `data`.
fn start_delayd_on(dir: &Path, url: &str, in_queue: &str) -> Process {
    start_delayd(&dir.join("data"), &config(dir, url, in_queue))
}

/// A test's directory, its queues on the shared node, and delayd on them; None without RabbitMQ.
/// (Bound in this order, delayd is dropped first and the directory last.)
fn queues_and_delayd(
    in_queue: &'static str,
    out_queue: &'static str,
) -> Option<(TempDir, Queues, Process)> {
    let rabbit = shared()?;
    let dir = tempfile::tempdir().unwrap();
    let queues = Queues::on(rabbit.url(), None, in_queue, out_queue);
    let delayd = start_delayd_on(dir.path(), &rabbit.url(), in_queue);
    Some((dir, queues, delayd))
}

/// A test's directory, and a client of the shared node with `queues` declared; None without
/// RabbitMQ.
fn shared_client(queues: &[&str]) -> Option<(TempDir, &'static Rabbit, Client)> {
    let rabbit = shared()?;
    let dir = tempfile::tempdir().unwrap();
    let client = Client::new(&rabbit.url());
    for queue in queues {
        client.declare(queue);
    }
    Some((dir, rabbit, client))
}

/// A test's source queue and target queue on a node, with its client: what the harness drives.
struct Queues {
    url: String,
    /// The test's own node, which it may stop (None: the shared one, never stopped).
    own: Option<Rabbit>,
    client: Option<Client>,
    in_queue: &'static str,
    out_queue: &'static str,
    consumer: Option<Consumer>,
    got: Vec<Got<Properties>>,
}

impl Queues {
    /// Declares the two queues on the node at `url` (`own`, when the test's own).
    fn on(
        url: String,
        own: Option<Rabbit>,
        in_queue: &'static str,
        out_queue: &'static str,
    ) -> Self {
        let mut queues = Queues {
            url,
            own,
            client: None,
            in_queue,
            out_queue,
            consumer: None,
            got: Vec::new(),
        };
        queues.connect();
        queues
    }

    /// A new client, declaring the queues as applications do at each connect: under load, a node
    /// killed moments after a declare came back once without the queue (RabbitMQ 3.10, 1 run in 10).
    fn connect(&mut self) {
        let client = Client::new(&self.url);
        client.declare(self.in_queue);
        client.declare(self.out_queue);
        self.client = Some(client);
    }

    fn client(&self) -> &Client {
        self.client.as_ref().unwrap()
    }

    /// Consumes the target queue from now on: what [`Mq::read_target`] returns is timed as it arrived.
    fn follow_target(&mut self) {
        self.consumer = Some(self.client().consume(self.out_queue));
    }
}

/// Requests are published to the source queue through the default exchange, their headers as strings;
/// a message read from the target keeps its AMQP properties. Acknowledged: none ready in the source
/// queue.
impl Mq for Queues {
    type Own = Properties;

    fn target(&self) -> String {
        self.out_queue.into()
    }

    fn publish(&mut self, headers: &[(&str, &str)], body: &str) {
        let headers: Vec<_> = headers.iter().map(|(n, v)| (*n, text(v))).collect();
        self.client()
            .publish("", self.in_queue, &headers, body, None);
    }

    fn read_target(&mut self, count: usize, within: Duration) -> Vec<Got<Properties>> {
        if self.consumer.is_none() {
            self.follow_target();
        }
        let more = count.saturating_sub(self.got.len());
        if more > 0 {
            let client = self.client.as_ref().unwrap();
            let read = client.read(self.consumer.as_mut().unwrap(), more, within);
            self.got.extend(read);
        }
        self.got.clone()
    }

    fn all_acknowledged(&mut self) -> bool {
        self.client().depth(self.in_queue) == 0
    }

    fn stop(&mut self) {
        self.consumer = None;
        self.client = None;
        self.own.as_mut().expect("the test's own node").stop();
    }

    fn restart(&mut self) {
        self.own.as_mut().expect("the test's own node").restart();
        self.connect();
    }
}

/// Requests due 1–3 s ahead arrive at their target queue, none early: with `delayd-delay`, with an
/// integer `x-delay` (as the delayed-message exchange's clients send it) published through an exchange
/// whose routing key is the target (the migration), and through another exchange named by
/// `delayd-exchange`. Headers pass, delayd's are stripped, `delayd-id` = `message_id`, persistent; the
/// HTTP API knows each as delivered.
#[test]
fn requests_through_rabbitmq_arrive_on_time_with_their_headers() {
    let (in_queue, out_queue) = ("delayd.in.ontime", "orders.out.ontime");
    let Some((_dir, mut queues, delayd)) = queues_and_delayd(in_queue, out_queue) else {
        return;
    };
    // The delayed-message exchange's users publish to an exchange with the target as the routing key.
    queues.client().fanout_to("orders.delayed.ontime", in_queue);
    queues.client().bind_direct(out_queue, "direct.ontime");
    queues.follow_target();
    let mut due = publish_orders(&mut queues, 30, false);
    let client = queues.client();
    for (i, x_delay) in [AMQPValue::LongInt(1500), AMQPValue::LongLongInt(2500)]
        .into_iter()
        .enumerate()
    {
        let published = now_ms();
        client.publish(
            "orders.delayed.ontime",
            out_queue,
            &[("x-delay", x_delay.clone()), ("trace", text("migrated"))],
            &format!("migrated {i}"),
            None,
        );
        let ms = match x_delay {
            AMQPValue::LongInt(ms) => i64::from(ms),
            AMQPValue::LongLongInt(ms) => ms,
            _ => unreachable!(),
        };
        due.insert(format!("migrated {i}"), published + ms);
    }
    let published = now_ms();
    client.publish(
        "",
        in_queue,
        &[
            ("x-delay", AMQPValue::LongInt(2000)),
            ("delayd-target", text("direct.ontime")),
            ("delayd-exchange", text("amq.direct")),
        ],
        "via amq.direct",
        None,
    );
    due.insert("via amq.direct".into(), published + 2000);
    let consumed = ["x-delay", "delayd-exchange"];
    let how = "as the consumer received them";
    assert_arrive_on_time(
        &mut queues,
        &delayd.base,
        &due,
        &consumed,
        how,
        |message, _| {
            if message.body.starts_with("migrated") {
                assert_eq!(message.headers["trace"], "migrated");
            }
            assert_eq!(message.mq.message_id.as_deref(), Some(message.id()));
            assert_eq!(message.mq.delivery_mode, Some(2), "persistent");
        },
    );
    let mut delayd = delayd;
    delayd.kill();
    assert_eq!(
        queues.client().unacked_after_stop(in_queue),
        0,
        "every request acknowledged"
    );
}

/// A request that cannot be scheduled is a dead letter with its reason, acknowledged, never delivered
/// (among them one with a table-valued header, and one published straight to the source queue without
/// a target: its routing key, the queue's own name, is not taken as the target); a cancel by target
/// and key keeps its message from being delivered.
#[test]
fn bad_amqp_requests_are_dead_letters_and_cancels_by_key_hold() {
    let (in_queue, out_queue) = ("delayd.in.bad", "orders.out.bad");
    let Some((_dir, mut queues, delayd)) = queues_and_delayd(in_queue, out_queue) else {
        return;
    };
    queues.follow_target();
    let client = queues.client();
    let bad: Vec<(Vec<(&str, AMQPValue)>, &str)> = vec![
        (vec![("delayd-delay", text("1s"))], "missing_target"),
        (vec![("delayd-target", text("t"))], "missing_deliver_time"),
        (
            vec![("delayd-target", text("t")), ("x-delay", text("soon"))],
            "invalid_delay",
        ),
        (
            vec![
                ("delayd-target", text("t")),
                ("delayd-delay", text("1s")),
                ("x-delay", AMQPValue::LongInt(5)),
            ],
            "conflicting_time_fields",
        ),
        (
            vec![
                ("delayd-target", text("t")),
                ("delayd-delay", text("1s")),
                ("nested", AMQPValue::FieldTable(FieldTable::default())),
            ],
            "invalid_header",
        ),
        // An exchange that is neither the sink's nor one of its `exchanges`.
        (
            vec![
                ("delayd-target", text("t")),
                ("delayd-delay", text("1s")),
                ("delayd-exchange", text("amq.topic")),
            ],
            "forbidden_target",
        ),
    ];
    for (headers, _) in &bad {
        client.publish("", in_queue, headers, "bad", None);
    }
    // AMQP message ids are the publisher's names, not an order: a cancel under "100" cancels the
    // message requested under "900".
    client.publish(
        "",
        in_queue,
        &[
            ("delayd-delay", text("2s")),
            ("delayd-target", text(out_queue)),
            ("delayd-key", text("o-2")),
        ],
        "cancel me too",
        Some("900"),
    );
    client.publish(
        "",
        in_queue,
        &[
            ("delayd-target", text(out_queue)),
            ("delayd-key", text("o-2")),
            ("delayd-cancel", AMQPValue::Boolean(true)),
        ],
        "",
        Some("100"),
    );
    let codes: Vec<&str> = bad.iter().map(|(_, code)| *code).collect();
    let counts = (bad.len() as f64, 2.0, 3.0);
    assert_dead_letters_and_cancel_by_key(&mut queues, &delayd.base, &codes, counts);
}

/// A target no queue is bound to: the publish is returned (`mandatory`), so it is retried, not counted
/// as delivered, and its status says why; once a queue exists it is delivered, once.
#[test]
fn an_unroutable_amqp_target_is_retried_until_a_queue_exists() {
    let (in_queue, out_queue) = ("delayd.in.unroutable", "orders.out.unroutable");
    // The target queue is declared later.
    let Some((dir, rabbit, client)) = shared_client(&[in_queue]) else {
        return;
    };
    let delayd = start_delayd_on(dir.path(), &rabbit.url(), in_queue);
    // Through the source and through HTTP (whose answer gives the id) to the same AMQP sink.
    client.publish(
        "",
        in_queue,
        &[
            ("delayd-delay", text("200ms")),
            ("delayd-target", text(out_queue)),
        ],
        "from amqp",
        Some("unroutable-1"),
    );
    let http = request(
        &delayd.base,
        "POST",
        "/v1/messages",
        Some(
            &json!({"topic": out_queue, "sink": "out", "body": "from http", "delay": "200ms"})
                .to_string(),
        ),
        None,
    );
    assert_eq!(http.status, 201, "{}", http.json);
    let id = http.json["id"].as_str().unwrap().to_string();
    // A routable and an unroutable message due at the same millisecond, so in one batch: the return
    // must be matched to the unroutable one, whichever confirm it arrives with.
    let routable = "orders.out.routable";
    client.declare(routable);
    let at = now_ms() + 300;
    let pair = request(
        &delayd.base,
        "POST",
        "/v1/messages/batch",
        Some(
            &json!({"messages": [
                {"topic": out_queue, "sink": "out", "body": "pair unroutable", "deliver_at": at},
                {"topic": routable, "sink": "out", "body": "pair routable", "deliver_at": at},
            ]})
            .to_string(),
        ),
        None,
    );
    assert_eq!(pair.status, 200, "{}", pair.json);
    let unroutable_id = pair.json["results"][0]["id"].as_str().unwrap().to_string();
    let mut routable_consumer = client.consume(routable);
    let got = client.read(&mut routable_consumer, 1, Duration::from_secs(20));
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body, "pair routable");
    let mut reason = String::new();
    wait_for("retries with a reason", Duration::from_secs(20), || {
        let status = get_message(&delayd.base, &id);
        reason = status.json["reason"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        // (The reason comes with the `retried` outcome, recorded a moment after the new attempt,
        // which a lookup may already find.)
        status.json["status"] == "retrying"
            && status.json["attempts"].as_u64() >= Some(2)
            && !reason.is_empty()
    });
    assert!(reason.contains("NO_ROUTE"), "{reason}");
    println!("unroutable: {reason}");
    // The routable one can be read as soon as it is published; its unroutable partner is "retrying"
    // only once the batch's outcomes are durable, a moment later.
    wait_for(
        "the unroutable one of the pair retries",
        Duration::from_secs(20),
        || {
            let path = format!("/v1/messages/{unroutable_id}");
            request(&delayd.base, "GET", &path, None, None).json["status"] == "retrying"
        },
    );
    assert!(
        client
            .read(&mut routable_consumer, 1, Duration::from_millis(1500))
            .is_empty(),
        "the routable one of the pair was published once"
    );
    let metrics = scrape(&delayd.base);
    let delivered_ok: f64 = metrics
        .iter()
        .filter(|(k, _)| {
            k.starts_with("delayd_messages_delivered_total{")
                && k.contains(r#"sink="out""#)
                && k.contains(r#"outcome="ok""#)
        })
        .map(|(_, v)| v)
        .sum();
    assert_eq!(delivered_ok, 1.0, "the routable one of the pair only");
    client.declare(out_queue);
    let mut consumer = client.consume(out_queue);
    let got = client.read(&mut consumer, 3, Duration::from_secs(20));
    let mut bodies: Vec<_> = got.iter().map(|g| g.body.as_str()).collect();
    bodies.sort();
    assert_eq!(bodies, ["from amqp", "from http", "pair unroutable"]);
    assert!(client
        .read(&mut consumer, 1, Duration::from_millis(1500))
        .is_empty());
    let status = get_message(&delayd.base, &id);
    assert_eq!(status.json["status"], "delivered", "{}", status.json);
}

/// delayd killed with SIGKILL again and again while requests stream in (each with a `message_id`):
/// nothing is lost, and no request is scheduled twice (each body reaches the target under one delayd
/// id; a redelivered request is counted as a duplicate instead).
#[test]
fn amqp_requests_survive_delayd_killed_under_load_and_are_scheduled_once() {
    let (in_queue, out_queue) = ("delayd.in.crash", "orders.out.crash");
    let Some((dir, rabbit, client)) = shared_client(&[in_queue, out_queue]) else {
        return;
    };
    let data = dir.path().join("data");
    let config = config(dir.path(), &rabbit.url(), in_queue);
    let count = 400;
    let url = rabbit.url();
    let publisher = std::thread::spawn(move || {
        let client = Client::new(&url);
        for i in 0..count {
            client.publish(
                "",
                in_queue,
                &[
                    ("delayd-delay", text("2s")),
                    ("delayd-target", text(out_queue)),
                ],
                &format!("once {i}"),
                Some(&format!("crash-{i}")),
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let mut consumer = client.consume(out_queue);
    let mut got = Vec::new();
    let mut duplicates = 0.0;
    for _ in 0..5 {
        let mut delayd = start_delayd(&data, &config);
        // Killed once it took some requests in this round.
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && !publisher.is_finished() {
            if source_count(&delayd.base, "scheduled") >= 20.0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        duplicates += source_count(&delayd.base, "duplicate");
        delayd.kill();
        got.extend(client.read(&mut consumer, usize::MAX, Duration::from_millis(1)));
    }
    publisher.join().unwrap();
    let delayd = start_delayd(&data, &config);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        got.extend(client.read(&mut consumer, usize::MAX, Duration::from_millis(500)));
        if ids_by_body(&got).len() == count || Instant::now() > deadline {
            break;
        }
    }
    assert_each_scheduled_once(&got, count);
    wait_for("the acknowledgements", Duration::from_secs(10), || {
        client.depth(in_queue) == 0
    });
    duplicates += source_count(&delayd.base, "duplicate");
    println!(
        "AMQP crash loop: {count} requests, 5 SIGKILLs, {} deliveries (repeats of one id: at-least-once \
         sink), {duplicates} redelivered requests recognised as duplicates",
        got.len()
    );
}

/// RabbitMQ killed mid-run (its own node): delayd keeps serving HTTP and says the source and sink are
/// down; once RabbitMQ is back, what was scheduled before and what is published after is delivered.
#[test]
fn rabbitmq_restarted_mid_run_loses_nothing() {
    if !installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rabbit = Rabbit::start(&dir.path().join("rabbit"), false);
    let url = rabbit.url();
    let in_queue = "delayd.in";
    let mut queues = Queues::on(url.clone(), Some(rabbit), in_queue, "orders.out");
    let delayd = start_delayd_on(dir.path(), &url, in_queue);
    // Due well after RabbitMQ is stopped (which takes up to a few seconds), so that the sink fails.
    assert_outage_loses_nothing(&mut queues, &delayd.base, "6s");
}
