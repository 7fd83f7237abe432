//! Exactly once into the built-in broker (broker/outcomes.rs): the real binary, killed with SIGKILL
//! while it delivers, round after round, stores every acknowledged message once.

use super::*;
use common::{env_number, wait_for, Draws, Process};
use std::collections::HashMap;

const TOPIC: &str = "once";

/// How many times each message id is stored in `topic`, over all its queues.
fn stored_ids(base: &str, topic: &str) -> HashMap<String, u32> {
    let mut ids = HashMap::new();
    for m in common::topic_messages(base, topic) {
        *ids.entry(m["id"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    ids
}

/// Messages stored in `topic` so far (the queues' `max_offset`s), 0 before the topic exists.
fn stored_count(base: &str, topic: &str) -> u64 {
    let info = request(base, "GET", &format!("/v1/topics/{topic}"), None, None);
    match info.status {
        200 => (info.json["queues"].as_array().unwrap().iter())
            .map(|q| q["max_offset"].as_u64().unwrap())
            .sum(),
        _ => 0,
    }
}

/// `DELAYD_BROKER_KILLS` (default 20) rounds: a batch of messages due within the next second and a
/// half, then, once the broker stored a drawn number of deliveries of this round, SIGKILL and start
/// again. Kills land among deliveries in flight: between a delivery's broker write and its outcome
/// too, which used to store it again after the restart. At the end every acknowledged message is
/// stored exactly once.
#[test]
fn deliveries_into_the_broker_are_stored_once_across_kill_9() {
    let kills = env_number("DELAYD_BROKER_KILLS", 20);
    let seed = env_number("DELAYD_BROKER_KILLS_SEED", now_ms() as u64);
    let mut draws = Draws::new(seed);
    let dir = tempfile::tempdir().unwrap();
    let mut acked: Vec<String> = Vec::new();
    let mut process: Process = spawn(dir.path(), &[]);
    for round in 0..kills {
        let now = now_ms();
        let messages: Vec<Value> = (0..400)
            .map(|i| {
                let due = now + draws.between((200, 1_500)) as i64;
                json!({"topic": TOPIC, "body": format!("r{round}m{i}"), "deliver_at": due})
            })
            .collect();
        let answer = request(
            &process.base,
            "POST",
            "/v1/messages/batch",
            Some(&json!({ "messages": messages }).to_string()),
            None,
        );
        assert_eq!(answer.status, 200, "{}", answer.json);
        for result in answer.json["results"].as_array().unwrap() {
            acked.push(result["id"].as_str().unwrap().to_string());
        }
        let before = stored_count(&process.base, TOPIC);
        let more = draws.between((1, 300));
        wait_for("deliveries of this round", Duration::from_secs(30), || {
            stored_count(&process.base, TOPIC) >= before + more
        });
        process.kill();
        process = spawn(dir.path(), &[]);
    }
    // Polled until every acknowledged id is there (a count could be reached by repeats).
    let deadline = Instant::now() + Duration::from_secs(60);
    let stored = loop {
        let stored = stored_ids(&process.base, TOPIC);
        if acked.iter().all(|id| stored.contains_key(id)) || Instant::now() > deadline {
            break stored;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let missing: Vec<&String> = acked
        .iter()
        .filter(|id| !stored.contains_key(*id))
        .collect();
    let twice: Vec<(&String, &u32)> = stored.iter().filter(|(_, n)| **n > 1).collect();
    println!(
        "{kills} kills: {} acknowledged, {} stored, {} twice (DELAYD_BROKER_KILLS_SEED={seed})",
        acked.len(),
        stored.len(),
        twice.len()
    );
    assert!(missing.is_empty(), "never stored: {missing:?}");
    assert!(twice.is_empty(), "stored more than once: {twice:?}");
    assert_eq!(stored.len(), acked.len(), "stored but never acknowledged");
    let metrics = scrape(&process.base);
    assert!(
        metrics.contains_key("delayd_broker_reconciled_total"),
        "{metrics:?}"
    );
}
