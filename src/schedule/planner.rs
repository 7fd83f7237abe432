//! The planner: writes each schedule's firings ahead of their time, from the table alone.
//!
//! A schedule's next firing is written at its plan time: `max(after, next - LEAD) + spread`, where
//! `after` is the nominal time of its last firing (or, for a schedule just put or resumed, the op's
//! time) and `spread` a hash of its id below half the gap (at most `LEAD / 2`). So a firing is
//! written between half the gap since the last one (at most 60 s) and a quarter of it (at least 30 s
//! for a schedule firing once a minute or less often) before it is due, and the firings of many
//! schedules due at one instant are written spread over the half minute before it, not at that
//! instant (100,000 schedules due each minute: ~3,300 writes a second). A schedule has at most one
//! firing written ahead: the next is planned once the last one's time has come.
//!
//! Invariants:
//! - What to write is decided from the table (`ScheduleLog::schedule`) under [`Schedules::writing`],
//!   and no schedule is decided on again until what was written is filed there (the planner waits,
//!   the lock released, so that the API's ops go on): a firing whose write is in doubt (a cluster's
//!   `Uncertain`) is waited for, never written again. The first decisions wait until the log filed
//!   everything committed before the term (a restart's WAL tail, a new leader's backlog).
//! - A batch's appends go in order, each at most [`APPEND_BYTES`] (below a cluster entry's size), a
//!   schedule's firings in one of them, and the batch stops at the first that fails: a later firing
//!   of a schedule never lands while an earlier one was lost.
//! - The queue is only a hint of when to look: each schedule's state is read afresh when it is due,
//!   and every schedule is looked at again every [`RESCAN`] (one that a write in doubt or a slow
//!   filing kept from the queue).
//! - Catch-up `none` writes nothing for the fire times it skips: the planner remembers (in memory)
//!   how far it skipped, so it plans the next on-time firing rather than meeting the same missed
//!   ones again; a restart counts them as skipped again.

use super::calendar::{plan, Catchup, Firing, MISSED_AFTER_MS};
use super::{Schedules, Stored};
use crate::timestamp::format_ms;
use schedulelog::{AppendError, EncodedMessage, MessageRef, ScheduleState};
use schedulelog::{FIRE_AT_HEADER, SCHEDULE_HEADER};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How far ahead of its time a firing is written at most.
pub const LEAD_MS: i64 = 60_000;
/// Schedules planned in one batch at most (one look at the table each, then a few group commits).
const BATCH: usize = 5_000;
/// Bytes of firings in one batch at most: what a batch holds in memory.
const BATCH_BYTES: usize = 32 << 20;
/// Bytes of firings per append at most: a group commit, and a cluster entry (`MAX_ENTRY_BYTES` is
/// 16 MiB), of a bounded size.
pub const APPEND_BYTES: usize = 4 << 20;
/// After a failed write, how long until the schedules are looked at again.
const RETRY_MS: i64 = 1_000;
/// How often every schedule is looked at again.
const RESCAN: Duration = Duration::from_secs(600);

/// The nominal time a schedule plans after: its last firing's, or the op it plans afresh from (put
/// or resume) and, when later, a firing planned before it that the op withdrew (its fire time is
/// not written again; at most a lead ahead of the op).
fn after(state: &ScheduleState, stored: &Stored) -> i64 {
    let since = state.since_ms.max(stored.created_at_ms);
    match state.last {
        Some(last) if last.is_current(state) => last.fire_at_ms,
        // Strictly after the op: an `every` without `start_at` first fires a period after it.
        Some(withdrawn) => since.max(withdrawn.fire_at_ms.min(since.saturating_add(LEAD_MS))),
        None => since,
    }
}

