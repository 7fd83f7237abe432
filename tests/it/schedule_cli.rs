//! `delayd schedule put|list|pause|resume|delete` (DESIGN §14) against the real binary: the commands'
//! output, exit codes and problems, and the firings they make, read back with `delayd tail`.

use super::*;

/// What a finished `delayd` command said.
struct Ran {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Ran {
    /// Its stdout as JSON (the answers `put`, `pause`, `resume` and `list --json` print).
    fn json(&self) -> Value {
        assert!(self.ok, "{}{}", self.stdout, self.stderr);
        serde_json::from_str(self.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", self.stdout))
    }
}

/// `delayd ARGS...` against the service at `base`, run to its end.
fn delayd(base: &str, args: &[&str]) -> Ran {
    let output = Command::new(env!("CARGO_BIN_EXE_delayd"))
        .args(args)
        .env("DELAYD_URL", base)
        .env_remove("DELAYD_TOKEN")
        .output()
        .unwrap();
    Ran {
        ok: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).to_string(),
        stderr: String::from_utf8_lossy(&output.stderr).to_string(),
    }
}

/// The line of `delayd schedule list`'s table for schedule `id`, split at runs of spaces (a cron
/// pattern's fields are cells of their own).
fn listed(base: &str, id: &str) -> Vec<String> {
    let list = delayd(base, &["schedule", "list"]);
    assert!(list.ok, "{}", list.stderr);
    let mut lines = list.stdout.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "id",
            "schedule",
            "tz",
            "paused",
            "next_fire_at",
            "last_fire_at",
            "fired"
        ]
    );
    lines
        .map(|line| {
            line.split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .find(|cells| cells[0] == id)
        .unwrap_or_else(|| panic!("{id} in {}", list.stdout))
}

#[test]
fn schedule_cli_puts_lists_pauses_resumes_and_deletes() {
    let dir = tempfile::tempdir().unwrap();
    let process = spawn(dir.path(), &[]);
    let base = process.base.as_str();
    let deadline = Instant::now() + Duration::from_secs(60);

    // A firing every second, into the broker.
    let put = [
        "schedule",
        "put",
        "tick",
        "--every",
        "1s",
        "--topic",
        "sched.cli",
        "--body",
        "tock",
        "--header",
        "trace=abc",
    ];
    let created = delayd(base, &put);
    assert!(
        created.stderr.contains("created tick"),
        "{}",
        created.stderr
    );
    let schedule = created.json();
    assert_eq!(
        (&schedule["id"], &schedule["every"], &schedule["paused"]),
        (&json!("tick"), &json!("1s"), &json!(false))
    );
    assert!(schedule["next_fire_at"].is_string(), "{schedule}");
    // The same definition again replaces it, changing nothing.
    let again = delayd(base, &put);
    assert!(again.stderr.contains("replaced tick"), "{}", again.stderr);
    assert_eq!(again.json()["created_at"], schedule["created_at"]);

    let row = listed(base, "tick");
    assert_eq!(row[1..5], ["every", "1s", "UTC", "false"], "{row:?}");

    // It fires: the table counts the firings, and each is a message in the broker with the firing's
    // headers beside its own.
    common::wait_for("two firings", Duration::from_secs(30), || {
        let all = delayd(base, &["schedule", "list", "--json"]).json();
        all[0]["fired"].as_u64().unwrap() >= 2
    });
    let row = listed(base, "tick");
    assert!(row[7].parse::<u64>().unwrap() >= 2, "{row:?}");
    let tail = spawn_cli(
        base,
        &[
            "tail",
            "--topic",
            "sched.cli",
            "--from",
            "beginning",
            "--count",
            "2",
        ],
    );
    let mut fire_times = Vec::new();
    for _ in 0..2 {
        let line = tail.stdout.next_before(deadline).expect("a firing tailed");
        let message: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(message["body"], "tock", "{message}");
        assert_eq!(message["headers"]["trace"], "abc", "{message}");
        assert_eq!(message["headers"]["delayd-schedule"], "tick", "{message}");
        fire_times.push(parse(&message["headers"]["delayd-fire-at"]));
    }
    // Two firings of one schedule: whole seconds apart (the queues are tailed in turn, so not
    // necessarily neighbours).
    fire_times.sort();
    let apart = fire_times[1] - fire_times[0];
    assert!(apart > 0 && apart % 1000 == 0, "{fire_times:?}");

    // Paused: no firing planned; resumed: one again.
    let paused = delayd(base, &["schedule", "pause", "tick"]);
    assert!(paused.stderr.contains("paused tick"), "{}", paused.stderr);
    let schedule = paused.json();
    assert_eq!(
        (&schedule["paused"], &schedule["next_fire_at"]),
        (&json!(true), &Value::Null)
    );
    let row = listed(base, "tick");
    assert_eq!(row[4..6], ["true", "-"], "{row:?}");
    let resumed = delayd(base, &["schedule", "resume", "tick"]);
    assert!(
        resumed.stderr.contains("resumed tick"),
        "{}",
        resumed.stderr
    );
    let schedule = resumed.json();
    assert_eq!(schedule["paused"], false);
    assert!(schedule["next_fire_at"].is_string(), "{schedule}");
    assert_eq!(listed(base, "tick")[4], "false");

    // A listing reads every page: four schedules, two to a page, by id.
    for id in ["a.yearly", "b.yearly", "c.yearly"] {
        let put = delayd(
            base,
            &[
                "schedule",
                "put",
                id,
                "--cron",
                "0 9 1 1 *",
                "--tz",
                "Europe/Berlin",
                "--topic",
                "sched.cli.yearly",
                "--body",
                "happy new year",
            ],
        );
        assert!(put.stderr.contains("created"), "{}", put.stderr);
    }
    let all = delayd(base, &["schedule", "list", "--limit", "2", "--json"]).json();
    let ids: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a.yearly", "b.yearly", "c.yearly", "tick"]);
    let row = listed(base, "b.yearly");
    assert_eq!(
        row[1..8],
        ["0", "9", "1", "1", "*", "Europe/Berlin", "false"],
        "{row:?}"
    );
    // 09:00 in Berlin on 1 January is 08:00 UTC.
    assert!(row[8].ends_with("-01-01T08:00:00.000Z"), "{row:?}");

    for id in ["a.yearly", "b.yearly", "c.yearly", "tick"] {
        let deleted = delayd(base, &["schedule", "delete", id]);
        assert!(deleted.ok, "{}", deleted.stderr);
        assert!(
            deleted.stderr.contains(&format!("deleted {id}")),
            "{}",
            deleted.stderr
        );
    }
    let empty = delayd(base, &["schedule", "list"]);
    assert!(empty.ok && empty.stdout.is_empty(), "{}", empty.stdout);
    assert!(empty.stderr.contains("no schedules"), "{}", empty.stderr);
    assert_eq!(
        delayd(base, &["schedule", "list", "--json"]).json(),
        json!([])
    );

    // Problems: the service's code and detail on stderr, and a non-zero exit.
    let bad = delayd(
        base,
        &[
            "schedule",
            "put",
            "bad",
            "--cron",
            "61 * * * *",
            "--topic",
            "t",
            "--body",
            "x",
        ],
    );
    assert!(!bad.ok && bad.stdout.is_empty(), "{}", bad.stdout);
    assert!(bad.stderr.contains("invalid_cron: "), "{}", bad.stderr);
    let gone = delayd(base, &["schedule", "pause", "tick"]);
    assert!(
        !gone.ok && gone.stderr.contains("not_found"),
        "{}",
        gone.stderr
    );
    // An id no schedule can have is sent encoded and refused by the service, not routed elsewhere.
    let slashed = delayd(
        base,
        &[
            "schedule", "put", "a/b", "--every", "1m", "--topic", "t", "--body", "x",
        ],
    );
    assert!(
        !slashed.ok && slashed.stderr.contains("invalid_schedule_id"),
        "{}",
        slashed.stderr
    );
    // Exactly one timing: clap refuses both, before any request.
    let both = delayd(
        base,
        &[
            "schedule", "put", "x", "--cron", "@daily", "--every", "1m", "--topic", "t", "--body",
            "x",
        ],
    );
    assert!(
        !both.ok && both.stderr.contains("cannot be used with"),
        "{}",
        both.stderr
    );
}
