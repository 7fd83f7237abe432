//! Sources: delay requests consumed from another message queue (DESIGN.md §11). A request is an ordinary
//! message of that MQ whose headers say when and where; a source turns each into a message (or a cancel,
//! or a dead letter) through the same intake as the HTTP API, and acknowledges it to its MQ only after
//! the group commit holding it returned from `fdatasync`.
//!
//! Each MQ's [`Transport`] only connects, receives and acknowledges; [`SourceRunner`] does the rest, the
//! same for every MQ.
//!
//! Invariants:
//! - A request is acknowledged only once what it asked for is durable: its message or cancel in the log,
//!   or its dead letter in the broker (`$dead`). One group commit per batch of requests.
//! - A request the MQ delivers again (a crash between the fsync and the ack) is not scheduled twice. Each
//!   message records where its request was (the header `delayd-source-position`, `{source}/{position}`);
//!   the runner remembers the positions written and not yet acknowledged, and keeps them on disk with
//!   a seq below which every other record of the source was acknowledged (mark.rs); on a cluster
//!   member every member keeps them (state.rs), so a new leader's source knows them. At a start it
//!   reads back the positions (never the bodies) of the source's records from that seq on, which
//!   follows the log's end: what a start reads grows with what the source has not acknowledged, not
//!   with the store. A redelivered request is acknowledged without a second message.
//! - A position names the incarnation of what it is in (a JetStream stream's creation time, a Kafka
//!   partition's epoch): a stream or topic deleted and made again starts a new order, whose requests
//!   are neither taken for redeliveries of the old one's nor ordered against them.
//! - A request that cannot be scheduled (no or a bad time, no target, too large, a bad header) is never
//!   dropped and never delivered: it becomes a dead letter with the reason, and is acknowledged.
//! - An MQ that is away never stops delayd: the runner reconnects with backoff, and its connection
//!   state (connection.rs) shows it.
//!
//! Recurring requests (DESIGN.md §14; NATS ADR-51's recurring `Nats-Schedule` forms, see
//! [`recurring_timing`]) make or replace a recurring schedule (schedule/) rather than a message: the one
//! their transport names ([`Request::schedule_id`]; NATS: one per subject, nats.rs says how the id is
//! made). Its topic is the request's target, its body and headers the request's (the headers passed
//! on, as a message's), its key `delayd-key`, its sink the source's.
//! - A recurring request is put on its own, outside the batch's group commit, and is acknowledged with
//!   the batch once the put is durable (an op record through the WAL, as the HTTP API's `PUT`). One
//!   whose schedule is refused (a bad cron, zone or interval; a field a schedule refuses) is a dead
//!   letter with the reason, as any request that cannot be scheduled.
//! - A redelivered recurring request changes nothing. Its position is remembered as a message's (with
//!   the seq the log had filed once its op was: no record carries the position), so that a redelivery
//!   the runner recognises is not put again (which would restart an interval's phase, or put back for
//!   a while a definition a later request on the subject replaced). One it does not recognise (a crash
//!   before the mark was saved) is put again: a definition equal to the schedule's writes nothing, and
//!   the MQ delivers again in order, so the subject's last request is its schedule in the end.

pub mod amqp;
mod config;
pub mod kafka;
pub(crate) mod mark;
pub mod nats;
pub mod redis;
pub mod state;

pub use config::{default_group, SourceContext, SourceShared, UnusedSourceKeys};
pub use state::{StateFileError, StateFiles};

use crate::connection::ConnectionState;
use crate::intake::{
    delay_from_text, deliver_at_from_text, Draft, Intake, MessageKey, Rejection, MAX_KEY_BYTES,
};
use crate::mq::{MqError, EXCHANGE_HEADER};
use crate::schedule::{Put, PutSchedule, ScheduleError, Schedules};
use crate::scheduler::{CancelError, BODY_BYTES_HEADER, DEAD_ON_ARRIVAL_HEADER};
use base64::Engine;
use futures_core::future::BoxFuture;
use mark::Mark;
use schedulelog::{EncodedMessage, MessageRef};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The header recording where a message's request was in its source.
pub const POSITION_HEADER: &str = "delayd-source-position";

/// One request as read from an MQ.
#[derive(Debug, Clone)]
pub struct Request {
    /// Where it is in its source (Redis entry id, JetStream stream sequence, an AMQP `message_id`):
    /// what a redelivery is recognised by. `None` when the MQ gives nothing stable (an AMQP message
    /// without `message_id`): such a request, delivered again after a crash, is scheduled again.
    pub position: Option<String>,
    /// What the transport acknowledges it by (Redis: the entry id; AMQP: the delivery tag; NATS: the
    /// reply subject).
    pub receipt: String,
    /// Its headers (Redis: the entry's fields other than `body`), in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Why the transport could not read it as a request (say, a header that is not UTF-8): a dead letter.
    pub unreadable: Option<String>,
    /// The target when no header names one (AMQP: the routing key it was published with, as the
    /// delayed-message exchange routes it).
    pub default_target: Option<String>,
    /// The key when no header gives one (Kafka: the record's key).
    pub default_key: Option<String>,
    /// The recurring schedule a recurring request (`Nats-Schedule: @every 5m`, a cron) makes or
    /// replaces (NATS: one per subject, nats.rs). `None` where the MQ names none: such a request is a
    /// dead letter.
    pub schedule_id: Option<String>,
}

impl Request {
    /// Makes the request a dead letter for `why` (added to any reason it has already).
    pub fn refuse(&mut self, why: String) {
        self.unreadable = Some(match self.unreadable.take() {
            Some(before) => format!("{before}; {why}"),
            None => why,
        });
    }

    /// Keeps a header whose value is not text (not UTF-8) as `NAME.base64`, its bytes in standard
    /// base64, and makes the request a dead letter that says so: delayd carries text headers only.
    pub fn keep_binary_header(&mut self, name: &str, value: &[u8]) {
        let kept = format!("{name}.base64");
        let encoded = base64::engine::general_purpose::STANDARD.encode(value);
        self.refuse(format!(
            "header {name:?} is not UTF-8 (the dead letter keeps it as {kept})"
        ));
        self.headers.push((kept, encoded));
    }
}

/// A transport's failure: the connection is dropped and made again, with backoff.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TransportError(pub String);

impl From<MqError> for TransportError {
    fn from(error: MqError) -> TransportError {
        TransportError(error.0)
    }
}

/// What [`Transport::receive`] gives: the requests received.
pub type Received<'a> = BoxFuture<'a, Result<Vec<Request>, TransportError>>;

/// What [`Transport::ack`] and [`Transport::flush`] give: the receipts acknowledged.
pub type Acked<'a> = BoxFuture<'a, Result<Vec<String>, TransportError>>;

/// What a transport holds while it is connected, or the error of a call that needs it before
/// `connect` made it (or after it was dropped).
pub fn connected<T>(held: Option<T>) -> Result<T, TransportError> {
    held.ok_or_else(|| TransportError("not connected".into()))
}

