//! Connections to the message queues delayd sits beside (DESIGN.md §11), made the same way for a
//! source (source/) and a sink (sink/) of the same MQ: timeouts, credentials, what an `amqp://` URL may
//! be. Sources and sinks are siblings; what they share about an MQ lives here, below both.

/// An MQ that could not be reached, or refused: what it said.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct MqError(pub String);

/// A request's header kept with its message for the AMQP sink: the exchange to publish to instead of
/// the sink's own (`delayd-*` headers are never passed on).
pub const EXCHANGE_HEADER: &str = "delayd-exchange";

pub mod redis {
    use super::MqError;
    use redis::aio::MultiplexedConnection;
    use std::time::Duration;

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
