//! The HTTP face of a cluster member (DESIGN.md §10, "Any node answers"). Every member answers
//! `GET /v1/cluster`, `/healthz`, `/readyz` and `/metrics` itself. Everything else goes to the API of
//! the leader's term: this member's own while it leads and its term runs, else the leader's, through
//! [`Forwarder`] (the answer relayed as it comes). With no leader known, or one that is itself still
//! starting: `503 no_leader` with `Retry-After`.
//!
//! Invariants:
//! - A request is forwarded at most once: one that a member forwarded already is answered
//!   `no_leader` by a member that does not lead (two members disagreeing on who leads, during an
//!   election), never sent on.
//! - `GET /v1/cluster` is never forwarded: it says what this member sees.
//! - A membership change (`POST /v1/cluster/members`, `DELETE /v1/cluster/members/{id}`) is made by
//!   the leader: a follower forwards it like any other request.

use super::error::ApiError;
use super::forward::{self, Forwarder};
use super::{
    check_token, count_requests, healthz, parse_json, render_metrics, storage_failure, RawBody,
};
use crate::broker::Broker;
use crate::cluster::membership::{self, MembershipError};
use crate::cluster::node::{ClusterStatus, Node};
use crate::config::Config;
use axum::extract::{FromRequest, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use schedulelog::ScheduleLog;
use std::sync::Arc;
use tower::ServiceExt;

/// What a member's own routes need.
pub struct MemberState {
    pub node: Arc<Node>,
    /// The API of this member's term while it leads (lib.rs starts and stops it).
    pub leading: tokio::sync::watch::Receiver<Option<Router>>,
    pub forwarder: Forwarder,
    pub log: Arc<ScheduleLog>,
    pub broker: Arc<Broker>,
    pub config: Arc<Config>,
    pub metrics: PrometheusHandle,
}

impl std::fmt::Debug for MemberState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberState")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

type Member = Arc<MemberState>;

pub fn router(state: Member) -> Router {
    let cluster = Router::new()
        .route("/v1/cluster", get(cluster))
        .route("/v1/cluster/members", post(add_member))
        .route("/v1/cluster/members/{id}", delete(remove_member))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .merge(cluster)
        .route("/healthz", get(healthz))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        // Counted here; what goes to the term's API is counted there (by its route), and what is
        // forwarded by the leader that answers it.
        .route_layer(middleware::from_fn(count_requests))
        .fallback(elsewhere)
        .with_state(state)
}

async fn authenticate(State(state): State<Member>, request: Request, next: Next) -> Response {
    match check_token(&state.config.auth.tokens, &request) {
        Ok(()) => next.run(request).await,
        Err(refused) => refused.into_response(),
    }
}

/// `GET /v1/cluster`: the cluster as this member sees it.
///
/// Answered by the member asked, never forwarded. A single node (no `[cluster]` section) answers 404.
#[utoipa::path(
    get,
    path = "/v1/cluster",
    tag = "cluster",
    responses(
        (status = 200, description = "the cluster as this member sees it: its leader, term, indexes and members", body = ClusterStatus),
        (status = 404, description = "`not_found`: a single node, no cluster member", body = crate::api::error::Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn cluster(State(state): State<Member>) -> Json<ClusterStatus> {
    Json(state.node.status())
}

/// A member to add: its id and addresses, as in `[[cluster.members]]`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewMember {
    /// The member's id: a whole number above 0, no other member's.
    pub id: u64,
    /// Its client listener, `http://host:port` (followers forward requests here).
    pub api: String,
    /// Its peer listener as the others reach it, `host:port`.
    pub peer: String,
}

/// `POST /v1/cluster/members`: adds a member, started with `join = true`: a learner until it has
/// caught up with the leader's log, then a voter (joint consensus). Made by the leader (a follower
/// forwards it).
#[utoipa::path(
    post,
    path = "/v1/cluster/members",
    tag = "cluster",
    request_body = NewMember,
    responses(
        (status = 200, description = "the member is a voter; the cluster as the leader sees it", body = ClusterStatus),
        (status = 400, description = "`invalid_json` or `invalid_member`: the body is not a member (`id` above 0, `api` an http(s) URL, `peer` host:port)", body = crate::api::error::Problem, content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: a single node, no cluster member", body = crate::api::error::Problem, content_type = "application/problem+json"),
        (status = 409, description = "`membership_conflict`: a voter already, another member's address, or another change under way", body = crate::api::error::Problem, content_type = "application/problem+json"),
        (status = 422, description = "`member_unreachable`: the member never answered the leader; it was not added", body = crate::api::error::Problem, content_type = "application/problem+json"),
        (status = 503, description = "`member_catching_up` (it stays a learner: add it again to make it a voter) or `no_leader`, with `Retry-After`", body = crate::api::error::Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn add_member(State(state): State<Member>, request: Request) -> Response {
    if !state.node.leads() {
        return not_here(state, request).await;
    }
    let new: NewMember = match RawBody::from_request(request, &()).await {
        Ok(RawBody(body)) => match parse_json(&body) {
            Ok(new) => new,
            Err(refused) => return refused.into_response(),
        },
        Err(refused) => return refused.into_response(),
    };
    let invalid = |why: String| ApiError::bad_request("invalid_member", why).into_response();
    if new.id == 0 {
        return invalid("id: a whole number above 0".into());
    }
    if let Err(why) = crate::config::cluster::api_url(&new.api) {
        return invalid(format!("api: {why}"));
    }
    if let Err(why) = crate::config::cluster::host_port(&new.peer) {
        return invalid(format!("peer: {why}"));
    }
    let member = crate::cluster::Member {
        api: new.api,
        peer: new.peer,
    };
    match membership::add(&state.node, new.id, member, membership::CATCH_UP_WITHIN).await {
        Ok(()) => Json(state.node.status()).into_response(),
        Err(error) => membership_refused(error).into_response(),
    }
}

/// `DELETE /v1/cluster/members/{id}`: removes a member, a voter (joint consensus) or a learner.
/// Made by the leader (a follower forwards it); the leader may remove itself, and then steps down.
#[utoipa::path(
    delete,
    path = "/v1/cluster/members/{id}",
    tag = "cluster",
    params(("id" = u64, Path, description = "the member's id")),
    responses(
        (status = 200, description = "the member is removed; the cluster as the leader sees it", body = ClusterStatus),
        (status = 400, description = "`invalid_member`: the id is not a whole number", body = crate::api::error::Problem, content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such member, or a single node", body = crate::api::error::Problem, content_type = "application/problem+json"),
        (status = 409, description = "`membership_conflict`: the last voter, a removal that would leave no answering majority, or another change under way", body = crate::api::error::Problem, content_type = "application/problem+json"),
        (status = 503, description = "`no_leader`, with `Retry-After`", body = crate::api::error::Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn remove_member(State(state): State<Member>, request: Request) -> Response {
    if !state.node.leads() {
        return not_here(state, request).await;
    }
    let id = request.uri().path().rsplit('/').next().unwrap_or_default();
    let Ok(id) = id.parse::<u64>() else {
        return ApiError::bad_request("invalid_member", format!("{id:?} is no member id"))
            .into_response();
    };
    match membership::remove(&state.node, id).await {
        Ok(()) => Json(state.node.status()).into_response(),
        Err(error) => membership_refused(error).into_response(),
    }
}

/// A membership change on a member that does not lead: to the leader, as any request goes; but
/// not to this member's own term, still running while it steps down (whose API is a single node's).
async fn not_here(state: Member, request: Request) -> Response {
    if state.leading.borrow().is_some() {
        return ApiError::no_leader(
            "this member is stepping down: no leader to change the membership",
        )
        .into_response();
    }
    elsewhere(State(state), request).await
}

fn membership_refused(error: MembershipError) -> ApiError {
    let detail = error.to_string();
    match error {
        MembershipError::Conflict(_) => {
            ApiError::new(StatusCode::CONFLICT, "membership_conflict", detail)
        }
        MembershipError::NotFound(_) => ApiError::not_found(detail),
        MembershipError::Unreachable(_) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "member_unreachable",
            detail,
        ),
        MembershipError::CatchingUp(_) => ApiError {
            retry_after_secs: Some(5),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "member_catching_up",
                detail,
            )
        },
        MembershipError::NotLeader(_) => ApiError::no_leader(detail),
    }
}

/// `GET /readyz` of a member: storage working, a leader known, and every entry this member knows
/// to be committed applied. 503 `no_leader` (or `storage_failed`) otherwise.
async fn ready(State(state): State<Member>) -> Response {
    if let Some(cause) = storage_failure(&state.log, &state.broker).await {
        let mut error = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "storage_failed", cause);
        error.retry_after_secs = Some(60);
        return error.into_response();
    }
    let starting = state.node.leads() && state.leading.borrow().is_none();
    match state.node.ready() {
        Ok(()) if starting => {
            ApiError::no_leader("this member was elected and is still loading its wheel")
                .into_response()
        }
        Ok(()) => Json(serde_json::json!({"status": "ready"})).into_response(),
        Err(why) => ApiError::no_leader(format!("this member is not ready: {why}")).into_response(),
    }
}

async fn metrics(State(state): State<Member>) -> Response {
    render_metrics(&state.log, &state.broker, &state.metrics).await
}

/// Every other route: the leader's API, here or through the leader.
async fn elsewhere(State(state): State<Member>, request: Request) -> Response {
    let leading = state.leading.borrow().clone();
    if let Some(api) = leading {
        return match api.oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
    }
    let id = state.node.id();
    match state.node.leader() {
        Some((leader, _)) if leader == id => match state.node.lease().holds() {
            true => ApiError::no_leader("this member was elected and is still loading its wheel"),
            false => ApiError::no_leader(
                "this member leads in name only: no majority has confirmed its lead lately (is it cut off from the others?)",
            ),
        }
        .into_response(),
        Some(_) if forward::was_forwarded(&request) => ApiError::no_leader(format!(
            "member {id} does not lead either; the members disagree on who leads (an election is under way)"
        ))
        .into_response(),
        Some((leader, member)) => {
            // A leader that stops answering (paused, cut off, its host gone) is replaced within a
            // few seconds: the request is not left waiting for it longer than that.
            let read_only = matches!(request.method(), &Method::GET | &Method::HEAD);
            let mut metrics = state.node.raft().metrics();
            let replaced = async move {
                while metrics.changed().await.is_ok() {
                    if metrics.borrow_and_update().current_leader != Some(leader) {
                        return;
                    }
                }
                std::future::pending::<()>().await
            };
            tokio::select! {
                answer = state.forwarder.forward(leader, &member.api, request) => answer,
                _ = replaced => match read_only {
                    true => ApiError::no_leader(format!(
                        "member {leader}, which led, stopped leading before it answered; nothing was changed"
                    )),
                    false => ApiError::write_uncertain(format!(
                        "member {leader}, which led, stopped leading before it answered: the request may or may not have taken effect"
                    )),
                }
                .into_response(),
            }
        }
        None => ApiError::no_leader("no member of the cluster leads now").into_response(),
    }
}
