//! A full disk is a state, not a death: injected `ENOSPC` in segment writes, dispatch appends,
//! checkpoint writes and WAL rollovers must hold the engine up while it lasts, be reported by
//! `disk_full()`, and leave every acknowledged record in place exactly once when it clears (with or without
//! a crash in between). A failed sync must still poison, naming its file.

use super::*;
use crate::fault::{Fault, Faults};
use std::collections::BTreeMap;
use std::time::Instant;

/// Waits until `disk_full()` names a file containing `file`, and returns the cause.
fn wait_disk_full_at(log: &ScheduleLog, file: &str) -> String {
    let mut last = None;
    wait_until(&format!("disk_full() names {file}"), || {
        last = log.disk_full();
        last.as_deref().is_some_and(|c| c.contains(file))
    });
    last.unwrap()
}

/// The seqs of every report on the tap so far, scheduled ones sorted: (scheduled, cancelled). Checks
/// that each bucket's records were reported in seq order (across buckets, the replayer reports a bucket
/// at a time: the wheel needs no other order).
fn drain(reports: &crossbeam_channel::Receiver<Replayed>) -> (Vec<u64>, Vec<u64>) {
    let (mut scheduled, mut cancelled) = (Vec::new(), Vec::new());
    let mut last_in_bucket = BTreeMap::new();
    for report in reports.try_iter() {
        match report {
            Replayed::Scheduled { bucket, entry } => {
                let last = last_in_bucket.insert(bucket, entry.seq).unwrap_or(0);
                assert!(
                    entry.seq > last,
                    "bucket {bucket}: seq {} after {last}",
                    entry.seq
                );
                scheduled.push(entry.seq);
            }
            Replayed::Cancelled { target, .. } => cancelled.push(target.seq),
        }
    }
    scheduled.sort_unstable();
    (scheduled, cancelled)
}

fn wal_files(dir: &Path) -> usize {
    wal::list(&dir.join("wal")).unwrap().len()
}

/// Four buckets (more than the two open segment writers of a test build, so eviction runs too).
fn deliver_at(i: usize) -> i64 {
    T0 + (i as i64 % 4 + 1) * HOUR_MS + i as i64
}

/// Appends four messages (one per bucket of `deliver_at`) and checkpoints them.
fn append_checkpointed(log: &ScheduleLog) -> Vec<Appended> {
    let appended = (0..4)
        .map(|i| append_one(log, deliver_at(i), "checkpointed"))
        .collect();
    log.checkpoint().unwrap();
    appended
}

/// Every message is filed once, each cancelled one reads as cancelled and the others as pending.
fn check_states(log: &ScheduleLog, appended: &[Appended], cancelled: &[Location]) {
    let all = all_messages(log);
    assert_eq!(
        all.keys().copied().collect::<Vec<_>>(),
        appended.iter().map(|a| a.location.seq).collect::<Vec<_>>(),
        "every acknowledged message filed once, nothing else"
    );
    let counted: u64 = log.entry_counts().iter().map(|(_, n)| n).sum();
    assert_eq!(counted, appended.len() as u64, "segment entry counts");
    for a in appended {
        let status = log.lookup(a.id).unwrap().expect("found by id");
        let expected = match cancelled.contains(&a.location) {
            true => MessageState::Cancelled { at_ms: T0 },
            false => MessageState::Pending,
        };
        assert_eq!(status.state, expected, "seq {}", a.location.seq);
    }
}

