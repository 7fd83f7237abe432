//! The `[broker]` table: the built-in broker's settings.

use super::BrokerOptions;
use crate::setting::{invalid, ConfigError, Millis};
use serde::Deserialize;
use std::time::Duration;

/// The `[broker]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BrokerConfig {
    /// Consume queues per topic (fixed when a topic is created).
    pub queues_per_topic: u32,
    /// Most messages one pull returns.
    pub max_pull_messages: usize,
    /// Most bytes of messages one pull returns (at least one message, however large).
    pub max_pull_bytes: u64,
    /// Most consumer groups with committed offsets.
    pub max_groups: usize,
    /// Longest `wait_ms` a long poll may ask for.
    pub max_wait: Millis,
    /// Delivered messages stored longer ago than this are deleted, a commit log segment at a time.
    pub retention: Millis,
    /// The same for dead letters (topic `$dead`), kept in a commit log of their own.
    pub dead_retention: Millis,
    /// Size of a commit log segment, the unit retention deletes.
    pub segment_bytes: u64,
    /// Optional cap on the commit logs' bytes: past it the oldest segments go, retention or not.
    pub max_bytes: Option<u64>,
}

impl Default for BrokerConfig {
    fn default() -> BrokerConfig {
        BrokerConfig {
            queues_per_topic: 4,
            max_pull_messages: 1024,
            max_pull_bytes: 16 << 20,
            max_groups: 10_000,
            max_wait: Millis(Duration::from_secs(30)),
            retention: Millis(Duration::from_secs(72 * 3600)),
            dead_retention: Millis(Duration::from_secs(7 * 86_400)),
            segment_bytes: 1 << 30,
            max_bytes: None,
        }
    }
}

impl BrokerConfig {
    /// Refuses settings the broker cannot work with, naming the key (`broker.…`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.queues_per_topic == 0 || self.queues_per_topic > 1024 {
            return Err(invalid(
                "broker.queues_per_topic",
                "must be between 1 and 1024",
            ));
        }
        for (key, value) in [
            ("broker.retention", self.retention),
            ("broker.dead_retention", self.dead_retention),
        ] {
            if value.0 < Duration::from_secs(1) {
                return Err(invalid(key, "must be at least 1s"));
            }
        }
        if self.max_pull_bytes == 0 || self.max_groups == 0 {
            return Err(invalid(
                "broker.max_pull_bytes, broker.max_groups",
                "must be at least 1",
            ));
        }
        if self.segment_bytes < 64 << 10 {
            return Err(invalid("broker.segment_bytes", "must be at least 65536"));
        }
        if self
            .max_bytes
            .is_some_and(|max| max < 2 * self.segment_bytes)
        {
            return Err(invalid(
                "broker.max_bytes",
                "must be at least two segments (2 × broker.segment_bytes)",
            ));
        }
        Ok(())
    }

    /// The broker's own settings.
    pub fn options(&self) -> BrokerOptions {
        BrokerOptions {
            queues_per_topic: self.queues_per_topic,
            segment_bytes: self.segment_bytes,
            retention: self.retention.0,
            dead_retention: self.dead_retention.0,
            max_bytes: self.max_bytes,
            max_pull_bytes: self.max_pull_bytes,
        }
    }
}
