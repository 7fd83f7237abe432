//! Whole-engine tests. Test builds shrink frames, groups and the unsynced window (see frame.rs and
//! commit.rs) and the tests use 8 KiB WAL files (one block of frames), so rollover and the tail policy are exercised constantly.

mod crash;
mod disk_full;
mod kill;
mod listing;
mod model;
mod replicated;
mod schedules;

use crate::fault::Fault;
use crate::*;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// 2026-12-01T09:30:00Z
pub(crate) const T0: i64 = 1_796_117_400_000;
pub(crate) const HOUR_MS: i64 = 3_600_000;

pub(crate) fn options(clock: &Arc<ManualClock>) -> Options {
    Options {
        wal_segment_bytes: 8192,
        // Checkpoints only when a test asks (and on clean close), so crashes leave WAL to replay.
        checkpoint_interval: Duration::from_secs(3600),
        checkpoint_bytes: u64::MAX,
        clock: clock.clone(),
        ..Options::default()
    }
}

pub(crate) fn message(deliver_at_ms: i64, body: &str) -> EncodedMessage {
    NewMessage {
        deliver_at_ms,
        topic: "orders.timeout".into(),
        key: Some("order-42".into()),
        headers: vec![("traceparent".into(), "00-abc".into())],
        sink: "broker".into(),
        body: body.as_bytes().to_vec(),
        retry_of: None,
        dedup: false,
    }
    .encode()
    .unwrap()
}

pub(crate) fn append_one(log: &ScheduleLog, deliver_at_ms: i64, body: &str) -> Appended {
    let mut appended = log
        .append(vec![message(deliver_at_ms, body)])
        .wait()
        .unwrap();
    appended.pop().unwrap()
}

/// Every message in every segment, by seq, checking no seq appears twice.
pub(crate) fn all_messages(log: &ScheduleLog) -> std::collections::BTreeMap<u64, Message> {
    let mut all = std::collections::BTreeMap::new();
    log.wait_replayed(0); // everything acknowledged so far is filed
    for bucket in log.buckets() {
        let reader = log.reader(bucket).unwrap().unwrap();
        for entry in reader.entries(0, reader.len()).unwrap() {
            let message = reader.read(&entry).unwrap();
            assert_eq!(
                Bucket::of(
                    message.deliver_at_ms.max(message.created_at_ms),
                    log.segment_minutes()
                ),
                bucket
            );
            assert!(
                all.insert(entry.seq, message).is_none(),
                "seq {} twice",
                entry.seq
            );
        }
    }
    all
}

/// A `delivered` outcome for the record `seq` of `bucket`.
pub(crate) fn delivered(bucket: Bucket, seq: u64) -> (Bucket, Outcome) {
    (
        bucket,
        Outcome {
            seq,
            at_ms: T0,
            attempt: 0,
            kind: OutcomeKind::Delivered,
        },
    )
}

/// The replayer's reports of `log` from now on (see [`ScheduleLog::set_tap`]).
pub(crate) fn tap(log: &ScheduleLog) -> crossbeam_channel::Receiver<Replayed> {
    let (tap, reports) = crossbeam_channel::unbounded();
    log.set_tap(tap);
    reports
}

/// `options` with a checkpoint every 20 ms (where the test options otherwise checkpoint only on request).
pub(crate) fn quick_checkpoints(options: Options) -> Options {
    Options {
        checkpoint_interval: Duration::from_millis(20),
        ..options
    }
}

/// Polls `condition` until it holds; panics after 10 s with `what`.
pub(crate) fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The `next_seq` of the checkpoint stored in `dir`.
pub(crate) fn checkpointed_seq(dir: &Path) -> u64 {
    checkpoint::Checkpoint::load(&dir.join("checkpoint"), SegmentMinutes::DEFAULT)
        .unwrap()
        .next_seq
}

pub(crate) fn open(dir: &Path, clock: &Arc<ManualClock>) -> ScheduleLog {
    ScheduleLog::open(dir, options(clock)).unwrap()
}

/// A log opened with the test options in a new directory, its manual clock at `T0`. The directory is
/// deleted when the returned handle is dropped, so a test keeps it (if only as `_dir`) while it runs.
pub(crate) fn new_log() -> (tempfile::TempDir, Arc<ManualClock>, ScheduleLog) {
    new_log_with(options)
}

