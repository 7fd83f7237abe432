//! Recurring schedules over HTTP (DESIGN §14): `PUT/GET/DELETE /v1/schedules/{id}`,
//! `GET /v1/schedules`, `POST /v1/schedules/{id}/pause` and `/resume`. Each write is answered once it
//! is durable and in the schedule table (schedule/mod.rs).

use super::error::{ApiError, Problem};
use super::messages::check_disk;
use super::{page_limit, parse_json, query_params, AppState, RawBody};
use crate::schedule::{valid_id, Put, PutSchedule, ScheduleError, ScheduleView};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

impl From<ScheduleError> for ApiError {
    fn from(error: ScheduleError) -> ApiError {
        match error {
            ScheduleError::Rejected(rejection) => ApiError::from(rejection),
            ScheduleError::NotFound => ApiError::not_found("no schedule has this id"),
            ScheduleError::Append(error) => ApiError::from(error),
            ScheduleError::NotFiled => {
                ApiError::from(schedulelog::Error::NotFiledYet { cause: None })
            }
        }
    }
}

/// A schedule's id from the path of a route that reads one: an id no schedule can have is not found.
fn existing(id: &str) -> Result<&str, ApiError> {
    match valid_id(id) {
        true => Ok(id),
        false => Err(ApiError::not_found(format!("{id:?} is not a schedule id"))),
    }
}

