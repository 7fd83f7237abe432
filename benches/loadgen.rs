//! The load generator: one workload, driven against delayd or against the delay queues people build
//! instead (a Redis sorted set, a PostgreSQL table), each configured durable.
//!
//! ```text
//! cargo bench --bench loadgen -- --target delayd --url http://127.0.0.1:7070 --messages 100000 \
//!     --mode batch --batch 1000 --concurrency 8 --delay-min-ms 1000 --delay-max-ms 5000 --pid $PID
//! ```
//!
//! It schedules `--messages` messages (one per request, or `--batch` per request) from `--concurrency`
//! producers, with delivery times uniform in [now + delay-min, now + delay-max]; consumes the deliveries;
//! and prints one JSON line: durable ingest rate, request latency p50/p99, delivery lateness p50/p99/max
//! (time the consumer got it minus the due time), early deliveries, duplicates, losses, and the target
//! process's peak RSS (`--pid`). `--no-consume` only ingests (for memory figures).
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
    /// delayd, redis or postgres
    #[arg(long)]
    target: String,
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    url: String,
    #[arg(long, default_value = "redis://127.0.0.1:6399/")]
    redis_url: String,
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
    /// How often the peers' movers/workers look for due messages
    #[arg(long, default_value_t = 100)]
    poll_ms: u64,
    /// Body size in bytes
    #[arg(long, default_value_t = 100)]
    body_bytes: usize,
    /// Only ingest (no consumer)
    #[arg(long)]
    no_consume: bool,
    /// The target's process id, for its peak RSS
    #[arg(long)]
    pid: Option<u32>,
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

/// A delay queue under test: durable on return from `schedule`; `consume` returns what became
/// deliverable (id, due time) and waits a little when nothing did.
trait Target: Send + Sync + 'static {
    fn schedule(&self, jobs: Vec<Job>) -> impl Future<Output = anyhow::Result<()>> + Send;
    fn consume(&self) -> impl Future<Output = anyhow::Result<Vec<(u64, i64)>>> + Send;
}

// ---------------------------------------------------------------- delayd

struct Delayd {
    url: String,
    client: reqwest::Client,
    batch: bool,
    /// Consume-queue offsets; each `consume` call long-polls the next queue in turn, so that several
    /// consumer tasks keep one long poll open per queue.
    offsets: Vec<tokio::sync::Mutex<u64>>,
    turn: AtomicU64,
}

