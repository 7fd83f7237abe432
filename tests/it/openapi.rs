//! The OpenAPI document at `GET /openapi.json` (DESIGN.md §13) against the router it describes: every
//! route served is documented with its methods, and nothing else is; `/v1` takes the bearer token; every
//! reference resolves; real answers (errors of several kinds, a 201) have a documented status, content
//! type and code; and a real answer of each JSON route, in each of its shapes, conforms to the schema
//! documented for it. Schemathesis checks the rest against a live server (`tests/schemathesis.sh`).

use super::*;
use std::collections::BTreeSet;

const TOKEN: &str = "openapi-test-token-0123";

/// Every route the router serves and its methods: what the document must describe.
const ROUTES: &[(&str, &[&str])] = &[
    ("/v1/messages", &["post", "get", "delete"]),
    ("/v1/messages/batch", &["post"]),
    ("/v1/messages/{id}", &["get", "delete"]),
    ("/v1/messages/{id}/requeue", &["post"]),
    ("/v1/messages/{id}/discard", &["post"]),
    ("/v1/stats/timeline", &["get"]),
    ("/v1/topics", &["get"]),
    ("/v1/topics/{topic}", &["get"]),
    ("/v1/topics/{topic}/queues/{queue}/messages", &["get"]),
    ("/v1/groups/{group}/offsets/{topic}/{queue}", &["put"]),
    ("/v1/groups/{group}/offsets/{topic}", &["get"]),
    ("/v1/schedules", &["get"]),
    ("/v1/schedules/{id}", &["get", "put", "delete"]),
    ("/v1/schedules/{id}/pause", &["post"]),
    ("/v1/schedules/{id}/resume", &["post"]),
    ("/v1/sources", &["get"]),
    ("/v1/sinks", &["get"]),
    ("/v1/cluster", &["get"]),
    ("/v1/cluster/members", &["post"]),
    ("/v1/cluster/members/{id}", &["delete"]),
    ("/healthz", &["get"]),
    ("/readyz", &["get"]),
    ("/metrics", &["get"]),
    ("/ui", &["get"]),
    ("/openapi.json", &["get"]),
];

const METHODS: &[&str] = &[
    "get", "put", "post", "delete", "patch", "head", "options", "trace",
];

/// A concrete path for a route's template.
fn concrete(template: &str) -> String {
    template
        .replace("{id}", "aaaaaaaaaaaaaaaaaaaaaaa")
        .replace("{topic}", "t")
        .replace("{queue}", "0")
        .replace("{group}", "g")
}

/// The document's operation for a method and path template.
fn operation<'a>(doc: &'a Value, method: &str, template: &str) -> &'a Value {
    let operation = &doc["paths"][template][method];
    assert!(
        operation.is_object(),
        "{} {template} is not documented",
        method.to_uppercase()
    );
    operation
}

/// Every `$ref` anywhere in `value`.
fn refs<'a>(value: &'a Value, found: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(target)) = map.get("$ref") {
                found.push(target);
            }
            map.values().for_each(|v| refs(v, found));
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, found)),
        _ => {}
    }
}

/// Asserts that `answer`, from `method template`, is documented: its status, its content type, and for
/// a problem its code.
fn assert_documented(doc: &Value, method: &str, template: &str, answer: &Answer) {
    let what = format!(
        "{} {template} answered {}",
        method.to_uppercase(),
        answer.status
    );
    let response = &operation(doc, method, template)["responses"][answer.status.to_string()];
    assert!(
        response.is_object(),
        "{what}, undocumented: {}",
        answer.json
    );
    let media = answer.content_type.split(';').next().unwrap().trim();
    let content = &response["content"][media];
    assert!(
        content.is_object(),
        "{what} as {media}, documented as {:?}",
        response["content"]
            .as_object()
            .map(|c| c.keys().collect::<Vec<_>>())
    );
    if media == "application/problem+json" {
        assert_eq!(
            content["schema"]["$ref"], "#/components/schemas/Problem",
            "{what}"
        );
        let codes = doc["components"]["schemas"]["Problem"]["properties"]["code"]["enum"]
            .as_array()
            .unwrap();
        assert!(
            codes.contains(&answer.json["code"]),
            "{what}: {}",
            answer.json
        );
    }
}

