//! What every `[sinks.NAME]` table has whatever its kind (its lane: pacing, batching, retries), what
//! a sink adapter is given to build itself, and what every MQ sink's table has: a `url` and the
//! `targets` a request may name. The NATS, Redis and Kafka sinks take just that ([`MqSinkConfig`]);
//! the other kinds' keys are their adapters' (`WebhookSinkConfig`, `AmqpSinkConfig`, ...).

use super::{Backoff, Reporter, SinkPolicy};
use crate::connection::ConnectionState;
use crate::mq::{MqKind, Targets};
use crate::setting::{invalid, ConfigError, Millis};
use serde::Deserialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A `[sinks.NAME]` table of kind `nats`, `redis` or `kafka`: where the MQ is and what a request may
/// name there.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MqSinkConfig {
    /// Where the MQ is: `nats://127.0.0.1:4222` (several servers comma-separated),
    /// `redis://127.0.0.1:6379/`, `kafka://host:9092[,host:9092...]`; required.
    pub url: Option<String>,
    /// Glob patterns (`*`, `?`) of the subjects, stream keys or topics a request may name; empty: any
    /// but the MQ's own.
    pub targets: Vec<String>,
}

impl MqSinkConfig {
    /// `key`: the table's (`sinks.NAME`).
    pub fn validate(&self, kind: MqKind, key: &str) -> Result<(), ConfigError> {
        require_sink_url(kind, key, &self.url)?;
        check_targets(key, &self.targets)
    }

    /// Where the sink may publish.
    pub fn targets(&self, kind: MqKind) -> Targets {
        Targets::new(kind, &self.targets, "", &[])
    }
}

/// The `url` every MQ sink's table requires, checked by the MQ's own check.
pub fn require_sink_url(kind: MqKind, key: &str, url: &Option<String>) -> Result<(), ConfigError> {
    let name = kind.name();
    let article = crate::setting::article(name);
    let missing = format!(
        "{article} {name} sink needs a url ({}) and takes no secret",
        kind.url_example()
    );
    kind.required_url(key, url, &missing)
}

/// The keys every sink takes: how the scheduler paces, batches and retries its deliveries.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LaneConfig {
    pub max_attempts: u16,
    pub rate_per_sec: Option<f64>,
    pub burst: u32,
    pub max_in_flight: usize,
    /// Messages per sink call; by default 1,024 for the broker (a batch costs it one commit-log sync
    /// however large) and 256 for the others (a webhook batch is that many concurrent requests).
    pub max_batch: Option<usize>,
    pub backoff_initial: Millis,
    pub backoff_multiplier: f64,
    pub backoff_cap: Millis,
}

impl Default for LaneConfig {
    fn default() -> LaneConfig {
        LaneConfig {
            max_attempts: 10,
            rate_per_sec: None,
            burst: 100,
            max_in_flight: 4,
            max_batch: None,
            backoff_initial: Millis(Duration::from_secs(1)),
            backoff_multiplier: 2.0,
            backoff_cap: Millis(Duration::from_secs(3600)),
        }
    }
}

impl LaneConfig {
    /// The lane's policy; `default_batch`: the kind's `max_batch` when the table sets none.
    pub fn policy(&self, default_batch: usize) -> SinkPolicy {
        SinkPolicy {
            max_in_flight: self.max_in_flight,
            max_batch: self.max_batch.unwrap_or(default_batch),
            rate_per_sec: self.rate_per_sec,
            burst: self.burst,
            max_attempts: self.max_attempts,
            backoff: Backoff {
                initial: self.backoff_initial.0,
                multiplier: self.backoff_multiplier,
                cap: self.backoff_cap.0,
            },
        }
    }
}

/// Keys every sink took before each kind had keys of its own, which the kinds that do not use them
/// still accept (and ignore) so that configurations written then load as before: `timeout` and
/// `ca_file` whatever they hold, `targets` and `exchanges` when empty.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnusedSinkKeys {
    pub timeout: Option<Millis>,
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub targets: Vec<String>,
    #[serde(default)]
    pub exchanges: Vec<String>,
}

impl UnusedSinkKeys {
    /// Refuses what a kind without these keys cannot ignore; `key`: `sinks.NAME`.
    pub fn check(&self, key: &str) -> Result<(), ConfigError> {
        if !self.targets.is_empty() {
            return Err(invalid(
                &format!("{key}.targets"),
                "only an MQ sink (nats, amqp, redis, kafka) has targets",
            ));
        }
        if !self.exchanges.is_empty() {
            return Err(invalid(
                &format!("{key}.exchanges"),
                "only an amqp sink has exchanges",
            ));
        }
        Ok(())
    }
}

/// What a sink adapter is given to build itself.
#[derive(Debug, Clone)]
pub struct SinkContext {
    /// The clock deliveries are stamped with.
    pub clock: Arc<dyn schedulelog::Clock>,
    /// The largest body delayd takes (`limits.max_message_bytes`).
    pub max_message_bytes: usize,
    /// The lane's `max_in_flight` (the AMQP sink opens a channel per call in flight).
    pub max_in_flight: usize,
    /// The sink's name (`NAME` of `[sinks.NAME]`).
    pub name: String,
}

impl SinkContext {
    /// What an MQ sink of `kind` tells the state of its connection, as `GET /v1/sinks` and
    /// `delayd_sink_connected` show it.
    pub fn reporter(&self, kind: &'static str) -> Reporter {
        let connection = ConnectionState::new("sink", &self.name, kind);
        Reporter::new(kind, connection, self.clock.clone())
    }
}

/// Checks an MQ sink's `targets`: glob patterns of 1 to 255 bytes, no whitespace or control
/// characters. `key`: the table's (`sinks.NAME`).
pub fn check_targets(key: &str, targets: &[String]) -> Result<(), ConfigError> {
    match targets.iter().find(|t| !crate::names::valid_target(t)) {
        None => Ok(()),
        Some(bad) => Err(invalid(
            &format!("{key}.targets"),
            format!(
                "{bad:?}: a pattern has 1 to 255 bytes and no whitespace or control characters"
            ),
        )),
    }
}
