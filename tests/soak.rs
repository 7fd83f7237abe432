//! Crash soak: the real binary under a steady load of single and batched requests is killed with SIGKILL
//! and restarted, round after round; then an independent consumer reads every queue of the topic to the
//! end and checks that every acknowledged message was delivered once, none early (the broker sink is
//! exactly once, broker/outcomes.rs: a duplicate fails the soak).
//!
//! A test binary of its own: cargo runs test binaries one after another, so the soak never shares the
//! machine with the parallel `it` suite, and it measures the service rather than the scheduler of a busy
//! machine. Each kill is timed from observed acknowledgements, never from the spawn or a clock, so it
//! always lands under load, however slow the machine.
//!
//! The broker runs with 1 MiB commit log segments, so that kills also land while it rolls over to a new
//! segment or consume-queue file.
//!
//! `SOAK_KILLS` sets the number of kills (default 5, as in CI; docs/testing.md's long form: 25),
//! `SOAK_SEED` the seed of the kill points and due times.

#![allow(clippy::unwrap_used, reason = "tests stop at the first failure")]

mod common;

use common::{agent, env_number, now_ms, parse, request, spawn, write_file, Draws};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const TOPIC: &str = "soak";
/// Messages per request of the batching producers.
const BATCH: usize = 50;
/// How far ahead a message is due, in ms: deliveries fall due while the same and the next rounds run,
/// so kills also land among deliveries in flight.
const DUE_IN_MS: (u64, u64) = (200, 1_700);
/// A round is killed once it has seen this many acknowledged messages (drawn per round).
const ACKS_BEFORE_KILL: (u64, u64) = (100, 10_000);
/// A round that cannot reach its kill point within this long is a failure (the service stopped
/// acknowledging), not a slow machine.
const ROUND_WITHIN: Duration = Duration::from_secs(60);
/// The independent consumer's deadline for reading everything after the last restart.
const CONSUME_WITHIN: Duration = Duration::from_secs(120);

/// What the producers were told: acknowledged ids with their due times, counted per round.
#[derive(Default)]
struct Ledger {
    acked: HashMap<String, i64>,
    this_round: u64,
    single_requests: u64,
    batch_requests: u64,
    /// The last refusal or transport error, for the report when a round cannot reach its kill point.
    last_error: String,
}

#[derive(Default)]
struct Shared {
    ledger: Mutex<Ledger>,
    /// Notified on every acknowledgement: the killer waits on it.
    acked: Condvar,
}

/// One producer: one message per request (`batched` false) or [`BATCH`], until `stop`. A transport error
/// or a non-2xx answer (the server was killed, is restarting, or is overloaded) is followed by a short
/// pause and a fresh connection; it never ends the producer.
fn produce(base: &str, name: &str, batched: bool, seed: u64, shared: &Shared, stop: &AtomicBool) {
    let mut draws = Draws::new(seed);
    let mut client = agent(Duration::from_secs(10));
    let mut sequence = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let count = if batched { BATCH } else { 1 };
        let messages: Vec<Value> = (0..count)
            .map(|_| {
                sequence += 1;
                json!({"topic": TOPIC, "body": format!("{name}-{sequence}"), "delay": draws.between(DUE_IN_MS)})
            })
            .collect();
        let sent = if batched {
            client
                .post(&format!("{base}/v1/messages/batch"))
                .send_json(json!({ "messages": messages }))
        } else {
            client
                .post(&format!("{base}/v1/messages"))
                .send_json(&messages[0])
        };
        let answer = sent.map_err(|e| e.to_string()).and_then(|mut response| {
            let status = response.status();
            let body: Value = response.body_mut().read_json().map_err(|e| e.to_string())?;
            if status.is_success() {
                Ok(body)
            } else {
                Err(format!("{status}: {body}"))
            }
        });
        let answer = match answer {
            Ok(answer) => answer,
            Err(error) => {
                shared.ledger.lock().unwrap().last_error = error;
                std::thread::sleep(Duration::from_millis(10));
                client = agent(Duration::from_secs(10));
                continue;
            }
        };
        let results = if batched {
            answer["results"].as_array().cloned().unwrap_or_default()
        } else {
            vec![answer]
        };
        let mut ledger = shared.ledger.lock().unwrap();
        for result in &results {
            if let (Some(id), Some(_)) = (result["id"].as_str(), result["deliver_at"].as_str()) {
                ledger
                    .acked
                    .insert(id.to_string(), parse(&result["deliver_at"]));
                ledger.this_round += 1;
            }
        }
        if batched {
            ledger.batch_requests += 1;
        } else {
            ledger.single_requests += 1;
        }
        drop(ledger);
        shared.acked.notify_all();
    }
}

