//! The vote file of a cluster member: the Raft vote, which must survive a crash (a member that forgets
//! its vote can vote twice in one term, and two leaders can be elected in it), and the last committed
//! log id, which may lag (Raft finds it again from a quorum). Plain types: this crate knows no Raft
//! library; the layer above converts.
//!
//! ```text
//! vote   FILE_LEN = 8192 bytes: two slots of SLOT_LEN = 4096, at 0 and 4096, each written whole with
//!        one pwrite, never renamed (saves are on Raft's hot path)
//! slot:
//! 0    8   magic            b"DLYDVOTE"
//! 8    2   version          u16 LE: VERSION
//! 10   1   flags            u8: 1 vote present, 2 vote committed, 4 committed log id present
//! 11   5   reserved         zero
//! 16   8   generation       u64 LE, 1 for the first save, one more for each save after it
//! 24   16  vote             term u64 | node_id u64 (zero when absent)
//! 40   24  committed        term u64 | node_id u64 | index u64 of the log id (zero when absent)
//! 64   4   crc              u32 LE, CRC-32C of bytes 0..64
//! 68   ..  zeros up to 4096
//! ```
//!
//! A slot of all zeros is empty: the state before the first save, generation 0. Open takes the slot of
//! the higher generation among the valid and empty ones; a damaged slot next to a valid or empty one is
//! a torn write and is passed over; two damaged slots are corruption. A slot is one page, so a torn
//! write damages only the slot it was writing.
//!
//! # Invariants
//!
//! The *durable slot* holds the newest state known to be on disk: the newest state open found (open
//! syncs the file: what it read may be only in the page cache, left by a process that crashed before its
//! sync), then that of each save whose sync returned.
//! 1. No save writes the durable slot: every save, durable or not, writes the other one (the *scratch
//!    slot*), whole, with a generation higher than any before. A durable save syncs the file and makes
//!    its slot the durable one; a run of non-durable saves rewrites the same scratch slot.
//! 2. A save that changes the vote is durable whatever `durable` says, so every state saved since the
//!    last sync holds the vote of that sync (or of a durable save under way).
//! 3. Open zeroes a damaged slot, synced, before any save: a write torn over the remains of a torn one
//!    could complete the earlier record (their first bytes are alike), outranking what open returned.
//!
//! Why no crash loses a durable vote: by (1) the durable slot was not written since its sync, so a crash
//! finds it whole. By (3) the scratch slot holds zeros, the record open passed over, records written
//! since open, or a write torn over these, which fails its checksum or equals one of them. Zeros and the
//! record passed over lose to the durable slot (a lower generation); a record written since open with a
//! higher generation is a state saved after the last sync. So open returns the last synced state or a
//! later one, and by (2) that holds the synced vote or the one being saved. Plain alternation would not
//! do: a second non-durable save would overwrite the only synced copy of the vote while the other slot
//! may not be on disk yet, and a crash could leave neither.
//! A failed save leaves the durable slot as it was; saving again is sound, since each save rewrites its
//! whole slot and relies on no earlier unsynced write.

use crate::entry::LogId;
use crate::error::{Error, Result};
use crate::header::{create_dir_durably, open_data_file, write_atomically, OpenMode};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The name of the vote file in the directory given to [`VoteFile::open`].
pub const VOTE_FILE_NAME: &str = "vote";
const MAGIC: [u8; 8] = *b"DLYDVOTE";
const VERSION: u16 = 1;
const SLOT_LEN: usize = 4096;
const FILE_LEN: usize = 2 * SLOT_LEN;
const FLAGS_AT: usize = 10;
const GENERATION_AT: usize = 16;
const VOTE_AT: usize = GENERATION_AT + 8;
const COMMITTED_AT: usize = VOTE_AT + 16;
const CRC_AT: usize = COMMITTED_AT + 24;
const RECORD_LEN: usize = CRC_AT + 4;
const HAS_VOTE: u8 = 1;
const VOTE_COMMITTED: u8 = 2;
const HAS_COMMITTED: u8 = 4;