/// What an MQ must do for a source.
pub trait Transport: Send + Sync + std::fmt::Debug + 'static {
    /// Connects (again); afterwards `receive` first returns the requests delivered to this consumer before
    /// and not acknowledged.
    fn connect(&mut self) -> BoxFuture<'_, Result<(), TransportError>>;
    /// At most `max` requests, waiting up to `wait` for the first; none when there were none.
    fn receive(&mut self, max: usize, wait: Duration) -> Received<'_>;
    /// Acknowledges requests to the MQ by their receipts: it will not deliver them again. Returns the
    /// receipts acknowledged now: all of these, for a transport that acknowledges at once; a transport
    /// whose acknowledgement is costly (Kafka's offset commit) may put some off and return them from
    /// a later call, or from [`Transport::flush`].
    fn ack<'a>(&'a mut self, receipts: &'a [String]) -> Acked<'a>;
    /// Acknowledges what `ack` put off, now (the source is idle, or stops); returns those receipts.
    fn flush(&mut self) -> Acked<'_> {
        Box::pin(async { Ok(Vec::new()) })
    }
    /// After a failed write: the requests not acknowledged are to be received again.
    fn rewind(&mut self);
    /// How long after a (re)connect the MQ has delivered again everything delivered before and not
    /// acknowledged. Positions remembered from before a connect and not seen again by then were
    /// acknowledged after all (an ack whose reply was lost, or records read back at a start), and are
    /// forgotten, so that the mark moves on.
    fn redelivery_window(&self) -> Duration {
        Duration::from_secs(10)
    }
    /// Whether a later request of one place of this MQ (a stream, a partition) has a position that
    /// sorts after an earlier one's ([`ordered`]): what lets a cancel the MQ delivers again leave alone
    /// the message a later request gave its key. False (the default) for an MQ whose positions are
    /// names the publisher chose (an AMQP `message_id`).
    fn ordered_positions(&self) -> bool {
        false
    }
}

/// What a request asks for.
#[derive(Debug)]
enum Action {
    Schedule {
        deliver_at_ms: i64,
        target: String,
        key: Option<String>,
        headers: Vec<(String, String)>,
    },
    Cancel {
        target: String,
        key: String,
    },
    /// Make or replace a recurring schedule.
    Recurring(Box<Recurring>),
    Dead(Rejection),
}

/// What a recurring request asks for: a schedule, but for the sink (the source's).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Recurring {
    id: String,
    timing: RecurringTiming,
    target: String,
    key: Option<String>,
    /// The headers passed on; the values of a name given more than once joined by `,`.
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

impl Recurring {
    /// The schedule, for `sink`: a body that is not UTF-8 goes as `body_base64`.
    fn put(self, sink: &str) -> PutSchedule {
        let (body, body_base64) = match String::from_utf8(self.body) {
            Ok(text) => (Some(text), None),
            Err(bytes) => (
                None,
                Some(base64::engine::general_purpose::STANDARD.encode(bytes.as_bytes())),
            ),
        };
        PutSchedule {
            cron: self.timing.cron,
            every: self.timing.every,
            tz: self.timing.tz,
            topic: self.target,
            body,
            body_base64,
            headers: self.headers,
            key: self.key,
            sink: Some(sink.to_string()),
            start_at: None,
            end_at: None,
            catchup: Default::default(),
        }
    }
}

/// A recurring `Nats-Schedule` as a schedule's timing fields (exactly one of `cron` and `every`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecurringTiming {
    pub cron: Option<String>,
    pub every: Option<String>,
    pub tz: Option<String>,
}

/// The header that names a recurring schedule's time zone (ADR-51; a cron's only).
const TIME_ZONE_HEADER: &str = "Nats-Schedule-Time-Zone";

/// Headers a request's meaning is read from, which are not passed on.
fn consumed(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower.starts_with("delayd-")
        || matches!(
            lower.as_str(),
            "x-delay"
                | "nats-schedule"
                | "nats-schedule-target"
                | "nats-schedule-time-zone"
                | "scheduler-epoch"
                | "scheduler-target-topic"
                | "scheduler-target-key"
        )
}

/// A request's header, by a name matched without regard to case, trimmed.
fn header<'r>(request: &'r Request, name: &str) -> Option<&'r str> {
    request
        .headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim())
}

/// Where a request wants its message delivered (empty: nowhere).
fn target_of(request: &Request) -> Option<&str> {
    header(request, "delayd-target")
        .or_else(|| header(request, "Nats-Schedule-Target"))
        .or_else(|| header(request, "scheduler-target-topic"))
        .or(request.default_target.as_deref())
}

/// Reads a request's headers (DESIGN.md §11): when, where, key, cancel. `now_ms` anchors delays.
fn classify(request: &Request, now_ms: i64) -> Action {
    if let Some(why) = &request.unreadable {
        return Action::Dead(Rejection::new("invalid_header", why.clone()));
    }
    let get = |name: &str| header(request, name);
    let target = target_of(request);
    let key = get("delayd-key")
        .or_else(|| get("scheduler-target-key"))
        .or(request.default_key.as_deref());
    let Some(target) = target.filter(|t| !t.is_empty()) else {
        return Action::Dead(Rejection::new(
            "missing_target",
            "give delayd-target: where to deliver the message",
        ));
    };
    if get("delayd-cancel").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return match key {
            Some(key) if !key.is_empty() => Action::Cancel {
                target: target.to_string(),
                key: key.to_string(),
            },
            _ => Action::Dead(Rejection::new(
                "invalid_key",
                "a cancel needs delayd-key (with delayd-target)",
            )),
        };
    }
    let times: Vec<(&str, &str)> = [
        "delayd-deliver-at",
        "delayd-delay",
        "x-delay",
        "Nats-Schedule",
        "scheduler-epoch",
    ]
    .into_iter()
    .filter_map(|name| get(name).map(|v| (name, v)))
    .collect();
    let deliver_at_ms = match times[..] {
        [] => {
            return Action::Dead(Rejection::new(
                "missing_deliver_time",
                "give one of delayd-deliver-at or delayd-delay",
            ))
        }
        // ADR-51's forms other than the one-off `@at`.
        [("Nats-Schedule", value)] if !is_at(value) => {
            return recurring(request, target, key, value)
        }
        [(name, value)] => match when(name, value, now_ms) {
            Ok(at) => at,
            Err(rejection) => return Action::Dead(rejection),
        },
        _ => {
            return Action::Dead(Rejection::new(
                "conflicting_time_fields",
                format!(
                    "give exactly one delivery time, not {}",
                    times.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
                ),
            ))
        }
    };
    if get(TIME_ZONE_HEADER).is_some() {
        return Action::Dead(zone_without_cron());
    }
    Action::Schedule {
        deliver_at_ms,
        target: target.to_string(),
        key: key.filter(|k| !k.is_empty()).map(str::to_string),
        headers: passed_on(request),
    }
}

