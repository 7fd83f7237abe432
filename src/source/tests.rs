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
