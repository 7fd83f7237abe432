//! The one error type of the HTTP edge: every failure becomes an `application/problem+json` body with a
//! stable machine-readable `code`. Internal errors are logged with their cause and answered without it.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use schedulelog::AppendError;
use serde::Serialize;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub detail: String,
    pub retry_after_secs: Option<u32>,
}

/// Every `code` a problem can carry, for the OpenAPI document's `Problem.code` enum. A test below finds
/// the codes the sources give and checks that this list holds exactly those.
pub const PROBLEM_CODES: &[&str] = &[
    "already_dead",
    "already_delivered",
    "conflicting_time_fields",
    "dedup_not_in_batch",
    "delay_too_long",
    "delivery_in_flight",
    "disk_full",
    "forbidden_target",
    "internal",
    "invalid_body",
    "invalid_cron",
    "invalid_cursor",
    "invalid_delay",
    "invalid_delay_level",
    "invalid_deliver_at",
    "invalid_end_at",
    "invalid_every",
    "invalid_group",
    "invalid_header",
    "invalid_json",
    "invalid_key",
    "invalid_member",
    "invalid_offset",
    "invalid_query",
    "invalid_queue",
    "invalid_schedule_id",
    "invalid_start_at",
    "invalid_target",
    "invalid_topic",
    "invalid_tz",
    "member_catching_up",
    "member_unreachable",
    "membership_conflict",
    "method_not_allowed",
    "missing_deliver_time",
    "no_leader",
    "not_dead",
    "not_found",
    "not_requeueable",
    "overloaded",
    "payload_too_large",
    "request_timeout",
    "shutting_down",
    "storage_failed",
    "too_many_attempts",
    "too_many_groups",
    "topic_required",
    "unauthorized",
    "unknown_sink",
    "write_uncertain",
];

/// An RFC 7807 problem: the body of every error answer, as `application/problem+json`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Problem {
    /// `urn:delayd:problem:` and the code.
    #[serde(rename = "type")]
    #[schema(examples("urn:delayd:problem:not_found"))]
    pub kind: String,
    /// The HTTP status's reason phrase.
    #[schema(value_type = String, examples("Not Found"))]
    pub title: &'static str,
    /// The HTTP status of the answer.
    #[schema(minimum = 400, maximum = 599)]
    pub status: u16,
    /// What went wrong, for people.
    pub detail: String,
    /// What went wrong, for programs: stable across versions.
    #[schema(schema_with = problem_code_schema)]
    pub code: &'static str,
}

fn problem_code_schema() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(PROBLEM_CODES.iter().copied()))
        .description(Some(
            "What went wrong, for programs: stable across versions (the Errors table of docs/api.md \
             says when each is answered)",
        ))
        .build()
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            detail: detail.into(),
            retry_after_secs: None,
        }
    }

    pub fn bad_request(code: &'static str, detail: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, code, detail)
    }

    pub fn not_found(detail: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", detail)
    }

    pub fn too_large(detail: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", detail)
    }

    /// 507: nothing was stored for want of disk space.
    pub fn disk_full(detail: impl Into<String>) -> ApiError {
        ApiError {
            retry_after_secs: Some(10),
            ..ApiError::new(StatusCode::INSUFFICIENT_STORAGE, "disk_full", detail)
        }
    }

    /// 503 `no_leader`: no cluster leader took the request, so nothing was done and it may be sent again.
    pub fn no_leader(detail: impl Into<String>) -> ApiError {
        ApiError {
            retry_after_secs: Some(1),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_leader", detail)
        }
    }

    /// 503 `write_uncertain`: a write reached the cluster but its outcome is unknown; it may still take
    /// effect, so it is resent with an idempotency key.
    pub fn write_uncertain(detail: impl Into<String>) -> ApiError {
        ApiError {
            retry_after_secs: Some(1),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "write_uncertain", detail)
        }
    }

    /// A failure inside delayd: logged in full, answered without internals.
    pub fn internal(error: impl std::fmt::Display) -> ApiError {
        tracing::error!(%error, "internal error");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "an internal error occurred; the server log has details",
        )
    }

    pub fn problem(&self) -> Problem {
        Problem {
            kind: format!("urn:delayd:problem:{}", self.code),
            title: self.status.canonical_reason().unwrap_or("Error"),
            status: self.status.as_u16(),
            detail: self.detail.clone(),
            code: self.code,
        }
    }
}