/// A member's vote: for `node_id` in `term`; `committed` once a quorum granted it (the leader's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vote {
    pub term: u64,
    pub node_id: u64,
    pub committed: bool,
}

/// What the vote file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RaftState {
    pub vote: Option<Vote>,
    pub committed: Option<LogId>,
}

/// The open vote file of a member (see the module doc for its layout and rules).
#[derive(Debug)]
pub struct VoteFile {
    file: File,
    path: PathBuf,
    /// The highest generation written or found.
    generation: u64,
    /// The slot of the newest synced state (0 or 1), which no save writes (invariant 1).
    durable_slot: usize,
    /// The vote of the last save that returned, which is on disk (invariant 2).
    vote: Option<Vote>,
}

impl VoteFile {
    /// Opens `dir/vote` (creating `dir` and the file when missing, durably: file fsync and directory
    /// fsync), returning the newest valid state.
    pub fn open(dir: &Path) -> Result<(VoteFile, RaftState)> {
        create_dir_durably(dir)?;
        let path = dir.join(VOTE_FILE_NAME);
        let file = match open_data_file(&path, OpenMode::Existing) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Written whole through a renamed temporary file: a crash cannot leave a short file.
                write_atomically(&path, &[0; FILE_LEN])?;
                open_data_file(&path, OpenMode::Existing).map_err(Error::io(&path))?
            }
            Err(e) => return Err(Error::io(&path)(e)),
        };
        let len = file.metadata().map_err(Error::io(&path))?.len();
        if len != FILE_LEN as u64 {
            let reason = format!("vote file is {len} bytes, not {FILE_LEN}");
            return Err(Error::corrupt(&path, 0, reason));
        }
        let mut bytes = vec![0; FILE_LEN];
        file.read_exact_at(&mut bytes, 0)
            .map_err(Error::io(&path))?;
        let found = newest(&bytes, &path)?;
        if let Some(torn) = found.torn {
            // Invariant 3: a save torn over what is left of this torn write could complete the record
            // it tore, from before the crash, which would outrank the state returned here.
            file.write_all_at(&[0; SLOT_LEN], (torn * SLOT_LEN) as u64)
                .map_err(Error::io(&path))?;
        }
        crate::slow_disk::sync();
        file.sync_data().map_err(Error::sync(&path))?;
        let vote_file = VoteFile {
            file,
            path,
            generation: found.generation,
            durable_slot: found.slot,
            vote: found.state.vote,
        };
        Ok((vote_file, found.state))
    }

    /// Writes `state`; when `durable` is true, or the vote changed, it is on disk (fdatasync) before
    /// this returns. Otherwise a crash may bring back the last durable state or any later one.
    pub fn save(&mut self, state: &RaftState, durable: bool) -> Result<()> {
        let durable = durable || state.vote != self.vote;
        let slot = 1 - self.durable_slot;
        self.generation += 1;
        let bytes = encode(self.generation, state);
        self.file
            .write_all_at(&bytes, (slot * SLOT_LEN) as u64)
            .map_err(Error::io(&self.path))?;
        if durable {
            crate::slow_disk::sync();
            self.file.sync_data().map_err(Error::sync(&self.path))?;
            self.durable_slot = slot;
        }
        self.vote = state.vote;
        Ok(())
    }
}

