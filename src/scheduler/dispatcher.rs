//! Lanes: one tokio task per sink that turns due wheel entries into deliveries and their outcomes.
//!
//! Per batch: read the records (blocking pool), admit them in the registry (registry.rs: a cancelled
//! attempt is dropped, one whose cancel is in progress is held, the rest are in flight until settled),
//! call the sink (at most `max_in_flight` calls at once; a sink that delivers in place, the built-in
//! broker, on the blocking thread that read the batch: no hand-over to another thread and back, each a
//! wait for a core when the cores are short), then make each answer durable:
//! - delivered / dead → an outcome in the bucket's dispatch log;
//! - retry → a new attempt through the WAL (`attempt + 1`, due after the backoff with jitter or the
//!   sink's own delay), then a `retried` outcome pointing to it; past `max_attempts` the message is dead;
//! - postpone (delayd's own trouble, not the destination's: the broker's disk is full or its files fail,
//!   or a sink delivering in place panicked, or a cluster leader's delivery lease does not hold right
//!   before the batch would go to the sink, lease.rs) → the entry goes back to the wheel, nothing written, no
//!   attempt used;
//! - withdrawn (a firing of a recurring schedule paused, replaced or deleted since it was written,
//!   DESIGN §14) → a `cancelled` outcome; it never goes to the sink;
//! - unreachable (an MQ refused the connection, was not connected, or timed out before it answered) →
//!   the same, after the sink's backoff for the batches in a row that found it away (at most 30 s), and
//!   the lane holds what comes due meanwhile, unread, until then (counted as postponed,
//!   `delayd_messages_postponed_total`). After the wait one batch goes out, alone: the batches that
//!   come due while it is out wait, unread and holding their delivery slots, for its answer (they go
//!   if the destination answered, back to the wheel until the next wait's end if not). An MQ outage of
//!   any length spends no attempt, writes nothing and reads one batch per wait. A batch the
//!   destination took in part is no outage: what it did not answer for waits on its own.
//!
//! A sink's own delay (an HTTP `Retry-After`) is capped by the sink's `backoff_cap`, like the backoff
//! itself (the configuration keeps that cap within `max_delay`): a receiver cannot park a message for
//! centuries.
//!
//! A record that cannot be read is handed back to the wheel, never forgotten (it stays pending and in
//! `delayd_pending_messages`); each failure is counted in `delayd_read_errors_total`, and
//! `delayd_unreadable_messages` says how many entries are failing now. An I/O error (EMFILE, EIO, a
//! segment that cannot be opened) is tried again after 1 s, doubling to 1 min. A corrupt record (a
//! checksum that does not match) is tried again every 10 min: it does not heal by itself, but it may be
//! repaired (a file restored), and it cannot be declared dead, for its id and seq are in the unreadable
//! bytes.
//!
//! Outcomes are written only after the sink answered, so a crash in between repeats the delivery rather
//! than losing it (at-least-once); the broker sink, which can tell what it stored, answers such a
//! repeat without storing it again (broker/outcomes.rs), and learns each batch's outcomes are
//! durable through `Sink::outcomes_recorded`.

use super::registry::Admission;
use super::wheel::Entry;
use super::{entry_bucket, SchedulerState, Settled};
use crate::sink::{
    BoxFuture, Delivery, Sink, SinkOutcome, SinkPolicy, SinkRegistry, UNREACHABLE_WAIT_MAX,
};
use crossbeam_channel::Sender;
use schedulelog::{Bucket, Location, MessageId, NewMessage, Outcome, OutcomeKind};
use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

/// A sink's lane before it runs.
pub(crate) struct Lane {
    name: String,
    sink: Arc<dyn Sink>,
    pub policy: SinkPolicy,
    shared: Arc<SchedulerState>,
    seed: AtomicU64,
    /// Metric handles, looked up once rather than per message; made at the start for a configured
    /// sink (its series exist at 0 from then), at first use for messages naming an unknown one.
    metrics: std::sync::OnceLock<LaneMetrics>,
    /// Batches in a row whose destination could not be reached: how long the next one waits.
    unreachable_streak: std::sync::atomic::AtomicU32,
    /// Until when (clock ms) the lane holds its batches, the destination having been found away; 0
    /// once it answered again.
    unreachable_until: std::sync::atomic::AtomicI64,
    /// Whether the batch sent after a wait, alone, is out (see the module doc).
    probe_out: std::sync::Mutex<bool>,
    /// Wakes the batches that wait for the probe's answer.
    probe_answered: tokio::sync::Notify,
}

/// A lane's metric handles.
struct LaneMetrics {
    lateness: metrics::Histogram,
    delivered_ok: metrics::Counter,
    delivered_retry: metrics::Counter,
    delivered_dead: metrics::Counter,
    postponed: metrics::Counter,
}

