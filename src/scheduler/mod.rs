//! The scheduler: turns stored messages into deliveries at their exact millisecond.
//!
//! ```text
//! loader thread ── watch(bucket) snapshots ──►┐
//! replayer tap ─── live records and cancels ──┼──► wheel thread ── per-sink feed ──► lane task ──► Sink
//! clock changes, lane "space again" signals ─►┘    (wheel.rs)     (backlog, token     (read record,
//!                                                                   bucket, bounded    deliver, retry,
//!                                                                   queue)             record outcome)
//! ```
//!
//! - The **loader** watches every bucket that starts within `preload` (default 5 min) of now and every
//!   older bucket that still has unfinished records, oldest first, and retires finished buckets.
//!   `ScheduleLog::watch` marks the bucket watched and takes its snapshot under the replayer's lock, so a
//!   record filed into it is either in the snapshot or reported live by the tap, never both, never neither.
//! - The **wheel thread** owns the [`wheel::Wheel`]. It never blocks on a sink: each sink has a feed with a
//!   token bucket and a bounded queue; when the queue is full, due entries wait in the feed's backlog (24
//!   bytes each, in due order) while time keeps running for every other sink.
//! - A **lane** per sink (a tokio task) reads records, drops cancelled ones, calls the sink with up to
//!   `max_in_flight` batches at a time, writes retries back through the WAL as new attempts and records
//!   outcomes in the dispatch log, always after the sink answered. A record it cannot read goes back to
//!   the wheel (dispatcher.rs says when): it stays pending and counted, never forgotten.
//! - The **registry** (registry.rs) is where lanes, cancels and the loader meet under one lock: what is in
//!   flight, what is being cancelled, which cancels must stay in memory. It makes a cancel's answer true:
//!   200 only when no attempt will start afterwards, 409 `delivery_in_flight` while one is running.
//!
//! Lanes report each message sent with an idempotency key (`dedup`) once it is finished (delivered, dead
//! or cancelled) on the channel [`Scheduler::take_finished_keys`] hands out, so that the HTTP edge's
//! idempotency index lets go of it.
//!
//! All time comes from the [`Clock`] the scheduler is given.

mod dead;
mod dispatcher;
mod lease;
mod loader;
pub mod rate;
mod registry;
pub mod wheel;

use crate::sink::{Sink, SinkRegistry};
use crossbeam_channel::{select, Receiver, Sender};
use rate::TokenBucket;
use registry::Registry;
use schedulelog::{Bucket, BucketSnapshot, Clock, MessageId, Replayed, ScheduleLog};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use wheel::{Entry, Wheel};

pub use dead::{DeadLetterError, Requeued};
pub use dispatcher::{BODY_BYTES_HEADER, DEAD_ON_ARRIVAL_HEADER, DEAD_REASON_HEADER, DEAD_TOPIC};
pub use lease::Lease;
pub use registry::{CancelError, Cancelled};
pub use schedulelog::{ManualClock, SystemClock};

/// A message sent with an idempotency key that is finished (delivered, dead or cancelled): its key is
/// free again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedKey {
    pub sink: String,
    pub topic: String,
    pub key: String,
    pub id: MessageId,
}

/// Scheduler settings.
#[derive(Clone)]
pub struct SchedulerConfig {
    /// Width of a wheel slot. Paging granularity only: entries are released at their exact millisecond.
    pub tick_ms: i64,
    /// How long before a bucket starts it is loaded into the wheel.
    pub preload: Duration,
    /// Due entries queued between the wheel and a sink's lane, at most.
    pub lane_queue: usize,
    /// How often finished buckets past their retention are deleted.
    pub retire_every: Duration,
    /// Receives, for every batch, each message's id and what became of its attempt once the outcomes
    /// are durable. For tests and embedding; `None` in the service.
    pub settled: Option<Sender<Vec<(MessageId, Settled)>>>,
    /// Where dead messages are copied, under the topic `$dead` (the service uses the broker).
    pub dead_letters: Option<Arc<dyn Sink>>,
    /// A cluster leader's delivery lease (lease.rs): no batch goes to a sink while it does not hold,
    /// and such a batch is postponed (no attempt used). `None`: a single node, always delivering.
    pub lease: Option<Arc<Lease>>,
}

/// What became of a delivery attempt a lane settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Settled {
    /// The sink took it.
    Delivered,
    /// Refused; a next attempt is written.
    Retried,
    /// Dead: refused for good, out of attempts, or dead on arrival.
    Dead,
    /// Put off without using an attempt (delayd's own storage, or the sink's MQ away).
    Postponed,
    /// Cancelled while the sink answered.
    Cancelled,
}

impl std::fmt::Debug for SchedulerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerConfig")
            .field("tick_ms", &self.tick_ms)
            .field("preload", &self.preload)
            .field("lane_queue", &self.lane_queue)
            .finish_non_exhaustive()
    }
}

