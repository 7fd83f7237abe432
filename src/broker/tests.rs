//! The broker's tests: stores, pulls, offsets, retention and the sink, on real files.

use super::append::Placed;
use super::*;
use crate::sink::{Delivery, Sink, SinkOutcome};
use schedulelog::frame;
use std::fs;

fn incoming(topic: &str, key: Option<&str>, body: &str) -> Incoming {
    stored_at(topic, key, body, 2)
}

fn stored_at(topic: &str, key: Option<&str>, body: &str, at_ms: i64) -> Incoming {
    Incoming {
        topic: topic.into(),
        id: format!("id-{body}"),
        key: key.map(String::from),
        headers: BTreeMap::new(),
        deliver_at_ms: 1,
        delivered_at_ms: at_ms,
        attempt: 0,
        attempt_at: None,
        body: body.as_bytes().to_vec(),
    }
}

/// A delivery of the message at `location`, as the scheduler hands it to the broker sink.
fn handed(location: schedulelog::Location, topic: &str, body: &[u8]) -> Delivery {
    Delivery {
        id: schedulelog::MessageId::new(location),
        location,
        message: schedulelog::Message {
            seq: location.seq,
            deliver_at_ms: 1,
            created_at_ms: 1,
            id: schedulelog::MessageId::new(location),
            attempt: 0,
            topic: topic.into(),
            key: None,
            dedup: false,
            headers: Vec::new(),
            sink: "broker".into(),
            body: body.to_vec(),
        },
        sent_at_ms: 7,
    }
}

/// The `delivered` outcome of the first attempt at `at`, at 5 ms.
fn delivered(at: schedulelog::Location) -> (schedulelog::Bucket, schedulelog::Outcome) {
    let outcome = schedulelog::Outcome {
        seq: at.seq,
        at_ms: 5,
        attempt: 0,
        kind: schedulelog::OutcomeKind::Delivered,
    };
    (at.bucket, outcome)
}

fn options(queues: u32) -> BrokerOptions {
    BrokerOptions {
        queues_per_topic: queues,
        ..BrokerOptions::default()
    }
}

/// Small segments, so that a few hundred messages make several.
fn small(queues: u32) -> BrokerOptions {
    BrokerOptions {
        segment_bytes: 64 << 10,
        retention: Duration::from_secs(3600),
        ..options(queues)
    }
}

fn bodies(pulled: &Pulled) -> Vec<String> {
    pulled
        .messages
        .iter()
        .map(|m| String::from_utf8(m.body.clone()).unwrap())
        .collect()
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

const LOG_0: &str = "broker/commitlog/00000000000000000000";

#[test]
fn append_read_reopen_and_repair() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(2)).unwrap();
    let placed = broker
        .append(vec![
            incoming("t", Some("k"), "a"),
            incoming("t", Some("k"), "b"),
            incoming("u", None, "c"),
        ])
        .unwrap();
    assert_eq!(placed[0].0, placed[1].0, "same key, same queue");
    assert_eq!(placed[1].1, placed[0].1 + 1);
    let q = placed[0].0;
    let read = broker.read("t", q, 0, 10).unwrap().unwrap();
    assert_eq!(bodies(&read), ["a", "b"]);
    assert_eq!(read.messages[1].offset, 1);
    assert_eq!(broker.read("nope", 0, 0, 10).unwrap(), None);
    drop(broker);

    // Lose the last unit of queue q: reopening restores it from the commit log.
    let path = dir
        .path()
        .join(format!("broker/consumequeue/t/{q}/00000000000000000000"));
    let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(queue::UNIT_LEN).unwrap();
    fs::remove_file(dir.path().join("broker/checkpoint")).unwrap();
    // And append garbage to the commit log (a torn write).
    let log = dir.path().join(LOG_0);
    let lf = fs::OpenOptions::new().append(true).open(&log).unwrap();
    lf.write_all_at(&[7u8; 13], lf.metadata().unwrap().len())
        .unwrap();
    let broker = Broker::open(dir.path(), options(2)).unwrap();
    let read = broker.read("t", q, 0, 10).unwrap().unwrap();
    assert_eq!(read.messages.len(), 2);
    assert_eq!(
        broker.topics(),
        vec![("t".to_string(), 2), ("u".to_string(), 2)]
    );
    broker.append(vec![incoming("t", Some("k"), "d")]).unwrap();
    assert_eq!(bodies(&broker.read("t", q, 2, 10).unwrap().unwrap()), ["d"]);
}

#[test]
fn units_written_after_the_checkpoint_are_rewritten_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(2)).unwrap();
    let names = ["a", "b", "c", "d", "e"];
    let placed = broker
        .append(names.map(|b| incoming("t", Some("k"), b)).to_vec())
        .unwrap();
    let q = placed[0].0;
    drop(broker);

    // Units are not synced per append; a crash may leave them zero, torn, or the file longer than
    // what was written.
    let path = dir
        .path()
        .join(format!("broker/consumequeue/t/{q}/00000000000000000000"));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let unit = queue::UNIT_LEN;
    f.write_all_at(&[0; queue::UNIT_LEN as usize], unit)
        .unwrap();
    f.write_all_at(&[9; 8], 3 * unit).unwrap();
    f.write_all_at(&[0; 4], 3 * unit + 8).unwrap();
    f.set_len(7 * unit).unwrap();
    // And stale bytes that look like a unit (a copy of the first) past the last record's.
    let mut first = [0; queue::UNIT_LEN as usize];
    f.read_exact_at(&mut first, 0).unwrap();
    f.write_all_at(&first, 6 * unit).unwrap();

    let broker = Broker::open(dir.path(), options(2)).unwrap();
    let read = broker.read("t", q, 0, 10).unwrap().unwrap();
    assert_eq!(bodies(&read), names);
    assert_eq!(
        broker.append(vec![incoming("t", Some("k"), "f")]).unwrap()[0],
        (q, 5),
        "the units past the last record were cut"
    );
}

#[test]
fn a_commit_log_torn_inside_its_header_is_started_afresh() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join(LOG_0);
    fs::create_dir_all(log.parent().unwrap()).unwrap();
    let mut torn = b"DLYDBRK\0".to_vec();
    torn.extend([0u8; 12]);
    fs::write(&log, &torn).unwrap();
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    broker.append(vec![incoming("t", None, "after")]).unwrap();
    assert_eq!(
        bodies(&broker.read("t", 0, 0, 1).unwrap().unwrap()),
        ["after"]
    );
}

#[test]
fn offsets_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    broker.commit_offset("g", "t", 0, 13, 10).unwrap();
    drop(broker);
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    assert_eq!(broker.group_offsets("g", "t"), BTreeMap::from([(0, 13)]));
    assert!(broker.group_offsets("other", "t").is_empty());
}

/// 2026-12-01T09:30:00Z, when [`fill`] stores its first batch.
const T0: i64 = 1_796_117_400_000;

/// 600 messages of 1 KiB in batches of 50, stored an hour apart per batch from `T0`.
fn fill(broker: &Broker) {
    let body = "x".repeat(1000);
    for batch in 0..12 {
        let messages: Vec<Incoming> = (0..50)
            .map(|i| {
                stored_at(
                    "t",
                    None,
                    &format!("{batch:02}-{i:02}-{body}"),
                    T0 + batch * 3_600_000,
                )
            })
            .collect();
        broker.append(messages).unwrap();
    }
}

/// A broker of small segments and one queue in `dir`, filled by [`fill`].
fn filled(dir: &Path) -> Broker {
    let broker = Broker::open(dir, small(1)).unwrap();
    fill(&broker);
    broker
}

/// Fills a broker in `dir` and closes it, for a test to tamper with its files: answers the commit
/// log's folder and its segments' names, oldest first.
fn filled_then_closed(dir: &Path) -> (PathBuf, Vec<String>) {
    drop(filled(dir));
    let log_dir = dir.join("broker/commitlog");
    let segments = files(&log_dir);
    (log_dir, segments)
}

