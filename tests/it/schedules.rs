//! Recurring schedules (DESIGN §14) in the real service: firings into a real webhook receiver, the
//! routes' answers, pause / resume / replace / delete as the receiver sees them, and no fire time made
//! twice (nor, with `catchup: all`, missed) across `kill -9` and restarts of the real binary.

use super::webhook::{endpoint, webhook_sink, Endpoint, Hit};
use super::*;
use common::{env_number, wait_for, Draws, Process};
use std::collections::{BTreeMap, BTreeSet};

/// A firing as the receiver saw it: its schedule, nominal time and message id.
fn firing(hit: &Hit) -> (String, i64, String) {
    let header = |name: &str| {
        hit.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("a firing carries {name}"))
            .to_string()
    };
    let fire_at = delayd::timestamp::parse_rfc3339(&header("delayd-fire-at")).unwrap();
    (header("delayd-schedule"), fire_at, hit.id.clone())
}

fn of(schedule: &str) -> impl Fn(&Hit) -> bool + '_ {
    move |hit| {
        hit.headers
            .get("delayd-schedule")
            .is_some_and(|v| v == schedule)
    }
}

/// Waits (30 s at most) until the receiver has `count` hits that match: they must come.
fn wait_hits(hook: &Endpoint, count: usize, matches: impl Fn(&Hit) -> bool) -> Vec<Hit> {
    let hits = hook.wait_until(count, matches);
    assert!(hits.len() >= count, "{} of {count} arrived", hits.len());
    hits
}

fn put(base: &str, id: &str, body: Value) -> Answer {
    request(
        base,
        "PUT",
        &format!("/v1/schedules/{id}"),
        Some(&body.to_string()),
        None,
    )
}

#[test]
fn an_interval_and_a_six_field_cron_fire_into_a_webhook_once_per_fire_time_never_early() {
    let hook = endpoint(&[]);
    let server = Server::start(|c| {
        c.sinks
            .insert("hook".into(), webhook_sink(&hook.url, |_, _| {}));
    });
    let answer = server.call(
        "PUT",
        "/v1/schedules/tick",
        Some(
            json!({"every": "1s", "topic": "ticks", "body": "tick", "sink": "hook",
            "headers": {"x-kind": "interval"}}),
        ),
    );
    assert_eq!(answer.status, 201, "{}", answer.json);
    let created = parse(&answer.json["created_at"]);
    let answer = server.call(
        "PUT",
        "/v1/schedules/even",
        Some(
            json!({"cron": "*/2 * * * * *", "tz": "Europe/Berlin", "topic": "evens",
            "body": "even", "sink": "hook"}),
        ),
    );
    assert_eq!(answer.status, 201, "{}", answer.json);
    assert!(
        parse(&answer.json["next_fire_at"]) % 2_000 == 0,
        "{}",
        answer.json
    );

    let ticks: Vec<_> = wait_hits(&hook, 4, of("tick")).iter().map(firing).collect();
    let evens: Vec<_> = wait_hits(&hook, 3, of("even")).iter().map(firing).collect();
    // The interval's phase is its creation: a second after it (or the first second after the put
    // was committed, had that taken longer), then each second.
    let first = ticks[0].1;
    assert!(
        first > created && (first - created) % 1_000 == 0,
        "{ticks:?}"
    );
    assert!(first <= created + 2_000, "{ticks:?}");
    for (n, (_, fire_at, _)) in ticks.iter().take(4).enumerate() {
        assert_eq!(*fire_at, first + 1_000 * n as i64, "{ticks:?}");
    }
    for pair in evens.windows(2) {
        assert_eq!(pair[1].1 - pair[0].1, 2_000, "{evens:?}");
    }
    assert!(evens.iter().all(|(_, at, _)| at % 2_000 == 0));
    // Never early, each a message of its own, with the schedule's own headers after the firing's.
    for hit in hook.hits() {
        let (_, fire_at, _) = firing(&hit);
        assert!(hit.at_ms >= fire_at, "delivered before its fire time");
        assert_eq!(hit.attempt, 0);
    }
    let ids: BTreeSet<String> = hook.hits().iter().map(|h| h.id.clone()).collect();
    assert_eq!(ids.len(), hook.hits().len(), "one message per firing");
    let first = &wait_hits(&hook, 1, of("tick"))[0];
    assert_eq!(first.body, b"tick");
    assert_eq!(first.headers["x-kind"], "interval");
    assert_eq!(first.headers["delayd-topic"], "ticks");

    let answer = server.call("GET", "/v1/schedules/tick", None);
    assert_eq!(answer.status, 200);
    assert!(
        answer.json["fired"].as_u64().unwrap() >= 4,
        "{}",
        answer.json
    );
    let last = answer.json["last_message_id"].as_str().unwrap().to_string();
    let status = server.call("GET", &format!("/v1/messages/{last}"), None);
    assert_eq!(
        status.json["topic"], "ticks",
        "a firing is an ordinary message"
    );
}

