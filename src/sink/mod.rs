//! Sinks: where due messages go, and the per-sink policies that govern them.
//!
//! A sink answers every delivery of a batch, in order: delivered, retry (optionally after a given delay),
//! or dead. The scheduler does everything else: rate limits, in-flight caps, retries through the WAL,
//! outcome records. A sink never sees a message before its `deliver_at`.

pub mod amqp;
mod config;
pub mod kafka;
pub mod nats;
pub mod redis;
pub mod webhook;

pub use config::{
    check_targets, require_sink_url, LaneConfig, MqSinkConfig, SinkContext, UnusedSinkKeys,
};

use schedulelog::record::sink_tag;
use schedulelog::{Location, Message, MessageId};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// The future a [`Sink`] returns.
pub use futures_core::future::BoxFuture;

/// One message handed to a sink.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The stable id consumers deduplicate on.
    pub id: MessageId,
    /// Where this attempt is stored.
    pub location: Location,
    /// The message, including its attempt number and `deliver_at_ms`.
    pub message: Message,
    /// When the lane handed the attempt to the sink (clock ms): the time a sink that stamps a delivery
    /// (the broker's `delivered_at`) gives it, and the time its outcome records when delivered, so that
    /// one delivery has one `delivered_at` wherever it is read.
    pub sent_at_ms: i64,
}

/// A sink's answer for one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkOutcome {
    Delivered,
    /// Try again later: after `after` if given (e.g. an HTTP `Retry-After`), else after the sink's backoff.
    Retry {
        after: Option<Duration>,
        reason: String,
    },
    /// Never deliverable; the reason is kept in the message's status.
    Dead {
        reason: String,
    },
    /// A target the sink may not publish to ([`forbidden`]), refused before anything was sent: dead as
    /// for `Dead`, but it says nothing of whether the destination answers.
    Refused {
        reason: String,
    },
    /// Not taken for a reason of delayd's own, not the destination's (the built-in broker's disk is
    /// full or its files fail; a sink delivering in place panicked): the message goes back to the wheel,
    /// due after `after`, without using up an attempt or writing anything (a retry would copy the
    /// message through the WAL into a segment again).
    Postpone {
        after: Duration,
        reason: String,
    },
    /// The destination could not be reached to ask it (an MQ refused the connection, was not connected,
    /// or timed out before it answered): nothing was said about the message, so no attempt is used.
    /// The message goes back to the wheel, as for `Postpone`, after a backoff the lane keeps per sink
    /// (its `backoff`, at most [`UNREACHABLE_WAIT_MAX`]), growing while the destination stays away.
    /// Only an answer about a message (a nack, an unroutable return, `WRONGTYPE`) is a failed attempt.
    Unreachable {
        reason: String,
    },
}

/// Whether a message header goes on to the destination: delayd's own (`delayd-*`, which each sink
/// sets itself where it has them) do not, except the two a firing of a recurring schedule carries
/// (`delayd-schedule`, `delayd-fire-at`: DESIGN §14), which no message from outside may have.
pub fn passed_on(name: &str) -> bool {
    let own = name.len() >= 7 && name.as_bytes()[..7].eq_ignore_ascii_case(b"delayd-");
    !own || name.eq_ignore_ascii_case(schedulelog::SCHEDULE_HEADER)
        || name.eq_ignore_ascii_case(schedulelog::FIRE_AT_HEADER)
}

/// The longest a message waits for an unreachable destination before it is tried again.
pub const UNREACHABLE_WAIT_MAX: Duration = Duration::from_secs(30);