/// [`new_log`] with other options, made from the test clock (mostly the test options, changed).
pub(crate) fn new_log_with(
    options: impl FnOnce(&Arc<ManualClock>) -> Options,
) -> (tempfile::TempDir, Arc<ManualClock>, ScheduleLog) {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let log = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
    (dir, clock, log)
}

#[test]
fn append_lookup_and_reopen() {
    let (dir, clock, log) = new_log();
    let a = append_one(&log, T0 + 30 * 60_000, "order 42 unpaid");
    let b = append_one(&log, T0 + 3 * HOUR_MS, "later");
    assert_eq!(a.id.first, a.location);
    assert_eq!(a.location.bucket.to_string(), "20261201T1000Z");
    assert_eq!(b.location.bucket.to_string(), "20261201T1200Z");
    assert_eq!(b.location.seq, a.location.seq + 1);

    let status = log.lookup(a.id).unwrap().unwrap();
    assert_eq!(status.state, MessageState::Pending);
    assert_eq!(status.message.body, b"order 42 unpaid");
    assert_eq!(status.message.created_at_ms, T0);
    assert_eq!(status.message.key.as_deref(), Some("order-42"));
    assert_eq!(
        status.message.headers,
        vec![("traceparent".to_string(), "00-abc".to_string())]
    );
    log.close().unwrap();

    let log = open(dir.path(), &clock);
    assert_eq!(log.lookup(b.id).unwrap().unwrap().message.body, b"later");
    let c = append_one(&log, T0, "after reopen");
    assert_eq!(
        c.location.seq,
        b.location.seq + 1,
        "seqs continue across reopen"
    );
    assert_eq!(all_messages(&log).len(), 3);
}

#[test]
fn past_deliver_at_is_filed_under_the_commit_bucket() {
    let (_dir, _, log) = new_log();
    let late = append_one(&log, T0 - 48 * HOUR_MS, "overdue");
    assert_eq!(
        late.location.bucket,
        Bucket::of(T0, SegmentMinutes::DEFAULT)
    );
    assert_eq!(
        log.lookup(late.id).unwrap().unwrap().message.deliver_at_ms,
        T0 - 48 * HOUR_MS
    );
}

#[test]
fn unknown_ids_are_not_found() {
    let (_dir, _, log) = new_log();
    let a = append_one(&log, T0, "x");
    let mut other = a.id;
    other.first.seq += 100;
    assert_eq!(log.lookup(other).unwrap(), None);
    let mut wrong_bucket = a.id;
    wrong_bucket.first.bucket = Bucket::of(T0 + 10 * HOUR_MS, SegmentMinutes::DEFAULT);
    assert_eq!(log.lookup(wrong_bucket).unwrap(), None);
}

#[test]
fn cancel_outcomes_and_retries_show_in_status() {
    let (dir, clock, log) = new_log();
    let cancelled = append_one(&log, T0 + 60_000, "c");
    let delivered = append_one(&log, T0 + 60_000, "d");
    let retried = append_one(&log, T0 + 60_000, "r");

    clock.advance(5);
    log.cancel(cancelled.location).wait().unwrap();
    log.record_outcomes(&[(
        delivered.location.bucket,
        Outcome {
            seq: delivered.location.seq,
            at_ms: T0 + 60_001,
            attempt: 0,
            kind: OutcomeKind::Delivered,
        },
    )])
    .unwrap();

    // A retry: the next attempt goes through the WAL with the same id, then the old attempt points to it.
    let next = NewMessage {
        deliver_at_ms: T0 + 2 * HOUR_MS,
        topic: "orders.timeout".into(),
        sink: "broker".into(),
        body: b"r".to_vec(),
        retry_of: Some((retried.id, 1)),
        ..Default::default()
    };
    let again = log.append(vec![next.encode().unwrap()]).wait().unwrap()[0];
    assert_eq!(again.id, retried.id);
    assert_ne!(again.location, retried.location);
    let kind = OutcomeKind::Retried {
        next: again.location,
        reason: "HTTP 503".into(),
    };
    log.record_outcomes(&[(
        retried.location.bucket,
        Outcome {
            seq: retried.location.seq,
            at_ms: T0 + 60_002,
            attempt: 0,
            kind,
        },
    )])
    .unwrap();

    let check = |log: &ScheduleLog| {
        assert_eq!(
            log.lookup(cancelled.id).unwrap().unwrap().state,
            MessageState::Cancelled { at_ms: T0 + 5 }
        );
        assert_eq!(
            log.lookup(delivered.id).unwrap().unwrap().state,
            MessageState::Delivered { at_ms: T0 + 60_001 }
        );
        let status = log.lookup(retried.id).unwrap().unwrap();
        assert_eq!(status.state, MessageState::Pending);
        assert_eq!(status.message.attempt, 1);
        assert_eq!(status.location, again.location);
        assert_eq!(status.last_retry_reason.as_deref(), Some("HTTP 503"));
    };
    check(&log);
    log.crash();
    let log = open(dir.path(), &clock);
    check(&log);
}