impl Default for SchedulerConfig {
    fn default() -> SchedulerConfig {
        SchedulerConfig {
            tick_ms: 500,
            preload: Duration::from_secs(300),
            lane_queue: 4096,
            retire_every: Duration::from_secs(60),
            settled: None,
            dead_letters: None,
            lease: None,
        }
    }
}

/// What the wheel thread, the loader and the lanes share.
#[derive(Debug)]
pub(crate) struct SchedulerState {
    pub log: Arc<ScheduleLog>,
    pub clock: Arc<dyn Clock>,
    /// In flight, being cancelled, cancelled: see registry.rs.
    registry: Mutex<Registry>,
    /// Woken each time a cancel finishes (another cancel of the same message may be waiting).
    pub cancel_done: tokio::sync::Notify,
    /// Held by a requeue or discard of a dead letter: they run one at a time (dead.rs).
    dead_letter_ops: tokio::sync::Mutex<()>,
    /// Due entries whose record could not be read, by (bucket minute, offset), with their failures so far.
    pub unreadable: Mutex<HashMap<(u32, u64), u32>>,
    /// Where finished messages with an idempotency key are reported.
    finished_keys: tokio::sync::mpsc::UnboundedSender<FinishedKey>,
    pub settled: Option<Sender<Vec<(MessageId, Settled)>>>,
    pub dead_letters: Option<Arc<dyn Sink>>,
    /// See [`SchedulerConfig::lease`].
    pub lease: Option<Arc<Lease>>,
    /// Records in buckets not loaded yet (set by the loader; part of `delayd_pending_messages`).
    pub unloaded_records: AtomicU64,
    /// Entries in the wheel and the sink backlogs (set by the wheel thread).
    pub in_memory: AtomicU64,
    /// Set at shutdown: lanes start no new batch (what they did not start stays pending on disk).
    pub stopping: std::sync::atomic::AtomicBool,
    /// Entries handed back to the wheel (an unreadable record, a failed retry write, a failed cancel, a
    /// postponed delivery).
    pub requeued: Sender<Entry>,
    #[cfg(test)]
    pub hooks: Mutex<tests::Hooks>,
}

impl SchedulerState {
    /// `delayd_pending_messages`: what the wheel holds plus what unloaded buckets hold (cancelled
    /// messages in unloaded buckets count until their bucket is loaded).
    pub fn report_pending(&self) {
        let pending =
            self.in_memory.load(Ordering::Relaxed) + self.unloaded_records.load(Ordering::Relaxed);
        metrics::gauge!("delayd_pending_messages").set(pending as f64);
    }

    pub(crate) fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn unreadable(&self) -> std::sync::MutexGuard<'_, HashMap<(u32, u64), u32>> {
        self.unreadable.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reports a finished message if it carries an idempotency key (`id`: its id).
    pub fn finished_key(&self, message: &schedulelog::Message, id: MessageId) {
        if let (true, Some(key)) = (message.dedup, &message.key) {
            let _ = self.finished_keys.send(FinishedKey {
                sink: message.sink.clone(),
                topic: message.topic.clone(),
                key: key.clone(),
                id,
            });
        }
    }

    /// Hands an entry back to the wheel, due a second from `now_ms`.
    pub fn requeue(&self, entry: Entry, now_ms: i64) {
        self.requeue_at(entry, now_ms + 1_000);
    }

    /// Hands an entry back to the wheel, due at `due_ms`.
    pub fn requeue_at(&self, entry: Entry, due_ms: i64) {
        let _ = self.requeued.send(entry.due_at(due_ms));
    }
}

/// A running scheduler. Stop it with [`Scheduler::shutdown`].
#[derive(Debug)]
pub struct Scheduler {
    shared: Arc<SchedulerState>,
    running: Mutex<Option<Running>>,
    finished_keys: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<FinishedKey>>>,
}

#[derive(Debug)]
struct Running {
    stop: Sender<()>,
    threads: Vec<JoinHandle<()>>,
    lanes: Vec<tokio::task::JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the loader and wheel threads, and one lane per sink on `runtime`.
    pub fn start(
        log: Arc<ScheduleLog>,
        sinks: &SinkRegistry,
        config: SchedulerConfig,
        clock: Arc<dyn Clock>,
        runtime: &tokio::runtime::Handle,
    ) -> std::io::Result<Scheduler> {
        let (requeued, requeued_rx) = crossbeam_channel::unbounded();
        let (finished_keys, finished_keys_rx) = tokio::sync::mpsc::unbounded_channel();
        let shared = Arc::new(SchedulerState {
            log: log.clone(),
            clock: clock.clone(),
            registry: Mutex::default(),
            cancel_done: tokio::sync::Notify::new(),
            dead_letter_ops: tokio::sync::Mutex::new(()),
            unreadable: Mutex::default(),
            finished_keys,
            settled: config.settled.clone(),
            dead_letters: config.dead_letters.clone(),
            lease: config.lease.clone(),
            unloaded_records: AtomicU64::default(),
            in_memory: AtomicU64::default(),
            stopping: Default::default(),
            requeued,
            #[cfg(test)]
            hooks: Mutex::default(),
        });
        let (tap_tx, tap_rx) = crossbeam_channel::unbounded();
        log.set_tap(tap_tx);
        let (loaded_tx, loaded_rx) = crossbeam_channel::unbounded();
        let (space_tx, space_rx) = crossbeam_channel::bounded(1);
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);

