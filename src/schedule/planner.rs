//! The planner: writes each schedule's firings ahead of their time, from the table alone.
//!
//! A schedule's next firing is written at its plan time: `max(after, next - LEAD) + spread`, where
//! `after` is the nominal time of its last firing (or, for a schedule just put or resumed, the op's
//! time) and `spread` a hash of its id below half the gap (at most `LEAD / 2`). So a firing is
//! written between half a period (at most 60 s) and 30 s before it is due, and the firings of many
//! schedules due at one instant are written spread over the half minute before it, not at that instant
//! (100,000 schedules due each minute: ~3,300 writes a second). A schedule has at most one firing
//! written ahead: the next is planned once the last one's time has come.
//!
//! Invariants:
//! - What to write is decided from the table (`ScheduleLog::schedule`) under [`Schedules::writing`],
//!   and the next decision waits until what was written is filed there: a firing whose write is in
//!   doubt (a cluster's `Uncertain`) is waited for, never written again.
//! - The queue is only a hint of when to look: each schedule's state is read afresh when it is due.

use super::calendar::{plan, Firing, MISSED_AFTER_MS};
use super::{Schedules, Stored};
use crate::timestamp::format_ms;
use schedulelog::{AppendError, EncodedMessage, MessageRef, ScheduleState};
use schedulelog::{FIRE_AT_HEADER, SCHEDULE_HEADER};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// How far ahead of its time a firing is written at most.
pub const LEAD_MS: i64 = 60_000;
/// Schedules planned in one batch at most (one look at the table each, then a few group commits).
const BATCH: usize = 5_000;
/// Firings per append: a group commit (and a cluster entry) of a bounded size.
const PER_APPEND: usize = 500;
/// After a failed write, how long until the schedules are looked at again.
const RETRY_MS: i64 = 1_000;

/// The nominal time a schedule plans after: its last firing's, or the op it plans afresh from.
fn after(state: &ScheduleState, stored: &Stored) -> i64 {
    match state.last {
        Some(last) if last.is_current(state) => last.fire_at_ms,
        // Strictly after the op: an `every` without `start_at` first fires a period after it.
        _ => state.since_ms.max(stored.created_at_ms),
    }
}

/// The next fire time of a schedule that is not paused; `None` once it ended.
pub(crate) fn next_fire(state: &ScheduleState, stored: &Stored, now_ms: i64) -> Option<i64> {
    let timing = stored.timing()?;
    let after = after(state, stored);
    match state.last {
        // Planned already and still ahead.
        Some(last) if last.is_current(state) && last.fire_at_ms >= now_ms => Some(last.fire_at_ms),
        _ => plan(&timing, Some(after), after, after).next,
    }
}

/// When to write the firing at `next`, the one after `after`.
fn plan_at(id: &str, after: i64, next: i64) -> i64 {
    let window = (next.saturating_sub(after)).clamp(0, LEAD_MS) / 2;
    let spread = match window {
        0 => 0,
        window => (crc32c::crc32c(id.as_bytes()) as i64) % window,
    };
    after
        .max(next.saturating_sub(LEAD_MS))
        .saturating_add(spread)
}