/// A retry the dispatcher wrote but whose `retried` outcome it never recorded (the log was poisoned, or
/// it shut down, in between): the lookup still finds the newest attempt, through the pointer the replayer
/// filed under the first attempt, before and after a crash; an attempt left without an outcome is
/// reported orphaned; the first attempt counts as finished for the loader.
#[test]
fn a_retry_whose_outcome_was_never_recorded_is_still_found() {
    let (dir, clock, log) = new_log();
    let first = append_one(&log, T0 + 60_000, "r");
    let retry = |attempt: u16, deliver_at_ms: i64| NewMessage {
        deliver_at_ms,
        topic: "orders.timeout".into(),
        sink: "broker".into(),
        body: b"r".to_vec(),
        retry_of: Some((first.id, attempt)),
        ..Default::default()
    };
    let append =
        |log: &ScheduleLog, m: NewMessage| log.append(vec![m.encode().unwrap()]).wait().unwrap()[0];

    // Attempt 1 is written; the `retried` outcome of attempt 0 is not.
    clock.advance(60_000);
    let one = append(&log, retry(1, T0 + 2 * HOUR_MS));
    let status = log.lookup(first.id).unwrap().unwrap();
    assert_eq!(status.location, one.location, "the newest attempt");
    assert_eq!(status.message.attempt, 1);
    assert_eq!(status.state, MessageState::Pending);
    assert_eq!(
        status.last_retry_reason, None,
        "its reason was never recorded"
    );
    assert!(
        status.orphaned.is_empty(),
        "the first attempt has the pointer as its outcome"
    );
    let snapshot = log.watch(first.location.bucket).unwrap();
    assert!(
        snapshot.pending.iter().all(|e| e.seq != first.location.seq),
        "the loader does not deliver attempt 0 again"
    );

    // Now attempt 0's outcome is recorded, attempt 2 written, and attempt 1's outcome lost.
    log.record_outcomes(&[(
        first.location.bucket,
        Outcome {
            seq: first.location.seq,
            at_ms: T0 + 60_000,
            attempt: 0,
            kind: OutcomeKind::Retried {
                next: one.location,
                reason: "HTTP 503".into(),
            },
        },
    )])
    .unwrap();
    clock.set(T0 + 2 * HOUR_MS);
    let two = append(&log, retry(2, T0 + 3 * HOUR_MS));
    let check = |log: &ScheduleLog| {
        let status = log.lookup(first.id).unwrap().unwrap();
        assert_eq!(status.location, two.location);
        assert_eq!(status.message.attempt, 2);
        assert_eq!(status.state, MessageState::Pending);
        assert_eq!(status.orphaned, vec![one.location]);
    };
    check(&log);
    log.crash();
    let log = open(dir.path(), &clock);
    check(&log);

    // Once attempt 2 is delivered, that is the message's state.
    log.record_outcomes(&[(
        two.location.bucket,
        Outcome {
            seq: two.location.seq,
            at_ms: T0 + 3 * HOUR_MS,
            attempt: 2,
            kind: OutcomeKind::Delivered,
        },
    )])
    .unwrap();
    let status = log.lookup(first.id).unwrap().unwrap();
    assert_eq!(status.location, two.location);
    assert!(matches!(status.state, MessageState::Delivered { .. }));
}

#[test]
fn a_second_open_of_the_same_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let _log = open(dir.path(), &clock);
    let err = ScheduleLog::open(dir.path(), options(&clock)).unwrap_err();
    assert!(matches!(err, Error::Locked(_)), "{err}");
    assert!(err.to_string().contains("in use by another process"));
}

#[test]
fn segment_minutes_is_fixed_per_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    open(dir.path(), &clock).close().unwrap();
    let other = Options {
        segment_minutes: SegmentMinutes::new(15).unwrap(),
        ..options(&clock)
    };
    let err = ScheduleLog::open(dir.path(), other).unwrap_err();
    assert!(
        matches!(
            err,
            Error::SegmentMinutesMismatch {
                stored: 60,
                configured: 15
            }
        ),
        "{err}"
    );
}

