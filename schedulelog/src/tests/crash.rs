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

/// The seqs a crashed data dir holds once opened with `options` (crashing again after).
fn surviving(dir: &Path, options: Options) -> Vec<u64> {
    let log = ScheduleLog::open(dir, options).unwrap();
    let seqs = all_messages(&log).keys().copied().collect();
    log.crash();
    seqs
}

fn surviving_seqs(dir: &Path, clock: &Arc<ManualClock>) -> Vec<u64> {
    surviving(dir, options(clock))
}

/// `rounds` times: the data dir holds exactly `expected`; then one more message is appended before a
/// crash (and expected next round). So a tail cut once stays cut, and appends after it survive.
fn reopen_and_append(
    dir: &Path,
    options: impl Fn() -> Options,
    expected: &mut Vec<u64>,
    rounds: u64,
) {
    for round in 0..rounds {
        assert_eq!(surviving(dir, options()), *expected, "round {round}");
        let log = ScheduleLog::open(dir, options()).unwrap();
        expected.push(append_one(&log, T0, "more").location.seq);
        log.crash();
    }
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
        let log = open(dir.path(), &clock);
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
    reopen_and_append(dir.path(), || options(&clock), &mut vec![1, 2, 3, 4], 10);
}

#[test]
fn a_torn_new_wal_file_is_removed() {
    let (dir, clock) = crashed_image(3, 20, 64 * 1024);
    let torn = wal::wal_path(&dir.path().join("wal"), 4);
    fs::write(&torn, [0u8; 20]).unwrap();
    assert_eq!(surviving_seqs(dir.path(), &clock), vec![1, 2, 3]);
    assert!(!torn.exists());
    let log = open(dir.path(), &clock);
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

/// A checkpoint taken while the replayer filed a watched bucket's messages ahead of their group holds a
/// segment with seqs at or above its `next_seq`. Should the WAL's tail then be lost, recovery must hand
/// out new seqs above every seq a segment holds: a new record with a held seq would be taken for filed
/// and skipped (lost), and a seq would name two messages.
#[test]
fn new_seqs_start_above_every_filed_record_when_the_checkpoint_is_behind() {
    let (dir, clock, log) = new_log();
    let a = append_one(&log, T0 + HOUR_MS, "a");
    let b = append_one(&log, T0 + HOUR_MS, "b");
    log.close().unwrap();
    let path = dir.path().join("checkpoint");
    let mut checkpoint = checkpoint::Checkpoint::load(&path, SegmentMinutes::DEFAULT).unwrap();
    assert!(checkpoint
        .segments
        .values()
        .any(|m| m.last_seq == b.location.seq));
    checkpoint.next_seq = a.location.seq;
    checkpoint.store(&path, SegmentMinutes::DEFAULT).unwrap();
    for entry in fs::read_dir(dir.path().join("wal")).unwrap() {
        fs::remove_file(entry.unwrap().path()).unwrap();
    }

    let log = open(dir.path(), &clock);
    let c = append_one(&log, T0 + HOUR_MS, "c");
    assert!(c.location.seq > b.location.seq, "{c:?} after {b:?}");
    let all = all_messages(&log);
    let bodies: Vec<&[u8]> = all.values().map(|m| &m.body[..]).collect();
    assert_eq!(bodies, [&b"a"[..], b"b", b"c"]);
    assert_eq!(log.lookup(c.id).unwrap().unwrap().message.body, b"c");
}

#[test]
fn segment_tails_past_the_checkpoint_are_cut_and_replayed() {
    let (dir, clock, log) = new_log();
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
    let (dir, clock, log) = new_log();
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
        let log = open(dir.path(), &clock);
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

/// A crashed data dir whose newest WAL file is a reused one: appends filled a few 64 KiB files, a
/// checkpoint retired them as spares, and more appends rolled into a spare. The first appends are small
/// groups and the later ones large, so that the reused file's earlier frames reach past its new ones.
/// Returns the dir, its clock, the acknowledged seqs and the newest WAL file.
fn reused_image() -> (tempfile::TempDir, Arc<ManualClock>, Vec<u64>, PathBuf) {
    let (dir, clock, log) = new_log_with(reuse_options);
    let mut acked = append_checkpointed(&log, 96, 5);
    let spares = || {
        let names = fs::read_dir(dir.path().join("wal")).unwrap();
        names
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("spare-")
            })
            .count()
    };
    assert!(
        spares() >= 2,
        "the checkpoint kept retired files: {}",
        spares()
    );
    append_batches(&log, 12, 20, &mut acked);
    log.crash();
    let (first_seq, newest) = wal::list(&dir.path().join("wal")).unwrap().pop().unwrap();
    // It is a reused file: past its own records lie frames of an earlier use.
    let bytes = fs::read(&newest).unwrap();
    let stale = (wal::DATA_START as usize..bytes.len())
        .step_by(frame::BLOCK)
        .filter_map(|b| wal::record_seq(&bytes[b..]))
        .filter(|&seq| seq < first_seq)
        .count();
    assert!(stale > 0, "the newest WAL file was not a reused one");
    (dir, clock, acked, newest)
}