#[test]
fn retention_deletes_old_segments_and_pulls_below_min_offset_start_at_it() {
    let dir = tempfile::tempdir().unwrap();
    let broker = filled(dir.path());
    let log_dir = dir.path().join("broker/commitlog");
    let segments = files(&log_dir).len();
    assert!(segments >= 8, "1 KiB x 600 in 64 KiB segments: {segments}");
    broker.commit_offset("slow", "t", 0, 10, 10).unwrap();
    broker.commit_offset("done", "t", 0, 600, 10).unwrap();
    // Nothing is old enough yet.
    assert_eq!(broker.enforce_retention(T0).unwrap(), Retired::default());

    // Five hours later, batches stored more than an hour before are gone (a segment at a time).
    let retired = broker.enforce_retention(T0 + 5 * 3_600_000).unwrap();
    assert!(retired.segments > 0 && retired.bytes > 0, "{retired:?}");
    let (min, max) = broker.queue_offsets("t").unwrap()[0];
    assert_eq!(max, 600);
    assert!((150..=250).contains(&min), "about 4 batches gone: {min}");
    assert_eq!(
        retired.unread,
        min - 10,
        "only the slow group missed messages"
    );
    assert_eq!(files(&log_dir).len(), segments - retired.segments);
    // A pull below min_offset is answered from it.
    let pulled = broker.read("t", 0, 3, 2).unwrap().unwrap();
    assert_eq!(pulled.from, min);
    assert_eq!(pulled.messages[0].offset, min);
    assert!(bodies(&pulled)[0].starts_with(&format!("{:02}-", min / 50)));
    // Queue files that only pointed into deleted segments are gone too.
    let queue_files = files(&dir.path().join("broker/consumequeue/t/0"));
    assert!(
        queue_files[0].parse::<u64>().unwrap() > 0,
        "{queue_files:?}"
    );

    // Reopened, the minimum is recomputed from the log, and nothing else changed.
    drop(broker);
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    assert_eq!(broker.queue_offsets("t").unwrap()[0], (min, 600));
    assert_eq!(
        broker.read("t", 0, 599, 5).unwrap().unwrap().messages.len(),
        1
    );

    // Everything expired: all but the segment taking appends go, and appends go on.
    broker.enforce_retention(T0 + 100 * 3_600_000).unwrap();
    assert_eq!(files(&log_dir).len(), 1);
    broker
        .append(vec![stored_at("t", None, "later", T0)])
        .unwrap();
    let (min, max) = broker.queue_offsets("t").unwrap()[0];
    assert_eq!(max, 601);
    assert_eq!(
        bodies(&broker.read("t", 0, 600, 10).unwrap().unwrap()),
        ["later"]
    );
    assert!(min <= 600);
}

#[test]
fn a_deletion_cut_short_by_a_crash_is_finished_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let (log_dir, segments) = filled_then_closed(dir.path());
    // Retention had deleted the oldest three segments, then the process died: the queue files that
    // pointed into them are still there.
    for segment in &segments[..3] {
        fs::remove_file(log_dir.join(segment)).unwrap();
    }
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    assert_eq!(files(&log_dir), segments[3..].to_vec());
    let (min, max) = broker.queue_offsets("t").unwrap()[0];
    assert_eq!(max, 600);
    let pulled = broker.read("t", 0, 0, 1000).unwrap().unwrap();
    assert_eq!(pulled.from, min);
    assert!(pulled.messages[0].meta.queue_offset == min && min > 0);
    // The rest, a few segments per read.
    let mut read = pulled.messages.len() as u64;
    while min + read < 600 {
        let more = broker.read("t", 0, min + read, 1000).unwrap().unwrap();
        assert_eq!(more.messages[0].meta.queue_offset, min + read);
        read += more.messages.len() as u64;
    }
    assert_eq!(read, 600 - min);
    let queue_files = files(&dir.path().join("broker/consumequeue/t/0"));
    assert!(
        queue_files[0].parse::<u64>().unwrap() <= min,
        "queue files wholly below min_offset went: {queue_files:?}"
    );
    drop(broker);
    // And opening again changes nothing.
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    assert_eq!(broker.queue_offsets("t").unwrap()[0], (min, 600));
}

#[test]
fn a_hole_in_the_commit_log_is_reported_and_an_empty_stray_segment_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (log_dir, segments) = filled_then_closed(dir.path());
    // An empty segment past the end, after a gap: what a failed append whose undo could not delete
    // the segment it started leaves. It holds nothing, and goes.
    let last = log_dir.join(segments.last().unwrap());
    let end = segments.last().unwrap().parse::<u64>().unwrap() + fs::metadata(&last).unwrap().len();
    let stray = format!("{:020}", end + 4096);
    fs::write(log_dir.join(&stray), commitlog::header(end + 4096)).unwrap();
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    assert_eq!(files(&log_dir), segments);
    assert_eq!(broker.queue_offsets("t").unwrap()[0], (0, 600));
    drop(broker);
    // A segment missing from the middle is corruption, named; nothing is deleted.
    fs::remove_file(log_dir.join(&segments[2])).unwrap();
    let error = Broker::open(dir.path(), small(1)).unwrap_err();
    assert!(
        matches!(&error, BrokerError::Corrupt { path, .. } if path.ends_with(&segments[1])),
        "{error}"
    );
    assert!(error.to_string().contains("missing"), "{error}");
    assert_eq!(files(&log_dir).len(), segments.len() - 1);
}

#[test]
fn max_bytes_deletes_the_oldest_segments_first() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions {
        max_bytes: Some(256 << 10),
        retention: Duration::from_secs(1 << 30),
        ..small(1)
    };
    let broker = Broker::open(dir.path(), options.clone()).unwrap();
    fill(&broker);
    let retired = broker.enforce_retention(T0).unwrap();
    assert!(retired.segments > 0);
    let log_bytes: u64 = fs::read_dir(dir.path().join("broker/commitlog"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(log_bytes <= 256 << 10, "{log_bytes}");
    let pulled = broker.read("t", 0, 0, 1000).unwrap().unwrap();
    assert_eq!(
        pulled.messages.last().unwrap().offset,
        599,
        "the newest stay"
    );
    assert!(pulled.from > 0);
}

#[test]
fn dead_letters_live_in_their_own_store_with_their_own_retention() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions {
        dead_retention: Duration::from_secs(100 * 3600),
        ..small(1)
    };
    let broker = Broker::open(dir.path(), options).unwrap();
    let dead = crate::scheduler::DEAD_TOPIC;
    let body = "y".repeat(1000);
    for batch in 0..12 {
        let messages: Vec<Incoming> = (0..50)
            .map(|i| {
                let topic = if i % 2 == 0 { "t" } else { dead };
                stored_at(
                    topic,
                    None,
                    &format!("{batch}-{i}-{body}"),
                    T0 + batch * 3_600_000,
                )
            })
            .collect();
        let placed = broker.append(messages).unwrap();
        // Each store numbers its own queues.
        assert_eq!(placed[1].1, batch as u64 * 25);
    }
    assert!(dir
        .path()
        .join("broker/dead/consumequeue")
        .join(dead)
        .is_dir());
    broker.enforce_retention(T0 + 20 * 3_600_000).unwrap();
    let main_min = broker.queue_offsets("t").unwrap()[0].0;
    assert!(main_min > 250, "all but the last segment went: {main_min}");
    assert_eq!(
        broker.queue_offsets(dead).unwrap()[0],
        (0, 300),
        "dead letters stay"
    );
    assert_eq!(
        broker.topics(),
        vec![(dead.to_string(), 1), ("t".to_string(), 1)]
    );
}

