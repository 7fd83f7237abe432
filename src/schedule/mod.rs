//! Recurring schedules (DESIGN §14): cron patterns and intervals that make one ordinary message per
//! firing.
//!
//! A schedule and its progress live in the log (schedulelog's schedules.rs): an op (put, pause,
//! resume, delete) is a record written through the WAL like a message, and a firing is a message with
//! the headers `delayd-schedule` and `delayd-fire-at`, whose filing counts as the schedule's progress.
//! So a firing and the progress it makes are one record: a crash leaves both or neither, a cluster
//! replicates both as it does messages, and the planner, which decides every firing from the table,
//! never writes a fire time twice.
//!
//! Invariants:
//! - One writer at a time ([`Schedules::writing`]): an op, or a planner batch, holds it from reading
//!   the table until what it wrote is filed, so no firing is planned from a definition being
//!   replaced, and none twice.
//! - Nothing fires after a pause, replacement or delete is answered: the planned firing is cancelled,
//!   and a lane withdraws any firing of its schedule written before (scheduler/dispatcher.rs), so also
//!   one already due and waiting for a retry. A delivery already under way completes.
//! - A firing is written ahead of its time (planner.rs), never due before its nominal time.

pub mod calendar;
mod definition;
pub(crate) mod planner;

pub use definition::{valid_id, PutSchedule, Spec, Stored};

use crate::intake::{Admission, Rejection};
use crate::scheduler::{CancelError, Scheduler};
use crate::timestamp::format_ms;
use schedulelog::{AppendError, Clock, ScheduleLog, ScheduleOp, ScheduleState};
use serde::Serialize;
use std::sync::Arc;
use utoipa::ToSchema;

/// A schedule as the API answers it: its definition's fields (`Spec`), then how it stands.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ScheduleView {
    pub id: String,
    pub cron: Option<String>,
    pub every: Option<String>,
    pub tz: String,
    pub topic: String,
    pub body: Option<String>,
    #[schema(content_encoding = "base64")]
    pub body_base64: Option<String>,
    pub headers: std::collections::BTreeMap<String, String>,
    pub key: Option<String>,
    pub sink: String,
    #[schema(format = DateTime)]
    pub start_at: Option<String>,
    #[schema(format = DateTime)]
    pub end_at: Option<String>,
    /// `none`, `one` or `all`.
    #[schema(value_type = String)]
    pub catchup: calendar::Catchup,
    pub paused: bool,
    /// The next firing it will make (null while paused, or once it ended).
    #[schema(format = DateTime)]
    pub next_fire_at: Option<String>,
    /// The nominal time of the newest firing written (one a pause, replacement or delete withdrew
    /// counts: its message says `cancelled`).
    #[schema(format = DateTime)]
    pub last_fire_at: Option<String>,
    /// The message id of that firing.
    pub last_message_id: Option<String>,
    /// Firings written, over all its definitions.
    pub fired: u64,
    /// When its current definition was made.
    #[schema(format = DateTime)]
    pub created_at: String,
}

/// What a put did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    Created,
    Replaced,
    /// The definition was the schedule's already: nothing was written.
    Unchanged,
}