/// Appends `batches` requests of `size` 300-byte messages each, adding their seqs to `acked`.
fn append_batches(log: &ScheduleLog, batches: i64, size: i64, acked: &mut Vec<u64>) {
    let body = "r".repeat(300);
    for i in 0..batches {
        let batch = (0..size).map(|j| message(T0 + (i * size + j) * 61_000, &body));
        let appended = log.append(batch.collect()).wait().unwrap();
        acked.extend(appended.iter().map(|a| a.location.seq));
    }
}

/// [`append_batches`] into a new list, then a checkpoint.
fn append_checkpointed(log: &ScheduleLog, batches: i64, size: i64) -> Vec<u64> {
    let mut acked = Vec::new();
    append_batches(log, batches, size, &mut acked);
    log.checkpoint().unwrap();
    acked
}

fn reuse_options(clock: &Arc<ManualClock>) -> Options {
    Options {
        wal_segment_bytes: 64 * 1024,
        ..options(clock)
    }
}

fn surviving_after_reuse(dir: &Path, clock: &Arc<ManualClock>) -> Vec<u64> {
    surviving(dir, reuse_options(clock))
}

#[test]
fn a_reused_wal_file_replays_its_own_records_and_never_its_earlier_ones() {
    let (dir, clock, mut acked, _) = reused_image();
    reopen_and_append(dir.path(), || reuse_options(&clock), &mut acked, 3);
}

/// Reused files that are not the newest: their own logs end at a block boundary inside an earlier use's
/// group (large groups then, small ones now), where no frame starts.
#[test]
fn reused_wal_files_behind_the_newest_end_inside_an_earlier_group() {
    let (dir, clock, log) = new_log_with(reuse_options);
    let mut acked = append_checkpointed(&log, 24, 20);
    append_batches(&log, 48, 5, &mut acked);
    log.crash();
    let files = wal::list(&dir.path().join("wal")).unwrap();
    assert!(files.len() >= 3, "{files:?}");
    let mut out = Vec::new();
    let clean = inspect(&files[files.len() - 2].1, &mut out).unwrap();
    assert!(clean, "{}", String::from_utf8_lossy(&out));
    assert_eq!(surviving_after_reuse(dir.path(), &clock), acked);
}

#[test]
fn a_torn_write_into_a_reused_wal_file_is_cut() {
    let (dir, clock, acked, newest) = reused_image();
    let end = frame_spans(&newest).last().unwrap().1;
    // A write that reached the disk in part: a record's frame with a bad checksum, at the end of the log.
    let mut torn = fs::read(&newest).unwrap()[wal::DATA_START as usize..][..600].to_vec();
    torn[100] ^= 0xff;
    let file = fs::OpenOptions::new().write(true).open(&newest).unwrap();
    file.write_all_at(&torn, end.next_multiple_of(frame::BLOCK) as u64)
        .unwrap();
    assert_eq!(surviving_after_reuse(dir.path(), &clock), acked);
    // What was cut stays cut, and appends continue in the same file.
    let log = ScheduleLog::open(dir.path(), reuse_options(&clock)).unwrap();
    let next = append_one(&log, T0, "next").location.seq;
    assert_eq!(next, acked.last().unwrap() + 1);
    log.crash();
    let mut expected = acked;
    expected.push(next);
    assert_eq!(surviving_after_reuse(dir.path(), &clock), expected);
}