#[test]
fn dead_letters_of_a_data_dir_from_before_their_store_stay_readable() {
    let dir = tempfile::tempdir().unwrap();
    let dead = crate::scheduler::DEAD_TOPIC;
    // The layout before dead letters had a store of their own: `$dead` in the main store.
    let mut legacy = Store::open(&dir.path().join("broker"), 1, 64 << 10).unwrap();
    let old = [incoming(dead, None, "old-1"), incoming(dead, None, "old-2")];
    legacy.append(&old.iter().collect::<Vec<_>>(), 2).unwrap();
    drop(legacy);
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    broker.commit_offset("ops", dead, 0, 1, 10).unwrap();
    assert_eq!(broker.queue_offsets(dead).unwrap(), vec![(0, 2)]);
    // New dead letters continue the queue the groups know.
    let placed = broker.append(vec![incoming(dead, None, "new")]).unwrap();
    assert_eq!(placed, vec![(0, 2)]);
    assert_eq!(
        bodies(&broker.read(dead, 0, 1, 10).unwrap().unwrap()),
        ["old-2", "new"]
    );
    assert_eq!(broker.topics(), vec![(dead.to_string(), 1)]);
}

#[test]
fn an_append_whose_units_cannot_be_written_is_undone_records_included() {
    let dir = tempfile::tempdir().unwrap();
    // 64 KiB segments: 64 units per queue file.
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    let first: Vec<Incoming> = (0..64)
        .map(|i| incoming("t", None, &format!("a{i}")))
        .collect();
    broker.append(first).unwrap();
    let log = dir.path().join(LOG_0);
    let log_len = fs::metadata(&log).unwrap().len();
    // The queue's next file cannot be started: a directory is in its way.
    let blocker = dir
        .path()
        .join("broker/consumequeue/t/0/00000000000000000064");
    fs::create_dir(&blocker).unwrap();
    let second: Vec<Incoming> = (0..3)
        .map(|i| incoming("t", None, &format!("b{i}")))
        .collect();
    assert!(broker.append(second.clone()).is_err());
    assert_eq!(
        fs::metadata(&log).unwrap().len(),
        log_len,
        "the records were cut back"
    );
    assert_eq!(broker.queue_offsets("t").unwrap()[0], (0, 64));
    assert_eq!(broker.failed(), None, "the undo worked");
    fs::remove_dir(&blocker).unwrap();
    assert_eq!(broker.append(second).unwrap()[0], (0, 64));
    assert_eq!(
        bodies(&broker.read("t", 0, 63, 10).unwrap().unwrap()),
        ["a63", "b0", "b1", "b2"]
    );
    drop(broker);
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    assert_eq!(broker.queue_offsets("t").unwrap()[0], (0, 67));
    assert_eq!(
        bodies(&broker.read("t", 0, 64, 10).unwrap().unwrap()),
        ["b0", "b1", "b2"]
    );
}

#[test]
fn a_read_is_bounded_in_bytes_but_always_has_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions {
        max_pull_bytes: 3 << 10,
        ..small(1)
    };
    let broker = Broker::open(dir.path(), options).unwrap();
    let kib = "k".repeat(1000);
    let messages: Vec<Incoming> = (0..10)
        .map(|i| incoming("t", None, &format!("{i}{kib}")))
        .collect();
    broker.append(messages).unwrap();
    broker
        .append(vec![incoming("t", None, &"big".repeat(3000))])
        .unwrap();
    let read = broker.read("t", 0, 0, 100).unwrap().unwrap();
    assert!(
        (1..=3).contains(&read.messages.len()),
        "{}",
        read.messages.len()
    );
    let total: usize = read.messages.iter().map(|m| m.body.len()).sum();
    assert!(total <= 3 << 10);
    let big = broker.read("t", 0, 10, 100).unwrap().unwrap();
    assert_eq!(
        big.messages.len(),
        1,
        "one message larger than the cap still comes"
    );
}

#[test]
fn the_sink_postpones_what_its_own_storage_fails_to_take() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Arc::new(Broker::open(dir.path(), small(1)).unwrap());
    let sink = BrokerSink::new(broker.clone());
    // Each its own attempt: one the broker holds already is answered stored (outcomes.rs).
    let delivery = |seq: u64, body: &str| {
        let location = schedulelog::Location {
            bucket: schedulelog::Bucket::from_start_minute(29_935_260),
            seq,
        };
        let mut delivery = handed(location, "t", body.as_bytes());
        delivery.message.attempt = 3;
        delivery
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let first = vec![delivery(1, &"a".repeat(60 << 10))];
    assert_eq!(
        runtime.block_on(sink.deliver(&first)),
        vec![SinkOutcome::Delivered]
    );
    // In place (as lanes deliver), the same: stored, then answered.
    assert_eq!(
        sink.deliver_blocking(&[delivery(2, "in place")]),
        Some(vec![SinkOutcome::Delivered])
    );
    let stored = broker.read("t", 0, 0, 10).unwrap().unwrap();
    assert_eq!(bodies(&stored)[1], "in place");
    // Stamped with the time the lane handed the delivery over, the time its outcome records.
    assert!(stored.messages.iter().all(|m| m.meta.delivered_at_ms == 7));
    // The next segment cannot be created (a directory in its way): not a full disk, an I/O error.
    let log_dir = dir.path().join("broker/commitlog");
    let last = files(&log_dir).pop().unwrap();
    let end = last.parse::<u64>().unwrap() + fs::metadata(log_dir.join(&last)).unwrap().len();
    fs::create_dir(log_dir.join(format!("{end:020}"))).unwrap();
    let second = vec![delivery(3, &"b".repeat(60 << 10))];
    let answers = runtime.block_on(sink.deliver(&second));
    assert!(
        matches!(&answers[..], [SinkOutcome::Postpone { after, .. }] if *after == Duration::from_secs(5)),
        "postponed, no attempt used: {answers:?}"
    );
    let answers = sink.deliver_blocking(&second).unwrap();
    assert!(
        matches!(&answers[..], [SinkOutcome::Postpone { after, .. }] if *after == Duration::from_secs(5)),
        "in place too: {answers:?}"
    );
    assert_eq!(broker.disk_full(), None, "not a full disk");
}

#[test]
fn a_large_batch_is_synced_in_bounded_writes_so_a_torn_one_is_a_tail() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    // 40 MiB in one batch (the sink's largest is 1,024 messages of up to 16 MiB).
    let mib = "m".repeat((1 << 20) - 512);
    let batch: Vec<Incoming> = (0..40)
        .map(|i| incoming("t", None, &format!("{i:02}{mib}")))
        .collect();
    broker.append(batch).unwrap();
    let writes = broker.main.lock().log.writes.clone();
    assert!(writes.len() >= 2, "{writes:?}");
    let limit = frame::UNSYNCED_LIMIT;
    assert!(writes.iter().all(|(_, len)| *len <= limit), "{writes:?}");
    drop(broker);
    // A power loss during the last write: its first frame is torn, the rest of it garbage. Only
    // that write was unsynced, so what it held is a torn tail, cut, and what came before stays.
    let (at, len) = *writes.last().unwrap();
    let log = fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join(LOG_0))
        .unwrap();
    log.write_all_at(&vec![0xab; len], at).unwrap();
    fs::remove_file(dir.path().join("broker/checkpoint")).ok();
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    let kept = broker.queue_offsets("t").unwrap()[0].1;
    assert!(kept > 0 && kept < 40, "{kept}");
    let read = broker.read("t", 0, kept - 1, 1).unwrap().unwrap();
    assert!(bodies(&read)[0].starts_with(&format!("{:02}", kept - 1)));
}

#[test]
fn only_the_segment_taking_appends_holds_a_file_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let broker = filled(dir.path());
    let log_dir = dir.path().join("broker/commitlog");
    assert!(files(&log_dir).len() >= 8);
    let open_here = || {
        fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| fs::read_link(e.unwrap().path()).ok())
            .filter(|target| target.starts_with(&log_dir))
            .count()
    };
    assert_eq!(
        open_here(),
        1,
        "sealed segments are opened when read, not kept open"
    );
    // Reading from a sealed one opens it for the read only.
    assert_eq!(
        broker.read("t", 0, 0, 5).unwrap().unwrap().messages.len(),
        5
    );
    assert_eq!(open_here(), 1);
}

