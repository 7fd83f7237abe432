//! The loader: pages buckets into the wheel shortly before they start, and retires finished ones.
//!
//! Which buckets are watched at time `now`:
//! - every bucket from the one holding `now` to the one holding `now + preload`, whether or not it has a
//!   segment yet (a message filed into it later is reported live);
//! - every older bucket that has a segment, oldest first: after a restart or a long outage they hold the
//!   overdue messages (QMQ reloads only the newest segments and strands the rest).
//!
//! A bucket is unwatched a grace period after it ended: nothing new is filed into a past bucket. One
//! that never got a segment is then forgotten; the others when they are retired.
//!
//! Before taking a bucket's snapshot the loader marks it loaded in the registry (registry.rs): from then
//! on cancels of its messages are kept in memory, and a cancel acknowledged before is filed before the
//! snapshot is taken (or still held in memory as unfiled), so the snapshot and the cancels never miss
//! each other. Once the snapshot is taken, cancels of records it leaves out as finished are dropped
//! from memory (no lane will meet them). A retired bucket is forgotten by the registry with its cancels. Unwatching a bucket does
//! not drop its cancels: its entries may still wait in a sink's backlog (a catch-up at a rate limit can
//! outlast the grace period), and a lane must still drop them.

use super::SchedulerState;
use crossbeam_channel::{select, Receiver, Sender};
use schedulelog::{Bucket, BucketSnapshot, SegmentMinutes};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

/// How long after its end a bucket stays watched: a record committed at the very end of a bucket is
/// filed into it when replayed, normally milliseconds later; an hour covers any stall of the replayer.
const UNWATCH_GRACE_MS: i64 = 3_600_000;

pub(crate) struct Loader {
    shared: Arc<SchedulerState>,
    width: SegmentMinutes,
    preload_ms: i64,
    retire_every_ms: i64,
    /// Buckets handed to the wheel at some point: never loaded twice (the wheel delivers what it got).
    loaded: BTreeSet<Bucket>,
    /// Loaded buckets still watched for live records.
    live: BTreeSet<Bucket>,
}

impl Loader {
    pub(crate) fn new(
        shared: Arc<SchedulerState>,
        width: SegmentMinutes,
        preload_ms: i64,
        retire_every: Duration,
    ) -> Loader {
        Loader {
            shared,
            width,
            preload_ms,
            retire_every_ms: i64::try_from(retire_every.as_millis()).unwrap_or(i64::MAX),
            loaded: BTreeSet::new(),
            live: BTreeSet::new(),
        }
    }

    pub(crate) fn run(mut self, loaded: Sender<BucketSnapshot>, stop: Receiver<()>) {
        let changes = self.shared.clock.changes();
        let mut next_retire = self.shared.clock.now_ms();
        loop {
            let now = self.shared.clock.now_ms();
            let mut retry_soon = false;
            for bucket in self.due_buckets(now) {
                self.shared
                    .registry()
                    .mark_loaded(bucket, self.shared.log.filed_below());
                #[cfg(test)]
                self.shared.hook_loader_marked(bucket);
                // Every record below this is in the snapshot unless it is finished.
                let filed_below = self.shared.log.filed_below();
                match self.shared.log.watch(bucket) {
                    Ok(snapshot) => {
                        self.shared
                            .registry()
                            .snapshot_taken(&snapshot, filed_below);
                        self.loaded.insert(bucket);
                        self.live.insert(bucket);
                        if loaded.send(snapshot).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        tracing::error!(%bucket, error = %e, "loading a bucket failed; retrying");
                        retry_soon = true;
                    }
                }
            }
            self.unwatch_ended(now);
            let unloaded: u64 = self
                .shared
                .log
                .entry_counts()
                .into_iter()
                .filter(|(b, _)| !self.loaded.contains(b))
                .map(|(_, n)| n)
                .sum();
            self.shared
                .unloaded_records
                .store(unloaded, std::sync::atomic::Ordering::Relaxed);
            self.shared.report_pending();
            if now >= next_retire {
                match self.shared.log.retire() {
                    Ok(retired) if !retired.is_empty() => {
                        let mut registry = self.shared.registry();
                        for bucket in &retired {
                            registry.forget(*bucket);
                            // Past buckets take no new records: never loaded again.
                            self.loaded.remove(bucket);
                        }
                        drop(registry);
                        tracing::info!(?retired, "retired buckets")
                    }
                    Ok(_) => {}
                    Err(e) => tracing::error!(error = %e, "retiring buckets failed"),
                }
                metrics::gauge!("delayd_segments").set(self.shared.log.buckets().len() as f64);
                next_retire = now.saturating_add(self.retire_every_ms);
            }
            // Wake when the next bucket enters the preload window, at the next retirement, or sooner
            // after a failed load.
            let horizon = Bucket::of(now + self.preload_ms, self.width);
            let mut next = (horizon.next(self.width).start_ms() - self.preload_ms).min(next_retire);
            if retry_soon {
                next = next.min(now + 1_000);
            }
            let timeout = self
                .shared
                .clock
                .real_wait(next)
                .map_or(crossbeam_channel::never(), crossbeam_channel::after);
            select! {
                recv(stop) -> _ => return,
                recv(changes) -> _ => {},
                recv(timeout) -> _ => {},
            }
        }
    }

    /// Buckets to watch now that are not watched yet, oldest first.
    fn due_buckets(&self, now: i64) -> Vec<Bucket> {
        let horizon_ms = now + self.preload_ms;
        let mut due: BTreeSet<Bucket> = self
            .shared
            .log
            .buckets()
            .into_iter()
            .filter(|b| b.start_ms() <= horizon_ms)
            .collect();
        let mut bucket = Bucket::of(now, self.width);
        while bucket.start_ms() <= horizon_ms {
            due.insert(bucket);
            bucket = bucket.next(self.width);
        }
        due.retain(|b| !self.loaded.contains(b));
        due.into_iter().collect()
    }

    fn unwatch_ended(&mut self, now: i64) {
        let ended: Vec<Bucket> = self
            .live
            .iter()
            .copied()
            .filter(|b| b.end_ms(self.width) + UNWATCH_GRACE_MS <= now)
            .collect();
        let with_segment: BTreeSet<Bucket> = self.shared.log.buckets().into_iter().collect();
        for bucket in ended {
            self.live.remove(&bucket);
            self.shared.log.unwatch(bucket);
            if !with_segment.contains(&bucket) {
                // It never held a record, and none is filed into it any more: nothing to remember
                // it for (retirement, which forgets the others, never sees a bucket without a segment).
                self.loaded.remove(&bucket);
                self.shared.registry().forget(bucket);
            }
        }
    }
}
