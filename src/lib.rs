//! delayd: a durable, millisecond-precise delay / scheduled-message service.
//!
//! Layers, bottom up: the storage engine (`schedulelog`, re-exported), the [`scheduler`] (loader, wheel,
//! dispatcher) and the [`sink`]s it delivers to, the built-in [`broker`], the HTTP [`api`], and the
//! [`edge`] that serves it within limits (timeouts, a connection cap, descriptors kept for storage).
//! [`run`] wires them together on a listener the caller bound, so tests can bind port 0: a single node
//! runs one term (term.rs) from start to stop; with a `[cluster]` section the node is a [`cluster`]
//! member, which runs a term each time it leads and forwards requests to the leader otherwise.
//!
//! A member's own state beside the schedule goes through Raft as application payloads of entries
//! (`ScheduleLog::propose_app`), which every member applies in log order ([`applier`]). Each payload
//! starts with its version (byte 0, 1 for all so far) and its kind (byte 1), which says whose it is:
//!
//! ```text
//! kind 1  a broker append          broker/op.rs
//! kind 2  a broker offset commit   broker/op.rs
//! kind 3  a source's state file    source/state.rs (its mark; a Kafka source's epochs)
//! ```

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
pub mod schedule;
pub mod scheduler;
pub mod setting;
pub mod sink;
pub mod source;
mod term;
pub mod timestamp;

pub use schedulelog;

use anyhow::Context;
use broker::Broker;
use config::Config;
use schedulelog::{Clock, Options, ScheduleLog, SegmentMinutes, SystemClock};
use sink::SinkRegistry;
use std::future::Future;
use std::sync::Arc;
use term::{lead, Base, Term};

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
    // A member's WAL is its Raft log, purged a file at a time.
    let options = match &config.cluster {
        Some(cluster) => Options {
            wal_segment_bytes: cluster.log_file_bytes,
            ..options
        },
        None => options,
    };
    let data_dir = config.data_dir.clone();
    let broker_options = config.broker.options();
    let member = config.cluster.is_some();
    let (log, broker) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        // A snapshot this member received is swapped in before anything is opened (snapshot.rs).
        if member {
            cluster::snapshot::finish_install(&data_dir, &data_dir.join(RAFT_DIR))
                .context("swapping in a received snapshot")?;
        }
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
    if config.cluster.is_some() {
        // The broker's appends and group offsets are entries too (DESIGN.md §10), and so are the
        // sources' marks (term.rs): proposed through the log, applied by every member into its own
        // files. Set before housekeeping starts: a member's broker stores no floor (outcomes.rs).
        broker.replicate_through(&log);
    }
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
                snapshot_entries: cluster.snapshot_entries,
                join: cluster.join,
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
            let applier = applier(base.broker.clone(), config.data_dir.clone());
            let snapshots = cluster::snapshot::Snapshots::new(
                cluster.node_id,
                log.clone(),
                &raft_dir,
                Some(app_files(base.broker.clone(), config.data_dir.clone())),
                Arc::new(restart_in_place),
            );
            let node = Arc::new(
                cluster::node::Node::start(
                    settings,
                    &log,
                    &raft_dir,
                    base.clock.clone(),
                    Some(applier),
                    snapshots,
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

/// A member's Raft state (its vote) in the data dir.
const RAFT_DIR: &str = "raft";

/// What a cluster member applies of each entry's application payloads (module doc), by their kind:
/// the broker's ops into its broker files, the sources' state files into `data_dir/sources/`.
pub(crate) fn applier(
    broker: Arc<Broker>,
    data_dir: std::path::PathBuf,
) -> cluster::store::Applier {
    Arc::new(move |at, payload| match payload.get(1).copied() {
        Some(kind) if broker::op::KINDS.contains(&kind) => {
            broker.apply_op(at, payload).map_err(|e| e.to_string())
        }
        Some(source::state::KIND) => {
            source::state::apply_op(&data_dir, at, payload).map_err(|e| e.to_string())
        }
        kind => Err(format!(
            "application payload {} of Raft entry {}: kind {kind:?} is none this delayd knows",
            at.1, at.0
        )),
    })
}

/// What a member's snapshot holds of the application's own files: the broker's (linked while the
/// broker holds still) and the sources' state files.
pub(crate) fn app_files(
    broker: Arc<Broker>,
    data_dir: std::path::PathBuf,
) -> cluster::snapshot::AppFiles {
    use cluster::snapshot::link_tree;
    Arc::new(move |into| {
        let mut files = broker
            .quiesced(|| link_tree(&data_dir, std::path::Path::new("broker"), into))
            .map_err(|e| e.to_string())?;
        let dir = std::path::Path::new(source::state::DIR);
        files.extend(link_tree(&data_dir, dir, into).map_err(|e| e.to_string())?);
        Ok(files)
    })
}

/// A member that received a snapshot restarts to swap it in (cluster/snapshot.rs): the process
/// replaces itself with the same program and arguments (same pid, so a supervisor sees nothing),
/// as a crash and restart would, without acknowledging anything more. If that fails it exits, for
/// its supervisor to restart it.
fn restart_in_place() {
    use std::os::unix::process::CommandExt;
    let program = std::env::current_exe();
    let error = match program {
        Ok(program) => std::process::Command::new(program)
            .args(std::env::args_os().skip(1))
            .exec(),
        Err(error) => error,
    };
    eprintln!("delayd: restarting to install a snapshot failed ({error}); exiting for a supervisor to restart this member");
    std::process::exit(75);
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
    for ticks in 1u64.. {
        tick.tick().await;
        let (log, broker, disk, now) = (log.clone(), broker.clone(), disk.clone(), clock.now_ms());
        let checked = tokio::task::spawn_blocking(move || {
            // Deliveries the start could not settle (outcomes.rs) are tried again each minute.
            if ticks % 60 == 0 {
                broker.reconcile(&log);
            }
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
            if let Err(error) = broker.store_floors(&log) {
                tracing::error!(%error, "storing the broker's floor failed; trying again");
            }
            disk.check(&[log.disk_full(), broker.disk_full()]);
            // Here rather than in a term's planner only: a cluster's followers count them too.
            ::metrics::gauge!("delayd_schedules").set(log.schedule_count() as f64);
            log.poisoned()
        })
        .await;
        if let (Ok(Some(cause)), false) = (checked, poisoned) {
            poisoned = true;
            tracing::error!(%cause, "the log is poisoned: writes are refused until delayd is restarted");
        }
    }
}