#[test]
fn a_read_spans_a_bounded_number_of_segments() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    // Each message of `t` in a segment of its own, with a large one of `u` between.
    let filler = "u".repeat(50 << 10);
    for i in 0..20 {
        broker
            .append(vec![
                incoming("t", None, &format!("t{i}")),
                incoming("u", None, &filler),
            ])
            .unwrap();
    }
    assert!(files(&dir.path().join("broker/commitlog")).len() >= 19);
    let first = broker.read("t", 0, 0, 100).unwrap().unwrap();
    // Each segment read holds a descriptor until the answer is sent: a few per read, not 20.
    assert_eq!(first.messages.len(), store::MAX_SEGMENTS_PER_READ);
    let next = |p: &Pulled| p.from + p.messages.len() as u64;
    let rest = broker.read("t", 0, next(&first), 100).unwrap().unwrap();
    let mut all = bodies(&first);
    all.extend(bodies(&rest));
    let more = broker.read("t", 0, next(&rest), 100).unwrap().unwrap();
    all.extend(bodies(&more));
    assert_eq!(all, (0..20).map(|i| format!("t{i}")).collect::<Vec<_>>());
}

#[test]
fn a_failed_append_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    let body = "z".repeat(1000);
    broker
        .append(
            (0..60)
                .map(|i| incoming("t", None, &format!("{i}{body}")))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let log_dir = dir.path().join("broker/commitlog");
    let before = files(&log_dir);
    let last = log_dir.join(before.last().unwrap());
    let end = before.last().unwrap().parse::<u64>().unwrap() + fs::metadata(&last).unwrap().len();
    // The next segment cannot be created: a directory is in its way.
    let blocker = log_dir.join(format!("{end:020}"));
    fs::create_dir(&blocker).unwrap();
    let batch: Vec<Incoming> = (0..70)
        .map(|i| incoming("t", None, &format!("b{i}{body}")))
        .collect();
    assert!(broker.append(batch.clone()).is_err());
    assert_eq!(broker.queue_offsets("t").unwrap()[0].1, 60, "no units");
    assert_eq!(
        fs::metadata(&last).unwrap().len() + before.last().unwrap().parse::<u64>().unwrap(),
        end,
        "the log was cut back"
    );
    fs::remove_dir(&blocker).unwrap();
    let placed = broker.append(batch).unwrap();
    assert_eq!(placed[0].1, 60, "queue offsets go on without a gap");
    let pulled = broker.read("t", 0, 58, 4).unwrap().unwrap();
    assert_eq!(pulled.messages.len(), 4);
    assert!(bodies(&pulled)[2].starts_with("b0"));
    drop(broker);
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    assert_eq!(broker.queue_offsets("t").unwrap()[0].1, 130);
}

/// Starts one thread per call while the main store is held, waits until every call is queued, lets
/// go, and answers each call's result in order.
fn appended_together(broker: &Broker, calls: Vec<Vec<Incoming>>) -> Vec<Placed> {
    let count = calls.len();
    let held = broker.main.lock();
    std::thread::scope(|scope| {
        let callers: Vec<_> = calls
            .into_iter()
            .map(|messages| scope.spawn(|| broker.append(messages)))
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while broker.main.queued() < count {
            assert!(std::time::Instant::now() < deadline, "every append queues");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(held);
        callers.into_iter().map(|c| c.join().unwrap()).collect()
    })
}

/// Opens its gate when dropped, however the test ends: a job held at it would hold up the store's
/// drop (for the gate's 30 s).
struct GateOpens(Arc<store::Gate>);

impl Drop for GateOpens {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Makes the main store's checkpoints due every two messages and holds their jobs at a gate.
fn gate_checkpoints(broker: &Broker) -> GateOpens {
    let gate = Arc::new(store::Gate::default());
    let mut store = broker.main.lock();
    store.checkpoint_every = (2, u64::MAX);
    store.checkpoint_gate = Some(gate.clone());
    GateOpens(gate)
}

/// A checkpoint is taken under the store's lock and made durable off it: while its job is held before
/// its first sync, appends and reads go on and the checkpoint file is untouched; released, the file
/// gets the log's end as it was when the job was taken. A checkpoint due while one runs waits for a
/// later append; dropping the broker waits for a running job; units of records after the last
/// checkpoint are rewritten on open.
#[test]
fn a_checkpoint_is_made_durable_off_the_stores_lock() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Arc::new(Broker::open(dir.path(), options(1)).unwrap());
    let gate = gate_checkpoints(&broker);
    let checkpoint = || store::read_checkpoint(&dir.path().join("broker"));
    let end = || broker.main.lock().log.end();
    let append = |bodies: [&str; 2]| {
        broker
            .append(bodies.map(|b| incoming("t", None, b)).to_vec())
            .unwrap()
    };
    let before = checkpoint();
    // On a thread of its own: were the job run under the lock, this append would wait at the gate.
    let (done, appended) = std::sync::mpsc::channel();
    let first = broker.clone();
    let appending = std::thread::spawn(move || {
        let messages = vec![incoming("t", None, "a"), incoming("t", None, "b")];
        done.send(first.append(messages).map(|_| ())).unwrap();
    });
    appended
        .recv_timeout(Duration::from_secs(20))
        .expect("the append returns while its checkpoint waits to sync")
        .unwrap();
    appending.join().unwrap();
    let taken = end();
    assert!(taken > before);
    append(["c", "d"]);
    let read = broker.read("t", 0, 0, 10).unwrap().unwrap();
    assert_eq!(
        bodies(&read),
        ["a", "b", "c", "d"],
        "appends and reads go on"
    );
    assert_eq!(checkpoint(), before, "nothing stored before the syncs");
    gate.0.open();
    broker.main.lock().wait_for_checkpoint();
    assert_eq!(
        checkpoint(),
        taken,
        "the end as it was when the job was taken"
    );

    append(["e", "f"]);
    broker.main.lock().wait_for_checkpoint();
    assert_eq!(
        checkpoint(),
        end(),
        "the next one, due since c and d, started at e and f"
    );

    let held = gate_checkpoints(&broker);
    append(["g", "h"]);
    let at_h = end();
    broker.main.lock().checkpoint_every = (u64::MAX, u64::MAX);
    append(["i", "j"]);
    // The gate opens a moment after the drop began: a drop that did not wait for the job would end
    // before its checkpoint is stored.
    let opening = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(held);
    });
    drop(broker);
    assert_eq!(checkpoint(), at_h, "the drop waited for the job");
    opening.join().unwrap();
    // i and j came after the last checkpoint: their units, zeroed here as a crash may leave them,
    // are rewritten on open (a checkpoint past them would have them cut instead).
    let queue = dir
        .path()
        .join("broker/consumequeue/t/0/00000000000000000000");
    let file = fs::OpenOptions::new().write(true).open(queue).unwrap();
    file.write_all_at(&[0; 2 * queue::UNIT_LEN as usize], 8 * queue::UNIT_LEN)
        .unwrap();
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    let read = broker.read("t", 0, 0, 20).unwrap().unwrap();
    assert_eq!(
        bodies(&read),
        ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]
    );
}