#[test]
fn a_full_disk_holds_the_replayer_up_and_loses_nothing() {
    let (dir, clock, log) = new_log();
    let reports = tap(&log);
    for i in 0..4 {
        let snapshot = log.watch(Bucket::of(deliver_at(i), SegmentMinutes::DEFAULT));
        assert!(snapshot.unwrap().pending.is_empty());
    }
    let mut appended: Vec<Appended> = (0..6)
        .map(|i| append_one(&log, deliver_at(i), "before"))
        .collect();
    assert!(log.wait_replayed(appended[5].location.seq));
    let before_stall = checkpointed_seq(dir.path());

    log.inject_fault(Fault::SegmentWritesFull(u32::MAX));
    // Appends and cancels are still acknowledged: they are durable in the WAL.
    appended.extend((6..14).map(|i| append_one(&log, deliver_at(i), "while full")));
    let cancelled = vec![appended[1].location, appended[9].location];
    for target in &cancelled {
        log.cancel(*target).wait().unwrap();
    }
    let cause = wait_disk_full_at(&log, "/schedule/");
    assert!(
        cause.starts_with("no space left writing ")
            && cause.contains(&dir.path().display().to_string())
            && cause.ends_with("No space left on device (os error 28)"),
        "{cause}"
    );
    assert_eq!(log.poisoned(), None);
    // A lookup of what is acknowledged but not filed says so at once, rather than wait for the disk.
    let started = Instant::now();
    match log.lookup(appended[8].id) {
        Err(Error::NotFiledYet { cause: Some(cause) }) => assert!(cause.contains("/schedule/")),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5), "it waited");
    appended.push(append_one(&log, deliver_at(14), "still accepted"));

    // The segments get written, then the cancels' dispatch appends (cut short half-way) find no space...
    log.inject_fault(Fault::DispatchAppendsFull(u32::MAX));
    log.inject_fault(Fault::CheckpointWritesFull(u32::MAX));
    log.inject_fault(Fault::SegmentWritesFull(0));
    wait_disk_full_at(&log, "/dispatch/");
    // ... then the checkpoint that follows a stall does.
    log.inject_fault(Fault::DispatchAppendsFull(0));
    wait_disk_full_at(&log, "checkpoint.tmp~");
    assert_eq!(log.poisoned(), None);
    log.inject_fault(Fault::CheckpointWritesFull(0));
    wait_until("disk_full() clears", || log.disk_full().is_none());

    let last = appended.last().unwrap().location.seq;
    wait_until("the replayer checkpoints by itself", || {
        checkpointed_seq(dir.path()) > before_stall
    });
    assert!(checkpointed_seq(dir.path()) > last);
    // Retired once the replayer has the checkpointer's answer.
    wait_until("replayed WAL files are retired", || {
        wal_files(dir.path()) == 1
    });
    check_states(&log, &appended, &cancelled);
    let (scheduled, cancels) = drain(&reports);
    let seqs: Vec<u64> = appended.iter().map(|a| a.location.seq).collect();
    assert_eq!(scheduled, seqs, "the tap saw each record once");
    assert_eq!(
        cancels,
        cancelled.iter().map(|l| l.seq).collect::<Vec<_>>(),
        "and each cancel once"
    );
    assert_eq!(log.poisoned(), None);
    let next = append_one(&log, deliver_at(0), "after");
    appended.push(next);

    log.close().unwrap();
    let log = open(dir.path(), &clock);
    check_states(&log, &appended, &cancelled);
}

#[test]
fn a_crash_while_the_disk_is_full_loses_and_doubles_nothing() {
    let (dir, clock, log) = new_log();
    let mut appended = append_checkpointed(&log);
    appended.extend((4..8).map(|i| append_one(&log, deliver_at(i), "replayed")));
    assert!(log.wait_replayed(appended[7].location.seq));

    // Each try writes the records and half their index entries before it fails.
    log.inject_fault(Fault::SegmentWritesFull(u32::MAX));
    appended.extend((8..14).map(|i| append_one(&log, deliver_at(i), "in the WAL only")));
    // A bucket no segment exists for yet: its creation fails.
    appended.push(append_one(&log, T0 + 9 * HOUR_MS, "new bucket"));
    let cancelled = vec![appended[2].location, appended[10].location];
    for target in &cancelled {
        log.cancel(*target).wait().unwrap();
    }
    wait_disk_full_at(&log, "/schedule/");
    log.crash();

    for reopen in 0..2 {
        let log = open(dir.path(), &clock);
        assert_eq!(log.disk_full(), None, "reopen {reopen}");
        check_states(&log, &appended, &cancelled);
        log.crash();
    }
}