impl LaneMetrics {
    fn new(sink: &str) -> LaneMetrics {
        let delivered = |outcome: &'static str| metrics::counter!("delayd_messages_delivered_total", "sink" => sink.to_string(), "outcome" => outcome);
        LaneMetrics {
            lateness: metrics::histogram!("delayd_delivery_lateness_seconds", "sink" => sink.to_string()),
            delivered_ok: delivered("ok"),
            delivered_retry: delivered("retry"),
            delivered_dead: delivered("dead"),
            postponed: metrics::counter!("delayd_messages_postponed_total", "sink" => sink.to_string()),
        }
    }
}

/// The probe out: dropped once the destination's answer to it is known (or the delivery ended early),
/// which wakes the batches waiting for it.
struct ProbeOut(Arc<Lane>);

impl Drop for ProbeOut {
    fn drop(&mut self) {
        *self.0.probe_out() = false;
        self.0.probe_answered.notify_waiters();
    }
}

/// One lane per registered sink, in registry order, then the lane for messages naming an unknown sink.
pub(crate) fn lanes(shared: &Arc<SchedulerState>, sinks: &SinkRegistry) -> Vec<Lane> {
    let seed = u64::try_from(shared.clock.now_ms()).unwrap_or(1);
    let mut lanes: Vec<Lane> = sinks
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let seed = seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let lane = Lane::new(&e.name, e.sink.clone(), e.policy.clone(), shared, seed);
            lane.metrics();
            lane
        })
        .collect();
    lanes.push(Lane::new(
        "(unknown)",
        Arc::new(UnknownSink),
        SinkPolicy::default(),
        shared,
        seed,
    ));
    lanes
}

impl Lane {
    fn new(
        name: &str,
        sink: Arc<dyn Sink>,
        policy: SinkPolicy,
        shared: &Arc<SchedulerState>,
        seed: u64,
    ) -> Lane {
        Lane {
            name: name.to_string(),
            sink,
            policy,
            shared: shared.clone(),
            seed: AtomicU64::new(seed),
            metrics: std::sync::OnceLock::new(),
            unreachable_streak: Default::default(),
            unreachable_until: Default::default(),
            probe_out: Default::default(),
            probe_answered: tokio::sync::Notify::new(),
        }
    }

    fn metrics(&self) -> &LaneMetrics {
        self.metrics.get_or_init(|| LaneMetrics::new(&self.name))
    }

