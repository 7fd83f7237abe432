//! A replicated data dir: its WAL is the Raft log (entry.rs, log/entries.rs). Entries in, read back, cut
//! off, applied, recovered after a crash; what the log refuses.

use super::*;
use crate::entry;
use crate::frame::{self, BLOCK};
use std::time::Duration;

fn replicated(clock: &Arc<ManualClock>) -> Options {
    Options {
        replicated: true,
        ..options(clock)
    }
}

fn id(term: u64, index: u64) -> LogId {
    LogId {
        term,
        node_id: 1,
        index,
    }
}

/// A normal entry of one message per body, continuing the log's records.
fn normal(log: &ScheduleLog, term: u64, index: u64, bodies: &[&str]) -> (Entry, Vec<Appended>) {
    let mut builder = EntryBuilder::new(log.next_entry_seq().unwrap(), log.segment_minutes());
    let messages: Vec<_> = bodies.iter().map(|b| message(T0 + HOUR_MS, b)).collect();
    let appended = builder.append(&messages, T0);
    let (payload, _) = builder.finish();
    let entry = Entry {
        log_id: id(term, index),
        payload,
    };
    (entry, appended)
}

fn append(log: &ScheduleLog, entries: Vec<Entry>) {
    log.append_entries(entries).wait().unwrap();
}

fn membership(index: u64) -> Entry {
    Entry {
        log_id: id(1, index),
        payload: EntryPayload::Membership(b"{\"voters\":[1,2,3]}".to_vec()),
    }
}

/// Blank, membership and normal entries: readable at once, durable, read back alike after a crash.
#[test]
fn entries_read_back_before_and_after_a_crash() {
    let (dir, clock, log) = new_log_with(replicated);
    assert_eq!(log.entry_bounds().unwrap(), (None, None));
    let blank = Entry {
        log_id: id(1, 0),
        payload: EntryPayload::Blank,
    };
    append(&log, vec![blank.clone(), membership(1)]);
    let (two, _) = normal(&log, 1, 2, &["a", "b"]);
    let ack = log.append_entries(vec![two.clone()]);
    assert_eq!(log.read_entries(2..3).unwrap(), vec![two.clone()]);
    ack.wait().unwrap();
    let (three, _) = normal(&log, 2, 3, &["c"]);
    append(&log, vec![three.clone()]);
    let all = vec![blank, membership(1), two, three];
    assert_eq!(log.read_entries(0..4).unwrap(), all);
    assert_eq!(log.entry_bounds().unwrap(), (None, Some(id(2, 3))));
    assert!(log.read_entries(3..5).is_err(), "never a short read");
    log.crash();

    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(log.read_entries(0..4).unwrap(), all, "read from the WAL");
    assert_eq!(log.entry_bounds().unwrap(), (None, Some(id(2, 3))));
    assert_eq!(
        log.next_entry_seq().unwrap(),
        4,
        "three records, from seq 1"
    );
    // Nothing was applied: the schedule holds none of them.
    assert!(all_messages(&log).is_empty());
}

/// Applied entries' records reach the schedule; after a reopen the applied state is the checkpoint's,
/// the entries up to it count as purged and the others are still there to apply.
#[test]
fn applied_entries_are_filed_and_survive_a_reopen() {
    let (dir, clock, log) = new_log_with(replicated);
    append(&log, vec![membership(0)]);
    let (one, appended) = normal(&log, 1, 1, &["first"]);
    append(&log, vec![one.clone()]);
    let (two, later) = normal(&log, 1, 2, &["second"]);
    append(&log, vec![two.clone()]);
    log.apply_entries(log.read_entries(0..2).unwrap()).unwrap();
    let status = log.lookup(appended[0].id).unwrap().unwrap();
    assert_eq!(status.message.body, b"first");
    assert_eq!(log.lookup(later[0].id).unwrap(), None, "not applied yet");
    log.checkpoint().unwrap();
    let applied = log.applied_state().unwrap();
    assert_eq!(applied.log_id, id(1, 1));
    assert_eq!(
        applied.membership,
        Some((id(1, 0), b"{\"voters\":[1,2,3]}".to_vec()))
    );
    log.crash();

    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(log.applied_state(), Some(applied));
    assert_eq!(log.entry_bounds().unwrap(), (None, Some(id(1, 2))));
    // Applied entries stay in the log, for members behind, until their WAL file is retired.
    assert_eq!(log.read_entries(1..3).unwrap(), vec![one, two.clone()]);
    assert_eq!(
        log.lookup(appended[0].id).unwrap().unwrap().message.body,
        b"first"
    );
    log.apply_entries(vec![two]).unwrap();
    assert_eq!(
        log.lookup(later[0].id).unwrap().unwrap().message.body,
        b"second"
    );
    assert_eq!(all_messages(&log).len(), 2);
}