        let now = clock.now_ms();
        let mut feeds = Vec::new();
        let mut lanes = Vec::new();
        for lane in dispatcher::lanes(&shared, sinks) {
            let (tx, rx) = tokio::sync::mpsc::channel(config.lane_queue.max(1));
            let rate = lane
                .policy
                .rate_per_sec
                .map(|r| TokenBucket::new(r, lane.policy.burst, now));
            feeds.push(LaneFeed {
                tx,
                backlog: VecDeque::new(),
                rate,
            });
            lanes.push(runtime.spawn(lane.run(rx, space_tx.clone())));
        }

        let width = log.segment_minutes();
        let preload_ms = i64::try_from(config.preload.as_millis()).unwrap_or(i64::MAX);
        let span_ms = 2 * width.width_ms() + preload_ms;
        let wheel = WheelThread {
            wheel: Wheel::new(config.tick_ms, span_ms, now),
            feeds,
            sinks: sinks.clone(),
            shared: shared.clone(),
        };
        let wheel_stop = stop_rx.clone();
        let wheel_thread = std::thread::Builder::new()
            .name("delayd-wheel".into())
            .spawn(move || wheel.run(tap_rx, loaded_rx, space_rx, requeued_rx, wheel_stop))?;
        let loader = loader::Loader::new(shared.clone(), width, preload_ms, config.retire_every);
        let loader_thread = std::thread::Builder::new()
            .name("delayd-loader".into())
            .spawn(move || loader.run(loaded_tx, stop_rx))?;
        Ok(Scheduler {
            shared,
            running: Mutex::new(Some(Running {
                stop: stop_tx,
                threads: vec![wheel_thread, loader_thread],
                lanes,
            })),
            finished_keys: Mutex::new(Some(finished_keys_rx)),
        })
    }

    /// Cancels a message: every attempt of it that is still pending. `Ok` means no attempt starts after
    /// this call and the tombstones are durable; [`CancelError::InFlight`] means an attempt is being
    /// delivered right now (nothing was written: ask again once it settled). See registry.rs for how the
    /// answer is kept true. The work runs on a task of its own, so a caller that goes away (a client
    /// that disconnects) cannot leave a durable tombstone unknown to the lanes.
    pub async fn cancel(&self, id: MessageId) -> Result<Cancelled, CancelError> {
        tokio::spawn(registry::cancel(self.shared.clone(), id))
            .await
            .map_err(|e| CancelError::Interrupted(e.to_string()))?
    }

    /// Makes a dead message a new attempt due at `deliver_at_ms`, through the WAL (dead.rs).
    pub async fn requeue_dead(
        &self,
        id: MessageId,
        deliver_at_ms: i64,
    ) -> Result<Requeued, DeadLetterError> {
        tokio::spawn(dead::requeue(self.shared.clone(), id, deliver_at_ms))
            .await
            .map_err(|e| DeadLetterError::Interrupted(e.to_string()))?
    }

    /// Puts a dead message away: it stays dead and leaves the dead-letter list (dead.rs).
    pub async fn discard_dead(&self, id: MessageId) -> Result<(), DeadLetterError> {
        tokio::spawn(dead::discard(self.shared.clone(), id))
            .await
            .map_err(|e| DeadLetterError::Interrupted(e.to_string()))?
    }

    /// The receiving end of the finished-key reports (see the module doc); `None` after the first call.
    /// Reports sent before it is taken wait in the channel (at most one per message sent with `dedup`).
    pub fn take_finished_keys(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<FinishedKey>> {
        self.finished_keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Stops loading and firing, lets the lanes finish the batches they hold, and returns.
    /// A second call returns at once.
    pub async fn shutdown(&self) {
        let running = self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some(Running {
            stop,
            threads,
            lanes,
        }) = running
        else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        drop(stop);
        let _ = tokio::task::spawn_blocking(move || {
            for thread in threads {
                let _ = thread.join();
            }
        })
        .await;
        for lane in lanes {
            let _ = lane.await;
        }
    }
}

/// Between the wheel and one sink's lane.
#[derive(Debug)]
struct LaneFeed {
    tx: tokio::sync::mpsc::Sender<Entry>,
    /// Due entries that may not go yet (rate limit or full queue), in due order.
    backlog: VecDeque<Entry>,
    rate: Option<TokenBucket>,
}

impl LaneFeed {
    /// Hands backlog entries to the lane while the rate limit and the queue allow. Returns when to try
    /// again by the clock, if waiting for tokens (a full queue is signalled by the lane instead).
    fn release(&mut self, now_ms: i64) -> Option<i64> {
        while let Some(entry) = self.backlog.front() {
            if let Some(rate) = &mut self.rate {
                if !rate.try_take(now_ms) {
                    return Some(rate.next_token_ms());
                }
            }
            match self.tx.try_send(*entry) {
                Ok(()) => {
                    self.backlog.pop_front();
                }
                Err(_) => {
                    if let Some(rate) = &mut self.rate {
                        rate.refund();
                    }
                    return None;
                }
            }
        }
        None
    }
}

struct WheelThread {
    wheel: Wheel,
    feeds: Vec<LaneFeed>,
    sinks: SinkRegistry,
    shared: Arc<SchedulerState>,
}

impl WheelThread {
    fn run(
        mut self,
        tap: Receiver<Replayed>,
        loaded: Receiver<BucketSnapshot>,
        space: Receiver<()>,
        requeued: Receiver<Entry>,
        stop: Receiver<()>,
    ) {
        let changes = self.shared.clock.changes();
        loop {
            // Read before the drain: every report of a tombstone below it is handled after the drain.
            let filed_below = self.shared.log.filed_below();
            for event in tap.try_iter() {
                self.on_replayed(event);
            }
            self.shared.registry().prune(filed_below, true);
            for snapshot in loaded.try_iter() {
                self.on_loaded(&snapshot);
            }
            for entry in requeued.try_iter() {
                self.wheel.insert(entry);
            }
            let now = self.shared.clock.now_ms();
            self.wheel.advance(now);
            while let Some(entry) = self.wheel.pop_due(now) {
                // Unknown tags go to the last feed, whose lane declares them dead.
                let feed = self
                    .sinks
                    .index_of_tag(entry.sink_tag())
                    .unwrap_or(self.feeds.len() - 1);
                self.feeds[feed].backlog.push_back(entry);
            }
            let mut next = self.wheel.next_deadline();
            let mut backlog = 0;
            for feed in &mut self.feeds {
                if let Some(at) = feed.release(now) {
                    next = Some(next.map_or(at, |n| n.min(at)));
                }
                backlog += feed.backlog.len();
            }
            let in_memory = (self.wheel.len() + backlog) as u64;
            metrics::gauge!("delayd_wheel_entries").set(in_memory as f64);
            self.shared.in_memory.store(in_memory, Ordering::Relaxed);
            self.shared.report_pending();

            let timeout = match next {
                Some(deadline) => self.shared.clock.real_wait(deadline),
                None => None,
            };
            let timeout = timeout.map_or(crossbeam_channel::never(), crossbeam_channel::after);
            select! {
                recv(stop) -> _ => return,
                recv(tap) -> event => match event {
                    Ok(event) => self.on_replayed(event),
                    Err(_) => return,
                },
                recv(loaded) -> snapshot => match snapshot {
                    Ok(snapshot) => self.on_loaded(&snapshot),
                    Err(_) => return,
                },
                recv(space) -> _ => {},
                recv(requeued) -> entry => if let Ok(entry) = entry { self.wheel.insert(entry) },
                recv(changes) -> _ => {},
                recv(timeout) -> _ => {},
            }
        }
    }

    fn on_replayed(&mut self, event: Replayed) {
        match event {
            Replayed::Scheduled { bucket, entry } => self.wheel.insert(Entry::new(
                entry.deliver_at_ms,
                bucket.start_minute(),
                entry.offset,
                entry.frame_len,
                entry.sink_tag,
            )),
            Replayed::Cancelled { target, seq } => {
                self.shared.registry().on_replayed_cancel(target, seq);
            }
        }
    }

    fn on_loaded(&mut self, snapshot: &BucketSnapshot) {
        let minute = snapshot.bucket.start_minute();
        let entries: Vec<Entry> = snapshot
            .pending
            .iter()
            .map(|e| Entry::new(e.deliver_at_ms, minute, e.offset, e.frame_len, e.sink_tag))
            .collect();
        self.wheel.insert_all(&entries);
    }
}

/// The bucket of a wheel entry.
pub(crate) fn entry_bucket(entry: &Entry) -> Bucket {
    Bucket::from_start_minute(entry.bucket)
}

#[cfg(test)]
mod tests;
