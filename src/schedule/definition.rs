//! A schedule's definition: the fields a `PUT /v1/schedules/{id}` gives (DESIGN §14), checked, and
//! stored as the definition of its op record (JSON, opaque to the engine): `{"spec": …, "created_at_ms"}`.
//!
//! Invariants:
//! - A stored definition passed every check a new message passes (intake.rs), with the delivery time
//!   left out: each firing is that message, so it is refused at the `PUT`, not at a firing.
//! - The firing headers (`delayd-schedule`, `delayd-fire-at`) are the firing's own: a schedule whose
//!   headers name them is refused, as is an ordinary message that does (intake.rs).

use super::calendar::{Calendar, Catchup, Timing};
use crate::intake::{Admission, Draft, Rejection};
use crate::names::valid_name;
use crate::timestamp::{format_ms, parse_rfc3339};
use base64::Engine;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// The sink of a schedule that names none, as for a message.
const DEFAULT_SINK: &str = "broker";

/// A time given as RFC 3339 or unix milliseconds.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TimeField {
    Ms(i64),
    Text(String),
}

/// The body of `PUT /v1/schedules/{id}`: exactly one of `cron` and `every`, exactly one of `body` and
/// `body_base64`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutSchedule {
    /// 5 fields (minute first) or 6 (second first); day and month names; `@hourly`, `@daily`,
    /// `@weekly`, `@monthly`, `@yearly`.
    #[schema(examples("0 9 * * MON-FRI"))]
    pub cron: Option<String>,
    /// A fixed interval: `"30s"`, `"5m"`, `"1h"`, `"1d"`, or milliseconds (a number, or its digits);
    /// at least 1 s.
    #[serde(default, deserialize_with = "text_or_ms")]
    #[schema(examples("5m"))]
    pub every: Option<String>,
    /// An IANA time zone (default `UTC`): cron times follow its wall clock across DST.
    #[schema(examples("Europe/Berlin"))]
    pub tz: Option<String>,
    /// Each firing's topic, as a message's.
    #[schema(examples("reports.daily"))]
    pub topic: String,
    /// Each firing's body as UTF-8 text.
    pub body: Option<String>,
    /// Each firing's body in standard base64.
    #[schema(content_encoding = "base64")]
    pub body_base64: Option<String>,
    /// Each firing's headers, as a message's (after `delayd-schedule` and `delayd-fire-at`).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    pub key: Option<String>,
    /// Default `broker`.
    pub sink: Option<String>,
    /// No firing before it (RFC 3339 or unix ms); an `every` counts its phase from it.
    #[schema(value_type = Option<String>)]
    pub start_at: Option<TimeField>,
    /// No firing after it (inclusive).
    #[schema(value_type = Option<String>)]
    pub end_at: Option<TimeField>,
    /// What a node that was down does with the firings it missed: `none`, `one` (default), `all`.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub catchup: Catchup,
}

/// A schedule's fields as stored (times normalized to RFC 3339 with milliseconds); the API answers
/// them in a `ScheduleView`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    pub cron: Option<String>,
    pub every: Option<String>,
    pub tz: String,
    pub topic: String,
    pub body: Option<String>,
    pub body_base64: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub key: Option<String>,
    pub sink: String,
    pub start_at: Option<String>,
    pub end_at: Option<String>,
    pub catchup: Catchup,
}

/// A definition as its op record holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stored {
    pub spec: Spec,
    /// When the definition was made: an `every` without `start_at` counts its phase from it.
    pub created_at_ms: i64,
}

/// `every` as text: a number of milliseconds is taken as its digits.
fn text_or_ms<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Option::<TimeField>::deserialize(d)? {
        None => None,
        Some(TimeField::Ms(ms)) => Some(ms.to_string()),
        Some(TimeField::Text(text)) => Some(text),
    })
}

/// Whether `id` may name a schedule: `[A-Za-z0-9._-]{1,200}`, not only dots.
pub fn valid_id(id: &str) -> bool {
    valid_name(id)
}

