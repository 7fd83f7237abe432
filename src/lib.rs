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
        replicated: config.cluster.is_some(),
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
    let base = Base {
        log: log.clone(),
        broker,
        sinks,
        sink_connections,
        disk,
        config: config.clone(),
        clock,
        metrics,
    };
    let limits = edge::Limits::from_config(&config);
    let mut proposers = Vec::new();
    let mut raft_failed = None;
    let served = match &config.cluster {
        None => {
            let term = Term::start(&base, None).await?;
            let router = api::router(term.state.clone());
            tracing::info!(data_dir = %config.data_dir.display(), "recovery done: storage and the broker are open");
            let served = edge::serve(listener, router, limits, on_ready, shutdown).await;
            if served.is_ok() {
                tracing::info!("shutting down: no new requests; finishing deliveries in flight");
            }
            term.stop().await;
            served
        }
        Some(cluster) => {
            let settings = cluster::node::Settings {
                id: cluster.node_id,
                listen: cluster.listen.clone(),
                secret: cluster.secret.clone(),
                election_timeout: cluster.election_timeout.0,
                members: (cluster.members.iter())
                    .map(|m| {
                        let member = cluster::Member {
                            api: m.api.clone(),
                            peer: m.peer.clone(),
                        };
                        (m.id, member)
                    })
                    .collect(),
            };
            let raft_dir = config.data_dir.join(RAFT_DIR);
            // The broker's appends and group offsets are entries too (DESIGN.md §10): proposed
            // through the log, applied by every member into its own broker files.
            base.broker.replicate_through(&log);
            let broker = base.broker.clone();
            let applier: cluster::store::Applier =
                Arc::new(move |at, op| broker.apply_op(at, op).map_err(|e| e.to_string()));
            let node = Arc::new(
                cluster::node::Node::start(
                    settings,
                    &log,
                    &raft_dir,
                    base.clock.clone(),
                    Some(applier),
                )
                .await?,
            );
            let (publish, leading) = tokio::sync::watch::channel(None);
            let (stop_leading, stopped) = tokio::sync::watch::channel(false);
            let leadership = tokio::spawn(lead(base.clone(), node.clone(), publish, stopped));
            // Raft stopped for good (a storage error: a write or an apply failed): the member stops
            // as a whole and exits non-zero, for its supervisor to restart it, rather than answer
            // as a member that no longer takes part.
            let mut raft_metrics = node.raft().metrics();
            let raft_stopped = async move {
                loop {
                    if let Err(fatal) = &raft_metrics.borrow_and_update().running_state {
                        return fatal.to_string();
                    }
                    if raft_metrics.changed().await.is_err() {
                        return "Raft stopped".to_string();
                    }
                }
            };
            let fatal = Arc::new(std::sync::Mutex::new(None));
            let noted = fatal.clone();
            let shutdown = async move {
                tokio::select! {
                    _ = shutdown => {}
                    cause = raft_stopped => {
                        tracing::error!(%cause, "Raft stopped on an error: this member shuts down");
                        *noted.lock().unwrap_or_else(|p| p.into_inner()) = Some(cause);
                    }
                }
            };
            let state = Arc::new(api::member::MemberState {
                node: node.clone(),
                leading,
                forwarder: api::forward::Forwarder::new(
                    cluster.node_id,
                    config.limits.max_request_bytes,
                    config.broker.max_wait.0,
                )
                .context("building the HTTP client that forwards requests to the leader")?,
                log: log.clone(),
                broker: base.broker.clone(),
                config: config.clone(),
                metrics: base.metrics.clone(),
            });
            tracing::info!(data_dir = %config.data_dir.display(), member = cluster.node_id, "recovery done: storage and the broker are open; this member joins the cluster");
            let served = edge::serve(
                listener,
                api::member::router(state),
                limits,
                on_ready,
                shutdown,
            )
            .await;
            if served.is_ok() {
                tracing::info!("shutting down: no new requests; finishing deliveries in flight");
            }
            let _ = stop_leading.send(true);
            let _ = leadership.await;
            node.shutdown().await;
            if let Some(proposer) = node.take_proposer() {
                proposers.push(proposer);
            }
            raft_failed = fatal.lock().unwrap_or_else(|p| p.into_inner()).take();
            served
        }
    };
    housekeeping.abort();
    probing.abort();
    drop(base);
    // A member's Raft lets go of its handles on the log as its tasks end, after its shutdown returned
    // (housekeeping's too, once aborted): a few seconds at most, so that the log is closed here.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while Arc::strong_count(&log) > 1 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // The last reference closes the log: pending group commits finish and a checkpoint is written.
    tokio::task::spawn_blocking(move || match Arc::try_unwrap(log) {
        Ok(log) => log.close().context("closing the log"),
        Err(log) => {
            drop(log);
            Ok(())
        }
    })
    .await??;
    // A member's proposer ends once its log is closed.
    for proposer in proposers {
        let _ = tokio::task::spawn_blocking(move || proposer.join()).await;
    }
    // A refused start (too few file descriptors) still stops what was started above, cleanly.
    served.context("serving HTTP")?;
    if let Some(cause) = raft_failed {
        anyhow::bail!("Raft stopped on an error, so this member did: {cause}");
    }
    tracing::info!("stopped cleanly");
    Ok(())
}