#[test]
fn schedule_routes_answer_as_documented() {
    let server = Server::start(|_| {});
    let good = json!({"cron": "0 9 * * MON-FRI", "tz": "Europe/Berlin", "topic": "reports.daily",
        "body": "report"});
    let answer = server.call("PUT", "/v1/schedules/daily", Some(good.clone()));
    assert_eq!(answer.status, 201, "{}", answer.json);
    // 09:00 in Berlin is 08:00 or 07:00 UTC, on a weekday.
    let next = answer.json["next_fire_at"].as_str().unwrap().to_string();
    assert!(
        next.ends_with("T08:00:00.000Z") || next.ends_with("T07:00:00.000Z"),
        "{next}"
    );
    assert_eq!(answer.json["catchup"], "one");
    assert_eq!(answer.json["sink"], "broker");
    // `every` in milliseconds, a number or its digits.
    let ms = json!({"every": 90_000, "topic": "t", "body": "x"});
    let ninety = server.call("PUT", "/v1/schedules/ninety", Some(ms));
    assert_eq!(
        (ninety.status, &ninety.json["every"]),
        (201, &json!("90000")),
        "{}",
        ninety.json
    );
    assert_eq!(
        server.call("DELETE", "/v1/schedules/ninety", None).status,
        200
    );
    // Put again unchanged: 200, nothing new; changed: 200, replaced.
    let again = server.call("PUT", "/v1/schedules/daily", Some(good.clone()));
    assert_eq!(again.status, 200);
    assert_eq!(again.json["created_at"], answer.json["created_at"]);
    let mut changed = good.clone();
    changed["body"] = json!("report v2");
    let replaced = server.call("PUT", "/v1/schedules/daily", Some(changed));
    assert_eq!(replaced.status, 200);
    assert_eq!(replaced.json["body"], "report v2");

    let cases = [
        (
            json!({"cron": "61 * * * *", "topic": "t", "body": "x"}),
            "invalid_cron",
        ),
        (
            json!({"cron": "* * * * *", "every": "1s", "topic": "t", "body": "x"}),
            "invalid_cron",
        ),
        (json!({"topic": "t", "body": "x"}), "invalid_cron"),
        (
            json!({"cron": "* * * * *", "tz": "Mars/Base", "topic": "t", "body": "x"}),
            "invalid_tz",
        ),
        (
            json!({"every": "500ms", "topic": "t", "body": "x"}),
            "invalid_every",
        ),
        (
            json!({"every": 999, "topic": "t", "body": "x"}),
            "invalid_every",
        ),
        (
            json!({"every": "soon", "topic": "t", "body": "x"}),
            "invalid_every",
        ),
        (
            json!({"every": "1s", "topic": "t", "body": "x", "start_at": "yesterday"}),
            "invalid_start_at",
        ),
        (
            json!({"every": "1s", "topic": "t", "body": "x", "start_at": 2_000, "end_at": 1_000}),
            "invalid_end_at",
        ),
        (
            json!({"every": "1s", "topic": "bad topic", "body": "x"}),
            "invalid_topic",
        ),
        (
            json!({"every": "1s", "topic": "t", "body": "x", "sink": "nowhere"}),
            "unknown_sink",
        ),
        (
            json!({"every": "1s", "topic": "t", "body": "x", "headers": {"delayd-fire-at": "x"}}),
            "invalid_header",
        ),
        (json!({"every": "1s", "topic": "t"}), "invalid_body"),
        (
            json!({"every": "1s", "topic": "t", "body": "x", "catchup": "some"}),
            "invalid_json",
        ),
        (
            json!({"every": "1s", "topic": "t", "body": "x", "color": "red"}),
            "invalid_json",
        ),
    ];
    for (body, code) in cases {
        let answer = server.call("PUT", "/v1/schedules/bad", Some(body.clone()));
        answer.assert_problem(400, code);
    }
    server
        .call("PUT", "/v1/schedules/bad%20id", Some(good.clone()))
        .assert_problem(400, "invalid_schedule_id");
    for (method, path) in [
        ("GET", "/v1/schedules/nothing"),
        ("DELETE", "/v1/schedules/nothing"),
        ("POST", "/v1/schedules/nothing/pause"),
        ("POST", "/v1/schedules/nothing/resume"),
    ] {
        server
            .call(method, path, None)
            .assert_problem(404, "not_found");
    }

    // Paging by id: 5 schedules, 2 a page.
    for n in 0..4 {
        let answer = server.call("PUT", &format!("/v1/schedules/s{n}"), Some(good.clone()));
        assert_eq!(answer.status, 201);
    }
    let mut ids = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/schedules?limit=2&cursor={c}"),
            None => "/v1/schedules?limit=2".to_string(),
        };
        let page = server.call("GET", &path, None);
        assert_eq!(page.status, 200, "{}", page.json);
        let schedules = page.json["schedules"].as_array().unwrap();
        assert!(schedules.len() <= 2);
        ids.extend(
            schedules
                .iter()
                .map(|s| s["id"].as_str().unwrap().to_string()),
        );
        match page.json["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => break,
        }
    }
    assert_eq!(ids, ["daily", "s0", "s1", "s2", "s3"]);
    server
        .call("GET", "/v1/schedules?limit=0", None)
        .assert_problem(400, "invalid_query");
}