#[test]
fn the_openapi_document_describes_every_route_its_auth_and_its_answers() {
    let server = Server::start(|c| c.auth.tokens = vec![TOKEN.into()]);
    // Served without a token, though the API takes one.
    let answer = server.call("GET", "/openapi.json", None);
    assert_eq!(answer.status, 200);
    assert_eq!(answer.content_type, "application/json");
    let doc = answer.json;
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(doc["info"]["title"], "delayd");
    assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));

    // Exactly the router's routes and methods, and the router serves each one the document lists.
    let documented: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, item)| {
            METHODS
                .iter()
                .filter(|m| item.get(**m).is_some())
                .map(move |m| (path.clone(), m.to_string()))
        })
        .collect();
    let routed: BTreeSet<(String, String)> = ROUTES
        .iter()
        .flat_map(|(path, methods)| methods.iter().map(|m| (path.to_string(), m.to_string())))
        .collect();
    assert_eq!(documented, routed);
    // ROUTES is the router's list: every `.route("...")` in src/api/mod.rs, so that a route added
    // there without its documentation fails here.
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/api/mod.rs")).unwrap();
    let in_router: BTreeSet<&str> = source
        .split(".route(")
        .skip(1)
        .filter_map(|rest| rest.trim_start().strip_prefix('"')?.split('"').next())
        .collect();
    let listed: BTreeSet<&str> = ROUTES.iter().map(|(path, _)| *path).collect();
    assert_eq!(in_router, listed, "the routes in src/api/mod.rs");
    for (template, method) in &routed {
        let answer = request(
            &server.base,
            &method.to_uppercase(),
            &concrete(template),
            None,
            Some(TOKEN),
        );
        let unrouted = answer.status == 405
            || (answer.status == 404 && answer.json["detail"] == "no such route");
        assert!(
            !unrouted,
            "{method} {template} is not routed: {}",
            answer.json
        );
    }

    // The bearer token: a scheme, required by every /v1 operation and by nothing else, with its 401.
    let scheme = &doc["components"]["securitySchemes"]["bearerAuth"];
    assert_eq!(
        (&scheme["type"], &scheme["scheme"]),
        (&json!("http"), &json!("bearer"))
    );
    for (template, method) in &routed {
        let operation = operation(&doc, method, template);
        if template.starts_with("/v1/") {
            assert_eq!(
                operation["security"],
                json!([{"bearerAuth": []}]),
                "{method} {template}"
            );
            assert!(
                operation["responses"]["401"].is_object(),
                "{method} {template}"
            );
        } else {
            assert!(operation.get("security").is_none(), "{method} {template}");
        }
        // Operation ids are what links name: unique.
        assert!(operation["operationId"].is_string(), "{method} {template}");
    }
    let ids: BTreeSet<&str> = routed
        .iter()
        .map(|(t, m)| operation(&doc, m, t)["operationId"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), routed.len(), "operation ids are unique");

    // Every reference resolves to a schema, and every schema is referred to from some operation's
    // answer or request (none is left over from a type that is no longer used).
    let mut found = Vec::new();
    refs(&doc, &mut found);
    assert!(found.len() > 30, "the document refers to its schemas");
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for target in &found {
        let name = target
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("{target} is not a schema reference"));
        assert!(schemas.contains_key(name), "{target} does not resolve");
    }
    let referred: BTreeSet<&str> = found
        .iter()
        .map(|t| t.trim_start_matches("#/components/schemas/"))
        .collect();
    let defined: BTreeSet<&str> = schemas.keys().map(String::as_str).collect();
    assert_eq!(referred, defined, "schemas no answer or request refers to");

    // The problem codes are the API's, and every problem answer is documented as one.
    let codes: BTreeSet<&str> = schemas["Problem"]["properties"]["code"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    let api_codes: BTreeSet<&str> = delayd::api::error::PROBLEM_CODES.iter().copied().collect();
    assert_eq!(codes, api_codes);
    for (template, method) in &routed {
        let responses = operation(&doc, method, template)["responses"]
            .as_object()
            .unwrap();
        for (status, response) in responses {
            if status.starts_with('4') || status.starts_with('5') {
                assert!(
                    response["content"]["application/problem+json"].is_object()
                        || template == "/v1/messages/batch",
                    "{method} {template} {status} is not a problem"
                );
            }
        }
    }

    // Real answers, each documented with its status, content type and (for a problem) code.
    let call = |method: &str, path: &str, body: Option<&str>, token: Option<&str>| {
        request(&server.base, method, path, body, token)
    };
    let cases = [
        ("get", "/v1/topics", call("GET", "/v1/topics", None, None)),
        (
            "get",
            "/v1/topics",
            call("GET", "/v1/topics", None, Some("wrong-token-0123456789")),
        ),
        (
            "post",
            "/v1/messages",
            call("POST", "/v1/messages", Some("{"), Some(TOKEN)),
        ),
        (
            "post",
            "/v1/messages",
            call(
                "POST",
                "/v1/messages",
                Some(r#"{"topic": "t", "body": "x", "delay": "1h"}"#),
                Some(TOKEN),
            ),
        ),
        (
            "post",
            "/v1/messages",
            call(
                "POST",
                "/v1/messages",
                Some(r#"{"topic": "t", "body": "x", "delay": "1h", "sink": "nowhere"}"#),
                Some(TOKEN),
            ),
        ),
        (
            "get",
            "/v1/messages/{id}",
            call("GET", "/v1/messages/nope", None, Some(TOKEN)),
        ),
        (
            "get",
            "/v1/messages",
            call("GET", "/v1/messages?limit=0", None, Some(TOKEN)),
        ),
        (
            "delete",
            "/v1/messages",
            call("DELETE", "/v1/messages", None, Some(TOKEN)),
        ),
        (
            "get",
            "/v1/topics/{topic}",
            call("GET", "/v1/topics/a%20b", None, Some(TOKEN)),
        ),
        (
            "put",
            "/v1/groups/{group}/offsets/{topic}/{queue}",
            call(
                "PUT",
                "/v1/groups/g/offsets/none/0",
                Some(r#"{"offset": 0}"#),
                Some(TOKEN),
            ),
        ),
        (
            "post",
            "/v1/messages/{id}/requeue",
            call(
                "POST",
                "/v1/messages/nope/requeue",
                Some(r#"{"delay": "1s", "deliver_at": 0}"#),
                Some(TOKEN),
            ),
        ),
        ("get", "/readyz", call("GET", "/readyz", None, None)),
    ];
    let statuses: BTreeSet<u16> = cases.iter().map(|(_, _, a)| a.status).collect();
    assert_eq!(
        statuses,
        BTreeSet::from([200, 201, 400, 401, 404]),
        "the cases answer what they are meant to"
    );
    for (method, template, answer) in &cases {
        assert_documented(&doc, method, template, answer);
    }
}

/// Where `value` does not conform to `schema`, if anywhere: the subset of JSON Schema the document uses
/// (`$ref`, `allOf` / `anyOf` / `oneOf`, `type`, `enum`, `const`, `required`, `properties`, `items`,
/// `additionalProperties`, `minimum`, the `date-time` format). An object that lists its properties is
/// closed, as `tests/schemathesis.sh` closes them: a field an answer has and the document lacks fails.
fn nonconformance(doc: &Value, schema: &Value, value: &Value, at: &str) -> Option<String> {
    let fail = |why: String| Some(format!("{at}: {why} (value {value}, schema {schema})"));
    if let Some(target) = schema["$ref"].as_str() {
        let name = target.trim_start_matches("#/components/schemas/");
        return nonconformance(doc, &doc["components"]["schemas"][name], value, at);
    }
    if let Some(all) = schema["allOf"].as_array() {
        if let Some(why) = all.iter().find_map(|s| nonconformance(doc, s, value, at)) {
            return Some(why);
        }
    }
    for (key, exactly_one) in [("anyOf", false), ("oneOf", true)] {
        if let Some(choices) = schema[key].as_array() {
            let matching = choices
                .iter()
                .filter(|s| nonconformance(doc, s, value, at).is_none())
                .count();
            if matching == 0 || (exactly_one && matching > 1) {
                return fail(format!("{matching} of the {key} choices match"));
            }
        }
    }
    let is = |kind: &str| match kind {
        "null" => value.is_null(),
        "boolean" => value.is_boolean(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "string" => value.is_string(),
        "array" => value.is_array(),
        "object" => value.is_object(),
        other => panic!("type {other} is not in the subset checked"),
    };
    let kinds: Vec<&str> = match &schema["type"] {
        Value::String(kind) => vec![kind],
        Value::Array(kinds) => kinds.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    if !kinds.is_empty() && !kinds.iter().any(|k| is(k)) {
        return fail(format!("not of type {kinds:?}"));
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(value) {
            return fail("not in the enum".into());
        }
    }
    if schema.get("const").is_some_and(|c| c != value) {
        return fail("not the const".into());
    }
    if let (Some(minimum), Some(number)) = (schema["minimum"].as_f64(), value.as_f64()) {
        if number < minimum {
            return fail(format!("below the minimum {minimum}"));
        }
    }
    if let (Some("date-time"), Some(text)) = (schema["format"].as_str(), value.as_str()) {
        if !is_rfc3339(text) {
            return fail("not an RFC 3339 date-time".into());
        }
    }
    if let Some(object) = value.as_object() {
        for name in schema["required"].as_array().into_iter().flatten() {
            if !object.contains_key(name.as_str().unwrap()) {
                return fail(format!("required {name} is missing"));
            }
        }
        let properties = schema["properties"].as_object();
        for (name, inner) in object {
            let inner_at = format!("{at}/{name}");
            let why = match (
                properties.and_then(|p| p.get(name)),
                &schema["additionalProperties"],
            ) {
                (Some(property), _) => nonconformance(doc, property, inner, &inner_at),
                (None, Value::Bool(false)) => fail(format!("{name} is not documented")),
                (None, Value::Null) if properties.is_some() => {
                    fail(format!("{name} is not documented"))
                }
                (None, Value::Object(_)) => {
                    nonconformance(doc, &schema["additionalProperties"], inner, &inner_at)
                }
                (None, _) => None,
            };
            if why.is_some() {
                return why;
            }
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array()) {
        return (array.iter().enumerate())
            .find_map(|(i, item)| nonconformance(doc, items, item, &format!("{at}/{i}")));
    }
    None
}

/// `YYYY-MM-DDTHH:MM:SS`, optional fraction, then `Z` or `±HH:MM`.
fn is_rfc3339(text: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let Some((date, time)) = text.split_once('T') else {
        return false;
    };
    let date_ok = date.len() == 10
        && date.split('-').map(str::len).eq([4, 2, 2])
        && date.split('-').all(digits);
    let (clock, zone) = match time.strip_suffix('Z') {
        Some(clock) => (clock, "+00:00"),
        None if time.len() > 6 => time.split_at(time.len() - 6),
        None => return false,
    };
    let (whole, fraction) = clock.split_once('.').unwrap_or((clock, "0"));
    let zone_ok = zone.len() == 6
        && matches!(&zone[..1], "+" | "-")
        && zone[1..].split(':').map(str::len).eq([2, 2])
        && zone[1..].split(':').all(digits);
    date_ok
        && whole.split(':').map(str::len).eq([2, 2, 2])
        && whole.split(':').all(digits)
        && digits(fraction)
        && zone_ok
}

#[test]
fn the_conformance_check_finds_what_differs() {
    let doc = json!({"components": {"schemas": {"S": {
        "type": "object",
        "required": ["id", "at"],
        "properties": {
            "id": {"type": "string"},
            "at": {"type": "string", "format": "date-time"},
            "state": {"type": "string", "enum": ["a", "b"]},
            "count": {"type": ["integer", "null"], "minimum": 0},
            "map": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    }}}});
    let schema = json!({"type": "array", "items": {"$ref": "#/components/schemas/S"}});
    let fits = |value: Value| nonconformance(&doc, &schema, &value, "").is_none();
    assert!(fits(
        json!([{"id": "x", "at": "2026-12-01T09:30:00.000Z", "state": "a", "count": null, "map": {"k": 1}}])
    ));
    assert!(fits(
        json!([{"id": "x", "at": "2026-12-01T09:30:00+01:00", "count": 3}])
    ));
    for wrong in [
        json!([{"id": "x", "at": "2026-12-01T09:30:00Z", "extra": 1}]),
        json!([{"id": "x"}]),
        json!([{"id": 1, "at": "2026-12-01T09:30:00Z"}]),
        json!([{"id": "x", "at": "2026-12-01 09:30:00"}]),
        json!([{"id": "x", "at": "2026-12-01T09:30:00Z", "state": "c"}]),
        json!([{"id": "x", "at": "2026-12-01T09:30:00Z", "count": -1}]),
        json!([{"id": "x", "at": "2026-12-01T09:30:00Z", "map": {"k": "v"}}]),
        json!({}),
    ] {
        assert!(!fits(wrong.clone()), "{wrong}");
    }
}

/// A real answer of every JSON route, in each of its shapes (a message scheduled, delivered, dead,
/// retrying, discarded and cancelled; a body as text and as base64; a batch with a problem; an MQ source
/// and sink that cannot connect), conforms to the schema documented for its status and content type.
/// The answers are typed structs whose schemas are derived from them; this catches what the derive
/// cannot see (a field skipped when empty but documented as required, or null where it is not).
#[test]
fn every_answer_conforms_to_its_documented_schema() {
    // A webhook sink that cannot connect (dead letters), and a Redis source and sink whose server is
    // absent (connections that say why they are down), as tests/schemathesis.sh configures them.
    let file =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/unreachable_connections.toml");
    let flags = delayd::config::Flags::default();
    let connections = delayd::config::Config::load(Some(&file), Vec::new(), &flags).unwrap();
    let server = Server::start(|c| {
        c.sinks.extend(connections.sinks);
        c.sources = connections.sources;
    });
    let doc = server.call("GET", "/openapi.json", None).json;
    let mut checked = BTreeSet::new();
    let mut check = |method: &str, template: &str, answer: Answer| -> Value {
        let what = format!(
            "{} {template} answered {}",
            method.to_uppercase(),
            answer.status
        );
        let media = answer
            .content_type
            .split(';')
            .next()
            .unwrap()
            .trim()
            .to_string();
        let schema = &operation(&doc, method, template)["responses"][answer.status.to_string()]
            ["content"][&media]["schema"];
        assert!(schema.is_object(), "{what} as {media}: not documented");
        if let Some(why) = nonconformance(&doc, schema, &answer.json, "") {
            panic!("{what}: {why}");
        }
        checked.insert((method.to_string(), template.to_string()));
        answer.json
    };
    let call = |method: &str, path: &str, body: Option<Value>| server.call(method, path, body);
    let id = |answer: &Value| answer["id"].as_str().unwrap().to_string();

    let schedule = |body: Value| call("POST", "/v1/messages", Some(body));
    let text = check(
        "post",
        "/v1/messages",
        schedule(json!(
            {"topic": "seen", "body": "text", "delay": 0, "key": "k1", "headers": {"h": "v"}}
        )),
    );
    check(
        "post",
        "/v1/messages",
        schedule(json!(
            {"topic": "seen", "body_base64": "/w==", "delay": 0}
        )),
    );
    let later =
        json!({"topic": "seen", "body": "later", "delay": "1d", "key": "k2", "dedup": true});
    let later = id(&check("post", "/v1/messages", schedule(later.clone())));
    let again = check(
        "post",
        "/v1/messages",
        schedule(json!(
            {"topic": "seen", "body": "later", "delay": "1d", "key": "k2", "dedup": true}
        )),
    );
    assert_eq!(
        (id(&again), &again["duplicate"]),
        (later.clone(), &json!(true))
    );
    let dead: Vec<String> = (0..2)
        .map(|n| {
            let body = json!({"topic": "doomed", "body": n.to_string(), "delay": 0, "sink": "unreachable"});
            id(&check("post", "/v1/messages", schedule(body)))
        })
        .collect();
    let batch = json!({"messages": [
        {"topic": "batched", "body": "1", "delay": "1h"},
        {"topic": "batched"},
        {"topic": "a \"quoted\" \\ topic", "body": "2", "delay": "1h"},
    ]});
    let batch = check(
        "post",
        "/v1/messages/batch",
        call("POST", "/v1/messages/batch", Some(batch)),
    );
    assert!(batch["results"][1]["error"].is_object(), "{batch}");

    common::wait_for("the dead letters", Duration::from_secs(30), || {
        call("GET", "/v1/messages?status=dead&topic=doomed", None).json["messages"]
            .as_array()
            .is_some_and(|m| m.len() == 2)
    });
    common::wait_for("the deliveries", Duration::from_secs(30), || {
        let topic = call("GET", "/v1/topics/seen", None).json;
        topic["queues"][0]["max_offset"] == 2
    });

    check(
        "get",
        "/v1/messages/{id}",
        call("GET", &format!("/v1/messages/{}", id(&text)), None),
    );
    check(
        "get",
        "/v1/messages/{id}",
        call("GET", &format!("/v1/messages/{later}"), None),
    );
    check(
        "get",
        "/v1/messages/{id}",
        call("GET", &format!("/v1/messages/{}", dead[0]), None),
    );
    for status in ["pending", "all", "dead", "delivered"] {
        let page = check(
            "get",
            "/v1/messages",
            call(
                "GET",
                &format!("/v1/messages?status={status}&limit=2"),
                None,
            ),
        );
        assert!(
            !page["messages"].as_array().unwrap().is_empty(),
            "{status}: {page}"
        );
    }
    check(
        "get",
        "/v1/stats/timeline",
        call("GET", "/v1/stats/timeline", None),
    );
    check("get", "/v1/topics", call("GET", "/v1/topics", None));
    check(
        "get",
        "/v1/topics/{topic}",
        call("GET", "/v1/topics/seen", None),
    );
    let pulled = check(
        "get",
        "/v1/topics/{topic}/queues/{queue}/messages",
        call("GET", "/v1/topics/seen/queues/0/messages", None),
    );
    let bodies: Vec<bool> = (pulled["messages"].as_array().unwrap().iter())
        .map(|m| m.get("body").is_some())
        .collect();
    assert_eq!(
        bodies,
        [true, false],
        "a text body and a base64 one: {pulled}"
    );
    check(
        "get",
        "/v1/topics/{topic}/queues/{queue}/messages",
        call("GET", "/v1/topics/$dead/queues/0/messages?wait_ms=10", None),
    );
    check(
        "put",
        "/v1/groups/{group}/offsets/{topic}/{queue}",
        call(
            "PUT",
            "/v1/groups/readers/offsets/seen/0",
            Some(json!({"offset": 1})),
        ),
    );
    check(
        "get",
        "/v1/groups/{group}/offsets/{topic}",
        call("GET", "/v1/groups/readers/offsets/seen", None),
    );
    common::wait_for(
        "the MQ source's first error",
        Duration::from_secs(30),
        || call("GET", "/v1/sources", None).json["sources"][0]["last_error"].is_string(),
    );
    check("get", "/v1/sources", call("GET", "/v1/sources", None));
    let daily = json!({"cron": "0 9 * * MON-FRI", "tz": "Europe/Berlin", "topic": "reports",
        "body": "report"});
    check(
        "put",
        "/v1/schedules/{id}",
        call("PUT", "/v1/schedules/daily", Some(daily.clone())),
    );
    check(
        "put",
        "/v1/schedules/{id}",
        call("PUT", "/v1/schedules/daily", Some(daily)),
    );
    check(
        "put",
        "/v1/schedules/{id}",
        call(
            "PUT",
            "/v1/schedules/bad",
            Some(json!({"cron": "x", "topic": "t", "body": "b"})),
        ),
    );
    check(
        "get",
        "/v1/schedules",
        call("GET", "/v1/schedules?limit=1", None),
    );
    check(
        "get",
        "/v1/schedules/{id}",
        call("GET", "/v1/schedules/daily", None),
    );
    check(
        "post",
        "/v1/schedules/{id}/pause",
        call("POST", "/v1/schedules/daily/pause", None),
    );
    check(
        "post",
        "/v1/schedules/{id}/resume",
        call("POST", "/v1/schedules/daily/resume", None),
    );
    check(
        "delete",
        "/v1/schedules/{id}",
        call("DELETE", "/v1/schedules/daily", None),
    );
    check(
        "get",
        "/v1/schedules/{id}",
        call("GET", "/v1/schedules/daily", None),
    );
    check("get", "/v1/sinks", call("GET", "/v1/sinks", None));
    check("get", "/readyz", call("GET", "/readyz", None));

    let requeue = format!("/v1/messages/{}/requeue", dead[0]);
    check(
        "post",
        "/v1/messages/{id}/requeue",
        call("POST", &requeue, Some(json!({"delay": "1h"}))),
    );
    check(
        "get",
        "/v1/messages/{id}",
        call("GET", &format!("/v1/messages/{}", dead[0]), None),
    );
    let discard = format!("/v1/messages/{}/discard", dead[1]);
    check(
        "post",
        "/v1/messages/{id}/discard",
        call("POST", &discard, None),
    );
    check(
        "get",
        "/v1/messages/{id}",
        call("GET", &format!("/v1/messages/{}", dead[1]), None),
    );
    check(
        "delete",
        "/v1/messages/{id}",
        call("DELETE", &format!("/v1/messages/{later}"), None),
    );
    check(
        "get",
        "/v1/messages/{id}",
        call("GET", &format!("/v1/messages/{later}"), None),
    );
    let purged = check(
        "delete",
        "/v1/messages",
        call("DELETE", "/v1/messages?topic=batched", None),
    );
    assert_eq!(purged["cancelled"], 1, "{purged}");
    // A single node is no cluster member (a member's 200 is checked in tests/cluster.rs).
    let alone = check("get", "/v1/cluster", call("GET", "/v1/cluster", None));
    assert_eq!(alone["code"], "not_found", "{alone}");
    let member =
        serde_json::json!({"id": 4, "api": "http://127.0.0.1:7074", "peer": "127.0.0.1:7174"});
    let alone = check(
        "post",
        "/v1/cluster/members",
        call("POST", "/v1/cluster/members", Some(member)),
    );
    assert_eq!(alone["code"], "not_found", "{alone}");
    let alone = check(
        "delete",
        "/v1/cluster/members/{id}",
        call("DELETE", "/v1/cluster/members/2", None),
    );
    assert_eq!(alone["code"], "not_found", "{alone}");

    // Every JSON route's answer was checked; the rest are text, HTML and this document.
    let json_routes: BTreeSet<(String, String)> = ROUTES
        .iter()
        .filter(|(path, _)| !matches!(*path, "/healthz" | "/metrics" | "/ui" | "/openapi.json"))
        .flat_map(|(path, methods)| methods.iter().map(|m| (m.to_string(), path.to_string())))
        .collect();
    assert_eq!(checked, json_routes);
}
