//! The second level of the timing wheel: a hashed wheel of `tick_ms` slots over the loaded window.
//!
//! Time is a number passed in, never read here, so the wheel is tested exhaustively without a clock.
//!
//! Invariants:
//! - Every slot before `cursor` (in ticks) has been moved to `ready`; slot `t % slots.len()` holds only
//!   entries of tick `t` in `[cursor, cursor + slots.len())`. Entries further ahead wait in `overflow`.
//! - `occupied` has bit `i` set exactly when slot `i` is non-empty, so advancing over idle time jumps from
//!   occupied slot to occupied slot instead of stepping through empty ones (as tokio's wheel does).
//! - `ready` is a min-heap by `deliver_at_ms`: entries leave it at their exact millisecond, never before.
//! - An [`Entry`] is 24 bytes and holds no message data: bodies stay on disk until the entry fires.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A due message, as the wheel keeps it: where to read it and when it is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Entry {
    /// First field, so that the derived order is by due time.
    pub deliver_at_ms: i64,
    /// Bits 16..64: offset of the record in its segment; bits 0..16: the sink tag.
    offset_and_tag: u64,
    /// The bucket's start minute.
    pub bucket: u32,
    pub frame_len: u32,
}

impl Entry {
    pub fn new(
        deliver_at_ms: i64,
        bucket: u32,
        offset: u64,
        frame_len: u32,
        sink_tag: u16,
    ) -> Entry {
        Entry {
            deliver_at_ms,
            offset_and_tag: offset << 16 | u64::from(sink_tag),
            bucket,
            frame_len,
        }
    }

    /// The same entry, due at `deliver_at_ms` instead (for an entry handed back to the wheel).
    pub fn due_at(self, deliver_at_ms: i64) -> Entry {
        Entry {
            deliver_at_ms,
            ..self
        }
    }

    pub fn offset(&self) -> u64 {
        self.offset_and_tag >> 16
    }

    pub fn sink_tag(&self) -> u16 {
        (self.offset_and_tag & 0xffff) as u16
    }
}

const _: () = assert!(size_of::<Entry>() == 24);

#[derive(Debug)]
pub struct Wheel {
    tick_ms: i64,
    slots: Vec<Vec<Entry>>,
    occupied: Vec<u64>,
    /// The first tick whose slot has not been moved to `ready`.
    cursor: i64,
    ready: BinaryHeap<Reverse<Entry>>,
    overflow: Vec<Entry>,
    len: usize,
}

