//! The load generator: one workload, driven against delayd or against the delay queues people build
//! instead (a Redis sorted set, a PostgreSQL table), each configured durable.
//!
//! ```text
//! cargo bench --bench loadgen -- --target delayd --url http://127.0.0.1:7070 --messages 100000 \
//!     --mode batch --batch 1000 --concurrency 8 --delay-min-ms 1000 --delay-max-ms 5000 --pid $PID
//! ```
//!
//! It schedules `--messages` messages (one per request, or `--batch` per request) from `--concurrency`
//! producers, each due uniformly between delay-min and delay-max after its request is sent; consumes
//! the deliveries (a progress bar on stderr); and prints one JSON line: durable ingest rate, request
//! latency p50/p99, delivery lateness p50/p99/max (time the consumer got it minus the due time), early
//! deliveries, duplicates, losses, and, given the target's process (`--pid`), its peak RSS and the bytes
//! it caused to be written to disk during the run (`write_bytes` of `/proc/PID/io`, its threads and
//! reaped children included) with the write amplification they make: disk bytes / (messages ×
//! `--body-bytes`). `--no-consume` only ingests (for memory and write-amplification figures); `--rate`
//! offers a fixed load instead of as much as the target takes (for lateness under a nominal load);
//! `--dump FILE` writes every delivery.
//!
//! delayd as a sidecar of another MQ (`--target delayd-redis`, `delayd-nats`, `delayd-amqp`,
//! `delayd-kafka`): the same messages published to delayd's source (Redis stream, JetStream subject,
//! RabbitMQ queue, Kafka topic) as an
//! application would, counted as ingested once delayd has acknowledged them to the MQ (after its
//! fsync), and read from a target stream or queue on that MQ when due. `benches/sidecar.sh` runs them.
//! With `--straight` the same messages are published to the target itself and read there, no delayd
//! involved: the MQ's own pass. `pass_s` (the first request sent to the last message read) of a
//! sidecar run with every message due at once, against that of a straight run, is the sidecar's cost.
//!
//! Peers, as a competent team would build them:
//! - Redis (`appendonly yes`, `appendfsync always`): the payload in a hash field, the due time in a
//!   sorted set, written in one MULTI (pipelined per batch); a mover runs a Lua script every
//!   `--poll-ms` that moves due ids from the sorted set to a ready list; consumers pop the list.
//! - PostgreSQL (`synchronous_commit = on`): a table with an index on the due time, one row per
//!   transaction or one multi-row INSERT per batch; workers claim due rows every `--poll-ms` with
//!   `DELETE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED) RETURNING`.

#![allow(clippy::unwrap_used, reason = "a benchmark stops at the first failure")]

use clap::Parser;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Parser)]
struct Args {
    /// delayd (HTTP), delayd-redis (delayd as a Redis Streams sidecar: its source stream `delayd:in`,
    /// target `loadgen:out`, at --redis-url), delayd-nats (a NATS JetStream sidecar: source stream
    /// `DELAYS` on `delayd.>`, consumer `delayd`, requests to `delayd.in`, target `loadgen.out` in
    /// stream `LOADGEN_OUT`, at --nats-url), delayd-amqp (a RabbitMQ sidecar: source queue `delayd.in`,
    /// target queue `loadgen.out`, at --amqp-url; delayd's metrics at --url), delayd-kafka (a Kafka
    /// sidecar: source topic `delayd-in`, target topic `loadgen-out`, both created, at --kafka-brokers;
    /// delayd's metrics at --url), redis or postgres
    #[arg(long)]
    target: String,
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    url: String,
    #[arg(long, default_value = "redis://127.0.0.1:6399/")]
    redis_url: String,
    #[arg(long, default_value = "nats://127.0.0.1:4298")]
    nats_url: String,
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5698/%2f")]
    amqp_url: String,
    /// Kafka brokers (`host:port`, comma-separated) for `--target delayd-kafka`
    #[arg(long, default_value = "127.0.0.1:9498")]
    kafka_brokers: String,
    #[arg(
        long,
        default_value = "host=127.0.0.1 port=5499 user=postgres dbname=postgres"
    )]
    postgres: String,
    #[arg(long, default_value_t = 10_000)]
    messages: u64,
    /// single (one message per request) or batch
    #[arg(long, default_value = "single")]
    mode: String,
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    #[arg(long, default_value_t = 1000)]
    delay_min_ms: u64,
    #[arg(long, default_value_t = 5000)]
    delay_max_ms: u64,
    /// Offered load in messages per second (0: as fast as the target takes them). Request `r` is sent
    /// no earlier than `r × messages-per-request / rate` seconds after the start.
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// How often the peers' movers/workers look for due messages
    #[arg(long, default_value_t = 100)]
    poll_ms: u64,
    /// Body size in bytes
    #[arg(long, default_value_t = 100)]
    body_bytes: usize,
    /// Only ingest (no consumer)
    #[arg(long)]
    no_consume: bool,
    /// A sidecar target with no delayd: only publish the requests to the MQ, and count them ingested
    /// once the MQ confirmed them (the MQ's own ceiling for the sidecar's requests); no consumer
    #[arg(long)]
    publish_only: bool,
    /// A sidecar target with no delayd: publish the messages straight to the target (no delay headers)
    /// and consume them there: the MQ's own pass, which `pass_s` times against the sidecar's
    #[arg(long)]
    straight: bool,
    /// With --straight, Kafka only: the messages carry the two headers a request does (a broker may
    /// store headers at a cost of its own: tansu's is tenfold)
    #[arg(long)]
    with_headers: bool,
    /// delayd over HTTP: each message with an idempotency key of its own (`"key"`, `"dedup": true`);
    /// one message a request
    #[arg(long)]
    keyed: bool,
    /// How long after the last due time deliveries are waited for before the missing ones count as lost
    #[arg(long, default_value_t = 5000)]
    grace_ms: u64,
    /// The target's process id, for its peak RSS and the bytes it writes to disk
    #[arg(long)]
    pid: Option<u32>,
    /// Also write every delivery as `id due_ms delivered_ms` lines to this file
    #[arg(long)]
    dump: Option<std::path::PathBuf>,
    /// A label for the output line
    #[arg(long, default_value = "")]
    label: String,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// One message of the workload.
#[derive(Debug, Clone)]
struct Job {
    id: u64,
    due_ms: i64,
    body: String,
}

