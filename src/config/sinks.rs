//! `[sinks.NAME]` tables: one variant per kind, each its adapter's own config type, and the one place
//! that names every sink kind (reading a table, checking it, building the sink). A new kind of sink is
//! its adapter's module plus a variant here.

use crate::broker::{Broker, BrokerSinkConfig};
use crate::connection::ConnectionState;
use crate::mq::{MqKind, Targets};
use crate::setting::{invalid, ConfigError, TableReader};
use crate::sink::amqp::AmqpSinkConfig;
use crate::sink::kafka::KafkaSink;
use crate::sink::nats::NatsSink;
use crate::sink::redis::RedisSink;
use crate::sink::webhook::WebhookSinkConfig;
use crate::sink::{LaneConfig, MqSinkConfig, Sink, SinkContext, SinkPolicy, UnusedSinkKeys};
use std::sync::Arc;

/// One `[sinks.NAME]` table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SinkConfig {
    /// The keys every sink takes.
    pub lane: LaneConfig,
    /// `kind` and that kind's own keys.
    pub kind: SinkKind,
}

/// A sink's `kind` (`broker` when the table names none) with that kind's keys.
#[derive(Debug, Clone, PartialEq)]
pub enum SinkKind {
    /// The built-in store.
    Broker(BrokerSinkConfig),
    Webhook(WebhookSinkConfig),
    Redis(MqSinkConfig),
    Nats(MqSinkConfig),
    Amqp(AmqpSinkConfig),
    Kafka(MqSinkConfig),
}

impl Default for SinkKind {
    fn default() -> SinkKind {
        SinkKind::Broker(BrokerSinkConfig::default())
    }
}

/// Every `kind` a sink may have, as written.
pub const SINK_KINDS: [&str; 6] = ["broker", "webhook", "redis", "nats", "amqp", "kafka"];

impl SinkKind {
    /// The kind as written in `kind`.
    pub fn name(&self) -> &'static str {
        match self {
            SinkKind::Broker(_) => "broker",
            SinkKind::Webhook(_) => "webhook",
            SinkKind::Redis(_) => "redis",
            SinkKind::Nats(_) => "nats",
            SinkKind::Amqp(_) => "amqp",
            SinkKind::Kafka(_) => "kafka",
        }
    }
}

impl SinkConfig {
    /// Reads a `[sinks.NAME]` table; `key`: `sinks.NAME`. An unknown kind or key, or a value of the
    /// wrong type, is an error naming it.
    pub fn read(key: String, table: toml::Table) -> Result<SinkConfig, ConfigError> {
        let mut table = TableReader::new(key, table);
        let kind = table.take_kind("broker")?;
        let lane = table.take()?;
        let kind = match kind.as_str() {
            "broker" => SinkKind::Broker(table.take()?),
            "webhook" => SinkKind::Webhook(table.take()?),
            "redis" => SinkKind::Redis(table.take()?),
            "nats" => SinkKind::Nats(table.take()?),
            "amqp" => SinkKind::Amqp(table.take()?),
            "kafka" => SinkKind::Kafka(table.take()?),
            _ => {
                return Err(invalid(
                    &format!("{}.kind", table.key()),
                    format!(
                        "unknown sink kind {kind:?}: use {}",
                        super::one_of(&SINK_KINDS)
                    ),
                ))
            }
        };
        table.take_unused::<UnusedSinkKeys>()?.check(table.key())?;
        let article = crate::setting::article(kind.name());
        table.finish(&format!("{article} {} sink", kind.name()))?;
        Ok(SinkConfig { lane, kind })
    }

    /// Refuses what the sink could not work with, naming the key; `key`: `sinks.NAME`.
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        match &self.kind {
            SinkKind::Broker(_) => Ok(()),
            SinkKind::Webhook(webhook) => webhook.validate(key),
            SinkKind::Redis(redis) => redis.validate(MqKind::Redis, key),
            SinkKind::Nats(nats) => nats.validate(MqKind::Nats, key),
            SinkKind::Amqp(amqp) => amqp.validate(key),
            SinkKind::Kafka(kafka) => kafka.validate(MqKind::Kafka, key),
        }
    }

    /// The lane's policy: `max_batch` by default 1,024 for the broker (a batch costs it one
    /// commit-log sync however large) and 256 for the others.
    pub fn policy(&self) -> SinkPolicy {
        let default_batch = match self.kind {
            SinkKind::Broker(_) => 1024,
            _ => 256,
        };
        self.lane.policy(default_batch)
    }

    /// Whether a message's topic is checked as a target on another message queue (1 to 255 bytes, no
    /// whitespace: a Redis stream key may hold `:`, a NATS subject `$`) rather than as a topic name. A
    /// Kafka sink's targets are Kafka topics, checked as topic names.
    pub fn topic_is_target(&self) -> bool {
        matches!(
            self.kind,
            SinkKind::Redis(_) | SinkKind::Nats(_) | SinkKind::Amqp(_)
        )
    }

    /// Where an MQ sink may publish; `None` for the broker and webhooks.
    pub fn targets(&self) -> Option<Targets> {
        match &self.kind {
            SinkKind::Broker(_) | SinkKind::Webhook(_) => None,
            SinkKind::Redis(redis) => Some(redis.targets(MqKind::Redis)),
            SinkKind::Nats(nats) => Some(nats.targets(MqKind::Nats)),
            SinkKind::Amqp(amqp) => Some(amqp.targets()),
            SinkKind::Kafka(kafka) => Some(kafka.targets(MqKind::Kafka)),
        }
    }

    /// The sink named `name`, and for an MQ sink the state of its connection.
    pub fn build(
        &self,
        name: &str,
        broker: &Arc<Broker>,
        clock: &Arc<dyn schedulelog::Clock>,
        max_message_bytes: usize,
    ) -> anyhow::Result<(Arc<dyn Sink>, Option<ConnectionState>)> {
        let context = SinkContext {
            clock: clock.clone(),
            max_message_bytes,
            max_in_flight: self.lane.max_in_flight,
            name: name.to_string(),
        };
        let built: (Arc<dyn Sink>, Option<ConnectionState>) = match &self.kind {
            SinkKind::Broker(config) => (Arc::new(config.build(broker.clone())), None),
            SinkKind::Webhook(config) => (Arc::new(config.build(clock.clone())?), None),
            SinkKind::Redis(config) => {
                let (sink, connection) = RedisSink::build(config, &context)?;
                (Arc::new(sink), Some(connection))
            }
            SinkKind::Nats(config) => {
                let (sink, connection) = NatsSink::build(config, &context);
                (Arc::new(sink), Some(connection))
            }
            SinkKind::Amqp(config) => {
                let (sink, connection) = config.build(&context);
                (Arc::new(sink), Some(connection))
            }
            SinkKind::Kafka(config) => {
                let (sink, connection) = KafkaSink::build(config, &context)?;
                (Arc::new(sink), Some(connection))
            }
        };
        Ok(built)
    }
}
