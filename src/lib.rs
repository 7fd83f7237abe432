//! delayd: a durable, millisecond-precise delay / scheduled-message service.
//!
//! Layers, bottom up: the storage engine (`schedulelog`, re-exported), the [`scheduler`] (loader, wheel,
//! dispatcher) and the [`sink`]s it delivers to, the built-in [`broker`], the HTTP [`api`], and the
//! [`edge`] that serves it within limits (timeouts, a connection cap, descriptors kept for storage).
//! [`run`] wires them together on a listener the caller bound, so tests can bind port 0.

#![forbid(unsafe_code)]

pub mod api;
pub mod broker;
pub mod config;
pub mod disk;
pub mod edge;
pub mod format;
pub mod intake;
pub mod link;
pub mod metrics;
pub mod mq;
pub mod notify;
pub mod scheduler;
pub mod sink;
pub mod source;

pub use schedulelog;

use anyhow::Context;
use broker::{Broker, BrokerSink};
use config::Config;
use schedulelog::{Clock, Options, ScheduleLog, SegmentMinutes, SystemClock};
use scheduler::{Scheduler, SchedulerConfig};
use sink::{Backoff, SinkPolicy, SinkRegistry};
use std::future::Future;
use std::sync::Arc;

/// Runs the service on `listener` until `shutdown` completes, then stops accepting requests, lets the
/// WAL group in flight finish, checkpoints and returns.
pub async fn run(
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    run_with_clock(config, listener, Arc::new(SystemClock), shutdown).await
}

/// [`run`] with a given clock.
pub async fn run_with_clock(
    config: Config,
    listener: tokio::net::TcpListener,
    clock: Arc<dyn Clock>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    run_with_ready(config, listener, clock, |_| {}, shutdown).await
}