impl From<AppendError> for ApiError {
    fn from(error: AppendError) -> ApiError {
        match error {
            AppendError::DiskFull => {
                ApiError::disk_full("the disk is full; nothing was stored, retry later")
            }
            AppendError::Overloaded => ApiError {
                retry_after_secs: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    "too many writes are waiting for the disk; nothing was stored, retry shortly",
                )
            },
            AppendError::Poisoned(cause) => {
                // Logged once, when it happened; not again for every refused request.
                tracing::debug!(%cause, "write refused: the log is poisoned");
                ApiError {
                    retry_after_secs: Some(60),
                    ..ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "storage_failed",
                        "a write to disk failed; this node accepts no writes until it is restarted. Nothing of \
                         this request is acknowledged; if the failure happened during it, what of it reached \
                         the disk may still take effect after the restart",
                    )
                }
            }
            AppendError::NotLeader { .. } => ApiError::no_leader(
                "this cluster member could not propose the write (it does not lead, or its last write is unresolved); nothing was stored, retry shortly",
            ),
            AppendError::Uncertain { .. } => ApiError::write_uncertain(
                "no quorum of the cluster took the write in time: it may still take effect; resend it with an idempotency key (dedup)",
            ),
            // What the log refuses is the caller's mistake in this process, not the client's.
            refused @ AppendError::Refused(_) => ApiError::internal(refused),
            AppendError::Closed => ApiError {
                retry_after_secs: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "shutting_down",
                    "the server is shutting down",
                )
            },
        }
    }
}

impl From<schedulelog::Error> for ApiError {
    fn from(error: schedulelog::Error) -> ApiError {
        match error {
            schedulelog::Error::NotFiledYet { cause: Some(cause) } => {
                tracing::debug!(%cause, "a lookup found the replayer held up by a full disk");
                ApiError::disk_full(
                    "the disk is full: recent writes are acknowledged but not filed yet; retry later",
                )
            }
            schedulelog::Error::NotFiledYet { cause: None } => ApiError {
                retry_after_secs: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    "recent writes are not filed yet; retry shortly",
                )
            },
            other => ApiError::internal(other),
        }
    }
}

impl From<crate::scheduler::CancelError> for ApiError {
    fn from(error: crate::scheduler::CancelError) -> ApiError {
        use crate::scheduler::CancelError;
        match error {
            CancelError::NotFound => ApiError::not_found(error.to_string()),
            CancelError::AlreadyDelivered => {
                ApiError::new(StatusCode::CONFLICT, "already_delivered", error.to_string())
            }
            CancelError::AlreadyDead => {
                ApiError::new(StatusCode::CONFLICT, "already_dead", error.to_string())
            }
            // Not a 200: the attempt may still be delivered. Nothing was written; once the attempt
            // settled, a DELETE answers for what it became (delivered, dead, or a retry it cancels).
            CancelError::InFlight => ApiError {
                retry_after_secs: Some(1),
                ..ApiError::new(
                    StatusCode::CONFLICT,
                    "delivery_in_flight",
                    "an attempt of this message is being delivered right now; nothing was cancelled. \
                     Send the DELETE again once it settled: it is then delivered (409 already_delivered), \
                     dead (409 already_dead) or waiting for a retry, which the DELETE cancels",
                )
            },
            CancelError::Lookup(e) => ApiError::from(e),
            CancelError::Append(e) => ApiError::from(e),
            CancelError::Interrupted(e) => ApiError::internal(e),
        }
    }
}

impl From<crate::scheduler::DeadLetterError> for ApiError {
    fn from(error: crate::scheduler::DeadLetterError) -> ApiError {
        use crate::scheduler::DeadLetterError;
        match error {
            DeadLetterError::NotFound => ApiError::not_found(error.to_string()),
            DeadLetterError::TooManyAttempts => {
                ApiError::new(StatusCode::CONFLICT, "too_many_attempts", error.to_string())
            }
            DeadLetterError::NotDead(_) => {
                ApiError::new(StatusCode::CONFLICT, "not_dead", error.to_string())
            }
            DeadLetterError::Lookup(e) => ApiError::from(e),
            DeadLetterError::Append(e) => ApiError::from(e),
            DeadLetterError::Interrupted(e) => ApiError::internal(e),
        }
    }
}

