use super::*;

fn request(headers: &[(&str, &str)]) -> Request {
    Request {
        position: Some("1-0".into()),
        receipt: "1-0".into(),
        headers: headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
        body: b"b".to_vec(),
        unreadable: None,
        default_target: None,
        default_key: None,
        schedule_id: None,
    }
}

fn dead_code(action: Action) -> &'static str {
    match action {
        Action::Dead(r) => r.code,
        other => panic!("{other:?}"),
    }
}

#[test]
fn headers_say_when_and_where_and_are_stripped() {
    let now = 1_796_117_400_000;
    let Action::Schedule {
        deliver_at_ms,
        target,
        key,
        headers,
    } = classify(
        &request(&[
            ("delayd-delay", "1500ms"),
            ("delayd-target", "orders:out"),
            ("delayd-key", "o-42"),
            ("trace", "t1"),
        ]),
        now,
    )
    else {
        panic!()
    };
    assert_eq!(deliver_at_ms, now + 1500);
    assert_eq!(
        (target.as_str(), key.as_deref()),
        ("orders:out", Some("o-42"))
    );
    assert_eq!(headers, vec![("trace".to_string(), "t1".to_string())]);
    // The migration headers, as their MQs write them.
    let at = |h: &[(&str, &str)]| match classify(&request(h), now) {
        Action::Schedule { deliver_at_ms, .. } => deliver_at_ms,
        other => panic!("{other:?}"),
    };
    assert_eq!(at(&[("x-delay", "250"), ("delayd-target", "t")]), now + 250);
    assert_eq!(at(&[("x-delay", "-5"), ("delayd-target", "t")]), now);
    assert_eq!(
        at(&[
            ("Nats-Schedule", "@at 2026-12-01T09:30:01Z"),
            ("Nats-Schedule-Target", "t")
        ]),
        now + 1000
    );
    assert_eq!(
        at(&[
            ("scheduler-epoch", "1796117401"),
            ("scheduler-target-topic", "t")
        ]),
        now + 1000
    );
    assert_eq!(
        at(&[
            ("delayd-deliver-at", "1796117400500"),
            ("delayd-target", "t")
        ]),
        now + 500
    );
}

#[test]
fn amqp_routing_key_is_the_default_target_and_the_exchange_is_kept() {
    let now = 1_796_117_400_000;
    let mut from_exchange = request(&[
        ("x-delay", "1000"),
        ("delayd-exchange", " orders "),
        ("trace", "t1"),
    ]);
    from_exchange.default_target = Some("orders.created".into());
    let Action::Schedule {
        target, headers, ..
    } = classify(&from_exchange, now)
    else {
        panic!()
    };
    assert_eq!(target, "orders.created");
    assert_eq!(
        headers,
        vec![
            (EXCHANGE_HEADER.to_string(), "orders".to_string()),
            ("trace".to_string(), "t1".to_string())
        ]
    );
    // A header still wins over the routing key.
    let mut named = request(&[("x-delay", "1000"), ("delayd-target", "elsewhere")]);
    named.default_target = Some("orders.created".into());
    assert!(
        matches!(classify(&named, now), Action::Schedule { target, .. } if target == "elsewhere")
    );
}

#[test]
fn bad_requests_are_dead_letters_with_a_reason() {
    let now = 1_796_117_400_000;
    assert_eq!(
        dead_code(classify(&request(&[("delayd-delay", "1s")]), now)),
        "missing_target"
    );
    assert_eq!(
        dead_code(classify(&request(&[("delayd-target", "t")]), now)),
        "missing_deliver_time"
    );
    assert_eq!(
        dead_code(classify(
            &request(&[("delayd-target", "t"), ("delayd-delay", "soon")]),
            now
        )),
        "invalid_delay"
    );
    assert_eq!(
        dead_code(classify(
            &request(&[
                ("delayd-target", "t"),
                ("delayd-delay", "1s"),
                ("x-delay", "5")
            ]),
            now
        )),
        "conflicting_time_fields"
    );
    assert_eq!(
        dead_code(classify(
            &request(&[("delayd-target", "t"), ("delayd-cancel", "true")]),
            now
        )),
        "invalid_key"
    );
    assert!(matches!(
        classify(
            &request(&[
                ("delayd-target", "t"),
                ("delayd-cancel", "true"),
                ("delayd-key", "k")
            ]),
            now
        ),
        Action::Cancel { .. }
    ));
}