impl Target for Delayd {
    async fn schedule(&self, jobs: Vec<Job>) -> anyhow::Result<()> {
        // The JSON is written directly (bodies are digits, ':' and 'x', nothing to escape): the generator
        // shares the CPU with the server, and building `Value` trees would bill it for the client's work.
        let message = |j: &Job| {
            format!(
                r#"{{"topic":"loadgen","body":"{}","deliver_at":{}}}"#,
                j.body, j.due_ms
            )
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
        let response = self
            .client
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await?;
        anyhow::ensure!(response.status().is_success(), "HTTP {}", response.status());
        if self.batch {
            // Every result is an id or an error object; a scan is enough to tell.
            let answer = response.text().await?;
            anyhow::ensure!(
                !answer.contains(r#""error""#),
                "a message was refused: {answer:.300}"
            );
        }
        Ok(())
    }

    async fn consume(&self) -> anyhow::Result<Vec<(u64, i64)>> {
        let queue = self.turn.fetch_add(1, Ordering::Relaxed) as usize % self.offsets.len();
        let Ok(mut offset) = self.offsets[queue].try_lock() else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            return Ok(Vec::new());
        };
        let url = format!(
            "{}/v1/topics/loadgen/queues/{queue}/messages?offset={}&max=1000&wait_ms=1000",
            self.url, *offset
        );
        let response = self.client.get(url).send().await?;
        if response.status() == 404 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            return Ok(Vec::new());
        }
        let answer: Value = response.json().await?;
        let got = answer["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| parse_body(m["body"].as_str().unwrap_or("")))
            .collect();
        *offset = answer["next_offset"].as_u64().unwrap_or(*offset);
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

    async fn consume(&self) -> anyhow::Result<Vec<(u64, i64)>> {
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

    async fn consume(&self) -> anyhow::Result<Vec<(u64, i64)>> {
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
                // Offsets from the start of the run; made absolute when sent.
                Job {
                    id,
                    due_ms: (args.delay_min_ms + seed % spread) as i64,
                    body: padding.clone(),
                }
            })
            .collect(),
    );
    let started = Instant::now();
    let start_ms = now_ms();
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
                    let from = (r as usize) * per_request;
                    let to = (from + per_request).min(jobs.len());
                    let batch: Vec<Job> = jobs[from..to]
                        .iter()
                        .map(|j| {
                            let due_ms = start_ms + j.due_ms;
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
                    let sent = Instant::now();
                    target.schedule(batch).await.unwrap();
                    latencies
                        .lock()
                        .unwrap()
                        .push(sent.elapsed().as_secs_f64() * 1000.0);
                    if r % 1000 == 0 {
                        eprint!("\r{} scheduled {}/{} requests", args_label(), r, requests);
                    }
                }
            })
        })
        .collect();
    // Consumers run during ingest, as in production.
    let delivered: Arc<Mutex<Vec<(u64, i64, i64)>>> = Arc::default();
    let consuming = Arc::new(std::sync::atomic::AtomicBool::new(!args.no_consume));
    // One consumer per delayd queue (each holds a long poll); two pollers for the peers.
    let consumer_count = if args.target == "delayd" { 4 } else { 2 };
    let consumers: Vec<_> = (0..consumer_count)
        .map(|_| {
            let (target, delivered, consuming) =
                (target.clone(), delivered.clone(), consuming.clone());
            tokio::spawn(async move {
                while consuming.load(Ordering::Relaxed) {
                    let got = target.consume().await.unwrap();
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
    let ingest_s = started.elapsed().as_secs_f64();
    eprintln!();
    let mut result = json!({});
    if !args.no_consume {
        // Wait for everything to come due and out (plus five seconds of grace).
        let last_due = due.lock().unwrap().values().copied().max().unwrap_or(0);
        let deadline =
            Instant::now() + Duration::from_millis((last_due - now_ms()).max(0) as u64 + 5_000);
        while Instant::now() < deadline && delivered.lock().unwrap().len() < args.messages as usize
        {
            tokio::time::sleep(Duration::from_millis(1000)).await;
            eprint!(
                "\r{} delivered {}/{}   ",
                args_label(),
                delivered.lock().unwrap().len(),
                args.messages
            );
        }
        eprintln!();
        consuming.store(false, Ordering::Relaxed);
        for consumer in consumers {
            let _ = consumer.await;
        }
        let delivered = delivered.lock().unwrap();
        let due = due.lock().unwrap();
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
    result
}

fn args_label() -> String {
    std::env::args()
        .skip_while(|a| a != "--target")
        .nth(1)
        .unwrap_or_default()
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
                let target = Delayd {
                    url: args.url.trim_end_matches('/').to_string(),
                    client: reqwest::Client::builder()
                        .pool_max_idle_per_host(256)
                        .build()?,
                    batch: args.mode == "batch",
                    offsets: (0..4).map(|_| tokio::sync::Mutex::new(0)).collect(),
                    turn: AtomicU64::new(0),
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
            "postgres" => {
                let mut target =
                    Postgres::connect(&args.postgres, args.concurrency.min(32) + 2).await?;
                target.poll = poll;
                run(Arc::new(target), args.clone()).await
            }
            other => anyhow::bail!("unknown target {other:?}: delayd, redis or postgres"),
        })
    })?;
    println!("{result}");
    Ok(())
}
