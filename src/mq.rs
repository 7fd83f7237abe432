//! Connections to the message queues delayd sits beside (DESIGN.md §11), made the same way for a
//! source (source/) and a sink (sink/) of the same MQ: timeouts, credentials, what an `amqp://` URL may
//! be, and which targets a sink may publish to. Sources and sinks are siblings; what they share about
//! an MQ lives here, below both.

use crate::setting::{invalid, ConfigError};

/// An MQ that could not be reached, or refused: what it said.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct MqError(pub String);

/// A request's header kept with its message for the AMQP sink: the exchange to publish to instead of
/// the sink's own (`delayd-*` headers are never passed on).
pub const EXCHANGE_HEADER: &str = "delayd-exchange";

/// The field of a Redis stream entry that holds the body (a source reads it, a sink writes it): a
/// header of that name is refused for a Redis sink rather than written as a second `body` field.
pub const REDIS_BODY: &str = "body";

/// The MQs an MQ sink publishes to and an MQ source consumes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MqKind {
    Nats,
    Amqp,
    Redis,
    Kafka,
}

impl MqKind {
    /// The kind of a sink's `kind`, when it is an MQ's.
    pub fn of(kind: &str) -> Option<MqKind> {
        match kind {
            "nats" => Some(MqKind::Nats),
            "amqp" => Some(MqKind::Amqp),
            "redis" => Some(MqKind::Redis),
            "kafka" => Some(MqKind::Kafka),
            _ => None,
        }
    }

    /// The MQ's `kind`, as a table writes it.
    pub fn name(self) -> &'static str {
        match self {
            MqKind::Nats => "nats",
            MqKind::Amqp => "amqp",
            MqKind::Redis => "redis",
            MqKind::Kafka => "kafka",
        }
    }

    /// What a `url` of this MQ looks like, for the error that asks for one.
    pub fn url_example(self) -> &'static str {
        match self {
            MqKind::Nats => "nats://host:4222",
            MqKind::Amqp => "amqp://user:password@host:5672/vhost",
            MqKind::Redis => "redis://host:6379/",
            MqKind::Kafka => "kafka://host:9092",
        }
    }

    /// Checks a URL of this MQ, as a configuration gives it.
    pub fn check_url(self, url: &str) -> Result<(), String> {
        match self {
            MqKind::Nats => nats::check_url(url),
            MqKind::Amqp => amqp::check_url(url),
            MqKind::Redis => redis::check_url(url),
            MqKind::Kafka => kafka::bootstrap_servers(url).map(drop),
        }
    }

    /// The `url` every MQ sink's and MQ source's table requires, checked by the MQ's own check.
    /// `key`: the table's (`sinks.NAME`); `missing`: what to say when it has none.
    pub fn required_url(
        self,
        key: &str,
        url: &Option<String>,
        missing: &str,
    ) -> Result<(), ConfigError> {
        let Some(url) = url else {
            return Err(invalid(key, missing));
        };
        self.check_url(url)
            .map_err(|e| invalid(&format!("{key}.url"), e))
    }

    /// Prefixes of the names an MQ keeps for itself: its API, its internal streams and topics, reply
    /// inboxes. A message published there would act with delayd's rights (a NATS `$JS.API.STREAM.
    /// DELETE.X` deletes a stream), so no sink publishes there, whatever `targets` says.
    fn internal_prefixes(self) -> &'static [&'static str] {
        match self {
            // `$JSC.` JetStream's cluster traffic, `$NRG.` its Raft groups, `$MQTT.` the MQTT
            // gateway's state, `$SRV.` the services API.
            MqKind::Nats => &[
                "$JS.", "$JSC.", "$KV.", "$O.", "$NRG.", "$MQTT.", "$SRV.", "$SYS.", "_INBOX.",
            ],
            // Kafka's own topics: __consumer_offsets, __transaction_state, ...
            MqKind::Kafka => &["__"],
            MqKind::Amqp | MqKind::Redis => &[],
        }
    }
}

/// Where an MQ sink may publish (DESIGN.md §11): targets matching one of its `targets` patterns (any
/// target when there are none), never one of the MQ's internal names, and for AMQP only to the sink's
/// own `exchange` or one listed in its `exchanges`. Checked when a request is taken (HTTP 400, a
/// source's dead letter, code `forbidden_target`) and again when it is published (a message taken
/// before the configuration changed is dead).
#[derive(Debug, Clone)]
pub struct Targets {
    kind: MqKind,
    patterns: Vec<String>,
    exchange: String,
    exchanges: Vec<String>,
}

impl Targets {
    pub fn new(kind: MqKind, patterns: &[String], exchange: &str, exchanges: &[String]) -> Targets {
        Targets {
            kind,
            patterns: patterns.to_vec(),
            exchange: exchange.to_string(),
            exchanges: exchanges.to_vec(),
        }
    }