/// Queue files are synced by checkpoint jobs alone: a file the queue moved on from while a job held
/// it goes to the next job, before the active one; everything reads back after a reopen.
#[test]
fn a_queue_file_moved_on_from_goes_to_the_next_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    let gate = gate_checkpoints(&broker);
    let names: Vec<String> = (0..74).map(|i| format!("m{i}")).collect();
    let messages = |names: &[String]| names.iter().map(|n| incoming("t", None, n)).collect();
    let queue_file = |first: u64| {
        dir.path()
            .join(format!("broker/consumequeue/t/0/{first:020}"))
    };
    broker.append(messages(&names[..2])).unwrap();
    let taken = broker.main.lock().log.end();
    assert_eq!(broker.main.lock().checkpoint_files, [queue_file(0)]);
    // 64 units a file with these segments: the queue moves on while the job holds file 0.
    broker.append(messages(&names[2..72])).unwrap();
    assert!(queue_file(64).exists(), "the queue moved on");
    gate.0.open();
    broker.main.lock().wait_for_checkpoint();
    assert_eq!(store::read_checkpoint(&dir.path().join("broker")), taken);
    broker.append(messages(&names[72..])).unwrap();
    broker.main.lock().wait_for_checkpoint();
    assert_eq!(
        broker.main.lock().checkpoint_files,
        [queue_file(0), queue_file(64)],
        "the file moved on from (written after the first job took it), then the active one"
    );
    drop(broker);
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    let read = broker.read("t", 0, 0, 100).unwrap().unwrap();
    assert_eq!(bodies(&read), names);
}

/// A store's lock is held through an append's commit-log sync: `queue_offsets_now` answers busy at
/// once instead of waiting (an async caller then asks on the blocking pool), only for the store that
/// is held, and otherwise answers what `queue_offsets` does.
#[test]
fn offsets_now_answer_busy_rather_than_wait_for_a_held_store() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(2)).unwrap();
    let dead = crate::scheduler::DEAD_TOPIC;
    broker
        .append(vec![incoming("t", None, "a"), incoming(dead, None, "d")])
        .unwrap();
    let offsets = broker.queue_offsets("t");
    assert_eq!(offsets, Some(vec![(0, 0), (0, 1)]));
    assert_eq!(broker.queue_offsets_now("t"), Ok(offsets.clone()));
    assert_eq!(broker.queue_offsets_now("nope"), Ok(None));
    let held = broker.main.lock();
    assert_eq!(broker.queue_offsets_now("t"), Err(StoreBusy));
    assert_eq!(
        broker.queue_offsets_now(dead),
        Ok(Some(vec![(0, 0), (0, 1)])),
        "the dead letters' store has a lock of its own"
    );
    drop(held);
    assert_eq!(broker.queue_offsets_now("t"), Ok(offsets));
}

/// Lanes delivering at once share the commit log's write and sync: three appends that arrive while
/// the store is busy go in one write, each caller gets its own placements, and all are readable.
#[test]
fn appends_that_arrive_together_share_one_write() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    broker.append(vec![incoming("t", None, "first")]).unwrap();
    let writes_before = broker.main.lock().log.writes.len();
    let bodies_of = |n: usize| [format!("{n}a"), format!("{n}b")];
    let calls = (0..3)
        .map(|n| {
            bodies_of(n)
                .iter()
                .map(|b| incoming("t", None, b))
                .collect()
        })
        .collect();
    for (n, placed) in appended_together(&broker, calls).into_iter().enumerate() {
        let placed = placed.unwrap();
        assert_eq!(
            placed[1].1,
            placed[0].1 + 1,
            "a caller's messages stay together"
        );
        for (body, (_, offset)) in bodies_of(n).iter().zip(&placed) {
            let pulled = broker.read("t", 0, *offset, 1).unwrap().unwrap();
            assert_eq!(&bodies(&pulled)[0], body, "where it says it went");
        }
    }
    assert_eq!(
        broker.main.lock().log.writes.len(),
        writes_before + 1,
        "one commit-log write for the three"
    );
    assert_eq!(broker.queue_offsets("t").unwrap()[0].1, 7);
}

/// A caller whose own messages cannot be stored (a topic whose files cannot be made) fails alone:
/// the others in its group are stored, where they say, with offsets that go on without a gap.
#[test]
fn a_caller_that_fails_in_a_group_fails_alone() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    broker.append(vec![incoming("t", None, "first")]).unwrap();
    // A file where the topic's consume queues would go.
    fs::write(dir.path().join("broker/consumequeue/blocked"), b"").unwrap();
    let calls = ["t", "blocked", "t"]
        .iter()
        .enumerate()
        .map(|(n, topic)| vec![incoming(topic, None, &n.to_string())])
        .collect();
    let answers = appended_together(&broker, calls);
    let err = answers[1].as_ref().unwrap_err();
    assert!(err.to_string().contains("blocked"), "{err}");
    assert!(!err.is_disk_full(), "{err}");
    let mut offsets: Vec<u64> = [&answers[0], &answers[2]]
        .iter()
        .map(|a| a.as_ref().unwrap()[0].1)
        .collect();
    offsets.sort();
    assert_eq!(
        offsets,
        vec![1, 2],
        "after the first message, without a gap"
    );
    for n in [0, 2] {
        let offset = answers[n].as_ref().unwrap()[0].1;
        let pulled = broker.read("t", 0, offset, 1).unwrap().unwrap();
        assert_eq!(bodies(&pulled), vec![n.to_string()]);
    }
    assert_eq!(broker.failed(), None);
}

/// A failure after the group's messages went to the commit log (its next segment cannot be made)
/// undoes the append as a whole: every caller hears it, none of it is stored, and the queue goes on
/// without a gap once the trouble is gone.
#[test]
fn a_write_that_fails_for_a_group_fails_every_caller_in_it() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    broker
        .append(vec![incoming("t", None, &"a".repeat(60 << 10))])
        .unwrap();
    let log_dir = dir.path().join("broker/commitlog");
    let last = files(&log_dir).pop().unwrap();
    let end = last.parse::<u64>().unwrap() + fs::metadata(log_dir.join(&last)).unwrap().len();
    let blocker = log_dir.join(format!("{end:020}"));
    fs::create_dir(&blocker).unwrap();
    let calls = (0..3)
        .map(|n| vec![incoming("t", None, &format!("{n}{}", "b".repeat(4 << 10)))])
        .collect();
    for answer in appended_together(&broker, calls) {
        let err = answer.unwrap_err();
        assert!(!err.is_disk_full(), "{err}");
    }
    assert_eq!(
        broker.queue_offsets("t").unwrap()[0].1,
        1,
        "nothing of the group stored"
    );
    fs::remove_dir(&blocker).unwrap();
    let placed = broker.append(vec![incoming("t", None, "after")]).unwrap();
    assert_eq!(placed[0].1, 1, "no gap");
    assert_eq!(broker.failed(), None);
}

// Replicated ops (op.rs): what a cluster member's broker proposes and every member applies.

fn op_message(topic: &str, key: Option<&str>, body: &[u8], queue: u32, queues: u32) -> OpMessage {
    let mut message = incoming(topic, key, "x");
    message.body = body.to_vec();
    message.headers.insert("h".into(), "v".into());
    OpMessage {
        chosen: Chosen { queue, queues },
        message,
    }
}

fn append_op(nonce: u64, messages: Vec<OpMessage>) -> Vec<u8> {
    BrokerOp::Append { nonce, messages }.encode()
}

#[test]
fn an_op_round_trips_with_its_bytes_as_they_are() {
    let body = [0u8, 255, b'"', b'\\', 10];
    let messages = vec![
        op_message("t", Some("k"), &body, 3, 4),
        op_message("$dead", None, b"", 0, 1),
    ];
    let bytes = append_op(77, messages.clone());
    // The body is in the op as it is: no base64, no JSON array.
    assert!(bytes.windows(body.len()).any(|w| w == body));
    let BrokerOp::Append {
        nonce,
        messages: decoded,
    } = BrokerOp::decode(&bytes).unwrap()
    else {
        panic!("not an append");
    };
    assert_eq!(nonce, 77);
    assert_eq!(decoded.len(), 2);
    for (a, b) in decoded.iter().zip(&messages) {
        assert_eq!(a.chosen, b.chosen);
        let (a, b) = (&a.message, &b.message);
        assert_eq!(
            (&a.topic, &a.id, &a.key, &a.headers, &a.body),
            (&b.topic, &b.id, &b.key, &b.headers, &b.body)
        );
        assert_eq!(
            (a.deliver_at_ms, a.delivered_at_ms, a.attempt),
            (b.deliver_at_ms, b.delivered_at_ms, b.attempt)
        );
    }
    let commit = BrokerOp::CommitOffset {
        group: "g".into(),
        topic: "t".into(),
        queue: 2,
        offset: 9,
    };
    let BrokerOp::CommitOffset {
        group,
        topic,
        queue,
        offset,
    } = BrokerOp::decode(&commit.encode()).unwrap()
    else {
        panic!("not a commit");
    };
    assert_eq!(
        (group.as_str(), topic.as_str(), queue, offset),
        ("g", "t", 2, 9)
    );
}