/// A delay queue under test: durable on return from `schedule`; `consume` (called in a loop by each
/// consumer task, numbered from 0) returns what became deliverable (id, due time) and waits a little
/// when nothing did.
trait Target: Send + Sync + 'static {
    fn schedule(&self, jobs: Vec<Job>) -> impl Future<Output = anyhow::Result<()>> + Send;
    /// Returns once everything `schedule` handed over is durable in the target (at once for a target
    /// whose `schedule` returns only then; the sidecar path waits for delayd's acknowledgements).
    fn settled(&self) -> impl Future<Output = anyhow::Result<()>> + Send {
        async { Ok(()) }
    }
    fn consume(
        &self,
        consumer: usize,
    ) -> impl Future<Output = anyhow::Result<Vec<(u64, i64)>>> + Send;
}

// ---------------------------------------------------------------- delayd

struct Delayd {
    http: Http,
    batch: bool,
    /// Each message with an idempotency key of its own (`--keyed`; single mode only).
    keyed: bool,
    /// Consume-queue offsets; consumer task `i` long-polls queue `i`, so every queue always has a long
    /// poll open (taking turns over the queues could leave one unpolled until a task came round to it).
    offsets: Vec<AtomicU64>,
}

/// A minimal HTTP/1.1 keep-alive client: a pool of plain connections, one request at a time on each.
/// The generator shares two cores with the server, so its own CPU is taken from the target's: 50,000
/// single-message requests cost it 2.2–2.5 s of CPU with reqwest and 1.2–1.4 s with this (ingest 26–30 k/s
/// vs 35–50 k/s), and the peers' clients speak their native protocols just as plainly. delayd answers
/// with `content-length` bodies, never chunked.
struct Http {
    address: String,
    idle: Mutex<Vec<tokio::io::BufStream<tokio::net::TcpStream>>>,
}

impl Http {
    fn new(url: &str) -> anyhow::Result<Http> {
        let address = url
            .trim_end_matches('/')
            .strip_prefix("http://")
            .ok_or_else(|| anyhow::anyhow!("the load generator speaks plain http://, not {url}"))?;
        Ok(Http {
            address: address.to_string(),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Sends one request and returns the status and body.
    async fn request(&self, method: &str, path: &str, body: &str) -> anyhow::Result<(u16, String)> {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let pooled = self.idle.lock().unwrap().pop();
        let mut stream = match pooled {
            Some(stream) => stream,
            None => {
                let socket = tokio::net::TcpStream::connect(&self.address).await?;
                socket.set_nodelay(true)?;
                tokio::io::BufStream::new(socket)
            }
        };
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            self.address,
            body.len()
        );
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.flush().await?;
        let mut line = String::new();
        stream.read_line(&mut line).await?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("bad status line {line:?}"))?;
        let mut length = 0;
        let mut keep_alive = true;
        loop {
            line.clear();
            anyhow::ensure!(stream.read_line(&mut line).await? > 0, "connection closed");
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse()?;
                }
                if name.eq_ignore_ascii_case("connection") && value.trim() == "close" {
                    keep_alive = false;
                }
                anyhow::ensure!(
                    !name.eq_ignore_ascii_case("transfer-encoding"),
                    "chunked answers are not expected"
                );
            }
        }
        let mut answer = vec![0; length];
        stream.read_exact(&mut answer).await?;
        if keep_alive {
            self.idle.lock().unwrap().push(stream);
        }
        Ok((status, String::from_utf8(answer)?))
    }
}