    /// Whether a message may go to `target` (on AMQP, through `exchange` when its request named one);
    /// if not, why.
    pub fn check(&self, target: &str, exchange: Option<&str>) -> Result<(), String> {
        if let Some(prefix) =
            (self.kind.internal_prefixes().iter()).find(|p| target.starts_with(**p))
        {
            return Err(format!(
                "{target:?} is one of the MQ's own names ({prefix}...): delayd never publishes there"
            ));
        }
        if !self.patterns.is_empty() && !self.patterns.iter().any(|p| glob(p, target)) {
            return Err(format!(
                "{target:?} matches none of the sink's targets ({})",
                self.patterns.join(", ")
            ));
        }
        if let Some(exchange) = exchange {
            if exchange != self.exchange && !self.exchanges.iter().any(|e| e == exchange) {
                return Err(format!(
                    "the exchange {exchange:?} is neither the sink's ({:?}) nor one of its exchanges",
                    self.exchange
                ));
            }
        }
        Ok(())
    }
}

/// Whether `text` matches the glob `pattern`: `*` stands for any run of characters (dots too), `?`
/// for one character, anything else for itself.
pub fn glob(pattern: &str, text: &str) -> bool {
    let (pattern, text): (Vec<char>, Vec<char>) =
        (pattern.chars().collect(), text.chars().collect());
    // The classic two-pointer match: on a mismatch, let the last `*` take one more character.
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some('*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == '?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((star_p, star_t)) => {
                    star = Some((star_p, star_t + 1));
                    p = star_p + 1;
                    t = star_t + 1;
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// A Kafka topic, group or instance name, and a Redis consumer name: 1 to 249 of `[A-Za-z0-9._-]`.
pub fn valid_client_name(name: &str) -> bool {
    (1..=249).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

pub mod redis {
    use super::MqError;
    use redis::aio::MultiplexedConnection;
    use std::time::Duration;

    /// Checks a `redis://` URL.
    pub fn check_url(url: &str) -> Result<(), String> {
        redis::Client::open(url)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// A connection whose commands time out a while after the longest block asked for.
    pub async fn connect(client: &redis::Client) -> Result<MultiplexedConnection, MqError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(15)));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| MqError(e.to_string()))
    }
}

pub mod nats {
    use super::MqError;
    use std::time::Duration;

    /// Requests, acks and publishes give up after this; the connection is then made again.
    pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

    /// Checks a NATS server address (or a comma-separated list of them).
    pub fn check_url(url: &str) -> Result<(), String> {
        for one in url.split(',') {
            one.trim()
                .parse::<async_nats::ServerAddr>()
                .map_err(|e| format!("{one:?}: {e}"))?;
        }
        Ok(())
    }

    /// A JetStream stream or consumer name: no whitespace, `.`, `*`, `>`, path separators.
    pub fn valid_name(name: &str) -> bool {
        !name.is_empty()
            && name.len() <= 255
            && !name
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c))
    }

    /// A NATS subject that may hold wildcards: `.`-separated non-empty tokens, `>` only last.
    pub fn valid_subject(subject: &str) -> bool {
        let tokens: Vec<&str> = subject.split('.').collect();
        !subject.is_empty()
            && !subject.chars().any(|c| c.is_whitespace() || c.is_control())
            && tokens.iter().enumerate().all(|(i, token)| {
                !token.is_empty()
                    && (*token == "*" || *token == ">" || !token.contains(['*', '>']))
                    && (*token != ">" || i == tokens.len() - 1)
            })
    }

    /// A connection that fails at once when the server is not there (the caller retries with backoff
    /// and says so), and whose requests give up after [`REQUEST_TIMEOUT`]. A `user:password@` in the URL
    /// is sent as the user's credentials (the client itself ignores it).
    pub async fn connect(url: &str) -> Result<async_nats::Client, MqError> {
        let credentials = url.split(',').find_map(|one| {
            let address = one.trim().parse::<async_nats::ServerAddr>().ok()?;
            let user = address.username()?.to_string();
            Some((user, address.password().unwrap_or_default().to_string()))
        });
        let options = match credentials {
            Some((user, password)) => {
                async_nats::ConnectOptions::with_user_and_password(user, password)
            }
            None => async_nats::ConnectOptions::new(),
        };
        options
            .connection_timeout(REQUEST_TIMEOUT)
            .request_timeout(Some(REQUEST_TIMEOUT))
            .connect(url)
            .await
            .map_err(|e| MqError(format!("connecting to NATS: {e}")))
    }
}

pub mod amqp {
    use super::MqError;
    use lapin::types::ShortString;
    use lapin::{Connection, ConnectionProperties};
    use std::time::Duration;

    /// How long connecting (TCP, handshake, declaring, consuming) may take.
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