#[test]
fn many_appends_roll_over_wal_files_and_checkpoints_delete_them() {
    let (dir, clock, log) = new_log();
    let body = "x".repeat(300);
    let mut ids = Vec::new();
    for i in 0..40 {
        let batch: Vec<_> = (0..5)
            .map(|j| message(T0 + (i * 5 + j) * 97_000, &body))
            .collect();
        ids.extend(log.append(batch).wait().unwrap());
    }
    let wal_files = || wal::list(&dir.path().join("wal")).unwrap().len();
    assert!(
        wal_files() > 20,
        "200 x 400 B records in 4 KiB files: {}",
        wal_files()
    );
    log.checkpoint().unwrap();
    assert_eq!(
        wal_files(),
        1,
        "replayed WAL files are deleted after a checkpoint"
    );
    for appended in &ids {
        assert!(log.lookup(appended.id).unwrap().is_some());
    }
    log.crash();
    let log = open(dir.path(), &clock);
    assert_eq!(all_messages(&log).len(), 200);
}

/// A checkpoint whose syncs take long (held at the gate) holds up neither the replayer (groups are
/// still filed, lookups answered) nor a newer checkpoint; and once it goes on it stores nothing, so the
/// stored checkpoint never goes back.
#[test]
fn a_slow_checkpoint_holds_up_neither_the_replayer_nor_a_newer_checkpoint() {
    let (dir, clock, log) = new_log_with(|clock| quick_checkpoints(options(clock)));
    let gate = log.checkpoint_gate();
    let count = |n: &std::sync::atomic::AtomicU32| n.load(std::sync::atomic::Ordering::SeqCst);
    // (The open made a checkpoint already.)
    let before = count(&gate.finished);
    gate.hold_next(true);
    let first = append_one(&log, T0 + HOUR_MS, "first");
    wait_until("a checkpoint job waits at the gate", || {
        count(&gate.reached) == before + 1
    });
    let later: Vec<_> = (2..6)
        .map(|h| append_one(&log, T0 + h * HOUR_MS, "later"))
        .collect();
    let last = later.last().unwrap().location.seq;
    wait_until("the replayer files groups meanwhile", || {
        log.filed_below() > last
    });
    for appended in later.iter().chain([&first]) {
        assert!(log.lookup(appended.id).unwrap().is_some());
    }
    log.checkpoint().unwrap();
    assert_eq!(checkpointed_seq(dir.path()), last + 1);
    gate.hold_next(false);
    wait_until("the held job finishes", || {
        count(&gate.finished) == before + 2
    });
    assert_eq!(checkpointed_seq(dir.path()), last + 1, "it went back");
    log.close().unwrap();
    let log = open(dir.path(), &clock);
    assert_eq!(all_messages(&log).len(), 5);
}