impl Target for Delayd {
    async fn schedule(&self, jobs: Vec<Job>) -> anyhow::Result<()> {
        // The JSON is written directly (bodies are digits, ':' and 'x', nothing to escape): the generator
        // shares the CPU with the server, and building `Value` trees would bill it for the client's work.
        let message = |j: &Job| match self.keyed {
            false => format!(
                r#"{{"topic":"loadgen","body":"{}","deliver_at":{}}}"#,
                j.body, j.due_ms
            ),
            true => format!(
                r#"{{"topic":"loadgen","body":"{}","deliver_at":{},"key":"k{}","dedup":true}}"#,
                j.body, j.due_ms, j.id
            ),
        };
        let (path, body) = if self.batch {
            let messages: Vec<String> = jobs.iter().map(message).collect();
            (
                "/v1/messages/batch",
                format!(r#"{{"messages":[{}]}}"#, messages.join(",")),
            )
        } else {
            ("/v1/messages", message(&jobs[0]))
        };
        let (status, answer) = self.http.request("POST", path, &body).await?;
        anyhow::ensure!(status / 100 == 2, "HTTP {status}: {answer:.300}");
        // Every result of a batch is an id or an error object; a scan is enough to tell.
        anyhow::ensure!(
            !self.batch || !answer.contains(r#""error""#),
            "a message was refused: {answer:.300}"
        );
        Ok(())
    }

    async fn consume(&self, consumer: usize) -> anyhow::Result<Vec<(u64, i64)>> {
        let queue = consumer % self.offsets.len();
        let offset = self.offsets[queue].load(Ordering::Relaxed);
        let path = format!(
            "/v1/topics/loadgen/queues/{queue}/messages?offset={offset}&max=1000&wait_ms=1000"
        );
        let (status, answer) = self.http.request("GET", &path, "").await?;
        if status == 404 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            return Ok(Vec::new());
        }
        anyhow::ensure!(status == 200, "HTTP {status}: {answer:.300}");
        let answer: Value = serde_json::from_str(&answer)?;
        let got = answer["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| parse_body(m["body"].as_str().unwrap_or("")))
            .collect();
        let next = answer["next_offset"].as_u64().unwrap_or(offset);
        self.offsets[queue].store(next, Ordering::Relaxed);
        Ok(got)
    }
}

/// Bodies are `{id}:{due_ms}:{padding}`.
fn parse_body(body: &str) -> (u64, i64) {
    let mut parts = body.splitn(3, ':');
    let id = parts
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(u64::MAX);
    let due = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (id, due)
}

// ---------------------------------------------------------------- Redis

struct Redis {
    connection: redis::aio::MultiplexedConnection,
    mover: redis::Script,
    poll: Duration,
}

const MOVE_DUE: &str = r"
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
if #ids > 0 then
  redis.call('ZREM', KEYS[1], unpack(ids))
  redis.call('RPUSH', KEYS[2], unpack(ids))
end
return #ids
";

impl Target for Redis {
    async fn schedule(&self, jobs: Vec<Job>) -> anyhow::Result<()> {
        let mut pipe = redis::pipe();
        pipe.atomic();
        for job in &jobs {
            pipe.hset("delay:payload", job.id, &job.body).ignore();
            pipe.zadd("delay:due", job.id, job.due_ms).ignore();
        }
        let mut connection = self.connection.clone();
        let () = pipe.query_async(&mut connection).await?;
        Ok(())
    }

    async fn consume(&self, _consumer: usize) -> anyhow::Result<Vec<(u64, i64)>> {
        let mut connection = self.connection.clone();
        let moved: i64 = self
            .mover
            .key("delay:due")
            .key("delay:ready")
            .arg(now_ms())
            .arg(1000)
            .invoke_async(&mut connection)
            .await?;
        if moved == 0 {
            tokio::time::sleep(self.poll).await;
            return Ok(Vec::new());
        }
        let ids: Vec<u64> = redis::cmd("LPOP")
            .arg("delay:ready")
            .arg(moved)
            .query_async(&mut connection)
            .await?;
        let mut pipe = redis::pipe();
        pipe.atomic();
        pipe.cmd("HMGET").arg("delay:payload").arg(&ids);
        pipe.cmd("HDEL").arg("delay:payload").arg(&ids).ignore();
        let (bodies,): (Vec<Option<String>>,) = pipe.query_async(&mut connection).await?;
        Ok(bodies
            .into_iter()
            .flatten()
            .map(|b| parse_body(&b))
            .collect())
    }
}

// ---------------------------------------------------------------- delayd as a Redis sidecar

/// The sidecar path: requests `XADD`ed to delayd's source stream (pipelined per batch), due messages
/// read from the target stream delayd's Redis sink writes to. A request counts as ingested once delayd
/// acknowledged it (`XACK`, after its fsync): [`Target::settled`] waits for the group to have read and
/// acknowledged every entry.
struct Sidecar {
    connection: redis::aio::MultiplexedConnection,
    /// Publish to the target itself (`--straight`).
    straight: bool,
    /// The last target entry read (one consumer reads the target stream).
    last: tokio::sync::Mutex<String>,
    produced: AtomicU64,
}

const SIDECAR_IN: &str = "delayd:in";
const SIDECAR_OUT: &str = "loadgen:out";

impl Target for Sidecar {
    async fn schedule(&self, jobs: Vec<Job>) -> anyhow::Result<()> {
        let mut pipe = redis::pipe();
        for job in &jobs {
            if self.straight {
                pipe.cmd("XADD").arg(SIDECAR_OUT).arg("*");
            } else {
                pipe.cmd("XADD")
                    .arg(SIDECAR_IN)
                    .arg("*")
                    .arg("delayd-deliver-at")
                    .arg(job.due_ms)
                    .arg("delayd-target")
                    .arg(SIDECAR_OUT);
            }
            pipe.arg("body").arg(&job.body).ignore();
        }
        let mut connection = self.connection.clone();
        let () = pipe.query_async(&mut connection).await?;
        self.produced
            .fetch_add(jobs.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    async fn settled(&self) -> anyhow::Result<()> {
        let mut connection = self.connection.clone();
        loop {
            // [pending count, ...] and the group's entries-read.
            let pending: redis::Value = redis::cmd("XPENDING")
                .arg(SIDECAR_IN)
                .arg("delayd")
                .query_async(&mut connection)
                .await?;
            let pending = match pending {
                redis::Value::Array(parts) => match parts.first() {
                    Some(redis::Value::Int(n)) => *n,
                    _ => 0,
                },
                _ => 0,
            };
            let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
                .arg("GROUPS")
                .arg(SIDECAR_IN)
                .query_async(&mut connection)
                .await?;
            let read = groups
                .first()
                .and_then(|g| g.get("entries-read"))
                .and_then(|v| redis::from_redis_value::<u64>(v.clone()).ok())
                .unwrap_or(0);
            if pending == 0 && read >= self.produced.load(Ordering::Relaxed) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn consume(&self, _consumer: usize) -> anyhow::Result<Vec<(u64, i64)>> {
        let mut last = self.last.lock().await;
        let mut connection = self.connection.clone();
        let answer: redis::Value = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(1000)
            .arg("BLOCK")
            .arg(200)
            .arg("STREAMS")
            .arg(SIDECAR_OUT)
            .arg(last.as_str())
            .query_async(&mut connection)
            .await?;
        let mut got = Vec::new();
        let redis::Value::Array(streams) = answer else {
            return Ok(got);
        };
        for stream in streams {
            let redis::Value::Array(pair) = stream else {
                continue;
            };
            let Some(redis::Value::Array(entries)) = pair.get(1) else {
                continue;
            };
            for entry in entries {
                let redis::Value::Array(parts) = entry else {
                    continue;
                };
                if let Some(redis::Value::BulkString(id)) = parts.first() {
                    *last = String::from_utf8_lossy(id).into_owned();
                }
                let Some(redis::Value::Array(fields)) = parts.get(1) else {
                    continue;
                };
                for pair in fields.chunks(2) {
                    if let [redis::Value::BulkString(name), redis::Value::BulkString(value)] = pair
                    {
                        if name == b"body" {
                            got.push(parse_body(&String::from_utf8_lossy(value)));
                        }
                    }
                }
            }
        }
        Ok(got)
    }
}

/// One read of a target's `reader` (its one consumer task's): waits a little for a first message,
/// then takes what else is already here, up to 1000, as `parse` reads each (None: nothing to count).
/// Fails with `ended` if the reader ends.
async fn take_ready<S: futures_util::Stream + Unpin>(
    reader: &mut S,
    ended: &str,
    mut parse: impl FnMut(S::Item) -> anyhow::Result<Option<(u64, i64)>>,
) -> anyhow::Result<Vec<(u64, i64)>> {
    use futures_util::{FutureExt, StreamExt};
    let mut got = Vec::new();
    let mut next = match tokio::time::timeout(Duration::from_millis(200), reader.next()).await {
        Ok(Some(message)) => Some(message),
        Ok(None) => anyhow::bail!("{ended}"),
        Err(_) => None,
    };
    while let Some(message) = next {
        got.extend(parse(message)?);
        if got.len() >= 1000 {
            break;
        }
        next = reader.next().now_or_never().flatten();
    }
    Ok(got)
}

// ---------------------------------------------------------------- delayd as a NATS JetStream sidecar

/// The NATS path: requests published through JetStream to delayd's source subject (a batch published,
/// then its PubAcks awaited), due messages read by a pull consumer on a target stream the load
/// generator creates. [`Target::settled`] waits until delayd's durable consumer has been handed every
/// request published and has acknowledged each (it acks after its fsync).
struct NatsSidecar {
    js: async_nats::jetstream::Context,
    /// Publish to the target itself (`--straight`).
    straight: bool,
    /// The target stream's reader (one consumer task reads it).
    reader: tokio::sync::Mutex<async_nats::jetstream::consumer::pull::Stream>,
    /// The highest stream sequence a PubAck gave.
    last_seq: AtomicU64,
}

/// The source stream, subject and durable consumer as `benches/sidecar.sh` configures delayd (its
/// defaults for the consumer's name).
const NATS_STREAM: &str = "DELAYS";
const NATS_SUBJECTS: &str = "delayd.>";
const NATS_IN: &str = "delayd.in";
const NATS_CONSUMER: &str = "delayd";
/// The target: a subject the load generator's own stream captures.
const NATS_OUT_STREAM: &str = "LOADGEN_OUT";
const NATS_OUT: &str = "loadgen.out";

impl NatsSidecar {
    async fn connect(url: &str, in_flight: usize, straight: bool) -> anyhow::Result<NatsSidecar> {
        use async_nats::jetstream::{self, consumer, stream};
        let client = async_nats::connect(url).await?;
        // Each producer holds a batch of PubAck futures before awaiting them, and the client lets no
        // more than `max_ack_inflight` wait at once: room for all of them, or the producers would hold
        // each other up. A durable server under load may answer slowly: wait rather than fail.
        let js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(60))
            .max_ack_inflight(in_flight.max(5_000))
            .build(client);
        // The source stream as delayd creates it, should the requests come before its source connects.
        js.get_or_create_stream(stream::Config {
            name: NATS_STREAM.into(),
            subjects: vec![NATS_SUBJECTS.into()],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await?;
        let _ = js.delete_stream(NATS_OUT_STREAM).await;
        let out = js
            .create_stream(stream::Config {
                name: NATS_OUT_STREAM.into(),
                subjects: vec![NATS_OUT.into()],
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await?;
        let reader: consumer::PullConsumer = out
            .create_consumer(consumer::pull::Config {
                durable_name: Some("loadgen".into()),
                ack_policy: consumer::AckPolicy::None,
                ..Default::default()
            })
            .await?;
        let reader = reader
            .stream()
            .max_messages_per_batch(1000)
            .messages()
            .await?;
        Ok(NatsSidecar {
            js,
            straight,
            reader: tokio::sync::Mutex::new(reader),
            last_seq: AtomicU64::new(0),
        })
    }
}

impl Target for NatsSidecar {
    async fn schedule(&self, jobs: Vec<Job>) -> anyhow::Result<()> {
        let mut acks = Vec::with_capacity(jobs.len());
        for job in &jobs {
            let body = job.body.clone().into();
            acks.push(match self.straight {
                true => self.js.publish(NATS_OUT, body).await?,
                false => {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("delayd-deliver-at", job.due_ms.to_string().as_str());
                    headers.insert("delayd-target", NATS_OUT);
                    self.js.publish_with_headers(NATS_IN, headers, body).await?
                }
            });
        }
        let mut last = 0;
        for ack in acks {
            last = last.max(ack.await?.sequence);
        }
        self.last_seq.fetch_max(last, Ordering::Relaxed);
        Ok(())
    }

    async fn settled(&self) -> anyhow::Result<()> {
        let last = self.last_seq.load(Ordering::Relaxed);
        loop {
            // None until delayd made its consumer.
            let consumer = self
                .js
                .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                    NATS_CONSUMER,
                    NATS_STREAM,
                )
                .await
                .ok();
            if let Some(consumer) = consumer {
                let info = consumer.cached_info();
                if info.num_pending == 0
                    && info.num_ack_pending == 0
                    && info.delivered.stream_sequence >= last
                {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn consume(&self, _consumer: usize) -> anyhow::Result<Vec<(u64, i64)>> {
        let mut reader = self.reader.lock().await;
        let ended = "the target stream's reader ended";
        take_ready(&mut *reader, ended, |message| match message {
            Ok(message) => Ok(Some(parse_body(&String::from_utf8_lossy(&message.payload)))),
            // A missed heartbeat under load, say: the reader goes on; a message it lost would show
            // as lost.
            Err(error) => {
                eprintln!("\nreading the target stream: {error}");
                Ok(None)
            }
        })
        .await
    }
}

// ---------------------------------------------------------------- delayd as a RabbitMQ sidecar

/// The AMQP path: persistent requests published to delayd's source queue through the default exchange
/// on confirming channels (a batch published, then its confirms awaited), due messages consumed
/// (auto-ack) from a target queue the load generator declares.
///
/// [`Target::settled`]: AMQP tells a client a queue's ready messages (a passive `queue.declare`) but not
/// its unacknowledged ones (only the management plugin or `rabbitmqctl` do). So it waits until the
/// source queue has no message ready (delayd was handed every request) and then until delayd's
/// `delayd_source_messages_total` (at `--url`/metrics, counted once a batch's group commit returned
/// from its fsync, just before its `basic.ack`) reaches the number published.
struct AmqpSidecar {
    _connection: lapin::Connection,
    /// Publish to the target itself (`--straight`).
    straight: bool,
    /// Confirming channels, taken in turn by the producers.
    channels: Vec<lapin::Channel>,
    next: AtomicU64,
    reader: tokio::sync::Mutex<lapin::Consumer>,
    produced: Produced,
}

/// The source queue as `benches/sidecar.sh` configures delayd, and the target queue.
const AMQP_IN: &str = "delayd.in";
const AMQP_OUT: &str = "loadgen.out";

impl AmqpSidecar {
    async fn connect(
        url: &str,
        delayd: &str,
        channels: usize,
        straight: bool,
    ) -> anyhow::Result<AmqpSidecar> {
        use lapin::options::{BasicConsumeOptions, ConfirmSelectOptions, QueuePurgeOptions};
        use lapin::types::FieldTable;
        let connection =
            lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
        let mut opened = Vec::new();
        for _ in 0..channels.max(1) {
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            opened.push(channel);
        }
        let channel = &opened[0];
        for queue in [AMQP_IN, AMQP_OUT] {
            // Durable, no arguments: as delayd declares its source queue.
            channel
                .queue_declare(
                    queue.into(),
                    lapin::options::QueueDeclareOptions::durable(),
                    FieldTable::default(),
                )
                .await?;
        }
        channel
            .queue_purge(AMQP_OUT.into(), QueuePurgeOptions::default())
            .await?;
        let reading = connection.create_channel().await?;
        let reader = reading
            .basic_consume(
                AMQP_OUT.into(),
                "loadgen".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        Ok(AmqpSidecar {
            _connection: connection,
            straight,
            channels: opened,
            next: AtomicU64::new(0),
            reader: tokio::sync::Mutex::new(reader),
            produced: Produced::new(delayd)?,
        })
    }
}

/// The requests produced to an MQ delayd reads, beside delayd's HTTP API, whose metrics count those
/// it made durable: what [`Target::settled`] waits for where the MQ does not tell.
struct Produced {
    count: AtomicU64,
    /// delayd's HTTP API, for its metrics.
    http: Http,
}

impl Produced {
    fn new(delayd: &str) -> anyhow::Result<Produced> {
        Ok(Produced {
            count: AtomicU64::new(0),
            http: Http::new(delayd)?,
        })
    }

    /// Counts `count` more requests produced; returns how many were before.
    fn add(&self, count: u64) -> u64 {
        self.count.fetch_add(count, Ordering::Relaxed)
    }

    /// Requests delayd made durable: the sum of `delayd_source_messages_total` over its sources and
    /// outcomes.
    async fn taken(&self) -> anyhow::Result<u64> {
        let (status, text) = self.http.request("GET", "/metrics", "").await?;
        anyhow::ensure!(status == 200, "GET /metrics: HTTP {status}");
        Ok(text
            .lines()
            .filter(|l| l.starts_with("delayd_source_messages_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64)
    }

    /// Whether delayd made every request produced so far durable.
    async fn all_taken(&self) -> anyhow::Result<bool> {
        Ok(self.taken().await? >= self.count.load(Ordering::Relaxed))
    }
}

impl Target for AmqpSidecar {
    async fn schedule(&self, jobs: Vec<Job>) -> anyhow::Result<()> {
        use lapin::types::{AMQPValue, FieldTable, LongString};
        let channel = &self.channels
            [self.next.fetch_add(1, Ordering::Relaxed) as usize % self.channels.len()];
        let mut confirms = Vec::with_capacity(jobs.len());
        for job in &jobs {
            let mut headers = FieldTable::default();
            headers.insert(
                "delayd-deliver-at".into(),
                AMQPValue::LongString(LongString::from(job.due_ms.to_string())),
            );
            headers.insert(
                "delayd-target".into(),
                AMQPValue::LongString(LongString::from(AMQP_OUT)),
            );
            // A message id on every request, as docs/sidecar.md asks: what a redelivery is known by.
            let properties = lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(job.id.to_string().as_str().into())
                .with_headers(headers);
            let (queue, properties) = match self.straight {
                true => (AMQP_OUT, properties.with_headers(FieldTable::default())),
                false => (AMQP_IN, properties),
            };
            confirms.push(
                channel
                    .basic_publish(
                        "".into(),
                        queue.into(),
                        lapin::options::BasicPublishOptions::default(),
                        job.body.as_bytes(),
                        properties,
                    )
                    .await?,
            );
        }
        for confirm in confirms {
            anyhow::ensure!(confirm.await?.is_ack(), "the broker nacked a request");
        }
        self.produced.add(jobs.len() as u64);
        Ok(())
    }

    async fn settled(&self) -> anyhow::Result<()> {
        loop {
            let queue = self.channels[0]
                .queue_declare(
                    AMQP_IN.into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await?;
            if queue.message_count() == 0 && self.produced.all_taken().await? {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn consume(&self, _consumer: usize) -> anyhow::Result<Vec<(u64, i64)>> {
        let mut reader = self.reader.lock().await;
        let ended = "the target queue's consumer ended";
        take_ready(&mut *reader, ended, |delivery| {
            Ok(Some(parse_body(&String::from_utf8_lossy(&delivery?.data))))
        })
        .await
    }
}

// ---------------------------------------------------------------- delayd as a Kafka sidecar

/// The Kafka path: requests produced to delayd's source topic (idempotent, `acks=all`, a batch sent
/// then its delivery reports awaited), due messages read from a target topic by a consumer group of the
/// load generator's own. Both topics are created (tansu creates none on use); a request counts as
/// ingested once delayd counts it durable (`delayd_source_messages_total` at `--url`/metrics), just
/// before it commits the offset.
struct KafkaSidecar {
    producer: rdkafka::producer::FutureProducer,
    /// Publish to the target itself (`--straight`).
    straight: bool,
    /// Straight, with a request's headers (`--with-headers`).
    with_headers: bool,
    reader: rdkafka::consumer::StreamConsumer,
    produced: Produced,
}

/// The source topic as `benches/sidecar.sh` configures delayd, and the target topic.
const KAFKA_IN: &str = "delayd-in";
const KAFKA_OUT: &str = "loadgen-out";

impl KafkaSidecar {
    async fn connect(
        brokers: &str,
        delayd: &str,
        straight: bool,
        with_headers: bool,
    ) -> anyhow::Result<KafkaSidecar> {
        use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
        use rdkafka::consumer::Consumer;
        let config = |extra: &[(&str, &str)]| {
            let mut config = rdkafka::ClientConfig::new();
            config
                .set("bootstrap.servers", brokers)
                .set("log_level", "3");
            for (key, value) in extra {
                config.set(*key, *value);
            }
            config
        };
        let admin: AdminClient<_> = config(&[]).create()?;
        let topics = [
            NewTopic::new(KAFKA_IN, 4, TopicReplication::Fixed(1)),
            NewTopic::new(KAFKA_OUT, 4, TopicReplication::Fixed(1)),
        ];
        // Already there from an earlier run is fine.
        for created in admin.create_topics(&topics, &AdminOptions::new()).await? {
            if let Err((topic, code)) = created {
                anyhow::ensure!(
                    code == rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists,
                    "creating {topic}: {code}"
                );
            }
        }
        let producer = config(&[
            ("acks", "all"),
            ("enable.idempotence", "true"),
            ("linger.ms", "2"),
        ])
        .create()?;
        let reader: rdkafka::consumer::StreamConsumer = config(&[
            ("group.id", "loadgen"),
            // A fresh topic (sidecar.sh starts a fresh broker): from its start, since joining the
            // group may take longer than the first messages take to come due.
            ("auto.offset.reset", "earliest"),
            ("enable.partition.eof", "false"),
            ("fetch.wait.max.ms", "10"),
        ])
        .create()?;
        reader.subscribe(&[KAFKA_OUT])?;
        Ok(KafkaSidecar {
            producer,
            straight,
            with_headers,
            reader,
            produced: Produced::new(delayd)?,
        })
    }

    /// Waits until the reader has joined its group (tansu takes seconds to answer a join), so that a
    /// straight pass times the MQ, not the join.
    async fn join_reader(&self) -> anyhow::Result<()> {
        use rdkafka::consumer::Consumer;
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.reader.assignment()?.count() == 0 {
            let _ = tokio::time::timeout(Duration::from_millis(100), self.reader.recv()).await;
            anyhow::ensure!(
                Instant::now() < deadline,
                "the reader did not join within 120 s"
            );
        }
        Ok(())
    }

    /// Waits until delayd's consumer and this reader have joined their groups (tansu takes seconds to
    /// answer a join): otherwise the first requests come due while nobody consumes and are counted
    /// late. delayd's join is seen from a warm-up request, a cancel of a key nothing has, being taken.
    async fn warm_up(&self) -> anyhow::Result<()> {
        use rdkafka::consumer::Consumer;
        use rdkafka::message::{Header, OwnedHeaders};
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "delayd-target",
                value: Some(KAFKA_OUT),
            })
            .insert(Header {
                key: "delayd-key",
                value: Some("loadgen-warm-up"),
            })
            .insert(Header {
                key: "delayd-cancel",
                value: Some("true"),
            });
        let record = rdkafka::producer::FutureRecord::<(), _>::to(KAFKA_IN)
            .payload("")
            .headers(headers);
        self.producer
            .send(record, Duration::from_secs(60))
            .await
            .map_err(|(e, _)| e)?;
        let before = self.produced.add(1);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            // Polling the reader is what lets it join (nothing is on its fresh topic yet).
            let _ = tokio::time::timeout(Duration::from_millis(100), self.reader.recv()).await;
            let joined = self.reader.assignment()?.count() > 0;
            if joined && self.produced.taken().await? > before {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "delayd's Kafka source or the reader did not join within 120 s"
            );
        }
    }
}

impl Target for KafkaSidecar {
    async fn schedule(&self, jobs: Vec<Job>) -> anyhow::Result<()> {
        use rdkafka::message::{Header, OwnedHeaders};
        let sends = jobs.iter().map(|job| {
            let due = job.due_ms.to_string();
            let headers = OwnedHeaders::new()
                .insert(Header {
                    key: "delayd-deliver-at",
                    value: Some(due.as_str()),
                })
                .insert(Header {
                    key: "delayd-target",
                    value: Some(KAFKA_OUT),
                });
            let record = match (self.straight, self.with_headers) {
                (true, false) => rdkafka::producer::FutureRecord::<(), _>::to(KAFKA_OUT),
                (true, true) => rdkafka::producer::FutureRecord::to(KAFKA_OUT).headers(headers),
                (false, _) => rdkafka::producer::FutureRecord::to(KAFKA_IN).headers(headers),
            };
            self.producer
                .send(record.payload(job.body.as_str()), Duration::from_secs(60))
        });
        for sent in futures_util::future::join_all(sends).await {
            sent.map_err(|(e, _)| e)?;
        }
        self.produced.add(jobs.len() as u64);
        Ok(())
    }

    async fn settled(&self) -> anyhow::Result<()> {
        loop {
            if self.produced.all_taken().await? {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn consume(&self, _consumer: usize) -> anyhow::Result<Vec<(u64, i64)>> {
        use rdkafka::message::Message;
        let mut got = Vec::new();
        let mut wait = Duration::from_millis(200);
        while got.len() < 1000 {
            match tokio::time::timeout(wait, self.reader.recv()).await {
                Err(_) => break,
                Ok(message) => {
                    let message = message?;
                    let body = String::from_utf8_lossy(message.payload().unwrap_or_default());
                    got.push(parse_body(&body));
                }
            }
            wait = Duration::ZERO;
        }
        Ok(got)
    }
}

// ---------------------------------------------------------------- PostgreSQL

struct Postgres {
    pool: Vec<tokio::sync::Mutex<tokio_postgres::Client>>,
    next: AtomicU64,
    poll: Duration,
}

impl Postgres {
    async fn connect(config: &str, connections: usize) -> anyhow::Result<Postgres> {
        let mut pool = Vec::new();
        for _ in 0..connections {
            let (client, connection) =
                tokio_postgres::connect(config, tokio_postgres::NoTls).await?;
            tokio::spawn(connection);
            pool.push(tokio::sync::Mutex::new(client));
        }
        let first = pool[0].lock().await;
        first
            .batch_execute(
                "DROP TABLE IF EXISTS delay_jobs;
                 CREATE TABLE delay_jobs (id bigint PRIMARY KEY, due_at bigint NOT NULL, payload text NOT NULL);
                 CREATE INDEX delay_jobs_due ON delay_jobs (due_at);",
            )
            .await?;
        drop(first);
        Ok(Postgres {
            pool,
            next: AtomicU64::new(0),
            poll: Duration::ZERO,
        })
    }

    fn client(&self) -> &tokio::sync::Mutex<tokio_postgres::Client> {
        &self.pool[self.next.fetch_add(1, Ordering::Relaxed) as usize % self.pool.len()]
    }
}

impl Target for Postgres {
    async fn schedule(&self, jobs: Vec<Job>) -> anyhow::Result<()> {
        let client = self.client().lock().await;
        if jobs.len() == 1 {
            let job = &jobs[0];
            client
                .execute(
                    "INSERT INTO delay_jobs (id, due_at, payload) VALUES ($1, $2, $3)",
                    &[&(job.id as i64), &job.due_ms, &job.body],
                )
                .await?;
        } else {
            // One multi-row INSERT per batch, in one transaction (arrays unnested server-side).
            let ids: Vec<i64> = jobs.iter().map(|j| j.id as i64).collect();
            let dues: Vec<i64> = jobs.iter().map(|j| j.due_ms).collect();
            let bodies: Vec<&str> = jobs.iter().map(|j| j.body.as_str()).collect();
            client
                .execute(
                    "INSERT INTO delay_jobs (id, due_at, payload) SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[])",
                    &[&ids, &dues, &bodies],
                )
                .await?;
        }
        Ok(())
    }

    async fn consume(&self, _consumer: usize) -> anyhow::Result<Vec<(u64, i64)>> {
        let client = self.client().lock().await;
        let rows = client
            .query(
                "DELETE FROM delay_jobs WHERE id IN (
                   SELECT id FROM delay_jobs WHERE due_at <= $1 ORDER BY due_at LIMIT 1000 FOR UPDATE SKIP LOCKED)
                 RETURNING payload",
                &[&now_ms()],
            )
            .await?;
        drop(client);
        if rows.is_empty() {
            tokio::time::sleep(self.poll).await;
        }
        Ok(rows
            .iter()
            .map(|r| parse_body(r.get::<_, &str>(0)))
            .collect())
    }
}

// ---------------------------------------------------------------- the run

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn peak_rss_mb(pid: Option<u32>) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The bytes the process has caused to be written to the storage layer so far (`write_bytes` of
/// `/proc/PID/io`: its threads and its reaped children included; page-cache writes count when the page
/// is dirtied, so a page rewritten after each fsync counts every time).
fn disk_write_bytes(pid: Option<u32>) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{}/io", pid?)).ok()?;
    let line = io.lines().find(|l| l.starts_with("write_bytes:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `write_bytes` once the process has stopped writing: unchanged over 0.5 s (at most 30 s of waiting).
/// Read at the start and the end of a run, so that the writes a run causes after its last answer (a
/// server filing what it acknowledged, its next checkpoint) count for it, and those of what ran before
/// (a warm-up) do not.
async fn settled_write_bytes(pid: Option<u32>) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = disk_write_bytes(pid)?;
    let mut since = Instant::now();
    while Instant::now() < deadline && since.elapsed() < Duration::from_millis(500) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = disk_write_bytes(pid)?;
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    Some(last)
}

async fn run<T: Target>(target: Arc<T>, args: Args) -> Value {
    let per_request = if args.mode == "batch" { args.batch } else { 1 };
    let requests = args.messages.div_ceil(per_request as u64);
    let next_request = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(requests as usize)));
    let due: Arc<Mutex<HashMap<u64, i64>>> = Arc::default();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let padding = "x".repeat(args.body_bytes.saturating_sub(24));
    let spread = args.delay_max_ms.saturating_sub(args.delay_min_ms).max(1);
    let jobs: Arc<Vec<Job>> = Arc::new(
        (0..args.messages)
            .map(|id| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                // Delays; made absolute when the request is sent (a due time counted from the start of
                // the run would already have passed for messages sent late in a long ingest).
                Job {
                    id,
                    due_ms: (args.delay_min_ms + seed % spread) as i64,
                    body: padding.clone(),
                }
            })
            .collect(),
    );
    let written_before = settled_write_bytes(args.pid).await;
    let started = Instant::now();
    let started_ms = now_ms();
    let producers: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (target, next_request, latencies, due, jobs) = (
                target.clone(),
                next_request.clone(),
                latencies.clone(),
                due.clone(),
                jobs.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let r = next_request.fetch_add(1, Ordering::Relaxed);
                    if r >= requests {
                        return;
                    }
                    // Latency counts from when the request was due to go out: a producer held up by a
                    // slow answer sends late, and that wait is the target's too.
                    let mut due_to_send = None;
                    if args.rate > 0 {
                        let at = r as f64 * per_request as f64 / args.rate as f64;
                        let at = started + Duration::from_secs_f64(at);
                        tokio::time::sleep_until(at.into()).await;
                        due_to_send = Some(at);
                    }
                    let from = (r as usize) * per_request;
                    let to = (from + per_request).min(jobs.len());
                    let send_ms = now_ms();
                    let batch: Vec<Job> = jobs[from..to]
                        .iter()
                        .map(|j| {
                            let due_ms = send_ms + j.due_ms;
                            Job {
                                id: j.id,
                                due_ms,
                                body: format!("{}:{}:{}", j.id, due_ms, j.body),
                            }
                        })
                        .collect();
                    {
                        let mut due = due.lock().unwrap();
                        for j in &batch {
                            due.insert(j.id, j.due_ms);
                        }
                    }
                    let sent = due_to_send.unwrap_or_else(Instant::now);
                    target.schedule(batch).await.unwrap();
                    latencies
                        .lock()
                        .unwrap()
                        .push(sent.elapsed().as_secs_f64() * 1000.0);
                    if r % 256 == 0 {
                        progress("scheduled", r * per_request as u64, args.messages);
                    }
                }
            })
        })
        .collect();
    // Consumers run during ingest, as in production.
    let delivered: Arc<Mutex<Vec<(u64, i64, i64)>>> = Arc::default();
    // (A straight pass has no delayd to wait for: its consumers read what was published.)
    let consume = !args.no_consume && !args.publish_only;
    let consuming = Arc::new(std::sync::atomic::AtomicBool::new(consume));
    // One consumer per delayd queue (each holds a long poll); one reader of a sidecar's target (two
    // would each read every message); two pollers for the peers.
    let consumer_count = match args.target.as_str() {
        "delayd" => 4,
        sidecar if sidecar.starts_with("delayd-") => 1,
        _ => 2,
    };
    let consumers: Vec<_> = (0..consumer_count)
        .map(|consumer| {
            let (target, delivered, consuming) =
                (target.clone(), delivered.clone(), consuming.clone());
            tokio::spawn(async move {
                while consuming.load(Ordering::Relaxed) {
                    let got = target.consume(consumer).await.unwrap();
                    let at = now_ms();
                    delivered
                        .lock()
                        .unwrap()
                        .extend(got.into_iter().map(|(id, due)| (id, due, at)));
                }
            })
        })
        .collect();
    for producer in producers {
        producer.await.unwrap();
    }
    if !args.publish_only && !args.straight {
        target.settled().await.unwrap();
    }
    let ingest_s = started.elapsed().as_secs_f64();
    progress("scheduled", args.messages, args.messages);
    eprintln!();
    let mut result = json!({});
    if consume {
        // Wait for everything to come due and out (plus the grace).
        let last_due = due.lock().unwrap().values().copied().max().unwrap_or(0);
        let deadline = Instant::now()
            + Duration::from_millis((last_due - now_ms()).max(0) as u64 + args.grace_ms);
        while Instant::now() < deadline && delivered.lock().unwrap().len() < args.messages as usize
        {
            tokio::time::sleep(Duration::from_millis(1000)).await;
            let delivered = delivered.lock().unwrap().len() as u64;
            progress("delivered", delivered, args.messages);
        }
        eprintln!();
        consuming.store(false, Ordering::Relaxed);
        for consumer in consumers {
            consumer.await.unwrap(); // a consumer that failed would show as losses
        }
        let delivered = delivered.lock().unwrap();
        let due = due.lock().unwrap();
        if let Some(path) = &args.dump {
            let lines: String = delivered
                .iter()
                .map(|(id, due_ms, at)| format!("{id} {due_ms} {at}\n"))
                .collect();
            std::fs::write(path, lines).unwrap();
        }
        let mut seen = HashMap::new();
        let mut lateness: Vec<f64> = Vec::new();
        let mut early = 0;
        for (id, due_ms, at) in delivered.iter() {
            *seen.entry(*id).or_insert(0u32) += 1;
            if at < due_ms {
                early += 1;
            }
            lateness.push((at - due_ms) as f64);
        }
        lateness.sort_by(f64::total_cmp);
        let duplicates: u32 = seen.values().map(|n| n - 1).sum();
        let lost = due.keys().filter(|id| !seen.contains_key(id)).count();
        result["lateness_ms"] = json!({"p50": percentile(&lateness, 0.5), "p99": percentile(&lateness, 0.99), "max": percentile(&lateness, 1.0)});
        result["early"] = json!(early);
        result["duplicates"] = json!(duplicates);
        result["lost"] = json!(lost);
        // From the first request sent to the last message consumed, when every message came.
        let last = delivered.iter().map(|(_, _, at)| *at).max();
        result["pass_s"] = json!(last
            .filter(|_| lost == 0)
            .map(|at| (at - started_ms) as f64 / 1000.0));
    }
    let mut latencies = latencies.lock().unwrap().clone();
    latencies.sort_by(f64::total_cmp);
    result["target"] = json!(args.target);
    result["label"] = json!(args.label);
    result["mode"] = json!(args.mode);
    result["messages"] = json!(args.messages);
    result["ingest_per_sec"] = json!((args.messages as f64 / ingest_s).round());
    result["request_latency_ms"] =
        json!({"p50": percentile(&latencies, 0.5), "p99": percentile(&latencies, 0.99)});
    result["peak_rss_mb"] = json!(peak_rss_mb(args.pid));
    let written = written_before
        .zip(settled_write_bytes(args.pid).await)
        .map(|(before, after)| after.saturating_sub(before));
    result["disk_write_bytes"] = json!(written);
    let payload = args.messages as f64 * args.body_bytes as f64;
    result["write_amplification"] = json!(written
        .filter(|_| payload > 0.0)
        .map(|w| w as f64 / payload));
    result
}

/// Redraws the progress bar on stderr: `delayd scheduled [#######-------------]  35% 17,500/50,000`.
fn progress(phase: &str, done: u64, total: u64) {
    const WIDTH: u64 = 30;
    let done = done.min(total);
    let filled = (done * WIDTH).checked_div(total).unwrap_or(WIDTH) as usize;
    let target = std::env::args()
        .skip_while(|a| a != "--target")
        .nth(1)
        .unwrap_or_default();
    eprint!(
        "\r{target} {phase:>9} [{}{}] {:>3}% {done}/{total}   ",
        "#".repeat(filled),
        "-".repeat(WIDTH as usize - filled),
        (done * 100).checked_div(total).unwrap_or(100),
    );
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; keep only our own arguments.
    let args = Args::parse_from(std::env::args().filter(|a| a != "--bench"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let poll = Duration::from_millis(args.poll_ms);
    let result = runtime.block_on(async {
        anyhow::Ok(match args.target.as_str() {
            "delayd" => {
                anyhow::ensure!(
                    !(args.keyed && args.mode == "batch"),
                    "--keyed needs --mode single (delayd takes dedup messages one at a time)"
                );
                let target = Delayd {
                    http: Http::new(&args.url)?,
                    batch: args.mode == "batch",
                    keyed: args.keyed,
                    offsets: (0..4).map(|_| AtomicU64::new(0)).collect(),
                };
                run(Arc::new(target), args.clone()).await
            }
            "redis" => {
                let client = redis::Client::open(args.redis_url.as_str())?;
                let mut connection = client.get_multiplexed_async_connection().await?;
                // A durable Redis under a large load answers slowly at times; wait rather than fail.
                connection.set_response_timeout(Duration::from_secs(120));
                let () = redis::cmd("DEL")
                    .arg("delay:due")
                    .arg("delay:payload")
                    .arg("delay:ready")
                    .query_async(&mut connection)
                    .await?;
                let target = Redis {
                    connection,
                    mover: redis::Script::new(MOVE_DUE),
                    poll,
                };
                run(Arc::new(target), args.clone()).await
            }
            "delayd-redis" => {
                let client = redis::Client::open(args.redis_url.as_str())?;
                let mut connection = client.get_multiplexed_async_connection().await?;
                connection.set_response_timeout(Duration::from_secs(120));
                let () = redis::cmd("DEL")
                    .arg(SIDECAR_OUT)
                    .query_async(&mut connection)
                    .await?;
                let target = Sidecar {
                    connection,
                    straight: args.straight,
                    last: tokio::sync::Mutex::new("0".into()),
                    produced: AtomicU64::new(0),
                };
                run(Arc::new(target), args.clone()).await
            }
            "delayd-nats" => {
                let per_request = if args.mode == "batch" { args.batch } else { 1 };
                let in_flight = args.concurrency * per_request;
                let target = NatsSidecar::connect(&args.nats_url, in_flight, args.straight).await?;
                run(Arc::new(target), args.clone()).await
            }
            "delayd-amqp" => {
                let channels = args.concurrency.min(16);
                let target =
                    AmqpSidecar::connect(&args.amqp_url, &args.url, channels, args.straight)
                        .await?;
                run(Arc::new(target), args.clone()).await
            }
            "delayd-kafka" => {
                let (brokers, url) = (&args.kafka_brokers, &args.url);
                let target =
                    KafkaSidecar::connect(brokers, url, args.straight, args.with_headers).await?;
                if args.straight {
                    target.join_reader().await?;
                } else if !args.publish_only {
                    target.warm_up().await?;
                }
                run(Arc::new(target), args.clone()).await
            }
            "postgres" => {
                let mut target =
                    Postgres::connect(&args.postgres, args.concurrency.min(32) + 2).await?;
                target.poll = poll;
                run(Arc::new(target), args.clone()).await
            }
            other => {
                anyhow::bail!("unknown target {other:?}: delayd, delayd-redis, delayd-nats, delayd-amqp, delayd-kafka, redis or postgres")
            }
        })
    })?;
    println!("{result}");
    Ok(())
}
