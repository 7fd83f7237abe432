//! Configuration: embedded defaults, then a TOML file (`--config`), then `DELAYD_*` environment
//! variables, then command-line flags; each layer overrides the one before. Every key is documented in
//! docs/configuration.md; unknown keys in the file are an error, not a silent no-op.

use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("parsing {path}: {error}")]
    Parse {
        path: PathBuf,
        error: Box<toml::de::Error>,
    },
    #[error("{key}: {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// A duration written as `"1500ms"`, `"30s"`, `"30m"`, `"2h"`, `"7d"` or an integer of milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Millis(pub Duration);

impl Millis {
    pub fn as_ms(self) -> i64 {
        i64::try_from(self.0.as_millis()).unwrap_or(i64::MAX)
    }
}

/// Whether `key=value` is one of the variables Kubernetes puts in every pod of a namespace for each
/// Service (its "service links"): for a Service named `delayd` or `delayd-…`, `DELAYD_SERVICE_HOST`
/// (an IP address), `DELAYD_SERVICE_PORT[_NAME]` (a port), `DELAYD_PORT` and `DELAYD_PORT_7070_TCP`
/// (`tcp://IP:PORT`), `DELAYD_PORT_7070_TCP_PROTO`, `_PORT` and `_ADDR`. They are not settings, and
/// refusing them would stop delayd from starting beside its own Service. Both the name and the value
/// must have the shape, so a misspelt setting such as `DELAYD_LISTEN_PORT=8080` is still refused.
fn kubernetes_service_link(key: &str, value: &str) -> bool {
    let ip = value.parse::<std::net::IpAddr>().is_ok();
    let port = value.parse::<u16>().is_ok();
    let url = ["tcp://", "udp://", "sctp://"]
        .iter()
        .any(|scheme| value.starts_with(scheme));
    // `_PORT_<n>_<PROTO>…` may sit anywhere (a Service named `delayd-port` makes
    // `DELAYD_PORT_PORT_7070_TCP`), and a Service's name may end in `-service` or `-port`: every reading
    // of the name is tried, and any that fits the value makes it a link.
    let numbered = (0..key.len())
        .filter(|&at| key[at..].starts_with("_PORT_"))
        .any(|at| {
            let rest = &key[at + "_PORT_".len()..];
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            let Some(rest) = rest[digits..].strip_prefix('_').filter(|_| digits > 0) else {
                return false;
            };
            ["TCP", "UDP", "SCTP"]
                .iter()
                .any(|protocol| match rest.strip_prefix(protocol) {
                    Some("") => url,
                    Some("_PROTO") => value.eq_ignore_ascii_case(protocol),
                    Some("_PORT") => port,
                    Some("_ADDR") => ip,
                    _ => false,
                })
        });
    numbered
        || (key.ends_with("_SERVICE_HOST") && ip)
        || ((key.ends_with("_SERVICE_PORT") || key.contains("_SERVICE_PORT_")) && port)
        || (key.ends_with("_PORT") && url)
}

/// Parses a duration: whole numbers with units, `ms`, `s`, `m`, `h` or `d`, alone (`"1500ms"`, `"30s"`,
/// `"7d"`) or in a row, largest first (`"1m30s"`, `"2h45m"`, `"1d12h"`), as people write them.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let not_a_duration =
        || format!("{text:?} is not a duration such as \"30s\", \"5m\", \"1m30s\" or \"7d\"");
    let mut rest = text;
    let mut total: u64 = 0;
    let mut last_unit_ms = u64::MAX;
    loop {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let number: u64 = rest[..digits].parse().map_err(|_| not_a_duration())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit_ms: u64 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "" => {
                return Err(format!(
                    "{text:?} has no unit: use ms, s, m, h or d (\"30s\", \"5m\", \"1m30s\")"
                ))
            }
            _ => return Err(not_a_duration()),
        };
        if unit_ms >= last_unit_ms {
            return Err(format!(
                "{text:?}: give the units largest first, each once (\"1h30m\")"
            ));
        }
        last_unit_ms = unit_ms;
        rest = &rest[unit_len..];
        total = number
            .checked_mul(unit_ms)
            .and_then(|ms| total.checked_add(ms))
            .ok_or_else(|| format!("{text:?} is too long"))?;
        if rest.is_empty() {
            return Ok(Duration::from_millis(total));
        }
    }
}

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Millis, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Ms(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Ms(ms) => Ok(Millis(Duration::from_millis(ms))),
            Raw::Text(text) => parse_duration(&text)
                .map(Millis)
                .map_err(serde::de::Error::custom),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest message body accepted (413 above).
    pub max_message_bytes: usize,
    /// Largest HTTP request body accepted (413 above).
    pub max_request_bytes: usize,
    /// Most messages in one batch request.
    pub max_batch_messages: usize,
    /// New messages are refused (507 `disk_full`) while the data dir's file system has less free space
    /// than this, so that deliveries, retries and cancels still have room; 0 turns the check off.
    pub min_free_disk_bytes: u64,
    /// A request's head (request line and headers) must arrive within this long of its first byte, or of
    /// the connection's start for its first request; else the connection is closed.
    pub header_timeout: Millis,
    /// A request's body must arrive within this long of its head (408 `request_timeout`, then the
    /// connection is closed).
    pub body_timeout: Millis,
    /// A keep-alive connection with no request in flight is closed after this long without traffic (a
    /// response the client does not read counts as no traffic).
    pub idle_timeout: Millis,
    /// Most HTTP connections served at once; past it new connections are answered 503 `overloaded`. The
    /// file descriptors left after [`Limits::reserved_fds`] may lower it (see `edge`).
    pub max_connections: usize,
    /// File descriptors HTTP connections must leave free for storage and webhook calls; `None`: 256 plus
    /// what the webhook sinks may open at once ([`Config::reserved_fds`]).
    pub reserved_fds: Option<u64>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_message_bytes: 1 << 20,
            max_request_bytes: 16 << 20,
            max_batch_messages: 10_000,
            min_free_disk_bytes: 256 << 20,
            header_timeout: Millis(Duration::from_secs(10)),
            body_timeout: Millis(Duration::from_secs(30)),
            idle_timeout: Millis(Duration::from_secs(60)),
            max_connections: 1024,
            reserved_fds: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Auth {
    /// Bearer tokens accepted on `/v1/*`; empty turns authentication off.
    pub tokens: Vec<String>,
}

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
    /// The broker's own settings.
    pub fn options(&self) -> crate::broker::BrokerOptions {
        crate::broker::BrokerOptions {
            queues_per_topic: self.queues_per_topic,
            segment_bytes: self.segment_bytes,
            retention: self.retention.0,
            dead_retention: self.dead_retention.0,
            max_bytes: self.max_bytes,
            max_pull_bytes: self.max_pull_bytes,
        }
    }
}