/// [`run_with_clock`], calling `on_ready` once the service is ready: recovery is done, storage and the
/// broker are open, the scheduler runs, and connections are about to be accepted (they may already wait
/// in the listen backlog). From then on `GET /readyz` answers, and it stays the source of truth (it
/// turns 503 when storage fails).
pub async fn run_with_ready(
    config: Config,
    listener: tokio::net::TcpListener,
    clock: Arc<dyn Clock>,
    on_ready: impl FnOnce(&edge::Ready),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let metrics = metrics::install();
    let config = Arc::new(config);
    let options = Options {
        segment_minutes: SegmentMinutes::new(config.segment_minutes).context("segment_minutes")?,
        fsync: config.fsync_policy()?,
        retention: config.retention.0,
        clock: clock.clone(),
        ..Options::default()
    };
    let data_dir = config.data_dir.clone();
    let broker_options = config.broker.options();
    let (log, broker) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let log = ScheduleLog::open(&data_dir, options)
            .with_context(|| format!("opening the data dir {}", data_dir.display()))?;
        let broker = Broker::open(&data_dir, broker_options).context("opening the broker store")?;
        Ok((Arc::new(log), Arc::new(broker)))
    })
    .await??;

    // Where an MQ sink may publish (every MQ sink has that).
    let targets = |sink: &config::SinkConfig| sink.targets().context("an MQ sink's targets");
    let mut sinks = SinkRegistry::new();
    let mut sink_links = Vec::new();
    let mut probes = Vec::new();
    for (name, sink) in &config.sinks {
        let policy = SinkPolicy {
            max_in_flight: sink.max_in_flight,
            max_batch: sink.batch_limit(),
            rate_per_sec: sink.rate_per_sec,
            burst: sink.burst,
            max_attempts: sink.max_attempts,
            backoff: Backoff {
                initial: sink.backoff_initial.0,
                multiplier: sink.backoff_multiplier,
                cap: sink.backoff_cap.0,
            },
        };
        // An MQ sink keeps a connection, which its link shows (`GET /v1/sinks`).
        let link = || link::Link::new("sink", name, &sink.kind);
        let (target, link): (Arc<dyn sink::Sink>, Option<link::Link>) =
            match (sink.kind.as_str(), &sink.url, &sink.secret) {
                ("webhook", Some(url), Some(secret)) => {
                    let webhook = sink::webhook::WebhookSink::new(
                        url,
                        secret,
                        sink.timeout.0,
                        sink.ca_file.as_deref(),
                        clock.clone(),
                    )?;
                    (Arc::new(webhook), None)
                }
                ("redis", Some(url), _) => {
                    let link = link();
                    let redis = sink::redis::RedisSink::new(
                        url,
                        targets(sink)?,
                        link.clone(),
                        clock.clone(),
                    )?;
                    (Arc::new(redis), Some(link))
                }
                ("nats", Some(url), _) => {
                    let link = link();
                    let nats =
                        sink::nats::NatsSink::new(url, targets(sink)?, link.clone(), clock.clone());
                    (Arc::new(nats), Some(link))
                }
                ("amqp", Some(url), _) => {
                    let link = link();
                    let amqp = sink::amqp::AmqpSink::new(
                        url,
                        sink.exchange.as_deref().unwrap_or(""),
                        targets(sink)?,
                        sink.max_in_flight,
                        link.clone(),
                        clock.clone(),
                    );
                    (Arc::new(amqp), Some(link))
                }
                ("kafka", Some(url), _) => {
                    let link = link();
                    let kafka = sink::kafka::KafkaSink::new(
                        url,
                        config.limits.max_message_bytes,
                        targets(sink)?,
                        link.clone(),
                        clock.clone(),
                    )?;
                    (Arc::new(kafka), Some(link))
                }
                _ => (
                    Arc::new(BrokerSink::new(broker.clone(), clock.clone())),
                    None,
                ),
            };
        if let Some(link) = link {
            sink_links.push(link.clone());
            probes.push((target.clone(), link));
        }
        sinks.register(name, target, policy)?;
    }
    metrics::register_series(config.sinks.keys().map(String::as_str));
    let scheduler_config = SchedulerConfig {
        tick_ms: i64::from(config.tick_ms),
        preload: config.preload.0,
        dead_letters: Some(Arc::new(BrokerSink::new(broker.clone(), clock.clone()))),
        ..SchedulerConfig::default()
    };
    let scheduler = Arc::new(Scheduler::start(
        log.clone(),
        &sinks,
        scheduler_config,
        clock.clone(),
        &tokio::runtime::Handle::current(),
    )?);
    let disk = Arc::new(disk::DiskWatch::new(
        config.data_dir.clone(),
        config.limits.min_free_disk_bytes,
    ));
    disk.check(&[log.disk_full(), broker.disk_full()]);
    let probing = tokio::spawn(sink::probe(probes));
    let housekeeping = tokio::spawn(housekeeping(
        log.clone(),
        broker.clone(),
        disk.clone(),
        clock.clone(),
    ));
    // The idempotency index is rebuilt from the pending messages that carry an idempotency key.
    let intake = {
        let (log, scheduler, config, clock, disk) = (
            log.clone(),
            scheduler.clone(),
            config.clone(),
            clock.clone(),
            disk.clone(),
        );
        Arc::new(
            tokio::task::spawn_blocking(move || {
                intake::Intake::open(log, scheduler, config, clock, disk)
            })
            .await??,
        )
    };
    intake.start_pruning();
    let (stop_sources, sources) = start_sources(&config, &intake).await?;
    let state = Arc::new(api::Services {
        log: log.clone(),
        scheduler: scheduler.clone(),
        broker,
        disk,
        config: config.clone(),
        clock,
        metrics,
        intake,
        sources: sources.iter().map(|(link, _)| link.clone()).collect(),
        sink_links,
    });
    let router = api::router(state);
    tracing::info!(data_dir = %config.data_dir.display(), "recovery done: storage and the broker are open");
    let served = edge::serve(
        listener,
        router,
        edge::Limits::from_config(&config),
        on_ready,
        shutdown,
    )
    .await;
    if served.is_ok() {
        tracing::info!("shutting down: no new requests; finishing deliveries in flight");
    }
    housekeeping.abort();
    probing.abort();
    // Sources first: what they took is acknowledged or left to the MQ before the log closes.
    let _ = stop_sources.send(true);
    for (_, task) in sources {
        let _ = task.await;
    }
    scheduler.shutdown().await;
    drop(scheduler);
    // The last reference closes the log: pending group commits finish and a checkpoint is written.
    tokio::task::spawn_blocking(move || match Arc::try_unwrap(log) {
        Ok(log) => log.close().context("closing the log"),
        Err(log) => {
            drop(log);
            Ok(())
        }
    })
    .await??;
    // A refused start (too few file descriptors) still stops what was started above, cleanly.
    served.context("serving HTTP")?;
    tracing::info!("stopped cleanly");
    Ok(())
}