/// How often a follower retires finished buckets (the scheduler's loader's default on the leader).
const FOLLOWER_RETIRE_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// A member's Raft state (its vote) in the data dir.
const RAFT_DIR: &str = "raft";

/// Runs a term of `node`'s each time it leads, and stops it as soon as it no longer does; publishes
/// the term's API for the member's routes (api/member.rs). Ends, stopping a term that runs, once
/// `stop` says `true`.
async fn lead(
    base: Base,
    node: Arc<cluster::node::Node>,
    publish: tokio::sync::watch::Sender<Option<axum::Router>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let retiring = tokio::spawn(retire_while_following(
        base.log.clone(),
        publish.subscribe(),
    ));
    let mut metrics = node.raft().metrics();
    let mut raft_alive = true;
    // The term that runs, and the Raft term it was started in.
    let mut term: Option<(Term, u64)> = None;
    let look_again = std::time::Duration::from_millis(100);
    // Since when a running term's lease has not held. openraft 0.9 keeps a leader cut off from the
    // others leading until it hears of a later term; its lease stops its deliveries at once, and
    // after an election timeout more its term stops too (its sources with it).
    let mut lapsed_since: Option<std::time::Instant> = None;
    loop {
        let lease = node.lease();
        lapsed_since = match (&term, lease.holds()) {
            (Some(_), false) => Some(lapsed_since.unwrap_or_else(std::time::Instant::now)),
            _ => None,
        };
        let cut_off = lapsed_since.is_some_and(|at| at.elapsed() > node.election_timeout());
        let raft_term = node.raft_term();
        let leads = raft_alive && node.leads() && !cut_off;
        match &term {
            // Still leading, in the term it started in.
            Some((_, started_in)) if leads && *started_in == raft_term => {}
            Some(_) => {
                // No batch goes to a sink from now on, before anything else stops.
                lease.revoke();
                publish.send_replace(None);
                if let Some((ended, _)) = term.take() {
                    ended.stop().await;
                }
                lapsed_since = None;
                match cut_off {
                    true => tracing::warn!(member = node.id(), "no majority has confirmed this member's lead for an election timeout: stopped delivering"),
                    false => tracing::info!(member = node.id(), "no longer leading (or leading in a new term): stopped delivering"),
                }
                continue; // a new term at once if this member leads again
            }
            None if leads => {
                // Everything committed before this term is applied first: the wheel and the
                // idempotency index are loaded from the files, as a restart loads them. (A member
                // that led before a restart comes back believing it leads; no majority confirms it.)
                let confirmed = tokio::time::timeout(
                    std::time::Duration::from_secs(10),
                    node.raft().ensure_linearizable(),
                )
                .await;
                if !matches!(confirmed, Ok(Ok(_))) || node.raft_term() != raft_term {
                    // Not confirmed (no majority answers yet): not before a moment, however often
                    // Raft's metrics change meanwhile.
                    tokio::time::sleep(look_again).await;
                } else {
                    tracing::info!(member = node.id(), raft_term, "elected: loading the wheel");
                    match Term::start(&base, Some(node.lease())).await {
                        Ok(started) => {
                            publish.send_replace(Some(api::router(started.state.clone())));
                            term = Some((started, raft_term));
                            tracing::info!(
                                member = node.id(),
                                "leading: delivering and taking writes"
                            );
                            continue; // it may have stopped leading meanwhile
                        }
                        Err(error) => {
                            tracing::error!(%error, "this member leads but could not start delivering; trying again")
                        }
                    }
                }
            }
            None => {}
        }
        tokio::select! {
            changed = metrics.changed(), if raft_alive => raft_alive = changed.is_ok(),
            _ = stop.wait_for(|stop| *stop) => break,
            _ = tokio::time::sleep(look_again) => {}
        }
    }
    node.lease().revoke();
    publish.send_replace(None);
    if let Some((ended, _)) = term {
        ended.stop().await;
    }
    retiring.abort();
}

