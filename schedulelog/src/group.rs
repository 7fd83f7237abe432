//! Group commit for a file (or a set of files) kept behind a lock: callers that arrive while one of them
//! is writing and syncing queue their work, and the next caller to get the lock does all of it in one
//! go: one write per file and one `fdatasync` for the lot, instead of one each behind each other.
//!
//! The WAL has its own writer thread for this (commit.rs); this is for stores written from many threads
//! at once: the dispatch logs (every lane settling its batches) and delayd's broker store (every lane
//! delivering to it).
//!
//! Invariants:
//! - A [`Group`] owns the state its work is done on, so work can only be done on that state.
//! - Every piece of work is done exactly once, by the caller that holds the lock when it is taken from
//!   the queue (its "leader"), and its result goes back to the caller that queued it.
//! - A caller's work is queued before it waits for the lock, and a leader takes the whole queue only
//!   once it holds the lock; so a caller that gets the lock and finds no result is still queued, and
//!   leads.
//! - A result is handed over before the leader lets go of the lock, so a caller that gets the lock after
//!   it finds its result.
//! - Nothing is done speculatively: a lone caller leads at once and waits for nobody.
//! - A leader that panics takes the work it holds with it: those callers panic too (the work may be
//!   half done). Work queued after it took the queue is not touched, and the next caller leads it, on
//!   the state as the panic left it (the lock's poisoning is ignored, as everywhere in the engine: each
//!   user keeps its state valid at every step that can fail, and a panic is a bug, not a failure mode).

use std::sync::{Arc, Mutex, MutexGuard};

/// Where a leader leaves one caller's result.
type Slot<R> = Arc<Mutex<Option<R>>>;

/// State `T` behind a lock, and a queue of work `W` on it with results `R`, done by whoever holds the
/// lock.
#[derive(Debug)]
pub struct Group<T, W, R> {
    state: Mutex<T>,
    queue: Mutex<Vec<(W, Slot<R>)>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T, W, R> Group<T, W, R> {
    pub fn new(state: T) -> Self {
        Group {
            state: Mutex::new(state),
            queue: Mutex::new(Vec::new()),
        }
    }

    /// The state, for what is not queued work (reads, maintenance). Queued work waits meanwhile.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        lock(&self.state)
    }