/// Opens and starts every configured source; each runs until the sender says `true`.
async fn start_sources(
    config: &Config,
    intake: &Arc<intake::Intake>,
) -> anyhow::Result<(
    tokio::sync::watch::Sender<bool>,
    Vec<(link::Link, tokio::task::JoinHandle<()>)>,
)> {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut started = Vec::new();
    for (name, source) in &config.sources {
        let transport: Box<dyn source::Transport> =
            match (source.kind.as_str(), &source.url, &source.stream_key) {
                ("amqp", Some(url), _) => Box::new(source::amqp::AmqpTransport::new(
                    url,
                    source.queue.as_deref().unwrap_or_default(),
                    name,
                    source.batch,
                )),
                ("redis", Some(url), Some(stream_key)) => Box::new(
                    source::redis::RedisTransport::new(
                        url,
                        stream_key,
                        &source.group,
                        source.consumer.as_deref().unwrap_or_default(),
                    )
                    .with_context(|| format!("sources.{name}"))?,
                ),
                ("kafka", Some(url), None) => Box::new(
                    source::kafka::KafkaTransport::new(
                        url,
                        &source.topics,
                        &source.group,
                        source.consumer.as_deref().unwrap_or_default(),
                        &source::mark::beside(&config.data_dir, name, "kafka-epochs"),
                    )
                    .with_context(|| format!("sources.{name}"))?,
                ),
                ("nats", Some(url), None) => Box::new(source::nats::NatsTransport::new(
                    url,
                    source.stream.as_deref().unwrap_or_default(),
                    source.subject.as_deref().unwrap_or_default(),
                    &source.group,
                    source.ack_wait.0,
                    source.batch,
                )),
                _ => anyhow::bail!("sources.{name}: kind {:?} is not supported", source.kind),
            };
        let settings = source::SourceSettings {
            name: name.clone(),
            sink: source.sink.clone().unwrap_or_default(),
            batch: source.batch,
            data_dir: config.data_dir.clone(),
        };
        let link = link::Link::new("source", name, &source.kind);
        let (intake, runner_link) = (intake.clone(), link.clone());
        let runner = tokio::task::spawn_blocking(move || {
            source::SourceRunner::open(settings, intake, runner_link, transport)
        })
        .await?
        .with_context(|| format!("opening sources.{name}"))?;
        started.push((link, tokio::spawn(runner.run(stopped.clone()))));
    }
    Ok((stop, started))
}

/// Once a second: broker retention, the disk's state, and the log's health, each change logged once.
async fn housekeeping(
    log: Arc<ScheduleLog>,
    broker: Arc<Broker>,
    disk: Arc<disk::DiskWatch>,
    clock: Arc<dyn Clock>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut poisoned = false;
    loop {
        tick.tick().await;
        let (log, broker, disk, now) = (log.clone(), broker.clone(), disk.clone(), clock.now_ms());
        let checked = tokio::task::spawn_blocking(move || {
            match broker.enforce_retention(now) {
                Ok(retired) if retired.segments > 0 => tracing::info!(
                    segments = retired.segments,
                    bytes = retired.bytes,
                    unread = retired.unread,
                    "broker retention deleted old segments"
                ),
                Ok(_) => {}
                Err(error) => tracing::error!(%error, "broker retention failed; trying again"),
            }
            disk.check(&[log.disk_full(), broker.disk_full()]);
            log.poisoned()
        })
        .await;
        if let (Ok(Some(cause)), false) = (checked, poisoned) {
            poisoned = true;
            tracing::error!(%cause, "the log is poisoned: writes are refused until delayd is restarted");
        }
    }
}