/// Every cut of an op, every flipped byte, extra bytes, an unknown version or kind: an error that says
/// what is wrong, never a panic (a flip inside the JSON meta or the body may still decode).
#[test]
fn a_cut_or_garbled_op_is_an_error_naming_what_is_wrong() {
    let append = append_op(1, vec![op_message("t", Some("k"), b"body", 1, 4)]);
    let commit = BrokerOp::CommitOffset {
        group: "group".into(),
        topic: "topic".into(),
        queue: 0,
        offset: 5,
    }
    .encode();
    for bytes in [&append, &commit] {
        for cut in 0..bytes.len() {
            let why = BrokerOp::decode(&bytes[..cut]).map(|_| ()).unwrap_err();
            assert!(
                why.contains("cut short") || why.contains("not a broker record"),
                "cut at {cut}: {why}"
            );
        }
        for at in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[at] ^= 0xA5;
            let _ = BrokerOp::decode(&flipped);
        }
        let mut extra = bytes.clone();
        extra.push(0);
        let why = BrokerOp::decode(&extra).map(|_| ()).unwrap_err();
        assert!(why.contains("1 bytes after the end"), "{why}");
    }
    let why = |bytes: &[u8]| BrokerOp::decode(bytes).map(|_| ()).unwrap_err();
    assert!(why(&[2, 1]).contains("version 2"), "{}", why(&[2, 1]));
    assert!(why(&[1, 9]).contains("unknown kind 9"));
    // A count of messages far past the bytes there are allocates nothing and is reported.
    let mut huge = append.clone();
    huge[10..14].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(
        why(&huge).contains("of message 1 of 4294967295"),
        "{}",
        why(&huge)
    );
    // A queue past the topic's queue count.
    let bad_queue = append_op(1, vec![op_message("t", None, b"b", 4, 4)]);
    assert!(why(&bad_queue).contains("queue 4 of a topic of 4 queues"));
    // A name that is not UTF-8.
    let mut bad_name = commit.clone();
    bad_name[4] = 0xFF;
    assert!(why(&bad_name).contains("the group is not UTF-8"));
    // A name that would leave the broker's dir.
    let escape = BrokerOp::CommitOffset {
        group: "..".into(),
        topic: "t".into(),
        queue: 0,
        offset: 1,
    }
    .encode();
    assert!(
        why(&escape).contains("invalid group name"),
        "{}",
        why(&escape)
    );
}

/// Applied, an op puts each message in the queue it names (whatever the key or this member's own
/// round robin would say), creates a new topic with the op's queue count, and an op applied again
/// (after a restart) stores nothing twice, also after a reopen.
#[test]
fn an_applied_op_places_messages_where_it_says_and_only_once() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(4)).unwrap();
    let op = append_op(
        5,
        vec![
            op_message("t", Some("k"), b"first", 1, 2),
            op_message("t", Some("k"), b"second", 0, 2),
            op_message("t", None, b"third", 1, 2),
            op_message("$dead", None, b"dead", 0, 1),
        ],
    );
    broker.apply_op((3, 0), &op).unwrap();
    assert_eq!(broker.queue_offsets("t"), Some(vec![(0, 1), (0, 2)]));
    assert_eq!(broker.queue_offsets("$dead"), Some(vec![(0, 1)]));
    let read = |broker: &Broker, queue| bodies(&broker.read("t", queue, 0, 10).unwrap().unwrap());
    assert_eq!(read(&broker, 1), ["first", "third"]);
    assert_eq!(read(&broker, 0), ["second"]);
    let stored = broker.read("t", 1, 0, 1).unwrap().unwrap().messages;
    assert_eq!(stored[0].meta.op, Some((3, 0)));
    assert_eq!(stored[0].meta.headers["h"], "v");
    // Again, as after a restart: nothing more; an older op neither.
    broker.apply_op((3, 0), &op).unwrap();
    broker.apply_op((2, 7), &op).unwrap();
    assert_eq!(broker.queue_offsets("t"), Some(vec![(0, 1), (0, 2)]));
    // The next op goes on at the next offsets.
    let next = append_op(6, vec![op_message("t", None, b"fourth", 0, 2)]);
    broker.apply_op((3, 1), &next).unwrap();
    assert_eq!(read(&broker, 0), ["second", "fourth"]);
    // Offsets: set, set again alike.
    let commit = |offset| {
        BrokerOp::CommitOffset {
            group: "g".into(),
            topic: "t".into(),
            queue: 1,
            offset,
        }
        .encode()
    };
    broker.apply_op((4, 0), &commit(2)).unwrap();
    broker.apply_op((4, 0), &commit(2)).unwrap();
    assert_eq!(broker.group_offsets("g", "t"), BTreeMap::from([(1, 2)]));
    drop(broker);

    // Reopened (the last op found from the records after the checkpoint): applied again, nothing.
    let broker = Broker::open(dir.path(), options(4)).unwrap();
    broker.apply_op((3, 1), &next).unwrap();
    assert_eq!(read(&broker, 0), ["second", "fourth"]);
    // And from the checkpoint alone: the open wrote one that covers every record.
    drop(broker);
    assert_eq!(
        store::read_checkpoint_and_op(&dir.path().join("broker")).1,
        Some((3, 1))
    );
    let broker = Broker::open(dir.path(), options(4)).unwrap();
    broker.apply_op((3, 0), &op).unwrap();
    broker.apply_op((3, 1), &next).unwrap();
    assert_eq!(broker.queue_offsets("t"), Some(vec![(0, 2), (0, 2)]));
    assert_eq!(broker.queue_offsets("$dead"), Some(vec![(0, 1)]));
    assert_eq!(broker.group_offsets("g", "t"), BTreeMap::from([(1, 2)]));
}

/// What an apply refuses (and so stops the member): an op that does not decode, a queue the topic
/// does not have, a commit past a queue's end or for a queue that is not there.
#[test]
fn an_apply_refuses_what_would_make_members_differ() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(4)).unwrap();
    let err = broker.apply_op((1, 0), b"\x01").unwrap_err().to_string();
    assert!(
        err.contains("broker op 0 of Raft entry 1") && err.contains("cut short"),
        "{err}"
    );
    broker
        .apply_op(
            (1, 1),
            &append_op(1, vec![op_message("t", None, b"a", 0, 2)]),
        )
        .unwrap();
    // The topic has 2 queues: an op that thinks it has 8 and names queue 5 is refused, nothing stored.
    let err = broker
        .apply_op(
            (2, 0),
            &append_op(2, vec![op_message("t", None, b"b", 5, 8)]),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("queue 5 of a topic with 2 queues"), "{err}");
    assert_eq!(broker.queue_offsets("t"), Some(vec![(0, 1), (0, 0)]));
    for (queue, offset, why) in [(0, 2, "past the end"), (3, 0, "has 2 queues")] {
        let commit = BrokerOp::CommitOffset {
            group: "g".into(),
            topic: "t".into(),
            queue,
            offset,
        };
        let err = broker.apply_op((3, 0), &commit.encode()).unwrap_err();
        assert!(err.to_string().contains(why), "{err}");
    }
    assert!(broker.group_offsets("g", "t").is_empty());
}

