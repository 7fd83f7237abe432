//! The schedule table through the whole engine: ops are records that are never filed, firings are
//! messages that count as progress, and both come back after a clean close, a crash before any
//! checkpoint (replayed from the WAL) and a crash after one (from the table's files), each once.

use super::*;

fn firing(id: &str, fire_at: &str, deliver_at_ms: i64) -> EncodedMessage {
    NewMessage {
        deliver_at_ms,
        topic: "reports.daily".into(),
        headers: vec![
            (SCHEDULE_HEADER.into(), id.into()),
            (FIRE_AT_HEADER.into(), fire_at.into()),
        ],
        sink: "broker".into(),
        body: b"report".to_vec(),
        ..NewMessage::default()
    }
    .encode()
    .unwrap()
}

fn op(id: &str, op: ScheduleOp, definition: &str) -> EncodedMessage {
    op.encode(id, definition.as_bytes()).unwrap()
}

fn write(log: &ScheduleLog, records: Vec<EncodedMessage>) -> Vec<Appended> {
    let appended = log.append(records).wait().unwrap();
    assert!(log.wait_filed(appended.last().unwrap().location.seq));
    appended
}

/// What a table reads as, without the definitions' sequence numbers.
fn summary(log: &ScheduleLog) -> Vec<(String, String, bool, u64, Option<i64>)> {
    log.schedules(None, 100)
        .into_iter()
        .map(|s| {
            let definition = String::from_utf8(s.definition.to_vec()).unwrap();
            (
                s.id,
                definition,
                s.paused,
                s.fired,
                s.last.map(|l| l.fire_at_ms),
            )
        })
        .collect()
}

fn fill(log: &ScheduleLog) -> Vec<(String, String, bool, u64, Option<i64>)> {
    write(
        log,
        vec![
            op("a", ScheduleOp::Put, "every 1s"),
            op("b", ScheduleOp::Put, "cron b"),
        ],
    );
    let fired = write(
        log,
        vec![
            firing("a", "2026-12-01T09:30:01.000Z", T0 + 1_000),
            firing("a", "2026-12-01T09:30:02.000Z", T0 + 2_000),
            firing("b", "2026-12-01T10:00:00.000Z", T0 + 30 * 60_000),
        ],
    );
    write(
        log,
        vec![
            op("b", ScheduleOp::Pause, ""),
            op("c", ScheduleOp::Put, "gone soon"),
            op("c", ScheduleOp::Delete, ""),
            // A firing of no schedule (deleted) counts for nothing; it is still a message.
            firing("c", "2026-12-01T09:31:00.000Z", T0 + 60_000),
        ],
    );
    let a = log.schedule("a").unwrap();
    assert_eq!(a.last.unwrap().message, fired[1].id);
    assert!(a.last.unwrap().is_current(&a));
    summary(log)
}

#[test]
fn ops_are_applied_not_filed_and_firings_count_once_across_restarts() {
    let expected = vec![
        ("a".into(), "every 1s".into(), false, 2, Some(T0 + 2_000)),
        ("b".into(), "cron b".into(), true, 1, Some(T0 + 30 * 60_000)),
    ];
    // Crashed before any checkpoint: everything comes from the WAL.
    let (dir, clock, log) = new_log();
    assert_eq!(fill(&log), expected);
    let filed = all_messages(&log);
    assert_eq!(filed.len(), 4, "the four firings are filed, no op is");
    assert!(filed.values().all(|m| m.sink == "broker"));
    log.crash();
    let log = open(dir.path(), &clock);
    assert_eq!(summary(&log), expected);
    assert_eq!(log.schedule_count(), 2);
    // Checkpointed (the table's files written), then more, then crashed: files plus WAL, each once.
    log.checkpoint().unwrap();
    assert!(dir.path().join("schedules/definitions").exists());
    write(
        &log,
        vec![firing("a", "2026-12-01T09:30:03.000Z", T0 + 3_000)],
    );
    log.crash();
    let log = open(dir.path(), &clock);
    let mut expected = expected;
    expected[0].3 = 3;
    expected[0].4 = Some(T0 + 3_000);
    assert_eq!(summary(&log), expected);
    // Resume plans afresh: the last firing predates it. A put replaces, keeping the paused state.
    write(
        &log,
        vec![
            op("b", ScheduleOp::Resume, ""),
            op("a", ScheduleOp::Pause, ""),
        ],
    );
    write(&log, vec![op("a", ScheduleOp::Put, "every 2s")]);
    let (a, b) = (log.schedule("a").unwrap(), log.schedule("b").unwrap());
    assert!(!b.paused && !b.last.unwrap().is_current(&b));
    assert!(a.paused && &*a.definition == b"every 2s" && a.fired == 3);
    assert_eq!(log.schedules(Some("a"), 10).len(), 1, "the page after a");
    drop(log);
    let log = open(dir.path(), &clock);
    assert_eq!(log.schedule("a"), Some(a));
    assert_eq!(log.schedule("b"), Some(b));
}

/// The table's files are stored before the checkpoint that covers them: a crash between the two (here
/// the checkpoint finds no room) leaves files newer than the checkpoint, whose records the WAL replay
/// then skips: each op and firing is applied once.
#[test]
fn files_stored_before_a_checkpoint_that_failed_count_nothing_twice() {
    let (dir, clock, log) = new_log();
    let expected = fill(&log);
    let before = checkpointed_seq(dir.path());
    log.inject_fault(Fault::CheckpointWritesFull(u32::MAX));
    assert!(log.checkpoint().is_err(), "the checkpoint found no room");
    assert!(
        dir.path().join("schedules/progress").exists(),
        "the files were stored first"
    );
    assert_eq!(
        checkpointed_seq(dir.path()),
        before,
        "the checkpoint did not move"
    );
    log.crash();
    let log = open(dir.path(), &clock);
    assert_eq!(summary(&log), expected);
}