impl From<crate::broker::BrokerError> for ApiError {
    fn from(error: crate::broker::BrokerError) -> ApiError {
        if let crate::broker::BrokerError::Replication(e) = error {
            // A cluster member's write that Raft did not take: `no_leader`, `write_uncertain`, ...
            return e.into();
        }
        if error.is_disk_full() {
            tracing::debug!(%error, "a broker write found the disk full");
            ApiError::disk_full("the disk is full; nothing was stored, retry later")
        } else {
            ApiError::internal(error)
        }
    }
}

impl From<crate::intake::Rejection> for ApiError {
    fn from(rejection: crate::intake::Rejection) -> ApiError {
        if rejection.too_large {
            ApiError::too_large(rejection.detail)
        } else {
            ApiError::bad_request(rejection.code, rejection.detail)
        }
    }
}

impl From<crate::intake::IntakeError> for ApiError {
    fn from(error: crate::intake::IntakeError) -> ApiError {
        use crate::intake::IntakeError;
        match error {
            IntakeError::Append(e) => e.into(),
            IntakeError::Lookup(e) => e.into(),
            IntakeError::Interrupted(e) => ApiError::internal(e),
            IntakeError::KeysNotReady => ApiError::disk_full(error.to_string()),
            IntakeError::KeyUnsettled => ApiError::write_uncertain(error.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.problem()).unwrap_or_default();
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = self.retry_after_secs {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// A cluster member's refused write tells the client whether anything may have been stored.
    #[test]
    fn a_refused_cluster_write_says_whether_it_may_take_effect() {
        let not_proposed = ApiError::from(AppendError::NotLeader { leader: Some(2) });
        let uncertain = ApiError::from(AppendError::Uncertain { seqs_below: 1 });
        for (error, code) in [
            (&not_proposed, "no_leader"),
            (&uncertain, "write_uncertain"),
        ] {
            assert_eq!(error.status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(error.code, code);
            assert_eq!(error.retry_after_secs, Some(1));
        }
        assert!(not_proposed.detail.contains("nothing was stored"));
        assert!(uncertain.detail.contains("may still take effect"));
    }

    /// The codes a source gives: a string literal right after `bad_request(`, `Rejection::new(`,
    /// `code: ` or a `StatusCode::NAME,` argument, which is how every code is written.
    fn codes_in(source: &str) -> Vec<&str> {
        let literal_after = |rest: &'static str| {
            source.match_indices(rest).filter_map(|(at, marker)| {
                let after = source[at + marker.len()..].trim_start();
                let literal = after.strip_prefix('"')?;
                literal.split('"').next()
            })
        };
        let after_status = source
            .match_indices("StatusCode::")
            .filter_map(|(at, marker)| {
                let after = &source[at + marker.len()..];
                let after = after.trim_start_matches(|c: char| c.is_ascii_uppercase() || c == '_');
                let literal = after.strip_prefix(',')?.trim_start().strip_prefix('"')?;
                literal.split('"').next()
            });
        literal_after("bad_request(")
            .chain(literal_after("Rejection::new("))
            .chain(literal_after("code: "))
            .chain(after_status)
            .filter(|code| code.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
            .collect()
    }

    /// Every code the HTTP API's sources give is in `PROBLEM_CODES` (so the OpenAPI document lists it),
    /// and every code listed is given somewhere (none is stale). The MQ sources' dead-letter reasons
    /// (src/source) are not HTTP answers and are not read.
    #[test]
    fn problem_codes_are_the_codes_the_sources_give() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = vec![src.join("intake/mod.rs")];
        for dir in ["api", "edge", "schedule"] {
            for entry in std::fs::read_dir(src.join(dir)).expect("a source directory") {
                let path = entry.expect("a directory entry").path();
                if path.extension().is_some_and(|e| e == "rs") {
                    files.push(path);
                }
            }
        }
        let mut given = BTreeSet::new();
        for file in &files {
            let source = std::fs::read_to_string(file).expect("a source file");
            for code in codes_in(&source) {
                given.insert(code.to_string());
            }
        }
        let listed: BTreeSet<String> = PROBLEM_CODES.iter().map(|c| c.to_string()).collect();
        assert!(given.len() > 20, "the scan finds the codes: {given:?}");
        assert_eq!(
            given.difference(&listed).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "codes given but not in PROBLEM_CODES"
        );
        assert_eq!(
            listed.difference(&given).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "codes in PROBLEM_CODES that no source gives"
        );
    }
}
