//! Crash consistency with a real process: a child appends from several threads and prints each
//! acknowledgement; the parent kills it with SIGKILL at a random moment, reopens the data dir and checks
//! that every acknowledged message is there, exactly once, and that nothing else is.

use super::*;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

const CHILD_DIR: &str = "SCHEDULELOG_KILL_CHILD_DIR";
const THREADS: usize = 4;

/// The child's side: append forever, print "ack <seq> <body>" after each acknowledgement.
#[test]
#[ignore = "run by kill_nine_during_appends in a child process"]
fn kill_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let clock = Arc::new(ManualClock::new(T0));
    let log = Arc::new(ScheduleLog::open(&dir, options(&clock)).unwrap());
    let round = std::process::id();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let log = log.clone();
            std::thread::spawn(move || {
                for i in 0.. {
                    let body = format!("{round}-{t}-{i}");
                    let deliver_at = T0 + (i % 50) * 60_000;
                    let batch = vec![message(deliver_at, &body)];
                    let appended = log.append(batch).wait().unwrap();
                    println!("ack {} {body}", appended[0].location.seq);
                }
            })
        })
        .collect();
    for thread in threads {
        let _ = thread.join();
    }
}

#[test]
fn kill_nine_during_appends() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let mut acked: BTreeMap<u64, String> = BTreeMap::new();
    let mut seed = 0x9e37_79b9_u64;
    for round in 0..5 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let kill_after = 20 + (seed % 300) as usize;
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "tests::kill::kill_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut seen = 0;
        while seen < kill_after {
            let line = lines.next().expect("child ended early").unwrap();
            if let Some(rest) = line.strip_prefix("ack ") {
                let (seq, body) = rest.split_once(' ').unwrap();
                assert!(
                    acked
                        .insert(seq.parse().unwrap(), body.to_string())
                        .is_none(),
                    "seq {seq} acked twice"
                );
                seen += 1;
            }
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Acks printed before the kill landed are durable too.
        for line in lines.map_while(Result::ok) {
            if let Some((seq, body)) = line.strip_prefix("ack ").and_then(|r| r.split_once(' ')) {
                acked.insert(seq.parse().unwrap(), body.to_string());
            }
        }

        let log = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
        let stored = all_messages(&log);
        for (seq, body) in &acked {
            let message = stored
                .get(seq)
                .unwrap_or_else(|| panic!("round {round}: acked seq {seq} lost"));
            assert_eq!(message.body, body.as_bytes(), "round {round}: seq {seq}");
        }
        // Unacknowledged but durable records may survive; invented ones may not.
        for message in stored.values() {
            let body = std::str::from_utf8(&message.body).unwrap();
            assert_eq!(
                body.split('-').count(),
                3,
                "round {round}: unexpected record {body}"
            );
        }
        log.close().unwrap();
    }
    assert!(acked.len() >= 100);
}
