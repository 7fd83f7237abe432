//! `[sources.NAME]` tables: one variant per kind, each its adapter's own config type, and the one
//! place that names every source kind (reading a table, checking it, building the transport). A new
//! kind of source is its adapter's module plus a variant here.

use crate::setting::{invalid, ConfigError, TableReader};
use crate::source::amqp::AmqpSourceConfig;
use crate::source::kafka::KafkaSourceConfig;
use crate::source::nats::NatsSourceConfig;
use crate::source::redis::RedisSourceConfig;
use crate::source::{SourceContext, SourceShared, StateFiles, Transport, UnusedSourceKeys};

/// One `[sources.NAME]` table: delay requests consumed from another MQ (DESIGN.md §11).
#[derive(Debug, Clone, PartialEq)]
pub struct SourceConfig {
    /// The keys every source takes (`sink`, `batch`).
    pub shared: SourceShared,
    /// `kind` and that kind's own keys.
    pub kind: SourceKind,
}

/// A source's `kind` with that kind's keys.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceKind {
    /// Redis Streams.
    Redis(RedisSourceConfig),
    /// NATS JetStream.
    Nats(NatsSourceConfig),
    /// AMQP 0-9-1 (RabbitMQ).
    Amqp(AmqpSourceConfig),
    Kafka(KafkaSourceConfig),
}

/// Every `kind` a source may have, as written.
pub const SOURCE_KINDS: [&str; 4] = ["redis", "nats", "amqp", "kafka"];

impl SourceKind {
    /// The kind as written in `kind`.
    pub fn name(&self) -> &'static str {
        match self {
            SourceKind::Redis(_) => "redis",
            SourceKind::Nats(_) => "nats",
            SourceKind::Amqp(_) => "amqp",
            SourceKind::Kafka(_) => "kafka",
        }
    }
}

impl SourceConfig {
    /// Reads a `[sources.NAME]` table; `key`: `sources.NAME`. An unknown kind or key, or a value of
    /// the wrong type, is an error naming it.
    pub fn read(key: String, table: toml::Table) -> Result<SourceConfig, ConfigError> {
        let mut table = TableReader::new(key, table);
        let kind = table.take_kind("")?;
        let shared = table.take()?;
        let kind = match kind.as_str() {
            "redis" => SourceKind::Redis(table.take()?),
            "nats" => SourceKind::Nats(table.take()?),
            "amqp" => SourceKind::Amqp(table.take()?),
            "kafka" => SourceKind::Kafka(table.take()?),
            _ => {
                return Err(invalid(
                    &format!("{}.kind", table.key()),
                    format!(
                        "unknown source kind {kind:?}: use {}",
                        super::one_of(&SOURCE_KINDS)
                    ),
                ))
            }
        };
        table
            .take_unused::<UnusedSourceKeys>()?
            .check(table.key(), kind.name())?;
        let article = crate::setting::article(kind.name());
        table.finish(&format!("{article} {} source", kind.name()))?;
        Ok(SourceConfig { shared, kind })
    }

    /// Refuses what the source could not work with, naming the key; `key`: `sources.NAME`. (That
    /// its sink exists is the whole configuration's to check.)
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if !(1..=10_000).contains(&self.shared.batch) {
            return Err(invalid(&format!("{key}.batch"), "between 1 and 10000"));
        }
        match &self.kind {
            SourceKind::Redis(redis) => redis.validate(key),
            SourceKind::Nats(nats) => nats.validate(key),
            SourceKind::Amqp(amqp) => amqp.validate(key),
            SourceKind::Kafka(kafka) => kafka.validate(key),
        }
    }

    /// The transport of the source named `name`; `files`: where it may keep files of its own.
    pub fn build(&self, name: &str, files: &StateFiles) -> anyhow::Result<Box<dyn Transport>> {
        let context = SourceContext {
            name: name.to_string(),
            batch: self.shared.batch,
            files: files.clone(),
        };
        Ok(match &self.kind {
            SourceKind::Redis(config) => Box::new(config.build(&context)?),
            SourceKind::Nats(config) => Box::new(config.build(&context)),
            SourceKind::Amqp(config) => Box::new(config.build(&context)),
            SourceKind::Kafka(config) => Box::new(config.build(&context)?),
        })
    }
}