/// A node stopped while the disk was full opens on the full disk: the records the open cannot file go
/// to the replayer, the log says it is held up, appends are acknowledged while the WAL has room, and
/// once there is room everything is filed, once.
#[test]
fn an_open_on_a_full_disk_leaves_the_filing_to_the_replayer() {
    let (dir, clock, log) = new_log();
    let mut appended = append_checkpointed(&log);
    log.inject_fault(Fault::SegmentWritesFull(u32::MAX));
    appended.extend((4..10).map(|i| append_one(&log, deliver_at(i), "in the WAL only")));
    wait_disk_full_at(&log, "/schedule/");
    log.crash();

    let faults = Arc::new(Faults::default());
    faults.arm(Fault::SegmentWritesFull(u32::MAX));
    let full = Options {
        faults: Some(faults.clone()),
        ..options(&clock)
    };
    let log = ScheduleLog::open(dir.path(), full).unwrap();
    let cause = log.disk_full().expect("held up from the open on");
    assert!(cause.contains("/schedule/"), "{cause}");
    assert!(matches!(
        log.read(appended[5].location),
        Err(Error::NotFiledYet { cause: Some(_) })
    ));
    // Acknowledged meanwhile: it is in the WAL.
    appended.push(append_one(&log, deliver_at(10), "while full"));
    faults.arm(Fault::SegmentWritesFull(0));
    wait_until("the backlog is filed", || log.disk_full().is_none());
    assert!(log.wait_replayed(appended[10].location.seq));
    check_states(&log, &appended, &[]);
    log.close().unwrap();
    let log = open(dir.path(), &clock);
    check_states(&log, &appended, &[]);
}

/// The room comes back between the open that found the disk full and the replayer's first try: that
/// try files everything, and the log is no longer held up.
#[test]
fn an_open_on_a_full_disk_heals_at_the_replayers_first_try() {
    let (dir, clock, log) = new_log();
    log.checkpoint().unwrap();
    log.inject_fault(Fault::SegmentWritesFull(u32::MAX));
    let appended: Vec<Appended> = (0..4)
        .map(|i| append_one(&log, deliver_at(i), "in the WAL only"))
        .collect();
    wait_disk_full_at(&log, "/schedule/");
    log.crash();
    // One strike: the open's filing fails, the replayer's first try does not.
    let faults = Arc::new(Faults::default());
    faults.arm(Fault::SegmentWritesFull(1));
    let log = ScheduleLog::open(
        dir.path(),
        Options {
            faults: Some(faults),
            ..options(&clock)
        },
    )
    .unwrap();
    wait_until("the log is no longer held up", || log.disk_full().is_none());
    assert!(log.wait_replayed(appended[3].location.seq));
    check_states(&log, &appended, &[]);
}

/// More committed groups than the replayer's backlog takes: past its bound the writer refuses new
/// requests with `DiskFull` instead of blocking (every request is answered while the disk is full), and
/// everything it acknowledged lands once after the fault clears, also across a crash.
#[test]
fn past_the_backlog_bound_the_writer_refuses_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let log = Arc::new(open(dir.path(), &clock));
    log.inject_fault(Fault::SegmentWritesFull(u32::MAX));
    // Each append is a group of at least 4 KiB (padded to a block): 40 of them are more than the
    // 128 KiB backlog of a test build.
    let acks: Vec<_> = (0..40)
        .map(|i| log.append(vec![message(deliver_at(i), "queued")]))
        .collect();
    // Every request is answered while the fault holds: none waits for the replayer.
    let (answered, answers) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let results: Vec<_> = acks.into_iter().map(|ack| ack.wait()).collect();
        let _ = answered.send(results);
    });
    let results = answers
        .recv_timeout(Duration::from_secs(30))
        .expect("requests were held back instead of answered");
    wait_disk_full_at(&log, "/schedule/");
    let refused = results.iter().filter(|r| r.is_err()).count();
    assert!(refused > 0, "the backlog bound was never reached");
    assert!(results
        .iter()
        .all(|r| matches!(r, Ok(_) | Err(AppendError::DiskFull))));
    log.inject_fault(Fault::SegmentWritesFull(0));
    let mut appended: Vec<Appended> = results
        .into_iter()
        .filter_map(|r| r.ok())
        .map(|mut a| a.pop().unwrap())
        .collect();
    appended.sort_by_key(|a| a.location.seq);
    wait_until("disk_full() clears", || log.disk_full().is_none());
    // Accepted again once the backlog is filed.
    let after = log.append(vec![message(deliver_at(99), "after")]).wait();
    appended.extend(after.expect("accepted once the disk has room"));
    check_states(&log, &appended, &[]);
    let log = Arc::try_unwrap(log).unwrap();
    log.crash();
    let log = open(dir.path(), &clock);
    check_states(&log, &appended, &[]);
}