/// A request's headers that are passed on to what it schedules: all but those its meaning is read
/// from, and `delayd-exchange` (trimmed), which the AMQP sink reads.
fn passed_on(request: &Request) -> Vec<(String, String)> {
    request
        .headers
        .iter()
        .filter(|(name, _)| !consumed(name) || name.eq_ignore_ascii_case(EXCHANGE_HEADER))
        .map(
            |(name, value)| match name.eq_ignore_ascii_case(EXCHANGE_HEADER) {
                true => (EXCHANGE_HEADER.to_string(), value.trim().to_string()),
                false => (name.clone(), value.clone()),
            },
        )
        .collect()
}

fn zone_without_cron() -> Rejection {
    Rejection::new(
        "invalid_tz",
        "Nats-Schedule-Time-Zone applies to a cron Nats-Schedule only (as in ADR-51)",
    )
}

/// A recurring request (`schedule`: its `Nats-Schedule`, not `@at`): the schedule it makes or replaces.
/// Its timing is checked where the schedule is (`PutSchedule::check`), with its other fields.
fn recurring(request: &Request, target: &str, key: Option<&str>, schedule: &str) -> Action {
    let Some(id) = &request.schedule_id else {
        return Action::Dead(Rejection::new(
            "invalid_deliver_at",
            format!("Nats-Schedule {schedule:?}: a recurring schedule is taken from a NATS source only (one per subject); a one-off delivery time is \"@at <RFC 3339 time>\""),
        ));
    };
    let timing = match recurring_timing(schedule, header(request, TIME_ZONE_HEADER)) {
        Ok(timing) => timing,
        Err(rejection) => return Action::Dead(rejection),
    };
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in passed_on(request) {
        match headers.get_mut(&name) {
            Some(joined) => {
                joined.push(',');
                joined.push_str(&value);
            }
            None => {
                headers.insert(name, value);
            }
        }
    }
    Action::Recurring(Box::new(Recurring {
        id: id.clone(),
        timing,
        target: target.to_string(),
        key: key.filter(|k| !k.is_empty()).map(str::to_string),
        headers,
        body: request.body.clone(),
    }))
}

/// ADR-51's recurring `Nats-Schedule` forms as a schedule's timing, with `Nats-Schedule-Time-Zone`
/// (`tz`):
/// - `@every <Go duration>` (`30s`, `5m`, `1h30m`, `1.5h`, `1500ms`; whole milliseconds, at least 1 s)
///   is an `every` (`1h30m` is `90m`); it takes no time zone.
/// - `@yearly` (`@annually`), `@monthly`, `@weekly`, `@daily` (`@midnight`), `@hourly` are a `cron`.
/// - Anything else is a cron of 6 fields, seconds first (`0 0 9 * * *`; day and month names, ranges,
///   lists, steps); a 5-field one, which ADR-51 does not take, is refused rather than read minute first.
///
/// A time zone applies to a cron only (an IANA name; `UTC` without one). What the cron or the zone
/// say is checked with the schedule (`invalid_cron`, `invalid_tz`); a malformed `@every` is refused here
/// (`invalid_every`).
pub fn recurring_timing(schedule: &str, tz: Option<&str>) -> Result<RecurringTiming, Rejection> {
    let schedule = schedule.trim();
    if let Some(duration) = schedule.strip_prefix("@every") {
        if tz.is_some() {
            return Err(zone_without_cron());
        }
        let duration = duration.trim();
        let ms = go_duration_ms(duration).map_err(|why| {
            Rejection::new(
                "invalid_every",
                format!("Nats-Schedule {schedule:?}: {duration:?} {why}"),
            )
        })?;
        return Ok(RecurringTiming {
            cron: None,
            every: Some(every_text(ms)),
            tz: None,
        });
    }
    let fields = schedule.split_whitespace().count();
    if !schedule.starts_with('@') && fields != 6 {
        return Err(Rejection::new(
            "invalid_cron",
            format!("Nats-Schedule {schedule:?}: a cron has 6 fields, seconds first (0 0 9 * * *), an interval is \"@every 5m\""),
        ));
    }
    Ok(RecurringTiming {
        cron: Some(schedule.to_string()),
        every: None,
        tz: tz.map(str::to_string),
    })
}

/// A Go duration (`time.ParseDuration`: `300ms`, `1.5h`, `2h45m`; units `ns`, `us`, `µs`, `ms`, `s`,
/// `m`, `h`) in whole milliseconds; why not.
fn go_duration_ms(text: &str) -> Result<i64, &'static str> {
    const NOT: &str = "is not a Go duration such as 30s, 5m or 1h30m";
    const TOO_LONG: &str = "is too long";
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest.starts_with('-') {
        return Err("is negative");
    }
    if rest == "0" {
        return Ok(0);
    }
    if rest.is_empty() {
        return Err(NOT);
    }
    let digits_end = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    // Nanoseconds, and whether a fraction left some of a nanosecond out.
    let (mut ns, mut exact) = (0u128, true);
    while !rest.is_empty() {
        let (whole, after) = rest.split_at(digits_end(rest));
        let (fraction, after) = match after.strip_prefix('.') {
            Some(after) => after.split_at(digits_end(after)),
            None => ("", after),
        };
        if whole.is_empty() && fraction.is_empty() {
            return Err(NOT);
        }
        let unit_end = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_end);
        let unit_ns: u128 = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err("has a number without a unit"),
            _ => return Err(NOT),
        };
        let whole: u128 = match whole {
            "" => 0,
            digits => digits.parse().map_err(|_| TOO_LONG)?,
        };
        ns = whole
            .checked_mul(unit_ns)
            .and_then(|part| ns.checked_add(part))
            .ok_or(TOO_LONG)?;
        if !fraction.is_empty() {
            let digits = u32::try_from(fraction.len()).map_err(|_| NOT)?;
            let scale = 10u128.checked_pow(digits).ok_or(NOT)?;
            let scaled = fraction
                .parse::<u128>()
                .ok()
                .and_then(|f| f.checked_mul(unit_ns))
                .ok_or(NOT)?;
            exact &= scaled % scale == 0;
            ns = ns.checked_add(scaled / scale).ok_or(TOO_LONG)?;
        }
        rest = after;
    }
    // Go's limit: an i64 of nanoseconds, about 292 years.
    if ns > i64::MAX as u128 {
        return Err(TOO_LONG);
    }
    if !exact || ns % 1_000_000 != 0 {
        return Err("is not a whole number of milliseconds");
    }
    i64::try_from(ns / 1_000_000).map_err(|_| TOO_LONG)
}