/// Waits until the receiver saw the schedule `probe` fire `count` more times: proof that firings go
/// on, so that one that did not come for another schedule meanwhile never will.
fn while_probe_fires(hook: &Endpoint, count: usize) {
    let seen = hook.hits().iter().filter(|h| of("probe")(h)).count();
    wait_hits(hook, seen + count, of("probe"));
}

#[test]
fn pause_resume_replace_and_delete_take_effect_at_their_answer() {
    let hook = endpoint(&[]);
    let server = Server::start(|c| {
        c.sinks
            .insert("hook".into(), webhook_sink(&hook.url, |_, _| {}));
    });
    let every = |body: &str| json!({"every": "1s", "topic": "t", "body": body, "sink": "hook"});
    assert_eq!(
        server
            .call("PUT", "/v1/schedules/probe", Some(every("probe")))
            .status,
        201
    );
    assert_eq!(
        server
            .call("PUT", "/v1/schedules/tick", Some(every("v1")))
            .status,
        201
    );
    wait_hits(&hook, 2, of("tick"));

    // Paused: nothing of it fires after the answer (its planned firing is cancelled).
    let paused = server.call("POST", "/v1/schedules/tick/pause", None);
    assert_eq!(paused.status, 200, "{}", paused.json);
    let paused_at = now_ms();
    assert_eq!(paused.json["paused"], true);
    assert!(paused.json["next_fire_at"].is_null());
    while_probe_fires(&hook, 3);
    let late: Vec<_> = (hook.hits().iter().filter(|h| of("tick")(h)))
        .filter(|h| firing(h).1 > paused_at)
        .map(firing)
        .collect();
    assert!(late.is_empty(), "fired after the pause: {late:?}");
    // Its last firing was delivered before the pause, or is cancelled by it.
    let last = paused.json["last_message_id"].as_str().unwrap();
    let status = settled_message(&server.base, last).json["status"].clone();
    assert!(status == "delivered" || status == "cancelled", "{status}");

    // Resumed: it fires again, planned from the resume (nothing missed while paused is made).
    let resuming_at = now_ms();
    let resumed = server.call("POST", "/v1/schedules/tick/resume", None);
    assert_eq!(resumed.status, 200);
    assert!(
        parse(&resumed.json["next_fire_at"]) > resuming_at,
        "{}",
        resumed.json
    );
    wait_hits(&hook, 1, |h| of("tick")(h) && firing(h).1 > paused_at);
    let between: Vec<_> = (hook.hits().iter().filter(|h| of("tick")(h)))
        .map(firing)
        .filter(|(_, at, _)| *at > paused_at && *at <= resuming_at)
        .collect();
    assert!(
        between.is_empty(),
        "made up firings of the pause: {between:?}"
    );

    // Replaced: what fires after the answer is the new definition.
    let replaced = server.call("PUT", "/v1/schedules/tick", Some(every("v2")));
    assert_eq!(replaced.status, 200);
    let replaced_at = now_ms();
    wait_hits(&hook, 2, |h| h.body == b"v2");
    let stale: Vec<_> = (hook.hits().iter())
        .filter(|h| h.body == b"v1" && firing(h).1 > replaced_at)
        .map(firing)
        .collect();
    assert!(
        stale.is_empty(),
        "the old definition fired after the replace: {stale:?}"
    );

    // Deleted: gone, and nothing of it fires after the answer.
    let deleted = server.call("DELETE", "/v1/schedules/tick", None);
    assert_eq!(deleted.status, 200);
    assert_eq!(deleted.json, json!({"id": "tick", "status": "deleted"}));
    let deleted_at = now_ms();
    server
        .call("GET", "/v1/schedules/tick", None)
        .assert_problem(404, "not_found");
    while_probe_fires(&hook, 3);
    let late: Vec<_> = (hook.hits().iter().filter(|h| of("tick")(h)))
        .filter(|h| firing(h).1 > deleted_at)
        .map(firing)
        .collect();
    assert!(late.is_empty(), "fired after the delete: {late:?}");
}