/// The next fire time of a schedule that is not paused; `None` once it ended.
pub(crate) fn next_fire(state: &ScheduleState, stored: &Stored, now_ms: i64) -> Option<i64> {
    let timing = stored.timing()?;
    let after = after(state, stored);
    match state.last {
        // Planned already and still ahead.
        Some(last) if last.is_current(state) && last.fire_at_ms >= now_ms => Some(last.fire_at_ms),
        _ => {
            let next = plan(&timing, Some(after), after, after).next?;
            // Missed with catch-up `none`: the next one to come is the next made.
            match timing.catchup == Catchup::None && next < now_ms - MISSED_AFTER_MS {
                true => plan(&timing, Some(now_ms), now_ms, now_ms).next,
                false => Some(next),
            }
        }
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

/// How far a `none` schedule skipped missed fire times: valid for the definition (or resume) it was
/// found under, `since_seq`.
type Skip = (u64, i64);

/// What one batch decided: per schedule, its firings (in order); missed fire times not made; how
/// far `none` schedules skipped.
#[derive(Debug, Default)]
struct Decided {
    firings: Vec<Vec<EncodedMessage>>,
    skipped: u64,
    skipped_to: Vec<(String, Skip)>,
    /// Schedules whose firings did not fit the record format: none written.
    unwritable: Vec<String>,
    /// Schedules left for the next batch (the batch was full).
    left: Vec<String>,
}

/// The nominal time a schedule plans after, with what the planner skipped for it.
fn planned_after(
    state: &ScheduleState,
    stored: &Stored,
    skipped_to: &HashMap<String, Skip>,
) -> i64 {
    let skip = (skipped_to.get(&state.id))
        .filter(|(since_seq, _)| *since_seq == state.since_seq)
        .map_or(i64::MIN, |(_, to)| *to);
    after(state, stored).max(skip)
}

/// Decides the firings of the schedules `due` at `now` (blocking: it reads the table and walks
/// calendars).
fn decide(
    schedules: &Schedules,
    due: Vec<String>,
    skipped_to: &HashMap<String, Skip>,
    now: i64,
) -> Decided {
    let mut decided = Decided::default();
    let mut bytes = 0;
    let mut due = due.into_iter();
    for id in due.by_ref() {
        let Some(state) = schedules.log.schedule(&id) else {
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
        let after = planned_after(&state, stored, skipped_to);
        let Some(next) = plan(&timing, Some(after), after, after).next else {
            continue;
        };
        if plan_at(&id, after, next) > now {
            continue; // put again meanwhile: planned anew once filed
        }
        // Missed (the node was down): catch up as the schedule says, and write the first fire time
        // still to come with it when it is within a lead (as it would be planned anyway), so that
        // progress moves even when catch-up writes nothing.
        let until = match next < now.saturating_sub(MISSED_AFTER_MS) {
            true => (timing.calendar)
                .next_after(now.saturating_sub(MISSED_AFTER_MS + 1))
                .filter(|first| *first <= now.saturating_add(LEAD_MS))
                .unwrap_or(next),
            false => next,
        };
        let planned = plan(&timing, Some(after), now, until);
        decided.skipped += planned.skipped;
        if planned.firings.is_empty() {
            if timing.catchup == Catchup::None {
                // No fire time lies between the skipped ones and a lead from now (`until`, above):
                // the next is planned after now, with its usual lead.
                decided
                    .skipped_to
                    .push((id.clone(), (state.since_seq, now)));
            }
            continue;
        }
        // A schedule's firings go in one append: the oldest of a long catch-up are left out (and
        // counted as skipped) when they would not fit; encoded newest first, only what fits.
        let body = stored.body();
        let mut firings = Vec::with_capacity(planned.firings.len());
        let mut size = 0;
        let count = planned.firings.len();
        for (n, firing) in planned.firings.into_iter().rev().enumerate() {
            let Some(encoded) = encode(&id, stored, &body, firing) else {
                tracing::warn!(schedule = %id, "a firing does not fit the record format: skipped");
                continue;
            };
            if size + encoded.frame_len() > APPEND_BYTES && !firings.is_empty() {
                decided.skipped += (count - n) as u64;
                break;
            }
            size += encoded.frame_len();
            firings.push(encoded);
        }
        if firings.is_empty() {
            decided.unwritable.push(id);
            continue;
        }
        firings.reverse();
        bytes += size;
        decided.firings.push(firings);
        if bytes >= BATCH_BYTES {
            break;
        }
    }
    decided.left = due.collect();
    decided
}

/// The planner of a term: runs until its term stops.
#[derive(Debug)]
pub struct Planner {
    schedules: Arc<Schedules>,
    woken: tokio::sync::mpsc::UnboundedReceiver<(String, u64)>,
    /// Schedules woken whose op is not filed yet, and the seq the log must have filed below.
    waking: Vec<(String, u64)>,
    /// (plan time, id), and each id's plan time.
    queue: BTreeSet<(i64, String)>,
    at: HashMap<String, i64>,
    /// How far `none` schedules skipped missed fire times (module doc).
    skipped_to: HashMap<String, Skip>,
}

impl Planner {
    pub(crate) fn new(
        schedules: Arc<Schedules>,
        woken: tokio::sync::mpsc::UnboundedReceiver<(String, u64)>,
    ) -> Planner {
        Planner {
            schedules,
            woken,
            waking: Vec::new(),
            queue: BTreeSet::new(),
            at: HashMap::new(),
            skipped_to: HashMap::new(),
        }
    }

    /// Plans every schedule, then each as its time comes, until `stop` says `true`.
    pub async fn run(mut self, mut stop: tokio::sync::watch::Receiver<bool>) {
        if !self.caught_up(&mut stop).await {
            return;
        }
        self.rescan();
        let mut rescanned = Instant::now();
        while !*stop.borrow() {
            if rescanned.elapsed() >= RESCAN {
                self.rescan();
                rescanned = Instant::now();
            }
            // Every schedule woken so far, not one a turn: a burst of puts is planned in the
            // batches below while earlier schedules keep firing.
            while let Ok(woken) = self.woken.try_recv() {
                self.waking.push(woken);
            }
            let filed_below = self.schedules.log.filed_below();
            let (filed, waiting): (Vec<_>, Vec<_>) = (std::mem::take(&mut self.waking).into_iter())
                .partition(|(_, below)| filed_below >= *below);
            self.waking = waiting;
            for (id, _) in filed {
                self.enqueue(&id);
            }
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
            // Woken ones wait for their op's filing: looked for often.
            let longest = match self.waking.is_empty() {
                true => 1_000,
                false => 5,
            };
            let wait_ms = self
                .queue
                .first()
                .map_or(longest, |(at, _)| at.saturating_sub(now).clamp(1, longest));
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(wait_ms as u64)) => {}
                Some(woken) = self.woken.recv() => self.waking.push(woken),
                _ = stop.changed() => {}
            }
        }
    }

    /// Waits until the log filed everything committed so far (`false`: stopped first).
    async fn caught_up(&self, stop: &mut tokio::sync::watch::Receiver<bool>) -> bool {
        loop {
            let log = self.schedules.log.clone();
            if let Ok(Ok(_)) = tokio::task::spawn_blocking(move || log.next_seq()).await {
                return true;
            }
            // Held up (a full disk): nothing is planned from a table that lags the log.
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.changed() => {}
            }
            if *stop.borrow() {
                return false;
            }
        }
    }

    /// Looks at every schedule again.
    fn rescan(&mut self) {
        let mut after = None;
        loop {
            let page = self.schedules.log.schedules(after.as_deref(), 1_000);
            let Some(last) = page.last() else { break };
            after = Some(last.id.clone());
            for state in &page {
                self.enqueue_state(state);
            }
        }
    }

    /// Looks at schedule `id` again.
    fn enqueue(&mut self, id: &str) {
        match self.schedules.log.schedule(id) {
            Some(state) => self.enqueue_state(&state),
            None => {
                self.dequeue(id);
                self.skipped_to.remove(id);
            }
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
        let after = planned_after(state, &stored, &self.skipped_to);
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
        // An op answered in doubt (or not filed in time) is in the table before it is read.
        if schedules.settled().await.is_err() {
            let again = schedules.clock.now_ms().saturating_add(RETRY_MS);
            for id in &due {
                self.insert(id, again);
            }
            return;
        }
        let now = schedules.clock.now_ms();
        let decided = {
            let (schedules, due, skipped_to) =
                (schedules.clone(), due.clone(), self.skipped_to.clone());
            tokio::task::spawn_blocking(move || decide(&schedules, due, &skipped_to, now)).await
        };
        let Ok(decided) = decided else {
            tracing::error!("planning firings panicked; tried again in a second");
            for id in &due {
                self.insert(id, now.saturating_add(RETRY_MS));
            }
            return;
        };
        for (id, to) in decided.skipped_to {
            self.skipped_to.insert(id, to);
        }
        metrics::counter!("delayd_schedule_firings_total", "outcome" => "skipped")
            .increment(decided.skipped);
        let (written, filed_below, outcome) = self.write(decided.firings).await;
        drop(writing);
        metrics::counter!("delayd_schedule_firings_total", "outcome" => "fired")
            .increment(written as u64);
        // Whatever was written (or may have been) is filed before the table is read again.
        let log = &self.schedules.log;
        while log.filed_below() < filed_below {
            if *stop.borrow() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        match outcome {
            Ok(()) => {
                for id in &decided.left {
                    self.insert(id, now);
                }
                let left: std::collections::HashSet<&String> = decided.left.iter().collect();
                for id in due.iter().filter(|id| !left.contains(id)) {
                    self.enqueue(id);
                    if self
                        .skipped_to
                        .get(id)
                        .is_some_and(|(_, to)| *to < now - LEAD_MS)
                    {
                        self.skipped_to.remove(id);
                    }
                }
                // One whose firings do not fit the record format is not looked at again at once.
                for id in &decided.unwritable {
                    self.dequeue(id);
                    self.insert(id, now.saturating_add(RETRY_MS));
                }
            }
            Err(error) => {
                tracing::warn!(%error, schedules = due.len(), "writing firings failed; tried again in a second");
                let again = now.saturating_add(RETRY_MS);
                for id in &due {
                    self.dequeue(id);
                    self.insert(id, again);
                }
            }
        }
    }

    /// Appends the firings, a schedule's together, in order, in appends of at most [`APPEND_BYTES`],
    /// stopping at the first that fails: how many were surely written, the seq below which every
    /// record written (or in doubt) is, and `Err` when some were not written or are in doubt (the
    /// table says, once filed, which took effect).
    async fn write(
        &self,
        firings: Vec<Vec<EncodedMessage>>,
    ) -> (usize, u64, Result<(), AppendError>) {
        let log = &self.schedules.log;
        let mut written = 0;
        let mut filed_below = 0;
        let mut chunk: Vec<EncodedMessage> = Vec::new();
        let mut chunk_bytes = 0;
        let mut firings = firings.into_iter().peekable();
        while let Some(schedule) = firings.next() {
            chunk_bytes += schedule
                .iter()
                .map(EncodedMessage::frame_len)
                .sum::<usize>();
            chunk.extend(schedule);
            let full = firings.peek().is_none_or(|next| {
                chunk_bytes + next.iter().map(EncodedMessage::frame_len).sum::<usize>()
                    > APPEND_BYTES
            });
            if !full {
                continue;
            }
            chunk_bytes = 0;
            match log.append(std::mem::take(&mut chunk)).await {
                Ok(appended) => {
                    written += appended.len();
                    if let Some(last) = appended.last() {
                        filed_below = filed_below.max(last.location.seq + 1);
                    }
                }
                Err(AppendError::Uncertain { seqs_below }) => {
                    filed_below = filed_below.max(seqs_below);
                    return (
                        written,
                        filed_below,
                        Err(AppendError::Uncertain { seqs_below }),
                    );
                }
                Err(other) => return (written, filed_below, Err(other)),
            }
        }
        (written, filed_below, Ok(()))
    }
}