#[test]
fn a_failed_segment_sync_poisons_the_log_naming_the_file() {
    let (dir, clock, log) = new_log();
    let kept = append_one(&log, T0, "kept");
    let segment = dir
        .path()
        .join(format!("schedule/{}.log", kept.location.bucket));
    log.inject_fault(Fault::SegmentSyncFails);
    let err = log.checkpoint().unwrap_err();
    assert!(
        matches!(&err, Error::Sync { path, .. } if *path == segment),
        "{err}"
    );
    assert!(!err.is_disk_full());
    let cause = log.poisoned().expect("poisoned");
    assert!(
        cause.contains(&segment.display().to_string()) && cause.contains("os error 5"),
        "{cause}"
    );
    assert_eq!(log.disk_full(), None);
    match log.append(vec![message(T0, "refused")]).wait() {
        Err(AppendError::Poisoned(why)) => assert_eq!(why, cause),
        other => panic!("expected poisoned, got {other:?}"),
    }
    // No checkpoint is written after the failed sync (a later one could claim lost pages durable).
    let again = log.checkpoint().unwrap_err();
    assert!(again.to_string().contains(&cause), "{again}");
    assert!(log.close().is_err(), "the final checkpoint is refused too");

    let log = open(dir.path(), &clock);
    assert_eq!(log.poisoned(), None);
    assert!(log.lookup(kept.id).unwrap().is_some());
}

/// The replayer's own checkpoint fails: the poison cause is its error with the file, not "the replayer
/// stopped", and so is the error every later request gets.
#[test]
fn the_replayers_error_is_the_poison_cause() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let eager = Options {
        checkpoint_bytes: 1, // the replayer checkpoints after every group
        ..options(&clock)
    };
    let log = ScheduleLog::open(dir.path(), eager).unwrap();
    append_one(&log, T0, "synced");
    wait_until("the first group is checkpointed", || {
        checkpointed_seq(dir.path()) == 2
    });
    log.inject_fault(Fault::SegmentSyncFails);
    let lost_sync = append_one(&log, T0, "acknowledged, then its segment sync fails");
    wait_until("the log is poisoned", || log.poisoned().is_some());
    let cause = log.poisoned().unwrap();
    let segment = format!("schedule/{}.log", lost_sync.location.bucket);
    assert!(
        cause.starts_with("replay failed: fsync of ") && cause.contains(&segment),
        "{cause}"
    );
    match log.append(vec![message(T0, "refused")]).wait() {
        Err(AppendError::Poisoned(why)) => assert_eq!(why, cause),
        other => panic!("expected poisoned, got {other:?}"),
    }
    drop(log);
    let log = open(dir.path(), &clock);
    assert!(log.lookup(lost_sync.id).unwrap().is_some());
}

#[test]
fn a_full_disk_at_rollover_backs_off_for_a_second() {
    let (dir, clock, log) = new_log();
    // One padded group fills the file's single data block; every later request needs a rollover.
    append_one(&log, T0, "first");
    log.inject_fault(Fault::DiskFullAtRoll);
    let err = log.append(vec![message(T0, "a")]).wait().unwrap_err();
    assert_eq!(err, AppendError::DiskFull);
    let cause = log.disk_full().expect("reported");
    assert!(
        cause.contains("wal/next.tmp") && cause.contains("No space left on device"),
        "{cause}"
    );
    // The fault is spent, so a try would succeed: failing proves there was none.
    clock.advance(999);
    assert_eq!(
        log.cancel(Location {
            bucket: Bucket::of(T0, SegmentMinutes::DEFAULT),
            seq: 1
        })
        .wait(),
        Err(AppendError::DiskFull)
    );
    assert!(log.disk_full().is_some());
    assert_eq!(log.poisoned(), None);
    clock.advance(1);
    // Past the back-off the idle writer tries the rollover itself: the state clears without a request
    // (a service that refuses requests while the disk is reported full would never send one).
    wait_until("the writer's own retry clears disk_full()", || {
        log.disk_full().is_none()
    });
    let after = append_one(&log, T0, "after");
    assert_eq!(
        after.location.seq, 2,
        "the failed requests consumed no seqs"
    );
    log.crash();
    let log = open(dir.path(), &clock);
    assert_eq!(
        all_messages(&log).keys().copied().collect::<Vec<_>>(),
        vec![1, 2]
    );
}