/// An interval of whole milliseconds as a schedule's `every`, in its largest whole unit (`90m`, `1500ms`).
fn every_text(ms: i64) -> String {
    let units = [("h", 3_600_000), ("m", 60_000), ("s", 1_000)];
    match units.iter().find(|(_, size)| ms != 0 && ms % size == 0) {
        Some((unit, size)) => format!("{}{unit}", ms / size),
        None => format!("{ms}ms"),
    }
}

/// Whether a `Nats-Schedule` value is ADR-51's one-off form, `@at <time>` (any case).
fn is_at(value: &str) -> bool {
    value
        .get(..3)
        .is_some_and(|at| at.eq_ignore_ascii_case("@at"))
}

/// A delivery time from one of the time headers.
fn when(name: &str, value: &str, now_ms: i64) -> Result<i64, Rejection> {
    let after =
        |d: Duration| now_ms.saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    match name {
        "delayd-deliver-at" => deliver_at_from_text(value),
        "delayd-delay" => delay_from_text(value).map(after),
        // As the delayed-message exchange reads it: integer milliseconds; 0 or less is now.
        "x-delay" => value
            .parse::<f64>()
            .ok()
            .filter(|ms| ms.is_finite())
            .map(|ms| now_ms.saturating_add(ms.max(0.0).min(i64::MAX as f64) as i64))
            .ok_or_else(|| Rejection::new("invalid_delay", format!("x-delay {value:?} is not a number of milliseconds"))),
        "Nats-Schedule" => (is_at(value).then(|| &value[3..]))
            .filter(|rest| rest.starts_with(' '))
            .map(str::trim)
            .ok_or_else(|| Rejection::new("invalid_deliver_at", format!("Nats-Schedule {value:?}: only \"@at <RFC 3339 time>\" is a one-off delivery time")))
            .and_then(deliver_at_from_text),
        "scheduler-epoch" => value
            .parse::<i64>()
            .ok()
            .and_then(|s| s.checked_mul(1000))
            .filter(|ms| *ms >= 0)
            .ok_or_else(|| Rejection::new("invalid_deliver_at", format!("scheduler-epoch {value:?} is not unix seconds"))),
        _ => Err(Rejection::new("invalid_deliver_at", name.to_string())),
    }
}

/// A message of a batch on its way to the log: the request's index, its idempotency key if keyed, and
/// the message.
type Pending = (usize, Option<MessageKey>, EncodedMessage);

/// How a request ended, as counted in `delayd_source_messages_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Scheduled,
    Duplicate,
    Cancelled,
    /// Made or replaced a recurring schedule.
    Recurring,
    Dead,
}

impl Outcome {
    const ALL: [Outcome; 5] = [
        Outcome::Scheduled,
        Outcome::Duplicate,
        Outcome::Cancelled,
        Outcome::Recurring,
        Outcome::Dead,
    ];

    fn label(self) -> &'static str {
        match self {
            Outcome::Scheduled => "scheduled",
            Outcome::Duplicate => "duplicate",
            Outcome::Cancelled => "cancelled",
            Outcome::Recurring => "recurring",
            Outcome::Dead => "dead",
        }
    }
}

/// A batch could not be made durable: nothing of it is acknowledged, and the requests are received again.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct NotStored(String);

/// The runner's settings.
#[derive(Debug, Clone)]
pub struct SourceSettings {
    pub name: String,
    /// The sink that delivers what this source schedules.
    pub sink: String,
    /// Requests per batch (one group commit) at most.
    pub batch: usize,
    /// Where its mark is kept (`sources/{name}`): on a cluster member, on every member.
    pub files: StateFiles,
    /// The term's recurring schedules, which recurring requests put.
    pub schedules: Arc<Schedules>,
}

/// Runs one source: receive, schedule, acknowledge; reconnect when the MQ goes away.
///
/// Batches go through it as a pipeline of three: while one batch is made durable, the one before it is
/// acknowledged and the one after it is received (what the MQ has at hand, without waiting), so that a
/// source waits for its MQ and for the disk at the same time rather than one after the other.
#[derive(Debug)]
pub struct SourceRunner {
    transport: Box<dyn Transport>,
    writer: Writer,
    /// When the current connection was made (with `redelivery_window`: see [`Transport`]).
    connected_at: Option<Instant>,
    /// Before the next connection attempt, after a failure.
    pause: Duration,
}

/// Makes a source's batches durable and remembers where their requests were.
#[derive(Debug)]
struct Writer {
    settings: SourceSettings,
    intake: Arc<Intake>,
    connection: ConnectionState,
    /// Whether the MQ's positions are ordered ([`Transport::ordered_positions`]).
    ordered: bool,
    /// Positions written and not yet acknowledged, with the seq of their record and when they were
    /// written (or read back at the start).
    unacked: HashMap<String, (u64, Instant)>,
    /// Receipts handed to the transport to acknowledge and not confirmed yet, with their requests'
    /// positions (this connection's: cleared at a connect).
    awaiting: HashMap<String, Option<String>>,
    /// The records of this source from this seq on are to be read back before the first connection
    /// (the mark's `below` at the start), `None` once they were.
    read_back_from: Option<u64>,
    /// The mark's `below` stays here: a read-back failed, and the next start must try it again.
    below_floor: Option<u64>,
    /// The mark is to be written at the next save: `unacked` changed since it was last written (or a
    /// stop wants the last state kept).
    unsaved: bool,
    /// The `below` of the mark last written, and when.
    saved_below: u64,
    mark_written_at: Instant,
    /// When a save was last due (sources save once a second at most).
    mark_checked_at: Instant,
    /// Every record this source wrote has a seq below this.
    last_written: u64,
}

const FIRST_PAUSE: Duration = Duration::from_millis(100);

/// How long a stop waits for the MQ to confirm the last acknowledgements (a Kafka commit, an AMQP
/// confirmation): well within the 60 s a service manager gives the whole stop.
const STOP_ACK_WAIT: Duration = Duration::from_secs(5);

impl SourceRunner {
    /// Loads the source's mark (blocking: call it off the async threads). A mark that cannot be read
    /// is an error naming its file; so is a first mark that cannot be saved (on a cluster member: one
    /// the cluster did not take, this member no longer leading, say).
    pub fn open(
        settings: SourceSettings,
        intake: Arc<Intake>,
        connection: ConnectionState,
        transport: Box<dyn Transport>,
    ) -> anyhow::Result<SourceRunner> {
        let (saved, read_back_from) = match mark::read(&settings.files, &settings.name)? {
            Some(saved) => {
                let below = saved.below;
                (saved, Some(below))
            }
            None => {
                // Never ran: no record of it exists, nothing to read back.
                let new = Mark {
                    below: intake.log.filed_below(),
                    unacked: Vec::new(),
                };
                mark::save(&settings.files, &settings.name, &new)
                    .map_err(|e| anyhow::anyhow!("saving the source's first mark: {e}"))?;
                (new, None)
            }
        };
        let now = Instant::now();
        let unacked: HashMap<String, (u64, Instant)> = saved
            .unacked
            .into_iter()
            .map(|(position, seq)| (position, (seq, now)))
            .collect();
        for outcome in Outcome::ALL {
            metrics::counter!("delayd_source_messages_total", "source" => settings.name.clone(), "outcome" => outcome.label()).absolute(0);
        }
        Ok(SourceRunner {
            writer: Writer {
                settings,
                intake,
                connection,
                ordered: transport.ordered_positions(),
                awaiting: HashMap::new(),
                last_written: unacked.values().map(|(seq, _)| seq + 1).max().unwrap_or(0),
                unacked,
                read_back_from,
                below_floor: None,
                unsaved: false,
                saved_below: saved.below,
                mark_written_at: now,
                mark_checked_at: now,
            },
            transport,
            connected_at: None,
            pause: FIRST_PAUSE,
        })
    }

