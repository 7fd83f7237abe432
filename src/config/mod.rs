//! Configuration: embedded defaults, then a TOML file (`--config`), then `DELAYD_*` environment
//! variables, then command-line flags; each layer overrides the one before. Every key is documented in
//! docs/configuration.md; unknown keys in the file are an error, not a silent no-op.

pub(crate) mod cluster;
mod sinks;
mod sources;
#[cfg(test)]
mod tests;

pub use crate::broker::BrokerConfig;
pub use crate::setting::{parse_duration, ConfigError, Millis};
pub use cluster::{ClusterConfig, MemberConfig};
pub use sinks::{SinkConfig, SinkKind, SINK_KINDS};
pub use sources::{SourceConfig, SourceKind, SOURCE_KINDS};

use crate::setting::invalid;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

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
    /// The `[cluster]` section (DESIGN.md §10); `None`, the default: a single node.
    pub cluster: Option<ClusterConfig>,
    /// The `[sinks.NAME]` tables; after [`Config::load`], also the built-in sink `broker`.
    #[serde(skip)]
    pub sinks: BTreeMap<String, SinkConfig>,
    /// The `[sources.NAME]` tables.
    #[serde(skip)]
    pub sources: BTreeMap<String, SourceConfig>,
    /// The `[sinks.NAME]` and `[sources.NAME]` tables as written: [`Config::load`] reads each into
    /// `sinks` and `sources` by its `kind`, so that a mistake in one names its key (`sinks.NAME.KEY`)
    /// and an unknown key lists the kind's keys. Empty once loaded.
    #[serde(rename = "sinks")]
    written_sinks: BTreeMap<String, toml::Table>,
    #[serde(rename = "sources")]
    written_sources: BTreeMap<String, toml::Table>,
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
            cluster: None,
            sinks: BTreeMap::new(),
            sources: BTreeMap::new(),
            written_sinks: BTreeMap::new(),
            written_sources: BTreeMap::new(),
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

/// `"a", "b" or "c"`: the kinds a table may have, for an error.
fn one_of(kinds: &[&str]) -> String {
    let quoted: Vec<String> = kinds.iter().map(|kind| format!("{kind:?}")).collect();
    match quoted.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
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
        config.read_tables()?;
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

    /// Reads the `[sinks.NAME]` and `[sources.NAME]` tables as written into their kinds' types.
    fn read_tables(&mut self) -> Result<(), ConfigError> {
        for (name, table) in std::mem::take(&mut self.written_sinks) {
            let sink = SinkConfig::read(format!("sinks.{name}"), table)?;
            self.sinks.insert(name, sink);
        }
        for (name, table) in std::mem::take(&mut self.written_sources) {
            let source = SourceConfig::read(format!("sources.{name}"), table)?;
            self.sources.insert(name, source);
        }
        Ok(())
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
            "DELAYD_CLUSTER_NODE_ID" => self.cluster_mut().node_id = number(value)?,
            "DELAYD_CLUSTER_LISTEN" => self.cluster_mut().listen = value.into(),
            "DELAYD_CLUSTER_SECRET" => self.cluster_mut().secret = value.into(),
            "DELAYD_CLUSTER_ELECTION_TIMEOUT" => {
                self.cluster_mut().election_timeout = duration(value)?
            }
            "DELAYD_CLUSTER_SNAPSHOT_ENTRIES" => {
                self.cluster_mut().snapshot_entries = number(value)?
            }
            "DELAYD_CLUSTER_LOG_FILE_BYTES" => self.cluster_mut().log_file_bytes = number(value)?,
            "DELAYD_CLUSTER_JOIN" => {
                self.cluster_mut().join = match value {
                    "true" => true,
                    "false" => false,
                    _ => return Err(invalid(key, "true or false")),
                }
            }
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

    /// The `[cluster]` section, made (at its defaults) if the file had none: a `DELAYD_CLUSTER_*`
    /// variable alone asks for a cluster, so that the members of a StatefulSet can share one file and
    /// each set its own `node_id`. [`Config::validate`] then demands the keys still missing.
    fn cluster_mut(&mut self) -> &mut ClusterConfig {
        self.cluster.get_or_insert_with(ClusterConfig::default)
    }

    /// What every new message is checked against, from the HTTP API or a source.
    pub fn admission(&self) -> crate::intake::Admission {
        let sinks = (self.sinks.iter())
            .map(|(name, sink)| {
                let rules = crate::intake::SinkRules {
                    topic_is_target: sink.topic_is_target(),
                    targets: sink.targets(),
                    body_header_reserved: matches!(sink.kind, SinkKind::Redis(_)),
                };
                (name.clone(), rules)
            })
            .collect();
        crate::intake::Admission {
            max_delay_ms: self.max_delay.as_ms(),
            max_message_bytes: self.limits.max_message_bytes,
            sinks,
        }
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
                .filter(|sink| matches!(sink.kind, SinkKind::Webhook(_)))
                .map(|sink| {
                    let policy = sink.policy();
                    (policy.max_in_flight * policy.max_batch) as u64
                })
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
        if let Some(cluster) = &self.cluster {
            cluster.validate()?;
            if self.fsync != "always" {
                return Err(invalid(
                    "fsync",
                    "must be \"always\" with a [cluster] section: a member acknowledges a write once \
                     a majority of the members have fdatasynced it, so a periodic fdatasync has no \
                     place; remove the fsync setting (DELAYD_FSYNC, --fsync) or set it to \"always\"",
                ));
            }
        }
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
        self.broker.validate()?;
        if self.auth.tokens.iter().any(|t| t.len() < 16) {
            return Err(invalid(
                "auth.tokens",
                "tokens must be at least 16 characters",
            ));
        }
        for (name, sink) in &self.sinks {
            let key = format!("sinks.{name}");
            if !crate::names::valid_name(name) {
                return Err(invalid(&key, "sink names match [A-Za-z0-9._-]{1,200}"));
            }
            sink.validate(&key)?;
        }
        // The built-in broker sink always exists; a [sinks.broker] table only tunes it.
        self.sinks.entry("broker".into()).or_default();
        for (name, source) in &self.sources {
            let key = format!("sources.{name}");
            if !crate::names::valid_name(name) {
                return Err(invalid(&key, "source names match [A-Za-z0-9._-]{1,200}"));
            }
            match source.shared.sink.as_deref() {
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
            source.validate(&key)?;
        }
        // No retry is scheduled further ahead than a new message may be: the cap bounds the backoff
        // and a receiver's own `Retry-After` alike.
        for sink in self.sinks.values_mut() {
            sink.lane.backoff_cap.0 = sink.lane.backoff_cap.0.min(self.max_delay.0);
        }
        Ok(())
    }
}