/// A single node's broker proposes nothing: `replicate_through` is what makes it a member's.
#[test]
fn a_broker_without_a_replicated_log_writes_its_files_directly() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path(), options(2)).unwrap();
    assert_eq!(
        broker.append(vec![incoming("t", None, "a")]).unwrap().len(),
        1
    );
    broker.commit_offset("g", "t", 0, 0, 10).unwrap();
    // A member's broker whose log is gone refuses, storing nothing.
    let log_dir = tempfile::tempdir().unwrap();
    let options = schedulelog::Options {
        replicated: true,
        ..schedulelog::Options::default()
    };
    let log = Arc::new(ScheduleLog::open(log_dir.path(), options).unwrap());
    broker.replicate_through(&log);
    drop(log);
    let refused = broker.append(vec![incoming("t", None, "b")]);
    assert!(
        matches!(
            refused,
            Err(BrokerError::Replication(schedulelog::AppendError::Closed))
        ),
        "{refused:?}"
    );
    assert!(matches!(
        broker.commit_offset("g", "t", 0, 1, 10),
        Err(CommitError::Broker(BrokerError::Replication(_)))
    ));
    let total: u64 = broker.queue_offsets("t").unwrap().iter().map(|q| q.1).sum();
    assert_eq!(total, 1);
}