#[test]
fn concurrent_submitters_share_group_commits() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let log = Arc::new(open(dir.path(), &clock));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let log = log.clone();
            std::thread::spawn(move || {
                (0..50)
                    .map(|i| {
                        append_one(&log, T0 + i * 1000, &format!("{t}-{i}"))
                            .location
                            .seq
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut seqs: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    seqs.sort();
    let expected: Vec<u64> = (1..=400).collect();
    assert_eq!(seqs, expected, "dense, unique seqs");
    assert_eq!(all_messages(&log).len(), 400);
}

#[test]
fn interval_fsync_acks_after_the_periodic_sync() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let options = Options {
        fsync: FsyncPolicy::Interval(Duration::from_millis(5)),
        ..options(&clock)
    };
    let log = ScheduleLog::open(dir.path(), options).unwrap();
    let acks: Vec<_> = (0..20)
        .map(|i| log.append(vec![message(T0 + i, "i")]))
        .collect();
    for ack in acks {
        ack.wait().unwrap();
    }
    log.crash();
    let log = open(dir.path(), &clock);
    assert_eq!(all_messages(&log).len(), 20);
}

#[test]
fn a_failed_fsync_poisons_the_log_until_restart() {
    let (dir, clock, log) = new_log();
    let kept = append_one(&log, T0, "kept");
    log.inject_fault(Fault::Sync);
    let err = log.append(vec![message(T0, "lost")]).wait().unwrap_err();
    assert!(matches!(err, AppendError::Poisoned(_)), "{err}");
    let cause = log.poisoned().unwrap();
    let wal = dir.path().join("wal").display().to_string();
    assert!(
        cause.contains("fdatasync") && cause.contains(&wal) && cause.contains("os error 5"),
        "{cause}"
    );
    let again = log.append(vec![message(T0, "refused")]).wait().unwrap_err();
    assert!(matches!(again, AppendError::Poisoned(_)));
    assert!(matches!(
        log.cancel(kept.location).wait(),
        Err(AppendError::Poisoned(_))
    ));
    drop(log);
    let log = open(dir.path(), &clock);
    assert!(log.poisoned().is_none());
    assert!(log.lookup(kept.id).unwrap().is_some());
    append_one(&log, T0, "accepted after restart");
}

#[test]
fn retirement_waits_for_every_record_and_the_retention() {
    let (dir, clock, log) = new_log();
    let a = append_one(&log, T0 + 60_000, "a");
    let b = append_one(&log, T0 + 120_000, "b");
    let later = append_one(&log, T0 + 5 * HOUR_MS, "later");
    let bucket = a.location.bucket;
    log.record_outcomes(&[delivered(bucket, a.location.seq)])
        .unwrap();

    clock.set(bucket.end_ms(SegmentMinutes::DEFAULT) + 25 * HOUR_MS);
    assert_eq!(log.retire().unwrap(), vec![], "b is still pending");
    log.record_outcomes(&[delivered(bucket, b.location.seq)])
        .unwrap();
    clock.set(bucket.end_ms(SegmentMinutes::DEFAULT) + 23 * HOUR_MS);
    assert_eq!(log.retire().unwrap(), vec![], "within retention");
    clock.set(bucket.end_ms(SegmentMinutes::DEFAULT) + 24 * HOUR_MS);
    assert_eq!(log.retire().unwrap(), vec![bucket]);
    assert!(!dir.path().join(format!("schedule/{bucket}.log")).exists());
    assert!(!dir.path().join(format!("dispatch/{bucket}.log")).exists());
    assert_eq!(log.lookup(a.id).unwrap(), None);

    log.crash();
    let log = open(dir.path(), &clock);
    assert_eq!(
        log.buckets(),
        vec![later.location.bucket],
        "retirement survives a crash"
    );
    assert!(log.lookup(later.id).unwrap().is_some());
}

/// `read_record` keeps a bucket's log open: it reads records filed after it was opened, a read that
/// fails closes it (so a file restored in place of a damaged one is read), and a retired bucket has
/// none.
#[test]
fn records_are_read_through_a_log_kept_open_until_a_read_fails_or_the_bucket_retires() {
    let (dir, clock, log) = new_log();
    let a = append_one(&log, T0 + 60_000, "a");
    let bucket = a.location.bucket;
    let entry = |seq| {
        log.wait_replayed(seq);
        log.reader(bucket)
            .unwrap()
            .unwrap()
            .find(seq)
            .unwrap()
            .unwrap()
    };
    let body = |e: &IndexEntry| {
        log.read_record(bucket, e.offset, e.frame_len)
            .map(|m| m.map(|m| String::from_utf8(m.body).unwrap()))
    };
    let at_a = entry(a.location.seq);
    assert_eq!(body(&at_a).unwrap().as_deref(), Some("a"));
    let path = dir.path().join(format!("schedule/{bucket}.log"));
    let aside = path.with_extension("aside");
    std::fs::rename(&path, &aside).unwrap();
    assert_eq!(
        body(&at_a).unwrap().as_deref(),
        Some("a"),
        "read through the file opened before"
    );
    std::fs::rename(&aside, &path).unwrap();
    let b = append_one(&log, T0 + 120_000, "b");
    let at_b = entry(b.location.seq);
    assert_eq!(
        body(&at_b).unwrap().as_deref(),
        Some("b"),
        "filed after the log was opened"
    );

    let good = std::fs::read(&path).unwrap();
    let last = (at_a.offset + u64::from(at_a.frame_len) - 1) as usize;
    let damaged = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&damaged, &[good[last] ^ 0xff], last as u64).unwrap();
    assert!(
        matches!(body(&at_a), Err(Error::Corrupt { .. })),
        "the damage is read"
    );
    let restored = path.with_extension("restored");
    std::fs::write(&restored, &good).unwrap();
    std::fs::rename(&restored, &path).unwrap();
    assert_eq!(
        body(&at_a).unwrap().as_deref(),
        Some("a"),
        "the restored file is read"
    );

    log.record_outcomes(&[
        delivered(bucket, a.location.seq),
        delivered(bucket, b.location.seq),
    ])
    .unwrap();
    clock.set(bucket.end_ms(SegmentMinutes::DEFAULT) + 25 * HOUR_MS);
    assert_eq!(log.retire().unwrap(), vec![bucket]);
    assert_eq!(
        body(&at_b).unwrap(),
        None,
        "a retired bucket has no records"
    );
}

#[test]
fn watch_hands_off_between_snapshot_and_live_reports() {
    let (_dir, _, log) = new_log();
    let reports = tap(&log);
    let before = append_one(&log, T0 + 60_000, "before");
    let done = append_one(&log, T0 + 60_000, "done");
    log.record_outcomes(&[(
        done.location.bucket,
        Outcome {
            seq: done.location.seq,
            at_ms: T0,
            attempt: 0,
            kind: OutcomeKind::Delivered,
        },
    )])
    .unwrap();
    let snapshot = log.watch(before.location.bucket).unwrap();
    assert_eq!(
        snapshot.pending.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![before.location.seq]
    );
    assert_eq!(snapshot.total, 2);
    let after = append_one(&log, T0 + 90_000, "after");
    log.cancel(before.location).wait().unwrap();
    let elsewhere = append_one(&log, T0 + 9 * HOUR_MS, "not watched");
    assert!(log.wait_replayed(elsewhere.location.seq));
    let got: Vec<_> = reports.try_iter().collect();
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(matches!(got[0], Replayed::Scheduled { entry, .. } if entry.seq == after.location.seq));
    assert!(matches!(got[1], Replayed::Cancelled { target, .. } if target == before.location));
}

/// While the replayer lingers for more groups, the messages of watched buckets are filed ahead of the
/// rest (`Replay::apply_watched`). A bucket that becomes watched between two early filings must still
/// get its records in seq order, each once (a record not above a segment's last seq counts as filed, so
/// a later record filed first would hide an earlier one), each reported to the tap once; the full apply
/// then files the rest and doubles nothing; a cancel of a watched bucket's message ends the wait.
#[test]
fn watched_buckets_are_filed_ahead_in_seq_order_and_once() {
    use crate::replay::Replay;
    use crate::wal::WalRecord;
    let source = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let log = open(source.path(), &clock);
    let (x, y) = (T0 + 2 * HOUR_MS, T0 + 5 * HOUR_MS);
    // One group per WAL file (test files hold one block of frames, and a group is padded to a block).
    let first = log
        .append(vec![message(x, "x1"), message(y, "y1"), message(x, "x2")])
        .wait()
        .unwrap();
    let second = log
        .append(vec![message(x, "x3"), message(y, "y2")])
        .wait()
        .unwrap();
    log.cancel(first[0].location).wait().unwrap();
    // Read while the log is open: test options checkpoint only on close, which retires the files.
    let files = wal::list(&source.path().join("wal")).unwrap();
    let scanned: Vec<_> = files
        .iter()
        .enumerate()
        .filter_map(|(i, (seq, path))| {
            wal::scan_file(path, *seq, i + 1 == files.len(), false, None).unwrap()
        })
        .filter(|f| !f.records.is_empty())
        .collect();
    log.close().unwrap();
    let groups: Vec<(&[u8], &[WalRecord])> = scanned
        .iter()
        .map(|f| (&f.bytes[..], &f.records[..]))
        .collect();
    // Where each group ends: the first append's, the second's, and the cancel's (last).
    let through = |seq: u64| {
        1 + groups
            .iter()
            .position(|(_, r)| r.iter().any(|r| r.seq() == seq))
            .unwrap()
    };
    let (to_first, to_second) = (
        through(first[2].location.seq),
        through(second[1].location.seq),
    );
    assert!(to_first < to_second && to_second < groups.len());

    let target = tempfile::tempdir().unwrap();
    for dir in ["schedule", "dispatch"] {
        std::fs::create_dir(target.path().join(dir)).unwrap();
    }
    let width = SegmentMinutes::DEFAULT;
    let mut replay =
        Replay::open(target.path(), width, &checkpoint::Checkpoint::empty(), 1).unwrap();
    let dispatch = dispatch::DispatchLogs::new(&target.path().join("dispatch"), width);
    let (tap, reports) = crossbeam_channel::unbounded();
    replay.tap = Some(tap);
    let (bx, by) = (first[0].location.bucket, first[1].location.bucket);

    assert!(!replay.apply_watched(&groups[..to_first]).unwrap());
    assert_eq!(replay.entries(bx), None, "not watched yet: nothing filed");
    replay.watched.insert(bx);
    assert!(!replay.apply_watched(&groups[..to_second]).unwrap());
    assert!(
        replay.apply_watched(&groups).unwrap(),
        "a cancel of a watched bucket's message does not wait"
    );
    let seqs = |replay: &Replay, bucket| {
        let entries = replay.entries(bucket).unwrap();
        let reader = SegmentReader::open(replay.schedule_dir(), bucket, entries).unwrap();
        let read = reader.entries(0, reader.len()).unwrap();
        read.iter().map(|e| e.seq).collect::<Vec<_>>()
    };
    let in_x = vec![
        first[0].location.seq,
        first[2].location.seq,
        second[0].location.seq,
    ];
    assert_eq!(seqs(&replay, bx), in_x);
    assert_eq!(replay.entries(by), None, "an unwatched bucket waits");
    assert_eq!(replay.next_seq, 1, "nothing counts as applied yet");

    replay.apply(&groups, &dispatch).unwrap();
    assert_eq!(seqs(&replay, bx), in_x, "nothing doubled");
    assert_eq!(
        seqs(&replay, by),
        vec![first[1].location.seq, second[1].location.seq]
    );
    assert_eq!(
        replay.next_seq,
        second[1].location.seq + 2,
        "the cancel is applied too"
    );
    let scheduled: Vec<u64> = reports
        .try_iter()
        .filter_map(|r| match r {
            Replayed::Scheduled { bucket, entry } if bucket == bx => Some(entry.seq),
            Replayed::Scheduled { .. } => panic!("an unwatched bucket was reported"),
            Replayed::Cancelled { .. } => None,
        })
        .collect();
    assert_eq!(scheduled, in_x, "each reported once, in order");
}

/// A watch that fails (here: the index cannot be opened, as with EMFILE) must leave the bucket
/// unwatched: records filed meanwhile are not reported, so the retry's snapshot, which holds them, is
/// the only place they appear. Reported and in the snapshot, they would be in the wheel twice.
#[test]
fn a_failed_watch_leaves_the_bucket_unwatched_so_a_retry_neither_misses_nor_repeats() {
    let (dir, _, log) = new_log();
    let reports = tap(&log);
    let first = append_one(&log, T0 + 60_000, "first");
    let bucket = first.location.bucket;
    assert!(log.wait_replayed(first.location.seq));
    let idx = dir.path().join("schedule").join(format!("{bucket}.idx"));
    let aside = idx.with_extension("aside");
    std::fs::rename(&idx, &aside).unwrap();
    assert!(log.watch(bucket).is_err());
    let second = append_one(&log, T0 + 61_000, "second");
    assert!(log.wait_replayed(second.location.seq));
    let reported: Vec<_> = reports.try_iter().collect();
    assert!(reported.is_empty(), "{reported:?}");
    std::fs::rename(&aside, &idx).unwrap();
    let snapshot = log.watch(bucket).unwrap();
    assert_eq!(
        snapshot.pending.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![first.location.seq, second.location.seq]
    );
    let third = append_one(&log, T0 + 62_000, "third");
    assert!(log.wait_replayed(third.location.seq));
    let reported: Vec<_> = reports.try_iter().collect();
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!(
        matches!(reported[0], Replayed::Scheduled { entry, .. } if entry.seq == third.location.seq)
    );
}

/// Appenders write into a bucket while it is being watched: every record must show up exactly once,
/// either in the snapshot or in the live reports, whatever the interleaving.
#[test]
fn watch_never_loses_or_doubles_a_record_under_concurrent_appends() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let log = Arc::new(open(dir.path(), &clock));
    let reports = tap(&log);
    for round in 0..12i64 {
        let bucket_start = T0 + (round + 1) * HOUR_MS;
        let bucket = Bucket::of(bucket_start, SegmentMinutes::DEFAULT);
        let (progress_tx, progress) = crossbeam_channel::unbounded();
        let appenders: Vec<_> = (0..3)
            .map(|t| {
                let log = log.clone();
                let progress_tx = progress_tx.clone();
                std::thread::spawn(move || {
                    let mut seqs = Vec::new();
                    for i in 0..40 {
                        let batch = (0..(1 + i % 3))
                            .map(|k| message(bucket_start + i * 1000 + k, &format!("{t}")))
                            .collect();
                        seqs.extend(
                            log.append(batch)
                                .wait()
                                .unwrap()
                                .iter()
                                .map(|a| a.location.seq),
                        );
                        progress_tx.send(()).unwrap();
                    }
                    seqs
                })
            })
            .collect();
        // Watch after a round-dependent number of appends: from before the first to after the last.
        for _ in 0..round * 10 {
            progress.recv().unwrap();
        }
        let snapshot = log.watch(bucket).unwrap();
        let mut appended: Vec<u64> = appenders
            .into_iter()
            .flat_map(|a| a.join().unwrap())
            .collect();
        appended.sort();
        assert!(log.wait_replayed(*appended.last().unwrap()));
        let mut seen: Vec<u64> = snapshot.pending.iter().map(|e| e.seq).collect();
        for report in reports.try_iter() {
            match report {
                Replayed::Scheduled { bucket: b, entry } if b == bucket => seen.push(entry.seq),
                other => panic!("round {round}: unexpected report {other:?}"),
            }
        }
        seen.sort();
        assert_eq!(
            seen, appended,
            "round {round}: snapshot + live reports = every record once"
        );
        log.unwatch(bucket);
    }
}

