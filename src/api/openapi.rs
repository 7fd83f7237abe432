//! The OpenAPI 3.1 document served at `GET /openapi.json` (DESIGN.md §13), generated from the code: each
//! operation from the `#[utoipa::path]` annotation on its handler, and every request and answer schema
//! derived from the type the handler reads or sends (`Serialize + ToSchema` structs beside the
//! handlers), so that what is documented is what is sent. A modifier adds what the router's layers add
//! to every route: the bearer token and its 401 on `/v1`, the connection cap's 503 and the 500 of an
//! internal failure.
//!
//! This module only reads the handlers' modules; they never read it. Each answer is checked against its
//! schema by `tests/it/openapi.rs` (one real answer of each main route) and by schemathesis against the
//! live server (`tests/schemathesis.sh`, run by `.ci/run`).

use super::dead_letters::RequeueRequest;
use super::error::Problem;
use super::messages::{BatchAnswer, BatchRequest, ScheduleRequest, Scheduled};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::sync::LazyLock;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi, ToSchema};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "delayd",
        version = env!("CARGO_PKG_VERSION"),
        description = "A durable, millisecond-precise delay / scheduled-message service. Every error \
            is `application/problem+json` with a stable `code`."
    ),
    paths(
        super::messages::schedule,
        super::messages::schedule_batch,
        super::listing::list,
        super::listing::purge,
        super::messages::status,
        super::messages::cancel,
        super::dead_letters::requeue,
        super::dead_letters::discard,
        super::listing::timeline,
        super::schedules::put,
        super::schedules::get,
        super::schedules::list,
        super::schedules::pause,
        super::schedules::resume,
        super::schedules::delete,
        super::consume::topics,
        super::consume::topic,
        super::consume::pull,
        super::consume::commit_offset,
        super::consume::group_offsets,
        super::sources,
        super::sinks,
        super::member::cluster,
        super::member::add_member,
        super::member::remove_member,
        super::healthz,
        super::ready,
        super::metrics,
        super::console,
        document,
    ),
    components(schemas(
        Problem,
        ScheduleRequest,
        BatchRequest,
        RequeueRequest,
        Scheduled,
        BatchAnswer
    )),
    modifiers(&RouterLayers),
    tags(
        (name = "messages", description = "Scheduling, status and cancellation"),
        (name = "listing", description = "Messages by due time, status and topic"),
        (name = "dead letters", description = "Requeue or discard dead messages"),
        (name = "schedules", description = "Recurring schedules: cron and intervals, a message per firing"),
        (name = "broker", description = "The built-in broker: topics, pulls, consumer group offsets"),
        (name = "connections", description = "The MQ sources and the sinks"),
        (name = "cluster", description = "A cluster member's view of its cluster"),
        (name = "operations", description = "Probes, metrics, the console and this document"),
    )
)]
struct ApiDoc;

/// Built once, on the first request: the document does not change while the process runs.
static DOCUMENT: LazyLock<String> = LazyLock::new(|| {
    ApiDoc::openapi()
        .to_json()
        .expect("the OpenAPI document serializes")
});

/// `GET /openapi.json`: this document.
///
/// Served without a token: it tells nothing a client of the API may not know.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "the OpenAPI 3.1 document", body = serde_json::Value))
)]
pub async fn document() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
        .into_response()
}

/// The name of the security scheme every `/v1` operation requires.
const BEARER: &str = "bearerAuth";

/// What the router's layers do to every route, so that each handler's annotation need not repeat it:
/// `/v1` takes the bearer token (`authenticate`), past the connection cap the edge answers 503 (except
/// the probes and metrics, which it always answers), and an internal failure is a 500 anywhere.
struct RouterLayers;

impl Modify for RouterLayers {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme(
                BEARER,
                SecurityScheme::Http(
                    HttpBuilder::new()
                        .scheme(HttpAuthScheme::Bearer)
                        .description(Some(
                            "One of `auth.tokens`; without tokens configured, `/v1` is open",
                        ))
                        .build(),
                ),
            );
        for (path, item) in &mut openapi.paths.paths {
            let v1 = path.starts_with("/v1/");
            let probe = matches!(path.as_str(), "/healthz" | "/readyz" | "/metrics");
            for operation in operations(item) {
                let responses = &mut operation.responses.responses;
                if v1 {
                    operation.security =
                        Some(vec![SecurityRequirement::new(BEARER, Vec::<String>::new())]);
                    responses.insert(
                        "401".to_string(),
                        problem(
                            "`unauthorized`: `auth.tokens` is set and the bearer token is missing or \
                             wrong",
                        ),
                    );
                    responses
                        .entry("500".to_string())
                        .or_insert_with(|| problem("`internal`: the server log has details"));
                }
                if !probe {
                    responses.entry("503".to_string()).or_insert_with(|| {
                        problem("`overloaded`: past the connection cap; nothing was done")
                    });
                }
            }
        }
    }
}

/// Every operation of a path.
fn operations(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.patch,
        &mut item.head,
        &mut item.options,
        &mut item.trace,
    ]
    .into_iter()
    .filter_map(Option::as_mut)
}

/// A response whose body is a problem.
fn problem(description: &str) -> RefOr<utoipa::openapi::Response> {
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/problem+json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name(Problem::name())))
                .build(),
        )
        .into()
}