/// A `start_at` or `end_at`, as unix ms; `refused` says why text that is no time is refused.
fn time_field(
    value: Option<TimeField>,
    refused: impl Fn(String) -> Rejection,
) -> Result<Option<i64>, Rejection> {
    let ms = match value {
        None => return Ok(None),
        Some(TimeField::Ms(ms)) => ms,
        Some(TimeField::Text(text)) => parse_rfc3339(&text).ok_or_else(|| {
            refused(format!(
                "{text:?} is not an RFC 3339 time nor unix milliseconds"
            ))
        })?,
    };
    // Stored as RFC 3339 text, which must read back as the same time (years 0 to 9999).
    match parse_rfc3339(&format_ms(ms)) == Some(ms) {
        true => Ok(Some(ms)),
        false => Err(refused(format!("{ms} is outside the years 0 to 9999"))),
    }
}

impl PutSchedule {
    /// Checks every field (the timing, then the message fields as a new message's) and makes the
    /// definition, created at `now_ms`.
    pub fn check(self, admission: &Admission, now_ms: i64) -> Result<Stored, Rejection> {
        let start_at_ms = time_field(self.start_at, |why| {
            Rejection::new("invalid_start_at", format!("start_at {why}"))
        })?;
        let end_at_ms = time_field(self.end_at, |why| {
            Rejection::new("invalid_end_at", format!("end_at {why}"))
        })?;
        if let (Some(start), Some(end)) = (start_at_ms, end_at_ms) {
            if end < start {
                return Err(Rejection::new(
                    "invalid_end_at",
                    "end_at is before start_at",
                ));
            }
        }
        let tz = self.tz.unwrap_or_else(|| "UTC".to_string());
        Calendar::parse(
            self.cron.as_deref(),
            self.every.as_deref(),
            Some(&tz),
            start_at_ms.unwrap_or(now_ms),
        )
        .map_err(|e| Rejection::new(e.code, e.detail))?;
        let body = match (&self.body, &self.body_base64) {
            (Some(text), None) => Cow::Borrowed(text.as_bytes()),
            (None, Some(encoded)) => Cow::Owned(
                base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|e| {
                        Rejection::new("invalid_body", format!("body_base64 is not base64: {e}"))
                    })?,
            ),
            _ => {
                return Err(Rejection::new(
                    "invalid_body",
                    "exactly one of body and body_base64 must be given",
                ))
            }
        };
        let sink = self.sink.unwrap_or_else(|| DEFAULT_SINK.to_string());
        let draft = Draft {
            deliver_at_ms: now_ms,
            topic: &self.topic,
            key: self.key.as_deref(),
            headers: self
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect(),
            sink: &sink,
            body,
            dedup: false,
        };
        draft.check(admission, now_ms)?;
        Ok(Stored {
            spec: Spec {
                cron: self.cron,
                every: self.every,
                tz,
                topic: self.topic,
                body: self.body,
                body_base64: self.body_base64,
                headers: self.headers,
                key: self.key,
                sink,
                start_at: start_at_ms.map(format_ms),
                end_at: end_at_ms.map(format_ms),
                catchup: self.catchup,
            },
            created_at_ms: now_ms,
        })
    }
}

impl Stored {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a definition always serializes")
    }

    /// A stored definition; `None` for bytes that are not one (a later version's, or damage the
    /// checksums missed), which the schedule then skips, saying so.
    pub fn decode(bytes: &[u8]) -> Option<Stored> {
        serde_json::from_slice(bytes).ok()
    }

    /// The body of each firing.
    pub fn body(&self) -> Vec<u8> {
        match (&self.spec.body, &self.spec.body_base64) {
            (Some(text), _) => text.as_bytes().to_vec(),
            (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .unwrap_or_default(),
            (None, None) => Vec::new(),
        }
    }

    /// The timing, parsed again (it was checked when stored).
    pub fn timing(&self) -> Option<Timing> {
        let spec = &self.spec;
        // A stored time that does not read back means no timing (it does not fire), never none.
        let time = |t: &Option<String>| match t {
            None => Some(None),
            Some(text) => parse_rfc3339(text).map(Some),
        };
        let (start_at_ms, end_at_ms) = (time(&spec.start_at)?, time(&spec.end_at)?);
        let calendar = Calendar::parse(
            spec.cron.as_deref(),
            spec.every.as_deref(),
            Some(&spec.tz),
            start_at_ms.unwrap_or(self.created_at_ms),
        )
        .ok()?;
        Some(Timing {
            calendar,
            start_at_ms,
            end_at_ms,
            catchup: spec.catchup,
            created_at_ms: self.created_at_ms,
        })
    }
}