/// A NATS request on `delayd.in.tick` of the source `in`.
fn nats_request(headers: &[(&str, &str)]) -> Request {
    Request {
        schedule_id: Some(nats::schedule_id("in", "delayd.in.tick")),
        ..request(headers)
    }
}

fn recurring_of(action: Action) -> Recurring {
    match action {
        Action::Recurring(recurring) => *recurring,
        other => panic!("{other:?}"),
    }
}

/// What the sink `out` (an MQ sink) admits.
fn admission() -> crate::intake::Admission {
    let rules = crate::intake::SinkRules {
        topic_is_target: true,
        targets: None,
        body_header_reserved: false,
    };
    crate::intake::Admission {
        max_delay_ms: i64::MAX,
        max_message_bytes: 1 << 20,
        sinks: [("out".to_string(), rules)].into(),
    }
}

/// The code a schedule made from this recurring request is refused with, if it is.
fn schedule_refused(headers: &[(&str, &str)]) -> Option<&'static str> {
    let now = 1_796_117_400_000;
    match classify(&nats_request(headers), now) {
        Action::Recurring(recurring) => (recurring.put("out").check(&admission(), now))
            .err()
            .map(|r| r.code),
        Action::Dead(rejection) => Some(rejection.code),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_recurring_nats_schedule_is_a_schedule_of_the_subject_with_the_body_and_the_headers() {
    let now = 1_796_117_400_000;
    let mut every = nats_request(&[
        ("Nats-Schedule", "@every 1s"),
        ("Nats-Schedule-Target", "orders.tick"),
        ("delayd-key", "k"),
        ("trace", "t1"),
        ("trace", "t2"),
        ("Nats-Msg-Id", "m-1"),
    ]);
    every.body = b"tick".to_vec();
    let recurring = recurring_of(classify(&every, now));
    assert_eq!(
        recurring,
        Recurring {
            id: "nats.in.delayd.in.tick".into(),
            timing: RecurringTiming {
                cron: None,
                every: Some("1s".into()),
                tz: None
            },
            target: "orders.tick".into(),
            key: Some("k".into()),
            headers: [("Nats-Msg-Id", "m-1"), ("trace", "t1,t2")]
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .into(),
            body: b"tick".to_vec(),
        }
    );
    let put = recurring.put("out");
    assert_eq!(
        (put.body.as_deref(), put.sink.as_deref()),
        (Some("tick"), Some("out"))
    );
    put.check(&admission(), now).unwrap();
    // A cron in a zone; delayd-target wins over Nats-Schedule-Target as for a one-off request.
    let cron = recurring_of(classify(
        &nats_request(&[
            ("Nats-Schedule", " */2 * * * * * "),
            ("Nats-Schedule-Time-Zone", "Europe/Berlin"),
            ("Nats-Schedule-Target", "orders.tick"),
            ("delayd-target", "orders.other"),
        ]),
        now,
    ));
    assert_eq!(
        (cron.timing, cron.target.as_str(), cron.key),
        (
            RecurringTiming {
                cron: Some("*/2 * * * * *".into()),
                every: None,
                tz: Some("Europe/Berlin".into())
            },
            "orders.other",
            None
        )
    );
    // A body that is not UTF-8 is kept in base64.
    let mut binary = nats_request(&[("Nats-Schedule", "@hourly"), ("delayd-target", "t")]);
    binary.body = vec![0xff, 0x00];
    let put = recurring_of(classify(&binary, now)).put("out");
    assert_eq!((put.body, put.body_base64.as_deref()), (None, Some("/wA=")));
}

#[test]
fn recurring_nats_schedule_forms() {
    let timing = |schedule: &str, tz: Option<&str>| recurring_timing(schedule, tz);
    let every = |text: &str| timing(text, None).map(|t| t.every.unwrap());
    let cron = |text: &str| timing(text, None).map(|t| t.cron.unwrap());
    // Go durations, in the largest whole unit the schedule's `every` takes.
    for (go, ours) in [
        ("@every 5m", "5m"),
        ("@every 30s", "30s"),
        ("@every 1h30m", "90m"),
        ("@every 1.5h", "90m"),
        ("@every 2h0m0s", "2h"),
        ("@every 1500ms", "1500ms"),
        ("@every 1.25s", "1250ms"),
        ("@every 1000ms", "1s"),
        ("@every 1000000us", "1s"),
        ("@every 2000000000ns", "2s"),
        ("@every +1m", "1m"),
        ("@every .5m", "30s"),
        ("@every  7s ", "7s"),
        // Shorter than the schedule's 1 s: refused where the schedule is checked (below).
        ("@every 500ms", "500ms"),
        ("@every 0", "0ms"),
    ] {
        assert_eq!(every(go).as_deref(), Ok(ours), "{go}");
    }
    // Go's three spellings of microseconds.
    for micro in ["us", "\u{b5}s", "\u{3bc}s"] {
        assert_eq!(
            every(&format!("@every 2000000{micro}")).as_deref(),
            Ok("2s")
        );
    }
    for bad in [
        "@every 5x",
        "@every 5",
        "@every m",
        "@every -5m",
        "@every 1.5",
        "@every 1ms500us",
        "@every 1.0000001s",
        "@every 99999999999999999999999h",
        "@every 3000000h",
        "@every",
    ] {
        assert_eq!(
            timing(bad, None).map_err(|r| r.code),
            Err("invalid_every"),
            "{bad}"
        );
    }
    // Crons: 6 fields, seconds first, and the predefined names.
    for pattern in [
        "0 0 9 * * *",
        "*/2 * * * * *",
        "0 30 8 * * MON-FRI",
        "@hourly",
        "@annually",
    ] {
        assert_eq!(cron(pattern).as_deref(), Ok(pattern));
    }
    assert_eq!(
        timing("0 0 9 * * *", Some("Europe/Berlin")).map(|t| t.tz),
        Ok(Some("Europe/Berlin".into()))
    );
    for five in ["0 9 * * *", "* * * * * * *", ""] {
        assert_eq!(
            cron(five).map_err(|r| r.code),
            Err("invalid_cron"),
            "{five:?}"
        );
    }
    // A zone is a cron's only.
    assert_eq!(
        timing("@every 5m", Some("Europe/Berlin")).map_err(|r| r.code),
        Err("invalid_tz")
    );
}

#[test]
fn bad_recurring_requests_are_dead_letters_with_a_reason() {
    let target = ("Nats-Schedule-Target", "orders.tick");
    for (headers, code) in [
        (
            vec![("Nats-Schedule", "0 0 99 * * *"), target],
            "invalid_cron",
        ),
        (vec![("Nats-Schedule", "0 0 9 * *"), target], "invalid_cron"),
        (
            vec![("Nats-Schedule", "@fortnightly"), target],
            "invalid_cron",
        ),
        (
            vec![("Nats-Schedule", "0 0 31 2 * *"), target],
            "invalid_cron",
        ),
        (
            vec![
                ("Nats-Schedule", "0 0 9 * * *"),
                ("Nats-Schedule-Time-Zone", "Mars/Olympus_Mons"),
                target,
            ],
            "invalid_tz",
        ),
        (
            vec![
                ("Nats-Schedule", "@every 5m"),
                ("Nats-Schedule-Time-Zone", "Europe/Berlin"),
                target,
            ],
            "invalid_tz",
        ),
        (
            vec![
                ("Nats-Schedule", "@at 2026-12-01T09:30:01Z"),
                ("Nats-Schedule-Time-Zone", "Europe/Berlin"),
                target,
            ],
            "invalid_tz",
        ),
        (
            vec![("Nats-Schedule", "@every 500ms"), target],
            "invalid_every",
        ),
        (
            vec![("Nats-Schedule", "@every soon"), target],
            "invalid_every",
        ),
        (vec![("Nats-Schedule", "@every 1s")], "missing_target"),
        (
            vec![
                ("Nats-Schedule", "@every 1s"),
                ("delayd-delay", "1s"),
                target,
            ],
            "conflicting_time_fields",
        ),
        // What a schedule refuses: a target with whitespace, a header of the firings' own.
        (
            vec![("Nats-Schedule", "@every 1s"), ("delayd-target", "a\u{b}b")],
            "invalid_target",
        ),
        (
            vec![("Nats-Schedule", "@every 1s"), ("x y", "v"), target],
            "invalid_header",
        ),
    ] {
        assert_eq!(schedule_refused(&headers), Some(code), "{headers:?}");
    }
    assert_eq!(
        schedule_refused(&[("Nats-Schedule", "@daily"), target, ("trace", "t")]),
        None
    );
    // Only a NATS source names a subject's schedule.
    assert_eq!(
        dead_code(classify(
            &request(&[("Nats-Schedule", "@every 1s"), target]),
            1_796_117_400_000
        )),
        "invalid_deliver_at"
    );
}