/// A membership entry, then five normal ones of term 3 (indexes 1 to 5), which it returns.
fn membership_and_five_old_entries(log: &ScheduleLog) -> Vec<Entry> {
    append(log, vec![membership(0)]);
    let mut old = Vec::new();
    for index in 1..6 {
        let (entry, _) = normal(log, 3, index, &["old"]);
        append(log, vec![entry.clone()]);
        old.push(entry);
    }
    old
}

/// A read that located entries on disk before a cut, and reads them after it, ends before the cut
/// (openraft's replication of a leader just deposed reads on while its tail is cut): never an error
/// that would stop the member as if its log were corrupt.
#[test]
fn a_read_across_a_cut_ends_where_the_cut_began() {
    let (dir, clock, log) = new_log_with(replicated);
    let old = membership_and_five_old_entries(&log);
    log.crash();
    // Reopened: every entry is read from its WAL file.
    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    let (located, missing) = log.entry_log().unwrap().locate(1..6);
    assert_eq!((located.len(), missing), (5, None));
    log.truncate_entries(3).wait().unwrap();
    assert_eq!(
        log.read_located(located.clone(), usize::MAX).unwrap(),
        old[..2].to_vec()
    );
    // Written over by the entries that replace them: the same.
    for index in 3..6 {
        let (entry, _) = normal(&log, 4, index, &["new", "longer than the old"]);
        append(&log, vec![entry]);
    }
    assert_eq!(
        log.read_located(located, usize::MAX).unwrap(),
        old[..2].to_vec()
    );
    // What replication reads now is the new tail, whole: never old entries joined to new ones.
    let read = log.read_entries_within(1..6, usize::MAX).unwrap();
    assert_eq!(read[..2], old[..2]);
    assert!(read[2..].iter().all(|e| e.log_id.term == 4), "{read:?}");
    assert_eq!(read.len(), 5);
    // A byte budget: past the first entry only while it is not reached.
    assert_eq!(log.read_entries_within(1..6, 1).unwrap().len(), 1);
    assert!(log
        .read_entries_within(6..9, usize::MAX)
        .unwrap()
        .is_empty());
}

/// A conflicting tail is cut, across WAL files, and new entries (of a lower term, with the same seqs)
/// take its place; a crash keeps the new ones, not the old.
#[test]
fn a_cut_tail_is_replaced_and_stays_cut() {
    let (dir, clock, log) = new_log_with(replicated);
    let old = membership_and_five_old_entries(&log);
    let files_before = wal::list(&dir.path().join("wal")).unwrap().len();
    assert!(
        files_before >= 3,
        "entries spread over files ({files_before})"
    );
    log.truncate_entries(3).wait().unwrap();
    assert!(log.read_entries(3..4).is_err());
    assert_eq!(log.entry_bounds().unwrap().1, Some(id(3, 2)));
    assert_eq!(log.next_entry_seq().unwrap(), 3);
    let (new, appended) = normal(&log, 2, 3, &["new"]);
    assert_eq!(
        appended[0].location.seq, 3,
        "the cut seqs are handed out again"
    );
    append(&log, vec![new.clone()]);
    log.crash();

    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(log.entry_bounds().unwrap().1, Some(id(2, 3)));
    assert_eq!(
        log.read_entries(1..4).unwrap(),
        vec![old[0].clone(), old[1].clone(), new]
    );
    log.apply_entries(log.read_entries(0..4).unwrap()).unwrap();
    let bodies: Vec<_> = all_messages(&log).into_values().map(|m| m.body).collect();
    assert_eq!(
        bodies,
        vec![b"old".to_vec(), b"old".to_vec(), b"new".to_vec()]
    );
}

/// An entry whose records did not all reach the disk is cut whole at recovery.
#[test]
fn a_torn_entry_is_cut_whole() {
    let (dir, clock, log) = new_log_with(replicated);
    let (one, _) = normal(&log, 1, 0, &["kept"]);
    append(&log, vec![one.clone()]);
    let (two, _) = normal(&log, 1, 1, &["torn", "torn too"]);
    append(&log, vec![two]);
    log.crash();
    // Damage the second entry's last record: as if the write had been torn there.
    let (first_seq, path) = wal::list(&dir.path().join("wal")).unwrap().pop().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let last_record = (0..bytes.len() - 4)
        .rev()
        .find(|&at| bytes[at..].starts_with(b"torn too"))
        .unwrap();
    bytes[last_record] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();

    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(log.entry_bounds().unwrap().1, Some(id(1, 0)), "{first_seq}");
    assert_eq!(log.next_entry_seq().unwrap(), 2);
    assert_eq!(log.read_entries(0..1).unwrap(), vec![one]);
    let (again, _) = normal(&log, 1, 1, &["again"]);
    append(&log, vec![again.clone()]);
    assert_eq!(log.read_entries(1..2).unwrap(), vec![again]);
}