/// A destination for due messages.
pub trait Sink: Send + Sync + fmt::Debug + 'static {
    /// Delivers a batch; returns one outcome per delivery, in the same order.
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>>;

    /// Delivers a batch on the calling thread, a blocking-pool thread, as [`Sink::deliver`] would: one
    /// outcome per delivery, in order. `None` (the default) for a sink that does not, whose batch is
    /// then delivered through [`Sink::deliver`]. Only for a sink whose work is local and blocking (the
    /// built-in broker, which writes and syncs delayd's own disk): the lane calls it on the thread that
    /// has just read the batch, holding that thread and one of the sink's call slots until it returns,
    /// and saves two thread hand-overs on the way from due to stored, each a wait for a core when the
    /// cores are short. A panic in it postpones the whole batch by 5 s.
    fn deliver_blocking(&self, _batch: &[Delivery]) -> Option<Vec<SinkOutcome>> {
        None
    }

    /// Checks the connection to the destination when no delivery has lately (at the start, and every
    /// few seconds while the sink is idle: [`probe`]), so that what the sink says of it is true: an MQ
    /// sink connects, or makes a round trip on its connection, and marks its connection up or down. Does
    /// nothing by default (the broker and webhooks keep no connection).
    fn probe(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// The outcomes of `batch`, which this sink answered, are durable in the dispatch logs. Nothing
    /// by default; the broker, which keeps the deliveries it stored until then so that a crash in
    /// between does not store them twice (broker/outcomes.rs), lets them go. Called on a runtime
    /// thread: it must not block.
    fn outcomes_recorded(&self, _batch: &[&Delivery]) {}
}

/// How long a sink's connection may go unchecked before [`probe`] checks it.
pub const PROBE_IDLE: Duration = Duration::from_secs(2);

/// Probes each MQ sink whose connection nothing checked for [`PROBE_IDLE`] (at once at the start), together,
/// a probe at most 10 s, until the task is dropped.
pub async fn probe(sinks: Vec<(Arc<dyn Sink>, crate::connection::ConnectionState)>) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let due = sinks
            .iter()
            .filter(|(_, connection)| connection.checked_ago().is_none_or(|ago| ago >= PROBE_IDLE))
            .map(|(sink, _)| tokio::time::timeout(Duration::from_secs(10), sink.probe()));
        futures_util::future::join_all(due).await;
    }
}

/// The code of a refused target, first in a [`forbidden`] outcome's reason.
const FORBIDDEN_TARGET: &str = "forbidden_target";

/// A message whose target the sink may not publish to (`crate::mq::Targets`): dead, with the code
/// `forbidden_target` a request gets for it.
pub fn forbidden(why: &str) -> SinkOutcome {
    SinkOutcome::Refused {
        reason: format!("{FORBIDDEN_TARGET}: {why}"),
    }
}

/// Tells the state of an MQ sink's connection what a batch's outcomes say of it: down (and how many
/// deliveries wait) when some found the MQ unreachable and it took none; up when it answered for all,
/// or took some (those it did not answer for are counted as waiting).
fn report(connection: &crate::connection::ConnectionState, now_ms: i64, outcomes: &[SinkOutcome]) {
    let mut unreachable = outcomes.iter().filter_map(|o| match o {
        SinkOutcome::Unreachable { reason } => Some(reason),
        _ => None,
    });
    let took_some = outcomes.iter().any(|o| matches!(o, SinkOutcome::Delivered));
    match unreachable.next() {
        Some(reason) if !took_some => {
            connection.unreachable(now_ms, reason, 1 + unreachable.count())
        }
        Some(_) => {
            connection.up();
            connection.postponed(1 + unreachable.count());
        }
        None if !outcomes
            .iter()
            .all(|o| matches!(o, SinkOutcome::Refused { .. })) =>
        {
            connection.up()
        }
        None => {}
    }
}

/// What an MQ sink tells the state of its connection (`GET /v1/sinks`, `delayd_sink_connected`): each
/// batch's outcomes and each probe's answer, at the time its clock says, with its `kind` before the
/// reason (`redis: ...`). Every MQ sink delivers and probes through one, so that they say the same.
#[derive(Debug, Clone)]
pub struct Reporter {
    kind: &'static str,
    connection: crate::connection::ConnectionState,
    clock: Arc<dyn schedulelog::Clock>,
}

impl Reporter {
    pub fn new(
        kind: &'static str,
        connection: crate::connection::ConnectionState,
        clock: Arc<dyn schedulelog::Clock>,
    ) -> Reporter {
        Reporter {
            kind,
            connection,
            clock,
        }
    }

    /// The state of the connection it tells.
    pub fn connection(&self) -> &crate::connection::ConnectionState {
        &self.connection
    }

