//! Listing, purging and the timeline over HTTP (DESIGN.md §13), against the service on a loopback port.

use super::*;

const HOUR_MS: i64 = 3_600_000;

/// Every message of a listing, following `next_cursor` from page to page.
fn list_all(server: &Server, query: &str) -> Vec<Value> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/messages?{query}&cursor={c}"),
            None => format!("/v1/messages?{query}"),
        };
        let answer = server.call("GET", &path, None);
        assert_eq!(answer.status, 200, "{path}: {}", answer.json);
        all.extend(answer.json["messages"].as_array().unwrap().iter().cloned());
        match answer.json["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => return all,
        }
    }
}

fn ids(messages: &[Value]) -> Vec<String> {
    messages
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn pending_messages_are_listed_by_due_time_counted_per_hour_and_purged_by_topic() {
    let server = Server::start(|_| {});
    // Hours ahead, so that nothing is delivered while the test runs.
    let base = (now_ms() / HOUR_MS + 2) * HOUR_MS;
    // (topic, due): orders every 13 minutes over ~6.5 hours, sent latest first; audit every 50 minutes.
    let mut sent: Vec<(String, i64)> = (0..30)
        .rev()
        .map(|i| ("orders".to_string(), base + i * 13 * 60_000 + 7))
        .collect();
    sent.extend((0..8).map(|i| ("audit".to_string(), base + i * 50 * 60_000)));
    let messages: Vec<Value> = sent
        .iter()
        .map(|(topic, at)| json!({"topic": topic, "body": "x", "deliver_at": at}))
        .collect();
    let answer = server.batch(&messages);
    let id_of: std::collections::HashMap<String, (String, i64)> = answer.json["results"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&sent)
        .map(|(r, s)| (r["id"].as_str().unwrap().to_string(), s.clone()))
        .collect();

    // A topic's pending messages, oldest due first, 7 to a page.
    let orders = list_all(&server, "topic=orders&limit=7");
    assert_eq!(orders.len(), 30);
    let due: Vec<i64> = orders.iter().map(|m| parse(&m["deliver_at"])).collect();
    let mut expected: Vec<i64> = sent
        .iter()
        .filter(|s| s.0 == "orders")
        .map(|s| s.1)
        .collect();
    expected.sort();
    assert_eq!(due, expected);
    assert!(orders
        .iter()
        .all(|m| m["status"] == "scheduled" && m["topic"] == "orders"));
    // Every topic, in a range of due times [from, to).
    let (from, to) = (base + HOUR_MS, base + 3 * HOUR_MS);
    let ranged = list_all(
        &server,
        &format!(
            "from={from}&to={}&limit=5",
            delayd::timestamp::format_ms(to)
        ),
    );
    let mut expected: Vec<i64> = sent
        .iter()
        .map(|s| s.1)
        .filter(|at| (from..to).contains(at))
        .collect();
    expected.sort();
    assert_eq!(
        ranged
            .iter()
            .map(|m| parse(&m["deliver_at"]))
            .collect::<Vec<_>>(),
        expected
    );

    // Pending per hour, from the indexes.
    let answer = server.call("GET", "/v1/stats/timeline", None);
    assert_eq!(answer.status, 200, "{}", answer.json);
    assert_eq!(answer.json["segment_minutes"], 60);
    let mut per_hour = std::collections::BTreeMap::new();
    for (_, at) in &sent {
        *per_hour.entry(at / HOUR_MS * HOUR_MS).or_insert(0u64) += 1;
    }
    let timeline: std::collections::BTreeMap<i64, u64> = answer.json["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["start_ms"].as_i64().unwrap(),
                b["pending"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(timeline, per_hour);

    // Bad requests are named.
    for (method, path, code) in [
        ("GET", "/v1/messages?status=bogus", "invalid_query"),
        ("GET", "/v1/messages?limit=0", "invalid_query"),
        ("GET", "/v1/messages?limit=1001", "invalid_query"),
        ("GET", "/v1/messages?from=yesterday", "invalid_query"),
        ("GET", "/v1/messages?colour=red", "invalid_query"),
        ("GET", "/v1/messages?cursor=zz", "invalid_cursor"),
        ("DELETE", "/v1/messages", "topic_required"),
        ("DELETE", "/v1/messages?topic=", "topic_required"),
        ("GET", "/v1/stats/timeline?to=soon", "invalid_query"),
    ] {
        let answer = server.call(method, path, None);
        assert_eq!(answer.status, 400, "{method} {path}: {}", answer.json);
        assert_eq!(answer.json["code"], code, "{method} {path}");
    }

    // Purge the orders due in the first three hours: those, and only those, are cancelled.
    let before = scrape(&server.base)["delayd_messages_cancelled_total"];
    let until = base + 3 * HOUR_MS;
    let answer = server.call(
        "DELETE",
        &format!("/v1/messages?topic=orders&to={until}"),
        None,
    );
    assert_eq!(answer.status, 200, "{}", answer.json);
    let purged: Vec<&String> = id_of
        .iter()
        .filter(|(_, (topic, at))| topic == "orders" && *at < until)
        .map(|(id, _)| id)
        .collect();
    assert_eq!(answer.json["cancelled"], purged.len());
    assert_eq!(answer.json["in_flight"], 0);
    // (The counter is the process's: other tests' servers may count too.)
    let after = scrape(&server.base)["delayd_messages_cancelled_total"];
    assert!(after - before >= purged.len() as f64, "{before} → {after}");
    for id in &purged {
        assert_eq!(
            server.call("GET", &format!("/v1/messages/{id}"), None).json["status"],
            "cancelled"
        );
    }
    let mut cancelled = ids(&list_all(&server, "topic=orders&status=cancelled"));
    cancelled.sort();
    let mut purged: Vec<String> = purged.into_iter().cloned().collect();
    purged.sort();
    assert_eq!(cancelled, purged);
    let left = list_all(&server, "topic=orders");
    assert_eq!(left.len(), 30 - purged.len());
    assert!(left.iter().all(|m| parse(&m["deliver_at"]) >= until));
    assert_eq!(
        list_all(&server, "topic=audit").len(),
        8,
        "another topic is left alone"
    );
    // Purging again finds nothing.
    let answer = server.call(
        "DELETE",
        &format!("/v1/messages?topic=orders&to={until}"),
        None,
    );
    assert_eq!(answer.json["cancelled"], 0);
    let answer = server.call("GET", &format!("/v1/stats/timeline?to={until}"), None);
    let pending: u64 = answer.json["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["pending"].as_u64().unwrap())
        .sum();
    let audit_before = sent
        .iter()
        .filter(|s| s.0 == "audit" && s.1 < until)
        .count() as u64;
    assert_eq!(pending, audit_before);
}

/// A listing filters by the status a message shows (`scheduled`, `retrying`) as well as by their union
/// `pending`; a message without a key has no `key`, as in a pull.
#[test]
fn a_listing_filters_by_the_status_a_message_shows() {
    let hook = webhook::endpoint(&[("flaky", vec!["503"])]);
    let server = Server::start(|c| {
        let sink = webhook::webhook_sink(&hook.url, |lane, _| {
            // The retry waits an hour: it stays `retrying` while the test looks.
            lane.backoff_initial = delayd::config::Millis(Duration::from_secs(3600));
        });
        c.sinks.insert("hooks".into(), sink);
    });
    let send = |body: &str, delay: &str| {
        let message =
            json!({"topic": "t", "body": body, "delay": delay, "sink": "hooks", "key": body});
        let answer = server.call("POST", "/v1/messages", Some(message));
        assert_eq!(answer.status, 201, "{}", answer.json);
        answer.json["id"].as_str().unwrap().to_string()
    };
    let flaky = send("flaky", "0s");
    let later = send("later", "1h");
    let unkeyed = server.call(
        "POST",
        "/v1/messages",
        Some(json!({"topic": "t", "body": "x", "delay": "1h"})),
    );
    let unkeyed = unkeyed.json["id"].as_str().unwrap().to_string();
    common::wait_for("the retry", Duration::from_secs(30), || {
        server
            .call("GET", &format!("/v1/messages/{flaky}"), None)
            .json["status"]
            == "retrying"
    });
    let listed = |status: &str| {
        let mut found = ids(&list_all(&server, &format!("topic=t&status={status}")));
        found.sort();
        found
    };
    let mut pending = vec![flaky.clone(), later.clone(), unkeyed.clone()];
    pending.sort();
    assert_eq!(listed("pending"), pending);
    assert_eq!(listed("retrying"), vec![flaky.clone()]);
    let mut scheduled = vec![later, unkeyed.clone()];
    scheduled.sort();
    assert_eq!(listed("scheduled"), scheduled);
    let all = list_all(&server, "topic=t&status=all");
    let of = |id: &str| all.iter().find(|m| m["id"] == id).unwrap().clone();
    assert_eq!(of(&flaky)["status"], "retrying");
    assert_eq!(of(&flaky)["key"], "flaky");
    assert!(of(&unkeyed).get("key").is_none(), "{}", of(&unkeyed));
}

#[test]
fn the_console_page_is_served_without_a_token_and_the_api_behind_it_needs_one() {
    let server = Server::start(|c| c.auth.tokens = vec!["s3cret".into()]);
    let answer = request(&server.base, "GET", "/ui", None, None);
    assert_eq!(answer.status, 200);
    assert!(
        answer.content_type.starts_with("text/html"),
        "{}",
        answer.content_type
    );
    for path in ["/v1/messages?status=dead", "/v1/stats/timeline"] {
        assert_eq!(
            request(&server.base, "GET", path, None, None).status,
            401,
            "{path}"
        );
        assert_eq!(
            request(&server.base, "GET", path, None, Some("s3cret")).status,
            200,
            "{path}"
        );
    }
    // The scheme is case-insensitive (RFC 9110 §11.1), as clients such as curl's --oauth2-bearer and
    // some proxies write it.
    for scheme in ["bearer", "BEARER", "Bearer "] {
        let status = common::agent(Duration::from_secs(10))
            .get(&format!("{}/v1/stats/timeline", server.base))
            .header("Authorization", &format!("{scheme} s3cret"))
            .call()
            .unwrap()
            .status();
        assert_eq!(status, 200, "{scheme:?}");
    }
    // The routes that change things answer 401 before they look at anything.
    let id = "a".repeat(23);
    for (method, path) in [
        ("DELETE", "/v1/messages?topic=orders".to_string()),
        ("POST", format!("/v1/messages/{id}/requeue")),
        ("POST", format!("/v1/messages/{id}/discard")),
    ] {
        let answer = request(&server.base, method, &path, Some("{}"), None);
        assert_eq!(answer.status, 401, "{method} {path}");
        let answer = request(&server.base, method, &path, Some("{}"), Some("s3cret"));
        assert_ne!(answer.status, 401, "{method} {path}");
    }
}