/// A follower retires finished buckets past retention by itself, as the leader's loader does (the
/// outcomes that finish them are replicated, so its files end as the leader's do): every
/// [`FOLLOWER_RETIRE_EVERY`] while `leading` publishes no term.
async fn retire_while_following(
    log: Arc<ScheduleLog>,
    leading: tokio::sync::watch::Receiver<Option<axum::Router>>,
) {
    let mut tick = tokio::time::interval(FOLLOWER_RETIRE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if leading.borrow().is_some() {
            continue; // the term's loader retires
        }
        let log = log.clone();
        match tokio::task::spawn_blocking(move || log.retire()).await {
            Ok(Ok(retired)) if !retired.is_empty() => tracing::info!(?retired, "retired buckets"),
            Ok(Err(error)) => {
                tracing::warn!(%error, "retiring finished buckets failed; trying again")
            }
            _ => {}
        }
    }
}

/// What the service holds for its whole run, whoever leads.
#[derive(Clone)]
struct Base {
    log: Arc<ScheduleLog>,
    broker: Arc<Broker>,
    sinks: SinkRegistry,
    sink_connections: Vec<connection::ConnectionState>,
    disk: Arc<disk::DiskWatch>,
    config: Arc<Config>,
    clock: Arc<dyn Clock>,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
}

/// What delivers and takes new messages: the scheduler, the intake and the MQ sources, and the API's
/// services over them. A single node runs one term from start to stop; a cluster member runs one
/// each time it is elected, and stops it when it no longer leads.
struct Term {
    state: api::AppState,
    stop_sources: tokio::sync::watch::Sender<bool>,
    sources: Vec<tokio::task::JoinHandle<()>>,
}

impl Term {
    /// Loads the wheel as a restart does (the window and the unfinished older buckets, from the
    /// files), rebuilds the idempotency index, and starts the sources. `lease`: a cluster leader's.
    async fn start(base: &Base, lease: Option<Arc<scheduler::Lease>>) -> anyhow::Result<Term> {
        let config = &base.config;
        let scheduler_config = SchedulerConfig {
            tick_ms: i64::from(config.tick_ms),
            preload: config.preload.0,
            dead_letters: Some(Arc::new(BrokerSink::new(base.broker.clone()))),
            lease,
            ..SchedulerConfig::default()
        };
        let scheduler = Arc::new(Scheduler::start(
            base.log.clone(),
            &base.sinks,
            scheduler_config,
            base.clock.clone(),
            &tokio::runtime::Handle::current(),
        )?);
        // The idempotency index is rebuilt from the pending messages that carry an idempotency key.
        let intake = {
            let (log, shared, config, clock, disk) = (
                base.log.clone(),
                scheduler.clone(),
                config.clone(),
                base.clock.clone(),
                base.disk.clone(),
            );
            let opened = tokio::task::spawn_blocking(move || {
                intake::Intake::open(log, shared, config.admission(), clock, disk)
            })
            .await?;
            match opened {
                Ok(intake) => Arc::new(intake),
                Err(error) => {
                    scheduler.shutdown().await;
                    return Err(error.into());
                }
            }
        };
        intake.start_pruning();
        let (stop_sources, sources) = match start_sources(config, &intake).await {
            Ok(started) => started,
            Err(error) => {
                scheduler.shutdown().await;
                return Err(error);
            }
        };
        let state = Arc::new(api::Services {
            log: base.log.clone(),
            scheduler,
            broker: base.broker.clone(),
            disk: base.disk.clone(),
            config: config.clone(),
            clock: base.clock.clone(),
            metrics: base.metrics.clone(),
            intake,
            sources: sources
                .iter()
                .map(|(connection, _)| connection.clone())
                .collect(),
            sink_connections: base.sink_connections.clone(),
        });
        Ok(Term {
            state,
            stop_sources,
            sources: sources.into_iter().map(|(_, task)| task).collect(),
        })
    }

    /// Stops the sources (what they took is acknowledged or left to the MQ before the log closes),
    /// then the scheduler, letting the lanes finish the batches they hold.
    async fn stop(self) {
        let _ = self.stop_sources.send(true);
        for task in self.sources {
            let _ = task.await;
        }
        self.state.scheduler.shutdown().await;
    }
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
