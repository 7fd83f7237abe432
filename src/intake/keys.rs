//! The idempotency index: which pending message holds each idempotency key, a key being a message's
//! sink, topic (an MQ sink's target) and key. HTTP messages sent with `dedup` and every keyed request
//! of an MQ source have one.
//!
//! It holds 16 bytes per key however long the key is, and nothing else per key: a 32-bit hash of the
//! (sink, topic, key) and the location of the message's first attempt (its id). The key itself stays
//! on disk: a hash names candidates, and the caller reads each candidate's record to learn whether it
//! is the key's message and whether that is still pending (intake/mod.rs). Two keys with one hash are
//! two entries; a stale entry (its message finished, its removal not yet reported) is found stale by
//! that read and removed.
//!
//! ```text
//! slot (16 bytes): hash u32 | bucket start minute u32 | seq u64
//! bulk:   Vec<Slot> sorted by hash, allocated to its exact length; a removed slot's minute is
//!         u32::MAX (a tombstone) until the next merge
//! recent: BTreeSet<Slot> of the slots added since the last merge
//! ```
//!
//! A lookup is a binary search of the bulk plus a range of `recent`. Once `recent` holds a 64th of the
//! bulk (at least 4,096 slots), or tombstones make up a 64th of it, both are merged into a new bulk of
//! the live slots: the cost of a merge, a copy of the bulk, is spread over that many changes, and the
//! memory beyond 16 bytes a key stays within a few percent.
//!
//! The hash is keyed at random per index (`RandomState`), so a client cannot choose keys that collide
//! and make every lookup read many records.

use schedulelog::{Bucket, Location, MessageId};
use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};

/// A (sink, topic, key)'s hash, as the index files it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash(u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Slot {
    hash: u32,
    minute: u32,
    seq: u64,
}

const _: () = assert!(size_of::<Slot>() == 16);

/// The minute of a removed bulk slot: no bucket starts in the year 10136.
const TOMBSTONE: u32 = u32::MAX;

/// The fewest recent slots or tombstones that make a merge due (with a smaller bulk).
const MERGE_AT_LEAST: usize = 4096;

impl Slot {
    fn new(hash: KeyHash, id: MessageId) -> Slot {
        Slot {
            hash: hash.0,
            minute: id.first.bucket.start_minute(),
            seq: id.first.seq,
        }
    }

    /// The id of the message this slot names. One index serves one shard (0 on a single node).
    fn id(&self) -> MessageId {
        MessageId::new(Location {
            bucket: Bucket::from_start_minute(self.minute),
            seq: self.seq,
        })
    }
}

/// Idempotency keys of pending messages → the messages' ids (see the module doc).
#[derive(Debug)]
pub struct KeyIndex {
    hasher: RandomState,
    bulk: Vec<Slot>,
    tombstones: usize,
    recent: BTreeSet<Slot>,
    #[cfg(test)]
    collide: bool,
}

impl Default for KeyIndex {
    fn default() -> KeyIndex {
        KeyIndex::new()
    }
}

impl KeyIndex {
    pub fn new() -> KeyIndex {
        KeyIndex {
            hasher: RandomState::new(),
            bulk: Vec::new(),
            tombstones: 0,
            recent: BTreeSet::new(),
            #[cfg(test)]
            collide: false,
        }
    }

    /// An index that files every key under one hash: every lookup meets a collision.
    #[cfg(test)]
    pub fn colliding() -> KeyIndex {
        KeyIndex {
            collide: true,
            ..KeyIndex::new()
        }
    }

    /// The hash a key is filed under.
    pub fn hash(&self, sink: &str, topic: &str, key: &str) -> KeyHash {
        #[cfg(test)]
        if self.collide {
            return KeyHash(7);
        }
        // (A `str` hashes with a terminator, so ("ab", "c") and ("a", "bc") differ.)
        let full = self.hasher.hash_one((sink, topic, key));
        KeyHash((full >> 32) as u32)
    }

    /// The ids filed under `hash`: the key's pending message among them, if it has one.
    pub fn candidates(&self, hash: KeyHash) -> Vec<MessageId> {
        let from = self.bulk.partition_point(|s| s.hash < hash.0);
        let bulk = self.bulk[from..]
            .iter()
            .take_while(|s| s.hash == hash.0)
            .filter(|s| s.minute != TOMBSTONE);
        let recent = self.recent.range(
            Slot {
                hash: hash.0,
                minute: 0,
                seq: 0,
            }..=Slot {
                hash: hash.0,
                minute: u32::MAX,
                seq: u64::MAX,
            },
        );
        bulk.chain(recent).map(Slot::id).collect()
    }

    /// Files a message under its key's hash.
    pub fn insert(&mut self, hash: KeyHash, id: MessageId) {
        self.recent.insert(Slot::new(hash, id));
        if self.recent.len() >= self.merge_threshold() {
            self.merge();
        }
    }

    /// Removes the entry of message `id` under `hash`; whether there was one.
    pub fn remove(&mut self, hash: KeyHash, id: MessageId) -> bool {
        let slot = Slot::new(hash, id);
        if self.recent.remove(&slot) {
            return true;
        }
        let from = self.bulk.partition_point(|s| s.hash < hash.0);
        let found = self.bulk[from..]
            .iter_mut()
            .take_while(|s| s.hash == hash.0)
            .find(|s| **s == slot);
        let Some(found) = found else {
            return false;
        };
        found.minute = TOMBSTONE;
        self.tombstones += 1;
        if self.tombstones >= self.merge_threshold() {
            self.merge();
        }
        true
    }