/// Entries start on block boundaries, so a cut continues with aligned writes.
#[test]
fn every_entry_starts_a_block() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let options = Options {
        wal_segment_bytes: 1 << 20,
        ..replicated(&clock)
    };
    let log = ScheduleLog::open(dir.path(), options).unwrap();
    for index in 0..5 {
        let (entry, _) = normal(&log, 1, index, &["x"]);
        append(&log, vec![entry]);
    }
    log.close().unwrap();
    let (first_seq, path) = wal::list(&dir.path().join("wal")).unwrap().pop().unwrap();
    let scanned = wal::scan_file(&path, first_seq, true, true, None)
        .unwrap()
        .unwrap();
    assert_eq!(scanned.entries.len(), 5);
    for entry in &scanned.entries {
        assert_eq!(entry.at % BLOCK as u64, 0, "entry {:?}", entry.head.log_id);
    }
}

#[test]
fn what_a_replicated_log_refuses() {
    let (dir, clock, log) = new_log_with(replicated);
    append(&log, vec![membership(0)]);
    let refused = |ack: Ack<()>| match ack.wait() {
        Err(AppendError::Refused(why)) => why,
        other => panic!("not refused: {other:?}"),
    };
    // An index gap, and an entry whose records do not continue the seqs.
    let (gap, _) = normal(&log, 1, 5, &["x"]);
    assert!(refused(log.append_entries(vec![gap])).contains("does not follow"));
    let mut builder = EntryBuilder::new(log.next_entry_seq().unwrap() + 7, log.segment_minutes());
    let _ = builder.append(&[message(T0, "x")], T0);
    let skipped = Entry {
        log_id: id(1, 1),
        payload: builder.finish().0,
    };
    assert!(refused(log.append_entries(vec![skipped])).contains("seq"));
    // Bytes that are no record frames.
    let garbage = Entry {
        log_id: id(1, 1),
        payload: EntryPayload::Normal(b"not frames".to_vec()),
    };
    refused(log.append_entries(vec![garbage]));
    // Plain appends wait for the proposer; one that is not proposed is told so.
    let ack = log.append(vec![message(T0, "x")]);
    let proposals = log.proposals().unwrap();
    assert!(log.proposals().is_none(), "given once");
    let next_seq = || log.next_entry_seq().unwrap();
    match proposals.next_group(next_seq, &*clock, Duration::from_secs(10)) {
        NextGroup::Formed(group) => drop(group),
        other => panic!("no group: {other:?}"),
    }
    assert!(matches!(ack.wait(), Err(AppendError::NotLeader { .. })));
    // Nothing of the above changed the log.
    let (next, _) = normal(&log, 1, 1, &["fine"]);
    append(&log, vec![next.clone()]);
    log.apply_entries(log.read_entries(0..2).unwrap()).unwrap();
    log.checkpoint().unwrap();
    assert!(refused(log.truncate_entries(1)).contains("applied"));
    drop(log);
    // The data dir is a member's for good.
    let err = ScheduleLog::open(dir.path(), options(&clock)).unwrap_err();
    assert!(err.to_string().contains("cluster member"), "{err}");
}

#[test]
fn a_single_node_takes_no_entries() {
    let (dir, clock, log) = new_log();
    let blank = Entry {
        log_id: id(1, 0),
        payload: EntryPayload::Blank,
    };
    assert!(matches!(
        log.append_entries(vec![blank]).wait(),
        Err(AppendError::Refused(_))
    ));
    append_one(&log, T0, "plain");
    drop(log);
    let err = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap_err();
    assert!(err.to_string().contains("single node"), "{err}");
}

fn blank(index: u64) -> Entry {
    Entry {
        log_id: id(1, index),
        payload: EntryPayload::Blank,
    }
}