    /// Runs until `stop` says so. A failure (to connect, receive or acknowledge) drops the connection
    /// and makes it again after a pause that doubles up to 5 s, and is reset by a round that worked.
    pub async fn run(mut self, mut stop: tokio::sync::watch::Receiver<bool>) {
        if !self.writer.read_back(&mut stop).await {
            return;
        }
        while !*stop.borrow() {
            let served = tokio::select! {
                connected = self.transport.connect() => match connected {
                    Ok(()) => {
                        self.connected_at = Some(Instant::now());
                        // A receipt is the connection's; what it did not confirm comes again.
                        self.writer.awaiting.clear();
                        self.serve(&mut stop).await
                    }
                    Err(e) => Err(e),
                },
                _ = stop.changed() => break,
            };
            if let Err(e) = served {
                self.writer
                    .connection
                    .down(self.writer.intake.clock.now_ms(), &e.0);
                if *stop.borrow() {
                    break;
                }
                // The mark follows the log while the MQ is away, so that a restart reads back little.
                if self.writer.mark_checked_at.elapsed() >= Duration::from_secs(1) {
                    self.writer.save_mark().await;
                }
                tokio::select! {
                    _ = tokio::time::sleep(self.pause) => {},
                    _ = stop.changed() => break,
                }
                self.pause = (self.pause * 2).min(Duration::from_secs(5));
            }
        }
        // The last state, for the next start to read back as little as possible.
        self.writer.unsaved = true;
        self.writer.save_mark().await;
    }

    /// Forgets the positions written before the current connection once the MQ has had its
    /// `redelivery_window` to deliver them again (see [`Transport::redelivery_window`]).
    ///
    /// Only after a receive that began once the window was over: a redelivery comes with a receive, and
    /// one begun earlier (before a long batch, say) may not have asked for it yet.
    fn forget_redelivered_window(&mut self, receive_began: Instant) {
        let writer = &mut self.writer;
        if let Some(connected_at) = self.connected_at {
            if receive_began >= connected_at + self.transport.redelivery_window() {
                let before = writer.unacked.len();
                writer
                    .unacked
                    .retain(|_, (_, since)| *since >= connected_at);
                writer.unsaved |= writer.unacked.len() != before;
            }
        }
    }

    /// A round worked: the MQ is there.
    fn healthy(&mut self) {
        self.writer.connection.up();
        self.pause = FIRST_PAUSE;
    }

    /// Acknowledges a durable batch to the MQ, and forgets the positions of what the MQ confirmed: it
    /// will not deliver those again. With `flush`, also what the transport put off.
    async fn acknowledge(
        &mut self,
        durable: &mut Vec<Request>,
        flush: bool,
    ) -> Result<(), TransportError> {
        let began = Instant::now();
        if !durable.is_empty() {
            self.writer.awaiting(durable);
            let confirmed = self.transport.ack(&receipts(durable)).await?;
            self.writer.acked(&confirmed);
            durable.clear();
        }
        if flush && !self.writer.awaiting.is_empty() {
            let confirmed = self.transport.flush().await?;
            self.writer.acked(&confirmed);
        }
        tracing::trace!(source = %self.writer.settings.name, acked_us = began.elapsed().as_micros() as u64, "acknowledged");
        Ok(())
    }

    /// At a stop: acknowledges what is durable, and what the transport put off, within
    /// [`STOP_ACK_WAIT`]. A stop does not wait for an MQ that is away: what it did not confirm is
    /// delivered again after the restart, and recognised.
    async fn acknowledge_at_stop(
        &mut self,
        durable: &mut Vec<Request>,
    ) -> Result<(), TransportError> {
        match tokio::time::timeout(STOP_ACK_WAIT, self.acknowledge(durable, true)).await {
            Ok(acknowledged) => acknowledged,
            Err(_) => {
                tracing::warn!(source = %self.writer.settings.name, "the MQ did not confirm the acknowledgements within {STOP_ACK_WAIT:?} of the stop; what it did not confirm is delivered again after the restart, and recognised");
                Ok(())
            }
        }
    }

    /// Receives and handles batches until the connection fails or `stop` says so.
    async fn serve(
        &mut self,
        stop: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), TransportError> {
        // Received and not yet handled; durable and not yet acknowledged.
        let mut received: Vec<Request> = Vec::new();
        let mut durable: Vec<Request> = Vec::new();
        loop {
            if *stop.borrow() {
                // What was read ahead too, rather than leave it to the MQ's redelivery (NATS: after
                // ack_wait); what cannot be stored now is read again after the restart.
                if !received.is_empty() {
                    match self.writer.handle(&received).await {
                        Ok(()) => durable.append(&mut received),
                        Err(NotStored(why)) => {
                            tracing::warn!(source = %self.writer.settings.name, %why, "requests read ahead not stored at the stop; they will be received again")
                        }
                    }
                }
                return self.acknowledge_at_stop(&mut durable).await;
            }
            if received.is_empty() {
                // Nothing to do meanwhile: acknowledge, then wait for requests.
                self.acknowledge(&mut durable, false).await?;
                let receive_began = Instant::now();
                received = tokio::select! {
                    received = self.transport.receive(self.writer.settings.batch, Duration::from_secs(1)) => received?,
                    // What the transport put off is acknowledged before the stop.
                    _ = stop.changed() => return self.acknowledge_at_stop(&mut durable).await,
                };
                if received.is_empty() {
                    // Idle: what the transport put off is acknowledged now.
                    self.acknowledge(&mut durable, true).await?;
                    self.healthy();
                    self.forget_redelivered_window(receive_began);
                    self.writer.save_mark().await;
                    continue;
                }
            }
            let batch = std::mem::take(&mut received);
            let began = Instant::now();
            let max = self.writer.settings.batch;
            let transport = &mut self.transport;
            self.writer.awaiting(&durable);
            let (handled, (acked, next)) = tokio::join!(self.writer.handle(&batch), async {
                if durable.is_empty() {
                    return (Ok(Vec::new()), transport.receive(max, Duration::ZERO).await);
                }
                match transport.ack(&receipts(&durable)).await {
                    Ok(confirmed) => (Ok(confirmed), transport.receive(max, Duration::ZERO).await),
                    Err(e) => (Err(e), Ok(Vec::new())),
                }
            });
            self.writer.acked(&acked?);
            durable.clear();
            match handled {
                Ok(()) => {
                    tracing::trace!(source = %self.writer.settings.name, requests = batch.len(), joined_us = began.elapsed().as_micros() as u64, "batch stored, the one before acknowledged, the next read");
                    durable = batch;
                    received = next?;
                    self.healthy();
                    self.forget_redelivered_window(began);
                    // A source that is never idle saves it too, once a second.
                    if self.writer.mark_checked_at.elapsed() >= Duration::from_secs(1) {
                        self.writer.save_mark().await;
                    }
                }
                Err(NotStored(why)) => {
                    tracing::warn!(source = %self.writer.settings.name, %why, "requests not stored; they will be received again");
                    // The batch and the one received after it come round again.
                    next?;
                    self.transport.rewind();
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {},
                        _ = stop.changed() => return Ok(()),
                    }
                }
            }
        }
    }
}

