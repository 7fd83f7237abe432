//! Damage tests: cut, flip and extend the files a crash could leave behind, reopen, and check exactly
//! which records survive.

use super::*;
use crate::frame::{Frames, Kind, UNSYNCED_LIMIT};
use crate::header::HEADER_LEN;
use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn wal_file(dir: &Path) -> PathBuf {
    let files = wal::list(&dir.join("wal")).unwrap();
    assert_eq!(files.len(), 1);
    files[0].1.clone()
}

/// (start, end) file offsets of every frame in a WAL file.
fn frame_spans(path: &Path) -> Vec<(usize, usize)> {
    let bytes = fs::read(path).unwrap();
    let start = wal::DATA_START as usize;
    Frames::new(&bytes[start..])
        .filter(|(_, kind, _)| *kind != Kind::Padding)
        .map(|(at, _, payload)| (start + at, start + at + frame::HEADER_LEN + payload.len()))
        .collect()
}

/// A crashed data dir holding `count` acknowledged messages, none checkpointed.
fn crashed_image(
    count: i64,
    body_len: usize,
    wal_segment_bytes: u64,
) -> (tempfile::TempDir, Arc<ManualClock>) {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let log = ScheduleLog::open(
        dir.path(),
        Options {
            wal_segment_bytes,
            ..options(&clock)
        },
    )
    .unwrap();
    for i in 0..count {
        append_one(
            &log,
            T0 + i * 600_000,
            &format!("{i:0>width$}", width = body_len),
        );
    }
    log.crash();
    (dir, clock)
}

fn surviving_seqs(dir: &Path, clock: &Arc<ManualClock>) -> Vec<u64> {
    let log = ScheduleLog::open(dir, options(clock)).unwrap();
    let seqs = all_messages(&log).keys().copied().collect();
    log.crash();
    seqs
}

#[test]
fn wal_cut_at_every_byte_of_the_last_records() {
    let (image, clock) = crashed_image(6, 40, 64 * 1024);
    let spans = frame_spans(&wal_file(image.path()));
    assert_eq!(spans.len(), 6);
    // Every byte of the last three records, and every 61st byte of the padding between them (each
    // record is its own group, padded to a block).
    let cuts = (spans[3].0..=spans[5].1 + 3).filter(|cut| {
        spans[3..]
            .iter()
            .any(|(start, end)| (start..=end).contains(&cut))
            || cut % 61 == 0
    });
    for cut in cuts {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(image.path(), dir.path());
        let wal = wal_file(dir.path());
        fs::OpenOptions::new()
            .write(true)
            .open(&wal)
            .unwrap()
            .set_len(cut as u64)
            .unwrap();

        let expected: Vec<u64> = (1..=6u64)
            .filter(|seq| spans[*seq as usize - 1].1 <= cut)
            .collect();
        for reopen in 0..2 {
            assert_eq!(
                surviving_seqs(dir.path(), &clock),
                expected,
                "cut at {cut}, reopen {reopen}"
            );
        }
        // The log continues densely after the cut.
        let log = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
        let next = append_one(&log, T0, "next");
        assert_eq!(next.location.seq, expected.len() as u64 + 1, "cut at {cut}");
        log.crash();
        let mut with_next = expected.clone();
        with_next.push(next.location.seq);
        assert_eq!(
            surviving_seqs(dir.path(), &clock),
            with_next,
            "cut at {cut}, after appending"
        );
    }
}

#[test]
fn wal_flipped_byte_in_the_last_record_drops_only_that_record() {
    let (image, clock) = crashed_image(5, 30, 64 * 1024);
    let spans = frame_spans(&wal_file(image.path()));
    let (start, end) = spans[4];
    for at in start..end {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(image.path(), dir.path());
        let wal = wal_file(dir.path());
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&wal)
            .unwrap();
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, at as u64).unwrap();
        file.write_all_at(&[byte[0] ^ 0x10], at as u64).unwrap();
        assert_eq!(
            surviving_seqs(dir.path(), &clock),
            vec![1, 2, 3, 4],
            "flip at {at}"
        );
        assert_eq!(
            surviving_seqs(dir.path(), &clock),
            vec![1, 2, 3, 4],
            "flip at {at}, second reopen"
        );
    }
}