/// A file named by the checkpoint's seq may follow a file whose last entry, without records, is not
/// applied yet: recovery keeps that entry (and retirement keeps its file).
#[test]
fn an_unapplied_entry_without_records_before_the_checkpoint_seq_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let three_blocks = |clock: &Arc<ManualClock>| Options {
        wal_segment_bytes: 3 * 4096,
        ..replicated(clock)
    };
    let log = ScheduleLog::open(dir.path(), three_blocks(&clock)).unwrap();
    append(&log, vec![membership(0)]);
    for index in 1..3 {
        let (entry, _) = normal(&log, 1, index, &["a"]);
        append(&log, vec![entry]);
    }
    append(&log, vec![blank(3)]);
    let (four, _) = normal(&log, 1, 4, &["c"]);
    append(&log, vec![four.clone()]);
    log.apply_entries(log.read_entries(0..3).unwrap()).unwrap();
    log.checkpoint().unwrap();
    log.crash();
    let log = ScheduleLog::open(dir.path(), three_blocks(&clock)).unwrap();
    assert_eq!(log.read_entries(3..5).unwrap(), vec![blank(3), four]);
    log.checkpoint().unwrap();
    assert_eq!(log.read_entries(3..4).unwrap(), vec![blank(3)]);
}

/// A damaged padding frame after a whole entry ends the log mid-block: appends continue on the next
/// block of the same file, which is not replaced by a new one of the same name.
#[test]
fn a_tail_ending_mid_block_keeps_its_file() {
    let (dir, clock, log) = new_log_with(replicated);
    append(&log, vec![membership(0)]);
    log.crash();
    let (_, path) = wal::list(&dir.path().join("wal")).unwrap().pop().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let padding = BLOCK + frame::HEADER_LEN + entry::ENTRY_HEAD_LEN + 18;
    assert_eq!(bytes[padding + 8], 4, "a padding frame follows the entry");
    bytes[padding + 4] ^= 0xff; // its crc: as if its sector had not been written
    std::fs::write(&path, &bytes).unwrap();
    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(log.read_entries(0..1).unwrap(), vec![membership(0)]);
    append(&log, vec![blank(1)]);
    drop(log);
    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(
        log.read_entries(0..2).unwrap(),
        vec![membership(0), blank(1)]
    );
}

/// An entry just handed to the replayer cannot be cut off, however soon the cut comes.
#[test]
fn an_entry_just_applied_is_never_cut() {
    let (_dir, _clock, log) = new_log_with(replicated);
    append(&log, vec![membership(0)]);
    for index in 1..40 {
        let (entry, _) = normal(&log, 1, index, &["x"]);
        append(&log, vec![entry.clone()]);
        log.apply_entries(vec![entry]).unwrap();
        assert!(
            matches!(
                log.truncate_entries(index).wait(),
                Err(AppendError::Refused(_))
            ),
            "entry {index} was cut"
        );
    }
}

/// Entries without records count as applied too: a checkpoint waits for them.
#[test]
fn a_membership_applied_alone_is_checkpointed() {
    let (dir, clock, log) = new_log_with(replicated);
    append(&log, vec![membership(0)]);
    log.apply_entries(log.read_entries(0..1).unwrap()).unwrap();
    log.checkpoint().unwrap();
    log.crash();
    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(log.applied_state().map(|a| a.log_id), Some(id(1, 0)));
}

/// An apply may come before the entry's own `fdatasync` (a follower learns of a commit on a quorum
/// without it): it waits for it. An entry the log never had is refused at once.
#[test]
fn an_apply_waits_for_its_entry_to_be_durable() {
    let (_dir, _clock, log) = new_log_with(replicated);
    let (entry, appended) = normal(&log, 1, 0, &["early"]);
    let ack = log.append_entries(vec![entry.clone()]);
    log.apply_entries(vec![entry.clone()]).unwrap();
    ack.wait().unwrap();
    assert_eq!(
        log.lookup(appended[0].id).unwrap().unwrap().message.body,
        b"early"
    );
    let (never, _) = normal(&log, 1, 1, &["never"]);
    let started = std::time::Instant::now();
    assert!(log.apply_entries(vec![never]).is_err());
    // Well under the 30 s an apply waits for a flush: it did not wait for one.
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "refused at once"
    );
}