    /// The state if nobody holds it now (a leader holds it through its write and sync); `None` rather
    /// than a wait, for callers that must not block (an async runtime's worker).
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        match self.state.try_lock() {
            Ok(state) => Some(state),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Does `work` on the state, together with whatever else is queued when the lock is obtained, and
    /// returns its result. `run` gets every queued piece of work in the order it was queued and must
    /// return one result for each, in the same order.
    ///
    /// # Panics
    /// If `run` returns the wrong number of results, or if a leader panicked in `run` while this
    /// caller's work was in its hands (the panic is passed on: the work may be half done).
    pub fn run(&self, work: W, run: impl FnOnce(&mut T, Vec<W>) -> Vec<R>) -> R {
        let slot: Slot<R> = Arc::default();
        lock(&self.queue).push((work, slot.clone()));
        let mut state = lock(&self.state);
        if let Some(result) = lock(&slot).take() {
            return result;
        }
        let (works, slots): (Vec<W>, Vec<Slot<R>>) = {
            let mut queue = lock(&self.queue);
            assert!(
                queue.iter().any(|(_, s)| Arc::ptr_eq(s, &slot)),
                "a group commit's leader panicked with this caller's work in its hands"
            );
            std::mem::take(&mut *queue).into_iter().unzip()
        };
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
    use std::sync::mpsc;

    #[test]
    fn a_lone_caller_leads_at_once() {
        let group = Group::new(Vec::new());
        let doubled = group.run(21, |seen: &mut Vec<Vec<i32>>, works: Vec<i32>| {
            seen.push(works.clone());
            works.iter().map(|w| w * 2).collect()
        });
        assert_eq!(doubled, 42);
        assert_eq!(*group.lock(), vec![vec![21]]);
    }

    #[test]
    fn callers_queued_behind_the_lock_are_done_in_one_run_and_each_gets_its_own_result() {
        let group = Arc::new(Group::new(Vec::<Vec<u32>>::new()));
        // Held as a leader writing and syncing would hold it, while three callers arrive.
        let held = group.lock();
        let callers: Vec<_> = (1..=3u32)
            .map(|n| {
                let group = group.clone();
                std::thread::spawn(move || {
                    group.run(n, |runs: &mut Vec<Vec<u32>>, works: Vec<u32>| {
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
        let runs = group.lock();
        assert_eq!(runs.len(), 1, "one run did all three: {runs:?}");
        let mut done = runs[0].clone();
        done.sort();
        assert_eq!(done, vec![1, 2, 3]);
        assert_eq!(group.queued(), 0);
    }

    #[test]
    fn try_lock_answers_none_while_the_state_is_held_instead_of_waiting() {
        let group: Group<u32, (), ()> = Group::new(7);
        let held = group.lock();
        assert!(group.try_lock().is_none());
        drop(held);
        assert_eq!(group.try_lock().as_deref(), Some(&7));
    }

    /// A leader that panics takes down the work it took from the queue (its callers panic too), not
    /// work queued after that: the caller of that leads it next.
    #[test]
    fn work_queued_while_a_leader_panics_is_done_by_the_next_caller() {
        let group = Arc::new(Group::new(()));
        let (entered_tx, entered) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        // Two callers queue behind a held lock; whichever leads blocks in `run`, then panics.
        let held = group.lock();
        let first_two: Vec<_> = (1..=2u32)
            .map(|n| {
                let (group, entered_tx, release_rx) =
                    (group.clone(), entered_tx.clone(), release_rx.clone());
                std::thread::spawn(move || {
                    group.run(n, move |_: &mut (), _: Vec<u32>| -> Vec<u32> {
                        entered_tx.send(()).unwrap();
                        release_rx.lock().unwrap().recv().unwrap();
                        panic!("the leader's write blew up")
                    })
                })
            })
            .collect();
        wait_until("two callers queue", || group.queued() == 2);
        drop(held);
        entered.recv().unwrap();
        let newcomer = {
            let group = group.clone();
            std::thread::spawn(move || {
                group.run(3u32, |_: &mut (), works: Vec<u32>| {
                    works.iter().map(|w| w * 10).collect()
                })
            })
        };
        wait_until("the newcomer queues", || group.queued() == 1);
        release.send(()).unwrap();
        for caller in first_two {
            assert!(
                caller.join().is_err(),
                "the leader and the caller it held panic"
            );
        }
        assert_eq!(newcomer.join().unwrap(), 30, "the newcomer's work was done");
        assert_eq!(group.run(4, |_, works| works), 4, "and the group goes on");
    }

    /// Callers whose work a panicking leader held do not wait forever: they panic too, saying why.
    #[test]
    fn callers_whose_work_a_panicking_leader_held_panic_too() {
        let group = Arc::new(Group::new(()));
        let held = group.lock();
        let callers: Vec<_> = (0..2u32)
            .map(|n| {
                let group = group.clone();
                std::thread::spawn(move || {
                    group.run(n, |_: &mut (), _: Vec<u32>| -> Vec<u32> { panic!("boom") })
                })
            })
            .collect();
        wait_until("both callers queue", || group.queued() == 2);
        drop(held);
        let mut messages: Vec<String> = callers
            .into_iter()
            .map(|c| {
                let panic = c.join().unwrap_err();
                (panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap()
            })
            .collect();
        messages.sort();
        assert_eq!(
            messages[0],
            "a group commit's leader panicked with this caller's work in its hands"
        );
        assert_eq!(messages[1], "boom");
    }
}