    /// A batch's outcomes, reported to the connection: those `send` gives, or, when the MQ could not
    /// be reached at all (`Err`), [`SinkOutcome::Unreachable`] for every delivery.
    pub async fn reported(
        &self,
        batch: &[Delivery],
        send: impl Future<Output = Result<Vec<SinkOutcome>, String>>,
    ) -> Vec<SinkOutcome> {
        let outcomes = send.await.unwrap_or_else(|error| {
            let unreachable = SinkOutcome::Unreachable {
                reason: format!("{}: {error}", self.kind),
            };
            vec![unreachable; batch.len()]
        });
        report(&self.connection, self.clock.now_ms(), &outcomes);
        outcomes
    }

    /// What a probe of the MQ (`ping`) found, told to the connection.
    pub async fn probed(&self, ping: impl Future<Output = Result<(), String>>) {
        match ping.await {
            Ok(()) => self.connection.up(),
            Err(error) => {
                let reason = format!("{}: {error}", self.kind);
                self.connection.down(self.clock.now_ms(), &reason)
            }
        }
    }
}

/// Exponential backoff with jitter: attempt `n` (0-based) waits `initial * multiplier^n`, capped, then
/// scaled by a random factor in [0.5, 1.0] so that retries of a burst spread out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub multiplier: f64,
    pub cap: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            initial: Duration::from_secs(1),
            multiplier: 2.0,
            cap: Duration::from_secs(3600),
        }
    }
}

impl Backoff {
    /// The delay before retry number `attempt + 1`; `unit` in [0, 1) is the random draw.
    pub fn delay(&self, attempt: u16, unit: f64) -> Duration {
        let exponential =
            self.initial.as_secs_f64() * self.multiplier.max(1.0).powi(i32::from(attempt));
        let capped = exponential.min(self.cap.as_secs_f64());
        Duration::from_secs_f64(capped * (0.5 + 0.5 * unit.clamp(0.0, 1.0)))
    }
}

/// How the scheduler treats one sink.
#[derive(Debug, Clone, PartialEq)]
pub struct SinkPolicy {
    /// Concurrent `deliver` calls at most.
    pub max_in_flight: usize,
    /// Deliveries per `deliver` call at most.
    pub max_batch: usize,
    /// Token-bucket rate limit in deliveries per second; `None` for none.
    pub rate_per_sec: Option<f64>,
    /// Deliveries allowed at once after an idle period (the bucket's size).
    pub burst: u32,
    /// Attempts in all, the first included; the last failure makes the message dead.
    pub max_attempts: u16,
    pub backoff: Backoff,
}

impl Default for SinkPolicy {
    fn default() -> SinkPolicy {
        SinkPolicy {
            max_in_flight: 4,
            max_batch: 64,
            rate_per_sec: None,
            burst: 100,
            max_attempts: 10,
            backoff: Backoff::default(),
        }
    }
}

/// A named sink with its policy.
#[derive(Clone)]
pub struct SinkEntry {
    pub name: String,
    pub sink: Arc<dyn Sink>,
    pub policy: SinkPolicy,
}

impl fmt::Debug for SinkEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SinkEntry")
            .field("name", &self.name)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// Why a sink could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("sink {0:?} is declared twice")]
    Duplicate(String),
    #[error("sink names {0:?} and {1:?} share an index tag; rename one of them")]
    TagCollision(String, String),
    #[error("sink {0:?}: {1}")]
    InvalidPolicy(String, &'static str),
}

/// The configured sinks, by name and by index tag.
#[derive(Debug, Default, Clone)]
pub struct SinkRegistry {
    entries: Vec<SinkEntry>,
    by_tag: HashMap<u16, usize>,
}

impl SinkRegistry {
    pub fn new() -> SinkRegistry {
        SinkRegistry::default()
    }

