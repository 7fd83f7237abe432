//! Edge soak: the real binary under a low open-file limit (`ulimit -n 256`, soft and hard) with
//! slow-loris clients holding more stalled connections than that limit allows, reopening each one the
//! server closes, beside a normal load: producers on keep-alive and on fresh connections, single
//! messages and batches, over eight topics (each new topic opens consume-queue files: storage needs more
//! descriptors while the attack runs), a consumer reading every queue as messages come due, and a
//! readiness probe. Everything acknowledged must be
//! delivered, none early, every probe answered 200, no request answered otherwise than 2xx or a clean
//! 503, and storage must never meet EMFILE. Lateness is reported, not asserted (it depends on the
//! machine).
//!
//! A test binary of its own, like the crash soak: cargo runs test binaries one after another, so it
//! never shares the machine with the parallel `it` suite. `SOAK_EDGE_SECS` sets how long the load runs
//! (default 10), `SOAK_EDGE_ATTACKERS` the stalled connections (default 400).

#![allow(clippy::unwrap_used, reason = "tests stop at the first failure")]

mod common;

use common::slowloris::{self, Met, SlowLoris};
use common::{agent, env_number, now_ms, parse, scrape, Draws};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOPICS: usize = 8;
const QUEUES: usize = 4;
/// How far ahead a message is due, in ms.
const DUE_IN_MS: (u64, u64) = (200, 1_700);
const BATCH: usize = 50;

/// What the legitimate clients saw.
#[derive(Debug, Default)]
struct Ledger {
    /// Acknowledged id → due time (ms).
    acked: HashMap<String, i64>,
    requests_2xx: u64,
    /// Clean 503 `overloaded` (with Retry-After), each retried.
    overloaded: u64,
    probes_ready: u64,
    /// How long each probe took, in ms (a fresh connection each).
    probe_ms: Vec<i64>,
    /// Anything else (a transport error, another status): the soak fails on it.
    other: Vec<String>,
    /// The connection cap as `/metrics` showed it, when a scrape got through.
    caps_seen: Vec<u64>,
}

/// Records something the soak fails on.
fn record_other(ledger: &Mutex<Ledger>, what: String) {
    ledger.lock().unwrap().other.push(what);
}