/// An op cut short by a crash between two of its writes (it crossed a segment boundary, and the
/// second write never reached the disk) is completed when applied again after the restart: the member
/// ends with every message of it, at the offsets the others have, none twice.
#[test]
fn an_op_cut_short_by_a_crash_is_completed_when_applied_again() {
    let dir = tempfile::tempdir().unwrap();
    let body = vec![b'x'; 2048];
    let op = append_op(
        9,
        (0..60)
            .map(|_| op_message("t", None, &body, 0, 1))
            .collect(),
    );
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    broker.apply_op((5, 0), &op).unwrap();
    assert_eq!(broker.queue_offsets("t"), Some(vec![(0, 60)]));
    drop(broker);
    // The crash: the newest segment (the op's second write) back to its header, and no checkpoint
    // past the op (recovery scans the log from the start).
    let log_dir = dir.path().join("broker/commitlog");
    let mut segments: Vec<_> = fs::read_dir(&log_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    segments.sort();
    assert!(segments.len() >= 2, "the op crossed a segment boundary");
    let newest = segments.last().unwrap();
    fs::OpenOptions::new()
        .write(true)
        .open(newest)
        .unwrap()
        .set_len(store::HEADER_LEN_FOR_TESTS)
        .unwrap();
    fs::remove_file(dir.path().join("broker/checkpoint")).unwrap();
    let broker = Broker::open(dir.path(), small(1)).unwrap();
    let (_, left) = broker.queue_offsets("t").unwrap()[0];
    assert!(left < 60, "the crash cut the op short ({left} left)");
    broker.apply_op((5, 0), &op).unwrap();
    assert_eq!(broker.queue_offsets("t"), Some(vec![(0, 60)]));
    // Applied once more: nothing more.
    broker.apply_op((5, 0), &op).unwrap();
    assert_eq!(broker.queue_offsets("t"), Some(vec![(0, 60)]));
}

/// A topic a crash left with fewer queue directories than the op that created it named is completed
/// by the op applied again, which then stores where it says.
#[test]
fn a_topic_cut_short_by_a_crash_gets_the_queues_its_op_names() {
    let dir = tempfile::tempdir().unwrap();
    let op = append_op(3, vec![op_message("t", None, b"m", 3, 4)]);
    let broker = Broker::open(dir.path(), options(4)).unwrap();
    broker.apply_op((2, 0), &op).unwrap();
    drop(broker);
    // The crash: queues 2 and 3 never made, nothing stored, no checkpoint of it.
    let topic = dir.path().join("broker/consumequeue/t");
    for queue in ["2", "3"] {
        fs::remove_dir_all(topic.join(queue)).unwrap();
    }
    fs::remove_dir_all(dir.path().join("broker/commitlog")).unwrap();
    fs::remove_file(dir.path().join("broker/checkpoint")).unwrap();
    let broker = Broker::open(dir.path(), options(4)).unwrap();
    assert_eq!(broker.queue_offsets("t").map(|q| q.len()), Some(2));
    broker.apply_op((2, 0), &op).unwrap();
    assert_eq!(
        broker.queue_offsets("t"),
        Some(vec![(0, 0), (0, 0), (0, 0), (0, 1)])
    );
}

/// A delivery the broker stored without its outcome (a crash came between the two) is held at the
/// next open, also after a second crash before it was reconciled, and reconciled once: its outcome
/// is recorded (`dead` with its reason for a dead letter); one whose outcome was recorded before the
/// crash gets none again. Nothing is stored twice.
#[test]
fn deliveries_stored_without_their_outcome_are_reconciled_at_the_next_open() {
    use schedulelog::{NewMessage, OutcomeKind, ScheduleLog};
    let dir = tempfile::tempdir().unwrap();
    let log = ScheduleLog::open(dir.path().join("log"), schedulelog::Options::default()).unwrap();
    let new = |body: &str| {
        let message = NewMessage {
            deliver_at_ms: 1,
            topic: "t".into(),
            sink: "broker".into(),
            body: body.as_bytes().to_vec(),
            ..NewMessage::default()
        };
        message.encode().unwrap()
    };
    let appended = log
        .append(vec![new("a"), new("b"), new("c")])
        .wait()
        .unwrap();
    let delivery = |n: usize, topic: &str| Incoming {
        id: appended[n].id.to_string(),
        attempt_at: Some(appended[n].location),
        ..stored_at(topic, None, &n.to_string(), 5)
    };
    let outcomes = |n: usize| log.outcomes_of(appended[n].location).unwrap().unwrap();
    {
        let broker = Broker::open(dir.path(), options(1)).unwrap();
        broker
            .append(vec![delivery(0, "t"), delivery(1, "t")])
            .unwrap();
        let mut dead = delivery(2, crate::scheduler::DEAD_TOPIC);
        dead.headers
            .insert(crate::scheduler::DEAD_REASON_HEADER.into(), "gone".into());
        broker.append(vec![dead]).unwrap();
        // The first one's outcome was recorded before the crash, the others' not.
        log.record_outcomes(&[delivered(appended[0].location)])
            .unwrap();
        broker.store_floors(&log).unwrap();
    }
    // A second crash before reconciling: the floor did not move past them.
    Broker::open(dir.path(), options(1))
        .unwrap()
        .store_floors(&log)
        .unwrap();
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    assert_eq!(broker.reconcile(&log), 2);
    assert_eq!(outcomes(0).len(), 1, "{:?}", outcomes(0));
    assert_eq!(outcomes(1)[0].kind, OutcomeKind::Delivered);
    assert_eq!(outcomes(1)[0].at_ms, 5);
    let gone = OutcomeKind::Dead {
        reason: "gone".into(),
    };
    assert_eq!(outcomes(2)[0].kind, gone);
    broker.store_floors(&log).unwrap();
    drop(broker);
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    assert_eq!(broker.reconcile(&log), 0);
    assert_eq!(outcomes(1).len(), 1);
    let stored = |topic: &str| broker.queue_offsets(topic).unwrap()[0].1;
    assert_eq!((stored("t"), stored(crate::scheduler::DEAD_TOPIC)), (2, 1));
}

/// A start looks the held deliveries up in the dispatch logs from the marks stored with the floor,
/// not from the start of the logs: an outcome recorded after a held delivery's append is found, also
/// when newer marks were taken after it before the floor moved to that delivery (the floor keeps the
/// marks taken before its delivery was appended), and one recorded before the marks is not read.
#[test]
fn held_deliveries_are_looked_up_from_the_marks_stored_with_their_floor() {
    use schedulelog::{NewMessage, ScheduleLog};
    let dir = tempfile::tempdir().unwrap();
    let open_log =
        || ScheduleLog::open(dir.path().join("log"), schedulelog::Options::default()).unwrap();
    let log = open_log();
    let message = NewMessage {
        deliver_at_ms: 1,
        topic: "t".into(),
        sink: "broker".into(),
        body: b"m".to_vec(),
        ..NewMessage::default()
    };
    let encoded = message.encode().unwrap();
    let appended = log.append(vec![encoded; 4]).wait().unwrap();
    let delivery = |n: usize| Incoming {
        id: appended[n].id.to_string(),
        attempt_at: Some(appended[n].location),
        ..stored_at("t", None, &n.to_string(), 5)
    };
    let record = |log: &ScheduleLog, n: usize| {
        let outcome = delivered(appended[n].location);
        log.record_outcomes(&[outcome]).unwrap();
    };
    let settled = || outcomes::read_settled(&dir.path().join("broker")).unwrap();
    {
        let broker = Broker::open(dir.path(), options(1)).unwrap();
        // Recorded before any mark (as no real delivery's outcome is: it comes after the append).
        record(&log, 3);
        broker.store_floors(&log).unwrap(); // the floor at the log's end, with the marks now
        assert_eq!(&*settled().marks, log.dispatch_marks().as_slice());
        broker.append(vec![delivery(0)]).unwrap();
        broker.store_floors(&log).unwrap(); // marks taken before 1's append
        broker.append(vec![delivery(1)]).unwrap();
        record(&log, 1); // past those marks
        broker.append(vec![delivery(2)]).unwrap();
        broker.store_floors(&log).unwrap(); // marks past 1's outcome; the floor stays at delivery 0
        record(&log, 0);
        broker.outcomes_recorded(&[&handed(appended[0].location, "t", b"0")]);
        broker.store_floors(&log).unwrap(); // the floor moves to 1: with the marks before it
        let stored = settled();
        assert_ne!(
            &*stored.marks,
            log.dispatch_marks().as_slice(),
            "not the newest"
        );
        broker.append(vec![delivery(3)]).unwrap();
    } // a crash: no other outcome reached the broker
    drop(log);
    let log = open_log();
    let broker = Broker::open(dir.path(), options(1)).unwrap();
    assert_eq!(
        broker.reconcile(&log),
        2,
        "2 and 3 had none since the marks"
    );
    let outcomes = |n: usize| log.outcomes_of(appended[n].location).unwrap().unwrap();
    for n in [0, 1, 2] {
        assert_eq!(outcomes(n).len(), 1, "{n}: {:?}", outcomes(n));
    }
    // 3's outcome from before the marks was not read: recorded again (harmlessly: a set).
    assert_eq!(outcomes(3).len(), 2, "{:?}", outcomes(3));
    assert_eq!(
        broker.queue_offsets("t").unwrap()[0].1,
        4,
        "each stored once"
    );
}

/// The floor is stored with the newest marks taken before the log reached it: those of a delivery
/// awaiting since before newer marks, and the newer ones once it is recorded. While the floor stays,
/// the marks it needs are kept however many are taken.
#[test]
fn a_floor_is_paired_with_the_marks_taken_before_its_delivery() {
    let marks = |end: u64| -> outcomes::Marks {
        vec![(schedulelog::Bucket::from_start_minute(60), end)].into()
    };
    let attempt = |seq| {
        let bucket = schedulelog::Bucket::from_start_minute(60);
        (schedulelog::Location { bucket, seq }, 0)
    };
    let mut awaiting = Awaiting::recovered(100, None, Vec::new());
    awaiting.marked(marks(10));
    awaiting.insert(100, attempt(1)); // appended at 100: after marks(10)
    awaiting.appended(200);
    awaiting.marked(marks(20));
    let stored = awaiting.to_store().unwrap();
    assert_eq!((stored.floor, stored.marks), (100, marks(10)));
    awaiting.stored(100);
    assert_eq!(awaiting.to_store(), None, "the floor did not move");
    for n in 0..1_000 {
        awaiting.appended(300 + n);
        awaiting.marked(marks(30 + n));
    }
    assert_eq!(
        awaiting.marks_at(100),
        marks(10),
        "kept while the floor stays"
    );
    awaiting.recorded([attempt(1)]);
    let stored = awaiting.to_store().unwrap();
    assert_eq!((stored.floor, stored.marks), (1_299, marks(1_029)));
}

/// A `settled` file carries its marks; one written before marks existed (the floor alone) is read
/// as a floor without marks, and a damaged one is not read.
#[test]
fn settled_files_are_read_with_their_marks_or_without() {
    let dir = tempfile::tempdir().unwrap();
    let bucket = |minute| schedulelog::Bucket::from_start_minute(minute);
    let settled = outcomes::Settled {
        floor: 4_096,
        marks: vec![(bucket(60), 16), (bucket(120), 9_000)].into(),
    };
    outcomes::write_settled(dir.path(), &settled).unwrap();
    let bytes = fs::read(dir.path().join("settled")).unwrap();
    assert_eq!(bytes.len(), 8 + 4 + 2 * 12 + 4);
    assert_eq!(outcomes::read_settled(dir.path()), Some(settled.clone()));
    for at in [0, 9, bytes.len() - 1] {
        let mut damaged = bytes.clone();
        damaged[at] ^= 1;
        assert_eq!(outcomes::decode_settled(&damaged), None, "byte {at}");
    }
    assert_eq!(outcomes::decode_settled(&bytes[..20]), None, "cut");
    let with_crc = |body: &[u8]| {
        let mut bytes = body.to_vec();
        bytes.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
        bytes
    };
    let body = &bytes[..bytes.len() - 4];
    let mut miscounted = body.to_vec();
    miscounted[8] = 3; // three marks said, two there
    assert_eq!(outcomes::decode_settled(&with_crc(&miscounted)), None);
    let none = outcomes::decode_settled(&with_crc(&[&body[..8], &[0; 4]].concat())).unwrap();
    assert_eq!(
        (none.floor, none.marks.len()),
        (4_096, 0),
        "no mark was open"
    );
    let read = outcomes::decode_settled(&with_crc(&4_096u64.to_le_bytes())).unwrap();
    assert_eq!((read.floor, read.marks.len()), (4_096, 0));
}

/// A delivery stored and awaiting its outcome (handed over again in the same run, or held since a
/// start that could not settle it) is answered delivered without being stored again, and once its
/// outcome is recorded it is let go (the floor moves).
#[test]
fn a_held_delivery_is_answered_stored_without_a_second_append() {
    let dir = tempfile::tempdir().unwrap();
    let location = schedulelog::Location {
        bucket: schedulelog::Bucket::from_start_minute(29_935_260),
        seq: 4,
    };
    let delivery = handed(location, "t", b"once");
    {
        let broker = Arc::new(Broker::open(dir.path(), small(1)).unwrap());
        let sink = BrokerSink::new(broker.clone());
        let answer = sink.deliver_blocking(std::slice::from_ref(&delivery));
        assert_eq!(answer, Some(vec![SinkOutcome::Delivered]));
        // Handed over again before its outcome is recorded (its answer lost): not stored again.
        let answer = sink.deliver_blocking(std::slice::from_ref(&delivery));
        assert_eq!(answer, Some(vec![SinkOutcome::Delivered]));
        assert_eq!(broker.queue_offsets("t").unwrap()[0].1, 1, "stored once");
    } // a crash before its outcome was recorded
    let broker = Arc::new(Broker::open(dir.path(), small(1)).unwrap());
    let sink = BrokerSink::new(broker.clone());
    let answer = sink.deliver_blocking(std::slice::from_ref(&delivery));
    assert_eq!(answer, Some(vec![SinkOutcome::Delivered]));
    assert_eq!(broker.queue_offsets("t").unwrap()[0].1, 1, "stored once");
    let log = ScheduleLog::open(dir.path().join("log"), schedulelog::Options::default()).unwrap();
    let floor = || outcomes::read_settled(&dir.path().join("broker")).map(|s| s.floor);
    broker.store_floors(&log).unwrap();
    let held_at = floor().unwrap();
    sink.outcomes_recorded(&[&delivery]);
    broker.store_floors(&log).unwrap();
    assert!(floor().unwrap() > held_at, "the floor moved past it");
    assert_eq!(broker.stored_already(&[delivery]), vec![false]);
}