/// Applied entries go with their WAL files once the Raft layer let them go and a checkpoint has said
/// where the log then starts: after a crash the log starts there, with everything after it.
#[test]
fn retired_files_purge_their_entries_once_a_checkpoint_says_so() {
    let (dir, clock, log) = new_log_with(replicated);
    append(&log, vec![membership(0)]);
    let mut entries = Vec::new();
    for index in 1..6 {
        let (entry, _) = normal(&log, 1, index, &["x"]);
        append(&log, vec![entry.clone()]);
        entries.push(entry);
    }
    log.apply_entries(log.read_entries(0..4).unwrap()).unwrap();
    log.checkpoint().unwrap();
    log.checkpoint().unwrap();
    assert_eq!(log.entry_bounds().unwrap().0, None, "not let go yet");
    log.purge_entries(3).unwrap();
    log.checkpoint().unwrap();
    assert_eq!(log.entry_bounds().unwrap().0, None, "not said yet");
    log.checkpoint().unwrap();
    let (purged, last) = log.entry_bounds().unwrap();
    let purged = purged.expect("files retired");
    assert!(purged.index < 4, "applied ones only: {purged:?}");
    assert_eq!(last, Some(id(1, 5)));
    log.crash();

    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(log.entry_bounds().unwrap(), (Some(purged), Some(id(1, 5))));
    assert!(log.read_entries(purged.index..purged.index + 1).is_err());
    let rest = log.read_entries(purged.index + 1..6).unwrap();
    assert_eq!(rest, entries[purged.index as usize..].to_vec());
    log.apply_entries(rest[rest.len() - 2..].to_vec()).unwrap();
}

/// Outcomes travel in entries: applied, they reach the dispatch logs (a lookup sees the message
/// delivered), and still after a crash. A replicated log takes none directly.
#[test]
fn outcomes_in_entries_reach_the_dispatch_logs() {
    let (dir, clock, log) = new_log_with(replicated);
    let (one, appended) = normal(&log, 1, 0, &["order 42"]);
    append(&log, vec![one.clone()]);
    log.apply_entries(vec![one]).unwrap();
    let location = appended[0].location;
    let delivered = Outcome {
        seq: location.seq,
        at_ms: T0 + 5,
        attempt: 0,
        kind: OutcomeKind::Delivered,
    };
    let placed = vec![(location.bucket, delivered)];
    let state = |log: &ScheduleLog| log.lookup(appended[0].id).unwrap().unwrap().state;
    // Recorded through the log, they wait for the proposer: formed into an entry, committed (here:
    // appended and applied), answered.
    let proposals = log.proposals().unwrap();
    let two = std::thread::scope(|scope| {
        let recorded = scope.spawn(|| log.record_outcomes(&placed));
        let next_seq = log.next_entry_seq().unwrap();
        let NextGroup::Formed(mut group) =
            proposals.next_group(|| next_seq, &*clock, Duration::from_secs(10))
        else {
            panic!("no group");
        };
        assert_eq!(group.next_seq, next_seq, "outcomes take no seq");
        let two = Entry {
            log_id: id(1, 1),
            payload: group.take_payload(),
        };
        append(&log, vec![two.clone()]);
        assert_eq!(state(&log), MessageState::Pending, "not applied yet");
        log.apply_entries(vec![two.clone()]).unwrap();
        group.answer(Ok(()));
        recorded.join().unwrap().unwrap();
        two
    });
    log.checkpoint().unwrap();
    assert_eq!(state(&log), MessageState::Delivered { at_ms: T0 + 5 });
    log.crash();

    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(log.read_entries(1..2).unwrap(), vec![two]);
    assert_eq!(state(&log), MessageState::Delivered { at_ms: T0 + 5 });
}

/// A group stays within one entry's bytes: a submission that does not fit waits for the next group,
/// and one larger than an entry on its own is refused before it is proposed.
#[test]
fn groups_stay_within_an_entry() {
    let (_dir, clock, log) = new_log_with(replicated);
    let proposals = log.proposals().unwrap();
    let body = "x".repeat(800);
    let batch = |n: usize| (0..n).map(|_| message(T0, &body)).collect::<Vec<_>>();
    let record = batch(1)[0].frame_len();
    let fits = MAX_ENTRY_BYTES / record / 2 + 1; // two of these do not fit one entry
    let (first, second) = (log.append(batch(fits)), log.append(batch(fits)));
    let too_large = log.append(batch(MAX_ENTRY_BYTES / record + 1));
    let wait = Duration::from_secs(10);
    let NextGroup::Formed(one) = proposals.next_group(|| 1, &*clock, wait) else {
        panic!("no first group");
    };
    assert_eq!(one.next_seq, 1 + fits as u64, "the first submission alone");
    let NextGroup::Formed(two) = proposals.next_group(|| one.next_seq, &*clock, wait) else {
        panic!("no second group");
    };
    assert_eq!(two.next_seq, 1 + 2 * fits as u64, "the second, held over");
    assert!(matches!(
        proposals.next_group(|| two.next_seq, &*clock, wait),
        NextGroup::Idle
    ));
    assert!(matches!(too_large.wait(), Err(AppendError::Refused(_))));
    drop((one, two));
    assert!(
        first.wait().is_err() && second.wait().is_err(),
        "not proposed"
    );
}