#[test]
fn crash_soak_with_kill_nine_under_load() {
    let started = Instant::now();
    let kills = env_number("SOAK_KILLS", 5);
    let seed = env_number("SOAK_SEED", 0x5eed);
    let mut draws = Draws::new(seed);
    let dir = tempfile::tempdir().unwrap();
    // Small broker segments (1 MiB, and so consume-queue files of 1,024 units): the kills land in the middle of
    // rolling over to a new segment or queue file too.
    let config_dir = tempfile::tempdir().unwrap();
    let config = write_file(
        config_dir.path(),
        "delayd.toml",
        "[broker]\nsegment_bytes = 1048576\n",
    );
    let args = ["--config", config.to_str().unwrap()];
    let shared = Arc::new(Shared::default());
    for round in 0..kills {
        let mut process = spawn(dir.path(), &args);
        let kill_after = draws.between(ACKS_BEFORE_KILL);
        shared.ledger.lock().unwrap().this_round = 0;
        let stop = Arc::new(AtomicBool::new(false));
        let round_started = Instant::now();
        // Four producers: two send one message per request, two send batches of 50.
        let producers: Vec<_> = (0..4)
            .map(|p| {
                let (base, shared, stop) = (process.base.clone(), shared.clone(), stop.clone());
                let seed = draws.next();
                std::thread::spawn(move || {
                    let name = format!("r{round}p{p}");
                    produce(&base, &name, p >= 2, seed, &shared, &stop);
                })
            })
            .collect();
        let ledger = shared.ledger.lock().unwrap();
        let (ledger, waited) = shared
            .acked
            .wait_timeout_while(ledger, ROUND_WITHIN, |l| l.this_round < kill_after)
            .unwrap();
        if waited.timed_out() {
            let message = format!(
                "round {round}: {} of {kill_after} acknowledgements within {ROUND_WITHIN:?}; last error: {}",
                ledger.this_round, ledger.last_error
            );
            drop(ledger);
            stop.store(true, Ordering::Relaxed);
            panic!("{message}");
        }
        drop(ledger);
        process.kill();
        let acked_at_kill = shared.ledger.lock().unwrap().this_round;
        stop.store(true, Ordering::Relaxed);
        for producer in producers {
            producer.join().unwrap();
        }
        println!(
            "round {round}: SIGKILL after {acked_at_kill} acknowledgements (kill point {kill_after}), {:?} after the server was ready",
            round_started.elapsed()
        );
    }
    // Every message made durable was sent before now, so it is due before this.
    let all_due_by_ms = now_ms() + DUE_IN_MS.1 as i64;
    let ledger = std::mem::take(&mut *shared.ledger.lock().unwrap());

    // The independent consumer: a restart, then every queue read to the end.
    let process = spawn(dir.path(), &args);
    let deadline = Instant::now() + CONSUME_WITHIN;
    let queues = loop {
        // The topic exists once the first delivery is stored; a pull on a missing topic waits for one.
        let info = request(
            &process.base,
            "GET",
            &format!("/v1/topics/{TOPIC}"),
            None,
            None,
        );
        if info.status == 200 {
            break info.json["queues"].as_array().unwrap().len();
        }
        assert!(Instant::now() < deadline, "the topic never appeared");
        let wait = format!("/v1/topics/{TOPIC}/queues/0/messages?wait_ms=1000");
        request(&process.base, "GET", &wait, None, None);
    };
    let mut deliveries = HashMap::<String, u32>::new();
    let mut early = Vec::new();
    let mut offsets = vec![0u64; queues];
    loop {
        let mut pulled = 0;
        for (queue, offset) in offsets.iter_mut().enumerate() {
            let path = format!(
                "/v1/topics/{TOPIC}/queues/{queue}/messages?offset={offset}&max=1024&wait_ms=200"
            );
            let answer = request(&process.base, "GET", &path, None, None);
            assert_eq!(answer.status, 200, "{}", answer.json);
            for message in answer.json["messages"].as_array().unwrap() {
                let id = message["id"].as_str().unwrap().to_string();
                let delivered_at = parse(&message["delivered_at"]);
                let promised = ledger.acked.get(&id).copied();
                if delivered_at < parse(&message["deliver_at"])
                    || promised.is_some_and(|at| delivered_at < at)
                {
                    early.push(message.clone());
                }
                *deliveries.entry(id).or_default() += 1;
                pulled += 1;
            }
            *offset = answer.json["next_offset"].as_u64().unwrap();
        }
        let all_acked_seen = ledger.acked.keys().all(|id| deliveries.contains_key(id));
        // The end: every acknowledged message seen, everything durable due, and a whole pass with
        // nothing new.
        if all_acked_seen && now_ms() > all_due_by_ms && pulled == 0 {
            break;
        }
        if Instant::now() > deadline {
            break;
        }
    }
    drop(process);

    let lost: Vec<&String> = ledger
        .acked
        .keys()
        .filter(|id| !deliveries.contains_key(*id))
        .collect();
    let duplicates: u32 = deliveries.values().map(|n| n - 1).sum();
    let unacknowledged = deliveries
        .keys()
        .filter(|id| !ledger.acked.contains_key(*id))
        .count();
    println!(
        "soak: {kills} kills, {} acknowledged ({} single requests, {} batches of {BATCH}), {} delivered, {unacknowledged} durable but unacknowledged, {duplicates} duplicates in the broker, {} lost, {} early; {:.1} s (SOAK_SEED={seed})",
        ledger.acked.len(),
        ledger.single_requests,
        ledger.batch_requests,
        deliveries.len(),
        lost.len(),
        early.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        lost.is_empty(),
        "{} acknowledged messages never delivered, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    // Into the built-in broker delivery is exactly once (broker/outcomes.rs), kills or not.
    let twice: Vec<_> = deliveries.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert_eq!(duplicates, 0, "stored more than once, e.g. {twice:?}");
    assert!(
        early.is_empty(),
        "{} delivered early, e.g. {}",
        early.len(),
        early[0]
    );
    assert!(
        ledger.acked.len() as u64 > 100 * kills,
        "the load was real: {} acknowledged over {kills} kills",
        ledger.acked.len()
    );
}