fn receipts(batch: &[Request]) -> Vec<String> {
    batch.iter().map(|r| r.receipt.clone()).collect()
}

impl Writer {
    /// A durable batch is being acknowledged: which position each receipt stands for.
    fn awaiting(&mut self, batch: &[Request]) {
        for request in batch {
            self.awaiting
                .insert(request.receipt.clone(), request.position.clone());
        }
    }

    /// The MQ confirmed these receipts: it will not deliver their requests again.
    fn acked(&mut self, receipts: &[String]) {
        for receipt in receipts {
            if let Some(Some(position)) = self.awaiting.remove(receipt) {
                self.unsaved |= self.unacked.remove(&position).is_some();
            }
        }
    }

    /// Reads back the positions of the records this source wrote since its mark was saved, before
    /// the first connection: the MQ may deliver their requests again. Waits (saying so in its connection state)
    /// while a full disk holds the replayer up; false when `stop` said so meanwhile.
    async fn read_back(&mut self, stop: &mut tokio::sync::watch::Receiver<bool>) -> bool {
        let Some(from) = self.read_back_from else {
            return true;
        };
        let prefix = format!("{}/", self.settings.name);
        loop {
            let (log, sink, prefix) = (
                self.intake.log.clone(),
                self.settings.sink.clone(),
                prefix.clone(),
            );
            let source = self.settings.name.clone();
            let read = tokio::task::spawn_blocking(move || {
                let mut found = Vec::new();
                log.records_since(from, &sink, |meta| match meta {
                    Ok(meta) => {
                        if let (Some(position), 0) =
                            (position_of(&meta.headers, &prefix), meta.attempt)
                        {
                            found.push((position.to_string(), meta.seq));
                        }
                    }
                    // Its request, delivered again, is scheduled again: the record cannot be
                    // delivered either (delayd_unreadable_messages counts it).
                    Err(error) => {
                        tracing::error!(%source, %error, "a record this source may have written is unreadable; its request, if the MQ delivers it again, is scheduled again")
                    }
                })
                .map(|()| found)
            })
            .await;
            match read {
                Ok(Ok(found)) => {
                    let now = Instant::now();
                    for (position, seq) in found {
                        self.last_written = self.last_written.max(seq + 1);
                        self.unacked.insert(position, (seq, now));
                    }
                    break;
                }
                Ok(Err(schedulelog::Error::NotFiledYet { cause })) => {
                    let why = format!(
                        "waiting for the disk before reading back what this source wrote: {}",
                        cause.as_deref().unwrap_or("the log is behind")
                    );
                    self.connection.down(self.intake.clock.now_ms(), &why);
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {},
                        _ = stop.changed() => return false,
                    }
                }
                Ok(Err(error)) => {
                    self.read_back_failed(&error);
                    break;
                }
                Err(error) => {
                    self.read_back_failed(&error);
                    break;
                }
            }
        }
        self.read_back_from = None;
        if !self.unacked.is_empty() {
            tracing::info!(source = %self.settings.name, records = self.unacked.len(), "requests scheduled before the restart may be delivered again by the MQ; they will not be scheduled twice");
        }
        true
    }

    /// Makes a batch durable; then every request of it may be acknowledged.
    async fn handle(&mut self, requests: &[Request]) -> Result<(), NotStored> {
        let now = self.intake.clock.now_ms();
        let intake = self.intake.clone();
        let bytes: usize = requests.iter().map(|r| r.body.len()).sum();
        if self.intake.disk.admit(bytes).is_err() {
            return Err(NotStored(
                "the disk is nearly full (limits.min_free_disk_bytes)".into(),
            ));
        }
        // In stream order: messages go to the log together, in one group commit, up to a cancel, which
        // runs after the messages before it (a cancel then a new message with its key must leave the new
        // one pending); dead letters are stored at the end.
        let mut run: Vec<Pending> = Vec::new();
        let mut dead = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            if let Some(seen) = request
                .position
                .as_ref()
                .and_then(|p| self.unacked.get_mut(p))
            {
                // Delivered again: remembered until this delivery is acknowledged, not forgotten with
                // the positions of before the connect that never came again.
                seen.1 = Instant::now();
                self.count(Outcome::Duplicate, 1);
                continue;
            }
            match classify(request, now) {
                Action::Schedule {
                    deliver_at_ms,
                    target,
                    key,
                    mut headers,
                } => {
                    if let Some(position) = &request.position {
                        headers.push((
                            POSITION_HEADER.to_string(),
                            format!("{}/{position}", self.settings.name),
                        ));
                    }
                    let draft = Draft {
                        deliver_at_ms,
                        topic: &target,
                        key: key.as_deref(),
                        headers: headers
                            .iter()
                            .map(|(n, v)| (n.as_str(), v.as_str()))
                            .collect(),
                        sink: &self.settings.sink,
                        body: std::borrow::Cow::Borrowed(&request.body),
                        dedup: key.is_some(),
                    };
                    match draft
                        .check(&intake.admission, now)
                        .and_then(|()| draft.encode())
                    {
                        Ok(encoded) => {
                            let key = key.map(|key| MessageKey {
                                sink: self.settings.sink.clone(),
                                topic: target.clone(),
                                key,
                            });
                            run.push((i, key, encoded));
                        }
                        Err(rejection) => dead.push((i, rejection)),
                    }
                }
                Action::Cancel { target, key } => {
                    self.write_run(requests, std::mem::take(&mut run)).await?;
                    self.cancel(&target, &key, request.position.as_deref())
                        .await?;
                    self.count(Outcome::Cancelled, 1);
                }
                // On its own: nothing in the batch depends on a schedule, nor it on them.
                Action::Recurring(recurring) => match self.put_schedule(*recurring).await? {
                    Ok(outcome) => {
                        if let Some(position) = &request.position {
                            // The op is filed: its seq is this one or an earlier one.
                            let seq = self.intake.log.filed_below().saturating_sub(1);
                            self.remember(position, seq);
                        }
                        self.count(outcome, 1);
                    }
                    Err(rejection) => dead.push((i, rejection)),
                },
                Action::Dead(rejection) => dead.push((i, rejection)),
            }
        }
        self.write_run(requests, run).await?;
        if !dead.is_empty() {
            // Messages like any, dead on arrival (the lane makes them dead without delivering them):
            // listed, found by their ids and requeued like every dead letter.
            let letters = dead
                .iter()
                .map(|(i, why)| self.dead_letter(&requests[*i], why, now))
                .collect::<Result<_, _>>()?;
            let appended = self
                .intake
                .schedule(letters)
                .await
                .map_err(|e| NotStored(format!("storing dead letters: {e}")))?;
            for ((i, why), one) in dead.iter().zip(appended) {
                tracing::debug!(source = %self.settings.name, receipt = %requests[*i].receipt, id = %one.id, reason = %why, "request made a dead letter");
                self.written(&requests[*i], one.location.seq);
                self.count(Outcome::Dead, 1);
            }
        }
        Ok(())
    }

    /// Appends a run of messages in one group commit; a keyed one whose message is pending is a
    /// duplicate.
    async fn write_run(
        &mut self,
        requests: &[Request],
        run: Vec<Pending>,
    ) -> Result<(), NotStored> {
        if run.is_empty() {
            return Ok(());
        }
        let (indexes, messages): (Vec<usize>, Vec<_>) =
            run.into_iter().map(|(i, key, m)| (i, (key, m))).unzip();
        let appended = self
            .intake
            .schedule_all(messages)
            .await
            .map_err(|e| NotStored(e.to_string()))?;
        let mut scheduled = 0;
        for (i, one) in indexes.iter().zip(appended) {
            if let Some(one) = one {
                self.written(&requests[*i], one.location.seq);
                scheduled += 1;
            }
        }
        self.count(Outcome::Scheduled, scheduled);
        self.count(Outcome::Duplicate, indexes.len() as u64 - scheduled);
        Ok(())
    }

    /// Counts a request's outcome as soon as it is durable (a batch that fails later comes round again,
    /// and its written messages as duplicates).
    fn count(&self, outcome: Outcome, count: u64) {
        if count == 0 {
            return;
        }
        self.connection.handled(outcome.label(), count);
        metrics::counter!("delayd_source_messages_total", "source" => self.settings.name.clone(), "outcome" => outcome.label()).increment(count);
        if outcome == Outcome::Scheduled {
            metrics::counter!("delayd_messages_received_total", "sink" => self.settings.sink.clone())
                .increment(count);
        }
    }

    /// The read-back failed (not for want of room): the source goes on without those positions, and
    /// its mark stays where it was, so that the next start tries again.
    fn read_back_failed(&mut self, error: &dyn std::fmt::Display) {
        tracing::error!(source = %self.settings.name, %error, "reading back what this source wrote before the restart failed; requests the MQ delivers again may be scheduled twice");
        self.below_floor = self.read_back_from;
    }

    fn written(&mut self, request: &Request, seq: u64) {
        match &request.position {
            Some(position) => self.remember(position, seq),
            None => self.last_written = self.last_written.max(seq + 1),
        }
    }

    /// What a request at `position` asked for is durable, at `seq`: its delivery again is a duplicate.
    fn remember(&mut self, position: &str, seq: u64) {
        self.unacked
            .insert(position.to_string(), (seq, Instant::now()));
        self.unsaved = true;
        self.last_written = self.last_written.max(seq + 1);
    }

    /// Makes or replaces the schedule a recurring request asks for, durably: how the request ended
    /// (`duplicate` when the schedule has its definition already, which the put leaves as it is), or
    /// why it is a dead letter.
    async fn put_schedule(
        &self,
        recurring: Recurring,
    ) -> Result<Result<Outcome, Rejection>, NotStored> {
        let schedules = &self.settings.schedules;
        let id = recurring.id.clone();
        let put = recurring.put(&self.settings.sink);
        let unchanged = match schedules.put(&id, put).await {
            Ok((done, _)) => done == Put::Unchanged,
            // (Not found: written, and gone from the table by the time the put looked.)
            Err(ScheduleError::NotFound) => false,
            // Durable: the table holds it once the replayer catches up.
            Err(ScheduleError::NotFiled) => {
                tracing::warn!(source = %self.settings.name, schedule = %id, "a recurring request's schedule is durable but not filed yet");
                false
            }
            Err(ScheduleError::Rejected(rejection)) => return Ok(Err(rejection)),
            Err(ScheduleError::Append(error)) => {
                return Err(NotStored(format!("putting schedule {id}: {error}")))
            }
        };
        tracing::debug!(source = %self.settings.name, schedule = %id, unchanged, "recurring request put");
        Ok(Ok(match unchanged {
            true => Outcome::Duplicate,
            false => Outcome::Recurring,
        }))
    }

    /// Cancels the pending message with this target and key, if there is one; waits while an attempt of
    /// it is being delivered (that ends it either way).
    async fn cancel(
        &self,
        target: &str,
        key: &str,
        position: Option<&str>,
    ) -> Result<(), NotStored> {
        let key = MessageKey {
            sink: self.settings.sink.clone(),
            topic: target.to_string(),
            key: key.to_string(),
        };
        let pending = self.intake.pending_with_key(&key).await;
        let Some(id) = pending.map_err(|e| NotStored(e.to_string()))? else {
            return Ok(()); // none pending: delivered, cancelled, or never sent
        };
        // A cancel the MQ delivers again (a crash before its ack) must not cancel a message its key was
        // given after it: one whose request comes later in this source. Only a request not yet
        // acknowledged can be delivered again, and with it every later one (acknowledgements go in
        // stream order), so a later request is one still unacknowledged; and only positions of an
        // ordered MQ, in one place (a stream, a partition) of one incarnation, say what is later.
        if let Some(cancel_at) = position.filter(|_| self.ordered).and_then(ordered) {
            let status = self
                .intake
                .lookup(id)
                .await
                .map_err(|e| NotStored(e.to_string()))?;
            let prefix = format!("{}/", self.settings.name);
            let later = status.is_some_and(|status| {
                position_of(&status.message.headers, &prefix)
                    .filter(|at| self.unacked.contains_key(*at))
                    .and_then(ordered)
                    .is_some_and(|(place, at)| place == cancel_at.0 && at > cancel_at.1)
            });
            if later {
                return Ok(());
            }
        }
        // An attempt settles within its sink's timeout, normally; one that does not (its outcome
        // cannot be written: a full disk) sends the batch round again rather than stall the source.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.intake.scheduler.cancel(id).await {
                Ok(_)
                | Err(CancelError::NotFound)
                | Err(CancelError::AlreadyDelivered)
                | Err(CancelError::AlreadyDead) => return Ok(()),
                Err(CancelError::InFlight) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(NotStored(format!("cancelling {id}: {e}"))),
            }
        }
    }

    /// A request that cannot be scheduled as the message it asks for: a message due now, for this
    /// source's sink, marked dead on arrival with the reason, keeping the request's target (as its
    /// topic, when one fits), headers and body. A header value with control characters is kept with
    /// them escaped (`\u{1b}`); one that is not text is kept by the transport (as `NAME.base64`, or
    /// an AMQP table's rendering), and the reason names it. A body the log cannot hold is cut to
    /// `limits.max_message_bytes`, its length in `delayd-body-bytes`.
    fn dead_letter(
        &self,
        request: &Request,
        why: &Rejection,
        now_ms: i64,
    ) -> Result<EncodedMessage, NotStored> {
        let topic = target_of(request)
            .filter(|t| t.len() <= 255)
            .unwrap_or_default();
        // The key the request would have had: a requeued dead letter goes out with it.
        let key = (header(request, "delayd-key"))
            .or_else(|| header(request, "scheduler-target-key"))
            .or(request.default_key.as_deref())
            .filter(|key| !key.is_empty() && key.len() <= MAX_KEY_BYTES);
        let mut escaped = false;
        let mut headers: Vec<(String, String)> = (request.headers.iter())
            .filter(|(name, _)| {
                ![DEAD_ON_ARRIVAL_HEADER, POSITION_HEADER, BODY_BYTES_HEADER]
                    .iter()
                    .any(|ours| name.eq_ignore_ascii_case(ours))
            })
            .map(|(name, value)| {
                // Named and trimmed as the sinks look for it, as for a request taken (`classify`).
                let (name, value) = match name.eq_ignore_ascii_case(EXCHANGE_HEADER) {
                    true => (EXCHANGE_HEADER.to_string(), value.trim()),
                    false => (name.clone(), value.as_str()),
                };
                match value.chars().any(char::is_control) {
                    true => {
                        escaped = true;
                        (name, escape_controls(value))
                    }
                    false => (name, value.to_string()),
                }
            })
            .collect();
        let reason = match escaped {
            true => format!("{why} (header values with control characters are kept escaped)"),
            false => why.to_string(),
        };
        if let Some(position) = &request.position {
            headers.push((
                POSITION_HEADER.to_string(),
                format!("{}/{position}", self.settings.name),
            ));
        }
        headers.push((DEAD_ON_ARRIVAL_HEADER.to_string(), reason));
        let encode = |headers: &[(String, String)], body: &[u8]| {
            let headers: Vec<(&str, &str)> = (headers.iter())
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            MessageRef {
                deliver_at_ms: now_ms,
                topic,
                key,
                headers: &headers,
                sink: &self.settings.sink,
                body,
                retry_of: None,
                dedup: false,
            }
            .encode()
        };
        if let Ok(encoded) = encode(&headers, &request.body) {
            return Ok(encoded);
        }
        // Too large for the log: the body cut; then, if the headers are what is too large, only the
        // position and the reason, each cut to 1 KiB; then no body (a few KiB: always fits).
        let max = self.intake.admission.max_message_bytes;
        let cut = &request.body[..request.body.len().min(max)];
        let body_bytes = (
            BODY_BYTES_HEADER.to_string(),
            request.body.len().to_string(),
        );
        if cut.len() < request.body.len() {
            headers.push(body_bytes.clone());
            if let Ok(encoded) = encode(&headers, cut) {
                return Ok(encoded);
            }
        }
        let short = |value: &str| {
            let end = (0..=value.len().min(1024))
                .rev()
                .find(|&i| value.is_char_boundary(i))
                .unwrap_or(0);
            value[..end].to_string()
        };
        let minimal: Vec<(String, String)> = (headers.iter())
            .filter(|(name, _)| name == POSITION_HEADER || name == DEAD_ON_ARRIVAL_HEADER)
            .map(|(name, value)| (name.clone(), short(value)))
            .chain([body_bytes])
            .collect();
        encode(&minimal, cut)
            .or_else(|_| encode(&minimal, &[]))
            .map_err(|e| NotStored(format!("a dead letter does not fit the log: {e}")))
    }

    /// Saves the mark (after an empty receive, a second after the last save, while the MQ is away,
    /// and at the end) when what is unacknowledged changed, or the log's end moved on and the last
    /// write is 10 s old: a quiet source's mark follows the log without a write every second.
    async fn save_mark(&mut self) {
        self.mark_checked_at = Instant::now();
        if self.read_back_from.is_some() {
            return; // the positions since the mark are not known yet
        }
        let below = match self.below_floor {
            Some(floor) => floor,
            None => self.last_written.max(self.intake.log.filed_below()),
        };
        let moved =
            below != self.saved_below && self.mark_written_at.elapsed() >= Duration::from_secs(10);
        if !self.unsaved && !moved {
            return;
        }
        let mark = Mark {
            below,
            unacked: (self.unacked.iter())
                .map(|(position, (seq, _))| (position.clone(), *seq))
                .collect(),
        };
        // An fsync (on a cluster member, a round of Raft): off the async threads.
        let written = (self.settings.files)
            .replace_off_thread(self.settings.name.clone(), mark::encode(&mark))
            .await;
        match written {
            Ok(()) => {
                self.saved_below = below;
                self.unsaved = false;
                self.mark_written_at = Instant::now();
            }
            Err(error) => {
                // Tried again at the next save; the mark saved last stays right, only older.
                tracing::warn!(source = %self.settings.name, %error, "saving the source's mark failed; a start reads back more records until a save succeeds")
            }
        }
    }
}

/// A header value with its control characters escaped (`\u{1b}`): kept in a dead letter, where a
/// header may not hold them.
fn escape_controls(value: &str) -> String {
    value
        .chars()
        .map(|c| match c.is_control() {
            true => c.escape_unicode().to_string(),
            false => c.to_string(),
        })
        .collect()
}

/// The position a record's request had in this source, from its header (`prefix`: `{source}/`).
fn position_of<'h>(headers: &'h [(String, String)], prefix: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(name, _)| name == POSITION_HEADER)
        .and_then(|(_, value)| value.strip_prefix(prefix))
}

/// A position as where it is ordered and the numbers that order it there: a Redis entry id
/// `1700000000000-3` or a JetStream stream sequence (one order for the whole source), a Kafka
/// `topic/partition/offset` (an order per partition); `None` for one without an order (an AMQP
/// `message_id`).
fn ordered(position: &str) -> Option<(&str, Vec<u64>)> {
    let (place, at) = position.rsplit_once('/').unwrap_or(("", position));
    let numbers = at
        .split('-')
        .map(|part| part.parse().ok())
        .collect::<Option<_>>()?;
    Some((place, numbers))
}

#[cfg(test)]
mod tests;
