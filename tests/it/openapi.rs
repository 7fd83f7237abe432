//! The OpenAPI document at `GET /openapi.json` (DESIGN.md §13) against the router it describes: every
//! route served is documented with its methods, and nothing else is; `/v1` takes the bearer token; every
//! reference resolves; and real answers (errors of several kinds, a 201) have a documented status,
//! content type and code. Schemathesis checks the rest against a live server (`tests/schemathesis.sh`).

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
    ("/v1/sources", &["get"]),
    ("/v1/sinks", &["get"]),
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