/// Every firing the broker holds for `topic`, by message id (a redelivery after a crash may store one
/// twice: the broker sink is at least once), as (schedule, fire time).
fn broker_firings(base: &str, topic: &str) -> BTreeMap<String, (String, i64)> {
    let mut firings = BTreeMap::new();
    for m in common::topic_messages(base, topic) {
        let fire_at = parse(&m["headers"]["delayd-fire-at"]);
        assert!(parse(&m["delivered_at"]) >= fire_at, "never early: {m}");
        let schedule = m["headers"]["delayd-schedule"].as_str().unwrap();
        firings.insert(
            m["id"].as_str().unwrap().to_string(),
            (schedule.to_string(), fire_at),
        );
    }
    firings
}

fn fired(base: &str, id: &str) -> u64 {
    let answer = request(base, "GET", &format!("/v1/schedules/{id}"), None, None);
    assert_eq!(answer.status, 200, "{}", answer.json);
    answer.json["fired"].as_u64().unwrap()
}

/// `DELAYD_SCHEDULE_KILLS` (default 12) times: wait until the schedules fired again, SIGKILL the
/// process (now and then after staying down for 1.5 to 3 s, so that fire times are missed), start it
/// again. Then every fire time is one message: none twice; with `catchup: all` none missing either;
/// with `one` and `none` the fire times still follow each other on the schedule's phase.
#[test]
fn no_fire_time_is_made_twice_across_kill_9_and_restarts() {
    let kills = env_number("DELAYD_SCHEDULE_KILLS", 12);
    let dir = tempfile::tempdir().unwrap();
    let mut process: Process = spawn(dir.path(), &[]);
    let schedules = [
        ("all", json!({"every": "1s", "catchup": "all"})),
        ("one", json!({"cron": "* * * * * *", "catchup": "one"})),
        ("none", json!({"every": "1s", "catchup": "none"})),
    ];
    for (id, timing) in &schedules {
        let mut body = timing.clone();
        body["topic"] = json!("firings");
        body["body"] = json!(*id);
        body["key"] = json!("one queue");
        let answer = put(&process.base, id, body);
        assert_eq!(answer.status, 201, "{}", answer.json);
    }
    // (A process of its own: the in-process servers of other tests share one metrics recorder.)
    wait_for(
        "the gauge counts the schedules",
        Duration::from_secs(10),
        || scrape(&process.base).get("delayd_schedules") == Some(&3.0),
    );
    let mut draws = Draws::new(now_ms() as u64);
    for kill in 0..kills {
        let before = fired(&process.base, "all");
        wait_for("the schedules fired again", Duration::from_secs(30), || {
            fired(&process.base, "all") >= before + draws.between((1, 3))
        });
        process.kill();
        if kill % 3 == 2 {
            // Down long enough to miss fire times: what catch-up is for.
            std::thread::sleep(Duration::from_millis(draws.between((1_500, 3_000))));
        }
        process = spawn(dir.path(), &[]);
    }
    let before = fired(&process.base, "all");
    wait_for(
        "the schedules fired after the last start",
        Duration::from_secs(30),
        || fired(&process.base, "all") >= before + 2,
    );
    for (id, _) in &schedules {
        let answer = request(
            &process.base,
            "POST",
            &format!("/v1/schedules/{id}/pause"),
            None,
            None,
        );
        assert_eq!(answer.status, 200, "{}", answer.json);
    }
    // Everything written before the pauses is delivered (or cancelled by them) before counting.
    for (id, _) in &schedules {
        let answer = request(
            &process.base,
            "GET",
            &format!("/v1/schedules/{id}"),
            None,
            None,
        );
        let last = answer.json["last_message_id"].as_str().unwrap().to_string();
        wait_for("the last firing settled", Duration::from_secs(30), || {
            let status = settled_message(&process.base, &last).json["status"].clone();
            status == "delivered" || status == "cancelled"
        });
    }
    let firings = broker_firings(&process.base, "firings");
    let mut by_time: BTreeMap<(String, i64), Vec<&String>> = BTreeMap::new();
    for (message, key) in &firings {
        by_time.entry(key.clone()).or_default().push(message);
    }
    let twice: Vec<_> = by_time.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(twice.is_empty(), "fire times made twice: {twice:?}");
    for (id, _) in &schedules {
        let times: Vec<i64> = (by_time.keys())
            .filter(|(s, _)| s == id)
            .map(|(_, at)| *at)
            .collect();
        let written = fired(&process.base, id);
        assert!(
            times.len() as u64 + 1 >= written && times.len() as u64 <= written,
            "{id}: {} delivered of {written} written (the last may be cancelled by the pause)",
            times.len()
        );
        assert!(
            times.len() >= kills as usize,
            "{id}: fired {} times",
            times.len()
        );
        for pair in times.windows(2) {
            let gap = pair[1] - pair[0];
            assert!(gap > 0 && gap % 1_000 == 0, "{id}: {pair:?} off its phase");
            if *id == "all" {
                assert_eq!(gap, 1_000, "{id}: a fire time missing between {pair:?}");
            }
        }
        println!("{id}: {} firings, each once", times.len());
    }
    let metrics = scrape(&process.base);
    let fired = metrics.get(r#"delayd_schedule_firings_total{outcome="fired"}"#);
    assert!(fired.is_some_and(|n| *n >= 1.0), "{metrics:?}");
    assert!(metrics.contains_key(r#"delayd_schedule_firings_total{outcome="skipped"}"#));
}

/// A pause withdraws what it finds planned: the firing written ahead (cancelled by the pause), and
/// an attempt of an earlier firing waiting for its retry (withdrawn by the lane when it comes due,
/// recorded as cancelled, never sent). Neither reaches the receiver; the schedule's status says so.
#[test]
fn a_pause_withdraws_the_planned_firing_and_a_retry_waiting_for_its_time() {
    // The first firing's first attempt is refused: its retry is due 4 to 8 s later (jitter).
    let hook = endpoint(&[("flaky", vec!["503"])]);
    let server = Server::start(|c| {
        let sink = webhook_sink(&hook.url, |s, _| {
            s.backoff_initial = delayd::config::Millis(Duration::from_millis(8_000));
            s.backoff_multiplier = 1.0;
        });
        c.sinks.insert("hook".into(), sink);
    });
    let body = json!({"every": "3s", "topic": "t", "body": "flaky", "sink": "hook"});
    assert_eq!(
        server.call("PUT", "/v1/schedules/flaky", Some(body)).status,
        201
    );
    // The first firing was refused; pause while its retry waits and the next firing is planned.
    let refused = wait_hits(&hook, 1, of("flaky")).remove(0);
    let retrying = refused.id.clone();
    wait_for("the retry written", Duration::from_secs(10), || {
        server
            .call("GET", &format!("/v1/messages/{retrying}"), None)
            .json["status"]
            == "retrying"
    });
    wait_for("the next firing planned", Duration::from_secs(10), || {
        let answer = server.call("GET", "/v1/schedules/flaky", None);
        answer.json["last_message_id"].as_str() != Some(retrying.as_str())
    });
    let paused = server.call("POST", "/v1/schedules/flaky/pause", None);
    assert_eq!(paused.status, 200, "{}", paused.json);
    let planned = paused.json["last_message_id"].as_str().unwrap().to_string();
    for id in [&planned, &retrying] {
        wait_for("withdrawn", Duration::from_secs(20), || {
            server.call("GET", &format!("/v1/messages/{id}"), None).json["status"] == "cancelled"
        });
    }
    let status = server.call("GET", &format!("/v1/messages/{retrying}"), None);
    let history = status.json["history"].as_array().unwrap();
    assert_eq!(
        (history.len(), &history[1]["outcome"]),
        (2, &json!("cancelled")),
        "the retry was withdrawn: {}",
        status.json
    );
    // A schedule that goes on (another body, never refused) shows time passing; nothing more of the
    // paused one arrives, and its firing's retry never went out.
    let probe = json!({"every": "1s", "topic": "t", "body": "probe", "sink": "hook"});
    assert_eq!(
        server
            .call("PUT", "/v1/schedules/probe", Some(probe))
            .status,
        201
    );
    while_probe_fires(&hook, 2);
    let flaky: Vec<_> = hook.hits().into_iter().filter(|h| of("flaky")(h)).collect();
    assert_eq!(
        flaky.len(),
        1,
        "only the refused first attempt: {:?}",
        flaky.iter().map(firing).collect::<Vec<_>>()
    );
}

/// Every schedule of a page of `GET /v1/schedules` whose next firing is due before `now` yet not
/// written: `next_fire_at` names the written firing while it is ahead, else the next one to write.
fn overdue(base: &str, now: i64) -> Vec<(String, i64)> {
    let mut overdue = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let path = match &after {
            Some(cursor) => format!("/v1/schedules?limit=1000&cursor={cursor}"),
            None => "/v1/schedules?limit=1000".to_string(),
        };
        let page = request(base, "GET", &path, None, None);
        assert_eq!(page.status, 200, "{}", page.json);
        for schedule in page.json["schedules"].as_array().unwrap() {
            let next = parse(&schedule["next_fire_at"]);
            if next < now {
                overdue.push((schedule["id"].as_str().unwrap().to_string(), next));
            }
        }
        match page.json["next_cursor"].as_str() {
            Some(cursor) => after = Some(cursor.to_string()),
            None => return overdue,
        }
    }
}

/// Thousands of schedules put as fast as four clients can, while the first of them already fire:
/// the planner takes every schedule put at its next turn, so each firing is written ahead of its
/// time (none is seen due and unwritten, none is skipped as missed).
#[test]
fn a_burst_of_puts_is_planned_ahead_while_earlier_schedules_fire() {
    let count = env_number("DELAYD_SCHEDULE_BURST", 4_000) as usize;
    let dir = tempfile::tempdir().unwrap();
    let process: Process = spawn(dir.path(), &[]);
    let base = process.base.clone();
    let putting = std::sync::atomic::AtomicUsize::new(0);
    let seen_overdue = std::thread::scope(|scope| {
        for client in 0..4 {
            let (base, putting) = (&base, &putting);
            scope.spawn(move || {
                for n in (client..count).step_by(4) {
                    let body = json!({"every": "6s", "topic": "burst", "body": n.to_string()});
                    let answer = put(base, &format!("burst-{n}"), body);
                    assert_eq!(answer.status, 201, "{}", answer.json);
                    putting.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        // Watch through the puts and two rounds of firings after them.
        let mut seen = Vec::new();
        let mut done_at = None;
        loop {
            let now = now_ms();
            seen.extend(overdue(&base, now));
            if putting.load(std::sync::atomic::Ordering::Relaxed) == count {
                let done = *done_at.get_or_insert(now);
                if now > done + 12_000 {
                    return seen;
                }
            }
        }
    });
    assert!(
        seen_overdue.is_empty(),
        "{} due and unwritten: {:?}",
        seen_overdue.len(),
        &seen_overdue[..seen_overdue.len().min(20)]
    );
    let metrics = scrape(&base);
    let firings = |outcome: &str| {
        let key = format!(r#"delayd_schedule_firings_total{{outcome="{outcome}"}}"#);
        metrics.get(&key).copied().unwrap_or(0.0) as usize
    };
    assert_eq!(firings("skipped"), 0, "{metrics:?}");
    assert!(firings("fired") >= 2 * count, "{} fired", firings("fired"));
    println!(
        "{count} schedules, {} firings written ahead",
        firings("fired")
    );
}