#[test]
fn wal_damage_before_synced_data_is_reported_not_cut() {
    let (image, clock) = crashed_image(16, 400, 128 * 1024);
    let wal = wal_file(image.path());
    let spans = frame_spans(&wal);
    let (start, _) = spans[1];
    assert!(
        spans[15].1 - start > UNSYNCED_LIMIT,
        "more than the unsynced window follows the damage"
    );
    let file = fs::OpenOptions::new().write(true).open(&wal).unwrap();
    file.write_all_at(&[0xff; 4], start as u64 + 20).unwrap();
    let err = ScheduleLog::open(image.path(), options(&clock)).unwrap_err();
    match &err {
        Error::Corrupt { path, offset, .. } => {
            assert_eq!(path, &wal);
            assert_eq!(*offset, start as u64);
        }
        other => panic!("expected corruption, got {other}"),
    }
    assert!(
        err.to_string().contains(&format!("at offset {start}")),
        "{err}"
    );
    // Opening again gives the same answer: nothing was cut.
    assert!(matches!(
        ScheduleLog::open(image.path(), options(&clock)),
        Err(Error::Corrupt { .. })
    ));
}

#[test]
fn garbage_after_the_wal_tail_is_cut_and_reopen_is_idempotent() {
    let (dir, clock) = crashed_image(4, 20, 64 * 1024);
    let wal = wal_file(dir.path());
    let end = frame_spans(&wal).last().unwrap().1;
    let garbage: Vec<u8> = (0..300u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 | 1)
        .collect();
    fs::OpenOptions::new()
        .write(true)
        .open(&wal)
        .unwrap()
        .write_all_at(&garbage, end as u64)
        .unwrap();
    let mut expected = vec![1, 2, 3, 4];
    for round in 0..10u64 {
        assert_eq!(
            surviving_seqs(dir.path(), &clock),
            expected,
            "round {round}"
        );
        let log = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
        expected.push(append_one(&log, T0, "more").location.seq);
        log.crash();
    }
}

#[test]
fn a_torn_new_wal_file_is_removed() {
    let (dir, clock) = crashed_image(3, 20, 64 * 1024);
    let torn = wal::wal_path(&dir.path().join("wal"), 4);
    fs::write(&torn, [0u8; 20]).unwrap();
    assert_eq!(surviving_seqs(dir.path(), &clock), vec![1, 2, 3]);
    assert!(!torn.exists());
    let log = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
    assert_eq!(append_one(&log, T0, "x").location.seq, 4);
}

/// A checkpoint lost (or older than the WAL) after the WAL moved on: the open refuses, naming the
/// checkpoint, and cuts nothing: the segments holding the acknowledged messages are untouched, and
/// the data dir opens again once the checkpoint is back.
#[test]
fn a_lost_checkpoint_refuses_the_open_and_cuts_no_segment() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let small = Options {
        wal_segment_bytes: 16 * 1024,
        ..options(&clock)
    };
    let log = ScheduleLog::open(dir.path(), small.clone()).unwrap();
    for i in 0..200 {
        append_one(&log, T0 + i * 3_600_000, &format!("{i:0>200}"));
    }
    log.checkpoint().unwrap();
    drop(log);
    let first_wal = wal::list(&dir.path().join("wal")).unwrap()[0].0;
    assert!(first_wal > 1, "the WAL moved on past its first file");
    let sizes = |dir: &Path| -> Vec<(PathBuf, u64)> {
        let mut all: Vec<_> = fs::read_dir(dir.join("schedule"))
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.path(), e.metadata().unwrap().len())
            })
            .collect();
        all.sort();
        all
    };
    let before = sizes(dir.path());
    assert!(before.len() >= 200, "{} segment files", before.len());
    let checkpoint = dir.path().join("checkpoint");
    let saved = fs::read(&checkpoint).unwrap();
    fs::remove_file(&checkpoint).unwrap();
    let error = ScheduleLog::open(dir.path(), small.clone()).err().unwrap();
    let said = error.to_string();
    assert!(
        said.contains("checkpoint") && said.contains("nothing was changed"),
        "{said}"
    );
    assert_eq!(sizes(dir.path()), before, "no segment deleted or cut");
    fs::write(&checkpoint, saved).unwrap();
    let log = ScheduleLog::open(dir.path(), small.clone()).unwrap();
    assert_eq!(all_messages(&log).len(), 200);
    log.checkpoint().unwrap();
    drop(log);

    // No WAL file at all (a crash can leave none) beside a checkpoint that covers everything: the
    // open makes a new WAL file and loses nothing.
    for (_, path) in wal::list(&dir.path().join("wal")).unwrap() {
        fs::remove_file(path).unwrap();
    }
    let log = ScheduleLog::open(dir.path(), small.clone()).unwrap();
    assert_eq!(all_messages(&log).len(), 200);
    drop(log);

    // Neither a WAL file nor a checkpoint: refused, nothing cut.
    for (_, path) in wal::list(&dir.path().join("wal")).unwrap() {
        fs::remove_file(path).unwrap();
    }
    fs::remove_file(&checkpoint).unwrap();
    let before = sizes(dir.path());
    let said = ScheduleLog::open(dir.path(), small)
        .err()
        .unwrap()
        .to_string();
    assert!(
        said.contains("neither a checkpoint nor a WAL file"),
        "{said}"
    );
    assert_eq!(sizes(dir.path()), before, "no segment deleted or cut");
}

