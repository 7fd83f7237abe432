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

/// The problem+json body.
#[derive(Debug, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub kind: String,
    pub title: &'static str,
    pub status: u16,
    pub detail: String,
    pub code: &'static str,
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
            DeadLetterError::NotDead(_) | DeadLetterError::TooManyAttempts => {
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
