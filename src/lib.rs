//! delayd: a durable, millisecond-precise delay / scheduled-message service.
//!
//! Layers, bottom up: the storage engine (`schedulelog`, re-exported), the [`scheduler`] (loader, wheel,
//! dispatcher) and the [`sink`]s it delivers to, the built-in [`broker`], the HTTP [`api`], and the
//! [`edge`] that serves it within limits (timeouts, a connection cap, descriptors kept for storage).
//! [`run`] wires them together on a listener the caller bound, so tests can bind port 0.

#![forbid(unsafe_code)]

pub mod api;
pub mod broker;
pub mod cluster;
pub mod config;
pub mod connection;
pub mod disk;
pub mod edge;
pub mod intake;
pub mod metrics;
pub mod mq;
pub mod names;
pub mod notify;
pub mod peer;
pub mod scheduler;
pub mod setting;
pub mod sink;
pub mod source;
pub mod timestamp;

pub use schedulelog;

use anyhow::Context;
use broker::{Broker, BrokerSink};
use config::Config;
use schedulelog::{Clock, Options, ScheduleLog, SegmentMinutes, SystemClock};
use scheduler::{Scheduler, SchedulerConfig};
use sink::SinkRegistry;
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

    let mut sinks = SinkRegistry::new();
    let mut sink_connections = Vec::new();
    let mut probes = Vec::new();
    for (name, sink) in &config.sinks {
        let (target, connection) = sink
            .build(name, &broker, &clock, config.limits.max_message_bytes)
            .with_context(|| format!("sinks.{name}"))?;
        if let Some(connection) = connection {
            sink_connections.push(connection.clone());
            probes.push((target.clone(), connection));
        }
        sinks.register(name, target, sink.policy())?;
    }
    metrics::register_series(config.sinks.keys().map(String::as_str));
    let scheduler_config = SchedulerConfig {
        tick_ms: i64::from(config.tick_ms),
        preload: config.preload.0,
        dead_letters: Some(Arc::new(BrokerSink::new(broker.clone()))),
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
                intake::Intake::open(log, scheduler, config.admission(), clock, disk)
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
        sources: sources
            .iter()
            .map(|(connection, _)| connection.clone())
            .collect(),
        sink_connections,
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
    Vec<(connection::ConnectionState, tokio::task::JoinHandle<()>)>,
)> {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut started = Vec::new();
    for (name, source) in &config.sources {
        let transport = source
            .build(name, &config.data_dir)
            .with_context(|| format!("sources.{name}"))?;
        let settings = source::SourceSettings {
            name: name.clone(),
            sink: source.shared.sink.clone().unwrap_or_default(),
            batch: source.shared.batch,
            data_dir: config.data_dir.clone(),
        };
        let connection = connection::ConnectionState::new("source", name, source.kind.name());
        let (intake, runner_connection) = (intake.clone(), connection.clone());
        let runner = tokio::task::spawn_blocking(move || {
            source::SourceRunner::open(settings, intake, runner_connection, transport)
        })
        .await?
        .with_context(|| format!("opening sources.{name}"))?;
        started.push((connection, tokio::spawn(runner.run(stopped.clone()))));
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