    /// Entries filed (live ones).
    pub fn len(&self) -> usize {
        self.bulk.len() - self.tombstones + self.recent.len()
    }

    /// Bytes the index holds on the heap, about (a `BTreeSet` slot counted at 24 bytes).
    pub fn heap_bytes(&self) -> usize {
        self.bulk.capacity() * size_of::<Slot>() + self.recent.len() * 24
    }

    fn merge_threshold(&self) -> usize {
        (self.bulk.len() / 64).max(MERGE_AT_LEAST)
    }

    /// Merges `recent` into a new bulk of the live slots, allocated to its exact length.
    fn merge(&mut self) {
        let mut bulk = Vec::with_capacity(self.len());
        let mut old = (self.bulk.iter().copied())
            .filter(|s| s.minute != TOMBSTONE)
            .peekable();
        let mut new = std::mem::take(&mut self.recent).into_iter().peekable();
        loop {
            let next = match (old.peek(), new.peek()) {
                (Some(a), Some(b)) if a <= b => old.next(),
                (Some(_), Some(_)) => new.next(),
                (Some(_), None) => old.next(),
                (None, Some(_)) => new.next(),
                (None, None) => break,
            };
            bulk.extend(next);
        }
        self.bulk = bulk;
        self.tombstones = 0;
    }
}

/// Builds an index from the keys of the pending messages, all at once: sorted and sized exactly.
#[derive(Debug, Default)]
pub struct KeyIndexBuilder {
    index: KeyIndex,
}

impl KeyIndexBuilder {
    pub fn hash(&self, sink: &str, topic: &str, key: &str) -> KeyHash {
        self.index.hash(sink, topic, key)
    }

    pub fn add(&mut self, hash: KeyHash, id: MessageId) {
        self.index.bulk.push(Slot::new(hash, id));
    }

    pub fn build(mut self) -> KeyIndex {
        self.index.bulk.sort_unstable();
        self.index.bulk.dedup();
        self.index.bulk.shrink_to_fit();
        self.index
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn id(minute: u32, seq: u64) -> MessageId {
        MessageId::new(Location {
            bucket: Bucket::from_start_minute(minute),
            seq,
        })
    }

    #[test]
    fn a_key_names_its_message_and_another_key_does_not() {
        let mut index = KeyIndex::new();
        let a = index.hash("out", "orders", "42");
        let b = index.hash("broker", "orders", "42");
        let c = index.hash("out", "order", "s42");
        assert_ne!(a, b, "the sink is part of the key");
        assert_ne!(a, c, "the parts do not run into each other");
        index.insert(a, id(60, 1));
        assert_eq!(index.candidates(a), [id(60, 1)]);
        assert!(index.candidates(b).is_empty());
        assert!(!index.remove(a, id(60, 2)), "only the message's own entry");
        assert!(index.remove(a, id(60, 1)));
        assert_eq!(index.len(), 0);
    }

    /// Random inserts and removals (some of entries that are not there, many under one hash, which is
    /// what colliding keys look like) agree with a plain map, across many merges.
    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32, u64),
        Remove(u32, u64),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            3 => (0u32..64, 0u64..2000).prop_map(|(h, s)| Op::Insert(h, s)),
            2 => (0u32..64, 0u64..2000).prop_map(|(h, s)| Op::Remove(h, s)),
        ];
        proptest::collection::vec(op, 0..12_000)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        #[test]
        fn agrees_with_a_map(ops in ops(), built in 0usize..3000) {
            let mut builder = KeyIndexBuilder::default();
            let mut model: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
            for i in 0..built as u64 {
                let hash = (i % 61) as u32;
                builder.add(KeyHash(hash), id(60, 10_000 + i));
                model.entry(hash).or_default().insert(10_000 + i);
            }
            let mut index = builder.build();
            for op in ops {
                match op {
                    Op::Insert(h, s) => {
                        if model.entry(h).or_default().insert(s) {
                            index.insert(KeyHash(h), id(60, s));
                        }
                    }
                    Op::Remove(h, s) => {
                        let there = model.get_mut(&h).is_some_and(|set| set.remove(&s));
                        prop_assert_eq!(index.remove(KeyHash(h), id(60, s)), there);
                    }
                }
            }
            for h in 0..64 {
                let mut got: Vec<u64> = index.candidates(KeyHash(h)).iter().map(|i| i.first.seq).collect();
                got.sort();
                let want: Vec<u64> = model.get(&h).map(|s| s.iter().copied().collect()).unwrap_or_default();
                prop_assert_eq!(got, want);
            }
            prop_assert_eq!(index.len(), model.values().map(BTreeSet::len).sum::<usize>());
        }
    }

    #[test]
    fn a_built_index_takes_sixteen_bytes_a_key() {
        let mut builder = KeyIndexBuilder::default();
        for seq in 0..100_000u64 {
            let hash = builder.hash("out", "orders", &seq.to_string());
            builder.add(hash, id(29_935_260, seq));
        }
        let index = builder.build();
        assert_eq!(index.len(), 100_000);
        assert_eq!(index.heap_bytes(), 100_000 * 16);
    }
}