/// One `[sinks.NAME]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SinkConfig {
    /// `broker` (the built-in store), `webhook`, `redis`, `nats`, `amqp` or `kafka`.
    pub kind: String,
    /// Webhook: where to POST (http:// or https://).
    pub url: Option<String>,
    /// Webhook: the signing secret, `whsec_<base64>`.
    pub secret: Option<String>,
    /// Webhook: how long one request may take.
    pub timeout: Millis,
    /// Webhook: a PEM file of extra CA certificates to trust (a private CA), besides the public roots.
    pub ca_file: Option<PathBuf>,
    /// AMQP: the exchange to publish to, with the target as the routing key; `""` (the default
    /// exchange) delivers to the queue the target names.
    pub exchange: Option<String>,
    /// MQ sinks: glob patterns (`*`, `?`) of the targets a request may name; empty: any, but the MQ's
    /// own names (`crate::mq::Targets`).
    pub targets: Vec<String>,
    /// AMQP: exchanges other than `exchange` a request may name in `delayd-exchange`.
    pub exchanges: Vec<String>,
    pub max_attempts: u16,
    pub rate_per_sec: Option<f64>,
    pub burst: u32,
    pub max_in_flight: usize,
    /// Messages per sink call; by default 1,024 for the broker (a batch costs it one commit-log sync
    /// however large) and 256 for a webhook (a batch is that many concurrent requests).
    pub max_batch: Option<usize>,
    pub backoff_initial: Millis,
    pub backoff_multiplier: f64,
    pub backoff_cap: Millis,
}