    fn probe_out(&self) -> std::sync::MutexGuard<'_, bool> {
        self.probe_out.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `batch` may go to the sink, once it may: `Some(probe)` (`probe`: it is the batch that
    /// tries the destination after a wait), or `None`: the wait for the destination is not over, and
    /// the batch went back to the wheel until then, unread, counted as postponed. While a probe is
    /// out the batch waits for its answer here, holding its delivery slot (so that what comes due
    /// meanwhile stays in the wheel's backlog, counted and held back as usual).
    async fn may_go(self: &Arc<Self>, batch: &mut Vec<Entry>) -> Option<Option<ProbeOut>> {
        loop {
            if self.unreachable_until.load(Ordering::SeqCst) == 0 {
                return Some(None); // the usual case: no outage
            }
            let answered = self.probe_answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            {
                // Read under the lock that `ProbeOut` clears: a probe answered just now has moved
                // `until` on before it let go.
                let mut out = self.probe_out();
                let until = self.unreachable_until.load(Ordering::SeqCst);
                if until == 0 {
                    return Some(None);
                }
                if until > self.shared.clock.now_ms() {
                    self.metrics().postponed.increment(batch.len() as u64);
                    for entry in batch.drain(..) {
                        self.shared.requeue_at(entry, until);
                    }
                    return None;
                }
                if !*out {
                    *out = true;
                    return Some(Some(ProbeOut(self.clone())));
                }
            }
            answered.await;
            if self.shared.stopping.load(Ordering::SeqCst) {
                batch.clear(); // pending on disk: the next start loads them
                return None;
            }
        }
    }

    pub(crate) async fn run(self, mut due: mpsc::Receiver<Entry>, space: Sender<()>) {
        let lane = Arc::new(self);
        let permits = Arc::new(Semaphore::new(lane.policy.max_in_flight));
        let mut running = JoinSet::new();
        loop {
            // A slot first, then the batch: entries that fall due while every slot is busy join the
            // next batch instead of waiting behind it, so under load batches grow and the syncs each
            // one costs (broker, dispatch log) are shared by more messages.
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let Some(first) = due.recv().await else {
                break;
            };
            if lane.shared.stopping.load(Ordering::SeqCst) {
                break;
            }
            let mut batch = vec![first];
            while batch.len() < lane.policy.max_batch {
                match due.try_recv() {
                    Ok(entry) => batch.push(entry),
                    Err(_) => break,
                }
            }
            // The wheel may hold a backlog waiting for space in this queue.
            let _ = space.try_send(());
            let lane = lane.clone();
            running.spawn(async move {
                lane.deliver(batch).await;
                drop(permit);
            });
            while running.try_join_next().is_some() {}
        }
        while running.join_next().await.is_some() {}
    }

    async fn deliver(self: Arc<Self>, mut batch: Vec<Entry>) {
        // The destination was found away: the batch is held, unread, so that an outage costs no disk
        // reads for the messages that wait.
        let Some(probe) = self.may_go(&mut batch).await else {
            return;
        };
        let lane = self.clone();
        // A sink that delivers in place does so on the thread that read the batch (Sink::deliver_blocking).
        let read = tokio::task::spawn_blocking(move || {
            let (entries, deliveries) = read_batch(&lane.shared, &batch);
            // Firings withdrawn since they were written go no further (answered here, below).
            let (entries, deliveries, withdrawn) =
                split_withdrawn(&lane.shared, entries, deliveries);
            // Admitted in flight by read_batch; released once settled (or if this task ends early).
            let flight = InFlight {
                shared: lane.shared.clone(),
                ids: deliveries.iter().map(|d| d.id).collect(),
            };
            let withdrawn_flight = InFlight {
                shared: lane.shared.clone(),
                ids: withdrawn.iter().map(|d| d.id).collect(),
            };
            // A batch with a message dead on arrival goes the other way, which answers for those.
            let in_place =
                !deliveries.is_empty() && !deliveries.iter().any(|d| dead_on_arrival(d).is_some());
            let outcomes = match in_place {
                true => lane
                    .unleased(deliveries.len())
                    .or_else(|| lane.deliver_in_place(&deliveries)),
                false => None,
            };
            (
                entries,
                deliveries,
                flight,
                outcomes,
                (withdrawn, withdrawn_flight),
            )
        })
        .await;
        let (entries, deliveries, flight, outcomes, withdrawn) = match read {
            Ok(read) => read,
            Err(e) => {
                tracing::error!(sink = %self.name, error = %e, "reading due messages panicked");
                return;
            }
        };
        if !withdrawn.0.is_empty() {
            self.withdraw(withdrawn.0, withdrawn.1).await;
        }
        if deliveries.is_empty() {
            return;
        }
        let mut outcomes = match outcomes {
            Some(outcomes) => outcomes,
            None => match self.unleased(deliveries.len()) {
                Some(postponed) => postponed,
                None => {
                    self.record_lateness(&deliveries, self.shared.clock.now_ms());
                    self.answer(&deliveries).await
                }
            },
        };
        outcomes.resize(
            deliveries.len(),
            SinkOutcome::Retry {
                after: None,
                reason: "the sink gave no answer for this message".into(),
            },
        );
        self.settle(&entries, &deliveries, outcomes, flight, probe)
            .await;
    }

    /// Records withdrawn firings as cancelled (their attempt's outcome), then releases them.
    async fn withdraw(&self, withdrawn: Vec<Delivery>, flight: InFlight) {
        let now = self.shared.clock.now_ms();
        let records = (withdrawn.iter())
            .map(|d| {
                let outcome = Outcome {
                    seq: d.location.seq,
                    at_ms: now,
                    attempt: d.message.attempt,
                    kind: OutcomeKind::Cancelled,
                };
                (d.location.bucket, outcome)
            })
            .collect();
        self.record_outcomes(records).await;
        metrics::counter!("delayd_messages_cancelled_total").increment(withdrawn.len() as u64);
        for delivery in &withdrawn {
            self.shared.finished_key(&delivery.message, delivery.id);
        }
        drop(flight);
        if let Some(settled) = &self.shared.settled {
            let _ = settled.send(
                withdrawn
                    .iter()
                    .map(|d| (d.id, Settled::Cancelled))
                    .collect(),
            );
        }
    }

    /// Postponements for a batch of `len` when this member's delivery lease (lease.rs) does not hold
    /// right before the batch would go to the sink: a cluster member that may no longer be the leader
    /// hands nothing over. `None`: go ahead (a single node has no lease).
    fn unleased(&self, len: usize) -> Option<Vec<SinkOutcome>> {
        let lease = self.shared.lease.as_ref()?;
        if lease.holds() {
            return None;
        }
        let postpone = SinkOutcome::Postpone {
            after: UNLEASED_WAIT,
            reason: "this member's delivery lease lapsed (it may no longer lead the cluster)"
                .into(),
        };
        Some(vec![postpone; len])
    }

    /// The answers for a batch: dead for a message dead on arrival ([`DEAD_ON_ARRIVAL_HEADER`]), the
    /// sink's for the others.
    async fn answer(&self, deliveries: &[Delivery]) -> Vec<SinkOutcome> {
        let arrived_dead: Vec<Option<&str>> = deliveries.iter().map(dead_on_arrival).collect();
        if arrived_dead.iter().all(Option::is_none) {
            return self.sink.deliver(deliveries).await;
        }
        let others: Vec<Delivery> = (deliveries.iter().zip(&arrived_dead))
            .filter(|(_, dead)| dead.is_none())
            .map(|(delivery, _)| delivery.clone())
            .collect();
        let mut answers = match others.is_empty() {
            true => Vec::new(),
            false => self.sink.deliver(&others).await,
        }
        .into_iter();
        arrived_dead
            .into_iter()
            .map(|dead| match dead {
                Some(reason) => SinkOutcome::Dead {
                    reason: reason.to_string(),
                },
                None => answers.next().unwrap_or_else(|| SinkOutcome::Retry {
                    after: None,
                    reason: "the sink gave no answer for this message".into(),
                }),
            })
            .collect()
    }

    /// The sink's answers if it delivers in place (on this thread, a blocking-pool one), else `None`.
    /// A panic there (a bug) postpones the batch: it is delayd's fault, not the message's, so no attempt
    /// is used; nothing is left in flight, and an error is logged with the panic's message.
    fn deliver_in_place(&self, deliveries: &[Delivery]) -> Option<Vec<SinkOutcome>> {
        let now = self.shared.clock.now_ms();
        let deliver = AssertUnwindSafe(|| self.sink.deliver_blocking(deliveries));
        let outcomes = std::panic::catch_unwind(deliver).unwrap_or_else(|panic| {
            let message = (panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(sink = %self.name, panic = %message, "delivering a batch panicked; it is postponed by 5 s");
            let reason = format!("the {} sink panicked delivering the batch: {message}", self.name);
            let after = Duration::from_secs(5);
            Some(vec![SinkOutcome::Postpone { after, reason }; deliveries.len()])
        })?;
        self.record_lateness(deliveries, now);
        Some(outcomes)
    }

    /// How late each delivery went to the sink, called at `now`.
    fn record_lateness(&self, deliveries: &[Delivery], now: i64) {
        for delivery in deliveries {
            let late_ms = (now - delivery.message.deliver_at_ms).max(0);
            self.metrics().lateness.record(late_ms as f64 / 1000.0);
        }
    }

    /// Makes the sink's answers durable: retries through the WAL, then every outcome in the dispatch logs;
    /// then releases the attempts from flight.
    async fn settle(
        &self,
        entries: &[Entry],
        deliveries: &[Delivery],
        outcomes: Vec<SinkOutcome>,
        flight: InFlight,
        probe: Option<ProbeOut>,
    ) {
        let now = self.shared.clock.now_ms();
        // The destination's answers only: a message dead on arrival never went to it.
        let sent: Vec<&SinkOutcome> = (deliveries.iter().zip(&outcomes))
            .filter(|(delivery, _)| dead_on_arrival(delivery).is_none())
            .map(|(_, outcome)| outcome)
            .collect();
        let unreachable_after_ms = self.unreachable_wait(&sent);
        // The answer is known: the batches waiting for it go (or wait on) at once, not after this
        // batch's outcomes are written.
        drop(probe);
        let mut records: Vec<(Bucket, Outcome)> = Vec::new();
        let mut retries = Vec::new();
        let mut labels = Vec::with_capacity(deliveries.len());
        let mut dead = Vec::new();
        for ((entry, delivery), outcome) in entries.iter().zip(deliveries).zip(outcomes) {
            let attempt = delivery.message.attempt;
            let record = |kind| Outcome {
                seq: delivery.location.seq,
                at_ms: now,
                attempt,
                kind,
            };
            let label = match outcome {
                SinkOutcome::Delivered => {
                    let delivered = Outcome {
                        at_ms: delivery.sent_at_ms,
                        ..record(OutcomeKind::Delivered)
                    };
                    records.push((delivery.location.bucket, delivered));
                    Settled::Delivered
                }
                SinkOutcome::Dead { reason } | SinkOutcome::Refused { reason } => {
                    dead.push((*entry, dead_letter(delivery, &reason, now)));
                    records.push((
                        delivery.location.bucket,
                        record(OutcomeKind::Dead { reason }),
                    ));
                    Settled::Dead
                }
                SinkOutcome::Postpone { after, reason } => {
                    // Nothing is written: the record stays pending, and its entry comes round again
                    // (unless cancelled meanwhile: the lane's read drops it then).
                    let after_ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
                    self.shared
                        .requeue_at(*entry, now.saturating_add(after_ms.max(1)));
                    tracing::debug!(sink = %self.name, %reason, "delivery postponed");
                    Settled::Postponed
                }
                SinkOutcome::Unreachable { reason } => {
                    // As a postponement: nothing written, no attempt used (see SinkOutcome).
                    self.shared
                        .requeue_at(*entry, now.saturating_add(unreachable_after_ms));
                    tracing::debug!(sink = %self.name, %reason, after_ms = unreachable_after_ms, "destination unreachable; delivery postponed");
                    Settled::Postponed
                }
                SinkOutcome::Retry { .. }
                    if self.shared.registry().take_cancelled(&delivery.location) =>
                {
                    // Cancelled while the sink was answering, by a tombstone the replayer reported (a
                    // cancel through the scheduler is refused while an attempt is in flight): no next
                    // attempt (the tombstone records it).
                    Settled::Cancelled
                }
                SinkOutcome::Retry { after, reason } => {
                    let next_attempt = attempt.saturating_add(1);
                    if next_attempt >= self.policy.max_attempts {
                        let reason = format!("gave up after {next_attempt} attempts: {reason}");
                        dead.push((*entry, dead_letter(delivery, &reason, now)));
                        records.push((
                            delivery.location.bucket,
                            record(OutcomeKind::Dead { reason }),
                        ));
                        Settled::Dead
                    } else {
                        // The sink's own delay is capped like the backoff (see the module doc).
                        let delay = match after {
                            Some(after) => after.min(self.policy.backoff.cap),
                            None => self.policy.backoff.delay(attempt, self.random_unit()),
                        };
                        let delay_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
                        retries.push((
                            *entry,
                            delivery,
                            next_attempt,
                            now.saturating_add(delay_ms),
                            reason,
                        ));
                        Settled::Retried
                    }
                }
            };
            // A retry answered for a cancelled attempt counts as the retry it was.
            match label {
                Settled::Delivered => self.metrics().delivered_ok.increment(1),
                Settled::Dead => self.metrics().delivered_dead.increment(1),
                // Not an attempt: counted apart, so that retries stay what receivers answered.
                Settled::Postponed => self.metrics().postponed.increment(1),
                Settled::Retried | Settled::Cancelled => {
                    self.metrics().delivered_retry.increment(1)
                }
            }
            labels.push((delivery.id, label));
        }
        if !retries.is_empty() {
            self.write_retries(&retries, &mut records).await;
        }
        // Dead letters are stored before the outcome is, so a crash in between repeats rather than loses.
        if let (Some(letters), false) = (&self.shared.dead_letters, dead.is_empty()) {
            let unstored = self.store_dead_letters(letters, &dead).await;
            for copy in unstored {
                // Given up (shutting down, or the log is poisoned): no outcome, so the message is
                // delivered again after the restart.
                records.retain(|(bucket, o)| {
                    !(*bucket == copy.location.bucket && o.seq == copy.location.seq)
                });
            }
        }
        if !records.is_empty() {
            let recorded: HashSet<(Bucket, u64, u16)> = (records.iter())
                .map(|(bucket, o)| (*bucket, o.seq, o.attempt))
                .collect();
            let has = |d: &&Delivery| {
                recorded.contains(&(d.location.bucket, d.location.seq, d.message.attempt))
            };
            if self.record_outcomes(records).await {
                // The broker's deliveries (and dead letters) await their outcomes until now; a
                // postponed one still awaits its answer.
                let delivered: Vec<&Delivery> = (deliveries.iter().zip(&labels))
                    .filter(|(_, (_, label))| matches!(label, Settled::Delivered))
                    .map(|(d, _)| d)
                    .filter(has)
                    .collect();
                self.sink.outcomes_recorded(&delivered);
                if let Some(letters) = &self.shared.dead_letters {
                    let copies: Vec<&Delivery> =
                        dead.iter().map(|(_, copy)| copy).filter(has).collect();
                    if !copies.is_empty() {
                        letters.outcomes_recorded(&copies);
                    }
                }
            }
        }
        for (delivery, (_, label)) in deliveries.iter().zip(&labels) {
            if matches!(
                label,
                Settled::Delivered | Settled::Dead | Settled::Cancelled
            ) {
                self.shared.finished_key(&delivery.message, delivery.id);
            }
        }
        // Released before the report, so that whoever waits for it finds the attempts settled.
        drop(flight);
        if let Some(settled) = &self.shared.settled {
            let _ = settled.send(labels);
        }
    }

    /// Stores dead letters, trying again (with backoff, holding this delivery slot) the ones the store
    /// did not take: a full disk, say. Delivering the message again instead would repeat an answer the
    /// receiver gave already (a 4xx) every time round. Returns the letters given up on at a shutdown or
    /// with a poisoned log.
    async fn store_dead_letters<'d>(
        &self,
        letters: &Arc<dyn Sink>,
        dead: &'d [(Entry, Delivery)],
    ) -> Vec<&'d Delivery> {
        let mut left: Vec<&Delivery> = dead.iter().map(|(_, copy)| copy).collect();
        let mut pause = Duration::from_millis(100);
        for attempt in 1u32.. {
            let copies: Vec<Delivery> = left.iter().map(|copy| (*copy).clone()).collect();
            let answers = letters.deliver(&copies).await;
            let mut failed = None;
            let mut still = Vec::new();
            for (i, copy) in left.into_iter().enumerate() {
                match answers.get(i) {
                    Some(SinkOutcome::Delivered) => {}
                    other => {
                        failed = Some(format!("{other:?}"));
                        still.push(copy);
                    }
                }
            }
            left = still;
            let Some(answer) = failed else {
                return left;
            };
            if self.shared.stopping.load(Ordering::SeqCst) || self.shared.log.poisoned().is_some() {
                tracing::error!(sink = %self.name, %answer, "storing dead letters failed; these messages will be delivered again after a restart");
                return left;
            }
            if attempt.is_power_of_two() {
                tracing::error!(sink = %self.name, attempt, %answer, "storing dead letters failed; trying again");
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        }
        left
    }

    /// Writes outcomes to the dispatch logs, trying again (with backoff, holding this delivery slot, so
    /// that a lane whose outcomes cannot be recorded stops delivering) until they are durable: a delivery
    /// whose outcome is lost is delivered again after a restart. Only a shutdown or a poisoned log (a
    /// failed sync, which is never retried) gives up.
    async fn record_outcomes(&self, records: Vec<(Bucket, Outcome)>) -> bool {
        let records = Arc::new(records);
        let mut pause = Duration::from_millis(100);
        for attempt in 1u32.. {
            let (log, batch) = (self.shared.log.clone(), records.clone());
            let written = tokio::task::spawn_blocking(move || log.record_outcomes(&batch)).await;
            let error = match written {
                Ok(Ok(())) => {
                    if attempt > 1 {
                        tracing::info!(sink = %self.name, attempt, "delivery outcomes recorded after all");
                    }
                    return true;
                }
                Ok(Err(e)) => e.to_string(),
                Err(e) => e.to_string(),
            };
            if self.shared.stopping.load(Ordering::SeqCst) || self.shared.log.poisoned().is_some() {
                // A failed sync poisoned the log (never retried): the restart it needs delivers these
                // again.
                tracing::error!(sink = %self.name, %error, "recording delivery outcomes failed; these messages will be delivered again after a restart");
                return false;
            }
            // Logged at the first failure and then ever more rarely (attempts 1, 2, 4, 8, ...).
            if attempt.is_power_of_two() {
                tracing::error!(sink = %self.name, attempt, %error, "recording delivery outcomes failed; trying again");
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        }
        false
    }

    async fn write_retries(
        &self,
        retries: &[(Entry, &Delivery, u16, i64, String)],
        records: &mut Vec<(Bucket, Outcome)>,
    ) {
        let mut encoded = Vec::with_capacity(retries.len());
        for (_, delivery, next_attempt, deliver_at_ms, _) in retries {
            let m = &delivery.message;
            let next = NewMessage {
                deliver_at_ms: *deliver_at_ms,
                topic: m.topic.clone(),
                key: m.key.clone(),
                headers: m.headers.clone(),
                sink: m.sink.clone(),
                body: m.body.clone(),
                retry_of: Some((delivery.id, *next_attempt)),
                dedup: m.dedup,
            };
            match next.encode() {
                Ok(next) => encoded.push(next),
                Err(e) => {
                    // Cannot happen for a message that was stored; if it does, nothing is lost.
                    tracing::error!(error = %e, "a stored message no longer encodes; trying again shortly");
                    let now = self.shared.clock.now_ms();
                    for (entry, ..) in retries {
                        self.shared.requeue(*entry, now);
                    }
                    return;
                }
            }
        }
        match self.shared.log.append(encoded).await {
            Ok(appended) => {
                #[cfg(test)]
                self.shared.hook_retry_written().await;
                let now = self.shared.clock.now_ms();
                for ((_, delivery, _, _, reason), next) in retries.iter().zip(appended) {
                    let kind = OutcomeKind::Retried {
                        next: next.location,
                        reason: reason.clone(),
                    };
                    let outcome = Outcome {
                        seq: delivery.location.seq,
                        at_ms: now,
                        attempt: delivery.message.attempt,
                        kind,
                    };
                    records.push((delivery.location.bucket, outcome));
                }
            }
            // The messages stay pending (no outcome) and come round again shortly.
            Err(e) => {
                if e == schedulelog::AppendError::DiskFull {
                    // The disk watch reports a full disk once; this would repeat for every batch.
                    tracing::debug!(sink = %self.name, error = %e, "writing retries failed; trying again shortly");
                } else {
                    tracing::error!(sink = %self.name, error = %e, "writing retries failed; trying again shortly");
                }
                let now = self.shared.clock.now_ms();
                for (entry, ..) in retries {
                    self.shared.requeue(*entry, now);
                }
            }
        }
    }

    /// How long the unreachable deliveries of a batch wait (ms): the sink's backoff for the waits in a
    /// row that ended with the destination still away, at most `UNREACHABLE_WAIT_MAX`. The lane holds
    /// the batches that come due meanwhile (see `deliver`); a batch that was already out when the wait
    /// began and comes back unanswered joins it, adding no step (else the batches in flight at an MQ's
    /// blip would each lengthen the wait). A batch the destination answered for in full (each message
    /// taken or refused by the MQ; a target the sink refuses itself tells nothing of the MQ) ends the
    /// row. One in which it took some messages and did not answer for others (a partition without a
    /// leader, a stream without its quorum, beside healthy ones) ends it too: the others wait the
    /// backoff's first step on their own, and the lane goes on.
    fn unreachable_wait(&self, outcomes: &[&SinkOutcome]) -> i64 {
        let unreachable = |o: &&SinkOutcome| matches!(o, SinkOutcome::Unreachable { .. });
        let answered = |o: &&SinkOutcome| match o {
            SinkOutcome::Delivered | SinkOutcome::Retry { .. } | SinkOutcome::Dead { .. } => true,
            SinkOutcome::Refused { .. }
            | SinkOutcome::Postpone { .. }
            | SinkOutcome::Unreachable { .. } => false,
        };
        let took_some = outcomes.iter().any(|o| matches!(o, SinkOutcome::Delivered));
        let any_unreachable = outcomes.iter().any(unreachable);
        if !any_unreachable || took_some {
            if outcomes.iter().any(answered) {
                self.unreachable_streak.store(0, Ordering::SeqCst);
                self.unreachable_until.store(0, Ordering::SeqCst);
            }
            if !any_unreachable {
                return 0;
            }
            let wait = (self.policy.backoff.delay(0, self.random_unit())).min(UNREACHABLE_WAIT_MAX);
            return i64::try_from(wait.as_millis()).unwrap_or(i64::MAX).max(1);
        }
        // Under the lock `may_go` reads `until` with, so that two batches back at once add one step.
        let _out = self.probe_out();
        let now = self.shared.clock.now_ms();
        let until = self.unreachable_until.load(Ordering::SeqCst);
        if until > now {
            return until - now;
        }
        let before = self.unreachable_streak.fetch_add(1, Ordering::Relaxed);
        let step = u16::try_from(before).unwrap_or(u16::MAX);
        let wait = (self.policy.backoff.delay(step, self.random_unit())).min(UNREACHABLE_WAIT_MAX);
        let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX).max(1);
        self.unreachable_until
            .store(now.saturating_add(wait_ms), Ordering::SeqCst);
        wait_ms
    }

    /// A uniform draw in [0, 1) for backoff jitter (splitmix64; no need for a cryptographic source).
    fn random_unit(&self) -> f64 {
        let mut z = self
            .seed
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A copy of a dead message for the `$dead` topic, with why it died and where it was going.
fn dead_letter(delivery: &Delivery, reason: &str, now: i64) -> Delivery {
    let mut copy = delivery.clone();
    copy.sent_at_ms = now;
    // (A request dead on arrival: `delayd-dead-reason` says it.)
    copy.message
        .headers
        .retain(|(name, _)| name != DEAD_ON_ARRIVAL_HEADER);
    copy.message
        .headers
        .push((DEAD_REASON_HEADER.into(), reason.to_string()));
    copy.message
        .headers
        .push(("delayd-original-topic".into(), copy.message.topic.clone()));
    copy.message
        .headers
        .push(("delayd-sink".into(), copy.message.sink.clone()));
    copy.message.topic = DEAD_TOPIC.into();
    copy
}

/// The broker topic that receives dead messages.
pub const DEAD_TOPIC: &str = "$dead";

/// The header of a dead letter that says why its message is dead (the reason its outcome records).
pub const DEAD_REASON_HEADER: &str = "delayd-dead-reason";

/// The header of a message that was dead when it arrived: a request an MQ source could not take (no
/// time, no target, a forbidden one...), stored as a message all the same so that it is listed, found
/// by its id and requeued like every dead letter. Its value is the reason; the lane makes the message
/// dead with it, without calling the sink (also after a crash between its append and that outcome).
pub const DEAD_ON_ARRIVAL_HEADER: &str = "delayd-dead-on-arrival";

/// The header of a message dead on arrival stored without all of its request: the body's length when
/// the body (or the headers) had to be cut to fit the log. Such a message is never requeued.
pub const BODY_BYTES_HEADER: &str = "delayd-body-bytes";

/// Why a delivery's message was dead on arrival, if it was.
fn dead_on_arrival(delivery: &Delivery) -> Option<&str> {
    (delivery.message.headers.iter())
        .find(|(name, _)| name == DEAD_ON_ARRIVAL_HEADER)
        .map(|(_, reason)| reason.as_str())
}

/// Attempts a lane has admitted and not yet settled; released from the registry when dropped (also if
/// the task that holds them ends early), so that a cancel is refused only while they really run.
struct InFlight {
    shared: Arc<SchedulerState>,
    ids: Vec<MessageId>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shared.registry().release(&self.ids);
    }
}

/// How long a batch waits when this member's delivery lease does not hold (a cluster leader waiting
/// for its next round of heartbeats to be acknowledged).
const UNLEASED_WAIT: Duration = Duration::from_millis(100);
/// I/O errors are tried again after 1 s, doubling up to this.
const READ_RETRY_MAX_MS: i64 = 60_000;
/// Corrupt records are tried again this often.
const CORRUPT_RETRY_MS: i64 = 600_000;

/// Hands an entry whose record could not be read back to the wheel, with backoff (module doc).
fn unreadable(shared: &SchedulerState, entry: &Entry, bucket: Bucket, error: &schedulelog::Error) {
    metrics::counter!("delayd_read_errors_total").increment(1);
    let failures = {
        let mut unreadable = shared.unreadable();
        let failures = unreadable
            .entry((entry.bucket, entry.offset()))
            .or_default();
        *failures = failures.saturating_add(1);
        let failures = *failures;
        metrics::gauge!("delayd_unreadable_messages").set(unreadable.len() as f64);
        failures
    };
    let corrupt = matches!(error, schedulelog::Error::Corrupt { .. });
    let wait_ms = if corrupt {
        CORRUPT_RETRY_MS
    } else {
        (1_000i64 << (failures - 1).min(6)).min(READ_RETRY_MAX_MS)
    };
    // Logged at the first failure and then ever more rarely (1, 2, 4, 8, ...), per entry.
    if failures.is_power_of_two() {
        tracing::error!(%bucket, offset = entry.offset(), failures, retry_in_ms = wait_ms, %error, "reading a due message failed; it stays pending and is tried again");
    }
    shared.requeue_at(*entry, shared.clock.now_ms().saturating_add(wait_ms));
    #[cfg(test)]
    shared.hook_read_failed(error);
}

/// Reads the records of a batch and admits them in the registry: returns the entries and deliveries to
/// make, without the cancelled ones (dropped) and those whose cancel is in progress (held). A record
/// that cannot be read goes back to the wheel (see the module doc).
fn read_batch(shared: &SchedulerState, batch: &[Entry]) -> (Vec<Entry>, Vec<Delivery>) {
    let mut read = Vec::with_capacity(batch.len());
    // Entries read, or gone with their retired bucket: no longer unreadable.
    let mut settled = Vec::new();
    for entry in batch {
        let bucket = entry_bucket(entry);
        match shared
            .log
            .read_record(bucket, entry.offset(), entry.frame_len)
        {
            Ok(Some(message)) => {
                settled.push(*entry);
                read.push((*entry, bucket, message));
            }
            Ok(None) => settled.push(*entry), // retired meanwhile
            Err(e) => unreadable(shared, entry, bucket, &e),
        }
    }
    {
        let mut unreadable = shared.unreadable();
        if !unreadable.is_empty() {
            let before = unreadable.len();
            for entry in &settled {
                unreadable.remove(&(entry.bucket, entry.offset()));
            }
            if unreadable.len() != before {
                metrics::gauge!("delayd_unreadable_messages").set(unreadable.len() as f64);
            }
        }
    }
    // The batch goes to the sink as soon as it is read.
    let sent_at_ms = shared.clock.now_ms();
    let mut entries = Vec::with_capacity(read.len());
    let mut deliveries = Vec::with_capacity(read.len());
    let mut dropped = Vec::new();
    {
        let mut registry = shared.registry();
        for (entry, bucket, message) in read {
            let location = Location {
                bucket,
                seq: message.seq,
            };
            match registry.admit(message.id, location, entry) {
                Admission::Deliver => {
                    entries.push(entry);
                    deliveries.push(Delivery {
                        id: message.id,
                        location,
                        message,
                        sent_at_ms,
                    });
                }
                Admission::Cancelled => dropped.push(message),
                Admission::Held => {
                    #[cfg(test)]
                    shared.hook_held(message.id);
                }
            }
        }
    }
    for message in dropped {
        shared.finished_key(&message, message.id);
        if let Some(settled) = &shared.settled {
            let _ = settled.send(vec![(message.id, Settled::Cancelled)]);
        }
    }
    (entries, deliveries)
}

/// Whether `message` is a firing of a recurring schedule (DESIGN §14) that was paused, replaced or
/// deleted (or paused and resumed) after the firing was written: then it is withdrawn, never delivered.
/// Decided only once the schedule table holds every record up to this attempt's: an op answered
/// after the firing was written has a later seq, and its answer waited until it was filed. (A
/// member's lane meets only records its replayer filed: the loader's watch waits for them.)
fn withdrawn(log: &schedulelog::ScheduleLog, message: &schedulelog::Message) -> bool {
    let [(first, id), (second, _), ..] = message.headers.as_slice() else {
        return false;
    };
    if first != schedulelog::SCHEDULE_HEADER || second != schedulelog::FIRE_AT_HEADER {
        return false;
    }
    if log.filed_below() <= message.seq {
        return false;
    }
    match log.schedule(id) {
        None => true,
        Some(state) => state.paused || message.id.first.seq <= state.since_seq,
    }
}

/// Takes the withdrawn firings out of a batch read (admitted in flight like the rest).
fn split_withdrawn(
    shared: &SchedulerState,
    entries: Vec<Entry>,
    deliveries: Vec<Delivery>,
) -> (Vec<Entry>, Vec<Delivery>, Vec<Delivery>) {
    let flags: Vec<bool> = (deliveries.iter())
        .map(|d| withdrawn(&shared.log, &d.message))
        .collect();
    if !flags.contains(&true) {
        return (entries, deliveries, Vec::new());
    }
    let mut kept = (Vec::new(), Vec::new());
    let mut out = Vec::new();
    for ((entry, delivery), withdrawn) in entries.into_iter().zip(deliveries).zip(flags) {
        match withdrawn {
            true => out.push(delivery),
            false => {
                kept.0.push(entry);
                kept.1.push(delivery);
            }
        }
    }
    (kept.0, kept.1, out)
}

/// The sink of messages that name a sink nobody configured: they are dead, with the reason.
#[derive(Debug)]
struct UnknownSink;

impl Sink for UnknownSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(async move {
            batch
                .iter()
                .map(|d| SinkOutcome::Dead {
                    reason: format!("no sink named {:?} is configured", d.message.sink),
                })
                .collect()
        })
    }
}
