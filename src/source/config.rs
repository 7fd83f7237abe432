//! What every `[sources.NAME]` table has whatever its kind, and what a source adapter is given to
//! build its transport. Each kind's own keys are its adapter's (`RedisSourceConfig`, ...).

use super::StateFiles;
use crate::setting::{invalid, ConfigError, Millis};
use serde::Deserialize;

/// The keys every source takes.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourceShared {
    /// The sink that delivers what this source schedules (required).
    pub sink: Option<String>,
    /// Requests per batch, made durable in one group commit (AMQP: the prefetch, `basic.qos`, is
    /// twice it).
    pub batch: usize,
}

impl Default for SourceShared {
    fn default() -> SourceShared {
        SourceShared {
            sink: None,
            batch: 256,
        }
    }
}

/// Keys every source took before each kind had keys of its own, which the kinds that do not use them
/// still accept (and ignore) so that configurations written then load as before: `group`,
/// `consumer` and `ack_wait` whatever they hold, `topics` when empty.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnusedSourceKeys {
    pub group: Option<String>,
    pub consumer: Option<String>,
    pub ack_wait: Option<Millis>,
    #[serde(default)]
    pub topics: Vec<String>,
}

impl UnusedSourceKeys {
    /// Refuses what a kind without these keys cannot ignore; `key`: `sources.NAME`, `kind` its kind.
    pub fn check(&self, key: &str, kind: &str) -> Result<(), ConfigError> {
        match self.topics.is_empty() {
            true => Ok(()),
            false => Err(invalid(
                &format!("{key}.topics"),
                format!(
                    "{} {kind} source has no topics",
                    crate::setting::article(kind)
                ),
            )),
        }
    }
}

/// The consumer group (Redis, Kafka) or durable consumer (NATS) when the table names none.
pub fn default_group() -> String {
    "delayd".into()
}

/// What a source adapter is given to build its transport.
#[derive(Debug, Clone)]
pub struct SourceContext {
    /// The source's name (`NAME` of `[sources.NAME]`).
    pub name: String,
    /// Requests per batch.
    pub batch: usize,
    /// Where a source may keep files of its own (`sources/{name}~{what}`, mark::beside): replaced
    /// through the cluster's log on a member, so a new leader's source finds them.
    pub files: StateFiles,
}