impl Default for SinkConfig {
    fn default() -> SinkConfig {
        SinkConfig {
            kind: "broker".into(),
            url: None,
            secret: None,
            timeout: Millis(Duration::from_secs(10)),
            ca_file: None,
            exchange: None,
            targets: Vec::new(),
            exchanges: Vec::new(),
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

impl SinkConfig {
    /// `max_batch`, or the default for the sink's kind.
    pub fn batch_limit(&self) -> usize {
        self.max_batch
            .unwrap_or(if self.kind == "broker" { 1024 } else { 256 })
    }

    /// A sink that publishes to another message queue: its targets are that MQ's names (a Redis
    /// stream key may hold `:`, a NATS subject `.`-separated tokens), not topic names.
    pub fn is_mq(&self) -> bool {
        matches!(self.kind.as_str(), "redis" | "nats" | "amqp")
    }

    /// Where an MQ sink may publish; `None` for the broker and webhooks.
    pub fn targets(&self) -> Option<crate::mq::Targets> {
        let kind = crate::mq::MqKind::of(&self.kind)?;
        let exchange = self.exchange.as_deref().unwrap_or("");
        Some(crate::mq::Targets::new(
            kind,
            &self.targets,
            exchange,
            &self.exchanges,
        ))
    }
}

/// One `[sources.NAME]` table: delay requests consumed from another MQ (DESIGN.md §11).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourceConfig {
    /// `redis` (Redis Streams), `nats` (NATS JetStream), `amqp` (AMQP 0-9-1: RabbitMQ) or `kafka`.
    pub kind: String,
    /// Where the MQ is: `redis://127.0.0.1:6379/`, `nats://127.0.0.1:4222`,
    /// `amqp://guest:guest@127.0.0.1:5672/%2f`, `kafka://127.0.0.1:9092` (brokers comma-separated).
    pub url: Option<String>,
    /// The sink that delivers what this source schedules (required).
    pub sink: Option<String>,
    /// Redis: the stream requests are read from.
    pub stream_key: Option<String>,
    /// NATS: the JetStream stream requests are read from (created with `subject` when missing).
    pub stream: Option<String>,
    /// NATS: the subjects that stream captures and the consumer takes (wildcards allowed).
    pub subject: Option<String>,
    /// AMQP: the durable queue requests are consumed from (declared when missing).
    pub queue: Option<String>,
    /// Kafka: the topics requests are consumed from (they must exist).
    pub topics: Vec<String>,
    /// The consumer group (Redis, Kafka); the durable pull consumer's name (NATS).
    pub group: String,
    /// This node's name in the group, its own among the nodes sharing the group (required for Redis
    /// and Kafka). Redis: its unacknowledged requests are read again after a restart under this name
    /// (two nodes under one name would each read the other's again: deliveries twice). Kafka: its
    /// `group.instance.id` (static membership: a restarted node gets its partitions back at once).
    pub consumer: Option<String>,
    /// NATS: how long JetStream waits for an ack before delivering a request again.
    pub ack_wait: Millis,
    /// Requests per batch, made durable in one group commit (AMQP: the prefetch, `basic.qos`, is twice it).
    pub batch: usize,
}

impl Default for SourceConfig {
    fn default() -> SourceConfig {
        SourceConfig {
            kind: String::new(),
            url: None,
            sink: None,
            stream_key: None,
            stream: None,
            subject: None,
            queue: None,
            topics: Vec::new(),
            group: "delayd".into(),
            consumer: None,
            ack_wait: Millis(crate::source::nats::DEFAULT_ACK_WAIT),
            batch: 256,
        }
    }
}

/// An AMQP exchange or queue name as RabbitMQ takes it: at most 255 bytes of letters, digits and
/// `.`, `_`, `:`, `-`; empty is the default exchange.
fn valid_exchange(name: &str) -> bool {
    name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub data_dir: PathBuf,
    pub listen: String,
    pub segment_minutes: u16,
    pub tick_ms: u32,
    pub max_delay: Millis,
    /// `"always"`, or an interval such as `"5ms"`: acknowledge after the next periodic `fdatasync`.
    pub fsync: String,
    pub preload: Millis,
    pub retention: Millis,
    /// RocketMQ's delay levels: `delay_level = n` means the n-th entry (1-based).
    pub delay_levels: Vec<Millis>,
    pub log_format: LogFormat,
    pub limits: Limits,
    pub auth: Auth,
    pub broker: BrokerConfig,
    pub sinks: BTreeMap<String, SinkConfig>,
    pub sources: BTreeMap<String, SourceConfig>,
}

/// RocketMQ's 18 levels.
const DEFAULT_LEVELS: [&str; 18] = [
    "1s", "5s", "10s", "30s", "1m", "2m", "3m", "4m", "5m", "6m", "7m", "8m", "9m", "10m", "20m",
    "30m", "1h", "2h",
];

impl Default for Config {
    fn default() -> Config {
        let levels = DEFAULT_LEVELS
            .iter()
            .map(|l| Millis(parse_duration(l).unwrap_or_default()))
            .collect();
        Config {
            data_dir: PathBuf::from("./data"),
            listen: "127.0.0.1:7070".into(),
            segment_minutes: 60,
            tick_ms: 500,
            max_delay: Millis(Duration::from_secs(730 * 86_400)),
            fsync: "always".into(),
            preload: Millis(Duration::from_secs(300)),
            retention: Millis(Duration::from_secs(86_400)),
            delay_levels: levels,
            log_format: LogFormat::Text,
            limits: Limits::default(),
            auth: Auth::default(),
            broker: BrokerConfig::default(),
            sinks: BTreeMap::new(),
            sources: BTreeMap::new(),
        }
    }
}

/// Overrides from the command line (`None`: not given).
#[derive(Debug, Clone, Default)]
pub struct Flags {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub fsync: Option<String>,
    pub segment_minutes: Option<u16>,
    pub log_format: Option<LogFormat>,
    pub auth_tokens: Vec<String>,
}

impl Config {
    /// Defaults, then the file (if any), then `env` (the `DELAYD_*` variables), then `flags`.
    pub fn load(
        file: Option<&std::path::Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &Flags,
    ) -> Result<Config, ConfigError> {
        let mut config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
                    path: path.into(),
                    error,
                })?;
                toml::from_str(&text).map_err(|error| ConfigError::Parse {
                    path: path.into(),
                    error: Box::new(error),
                })?
            }
            None => Config::default(),
        };
        for (key, value) in env {
            config.apply_env(&key, &value)?;
        }
        if let Some(dir) = &flags.data_dir {
            config.data_dir = dir.clone();
        }
        if let Some(listen) = &flags.listen {
            config.listen = listen.clone();
        }
        if let Some(fsync) = &flags.fsync {
            config.fsync = fsync.clone();
        }
        if let Some(minutes) = flags.segment_minutes {
            config.segment_minutes = minutes;
        }
        if let Some(format) = flags.log_format {
            config.log_format = format;
        }
        if !flags.auth_tokens.is_empty() {
            config.auth.tokens = flags.auth_tokens.clone();
        }
        config.validate()?;
        Ok(config)
    }

    fn apply_env(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let number = |v: &str| -> Result<u64, ConfigError> {
            v.trim()
                .parse()
                .map_err(|_| invalid(key, format!("{v:?} is not a whole number")))
        };
        let duration = |v: &str| parse_duration(v).map(Millis).map_err(|e| invalid(key, e));
        match key {
            "DELAYD_DATA_DIR" => self.data_dir = value.into(),
            "DELAYD_LISTEN" => self.listen = value.into(),
            "DELAYD_SEGMENT_MINUTES" => {
                self.segment_minutes =
                    u16::try_from(number(value)?).map_err(|_| invalid(key, "too large"))?
            }
            "DELAYD_TICK_MS" => {
                self.tick_ms =
                    u32::try_from(number(value)?).map_err(|_| invalid(key, "too large"))?
            }
            "DELAYD_MAX_DELAY" => self.max_delay = duration(value)?,
            "DELAYD_FSYNC" => self.fsync = value.into(),
            "DELAYD_PRELOAD" => self.preload = duration(value)?,
            "DELAYD_RETENTION" => self.retention = duration(value)?,
            "DELAYD_LOG_FORMAT" => {
                self.log_format = match value {
                    "text" => LogFormat::Text,
                    "json" => LogFormat::Json,
                    _ => return Err(invalid(key, "use text or json")),
                }
            }
            "DELAYD_MAX_MESSAGE_BYTES" => self.limits.max_message_bytes = number(value)? as usize,
            "DELAYD_MAX_REQUEST_BYTES" => self.limits.max_request_bytes = number(value)? as usize,
            "DELAYD_MIN_FREE_DISK_BYTES" => self.limits.min_free_disk_bytes = number(value)?,
            "DELAYD_HEADER_TIMEOUT" => self.limits.header_timeout = duration(value)?,
            "DELAYD_BODY_TIMEOUT" => self.limits.body_timeout = duration(value)?,
            "DELAYD_IDLE_TIMEOUT" => self.limits.idle_timeout = duration(value)?,
            "DELAYD_MAX_CONNECTIONS" => {
                self.limits.max_connections =
                    usize::try_from(number(value)?).map_err(|_| invalid(key, "too large"))?
            }
            "DELAYD_RESERVED_FDS" => self.limits.reserved_fds = Some(number(value)?),
            "DELAYD_BROKER_RETENTION" => self.broker.retention = duration(value)?,
            "DELAYD_BROKER_MAX_BYTES" => self.broker.max_bytes = Some(number(value)?),
            "DELAYD_AUTH_TOKENS" => {
                self.auth.tokens = value
                    .split(',')
                    .map(str::trim)
                    .filter(|t| !t.is_empty())
                    .map(String::from)
                    .collect()
            }
            _ if kubernetes_service_link(key, value) => {}
            // Read by the storage engine of a benchmark build (schedulelog/src/slow_disk.rs).
            "DELAYD_SLOW_DISK_SYNC_US" | "DELAYD_SLOW_DISK_WRITE_US_PER_MIB"
                if cfg!(feature = "slow-disk") => {}
            _ if key.starts_with("DELAYD_") => {
                return Err(invalid(
                    key,
                    "not a delayd setting (see docs/configuration.md for the list)",
                ))
            }
            _ => {}
        }
        Ok(())
    }

    /// File descriptors HTTP connections leave free: `limits.reserved_fds`, or by default 256 for the
    /// storage engine and the broker (the WAL and its next file, the open buckets' segments, indexes and
    /// dispatch logs, readers, checkpoints, a commit log and a consume-queue file per queue of each new
    /// topic) plus the connections the webhook sinks may have open at once: a webhook call sends each
    /// message of its batch on a request of its own, `max_in_flight` calls at a time.
    pub fn reserved_fds(&self) -> u64 {
        self.limits.reserved_fds.unwrap_or_else(|| {
            let webhooks: u64 = self
                .sinks
                .values()
                .filter(|sink| sink.kind == "webhook")
                .map(|sink| (sink.max_in_flight * sink.batch_limit()) as u64)
                .sum();
            256 + webhooks
        })
    }

    /// The `fsync` setting as a policy.
    pub fn fsync_policy(&self) -> Result<schedulelog::FsyncPolicy, ConfigError> {
        if self.fsync == "always" {
            return Ok(schedulelog::FsyncPolicy::Always);
        }
        let every = parse_duration(&self.fsync)
            .map_err(|e| invalid("fsync", format!("use \"always\" or an interval: {e}")))?;
        if every.is_zero() || every > Duration::from_secs(1) {
            return Err(invalid("fsync", "the interval must be between 1ms and 1s"));
        }
        Ok(schedulelog::FsyncPolicy::Interval(every))
    }

    fn validate(&mut self) -> Result<(), ConfigError> {
        if schedulelog::SegmentMinutes::new(self.segment_minutes).is_none() {
            return Err(invalid("segment_minutes", "must be between 5 and 60"));
        }
        if !(1..=60_000).contains(&self.tick_ms) {
            return Err(invalid("tick_ms", "must be between 1 and 60000"));
        }
        if self.max_delay.0 > Duration::from_secs(100 * 365 * 86_400) {
            return Err(invalid("max_delay", "at most 100 years"));
        }
        self.fsync_policy()?;
        if self.delay_levels.is_empty() || self.delay_levels.len() > 255 {
            return Err(invalid("delay_levels", "between 1 and 255 levels"));
        }
        // The record format's own limit leaves room for the fields around the body.
        let format_limit = schedulelog::frame::MAX_PAYLOAD - 64 * 1024;
        if self.limits.max_message_bytes == 0 || self.limits.max_message_bytes > format_limit {
            return Err(invalid(
                "limits.max_message_bytes",
                format!("must be between 1 and {format_limit}"),
            ));
        }
        if self.limits.max_request_bytes < self.limits.max_message_bytes {
            return Err(invalid(
                "limits.max_request_bytes",
                "must be at least limits.max_message_bytes",
            ));
        }
        if self.limits.max_batch_messages == 0 {
            return Err(invalid("limits.max_batch_messages", "must be at least 1"));
        }
        if self.broker.queues_per_topic == 0 || self.broker.queues_per_topic > 1024 {
            return Err(invalid(
                "broker.queues_per_topic",
                "must be between 1 and 1024",
            ));
        }
        let reserve = self.limits.min_free_disk_bytes;
        if reserve != 0 && reserve < 128 << 20 {
            return Err(invalid(
                "limits.min_free_disk_bytes",
                "0 (off) or at least 134217728 (128 MiB: the WAL prepares its next 64 MiB file ahead, \
                 and deliveries, retries and cancels need room of their own)",
            ));
        }
        for (key, value) in [
            ("limits.header_timeout", self.limits.header_timeout),
            ("limits.body_timeout", self.limits.body_timeout),
            ("limits.idle_timeout", self.limits.idle_timeout),
        ] {
            if value.0 < Duration::from_millis(100) || value.0 > Duration::from_secs(3600) {
                return Err(invalid(key, "must be between 100ms and 1h"));
            }
        }
        if !(1..=1_000_000).contains(&self.limits.max_connections) {
            return Err(invalid(
                "limits.max_connections",
                "must be between 1 and 1000000",
            ));
        }
        if self.limits.reserved_fds.is_some_and(|n| n < 32) {
            return Err(invalid(
                "limits.reserved_fds",
                "must be at least 32 (the WAL's next file, a checkpoint, segment readers and the \
                 broker's files need descriptors of their own)",
            ));
        }
        for (key, value) in [
            ("broker.retention", self.broker.retention),
            ("broker.dead_retention", self.broker.dead_retention),
        ] {
            if value.0 < Duration::from_secs(1) {
                return Err(invalid(key, "must be at least 1s"));
            }
        }
        if self.broker.max_pull_bytes == 0 || self.broker.max_groups == 0 {
            return Err(invalid(
                "broker.max_pull_bytes, broker.max_groups",
                "must be at least 1",
            ));
        }
        if self.broker.segment_bytes < 64 << 10 {
            return Err(invalid("broker.segment_bytes", "must be at least 65536"));
        }
        if self
            .broker
            .max_bytes
            .is_some_and(|max| max < 2 * self.broker.segment_bytes)
        {
            return Err(invalid(
                "broker.max_bytes",
                "must be at least two segments (2 × broker.segment_bytes)",
            ));
        }
        if self.auth.tokens.iter().any(|t| t.len() < 16) {
            return Err(invalid(
                "auth.tokens",
                "tokens must be at least 16 characters",
            ));
        }
        for (name, sink) in &self.sinks {
            let key = format!("sinks.{name}");
            if !crate::format::valid_name(name) {
                return Err(invalid(&key, "sink names match [A-Za-z0-9._-]{1,200}"));
            }
            match (sink.kind.as_str(), &sink.url, &sink.secret) {
                ("broker", None, None) => {}
                ("broker", _, _) => {
                    return Err(invalid(&key, "a broker sink takes no url or secret"))
                }
                ("webhook", Some(url), Some(secret)) => {
                    let clock: std::sync::Arc<dyn schedulelog::Clock> =
                        std::sync::Arc::new(schedulelog::SystemClock);
                    crate::sink::webhook::WebhookSink::new(
                        url,
                        secret,
                        sink.timeout.0,
                        sink.ca_file.as_deref(),
                        clock,
                    )
                    .map_err(|e| invalid(&key, e.to_string()))?;
                }
                ("webhook", _, _) => {
                    return Err(invalid(&key, "a webhook sink needs url and secret"))
                }
                ("redis", Some(url), None) => {
                    redis::Client::open(url.as_str())
                        .map_err(|e| invalid(&format!("{key}.url"), e.to_string()))?;
                }
                ("redis", _, _) => {
                    return Err(invalid(
                        &key,
                        "a redis sink needs a url and takes no secret",
                    ))
                }
                ("nats", Some(url), None) => nats_url(&format!("{key}.url"), url)?,
                ("nats", _, _) => {
                    return Err(invalid(
                        &key,
                        "a nats sink needs a url (nats://host:4222) and takes no secret",
                    ))
                }
                ("amqp", Some(url), None) => {
                    crate::mq::amqp::check_url(url)
                        .map_err(|e| invalid(&format!("{key}.url"), e))?;
                    if sink.exchange.as_ref().is_some_and(|e| !valid_exchange(e)) {
                        return Err(invalid(
                            &format!("{key}.exchange"),
                            "an exchange name has at most 255 bytes of [A-Za-z0-9._:-] (\"\" is the default exchange)",
                        ));
                    }
                }
                ("amqp", _, _) => {
                    return Err(invalid(
                        &key,
                        "an amqp sink needs a url (amqp://user:password@host:5672/vhost) and takes no secret",
                    ))
                }
                ("kafka", Some(url), None) => {
                    crate::mq::kafka::bootstrap_servers(url)
                        .map_err(|e| invalid(&format!("{key}.url"), e))?;
                }
                ("kafka", _, _) => {
                    return Err(invalid(
                        &key,
                        "a kafka sink needs a url (kafka://host:9092) and takes no secret",
                    ))
                }
                (kind, _, _) => {
                    return Err(invalid(
                        &format!("{key}.kind"),
                        format!(
                            "unknown sink kind {kind:?}: use \"broker\", \"webhook\", \"redis\", \"nats\", \"amqp\" or \"kafka\""
                        ),
                    ))
                }
            }
            if sink.kind != "amqp" && sink.exchange.is_some() {
                return Err(invalid(
                    &format!("{key}.exchange"),
                    "only an amqp sink has an exchange",
                ));
            }
            if sink.kind != "amqp" && !sink.exchanges.is_empty() {
                return Err(invalid(
                    &format!("{key}.exchanges"),
                    "only an amqp sink has exchanges",
                ));
            }
            if let Some(bad) = sink.exchanges.iter().find(|e| !valid_exchange(e)) {
                return Err(invalid(
                    &format!("{key}.exchanges"),
                    format!("{bad:?}: an exchange name has at most 255 bytes of [A-Za-z0-9._:-]"),
                ));
            }
            if sink.targets().is_none() && !sink.targets.is_empty() {
                return Err(invalid(
                    &format!("{key}.targets"),
                    "only an MQ sink (nats, amqp, redis, kafka) has targets",
                ));
            }
            if let Some(bad) = sink
                .targets
                .iter()
                .find(|t| !crate::format::valid_target(t))
            {
                return Err(invalid(
                    &format!("{key}.targets"),
                    format!("{bad:?}: a pattern has 1 to 255 bytes and no whitespace or control characters"),
                ));
            }
        }
        // The built-in broker sink always exists; a [sinks.broker] table only tunes it.
        self.sinks.entry("broker".into()).or_default();
        for (name, source) in &self.sources {
            let key = format!("sources.{name}");
            if !crate::format::valid_name(name) {
                return Err(invalid(&key, "source names match [A-Za-z0-9._-]{1,200}"));
            }
            match source.sink.as_deref() {
                None => {
                    return Err(invalid(
                        &format!("{key}.sink"),
                        "name the sink that delivers what this source schedules",
                    ))
                }
                Some(sink) if !self.sinks.contains_key(sink) => {
                    return Err(invalid(
                        &format!("{key}.sink"),
                        format!("no sink named {sink:?} is configured"),
                    ))
                }
                Some(_) => {}
            }
            if !(1..=10_000).contains(&source.batch) {
                return Err(invalid(&format!("{key}.batch"), "between 1 and 10000"));
            }
            // A key of another kind is a mistake to say, not to ignore.
            let foreign = match source.kind.as_str() {
                "nats" => source.queue.as_ref().map(|_| "queue"),
                "kafka" => [
                    (source.stream.is_some(), "stream"),
                    (source.subject.is_some(), "subject"),
                    (source.queue.is_some(), "queue"),
                ]
                .into_iter()
                .find_map(|(set, name)| set.then_some(name)),
                "amqp" => [
                    (source.stream.is_some(), "stream"),
                    (source.subject.is_some(), "subject"),
                ]
                .into_iter()
                .find_map(|(set, name)| set.then_some(name)),
                _ => None,
            };
            let foreign = foreign.or_else(|| {
                (source.kind != "kafka" && !source.topics.is_empty()).then_some("topics")
            });
            if let Some(field) = foreign {
                return Err(invalid(
                    &format!("{key}.{field}"),
                    format!("a {} source has no {field}", source.kind),
                ));
            }
            match (source.kind.as_str(), &source.url, &source.stream_key) {
                ("redis", _, _) if source.stream.is_some() || source.subject.is_some() => {
                    return Err(invalid(
                        &key,
                        "stream and subject are for nats sources; a redis source reads stream_key",
                    ))
                }
                ("redis", Some(url), Some(stream_key))
                    if !stream_key.is_empty() && source.queue.is_none() =>
                {
                    redis::Client::open(url.as_str())
                        .map_err(|e| invalid(&format!("{key}.url"), e.to_string()))?;
                    // Two nodes under one consumer name read each other's pending entries again on
                    // every reconnect: no shared default.
                    match source.consumer.as_deref() {
                        Some(consumer) if kafka_name(consumer) => {}
                        Some(_) => {
                            return Err(invalid(
                                &format!("{key}.consumer"),
                                "a consumer name is 1 to 249 [A-Za-z0-9._-]",
                            ))
                        }
                        None => {
                            return Err(invalid(
                                &format!("{key}.consumer"),
                                "a redis source needs consumer: this node's name in the group, its own among the nodes sharing the group (say its host name)",
                            ))
                        }
                    }
                }
                ("redis", _, _) => {
                    return Err(invalid(
                        &key,
                        "a redis source needs url and stream_key (and has no queue)",
                    ))
                }
                ("amqp", Some(url), None) => {
                    crate::mq::amqp::check_url(url)
                        .map_err(|e| invalid(&format!("{key}.url"), e))?;
                    match source.queue.as_deref() {
                        Some(queue) if valid_exchange(queue) && !queue.is_empty() && !queue.starts_with("amq.") => {}
                        _ => {
                            return Err(invalid(
                                &format!("{key}.queue"),
                                "an amqp source needs a queue: 1 to 255 bytes of [A-Za-z0-9._:-], not starting with amq.",
                            ))
                        }
                    }
                }
                ("amqp", _, _) => {
                    return Err(invalid(
                        &key,
                        "an amqp source needs url (amqp://user:password@host:5672/vhost) and queue, and has no stream_key",
                    ))
                }
                ("nats", _, Some(_)) => {
                    return Err(invalid(
                        &format!("{key}.stream_key"),
                        "a nats source reads stream (a JetStream stream) and subject",
                    ))
                }
                ("nats", Some(url), None) => {
                    nats_url(&format!("{key}.url"), url)?;
                    validate_nats_source(&key, source)?;
                }
                ("nats", None, None) => {
                    return Err(invalid(&key, "a nats source needs url, stream and subject"))
                }
                ("kafka", Some(url), None) => {
                    crate::mq::kafka::bootstrap_servers(url)
                        .map_err(|e| invalid(&format!("{key}.url"), e))?;
                    if source.topics.is_empty()
                        || !source.topics.iter().all(|t| kafka_name(t))
                    {
                        return Err(invalid(
                            &format!("{key}.topics"),
                            "a kafka source needs topics: a list of names of 1 to 249 [A-Za-z0-9._-]",
                        ));
                    }
                    // Two nodes under one group.instance.id fence each other: no shared default.
                    let Some(consumer) = source.consumer.as_deref() else {
                        return Err(invalid(
                            &format!("{key}.consumer"),
                            "a kafka source needs consumer: this node's group.instance.id, its own among the nodes sharing the group (say its host name)",
                        ));
                    };
                    if !kafka_name(&source.group) || !kafka_name(consumer) {
                        return Err(invalid(
                            &key,
                            "group and consumer are 1 to 249 [A-Za-z0-9._-]",
                        ));
                    }
                }
                ("kafka", _, _) => {
                    return Err(invalid(
                        &key,
                        "a kafka source needs url (kafka://host:9092) and topics, and has no stream_key",
                    ))
                }
                (kind, _, _) => {
                    return Err(invalid(
                        &format!("{key}.kind"),
                        format!("unknown source kind {kind:?}: use \"redis\", \"nats\", \"amqp\" or \"kafka\""),
                    ))
                }
            }
        }
        // No retry is scheduled further ahead than a new message may be: the cap bounds the backoff
        // and a receiver's own `Retry-After` alike.
        for sink in self.sinks.values_mut() {
            sink.backoff_cap.0 = sink.backoff_cap.0.min(self.max_delay.0);
        }
        Ok(())
    }
}