    /// An AMQP exchange or queue name as RabbitMQ takes it: at most 255 bytes of letters, digits and
    /// `.`, `_`, `:`, `-`; empty is the default exchange.
    pub fn valid_name(name: &str) -> bool {
        name.len() <= 255
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
    }

    /// Checks an `amqp://` URL: what the config validation calls.
    pub fn check_url(url: &str) -> Result<(), String> {
        let uri: lapin::uri::AMQPUri = url.parse()?;
        if uri.scheme != lapin::uri::AMQPScheme::AMQP {
            return Err("only amqp:// URLs are supported (delayd has no TLS for AMQP)".into());
        }
        Ok(())
    }

    /// A connection, with a timeout.
    pub async fn connect(url: &str) -> Result<Connection, MqError> {
        tokio::time::timeout(
            CONNECT_TIMEOUT,
            Connection::connect(url, ConnectionProperties::default()),
        )
        .await
        .map_err(|_| MqError("connecting timed out".into()))?
        .map_err(|e| MqError(format!("connecting: {e}")))
    }

    /// Closes a connection politely if it still answers; gives up after a second (it may be dead).
    pub async fn close(connection: &Connection) {
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            connection.close(200, ShortString::from("delayd reconnects")),
        )
        .await;
    }
}

pub mod kafka {
    use rdkafka::ClientConfig;

    /// The brokers of a `kafka://host:port[,host:port...]` URL (or a bare `host:port` list), as
    /// librdkafka's `bootstrap.servers`.
    pub fn bootstrap_servers(url: &str) -> Result<String, String> {
        let list = url
            .strip_prefix("kafka://")
            .unwrap_or(url)
            .trim_end_matches('/');
        let servers: Vec<&str> = list.split(',').map(str::trim).collect();
        let valid = |server: &&str| {
            server
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
        };
        if servers.is_empty() || !servers.iter().all(valid) {
            return Err(format!(
                "{url:?} is not kafka://host:port (several brokers: kafka://a:9092,b:9092)"
            ));
        }
        Ok(servers.join(","))
    }

    /// A client's settings shared by sources and sinks: the brokers, and failures reported within
    /// seconds rather than minutes (the caller retries with backoff and says so).
    pub fn client_config(url: &str) -> Result<ClientConfig, super::MqError> {
        let servers = bootstrap_servers(url).map_err(super::MqError)?;
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", servers)
            .set("socket.timeout.ms", "10000")
            .set("reconnect.backoff.max.ms", "5000")
            .set("log_level", "3");
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_as_shells_do() {
        assert!(glob("orders.*", "orders.created"));
        assert!(glob("orders.*", "orders.eu.created"));
        assert!(!glob("orders.*", "orders"));
        assert!(glob("*", ""));
        assert!(glob("a?c", "abc"));
        assert!(!glob("a?c", "ac"));
        assert!(glob("*.out", "billing.out"));
        assert!(glob("a*b*c", "aXbYbZc"));
        assert!(!glob("a*b*c", "aXbYbZ"));
        assert!(glob("exact", "exact"));
        assert!(!glob("exact", "exactly"));
    }

    #[test]
    fn internal_names_are_refused_whatever_the_patterns_say() {
        let any = Targets::new(MqKind::Nats, &[], "", &[]);
        assert!(any.check("orders.out", None).is_ok());
        for internal in [
            "$JS.API.STREAM.DELETE.ORDERS",
            "$KV.config.x",
            "$O.bucket.x",
            "$SYS.REQ.SERVER.PING",
            "$JSC.R.abc",
            "$NRG.AE.group",
            "$MQTT.sess.x",
            "$SRV.PING",
            "_INBOX.abc",
        ] {
            assert!(any.check(internal, None).is_err(), "{internal}");
        }
        let everything = Targets::new(MqKind::Nats, &["*".into()], "", &[]);
        assert!(everything.check("$JS.API.INFO", None).is_err());
        let kafka = Targets::new(MqKind::Kafka, &[], "", &[]);
        assert!(kafka.check("__consumer_offsets", None).is_err());
        assert!(kafka.check("orders", None).is_ok());
        let listed = Targets::new(MqKind::Redis, &["orders:*".into()], "", &[]);
        assert!(listed.check("orders:out", None).is_ok());
        assert!(listed.check("sessions", None).is_err());
    }

    #[test]
    fn an_amqp_request_names_only_the_sinks_exchange_or_a_listed_one() {
        let targets = Targets::new(MqKind::Amqp, &[], "orders", &["audit".into()]);
        assert!(targets.check("created", None).is_ok());
        assert!(targets.check("created", Some("orders")).is_ok());
        assert!(targets.check("created", Some("audit")).is_ok());
        assert!(targets.check("created", Some("amq.rabbitmq.log")).is_err());
        assert!(
            targets.check("created", Some("")).is_err(),
            "the default exchange is not this sink's"
        );
    }
}