    pub fn register(
        &mut self,
        name: &str,
        sink: Arc<dyn Sink>,
        policy: SinkPolicy,
    ) -> Result<(), RegistryError> {
        if policy.max_in_flight == 0 || policy.max_batch == 0 {
            return Err(RegistryError::InvalidPolicy(
                name.into(),
                "max_in_flight and max_batch must be at least 1",
            ));
        }
        if policy.max_attempts == 0 {
            return Err(RegistryError::InvalidPolicy(
                name.into(),
                "max_attempts must be at least 1",
            ));
        }
        if policy.rate_per_sec.is_some_and(|r| r.is_nan() || r <= 0.0) {
            return Err(RegistryError::InvalidPolicy(
                name.into(),
                "rate_per_sec must be positive",
            ));
        }
        let tag = sink_tag(name);
        if let Some(&other) = self.by_tag.get(&tag) {
            let other = &self.entries[other].name;
            return Err(if other == name {
                RegistryError::Duplicate(name.into())
            } else {
                RegistryError::TagCollision(other.clone(), name.into())
            });
        }
        self.by_tag.insert(tag, self.entries.len());
        self.entries.push(SinkEntry {
            name: name.to_string(),
            sink,
            policy,
        });
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&SinkEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    pub fn entries(&self) -> &[SinkEntry] {
        &self.entries
    }

    /// The index of the sink with this tag.
    pub fn index_of_tag(&self, tag: u16) -> Option<usize> {
        self.by_tag.get(&tag).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Nothing;
    impl Sink for Nothing {
        fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
            Box::pin(async move { vec![SinkOutcome::Delivered; batch.len()] })
        }
    }

    /// What a batch's outcomes tell a connection: a refusal the sink made itself tells nothing of the MQ.
    #[test]
    fn report_reads_the_mq_from_its_answers_only() {
        let connection = crate::connection::ConnectionState::new("sink", "n", "nats");
        let away = SinkOutcome::Unreachable {
            reason: "nats: connection refused".into(),
        };
        report(&connection, 1, &[away.clone(), forbidden("$JS.API.x")]);
        assert!(!connection.is_up());
        report(&connection, 2, &[forbidden("$JS.API.x")]);
        assert!(!connection.is_up(), "a refused target is no answer");
        report(&connection, 3, &[SinkOutcome::Delivered, away.clone()]);
        assert!(connection.is_up(), "it took one");
        assert_eq!(connection.snapshot().postponed, 2);
        let nack = SinkOutcome::Dead {
            reason: "nack".into(),
        };
        report(&connection, 4, &[away]);
        assert!(!connection.is_up());
        report(&connection, 5, &[nack]);
        assert!(connection.is_up(), "a nack is an answer");
        let SinkOutcome::Refused { reason } = forbidden("x") else {
            panic!("a refused target is the sink's own refusal");
        };
        assert_eq!(
            reason, "forbidden_target: x",
            "the code a request gets for it"
        );
    }

    #[test]
    fn registry_refuses_duplicates_and_bad_policies() {
        let mut registry = SinkRegistry::new();
        registry
            .register("broker", Arc::new(Nothing), SinkPolicy::default())
            .unwrap();
        assert_eq!(
            registry.register("broker", Arc::new(Nothing), SinkPolicy::default()),
            Err(RegistryError::Duplicate("broker".into()))
        );
        let zero = SinkPolicy {
            max_attempts: 0,
            ..SinkPolicy::default()
        };
        assert!(registry.register("x", Arc::new(Nothing), zero).is_err());
        let negative = SinkPolicy {
            rate_per_sec: Some(-1.0),
            ..SinkPolicy::default()
        };
        assert!(registry.register("y", Arc::new(Nothing), negative).is_err());
        assert_eq!(registry.index_of_tag(sink_tag("broker")), Some(0));
        assert!(registry.get("broker").is_some());
    }

    #[test]
    fn backoff_grows_caps_and_jitters() {
        let backoff = Backoff {
            initial: Duration::from_secs(1),
            multiplier: 2.0,
            cap: Duration::from_secs(10),
        };
        assert_eq!(backoff.delay(0, 1.0), Duration::from_secs(1));
        assert_eq!(backoff.delay(3, 1.0), Duration::from_secs(8));
        assert_eq!(backoff.delay(4, 1.0), Duration::from_secs(10));
        assert_eq!(backoff.delay(40, 0.0), Duration::from_secs(5));
    }
}