/// A Kafka topic, group or instance name.
fn kafka_name(name: &str) -> bool {
    (1..=249).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// A NATS server address (or a comma-separated list of them).
fn nats_url(key: &str, url: &str) -> Result<(), ConfigError> {
    for one in url.split(',') {
        one.trim()
            .parse::<async_nats::ServerAddr>()
            .map_err(|e| invalid(key, format!("{one:?}: {e}")))?;
    }
    Ok(())
}

/// A JetStream stream or consumer name: no whitespace, `.`, `*`, `>`, path separators.
fn nats_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c))
}

/// A NATS subject that may hold wildcards: `.`-separated non-empty tokens, `>` only last.
fn nats_subject(subject: &str) -> bool {
    let tokens: Vec<&str> = subject.split('.').collect();
    !subject.is_empty()
        && !subject.chars().any(|c| c.is_whitespace() || c.is_control())
        && tokens.iter().enumerate().all(|(i, token)| {
            !token.is_empty()
                && (*token == "*" || *token == ">" || !token.contains(['*', '>']))
                && (*token != ">" || i == tokens.len() - 1)
        })
}

fn validate_nats_source(key: &str, source: &SourceConfig) -> Result<(), ConfigError> {
    match source.stream.as_deref() {
        Some(stream) if nats_name(stream) => {}
        _ => {
            return Err(invalid(
                &format!("{key}.stream"),
                "the JetStream stream to read (created when missing): a name without whitespace, '.', '*', '>' or slashes",
            ))
        }
    }
    match source.subject.as_deref() {
        Some(subject) if nats_subject(subject) => {}
        _ => {
            return Err(invalid(
                &format!("{key}.subject"),
                "the subjects the stream captures and delayd consumes, such as \"delayd.>\" (an existing stream must capture them)",
            ))
        }
    }
    if !nats_name(&source.group) {
        return Err(invalid(
            &format!("{key}.group"),
            "the durable consumer's name: no whitespace, '.', '*', '>' or slashes",
        ));
    }
    if source.ack_wait.0 < Duration::from_secs(1) {
        return Err(invalid(&format!("{key}.ack_wait"), "at least 1s"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("1.5s").is_err());
        assert!(parse_duration("s").is_err());
        // In a row, largest first, as people write them.
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1d12h"), Ok(Duration::from_secs(36 * 3600)));
        assert_eq!(
            parse_duration("2h0m5s250ms"),
            Ok(Duration::from_millis(7_205_250))
        );
        assert!(parse_duration("1m30").unwrap_err().contains("has no unit"));
        assert!(parse_duration("30s1m")
            .unwrap_err()
            .contains("largest first"));
        assert!(parse_duration("1m1m").is_err());
        assert!(parse_duration("1m 30s").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("213503982334d23h59m59s")
            .unwrap_err()
            .contains("too long"));
        assert!(parse_duration("99999999999999999999d").is_err());
    }

    #[test]
    fn embedded_defaults() {
        let config = Config::load(None, Vec::new(), &Flags::default()).unwrap();
        assert_eq!(config.listen, "127.0.0.1:7070");
        assert_eq!(config.data_dir, PathBuf::from("./data"));
        assert_eq!(config.delay_levels.len(), 18);
        assert_eq!(config.delay_levels[17].0, Duration::from_secs(7200));
        assert_eq!(config.sinks["broker"].batch_limit(), 1024);
        let webhook = SinkConfig {
            kind: "webhook".into(),
            ..SinkConfig::default()
        };
        assert_eq!(webhook.batch_limit(), 256);
        let set = SinkConfig {
            max_batch: Some(7),
            ..SinkConfig::default()
        };
        assert_eq!(set.batch_limit(), 7);
        assert_eq!(config.limits.header_timeout.0, Duration::from_secs(10));
        assert_eq!(config.limits.body_timeout.0, Duration::from_secs(30));
        assert_eq!(config.limits.idle_timeout.0, Duration::from_secs(60));
        assert_eq!(config.limits.max_connections, 1024);
        assert_eq!(config.reserved_fds(), 256);
    }

    /// The default reserve grows with what the webhook sinks may have open at once; a set one is kept.
    #[test]
    fn reserved_fds_cover_webhook_calls() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("delayd.toml");
        std::fs::write(
            &path,
            "[sinks.billing]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\nmax_in_flight = 2\nmax_batch = 10\n",
        )
        .unwrap();
        let config = Config::load(Some(&path), Vec::new(), &Flags::default()).unwrap();
        assert_eq!(config.reserved_fds(), 256 + 20);
        let config = Config::load(
            Some(&path),
            env(&[
                ("DELAYD_RESERVED_FDS", "64"),
                ("DELAYD_MAX_CONNECTIONS", "10"),
            ]),
            &Flags::default(),
        )
        .unwrap();
        assert_eq!(
            (config.reserved_fds(), config.limits.max_connections),
            (64, 10)
        );
    }

    /// `deploy/delayd.toml`, the example operators copy, loads to exactly the built-in defaults and
    /// names every key (the optional ones, and those of sinks and sources, commented out).
    #[test]
    fn the_example_config_is_every_key_at_its_default() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/delayd.toml");
        let example = Config::load(
            Some(std::path::Path::new(path)),
            Vec::new(),
            &Flags::default(),
        )
        .unwrap();
        let builtin = Config::load(None, Vec::new(), &Flags::default()).unwrap();
        assert_eq!(format!("{example:?}"), format!("{builtin:?}"));
        let text = std::fs::read_to_string(path).unwrap();
        let keys: std::collections::BTreeSet<&str> = text
            .lines()
            .map(|line| line.trim_start_matches(['#', ' ']))
            .filter_map(|line| line.split_once(" = ").map(|(key, _)| key.trim()))
            .collect();
        // The field names a Debug rendering shows: `name: value`.
        let fields = |debug: String| -> Vec<String> {
            debug
                .match_indices(": ")
                .map(|(at, _)| {
                    let before = &debug[..at];
                    let start = before
                        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .map_or(0, |i| i + 1);
                    before[start..].to_string()
                })
                .collect()
        };
        let mut all = fields(format!("{:?}", Config::default()));
        all.extend(fields(format!("{:?}", SinkConfig::default())));
        all.extend(fields(format!("{:?}", SourceConfig::default())));
        let nested = ["limits", "auth", "broker", "sinks", "sources"];
        for field in all.iter().filter(|f| !nested.contains(&f.as_str())) {
            assert!(
                keys.contains(field.as_str()),
                "deploy/delayd.toml lacks {field}"
            );
        }
        assert!(all.len() > 50, "{all:?}");
    }

    #[test]
    fn kubernetes_service_links_are_not_taken_for_settings() {
        // What a pod sees for a Service named `delayd` (its port named http).
        let links = env(&[
            ("DELAYD_SERVICE_HOST", "10.0.0.7"),
            ("DELAYD_SERVICE_PORT", "7070"),
            ("DELAYD_SERVICE_PORT_HTTP", "7070"),
            ("DELAYD_PORT", "tcp://10.0.0.7:7070"),
            ("DELAYD_PORT_7070_TCP", "tcp://10.0.0.7:7070"),
            ("DELAYD_PORT_7070_TCP_PROTO", "tcp"),
            ("DELAYD_PORT_7070_TCP_PORT", "7070"),
            ("DELAYD_PORT_7070_TCP_ADDR", "10.0.0.7"),
            // Services named `delayd-service` and `delayd-port`.
            ("DELAYD_SERVICE_SERVICE_HOST", "10.0.0.8"),
            ("DELAYD_SERVICE_PORT", "tcp://10.0.0.8:7070"),
            ("DELAYD_PORT_PORT", "tcp://[fd00::9]:7070"),
            ("DELAYD_PORT_PORT_7070_TCP_ADDR", "fd00::9"),
            ("DELAYD_LISTEN", "0.0.0.0:7070"),
        ]);
        let config = Config::load(None, links, &Flags::default()).unwrap();
        assert_eq!(config.listen, "0.0.0.0:7070");
        // A misspelt setting is still refused.
        for key in [
            "DELAYD_LISTEN_ADDR",
            "DELAYD_PORTS",
            "DELAYD_PORT_HTTP",
            "DELAYD_SERVICE",
        ] {
            let error = Config::load(None, env(&[(key, "1")]), &Flags::default()).unwrap_err();
            assert!(error.to_string().contains(key), "{key}: {error}");
        }
    }

    #[test]
    fn file_then_env_then_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("delayd.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:1\"\nfsync = \"5ms\"\nmax_delay = \"3d\"\n[limits]\nmax_message_bytes = 1000\n",
        )
        .unwrap();
        let env = env(&[("DELAYD_LISTEN", "127.0.0.1:2"), ("HOME", "/root")]);
        let flags = Flags {
            data_dir: Some("/tmp/x".into()),
            ..Flags::default()
        };
        let config = Config::load(Some(&path), env.clone(), &flags).unwrap();
        assert_eq!(config.listen, "127.0.0.1:2");
        assert_eq!(config.data_dir, PathBuf::from("/tmp/x"));
        assert_eq!(config.max_delay.0, Duration::from_secs(3 * 86_400));
        assert_eq!(config.limits.max_message_bytes, 1000);
        assert_eq!(
            config.fsync_policy().unwrap(),
            schedulelog::FsyncPolicy::Interval(Duration::from_millis(5))
        );
        let flags = Flags {
            listen: Some("127.0.0.1:3".into()),
            ..Flags::default()
        };
        assert_eq!(
            Config::load(Some(&path), env, &flags).unwrap().listen,
            "127.0.0.1:3"
        );
    }

    #[test]
    fn mistakes_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "lisen = \"x\"\n").unwrap();
        let err = Config::load(Some(&path), Vec::new(), &Flags::default()).unwrap_err();
        assert!(err.to_string().contains("lisen"), "{err}");
        let err = Config::load(
            None,
            env(&[("DELAYD_SEGMENT_MINUTES", "90")]),
            &Flags::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("segment_minutes"), "{err}");
        let err = Config::load(
            None,
            env(&[("DELAYD_FSYNC", "sometimes")]),
            &Flags::default(),
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("fsync"), "{err}");
        let err = Config::load(
            None,
            env(&[("DELAYD_MIN_FREE_DISK_BYTES", "1000")]),
            &Flags::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("min_free_disk_bytes"), "{err}");
        let err = Config::load(
            None,
            env(&[("DELAYD_BROKER_RETENTION", "0s")]),
            &Flags::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("broker.retention"), "{err}");
        for (var, value, key) in [
            ("DELAYD_HEADER_TIMEOUT", "0s", "limits.header_timeout"),
            ("DELAYD_BODY_TIMEOUT", "2h", "limits.body_timeout"),
            ("DELAYD_IDLE_TIMEOUT", "50ms", "limits.idle_timeout"),
            ("DELAYD_MAX_CONNECTIONS", "0", "limits.max_connections"),
            ("DELAYD_RESERVED_FDS", "8", "limits.reserved_fds"),
        ] {
            let err = Config::load(None, env(&[(var, value)]), &Flags::default()).unwrap_err();
            assert!(err.to_string().starts_with(key), "{var}={value}: {err}");
        }
        let err = Config::load(
            None,
            env(&[("DELAYD_HEADER_TIMEOUT", "10")]),
            &Flags::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("DELAYD_HEADER_TIMEOUT"), "{err}");
        let err = Config::load(None, env(&[("DELAYD_NOPE", "1")]), &Flags::default()).unwrap_err();
        assert!(err.to_string().contains("DELAYD_NOPE"), "{err}");
        std::fs::write(&path, "[sinks.billing]\nkind = \"carrier-pigeon\"\n").unwrap();
        let err = Config::load(Some(&path), Vec::new(), &Flags::default()).unwrap_err();
        assert!(err.to_string().contains("carrier-pigeon"), "{err}");
    }

    #[test]
    fn nats_sources_and_sinks_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nats.toml");
        let sink = "[sinks.out]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\n";
        let load = |source: &str| {
            std::fs::write(
                &path,
                format!("{sink}[sources.in]\nkind = \"nats\"\nsink = \"out\"\n{source}"),
            )
            .unwrap();
            Config::load(Some(&path), Vec::new(), &Flags::default())
        };
        let good = "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\nsubject = \"delayd.>\"\n";
        let config = load(good).unwrap();
        assert!(config.sinks["out"].is_mq());
        assert_eq!(config.sources["in"].group, "delayd");
        for (source, key) in [
            (
                "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\nsubject = \"delayd.>\"\nqueue = \"q\"\n",
                "sources.in.queue",
            ),
            (
                "stream = \"DELAYS\"\nsubject = \"delayd.>\"\n",
                "sources.in",
            ),
            (
                "url = \"nats://127.0.0.1:4222\"\nsubject = \"delayd.>\"\n",
                "sources.in.stream",
            ),
            (
                "url = \"nats://127.0.0.1:4222\"\nstream = \"DE.LAYS\"\nsubject = \"delayd.>\"\n",
                "sources.in.stream",
            ),
            (
                "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\n",
                "sources.in.subject",
            ),
            (
                "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\nsubject = \"delayd.>.x\"\n",
                "sources.in.subject",
            ),
            (
                "url = \"nats://127.0.0.1:4222\"\nstream = \"DELAYS\"\nsubject = \"delayd..x\"\n",
                "sources.in.subject",
            ),
            (&format!("{good}group = \"a.b\"\n"), "sources.in.group"),
            (
                &format!("{good}ack_wait = \"10ms\"\n"),
                "sources.in.ack_wait",
            ),
            (
                &format!("{good}stream_key = \"x\"\n"),
                "sources.in.stream_key",
            ),
        ] {
            let err = load(source).unwrap_err();
            assert!(err.to_string().starts_with(key), "{source}: {err}");
        }
        std::fs::write(&path, "[sinks.out]\nkind = \"nats\"\n").unwrap();
        let err = Config::load(Some(&path), Vec::new(), &Flags::default()).unwrap_err();
        assert!(err.to_string().contains("nats sink needs a url"), "{err}");
    }

    #[test]
    fn amqp_sources_and_sinks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("amqp.toml");
        let load = |text: &str| {
            std::fs::write(&path, text).unwrap();
            Config::load(Some(&path), Vec::new(), &Flags::default())
        };
        let good = "[sinks.out]\nkind = \"amqp\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nexchange = \"\"\n\n\
                    [sources.in]\nkind = \"amqp\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nqueue = \"delayd.in\"\nsink = \"out\"\nbatch = 64\n";
        let config = load(good).unwrap();
        assert!(config.sinks["out"].is_mq());
        assert_eq!(config.sources["in"].queue.as_deref(), Some("delayd.in"));
        for (bad, key) in [
            (
                good.replace("batch = 64", "batch = 64\nsubject = \"x.>\""),
                "sources.in.subject",
            ),
            (
                good.replace("queue = \"delayd.in\"\n", ""),
                "sources.in.queue",
            ),
            (
                good.replace("queue = \"delayd.in\"", "queue = \"amq.x\""),
                "sources.in.queue",
            ),
            (
                good.replace("queue = \"delayd.in\"", "queue = \"a b\""),
                "sources.in.queue",
            ),
            (
                good.replace(
                    "amqp://guest:guest@127.0.0.1:5672/%2f\"\nqueue",
                    "amqps://127.0.0.1/\"\nqueue",
                ),
                "sources.in.url",
            ),
            (
                good.replace("exchange = \"\"", "exchange = \"no spaces\""),
                "sinks.out.exchange",
            ),
            (
                good.replace(
                    "amqp://guest:guest@127.0.0.1:5672/%2f\"\nexchange",
                    "http://x/\"\nexchange",
                ),
                "sinks.out.url",
            ),
            (
                good.replace("queue = \"delayd.in\"", "stream_key = \"s\""),
                "sources.in",
            ),
        ] {
            let err = load(&bad).unwrap_err();
            assert!(err.to_string().starts_with(key), "{bad}: {err}");
        }
        let err = load("[sinks.out]\nkind = \"webhook\"\nurl = \"http://x/\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\nexchange = \"e\"\n").unwrap_err();
        assert!(err.to_string().starts_with("sinks.out.exchange"), "{err}");
    }

    /// Nodes sharing a Redis group each need a consumer name of their own: no default.
    #[test]
    fn a_redis_source_names_this_nodes_consumer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("redis.toml");
        let load = |text: &str| {
            std::fs::write(&path, text).unwrap();
            Config::load(Some(&path), Vec::new(), &Flags::default())
        };
        let good = "[sinks.out]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:6379/\"\n\n\
                    [sources.in]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:6379/\"\nstream_key = \"in\"\nsink = \"out\"\nconsumer = \"node-1\"\n";
        assert_eq!(
            load(good).unwrap().sources["in"].consumer.as_deref(),
            Some("node-1")
        );
        for (bad, why) in [
            (
                good.replace("consumer = \"node-1\"\n", ""),
                "needs consumer",
            ),
            (
                good.replace("consumer = \"node-1\"", "consumer = \"a b\""),
                "a consumer name",
            ),
        ] {
            let err = load(&bad).unwrap_err().to_string();
            assert!(
                err.starts_with("sources.in.consumer") && err.contains(why),
                "{err}"
            );
        }
    }

    #[test]
    fn kafka_sources_and_sinks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kafka.toml");
        let load = |text: &str| {
            std::fs::write(&path, text).unwrap();
            Config::load(Some(&path), Vec::new(), &Flags::default())
        };
        let good = "[sinks.out]\nkind = \"kafka\"\nurl = \"kafka://127.0.0.1:9092,127.0.0.2:9092\"\n\n\
                    [sources.in]\nkind = \"kafka\"\nurl = \"kafka://127.0.0.1:9092\"\ntopics = [\"delayd-in\"]\nsink = \"out\"\nconsumer = \"node-1\"\n";
        let config = load(good).unwrap();
        assert!(!config.sinks["out"].is_mq(), "targets are topic names");
        assert_eq!(config.sources["in"].topics, ["delayd-in"]);
        assert_eq!(
            crate::mq::kafka::bootstrap_servers("kafka://127.0.0.1:9092,127.0.0.2:9092").unwrap(),
            "127.0.0.1:9092,127.0.0.2:9092"
        );
        for (bad, key) in [
            (
                good.replace("topics = [\"delayd-in\"]\n", ""),
                "sources.in.topics",
            ),
            (
                good.replace("[\"delayd-in\"]", "[\"no spaces\"]"),
                "sources.in.topics",
            ),
            (
                good.replace(
                    "kafka://127.0.0.1:9092\"\ntopics",
                    "kafka://127.0.0.1\"\ntopics",
                ),
                "sources.in.url",
            ),
            (
                good.replace("consumer = \"node-1\"", "consumer = \"a/b\""),
                "sources.in",
            ),
            (
                good.replace("consumer = \"node-1\"\n", ""),
                "sources.in.consumer",
            ),
            (
                good.replace("sink = \"out\"", "sink = \"out\"\nqueue = \"q\""),
                "sources.in.queue",
            ),
            (
                good.replace("kafka://127.0.0.1:9092,127.0.0.2:9092", "redis://x/"),
                "sinks.out.url",
            ),
        ] {
            let err = load(&bad).unwrap_err();
            assert!(err.to_string().starts_with(key), "{bad}: {err}");
        }
        // topics belong to kafka sources only.
        let err = load("[sinks.out]\nkind = \"redis\"\nurl = \"redis://127.0.0.1/\"\n\n[sources.in]\nkind = \"redis\"\nurl = \"redis://127.0.0.1/\"\nstream_key = \"s\"\ntopics = [\"t\"]\nsink = \"out\"\n").unwrap_err();
        assert!(err.to_string().starts_with("sources.in.topics"), "{err}");
    }

    #[test]
    fn backoff_caps_stay_within_max_delay() {
        let config =
            Config::load(None, env(&[("DELAYD_MAX_DELAY", "10m")]), &Flags::default()).unwrap();
        assert_eq!(
            config.sinks["broker"].backoff_cap.0,
            Duration::from_secs(600)
        );
    }
}