#[test]
fn segment_tails_past_the_checkpoint_are_cut_and_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let log = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
    for i in 0..3 {
        append_one(&log, T0 + i, "checkpointed");
    }
    log.checkpoint().unwrap();
    for i in 0..3 {
        append_one(&log, T0 + i, "replayed only");
    }
    // Wait until the replayer has filed everything, then crash.
    assert!(log
        .read(Location {
            bucket: Bucket::of(T0, SegmentMinutes::DEFAULT),
            seq: 6
        })
        .unwrap()
        .is_some());
    log.crash();
    let bucket = Bucket::of(T0, SegmentMinutes::DEFAULT);
    for ext in ["log", "idx"] {
        let path = dir.path().join(format!("schedule/{bucket}.{ext}"));
        fs::OpenOptions::new()
            .append(true)
            .open(path)
            .unwrap()
            .write_all(&[0xab; 77])
            .unwrap();
    }
    assert_eq!(surviving_seqs(dir.path(), &clock), vec![1, 2, 3, 4, 5, 6]);
}

#[test]
fn dispatch_log_cut_inside_its_last_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let log = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
    let ids: Vec<_> = (0..3).map(|i| append_one(&log, T0 + i, "m")).collect();
    let bucket = ids[0].location.bucket;
    for appended in &ids {
        let outcome = Outcome {
            seq: appended.location.seq,
            at_ms: T0,
            attempt: 0,
            kind: OutcomeKind::Delivered,
        };
        log.record_outcomes(&[(bucket, outcome)]).unwrap();
    }
    log.close().unwrap();
    let path = dir.path().join(format!("dispatch/{bucket}.log"));
    let image = fs::read(&path).unwrap();
    let frames: Vec<_> = Frames::new(&image[HEADER_LEN..])
        .map(|(at, _, p)| (HEADER_LEN + at, p.len()))
        .collect();
    let (last_start, last_len) = frames[2];
    for cut in last_start..last_start + frame::HEADER_LEN + last_len {
        fs::write(&path, &image[..cut]).unwrap();
        let log = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
        assert_eq!(
            log.lookup(ids[1].id).unwrap().unwrap().state,
            MessageState::Delivered { at_ms: T0 }
        );
        assert_eq!(
            log.lookup(ids[2].id).unwrap().unwrap().state,
            MessageState::Pending,
            "cut {cut}"
        );
        // Appending after the torn tail works and is read back.
        let outcome = Outcome {
            seq: ids[2].location.seq,
            at_ms: T0 + 1,
            attempt: 0,
            kind: OutcomeKind::Dead { reason: "r".into() },
        };
        log.record_outcomes(&[(bucket, outcome)]).unwrap();
        assert!(
            matches!(
                log.lookup(ids[2].id).unwrap().unwrap().state,
                MessageState::Dead { .. }
            ),
            "cut {cut}"
        );
        log.close().unwrap();
    }
}

#[test]
fn a_cancel_recovered_with_its_message_still_cancels_it() {
    // Both records in one WAL file, so that recovery applies them in one call, and in a bucket that no
    // checkpoint lists yet: the cancel must be kept even though its bucket appears only in that call.
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let options = || Options {
        wal_segment_bytes: 1 << 20,
        ..options(&clock)
    };
    let log = ScheduleLog::open(dir.path(), options()).unwrap();
    let kept = append_one(&log, T0 + 5 * HOUR_MS, "kept");
    let cancelled = append_one(&log, T0 + 5 * HOUR_MS, "cancelled");
    log.cancel(cancelled.location).wait().unwrap();
    log.crash();
    // As if the crash came before the replayer got to the cancel (it trails the WAL writer): the
    // dispatch log holds nothing but that cancel's outcome.
    fs::remove_dir_all(dir.path().join("dispatch")).unwrap();
    fs::create_dir(dir.path().join("dispatch")).unwrap();

    let log = ScheduleLog::open(dir.path(), options()).unwrap();
    assert_eq!(
        log.lookup(cancelled.id).unwrap().unwrap().state,
        MessageState::Cancelled { at_ms: T0 }
    );
    assert_eq!(
        log.lookup(kept.id).unwrap().unwrap().state,
        MessageState::Pending
    );
}
