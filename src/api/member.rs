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

use super::error::ApiError;
use super::forward::{self, Forwarder};
use super::{check_token, count_requests, healthz, render_metrics, storage_failure};
use crate::broker::Broker;
use crate::cluster::node::{ClusterStatus, Node};
use crate::config::Config;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
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