impl Wheel {
    /// A wheel of `tick_ms` slots spanning at least `span_ms`, starting at time `now_ms`.
    pub fn new(tick_ms: i64, span_ms: i64, now_ms: i64) -> Wheel {
        let tick_ms = tick_ms.max(1);
        let count = usize::try_from(span_ms.max(tick_ms).div_euclid(tick_ms) + 1)
            .unwrap_or(1)
            .next_multiple_of(64);
        Wheel {
            tick_ms,
            slots: (0..count).map(|_| Vec::new()).collect(),
            occupied: vec![0; count / 64],
            cursor: now_ms.div_euclid(tick_ms),
            ready: BinaryHeap::new(),
            overflow: Vec::new(),
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn slot_count(&self) -> i64 {
        self.slots.len() as i64
    }

    /// Inserts one entry in O(1).
    pub fn insert(&mut self, entry: Entry) {
        self.len += 1;
        let tick = entry.deliver_at_ms.div_euclid(self.tick_ms);
        if tick < self.cursor {
            self.ready.push(Reverse(entry));
        } else if tick >= self.cursor + self.slot_count() {
            self.overflow.push(entry);
        } else {
            self.push_slot(tick, entry);
        }
    }

    fn push_slot(&mut self, tick: i64, entry: Entry) {
        let index = tick.rem_euclid(self.slot_count()) as usize;
        self.slots[index].push(entry);
        self.occupied[index / 64] |= 1 << (index % 64);
    }

    /// Inserts many entries, reserving each slot's room exactly once, so that a bulk load costs 24 bytes
    /// per entry rather than whatever a doubling `Vec` leaves spare.
    pub fn insert_all(&mut self, entries: &[Entry]) {
        let count = self.slot_count();
        let mut per_slot = vec![0u32; self.slots.len()];
        for entry in entries {
            let tick = entry.deliver_at_ms.div_euclid(self.tick_ms);
            if tick >= self.cursor && tick < self.cursor + count {
                per_slot[tick.rem_euclid(count) as usize] += 1;
            }
        }
        for (slot, extra) in self.slots.iter_mut().zip(per_slot) {
            slot.reserve_exact(extra as usize);
        }
        for entry in entries {
            self.insert(*entry);
        }
    }

    /// Moves every slot whose tick has started by `now_ms` into the ready heap, jumping over empty slots.
    pub fn advance(&mut self, now_ms: i64) {
        let now_tick = now_ms.div_euclid(self.tick_ms);
        while let Some(tick) = self.next_occupied_tick() {
            if tick > now_tick {
                break;
            }
            let index = tick.rem_euclid(self.slot_count()) as usize;
            let entries = std::mem::take(&mut self.slots[index]);
            self.occupied[index / 64] &= !(1 << (index % 64));
            self.ready.extend(entries.into_iter().map(Reverse));
            self.cursor = tick + 1;
        }
        if now_tick >= self.cursor {
            self.cursor = now_tick + 1;
        }
        if !self.overflow.is_empty() {
            // The window moved: entries that now fit go to their slots (or straight to ready).
            let limit = self.cursor + self.slot_count();
            let (fit, later): (Vec<Entry>, Vec<Entry>) = std::mem::take(&mut self.overflow)
                .into_iter()
                .partition(|e| e.deliver_at_ms.div_euclid(self.tick_ms) < limit);
            self.overflow = later;
            self.len -= fit.len();
            for entry in fit {
                self.insert(entry);
            }
        }
    }

    /// The tick of the first non-empty slot at or after the cursor.
    fn next_occupied_tick(&self) -> Option<i64> {
        let count = self.slots.len();
        let start = self.cursor.rem_euclid(count as i64) as usize;
        let words = self.occupied.len();
        // Walk the bitmap from `start`, wrapping once: words+1 steps cover the partial first word twice.
        for step in 0..=words {
            let word_index = (start / 64 + step) % words;
            let mut word = self.occupied[word_index];
            if step == 0 {
                word &= u64::MAX << (start % 64);
            } else if step == words {
                word &= !(u64::MAX << (start % 64));
            }
            if word != 0 {
                let index = word_index * 64 + word.trailing_zeros() as usize;
                let distance = (index + count - start) % count;
                return Some(self.cursor + distance as i64);
            }
        }
        None
    }

    /// Takes the earliest entry if it is due at `now_ms`.
    pub fn pop_due(&mut self, now_ms: i64) -> Option<Entry> {
        match self.ready.peek() {
            Some(Reverse(entry)) if entry.deliver_at_ms <= now_ms => {
                self.len -= 1;
                self.ready.pop().map(|Reverse(e)| e)
            }
            _ => None,
        }
    }

    /// When something next needs attention: the earliest ready entry, or the start of the next occupied
    /// slot, or of the window's next turn when only far entries wait.
    pub fn next_deadline(&self) -> Option<i64> {
        let ready = self.ready.peek().map(|Reverse(e)| e.deliver_at_ms);
        let slot = self.next_occupied_tick().map(|t| t * self.tick_ms);
        // An overflowing entry fits once the cursor passes its tick minus the window.
        let overflow = self
            .overflow
            .iter()
            .map(|e| e.deliver_at_ms.div_euclid(self.tick_ms) - self.slot_count() + 1)
            .min()
            .map(|tick| tick.max(self.cursor) * self.tick_ms);
        [ready, slot, overflow].into_iter().flatten().min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(deliver_at_ms: i64, id: u64) -> Entry {
        Entry::new(deliver_at_ms, 7, id, 100, 3)
    }

    fn drain(wheel: &mut Wheel, until_ms: i64) -> Vec<(i64, i64)> {
        // Step from deadline to deadline as the wheel thread does; record (release time, due time).
        let mut out = Vec::new();
        let mut now = i64::MIN;
        while let Some(deadline) = wheel.next_deadline() {
            if deadline > until_ms {
                break;
            }
            now = now.max(deadline);
            wheel.advance(now);
            while let Some(e) = wheel.pop_due(now) {
                out.push((now, e.deliver_at_ms));
            }
        }
        out
    }

    #[test]
    fn entries_pack_into_24_bytes() {
        let e = Entry::new(-5, 29_935_260, (1 << 48) - 1, 16 << 20, 0xbeef);
        assert_eq!(e.offset(), (1 << 48) - 1);
        assert_eq!(e.sink_tag(), 0xbeef);
        assert_eq!(size_of::<Entry>(), 24);
    }

    #[test]
    fn releases_at_the_exact_millisecond_in_order() {
        let mut wheel = Wheel::new(500, 3_600_000, 1_000_000);
        for (i, at) in [
            1_000_999, 1_000_001, 1_000_500, 1_000_499, 1_000_000, 1_007_250,
        ]
        .iter()
        .enumerate()
        {
            wheel.insert(entry(*at, i as u64));
        }
        let released = drain(&mut wheel, i64::MAX);
        assert_eq!(
            released,
            vec![
                (1_000_000, 1_000_000),
                (1_000_001, 1_000_001),
                (1_000_499, 1_000_499),
                (1_000_500, 1_000_500),
                (1_000_999, 1_000_999),
                (1_007_250, 1_007_250)
            ]
        );
        assert!(wheel.is_empty());
        assert_eq!(wheel.next_deadline(), None);
    }

    #[test]
    fn nothing_is_released_early() {
        let mut wheel = Wheel::new(500, 10_000, 0);
        wheel.insert(entry(1_234, 1));
        wheel.advance(1_233);
        assert_eq!(
            wheel.pop_due(1_233),
            None,
            "its slot started at 1000 but it is due at 1234"
        );
        assert_eq!(wheel.next_deadline(), Some(1_234));
        assert!(wheel.pop_due(1_234).is_some());
    }

    #[test]
    fn overdue_entries_are_ready_at_once_oldest_first() {
        let mut wheel = Wheel::new(500, 10_000, 50_000);
        wheel.insert(entry(40_000, 1));
        wheel.insert(entry(10, 2));
        wheel.insert(entry(49_999, 3));
        assert_eq!(wheel.next_deadline(), Some(10));
        let order: Vec<_> = std::iter::from_fn(|| wheel.pop_due(50_000))
            .map(|e| e.deliver_at_ms)
            .collect();
        assert_eq!(order, vec![10, 40_000, 49_999]);
    }

    #[test]
    fn idle_time_is_jumped_not_stepped() {
        let mut wheel = Wheel::new(1, 1 << 20, 0);
        wheel.insert(entry(1_000_000, 1));
        assert_eq!(wheel.next_deadline(), Some(1_000_000));
        wheel.advance(999_999);
        assert_eq!(wheel.pop_due(999_999), None);
        wheel.advance(1_000_000);
        assert!(wheel.pop_due(1_000_000).is_some());
    }

    #[test]
    fn entries_beyond_the_window_wait_in_overflow() {
        let mut wheel = Wheel::new(500, 5_000, 0);
        wheel.insert(entry(60_000, 1)); // 12 windows ahead
        wheel.insert(entry(2_000, 2));
        assert_eq!(
            drain(&mut wheel, i64::MAX),
            vec![(2_000, 2_000), (60_000, 60_000)]
        );
    }

    #[test]
    fn bulk_insert_reserves_exactly() {
        let mut wheel = Wheel::new(500, 3_600_000, 0);
        let entries: Vec<_> = (0..10_000).map(|i| entry(i * 360, i as u64)).collect();
        wheel.insert_all(&entries);
        assert_eq!(wheel.len(), 10_000);
        let spare: usize = wheel.slots.iter().map(|s| s.capacity() - s.len()).sum();
        assert_eq!(spare, 0);
        assert_eq!(drain(&mut wheel, i64::MAX).len(), 10_000);
    }

    proptest! {
        #[test]
        fn wheel_agrees_with_a_sorted_list(
            start in -10_000i64..10_000,
            tick in 1i64..700,
            span in 1i64..20_000,
            dues in proptest::collection::vec(-30_000i64..90_000, 0..300),
            steps in proptest::collection::vec(0i64..3_000, 1..60),
        ) {
            let mut wheel = Wheel::new(tick, span, start);
            for (i, due) in dues.iter().enumerate() {
                wheel.insert(entry(*due, i as u64));
            }
            let mut now = start;
            let mut released = Vec::new();
            for step in steps {
                now += step;
                wheel.advance(now);
                while let Some(e) = wheel.pop_due(now) {
                    prop_assert!(e.deliver_at_ms <= now, "early: {} at {}", e.deliver_at_ms, now);
                    released.push(e.deliver_at_ms);
                }
                // Nothing due may be left behind.
                prop_assert!(wheel.next_deadline().is_none_or(|d| d > now));
            }
            let mut expected: Vec<i64> = dues.iter().copied().filter(|d| *d <= now).collect();
            expected.sort();
            prop_assert_eq!(&released, &expected);
            prop_assert_eq!(wheel.len(), dues.len() - released.len());
        }
    }
}
