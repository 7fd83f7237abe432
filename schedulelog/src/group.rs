//! Group commit for a file (or a set of files) kept behind a lock: callers that arrive while one of them
//! is writing and syncing queue their work, and the next caller to get the lock does all of it in one
//! go: one write per file and one `fdatasync` for the lot, instead of one each behind each other.
//!
//! The WAL has its own writer thread for this (commit.rs); this is for stores written from many threads
//! at once: the dispatch logs (every lane settling its batches) and delayd's broker store (every lane
//! delivering to it).
//!
//! Invariants:
//! - Every piece of work is done exactly once, by the caller that holds the lock when it is taken from
//!   the queue (its "leader"), and its result goes back to the caller that queued it.
//! - A caller's work is queued before it waits for the lock, and a leader takes the whole queue only
//!   once it holds the lock; so a caller that gets the lock and finds no result is still queued, and
//!   leads.
//! - A result is handed over before the leader lets go of the lock, so a caller that gets the lock after
//!   it finds its result.
//! - Nothing is done speculatively: a lone caller leads at once and waits for nobody.

use std::sync::{Arc, Mutex, MutexGuard};

/// Where a leader leaves one caller's result.
type Slot<R> = Arc<Mutex<Option<R>>>;

/// A queue of work `W` with results `R`, done by whoever holds the lock of the state it is done on.
#[derive(Debug)]
pub struct Group<W, R> {
    queue: Mutex<Vec<(W, Slot<R>)>>,
}

impl<W, R> Default for Group<W, R> {
    fn default() -> Self {
        Group {
            queue: Mutex::new(Vec::new()),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl<W, R> Group<W, R> {
    /// Does `work` on the state behind `state`, together with whatever else is queued when the lock is
    /// obtained, and returns its result. `run` gets every queued piece of work in the order it was
    /// queued and must return one result for each, in the same order.
    ///
    /// # Panics
    /// If `run` returns the wrong number of results, or if a leader panicked in `run` while this
    /// caller's work was in its hands (the panic is passed on: the work may be half done).
    pub fn run<T>(
        &self,
        state: &Mutex<T>,
        work: W,
        run: impl FnOnce(&mut T, Vec<W>) -> Vec<R>,
    ) -> R {
        let slot: Slot<R> = Arc::default();
        lock(&self.queue).push((work, slot.clone()));
        let mut state = lock(state);
        if let Some(result) = lock(&slot).take() {
            return result;
        }
        let (works, slots): (Vec<W>, Vec<Slot<R>>) =
            std::mem::take(&mut *lock(&self.queue)).into_iter().unzip();
        assert!(
            slots.iter().any(|s| Arc::ptr_eq(s, &slot)),
            "a group commit's leader panicked with this caller's work in its hands"
        );
        let results = run(&mut state, works);
        assert_eq!(results.len(), slots.len(), "one result per piece of work");
        let mut own = None;
        for (s, result) in slots.iter().zip(results) {
            if Arc::ptr_eq(s, &slot) {
                own = Some(result);
            } else {
                *lock(s) = Some(result);
            }
        }
        drop(state);
        own.expect("checked above")
    }

    /// How many pieces of work wait for a leader now.
    pub fn queued(&self) -> usize {
        lock(&self.queue).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::wait_until;

    #[test]
    fn a_lone_caller_leads_at_once() {
        let group = Group::default();
        let state = Mutex::new(Vec::new());
        let doubled = group.run(&state, 21, |seen: &mut Vec<Vec<i32>>, works: Vec<i32>| {
            seen.push(works.clone());
            works.iter().map(|w| w * 2).collect()
        });
        assert_eq!(doubled, 42);
        assert_eq!(*state.lock().unwrap(), vec![vec![21]]);
    }

    #[test]
    fn callers_queued_behind_the_lock_are_done_in_one_run_and_each_gets_its_own_result() {
        let group = Arc::new(Group::default());
        let state = Arc::new(Mutex::new(Vec::<Vec<u32>>::new()));
        // Held as a leader writing and syncing would hold it, while three callers arrive.
        let held = state.lock().unwrap();
        let callers: Vec<_> = (1..=3u32)
            .map(|n| {
                let (group, state) = (group.clone(), state.clone());
                std::thread::spawn(move || {
                    group.run(&state, n, |runs: &mut Vec<Vec<u32>>, works: Vec<u32>| {
                        runs.push(works.clone());
                        works.iter().map(|w| w * 10).collect()
                    })
                })
            })
            .collect();
        wait_until("three callers queue", || group.queued() == 3);
        drop(held);
        let results: Vec<u32> = callers.into_iter().map(|c| c.join().unwrap()).collect();
        assert_eq!(
            results,
            vec![10, 20, 30],
            "each caller gets the result of its own work"
        );
        let runs = state.lock().unwrap();
        assert_eq!(runs.len(), 1, "one run did all three: {runs:?}");
        let mut done = runs[0].clone();
        done.sort();
        assert_eq!(done, vec![1, 2, 3]);
        assert_eq!(group.queued(), 0);
    }
}
