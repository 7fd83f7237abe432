//! Retention end to end: the service runs through a day of simulated time (a manual clock) under a
//! steady load of deliveries into the broker, and its data dir stops growing: finished schedule buckets
//! and their dispatch logs go after `retention`, broker segments after `broker.retention`, WAL files once
//! replayed and checkpointed.

use super::*;
use delayd::schedulelog::ManualClock;
use std::path::Path;

/// 2026-12-01T00:00:00Z
const T0: i64 = 1_796_083_200_000;
const HOUR: i64 = 3_600_000;

/// Bytes of the files under `path`. Retention deletes files as this walks: a file gone meanwhile counts 0.
fn dir_bytes(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(meta) if meta.is_dir() => dir_bytes(&e.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}

fn count_files(path: &Path, extension: &str) -> usize {
    std::fs::read_dir(path)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == extension)
        })
        .count()
}

/// Polls `condition` until it holds, for at most a minute.
fn wait_for(what: &str, condition: impl FnMut() -> bool) {
    common::wait_for(what, Duration::from_secs(60), condition);
}

#[test]
fn the_data_dir_levels_off_under_a_steady_load_of_deliveries() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let server = Server::start_with_clock(dir.path(), clock.clone(), |config| {
        config.retention = delayd::config::Millis(Duration::from_secs(2 * 3600));
        config.broker.retention = delayd::config::Millis(Duration::from_secs(2 * 3600));
        config.broker.segment_bytes = 256 << 10;
    });
    let topic = "hourly";
    let body = "r".repeat(1024);
    let (per_batch, batches, hours) = (500_i64, 6_i64, 24_i64);
    let per_hour = per_batch * batches;
    let first_id = std::cell::OnceCell::new();
    let offsets = |server: &Server| -> (u64, u64) {
        let info = server.call("GET", &format!("/v1/topics/{topic}"), None);
        if info.status != 200 {
            return (0, 0);
        }
        let queue = &info.json["queues"][0];
        (
            queue["min_offset"].as_u64().unwrap(),
            queue["max_offset"].as_u64().unwrap(),
        )
    };
    // The slow group below never reads: every message retention deletes counts as unread, and the
    // counter moves once the round's files are deleted. So a counter at `min_offset` (read first) means
    // the deletions that moved it there are done.
    let unread_retired = |server: &Server| -> u64 {
        scrape(&server.base)
            .get("delayd_broker_unread_retired_total")
            .copied()
            .unwrap_or(0.0) as u64
    };
    let retired_files_gone = |server: &Server| {
        let (min, _) = offsets(server);
        unread_retired(server) >= min
    };
    let mut sizes = Vec::new();
    for hour in 0..hours {
        // An hour's messages, due spread over the hour.
        let start = clock.now_ms();
        for batch in 0..batches {
            let messages: Vec<Value> = (0..per_batch)
                .map(|i| {
                    let n = batch * per_batch + i;
                    json!({"topic": topic, "body": body, "deliver_at": start + 1 + n * (HOUR - 2) / per_hour})
                })
                .collect();
            let answer = server.batch(&messages);
            first_id.get_or_init(|| {
                answer.json["results"][0]["id"]
                    .as_str()
                    .unwrap()
                    .to_string()
            });
        }
        // Through the hour a minute at a time; the broker gets each message as it comes due.
        for _ in 0..60 {
            clock.advance(60_000);
        }
        let sent = ((hour + 1) * per_hour) as u64;
        wait_for("the hour's deliveries", || offsets(&server).1 == sent);
        if hour == 0 {
            // A consumer group that never reads: retention deletes its messages all the same.
            let committed = server.call(
                "PUT",
                &format!("/v1/groups/slow/offsets/{topic}/0"),
                Some(json!({"offset": 0})),
            );
            assert_eq!(committed.status, 200, "{}", committed.json);
        }
        if hour >= 2 {
            // Broker retention runs once a second: wait for it to catch up with the clock. Segments
            // whose newest message is more than two hours old go: all but the last segment's worth
            // (256 KiB, about 230 messages) of the hours before that.
            let expired = ((hour - 1) * per_hour - 300) as u64;
            wait_for("broker retention", || {
                offsets(&server).0 >= expired && retired_files_gone(&server)
            });
            // And the loader's, which runs on its own thread as the clock moves: buckets that ended
            // more than two hours ago go, which leaves the last two hours' segments.
            wait_for("schedule retention", || {
                count_files(&dir.path().join("schedule"), "log") <= 2
            });
        }
        let data = dir.path();
        sizes.push((
            dir_bytes(&data.join("schedule")),
            dir_bytes(&data.join("dispatch")),
            dir_bytes(&data.join("broker")),
            count_files(&data.join("wal"), "wal"),
            count_files(&data.join("schedule"), "log"),
        ));
    }
    println!("hour: schedule/ dispatch/ broker/ bytes, WAL files, schedule segments");
    for (hour, s) in sizes.iter().enumerate() {
        println!(
            "{hour:>4}: {:>9} {:>7} {:>9} {} {}",
            s.0, s.1, s.2, s.3, s.4
        );
    }
    let total = |s: &(u64, u64, u64, usize, usize)| s.0 + s.1 + s.2;
    let middle = sizes[8..16].iter().map(total).max().unwrap();
    let last = sizes[16..].iter().map(total).max().unwrap();
    let all_sent = (hours * per_hour) as u64;
    assert!(
        last <= middle + middle / 10,
        "the data dir keeps growing: at most {middle} bytes in hours 8-15, {last} in hours 16-23"
    );
    // Two hours of retention plus the hour being delivered: about four buckets, whatever the history.
    assert!(sizes[16..].iter().all(|s| s.4 <= 5), "{sizes:?}");
    // About 80 MB went through the WAL: its files were deleted once replayed and checkpointed.
    assert!(sizes.iter().all(|s| s.3 <= 2), "{sizes:?}");
    let wal_files: Vec<String> = std::fs::read_dir(dir.path().join("wal"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        !wal_files.contains(&format!("{:020}.wal", 1)),
        "the first WAL file outlived its records: {wal_files:?}"
    );

    // The first message's bucket was retired with its retention: its id is unknown now.
    let first = first_id.get().unwrap();
    assert_eq!(
        server
            .call("GET", &format!("/v1/messages/{first}"), None)
            .status,
        404
    );
    // The group that never read: a pull from its offset starts at min_offset and says what it missed.
    let (min, max) = offsets(&server);
    assert_eq!(max, all_sent);
    assert!(min > 0);
    let pulled = server.call(
        "GET",
        &format!("/v1/topics/{topic}/queues/0/messages?offset=0&max=5"),
        None,
    );
    assert_eq!(pulled.status, 200, "{}", pulled.json);
    assert_eq!(pulled.json["skipped"], json!(min));
    assert_eq!(pulled.json["messages"][0]["offset"], json!(min));
    assert_eq!(pulled.json["next_offset"], json!(min + 5));
    wait_for("the unread count", || unread_retired(&server) >= min);
}