/// An entry that starts with an outcome (no seq) and goes on with messages, then another entry of
/// messages, in one append: the writer checks each entry's first seq against the seqs before it,
/// outcomes passed over (it once took the second entry's first seq for the first's, and poisoned the
/// log of a follower catching up under load).
#[test]
fn an_entry_that_starts_with_an_outcome_continues_the_seqs() {
    let (dir, clock, log) = new_log_with(replicated);
    let (one, appended) = normal(&log, 1, 0, &["order 42"]);
    append(&log, vec![one.clone()]);
    log.apply_entries(vec![one]).unwrap();
    let delivered = Outcome {
        seq: appended[0].location.seq,
        at_ms: T0 + 5,
        attempt: 0,
        kind: OutcomeKind::Delivered,
    };
    let mut builder = EntryBuilder::new(log.next_entry_seq().unwrap(), log.segment_minutes());
    builder.outcomes(&[(appended[0].location.bucket, delivered)]);
    builder.append(&[message(T0 + HOUR_MS, "after the outcome")], T0);
    let (payload, next_seq) = builder.finish();
    let two = Entry {
        log_id: id(1, 1),
        payload,
    };
    let mut builder = EntryBuilder::new(next_seq, log.segment_minutes());
    builder.append(&[message(T0 + HOUR_MS, "the next entry")], T0);
    let three = Entry {
        log_id: id(1, 2),
        payload: builder.finish().0,
    };
    append(&log, vec![two.clone(), three.clone()]);
    assert!(log.poisoned().is_none());
    log.apply_entries(vec![two, three]).unwrap();
    assert_eq!(all_messages(&log).len(), 3);
    log.crash();
    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    assert_eq!(log.next_entry_seq().unwrap(), 4);
}

/// A bucket watched right after an entry with an outcome was applied (a member elected leader loads its
/// wheel so) leaves the finished message out: the snapshot waits for the applied entries' outcomes.
#[test]
fn a_watch_after_an_applied_outcome_leaves_the_finished_message_out() {
    let (_dir, _clock, log) = new_log_with(replicated);
    let (one, appended) = normal(&log, 1, 0, &["order 42", "order 43"]);
    append(&log, vec![one.clone()]);
    log.apply_entries(vec![one]).unwrap();
    let location = appended[0].location;
    let delivered = Outcome {
        seq: location.seq,
        at_ms: T0 + 5,
        attempt: 0,
        kind: OutcomeKind::Delivered,
    };
    let mut builder = EntryBuilder::new(log.next_entry_seq().unwrap(), log.segment_minutes());
    builder.outcomes(&[(location.bucket, delivered)]);
    let two = Entry {
        log_id: id(1, 1),
        payload: builder.finish().0,
    };
    append(&log, vec![two.clone()]);
    log.apply_entries(vec![two]).unwrap();
    let snapshot = log.watch(location.bucket).unwrap();
    let pending: Vec<u64> = snapshot.pending.iter().map(|e| e.seq).collect();
    assert_eq!(
        pending,
        vec![appended[1].location.seq],
        "only the undelivered one"
    );
}