/// A firing as the message it is.
fn encode(id: &str, stored: &Stored, body: &[u8], firing: Firing) -> Option<EncodedMessage> {
    let spec = &stored.spec;
    let fire_at = format_ms(firing.nominal_ms);
    let mut headers = Vec::with_capacity(2 + spec.headers.len());
    headers.push((SCHEDULE_HEADER, id));
    headers.push((FIRE_AT_HEADER, fire_at.as_str()));
    headers.extend(spec.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
    MessageRef {
        deliver_at_ms: firing.deliver_at_ms,
        topic: &spec.topic,
        key: spec.key.as_deref(),
        headers: &headers,
        sink: &spec.sink,
        body,
        retry_of: None,
        dedup: false,
    }
    .encode()
    .ok()
}

/// The planner of a term: runs until its term stops.
#[derive(Debug)]
pub struct Planner {
    schedules: Arc<Schedules>,
    woken: tokio::sync::mpsc::UnboundedReceiver<String>,
    /// (plan time, id), and each id's plan time.
    queue: BTreeSet<(i64, String)>,
    at: HashMap<String, i64>,
}

impl Planner {
    pub(crate) fn new(
        schedules: Arc<Schedules>,
        woken: tokio::sync::mpsc::UnboundedReceiver<String>,
    ) -> Planner {
        Planner {
            schedules,
            woken,
            queue: BTreeSet::new(),
            at: HashMap::new(),
        }
    }

    /// Plans every schedule, then each as its time comes, until `stop` says `true`.
    pub async fn run(mut self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut after = None;
        loop {
            let page = self.schedules.log.schedules(after.as_deref(), 1_000);
            let Some(last) = page.last() else { break };
            after = Some(last.id.clone());
            for state in &page {
                self.enqueue_state(state);
            }
        }
        while !*stop.borrow() {
            metrics::gauge!("delayd_schedules").set(self.schedules.count() as f64);
            let now = self.schedules.clock.now_ms();
            let mut due = Vec::new();
            while due.len() < BATCH {
                match self.queue.first() {
                    Some((at, _)) if *at <= now => {
                        let (_, id) = self.queue.pop_first().expect("first exists");
                        self.at.remove(&id);
                        due.push(id);
                    }
                    _ => break,
                }
            }
            if !due.is_empty() {
                self.fire(due, &mut stop).await;
                continue;
            }
            let wait_ms = self
                .queue
                .first()
                .map_or(1_000, |(at, _)| at.saturating_sub(now).clamp(1, 1_000));
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(wait_ms as u64)) => {}
                Some(id) = self.woken.recv() => self.enqueue(&id),
                _ = stop.changed() => {}
            }
        }
    }

    /// Looks at schedule `id` again.
    fn enqueue(&mut self, id: &str) {
        match self.schedules.log.schedule(id) {
            Some(state) => self.enqueue_state(&state),
            None => self.dequeue(id),
        }
    }

    fn dequeue(&mut self, id: &str) {
        if let Some(at) = self.at.remove(id) {
            self.queue.remove(&(at, id.to_string()));
        }
    }

    fn enqueue_state(&mut self, state: &ScheduleState) {
        self.dequeue(&state.id);
        if state.paused {
            return;
        }
        let Some(stored) = Stored::decode(&state.definition) else {
            tracing::warn!(schedule = %state.id, "a schedule's definition does not decode (written by a later version?): it does not fire");
            return;
        };
        let Some(timing) = stored.timing() else {
            tracing::warn!(schedule = %state.id, "a schedule's timing does not parse: it does not fire");
            return;
        };
        let after = after(state, &stored);
        let Some(next) = plan(&timing, Some(after), after, after).next else {
            return; // ended
        };
        self.insert(&state.id, plan_at(&state.id, after, next));
    }

    fn insert(&mut self, id: &str, at: i64) {
        self.queue.insert((at, id.to_string()));
        self.at.insert(id.to_string(), at);
    }

    /// Writes the firings of the schedules `due`, waits until they are filed, and plans them again.
    async fn fire(&mut self, due: Vec<String>, stop: &mut tokio::sync::watch::Receiver<bool>) {
        let schedules = self.schedules.clone();
        let writing = schedules.writing.lock().await;
        let now = schedules.clock.now_ms();
        let mut records = Vec::new();
        let mut skipped = 0;
        for id in &due {
            let Some(state) = schedules.log.schedule(id) else {
                continue;
            };
            let stored = Stored::decode(&state.definition);
            let (Some(stored), Some(timing)) =
                (stored.as_ref(), stored.as_ref().and_then(Stored::timing))
            else {
                continue;
            };
            if state.paused {
                continue;
            }
            let after = after(&state, stored);
            let Some(next) = plan(&timing, Some(after), after, after).next else {
                continue;
            };
            if plan_at(id, after, next) > now {
                continue; // put again meanwhile: planned below
            }
            // Missed (the node was down): catch up as the schedule says, and write the next fire time
            // to come as well, so that its progress moves even when catch-up writes nothing.
            let until = match next < now.saturating_sub(MISSED_AFTER_MS) {
                true => (timing.calendar)
                    .next_after(now.saturating_sub(MISSED_AFTER_MS + 1))
                    .unwrap_or(next),
                false => next,
            };
            let planned = plan(&timing, Some(after), now, until);
            skipped += planned.skipped;
            let body = stored.body();
            for firing in planned.firings {
                match encode(id, stored, &body, firing) {
                    Some(record) => records.push(record),
                    None => {
                        tracing::warn!(schedule = %id, "a firing does not fit the record format: skipped");
                    }
                }
            }
        }
        let (written, outcome) = self.write(records, stop).await;
        drop(writing);
        metrics::counter!("delayd_schedule_firings_total", "outcome" => "fired")
            .increment(written as u64);
        match outcome {
            Ok(()) => {
                metrics::counter!("delayd_schedule_firings_total", "outcome" => "skipped")
                    .increment(skipped);
                for id in &due {
                    self.enqueue(id);
                    // One that wrote nothing (a firing that does not fit the record format) is not
                    // looked at again at once.
                    if self.at.get(id).is_some_and(|at| *at <= now) {
                        self.dequeue(id);
                        self.insert(id, now.saturating_add(RETRY_MS));
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, schedules = due.len(), "writing firings failed; tried again in a second");
                let again = now.saturating_add(RETRY_MS);
                for id in &due {
                    self.insert(id, again);
                }
            }
        }
    }

    /// Appends `records` and waits until they are filed (or, for a write in doubt, until the log
    /// filed every seq it could have taken): how many were surely written, and `Err` when some were
    /// not (or may not have been, and the term stopped before it knew).
    async fn write(
        &self,
        records: Vec<EncodedMessage>,
        stop: &mut tokio::sync::watch::Receiver<bool>,
    ) -> (usize, Result<(), AppendError>) {
        if records.is_empty() {
            return (0, Ok(()));
        }
        let log = &self.schedules.log;
        let mut acks = Vec::new();
        let mut records = records.into_iter().peekable();
        while records.peek().is_some() {
            acks.push(log.append(records.by_ref().take(PER_APPEND).collect()));
        }
        let mut result = Ok(());
        let mut filed_below = 0;
        let mut written = 0;
        for ack in acks {
            match ack.await {
                Ok(appended) => {
                    written += appended.len();
                    if let Some(last) = appended.last() {
                        filed_below = filed_below.max(last.location.seq + 1);
                    }
                }
                Err(AppendError::Uncertain { seqs_below }) => {
                    filed_below = filed_below.max(seqs_below);
                    result = Err(AppendError::Uncertain { seqs_below });
                }
                Err(other) => result = result.and(Err(other)),
            }
        }
        // Whatever was written (or may have been) is filed before the table is read again.
        while log.filed_below() < filed_below {
            if *stop.borrow() {
                return (written, Err(AppendError::Closed));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match result {
            // In doubt, but now filed: the table says what took effect.
            Err(AppendError::Uncertain { .. }) => (written, Ok(())),
            other => (written, other),
        }
    }
}