fn encode(generation: u64, state: &RaftState) -> [u8; SLOT_LEN] {
    let mut out = [0u8; SLOT_LEN];
    out[..8].copy_from_slice(&MAGIC);
    out[8..10].copy_from_slice(&VERSION.to_le_bytes());
    out[GENERATION_AT..VOTE_AT].copy_from_slice(&generation.to_le_bytes());
    let mut put = |at: usize, value: u64| out[at..at + 8].copy_from_slice(&value.to_le_bytes());
    let mut flags = 0;
    if let Some(vote) = state.vote {
        flags |= HAS_VOTE | if vote.committed { VOTE_COMMITTED } else { 0 };
        put(VOTE_AT, vote.term);
        put(VOTE_AT + 8, vote.node_id);
    }
    if let Some(log_id) = state.committed {
        flags |= HAS_COMMITTED;
        put(COMMITTED_AT, log_id.term);
        put(COMMITTED_AT + 8, log_id.node_id);
        put(COMMITTED_AT + 16, log_id.index);
    }
    out[FLAGS_AT] = flags;
    let crc = crc32c::crc32c(&out[..CRC_AT]);
    out[CRC_AT..RECORD_LEN].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Decodes one slot into its generation and state: generation 0 and no state when it is empty.
fn decode(slot: &[u8]) -> Result<(u64, RaftState), &'static str> {
    if slot.iter().all(|&b| b == 0) {
        return Ok((0, RaftState::default()));
    }
    let u64_at = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&slot[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let crc = u32::from_le_bytes([
        slot[CRC_AT],
        slot[CRC_AT + 1],
        slot[CRC_AT + 2],
        slot[CRC_AT + 3],
    ]);
    if crc32c::crc32c(&slot[..CRC_AT]) != crc {
        return Err("checksum mismatch");
    }
    if slot[..8] != MAGIC || u16::from_le_bytes([slot[8], slot[9]]) != VERSION {
        return Err("not a vote slot of this format version");
    }
    if slot[RECORD_LEN..].iter().any(|&b| b != 0) {
        return Err("bytes after the record are not zero");
    }
    let flags = slot[FLAGS_AT];
    if flags & !(HAS_VOTE | VOTE_COMMITTED | HAS_COMMITTED) != 0 || u64_at(GENERATION_AT) == 0 {
        return Err("unknown flags or generation 0");
    }
    let vote = (flags & HAS_VOTE != 0).then(|| Vote {
        term: u64_at(VOTE_AT),
        node_id: u64_at(VOTE_AT + 8),
        committed: flags & VOTE_COMMITTED != 0,
    });
    let committed = (flags & HAS_COMMITTED != 0).then(|| LogId {
        term: u64_at(COMMITTED_AT),
        node_id: u64_at(COMMITTED_AT + 8),
        index: u64_at(COMMITTED_AT + 16),
    });
    Ok((u64_at(GENERATION_AT), RaftState { vote, committed }))
}

/// What [`newest`] found in a vote file.
#[derive(Debug)]
struct Found {
    /// The slot holding the newest state: 1 when both are empty, so that the first save goes to 0.
    slot: usize,
    generation: u64,
    state: RaftState,
    /// The other slot, when it is damaged (a torn write).
    torn: Option<usize>,
}

/// The newest state of the vote file `bytes` read from `path`.
fn newest(bytes: &[u8], path: &Path) -> Result<Found> {
    let slots = [0, 1].map(|slot| decode(&bytes[slot * SLOT_LEN..(slot + 1) * SLOT_LEN]));
    let found = |slot: usize, (generation, state): (u64, RaftState), torn: bool| Found {
        slot,
        generation,
        state,
        torn: torn.then_some(1 - slot),
    };
    match slots {
        [Err(first), Err(second)] => {
            let reason = format!("both slots are damaged: at 0, {first}; at {SLOT_LEN}, {second}");
            Err(Error::corrupt(path, 0, reason))
        }
        [Ok((g0, _)), Ok((g1, _))] if g0 == g1 && g0 > 0 => {
            let reason = format!("both slots hold generation {g0}");
            Err(Error::corrupt(path, 0, reason))
        }
        [Ok(first), Ok(second)] if first.0 > second.0 => Ok(found(0, first, false)),
        [Ok(first), Err(_)] => Ok(found(0, first, true)),
        [other, Ok(second)] => Ok(found(1, second, other.is_err())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::fs;

    fn state(term: u64, index: Option<u64>) -> RaftState {
        RaftState {
            vote: (term > 0).then_some(Vote {
                term,
                node_id: term % 3 + 1,
                committed: term == 2,
            }),
            committed: index.map(|index| LogId {
                term: 1 + index / 10,
                node_id: 2,
                index,
            }),
        }
    }

    fn slot_of(bytes: &[u8], slot: usize) -> &[u8] {
        &bytes[slot * SLOT_LEN..(slot + 1) * SLOT_LEN]
    }

    /// The generation each slot of the file at `path` holds.
    fn generations(path: &Path) -> [u64; 2] {
        let bytes = fs::read(path).unwrap();
        [0, 1].map(|slot| decode(slot_of(&bytes, slot)).unwrap().0)
    }

    #[test]
    fn saves_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let raft = dir.path().join("raft");
        let (mut file, empty) = VoteFile::open(&raft).unwrap();
        assert_eq!(empty, RaftState::default());
        file.save(&state(2, None), true).unwrap();
        file.save(&state(2, Some(7)), false).unwrap();
        drop(file);
        let (_, reopened) = VoteFile::open(&raft).unwrap();
        assert_eq!(reopened, state(2, Some(7)));
        assert_eq!(
            reopened.vote.map(|v| (v.term, v.committed)),
            Some((2, true))
        );
    }

    /// Durable saves alternate slots; non-durable ones rewrite the slot beside the durable one; a
    /// changed vote is saved durably even when asked not to be (the next save moves to the other slot).
    #[test]
    fn saves_never_write_the_slot_of_the_last_durable_state() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(VOTE_FILE_NAME);
        let (mut file, _) = VoteFile::open(dir.path()).unwrap();
        let mut expect = |s: RaftState, durable: bool, gens: [u64; 2]| {
            file.save(&s, durable).unwrap();
            assert_eq!(generations(&path), gens, "{s:?} durable {durable}");
        };
        expect(state(1, None), true, [1, 0]);
        expect(state(1, None), true, [1, 2]);
        expect(state(1, Some(1)), false, [3, 2]);
        expect(state(1, Some(2)), false, [4, 2]);
        expect(state(1, Some(3)), true, [5, 2]);
        expect(state(2, Some(3)), false, [5, 6]);
        expect(state(2, Some(4)), false, [7, 6]);
    }

    #[test]
    fn a_damaged_slot_falls_back_to_the_other_and_is_written_next() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(VOTE_FILE_NAME);
        let (mut file, _) = VoteFile::open(dir.path()).unwrap();
        file.save(&state(1, Some(1)), true).unwrap();
        file.save(&state(2, Some(2)), true).unwrap();
        drop(file);
        let good = fs::read(&path).unwrap();
        for at in (SLOT_LEN..SLOT_LEN + RECORD_LEN).chain([FILE_LEN - 1]) {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            fs::write(&path, &bad).unwrap();
            let (mut file, recovered) = VoteFile::open(dir.path()).unwrap();
            assert_eq!(recovered, state(1, Some(1)), "flip at {at}");
            assert_eq!(generations(&path), [1, 0], "flip at {at}: zeroed at open");
            file.save(&state(3, None), false).unwrap();
            assert_eq!(generations(&path), [1, 2], "flip at {at}");
        }
    }

    #[test]
    fn two_damaged_slots_or_a_wrong_size_are_corruption_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(VOTE_FILE_NAME);
        let (mut file, _) = VoteFile::open(dir.path()).unwrap();
        file.save(&state(1, None), true).unwrap();
        file.save(&state(1, Some(1)), true).unwrap();
        drop(file);
        let mut bytes = fs::read(&path).unwrap();
        bytes[VOTE_AT] ^= 1;
        bytes[SLOT_LEN + CRC_AT] ^= 1;
        let wrong_size = [
            bytes[..SLOT_LEN].to_vec(),
            [bytes.clone(), vec![0]].concat(),
        ];
        for (bad, reason) in [(bytes, "both slots are damaged")]
            .into_iter()
            .chain(wrong_size.map(|b| (b, "bytes, not 8192")))
        {
            fs::write(&path, bad).unwrap();
            let error = VoteFile::open(dir.path()).unwrap_err();
            let Error::Corrupt {
                path: p, reason: r, ..
            } = &error
            else {
                panic!("{error}")
            };
            assert!(*p == path && r.contains(reason), "{error}");
            assert!(
                error.to_string().contains(&*path.to_string_lossy()),
                "{error}"
            );
        }
    }

    #[test]
    fn a_zeroed_file_or_a_torn_first_save_is_the_empty_state() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(VOTE_FILE_NAME);
        fs::write(&path, [0; FILE_LEN]).unwrap();
        let (mut file, empty) = VoteFile::open(dir.path()).unwrap();
        assert_eq!(empty, RaftState::default());
        file.save(&state(1, None), true).unwrap();
        let mut torn = fs::read(&path).unwrap();
        torn[CRC_AT] ^= 1;
        fs::write(&path, torn).unwrap();
        assert_eq!(VoteFile::open(dir.path()).unwrap().1, empty);
    }

    /// What a crash may leave of the file: of each slot, its synced bytes, any write to it since, or
    /// such a write torn over what it replaced.
    struct Disk {
        synced: Vec<u8>,
        since: [Vec<Vec<u8>>; 2],
    }

    impl Disk {
        fn images(&self) -> Vec<Vec<u8>> {
            let [first, second] = [0, 1].map(|slot| {
                let mut before = slot_of(&self.synced, slot).to_vec();
                let mut left = vec![before.clone()];
                for written in &self.since[slot] {
                    for cut in [GENERATION_AT, COMMITTED_AT] {
                        left.push([&written[..cut], &before[cut..]].concat());
                    }
                    left.push(written.clone());
                    before = written.clone();
                }
                left
            });
            let both = first
                .iter()
                .flat_map(|a| second.iter().map(move |b| [&a[..], b]));
            both.map(|slots| slots.concat()).collect()
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Save {
            term: u64,
            index: Option<u64>,
            durable: bool,
        },
        Crash {
            image: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let save = (0..3u64, proptest::option::of(0..50u64), any::<bool>());
        prop_oneof![
            4 => save.prop_map(|(term, index, durable)| Op::Save { term, index, durable }),
            1 => any::<usize>().prop_map(|image| Op::Crash { image }),
        ]
    }

    proptest! {
        // Each case makes real files and syncs: a few dozen cases of up to 40 saves and crashes.
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// After every save, every file a crash during it may leave opens to a state saved since the
        /// last sync (holding its vote) or to the state being saved; crashes reopen one of them.
        #[test]
        fn no_crash_loses_a_durable_vote(ops in proptest::collection::vec(op(), 1..40)) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join(VOTE_FILE_NAME);
            let (mut file, opened) = VoteFile::open(dir.path()).unwrap();
            let mut disk = Disk { synced: fs::read(&path).unwrap(), since: Default::default() };
            // The states saved since the last sync, the synced one first.
            let mut since_sync = vec![opened];
            for op in ops {
                match op {
                    Op::Save { term, index, durable } => {
                        let saved = state(term, index);
                        let before = fs::read(&path).unwrap();
                        file.save(&saved, durable).unwrap();
                        let after = fs::read(&path).unwrap();
                        let slot = usize::from(slot_of(&before, 0) == slot_of(&after, 0));
                        disk.since[slot].push(slot_of(&after, slot).to_vec());
                        let synced_vote = since_sync[0].vote;
                        since_sync.push(saved);
                        for image in disk.images() {
                            let recovered = newest(&image, &path).unwrap().state;
                            prop_assert!(since_sync.contains(&recovered), "{recovered:?}");
                            prop_assert!(recovered.vote == synced_vote || recovered.vote == saved.vote);
                        }
                        if durable || saved.vote != since_sync[since_sync.len() - 2].vote {
                            disk = Disk { synced: after, since: Default::default() };
                            since_sync = vec![saved];
                        }
                    }
                    Op::Crash { image } => {
                        let images = disk.images();
                        let image = &images[image % images.len()];
                        drop(file);
                        fs::write(&path, image).unwrap();
                        let (reopened, recovered) = VoteFile::open(dir.path()).unwrap();
                        prop_assert!(since_sync.contains(&recovered), "{recovered:?}");
                        file = reopened;
                        // Open synced what it found, a torn slot zeroed.
                        disk = Disk { synced: fs::read(&path).unwrap(), since: Default::default() };
                        since_sync = vec![recovered];
                    }
                }
            }
        }
    }
}