#[test]
fn a_dispatch_append_cut_short_by_a_full_disk_is_retried_cleanly() {
    let (dir, clock, log) = new_log();
    let a = append_one(&log, T0 + HOUR_MS, "a");
    let b = append_one(&log, T0 + 2 * HOUR_MS, "b");
    let outcome = |appended: &Appended, kind| {
        (
            appended.location.bucket,
            Outcome {
                seq: appended.location.seq,
                at_ms: T0,
                attempt: 0,
                kind,
            },
        )
    };
    log.record_outcomes(&[outcome(&a, OutcomeKind::Delivered)])
        .unwrap();
    let outcomes = vec![
        outcome(&a, OutcomeKind::Dead { reason: "r".into() }),
        outcome(&b, OutcomeKind::Delivered),
    ];
    log.inject_fault(Fault::DispatchAppendsFull(1));
    let err = log.record_outcomes(&outcomes).unwrap_err();
    assert!(err.is_disk_full(), "{err}");
    assert!(err.to_string().contains("/dispatch/"), "{err}");
    // Half a frame is on one of the logs now; the retry cuts it and appends after it.
    log.record_outcomes(&outcomes).unwrap();
    let check = |log: &ScheduleLog| {
        assert_eq!(
            log.lookup(a.id).unwrap().unwrap().state,
            MessageState::Delivered { at_ms: T0 },
            "the first outcome recorded counts"
        );
        assert_eq!(
            log.lookup(b.id).unwrap().unwrap().state,
            MessageState::Delivered { at_ms: T0 }
        );
        let mut kinds: BTreeMap<u64, usize> = BTreeMap::new();
        for bucket in [a.location.bucket, b.location.bucket] {
            for o in log.outcomes(bucket).unwrap() {
                *kinds.entry(o.seq).or_default() += 1;
            }
        }
        assert!(kinds[&a.location.seq] >= 2 && kinds[&b.location.seq] >= 1);
    };
    check(&log);
    assert_eq!(log.poisoned(), None);
    log.close().unwrap();
    let log = open(dir.path(), &clock);
    check(&log);
}

/// A rollover held up by a full disk happens later, on the writer's own retry, after the last checkpoint:
/// the file it leaves behind is deleted all the same, though no new record comes to trigger a checkpoint
/// (on a quiet node, or one whose other writers wait for exactly that space).
#[test]
fn a_wal_file_left_by_a_late_rollover_is_deleted_without_new_records() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let options = Options {
        checkpoint_interval: Duration::from_millis(20),
        ..options(&clock)
    };
    let log = ScheduleLog::open(dir.path(), options).unwrap();
    append_one(&log, T0, "first");
    log.inject_fault(Fault::DiskFullAtRoll);
    let err = log.append(vec![message(T0, "a")]).wait().unwrap_err();
    assert_eq!(err, AppendError::DiskFull);
    let wal = dir.path().join("wal");
    let files = || -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&wal)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".wal"))
            .collect();
        names.sort();
        names
    };
    assert_eq!(files(), ["00000000000000000001.wal"]);
    clock.advance(1_000);
    wait_until("the writer's own rollover", || log.disk_full().is_none());
    wait_until("the replayed file to be deleted", || {
        files() == ["00000000000000000002.wal"]
    });
}

/// A failed fsync of a dispatch log poisons the log like every other failed sync: the outcome may be
/// lost with the pages the kernel dropped, and writing it again would not tell.
#[test]
fn a_failed_dispatch_sync_poisons_the_log() {
    let (_dir, _, log) = new_log();
    let a = append_one(&log, T0 + HOUR_MS, "a");
    let delivered = Outcome {
        seq: a.location.seq,
        at_ms: T0,
        attempt: 0,
        kind: OutcomeKind::Delivered,
    };
    log.inject_fault(Fault::DispatchSyncFails);
    let err = log
        .record_outcomes(&[(a.location.bucket, delivered)])
        .unwrap_err();
    assert!(!err.is_disk_full(), "{err}");
    let cause = log.poisoned().expect("poisoned");
    assert!(cause.contains("/dispatch/"), "{cause}");
    assert!(matches!(
        log.append(vec![message(T0, "after")]).wait(),
        Err(AppendError::Poisoned(_))
    ));
}