#[test]
fn damage_in_the_synced_records_of_a_reused_wal_file_is_reported_not_cut() {
    let (dir, clock, _, newest) = reused_image();
    let spans = frame_spans(&newest);
    let own: Vec<_> = spans
        .iter()
        .filter(|(start, _)| {
            let bytes = fs::read(&newest).unwrap();
            let first = wal::list(&dir.path().join("wal")).unwrap().pop().unwrap().0;
            wal::record_seq(&bytes[*start..]).is_some_and(|seq| seq >= first)
        })
        .copied()
        .collect();
    let (start, _) = own[1];
    assert!(
        own.last().unwrap().1 - start > UNSYNCED_LIMIT,
        "more than the unsynced window follows the damage"
    );
    let file = fs::OpenOptions::new().write(true).open(&newest).unwrap();
    file.write_all_at(&[0xff; 4], start as u64 + 20).unwrap();
    match ScheduleLog::open(dir.path(), reuse_options(&clock)) {
        Err(Error::Corrupt { path, offset, .. }) => {
            assert_eq!(path, newest);
            assert_eq!(offset, start as u64);
        }
        other => panic!("expected corruption, got {other:?}"),
    }
}

/// A crash between renaming a spare to the next file's name and the first sync of its new header: the
/// file still carries its earlier use's header and records, none of them acknowledged in it.
#[test]
fn a_reused_wal_file_whose_new_header_never_reached_the_disk_holds_nothing() {
    let (dir, clock, log) = new_log_with(reuse_options);
    let acked = append_checkpointed(&log, 24, 20);
    log.crash();
    let wal_dir = dir.path().join("wal");
    let spare = fs::read_dir(&wal_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("spare-")
        })
        .expect("a spare");
    let next_seq = acked.last().unwrap() + 1;
    let renamed = wal::wal_path(&wal_dir, next_seq);
    fs::rename(&spare, &renamed).unwrap();
    assert_eq!(surviving_after_reuse(dir.path(), &clock), acked);
    // It was removed, and a new file of that name started (from the zero-filled `next.tmp`).
    let header =
        header::FileHeader::check(&fs::read(&renamed).unwrap(), header::WAL_MAGIC, &renamed);
    assert_eq!(header.unwrap().value, next_seq);
    let log = ScheduleLog::open(dir.path(), reuse_options(&clock)).unwrap();
    assert_eq!(append_one(&log, T0, "x").location.seq, next_seq);
}

#[test]
fn inspect_ends_a_reused_wal_file_at_its_own_records() {
    let (dir, _clock, acked, newest) = reused_image();
    let first = wal::list(&dir.path().join("wal")).unwrap().pop().unwrap().0;
    let own = acked.iter().filter(|&&seq| seq >= first).count();
    let mut out = Vec::new();
    assert!(inspect(&newest, &mut out).unwrap());
    let text = String::from_utf8(out).unwrap();
    let end = format!("{own} records; the log ends at offset");
    assert!(
        text.contains(&end) && text.contains("earlier use"),
        "{text}"
    );
}

/// `delayd inspect` reads the data dir's own small files too: the meta and the checkpoint.
#[test]
fn inspect_reads_the_meta_and_the_checkpoint() {
    let (dir, _, log) = new_log_with(reuse_options);
    let seq = append_one(&log, T0 + 1_000, "x").location.seq;
    log.checkpoint().unwrap();
    let dump = |name: &str| {
        let mut out = Vec::new();
        let clean = inspect(&dir.path().join(name), &mut out).unwrap();
        (clean, String::from_utf8(out).unwrap())
    };
    let (clean, text) = dump("checkpoint");
    let below = format!("below seq {}", seq + 1);
    assert!(
        clean && text.contains(&below) && text.contains("1 segments"),
        "{text}"
    );
    let (clean, text) = dump("meta");
    assert!(clean && text.contains("buckets of 60 minutes"), "{text}");
    let mut damaged = fs::read(dir.path().join("checkpoint")).unwrap();
    let last = damaged.len() - 1;
    damaged[last] ^= 1;
    fs::write(dir.path().join("checkpoint"), damaged).unwrap();
    let (clean, text) = dump("checkpoint");
    assert!(!clean, "{text}");
}

/// Spares nobody takes go back to the file system, one per checkpoint interval, once the node is idle.
#[test]
fn an_idle_node_sheds_its_wal_spares() {
    let (dir, clock, log) = new_log_with(|clock| quick_checkpoints(reuse_options(clock)));
    let wal_dir = dir.path().join("wal");
    let mut acked = Vec::new();
    append_batches(&log, 96, 5, &mut acked);
    // (That the checkpoint keeps retired files as spares is `reused_image`'s first check; here the
    // idle passes that follow may shed them as soon as they exist.)
    log.checkpoint().unwrap();
    wait_until("the idle node shed its spares", || {
        wal::spare_count(&wal_dir).unwrap() == 0 && wal::list(&wal_dir).unwrap().len() == 1
    });
    log.close().unwrap();
    assert_eq!(surviving_after_reuse(dir.path(), &clock), acked);
}