/// A message for `sink` with an idempotency key and a header long enough that its start is read in
/// more than one piece (see `META_READ`).
fn keyed(deliver_at_ms: i64, sink: &str, key: &str) -> EncodedMessage {
    NewMessage {
        deliver_at_ms,
        topic: "orders.timeout".into(),
        key: Some(key.into()),
        headers: vec![(
            "delayd-source-position".into(),
            format!("in/{key}").repeat(20),
        )],
        sink: sink.into(),
        body: vec![7; 300],
        retry_of: None,
        dedup: true,
    }
    .encode()
    .unwrap()
}

#[test]
fn pending_keyed_messages_and_a_sinks_records_since_a_seq_are_read_without_bodies() {
    let (dir, _, log) = new_log();
    let appended = log
        .append(vec![
            keyed(T0 + 1000, "out", "a"),
            keyed(T0 + 2 * HOUR_MS, "out", "b"),
            keyed(T0 + 1000, "other", "c"),
            message(T0 + 1000, "not keyed"),
            keyed(T0 + 3 * HOUR_MS, "out", "d"),
        ])
        .wait()
        .unwrap();
    // "a" is delivered: no longer pending.
    let a = appended[0].location;
    log.record_outcomes(&[delivered(a.bucket, a.seq)]).unwrap();
    let full = all_messages(&log);
    let mut keyed = Vec::new();
    log.pending_keyed(|meta| keyed.push(meta.unwrap())).unwrap();
    keyed.sort_by_key(|m| m.seq);
    let keys: Vec<_> = keyed.iter().map(|m| m.key.as_deref().unwrap()).collect();
    assert_eq!(keys, ["b", "c", "d"]);
    for meta in &keyed {
        assert_eq!(*meta, MessageMeta::from(full[&meta.seq].clone()));
    }
    // The records of "out" from the second on, whichever bucket they are in.
    let mut since = Vec::new();
    log.records_since(appended[1].location.seq, "out", |meta| {
        since.push(meta.unwrap().seq)
    })
    .unwrap();
    since.sort();
    assert_eq!(
        since,
        [appended[1].location.seq, appended[4].location.seq],
        "only the sink's records at or after the seq"
    );
    // A record whose start is damaged is handed over as its error (naming the file and offset), and
    // does not hide the others.
    let c = appended[2].location;
    let entry = log
        .reader(c.bucket)
        .unwrap()
        .unwrap()
        .find(c.seq)
        .unwrap()
        .unwrap();
    let path = dir.path().join(format!("schedule/{}.log", c.bucket));
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[0xff; 24], entry.offset).unwrap();
    let (mut read, mut damaged) = (Vec::new(), Vec::new());
    log.pending_keyed(|meta| match meta {
        Ok(meta) => read.push(meta.seq),
        Err(e) => damaged.push(e.to_string()),
    })
    .unwrap();
    read.sort();
    assert_eq!(read, [appended[1].location.seq, appended[4].location.seq]);
    assert_eq!(damaged.len(), 1);
    assert!(
        damaged[0].contains(&format!("{}", path.display()))
            && damaged[0].contains(&format!("offset {}", entry.offset)),
        "{damaged:?}"
    );
    let mut other = Vec::new();
    log.records_since(0, "other", |meta| other.push(meta.is_err()))
        .unwrap();
    assert_eq!(other, [true]);
}