/// Creates or replaces a schedule.
///
/// `PUT /v1/schedules/{id}`: 201 for a new schedule, 200 for one replaced (or put again unchanged,
/// which writes nothing). Replacing keeps a paused schedule paused and withdraws the firing planned
/// under the old definition.
#[utoipa::path(
    put,
    path = "/v1/schedules/{id}",
    tag = "schedules",
    operation_id = "put_schedule",
    params(("id" = String, Path, description = "`[A-Za-z0-9._-]{1,200}`, not only dots")),
    request_body(content = PutSchedule, content_type = "application/json"),
    responses(
        (status = 200, description = "replaced (durable), or put again unchanged (nothing written)",
            body = ScheduleView),
        (status = 201, description = "created (durable)", body = ScheduleView, links(
            ("get" = (operation_id = "get_schedule", parameters(("id" = "$response.body#/id")))),
            ("pause" = (operation_id = "pause_schedule", parameters(("id" = "$response.body#/id")))),
            ("resume" = (operation_id = "resume_schedule", parameters(("id" = "$response.body#/id")))),
            ("delete" = (operation_id = "delete_schedule", parameters(("id" = "$response.body#/id")))),
        )),
        (status = 400, description = "`invalid_schedule_id`, `invalid_cron`, `invalid_tz`, \
            `invalid_every`, `invalid_start_at`, `invalid_end_at`, `invalid_json`, `invalid_body`, \
            `invalid_topic`, `invalid_target`, `invalid_key`, `invalid_header`, `unknown_sink`, \
            `forbidden_target`", body = Problem, content_type = "application/problem+json"),
        (status = 408, description = "`request_timeout`", body = Problem,
            content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`, `storage_failed`, `shutting_down`, `no_leader`, \
            `write_uncertain`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn put(
    State(state): State<AppState>,
    Path(id): Path<String>,
    RawBody(bytes): RawBody,
) -> Result<(StatusCode, Json<ScheduleView>), ApiError> {
    let request: PutSchedule = parse_json(&bytes)?;
    check_disk(&state, bytes.len())?;
    let (put, view) = state.schedules.put(&id, request).await?;
    let status = match put {
        Put::Created => StatusCode::CREATED,
        Put::Replaced | Put::Unchanged => StatusCode::OK,
    };
    Ok((status, Json(view)))
}

/// A schedule.
#[utoipa::path(
    get,
    path = "/v1/schedules/{id}",
    tag = "schedules",
    operation_id = "get_schedule",
    params(("id" = String, Path, description = "the schedule's id")),
    responses(
        (status = 200, description = "the schedule", body = ScheduleView),
        (status = 404, description = "`not_found`", body = Problem,
            content_type = "application/problem+json"),
    )
)]
pub async fn get(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ScheduleView>, ApiError> {
    let id = existing(&id)?;
    let view = state
        .schedules
        .get(id)
        .ok_or_else(|| ApiError::not_found("no schedule has this id"))?;
    Ok(Json(view))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// Schedules in a page, 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<usize>,
    /// Where the page starts: the previous page's `next_cursor`.
    cursor: Option<String>,
}

/// `GET /v1/schedules`: a page, by id; `next_cursor` is null after the last.
#[derive(Debug, Serialize, ToSchema)]
pub struct SchedulePage {
    schedules: Vec<ScheduleView>,
    next_cursor: Option<String>,
}

/// Lists schedules by id.
#[utoipa::path(
    get,
    path = "/v1/schedules",
    tag = "schedules",
    operation_id = "list_schedules",
    params(ListParams),
    responses(
        (status = 200, description = "a page of schedules", body = SchedulePage),
        (status = 400, description = "`invalid_query`, `invalid_cursor`", body = Problem,
            content_type = "application/problem+json"),
    )
)]
pub async fn list(
    State(state): State<AppState>,
    params: Result<Query<ListParams>, QueryRejection>,
) -> Result<Json<SchedulePage>, ApiError> {
    let params = query_params(params)?;
    let limit = page_limit(params.limit)?;
    // The cursor is the last id of the page before.
    let after = match params.cursor.as_deref() {
        None => None,
        Some(cursor) if valid_id(cursor) => Some(cursor),
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_cursor",
                "not a cursor this listing gave",
            ))
        }
    };
    let (schedules, next_cursor) = state.schedules.list(after, limit);
    Ok(Json(SchedulePage {
        schedules,
        next_cursor,
    }))
}

/// Pauses a schedule: no firing after the answer (the planned one is withdrawn).
#[utoipa::path(
    post,
    path = "/v1/schedules/{id}/pause",
    tag = "schedules",
    operation_id = "pause_schedule",
    params(("id" = String, Path, description = "the schedule's id")),
    responses(
        (status = 200, description = "paused (durable; also when it was)", body = ScheduleView),
        (status = 404, description = "`not_found`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`, `storage_failed`, `shutting_down`, `no_leader`, \
            `write_uncertain`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn pause(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ScheduleView>, ApiError> {
    let id = existing(&id)?;
    Ok(Json(state.schedules.pause(id).await?))
}

/// Resumes a paused schedule: it plans afresh from now (firings missed while paused are not made).
#[utoipa::path(
    post,
    path = "/v1/schedules/{id}/resume",
    tag = "schedules",
    operation_id = "resume_schedule",
    params(("id" = String, Path, description = "the schedule's id")),
    responses(
        (status = 200, description = "resumed (durable; also when it was not paused)",
            body = ScheduleView),
        (status = 404, description = "`not_found`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`, `storage_failed`, `shutting_down`, `no_leader`, \
            `write_uncertain`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn resume(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ScheduleView>, ApiError> {
    let id = existing(&id)?;
    Ok(Json(state.schedules.resume(id).await?))
}

/// Deletes a schedule: no firing after the answer (the planned one is withdrawn).
#[utoipa::path(
    delete,
    path = "/v1/schedules/{id}",
    tag = "schedules",
    operation_id = "delete_schedule",
    params(("id" = String, Path, description = "the schedule's id")),
    responses(
        (status = 200, description = "deleted (durable)", body = Deleted),
        (status = 404, description = "`not_found`", body = Problem,
            content_type = "application/problem+json"),
        (status = 503, description = "`overloaded`, `storage_failed`, `shutting_down`, `no_leader`, \
            `write_uncertain`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32))),
        (status = 507, description = "`disk_full`", body = Problem,
            content_type = "application/problem+json", headers(("Retry-After" = u32))),
    )
)]
pub async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Deleted>, ApiError> {
    let id = existing(&id)?;
    state.schedules.delete(id).await?;
    Ok(Json(Deleted {
        id: id.to_string(),
        status: "deleted",
    }))
}

/// The answer to a delete.
#[derive(Debug, Serialize, ToSchema)]
pub struct Deleted {
    id: String,
    /// `deleted`.
    #[schema(value_type = String)]
    status: &'static str,
}