/// Why a schedule op did nothing.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error(transparent)]
    Rejected(#[from] Rejection),
    #[error("no schedule has this id")]
    NotFound,
    #[error(transparent)]
    Append(#[from] AppendError),
    /// The op is durable but not filed within the wait (a replayer held up by a full disk).
    #[error("the write is durable but not filed yet")]
    NotFiled,
}

/// The schedules' service over a term's log: the API's ops and the planner's firings.
#[derive(Debug)]
pub struct Schedules {
    log: Arc<ScheduleLog>,
    scheduler: Arc<Scheduler>,
    admission: Admission,
    clock: Arc<dyn Clock>,
    /// Held from reading the table to the write being filed (module doc).
    writing: tokio::sync::Mutex<()>,
    /// Schedules for the planner to look at again (put, resumed), once the log filed every seq below
    /// the one given (the op's, or those a write in doubt could have).
    wake: tokio::sync::mpsc::UnboundedSender<(String, u64)>,
}

impl Schedules {
    /// The service and its planner, which the caller runs ([`planner::Planner::run`]).
    pub fn new(
        log: Arc<ScheduleLog>,
        scheduler: Arc<Scheduler>,
        admission: Admission,
        clock: Arc<dyn Clock>,
    ) -> (Arc<Schedules>, planner::Planner) {
        let (wake, woken) = tokio::sync::mpsc::unbounded_channel();
        let schedules = Arc::new(Schedules {
            log,
            scheduler,
            admission,
            clock,
            writing: tokio::sync::Mutex::new(()),
            wake,
        });
        let planner = planner::Planner::new(schedules.clone(), woken);
        (schedules, planner)
    }

    /// Creates or replaces schedule `id`: what it did, and the schedule. A definition equal to the
    /// current one writes nothing (a deploy that puts its schedules again changes none).
    pub async fn put(
        &self,
        id: &str,
        request: PutSchedule,
    ) -> Result<(Put, ScheduleView), ScheduleError> {
        if !valid_id(id) {
            return Err(Rejection::new(
                "invalid_schedule_id",
                "a schedule id must match [A-Za-z0-9._-]{1,200} and not be only dots",
            )
            .into());
        }
        let stored = request.check(&self.admission, self.clock.now_ms())?;
        let _writing = self.writing.lock().await;
        self.settled().await?;
        let before = self.log.schedule(id);
        let unchanged = before.as_ref().is_some_and(|before| {
            Stored::decode(&before.definition).is_some_and(|s| s.spec == stored.spec)
        });
        if !unchanged {
            self.write_op(id, ScheduleOp::Put, &stored.encode()).await?;
            if let Some(before) = &before {
                self.withdraw(before).await;
            }
        }
        let state = self.log.schedule(id).ok_or(ScheduleError::NotFound)?;
        let put = match (&before, unchanged) {
            (None, _) => Put::Created,
            (Some(_), false) => Put::Replaced,
            (Some(_), true) => Put::Unchanged,
        };
        Ok((put, self.view(&state)))
    }

    pub fn get(&self, id: &str) -> Option<ScheduleView> {
        Some(self.view(&self.log.schedule(id)?))
    }

    /// Up to `limit` schedules after the id `after`, by id, and the cursor of the next page.
    pub fn list(&self, after: Option<&str>, limit: usize) -> (Vec<ScheduleView>, Option<String>) {
        let mut page = self.log.schedules(after, limit + 1);
        let more = page.len() > limit;
        page.truncate(limit);
        let next = more.then(|| page.last().map(|s| s.id.clone())).flatten();
        (page.iter().map(|s| self.view(s)).collect(), next)
    }

    /// Pauses schedule `id` (again: nothing more is written) and withdraws its planned firing.
    pub async fn pause(&self, id: &str) -> Result<ScheduleView, ScheduleError> {
        let _writing = self.writing.lock().await;
        self.settled().await?;
        let state = self.log.schedule(id).ok_or(ScheduleError::NotFound)?;
        if !state.paused {
            self.write_op(id, ScheduleOp::Pause, &[]).await?;
        }
        self.withdraw(&state).await;
        let state = self.log.schedule(id).ok_or(ScheduleError::NotFound)?;
        Ok(self.view(&state))
    }

    /// Resumes schedule `id`: it plans afresh from now (what it missed while paused is not caught up).
    pub async fn resume(&self, id: &str) -> Result<ScheduleView, ScheduleError> {
        let _writing = self.writing.lock().await;
        self.settled().await?;
        let state = self.log.schedule(id).ok_or(ScheduleError::NotFound)?;
        if state.paused {
            self.write_op(id, ScheduleOp::Resume, &[]).await?;
        }
        let state = self.log.schedule(id).ok_or(ScheduleError::NotFound)?;
        Ok(self.view(&state))
    }

    /// Deletes schedule `id` and withdraws its planned firing.
    pub async fn delete(&self, id: &str) -> Result<(), ScheduleError> {
        let _writing = self.writing.lock().await;
        self.settled().await?;
        let state = self.log.schedule(id).ok_or(ScheduleError::NotFound)?;
        self.write_op(id, ScheduleOp::Delete, &[]).await?;
        self.withdraw(&state).await;
        Ok(())
    }

    /// Waits until the log filed everything committed so far: a firing the planner wrote (its lock
    /// released while it is filed) or an op answered in doubt is in the table before it is read.
    async fn settled(&self) -> Result<(), ScheduleError> {
        let log = self.log.clone();
        match tokio::task::spawn_blocking(move || log.next_seq()).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(ScheduleError::NotFiled),
        }
    }

    /// Writes an op record and waits until the table holds it. The planner is told of it (a put,
    /// a resume) whatever the answer: an op not filed in time, or in doubt, may still take effect.
    async fn write_op(
        &self,
        id: &str,
        op: ScheduleOp,
        definition: &[u8],
    ) -> Result<(), ScheduleError> {
        let record = op
            .encode(id, definition)
            .map_err(|e| Rejection::too_large(e.to_string()))?;
        let wake = |below: u64| {
            if matches!(op, ScheduleOp::Put | ScheduleOp::Resume) {
                let _ = self.wake.send((id.to_string(), below));
            }
        };
        let appended = match self.log.append(vec![record]).await {
            Ok(appended) => appended,
            Err(AppendError::Uncertain { seqs_below }) => {
                wake(seqs_below);
                return Err(AppendError::Uncertain { seqs_below }.into());
            }
            Err(other) => return Err(other.into()),
        };
        let seq = appended.first().map_or(0, |a| a.location.seq);
        wake(seq + 1);
        let log = self.log.clone();
        let filed = tokio::task::spawn_blocking(move || log.wait_filed(seq))
            .await
            .unwrap_or(false);
        match filed {
            true => Ok(()),
            false => Err(ScheduleError::NotFiled),
        }
    }

    /// Cancels the firing `before` planned last, if it is still pending (status hygiene: a lane
    /// withdraws it anyway when it comes due).
    async fn withdraw(&self, before: &ScheduleState) {
        let Some(last) = before.last.filter(|last| last.is_current(before)) else {
            return;
        };
        match self.scheduler.cancel(last.message).await {
            Ok(_)
            | Err(CancelError::NotFound)
            | Err(CancelError::AlreadyDelivered)
            | Err(CancelError::AlreadyDead)
            | Err(CancelError::InFlight) => {}
            Err(error) => {
                tracing::warn!(schedule = %before.id, %error, "cancelling a withdrawn firing failed; it is withdrawn when it comes due")
            }
        }
    }

    fn view(&self, state: &ScheduleState) -> ScheduleView {
        let stored = Stored::decode(&state.definition);
        let next_fire_at = match (&stored, state.paused) {
            (Some(stored), false) => {
                planner::next_fire(state, stored, self.clock.now_ms()).map(format_ms)
            }
            _ => None,
        };
        let (spec, created_at_ms) = match stored {
            Some(stored) => (stored.spec, stored.created_at_ms),
            None => (undecodable(), state.since_ms),
        };
        ScheduleView {
            id: state.id.clone(),
            cron: spec.cron,
            every: spec.every,
            tz: spec.tz,
            topic: spec.topic,
            body: spec.body,
            body_base64: spec.body_base64,
            headers: spec.headers,
            key: spec.key,
            sink: spec.sink,
            start_at: spec.start_at,
            end_at: spec.end_at,
            catchup: spec.catchup,
            paused: state.paused,
            next_fire_at,
            last_fire_at: state.last.map(|l| format_ms(l.fire_at_ms)),
            last_message_id: state.last.map(|l| l.message.to_string()),
            fired: state.fired,
            created_at: format_ms(created_at_ms),
        }
    }
}

/// What a definition that does not decode shows (written by a later version): no timing, no firing.
fn undecodable() -> Spec {
    Spec {
        cron: None,
        every: None,
        tz: "UTC".into(),
        topic: String::new(),
        body: None,
        body_base64: None,
        headers: Default::default(),
        key: None,
        sink: String::new(),
        start_at: None,
        end_at: None,
        catchup: calendar::Catchup::None,
    }
}