/// [`slowloris::until_answered`] until `give_up` is set, counted in `ledger`.
fn until_answered(
    ledger: &Mutex<Ledger>,
    give_up: &AtomicBool,
    send: impl FnMut() -> Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Option<(u16, Value)> {
    let go_on = || !give_up.load(Ordering::Relaxed);
    slowloris::until_answered(send, go_on, Duration::from_millis(50), |met| {
        let mut ledger = ledger.lock().unwrap();
        match met {
            Met::Error(error) => ledger.other.push(error.to_string()),
            Met::Overloaded => ledger.overloaded += 1,
            Met::Success => ledger.requests_2xx += 1,
            // Not worth recording: the soak is over.
            Met::GaveUp => {}
        }
    })
}

/// One producer until `stop`: `kind` 0 sends one message per request on a fresh connection each time,
/// 1 one per request on a keep-alive connection, 2 batches of [`BATCH`] on a keep-alive connection.
fn produce(base: &str, kind: u8, seed: u64, ledger: &Mutex<Ledger>, stop: &AtomicBool) {
    let mut draws = Draws::new(seed);
    let kept = agent(Duration::from_secs(30));
    let mut sequence = 0u64;
    let never = AtomicBool::new(false);
    while !stop.load(Ordering::Relaxed) {
        let count = if kind == 2 { BATCH } else { 1 };
        let messages: Vec<Value> = (0..count)
            .map(|_| {
                sequence += 1;
                let topic = draws.next() as usize % TOPICS;
                let delay = draws.between(DUE_IN_MS);
                json!({"topic": format!("soak.edge.{topic}"), "body": format!("{kind}-{seed}-{sequence}"), "delay": delay})
            })
            .collect();
        let answer = until_answered(ledger, &never, || {
            let client = if kind == 0 {
                agent(Duration::from_secs(30))
            } else {
                kept.clone()
            };
            slowloris::post_messages(&client, base, &messages)
        });
        let other = |what| record_other(ledger, what);
        let Some(results) = slowloris::acknowledged(answer, other) else {
            continue;
        };
        let mut ledger = ledger.lock().unwrap();
        for result in results {
            if let Some(id) = result["id"].as_str() {
                ledger
                    .acked
                    .insert(id.to_string(), parse(&result["deliver_at"]));
            }
        }
    }
}

/// Quantiles of a sorted sample.
fn quantile(sorted: &[i64], q: f64) -> i64 {
    sorted
        .get(((sorted.len().max(1) - 1) as f64 * q).round() as usize)
        .copied()
        .unwrap_or(0)
}

#[test]
fn slow_loris_and_a_low_fd_limit_beside_normal_load_deliver_everything_on_time() {
    let started = Instant::now();
    let load_for = Duration::from_secs(env_number("SOAK_EDGE_SECS", 10));
    let attackers = env_number("SOAK_EDGE_ATTACKERS", 400) as usize;
    let dir = tempfile::tempdir().unwrap();
    let process = slowloris::spawn_with_256_fds(dir.path());
    let base = process.base.clone();
    let attack = SlowLoris::start(
        base.strip_prefix("http://").unwrap().parse().unwrap(),
        attackers,
    );
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop_producing = Arc::new(AtomicBool::new(false));
    let stop_all = Arc::new(AtomicBool::new(false));

    let producers: Vec<_> = [0u8, 1, 2, 2]
        .into_iter()
        .enumerate()
        .map(|(p, kind)| {
            let (base, ledger, stop) = (base.clone(), ledger.clone(), stop_producing.clone());
            std::thread::spawn(move || produce(&base, kind, 0x5eed + p as u64, &ledger, &stop))
        })
        .collect();
    let prober = {
        let (base, ledger, stop) = (base.clone(), ledger.clone(), stop_all.clone());
        std::thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                // A fresh connection each time, as an orchestrator's probe.
                let sent = Instant::now();
                match agent(Duration::from_secs(30))
                    .get(&format!("{base}/readyz"))
                    .call()
                {
                    Ok(r) if r.status() == 200 => {
                        let mut ledger = ledger.lock().unwrap();
                        ledger.probes_ready += 1;
                        ledger.probe_ms.push(sent.elapsed().as_millis() as i64);
                    }
                    Ok(r) => record_other(&ledger, format!("/readyz {}", r.status())),
                    Err(e) => record_other(&ledger, format!("/readyz {e}")),
                }
                // Once a second, the cap (a scrape past the cap is answered 503: skipped).
                if round.is_multiple_of(5) {
                    if let Ok(mut r) = agent(Duration::from_secs(30))
                        .get(&format!("{base}/metrics"))
                        .call()
                    {
                        if r.status() == 200 {
                            let text = r.body_mut().read_to_string().unwrap_or_default();
                            if let Some(cap) = text
                                .lines()
                                .find_map(|l| l.strip_prefix("delayd_http_connections_max "))
                            {
                                ledger.lock().unwrap().caps_seen.push(cap.parse().unwrap());
                            }
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    // The consumer reads every queue as messages come due, on a keep-alive connection: id → (due,
    // delivered_at, received here), all in ms.
    type Received = HashMap<String, (i64, i64, i64)>;
    let received: Arc<Mutex<Received>> = Arc::default();
    let consumer = {
        let (base, ledger, stop) = (base.clone(), ledger.clone(), stop_all.clone());
        let received = received.clone();
        std::thread::spawn(move || {
            let client = agent(Duration::from_secs(30));
            let mut offsets = [[0u64; QUEUES]; TOPICS];
            while !stop.load(Ordering::Relaxed) {
                for (topic, queues) in offsets.iter_mut().enumerate() {
                    for (queue, offset) in queues.iter_mut().enumerate() {
                        let path = format!(
                            "{base}/v1/topics/soak.edge.{topic}/queues/{queue}/messages?offset={offset}&max=1024&wait_ms=10"
                        );
                        let answer =
                            match until_answered(&ledger, &stop, || client.get(&path).call()) {
                                Some((200, answer)) => answer,
                                Some((404, _)) | None => continue, // not delivered to yet, or stopping
                                Some((status, answer)) => {
                                    record_other(&ledger, format!("pull {status}: {answer}"));
                                    continue;
                                }
                            };
                        let now = now_ms();
                        let mut received = received.lock().unwrap();
                        for message in answer["messages"].as_array().unwrap() {
                            received.insert(
                                message["id"].as_str().unwrap().to_string(),
                                (
                                    parse(&message["deliver_at"]),
                                    parse(&message["delivered_at"]),
                                    now,
                                ),
                            );
                        }
                        *offset = answer["next_offset"].as_u64().unwrap();
                    }
                }
            }
        })
    };

    std::thread::sleep(load_for); // the load runs for this long (the soak's length, not a sync)
    stop_producing.store(true, Ordering::Relaxed);
    for producer in producers {
        producer.join().unwrap();
    }
    let acked: HashMap<String, i64> = ledger.lock().unwrap().acked.clone();
    // The consumer goes on (beside the attack) until it has read everything acknowledged.
    let consume_within = Instant::now() + Duration::from_secs(60);
    while Instant::now() < consume_within {
        let received = received.lock().unwrap();
        if acked.keys().all(|id| received.contains_key(id)) {
            break;
        }
        drop(received);
        // Progress is a map the consumer fills; nothing to wait on but its lock.
        std::thread::sleep(Duration::from_millis(50));
    }
    stop_all.store(true, Ordering::Relaxed);
    consumer.join().unwrap();
    prober.join().unwrap();
    let received = std::mem::take(&mut *received.lock().unwrap());
    let attack_ran = started.elapsed();
    let report = attack.finish(Duration::from_secs(4));
    let series = scrape(&base);
    let ledger = ledger.lock().unwrap();

    let lost: Vec<&String> = acked
        .keys()
        .filter(|id| !received.contains_key(*id))
        .collect();
    let early: Vec<_> = received
        .iter()
        .filter(|(id, (due, delivered, _))| {
            delivered < due || acked.get(*id).is_some_and(|at| delivered < at)
        })
        .collect();
    let mut lateness: Vec<i64> = received.values().map(|(due, d, _)| d - due).collect();
    let mut lag: Vec<i64> = received.values().map(|(due, _, seen)| seen - due).collect();
    lateness.sort_unstable();
    lag.sort_unstable();
    let mut probe_ms = ledger.probe_ms.clone();
    probe_ms.sort_unstable();
    let caps: HashSet<u64> = ledger.caps_seen.iter().copied().collect();
    println!(
        "edge soak, {:.1} s of load at ulimit -n 256: {} acknowledged ({} requests 2xx, {} clean 503 retried), \
         {} delivered, {} lost, {} early; lateness (delivered_at - deliver_at) p50 {} ms, p99 {} ms, max {} ms; \
         consumer lag p50 {} ms, p99 {} ms, max {} ms; {} probes 200 (p50 {} ms, max {} ms); caps seen {:?}; \
         {attackers} slow-loris connections: {} opened, {} closed by the server (held p50 {} ms, max {} ms), \
         {} connect failures; refused {}, header timeouts {}; {:.1} s in all",
        load_for.as_secs_f64(),
        acked.len(),
        ledger.requests_2xx,
        ledger.overloaded,
        received.len(),
        lost.len(),
        early.len(),
        quantile(&lateness, 0.5),
        quantile(&lateness, 0.99),
        quantile(&lateness, 1.0),
        quantile(&lag, 0.5),
        quantile(&lag, 0.99),
        quantile(&lag, 1.0),
        ledger.probes_ready,
        quantile(&probe_ms, 0.5),
        quantile(&probe_ms, 1.0),
        {
            let mut caps: Vec<u64> = caps.into_iter().collect();
            caps.sort_unstable();
            caps
        },
        report.opened,
        report.closed_by_server,
        report.held_quantile(0.5),
        report.held_quantile(1.0),
        report.connect_failures,
        series["delayd_http_connections_refused_total"],
        series[r#"delayd_http_timeouts_total{phase="header"}"#],
        attack_ran.as_secs_f64(),
    );
    assert!(
        ledger.other.is_empty(),
        "not 2xx nor a clean 503: {:?}",
        ledger.other
    );
    assert!(
        lost.is_empty(),
        "{} acknowledged, never delivered: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    assert!(early.is_empty(), "delivered early: {early:?}");
    assert!(acked.len() > 1_000, "the load was real: {}", acked.len());
    assert!(ledger.probes_ready > 0);
    assert!(
        report.opened > attackers as u64 && report.closed_by_server >= attackers as u64,
        "the attack pressed: {report:?}"
    );
    assert_eq!(report.closed_after_stop, report.open_at_stop, "{report:?}");
    assert_eq!(series["delayd_read_errors_total"], 0.0);
    assert_eq!(series["delayd_wal_poisoned_total"], 0.0);
    let log = process.output_tail(100_000);
    assert!(
        !log.contains("os error 24") && !log.contains("Too many open files"),
        "{log}"
    );
}
