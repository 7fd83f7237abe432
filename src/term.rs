//! Terms: what delivers and takes new messages (the scheduler, the intake, the MQ sources, the recurring
//! schedules' planner and the API over them), started together and stopped together. A single node runs one term from its start to
//! its stop; a cluster member runs one each time it is elected ([`lead`]), and stops it as soon as it
//! no longer leads.
//!
//! Invariants:
//! - A member's term belongs to the Raft term it started in: a new Raft term, even with this member
//!   leading again, stops it and starts another, whose wheel is loaded from the files afresh.
//! - The delivery lease is revoked before a term stops: no batch goes to a sink from the moment the
//!   lead is in doubt.
//! - A member that does not lead runs no term; it retires finished buckets by itself, as a term's
//!   loader does.

use crate::broker::{Broker, BrokerSink};
use crate::config::Config;
use crate::scheduler::{self, Scheduler, SchedulerConfig};
use crate::sink::SinkRegistry;
use crate::{api, cluster, connection, disk, intake, schedule, source};
use anyhow::Context;
use schedulelog::{Clock, ScheduleLog};
use std::sync::Arc;

/// How often a follower retires finished buckets (the scheduler's loader's default on the leader).
const FOLLOWER_RETIRE_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs a term of `node`'s each time it leads, and stops it as soon as it no longer does; publishes
/// the term's API for the member's routes (api/member.rs). Ends, stopping a term that runs, once
/// `stop` says `true`.
pub(crate) async fn lead(
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
pub(crate) struct Base {
    pub log: Arc<ScheduleLog>,
    pub broker: Arc<Broker>,
    pub sinks: SinkRegistry,
    pub sink_connections: Vec<connection::ConnectionState>,
    pub disk: Arc<disk::DiskWatch>,
    pub config: Arc<Config>,
    pub clock: Arc<dyn Clock>,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
}

/// What delivers and takes new messages: the scheduler, the intake and the MQ sources, and the API's
/// services over them. A single node runs one term from start to stop; a cluster member runs one
/// each time it is elected, and stops it when it no longer leads.
pub(crate) struct Term {
    pub state: api::AppState,
    stop_sources: tokio::sync::watch::Sender<bool>,
    sources: Vec<tokio::task::JoinHandle<()>>,
    /// The recurring schedules' planner (schedule/planner.rs), stopped with the sources.
    planner: tokio::task::JoinHandle<()>,
}

impl Term {
    /// Loads the wheel as a restart does (the window and the unfinished older buckets, from the
    /// files), rebuilds the idempotency index, and starts the sources. `lease`: a cluster leader's.
    pub async fn start(base: &Base, lease: Option<Arc<scheduler::Lease>>) -> anyhow::Result<Term> {
        let config = &base.config;
        let scheduler_config = SchedulerConfig {
            tick_ms: i64::from(config.tick_ms),
            preload: config.preload.0,
            dead_letters: Some(Arc::new(BrokerSink::new(base.broker.clone()))),
            lease,
            ..SchedulerConfig::default()
        };
        // Before any message goes to a sink: deliveries a crash left without their outcome get it
        // (broker/outcomes.rs), rather than being stored twice.
        let (broker, log) = (base.broker.clone(), base.log.clone());
        tokio::task::spawn_blocking(move || broker.reconcile(&log)).await?;
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
        // Before the sources: their recurring requests put schedules.
        let (schedules, planner) = schedule::Schedules::new(
            base.log.clone(),
            scheduler.clone(),
            intake.admission.clone(),
            base.clock.clone(),
        );
        let (stop_sources, sources) = match start_sources(config, &intake, &schedules).await {
            Ok(started) => started,
            Err(error) => {
                scheduler.shutdown().await;
                return Err(error);
            }
        };
        let planner = tokio::spawn(planner.run(stop_sources.subscribe()));
        let state = Arc::new(api::Services {
            schedules,
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
            planner,
        })
    }

    /// Stops the sources (what they took is acknowledged or left to the MQ before the log closes),
    /// then the scheduler, letting the lanes finish the batches they hold.
    pub async fn stop(self) {
        let _ = self.stop_sources.send(true);
        for task in self.sources {
            let _ = task.await;
        }
        let _ = self.planner.await;
        self.state.scheduler.shutdown().await;
        // Every lane is done: the next start reads no delivery again to reconcile it.
        let (broker, log) = (self.state.broker.clone(), self.state.log.clone());
        if let Ok(Err(error)) = tokio::task::spawn_blocking(move || broker.store_floors(&log)).await
        {
            tracing::warn!(%error, "storing the broker's floor failed; the next start looks up more outcomes");
        }
    }
}

/// Opens and starts every configured source; each runs until the sender says `true`. When one cannot
/// be opened, those started before it are stopped before the error is returned: the term is tried
/// again (a member's, by [`lead`]), and no source may run twice meanwhile.
async fn start_sources(
    config: &Config,
    intake: &Arc<intake::Intake>,
    schedules: &Arc<schedule::Schedules>,
) -> anyhow::Result<(
    tokio::sync::watch::Sender<bool>,
    Vec<(connection::ConnectionState, tokio::task::JoinHandle<()>)>,
)> {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut started = Vec::new();
    // A member's sources keep their marks (and Kafka's epochs) through the cluster's log, on every
    // member, for whichever member leads next to start from (DESIGN.md §10); a single node's, in its
    // own dir, with no Raft on the path.
    let files = match &config.cluster {
        Some(_) => source::StateFiles::replicated(&config.data_dir, &intake.log),
        None => source::StateFiles::local(&config.data_dir),
    };
    for (name, source) in &config.sources {
        let settings = source::SourceSettings {
            name: name.clone(),
            sink: source.shared.sink.clone().unwrap_or_default(),
            batch: source.shared.batch,
            files: files.clone(),
            schedules: schedules.clone(),
        };
        let connection = connection::ConnectionState::new("source", name, source.kind.name());
        let (intake, runner_connection) = (intake.clone(), connection.clone());
        let opened = async {
            let transport = source
                .build(name, &files)
                .with_context(|| format!("sources.{name}"))?;
            tokio::task::spawn_blocking(move || {
                source::SourceRunner::open(settings, intake, runner_connection, transport)
            })
            .await?
            .with_context(|| format!("opening sources.{name}"))
        };
        match opened.await {
            Ok(runner) => started.push((connection, tokio::spawn(runner.run(stopped.clone())))),
            Err(error) => {
                let _ = stop.send(true);
                for (_, task) in started {
                    let _ = task.await;
                }
                return Err(error);
            }
        }
    }
    Ok((stop, started))
}
