//! The schedule table as readers see it (schedules.rs): each schedule's definition and progress, as of
//! the records filed so far.

use super::ScheduleLog;
use crate::schedules::{ScheduleState, ScheduleTable};
use std::sync::MutexGuard;

impl ScheduleLog {
    fn schedule_table(&self) -> MutexGuard<'_, ScheduleTable> {
        self.shared
            .schedules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The schedule `id`, as of the records filed so far.
    pub fn schedule(&self, id: &str) -> Option<ScheduleState> {
        self.schedule_table().get(id).cloned()
    }

    /// Up to `limit` schedules whose ids sort after `after`, by id.
    pub fn schedules(&self, after: Option<&str>, limit: usize) -> Vec<ScheduleState> {
        self.schedule_table().page(after, limit)
    }

    /// How many schedules there are.
    pub fn schedule_count(&self) -> usize {
        self.schedule_table().len()
    }

    /// Waits until the record `seq` (acknowledged) is filed, so that the table holds a schedule op or
    /// a firing once it returns true; at most 10 s (false: not yet, or never committed).
    pub fn wait_filed(&self, seq: u64) -> bool {
        self.wait_replayed(seq)
    }
}