/// Application payloads ride in normal entries beside records: read back alike before and after a
/// crash, listed by `app_payloads` in order, passed over when the entry is applied (its message is
/// filed, nothing else), and printed by `inspect`.
#[test]
fn app_payloads_round_trip_through_an_entry_and_survive_a_crash() {
    let (dir, clock, log) = new_log_with(replicated);
    let mut builder = EntryBuilder::new(log.next_entry_seq().unwrap(), log.segment_minutes());
    builder.app(b"first op");
    let appended = builder.append(&[message(T0 + HOUR_MS, "beside them")], T0);
    builder.app(&[0, 255, 7]);
    builder.app(b"");
    let (payload, next_seq) = builder.finish();
    assert_eq!(next_seq, 2, "only the message takes a seq");
    let one = Entry {
        log_id: id(1, 0),
        payload,
    };
    let listed = |entry: &Entry| match &entry.payload {
        EntryPayload::Normal(frames) => app_payloads(frames)
            .unwrap()
            .into_iter()
            .map(<[u8]>::to_vec)
            .collect::<Vec<_>>(),
        other => panic!("not a normal entry: {other:?}"),
    };
    let expected = vec![b"first op".to_vec(), vec![0, 255, 7], Vec::new()];
    assert_eq!(listed(&one), expected);
    append(&log, vec![one.clone()]);
    assert_eq!(log.read_entries(0..1).unwrap(), vec![one.clone()]);
    log.crash();

    let log = ScheduleLog::open(dir.path(), replicated(&clock)).unwrap();
    let read = log.read_entries(0..1).unwrap();
    assert_eq!(read, vec![one.clone()], "read from the WAL");
    assert_eq!(listed(&read[0]), expected);
    assert_eq!(log.next_entry_seq().unwrap(), 2);
    // The next entry continues the seqs: the payloads took none.
    let (two, later) = normal(&log, 1, 1, &["after"]);
    append(&log, vec![two.clone()]);
    log.apply_entries(vec![one, two]).unwrap();
    assert_eq!(all_messages(&log).len(), 2);
    let body = |id| log.lookup(id).unwrap().unwrap().message.body;
    assert_eq!(body(appended[0].id), b"beside them");
    assert_eq!(body(later[0].id), b"after");
    log.checkpoint().unwrap();
    drop(log);

    let newest = wal::list(&dir.path().join("wal")).unwrap().remove(0).1;
    let mut out = Vec::new();
    let clean = inspect(&newest, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(clean, "{text}");
    assert!(text.contains("application payload, 8 bytes"), "{text}");
    assert!(text.contains("application payload, 0 bytes"), "{text}");
}

/// What `app_payloads` refuses: bytes that are not whole record frames, and frames that do not belong
/// in an entry.
#[test]
fn app_payloads_refuses_what_is_not_an_entrys_records() {
    let mut builder = EntryBuilder::new(1, SegmentMinutes::DEFAULT);
    builder.app(b"an op");
    let EntryPayload::Normal(frames) = builder.finish().0 else {
        panic!("not a normal entry");
    };
    for cut in 1..frames.len() {
        assert!(app_payloads(&frames[..cut]).is_err(), "cut at {cut}");
    }
    let mut flipped = frames.clone();
    *flipped.last_mut().unwrap() ^= 1;
    assert!(app_payloads(&flipped).is_err());
    let mut padding = Vec::new();
    let at = frame::start(&mut padding);
    padding.extend_from_slice(&[0; 4]);
    frame::finish(&mut padding, at, frame::Kind::Padding);
    let why = app_payloads(&padding).unwrap_err();
    assert!(why.contains("Padding"), "{why}");
    assert_eq!(app_payloads(&[]).unwrap(), Vec::<&[u8]>::new());
}

/// A single node's log proposes nothing: an application payload is refused at once.
#[test]
fn a_single_node_refuses_app_payloads() {
    let (_dir, _clock, log) = new_log();
    let refused = log.propose_app(b"op".to_vec());
    assert!(
        matches!(refused, Err(AppendError::Refused(_))),
        "{refused:?}"
    );
}

/// `propose_app` joins the next group the proposer forms (beside an append), and answers only once
/// that group is answered, which the proposer does after the entry is applied; a payload too large
/// for an entry is refused before it is queued; the largest that fits is proposed.
#[test]
fn propose_app_answers_once_its_entry_is_applied() {
    let (_dir, clock, log) = new_log_with(replicated);
    let proposals = log.proposals().unwrap();
    let too_large = vec![7u8; MAX_APP_PAYLOAD_BYTES + 1];
    assert!(matches!(
        log.propose_app(too_large),
        Err(AppendError::Refused(_))
    ));
    assert_eq!(
        entry::normal_entry_bytes(frame::HEADER_LEN + MAX_APP_PAYLOAD_BYTES),
        MAX_ENTRY_BYTES,
        "the largest payload fills an entry"
    );
    let wait = Duration::from_secs(10);
    // Proposes each group formed as the next entry, applies it and answers it, until one carried an
    // application payload (listed in `apps`); the proposer's submitter must not be answered before.
    let mut index = 0;
    let mut commit_until_an_app = |apps: &mut Vec<Vec<u8>>, answered: &dyn Fn() -> bool| {
        while apps.is_empty() {
            let next_seq = log.next_entry_seq().unwrap();
            let mut group = match proposals.next_group(|| next_seq, &*clock, wait) {
                NextGroup::Formed(group) => group,
                other => panic!("no group: {other:?}"),
            };
            let payload = group.take_payload();
            if let EntryPayload::Normal(frames) = &payload {
                let listed = app_payloads(frames).unwrap();
                apps.extend(listed.into_iter().map(<[u8]>::to_vec));
            }
            let entry = Entry {
                log_id: id(1, index),
                payload,
            };
            index += 1;
            append(&log, vec![entry.clone()]);
            assert!(!answered(), "answered before its entry was applied");
            log.apply_entries(vec![entry]).unwrap();
            group.answer(Ok(()));
        }
    };
    std::thread::scope(|scope| {
        let appended = log.append(vec![message(T0 + HOUR_MS, "beside it")]);
        let proposed = scope.spawn(|| log.propose_app(b"commit offset 5".to_vec()));
        let mut apps = Vec::new();
        commit_until_an_app(&mut apps, &|| proposed.is_finished());
        assert_eq!(apps, vec![b"commit offset 5".to_vec()]);
        proposed.join().unwrap().unwrap();
        appended.wait().unwrap();
    });
    // The largest payload that fits goes through, alone in its entry.
    std::thread::scope(|scope| {
        let proposed = scope.spawn(|| log.propose_app(vec![1u8; MAX_APP_PAYLOAD_BYTES]));
        let next_seq = log.next_entry_seq().unwrap();
        let NextGroup::Formed(mut group) = proposals.next_group(|| next_seq, &*clock, wait) else {
            panic!("no group");
        };
        let payload = group.take_payload();
        let (_, last) = log.entry_bounds().unwrap();
        let entry = Entry {
            log_id: id(1, last.unwrap().index + 1),
            payload,
        };
        append(&log, vec![entry.clone()]);
        log.apply_entries(vec![entry]).unwrap();
        group.answer(Ok(()));
        proposed.join().unwrap().unwrap();
    });
    // A group dropped unproposed tells the payload's submitter so.
    std::thread::scope(|scope| {
        let proposed = scope.spawn(|| log.propose_app(b"lost".to_vec()));
        let NextGroup::Formed(group) = proposals.next_group(|| 0, &*clock, wait) else {
            panic!("no group");
        };
        drop(group);
        let answer = proposed.join().unwrap();
        assert!(
            matches!(answer, Err(AppendError::NotLeader { .. })),
            "{answer:?}"
        );
    });
}

/// A snapshot's links, opened as a data dir of their own (a member restored from it): the applied
/// state and every message of the entries up to it, a Raft log that starts after it, a WAL of its own;
/// and nothing the original log filed after it was taken.
#[test]
fn a_linked_snapshot_opens_as_the_data_dir_it_was_taken_from() {
    let (dir, clock, log) = new_log_with(replicated);
    append(&log, vec![membership(0)]);
    let (one, first) = normal(&log, 1, 1, &["first", "also first"]);
    append(&log, vec![one]);
    let (two, second) = normal(&log, 1, 2, &["second"]);
    append(&log, vec![two]);
    log.apply_entries(log.read_entries(0..3).unwrap()).unwrap();
    let (three, later) = normal(&log, 1, 3, &["later"]);
    append(&log, vec![three.clone()]);

    let snapshot = dir.path().join("snapshot");
    let linked = log.link_snapshot(&snapshot).unwrap();
    assert_eq!(linked.applied.log_id, id(1, 2));
    for (file, len) in &linked.files {
        let on_disk = std::fs::metadata(snapshot.join(file)).unwrap().len();
        assert!(*len <= on_disk, "{file:?}: {len} of {on_disk} bytes");
    }
    // Applied after the snapshot: its files (links) may grow, the snapshot's lengths do not.
    log.apply_entries(vec![three]).unwrap();
    log.checkpoint().unwrap();
    assert!(log.lookup(later[0].id).unwrap().is_some());
    drop(log);

    // What a member receives: exactly the snapshot's bytes of each file.
    let restored = tempfile::tempdir().unwrap();
    for (file, len) in &linked.files {
        let bytes = std::fs::read(snapshot.join(file)).unwrap();
        let to = restored.path().join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(to, &bytes[..*len as usize]).unwrap();
    }
    let copy = ScheduleLog::open(restored.path(), replicated(&clock)).unwrap();
    let applied = copy.applied_state().unwrap();
    assert_eq!(applied.log_id, id(1, 2));
    assert_eq!(applied.membership.as_ref().map(|m| m.0), Some(id(1, 0)));
    assert_eq!(
        copy.entry_bounds().unwrap(),
        (Some(id(1, 2)), Some(id(1, 2))),
        "the log starts after the snapshot"
    );
    for appended in first.iter().chain(&second) {
        assert!(copy.lookup(appended.id).unwrap().is_some());
    }
    assert_eq!(
        copy.lookup(later[0].id).unwrap(),
        None,
        "after the snapshot"
    );
    assert_eq!(all_messages(&copy).len(), 3);
    // The restored log goes on from there: the next entry, with seqs after the snapshot's.
    let (next, appended) = normal(&copy, 2, 3, &["after"]);
    assert!(appended[0].location.seq > second[0].location.seq);
    copy.append_entries(vec![next.clone()]).wait().unwrap();
    copy.apply_entries(vec![next]).unwrap();
    assert_eq!(
        copy.lookup(appended[0].id).unwrap().unwrap().message.body,
        b"after"
    );
}
