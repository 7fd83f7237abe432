//! The NATS JetStream transport: a durable pull consumer (`group`) on a stream (`stream`, created with
//! `subject` when missing), explicit acks. A message's NATS headers are the request's headers (each value
//! of a multi-valued header is one pair), its payload the body.
//!
//! - position: `{stream}@{created}/{sequence}`: the JetStream stream sequence (from the message's
//!   `$JS.ACK...` reply subject), the same on every redelivery, after the stream's name and creation
//!   time (unix nanoseconds), so that a stream deleted and made again, whose sequences start again at
//!   1, starts a new order of positions.
//! - receipt: that reply subject. An ack is a double ack (`+ACK` as a request: the server's reply
//!   confirms it was recorded), sent on whatever connection is current, for the whole batch at once.
//! - A request not acknowledged comes again after the consumer's `ack_wait` (a crash, a lost
//!   connection). `rewind` (a failed write) and a reconnect do not wait for that: they `-NAK` the
//!   requests received and not acknowledged, which the server delivers again at once. The runner
//!   recognises a redelivered request by its position either way.
//! - An existing consumer is updated to this config (filter, ack policy, `ack_wait`); one that cannot
//!   be (a push consumer under the same name) is an error said in the log and `GET /v1/sources`.

use super::{default_group, Acked, Received, Request, SourceContext, Transport, TransportError};
use crate::mq::nats::{connect, REQUEST_TIMEOUT};
use crate::mq::nats::{valid_name, valid_subject};
use crate::mq::MqKind;
use crate::setting::{invalid, ConfigError, Millis};
use async_nats::jetstream::{self, consumer, stream};
use futures_core::future::BoxFuture;
use futures_util::StreamExt;
use std::time::Duration;

/// How long the server waits for an ack before delivering a request again (also what a delayd
/// killed between the fsync and the ack costs in delay).
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(60);

/// A `[sources.NAME]` table of kind `nats`: requests read from a JetStream stream by a durable pull
/// consumer.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsSourceConfig {
    /// Where NATS is, `nats://127.0.0.1:4222`; required.
    pub url: Option<String>,
    /// The JetStream stream requests are read from (created with `subject` when missing); required.
    pub stream: Option<String>,
    /// The subjects that stream captures and the consumer takes (wildcards allowed); required.
    pub subject: Option<String>,
    /// The durable pull consumer's name.
    pub group: String,
    /// How long JetStream waits for an ack before delivering a request again.
    pub ack_wait: Millis,
}

impl Default for NatsSourceConfig {
    fn default() -> NatsSourceConfig {
        NatsSourceConfig {
            url: None,
            stream: None,
            subject: None,
            group: default_group(),
            ack_wait: Millis(DEFAULT_ACK_WAIT),
        }
    }
}

impl NatsSourceConfig {
    /// `key`: the table's (`sources.NAME`).
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        MqKind::Nats.required_url(
            key,
            &self.url,
            "a nats source needs url, stream and subject",
        )?;
        if !self.stream.as_deref().is_some_and(valid_name) {
            return Err(invalid(
                &format!("{key}.stream"),
                "the JetStream stream to read (created when missing): a name without whitespace, '.', '*', '>' or slashes",
            ));
        }
        if !self.subject.as_deref().is_some_and(valid_subject) {
            return Err(invalid(
                &format!("{key}.subject"),
                "the subjects the stream captures and delayd consumes, such as \"delayd.>\" (an existing stream must capture them)",
            ));
        }
        if !valid_name(&self.group) {
            return Err(invalid(
                &format!("{key}.group"),
                "the durable consumer's name: no whitespace, '.', '*', '>' or slashes",
            ));
        }
        if self.ack_wait.0 < Duration::from_secs(1) {
            return Err(invalid(&format!("{key}.ack_wait"), "at least 1s"));
        }
        Ok(())
    }

    pub fn build(&self, context: &SourceContext) -> NatsTransport {
        NatsTransport::new(
            self.url.as_deref().unwrap_or_default(),
            self.stream.as_deref().unwrap_or_default(),
            self.subject.as_deref().unwrap_or_default(),
            &self.group,
            self.ack_wait.0,
            context.batch,
        )
    }
}

#[derive(Debug)]
pub struct NatsTransport {
    url: String,
    stream: String,
    subject: String,
    durable: String,
    ack_wait: Duration,
    /// The runner's batch: the consumer lets three times as many requests be unacknowledged, at least
    /// 1,000. The runner holds two batches unacknowledged (one durable, one read ahead), and after a
    /// crash those of the last run are outstanding until `ack_wait`; a pull made while the limit is
    /// full goes unanswered.
    batch: usize,
    connected: Option<(async_nats::Client, consumer::PullConsumer)>,
    /// `{stream}@{created}`: what positions in the stream connected to start with.
    incarnation: String,
    /// Receipts of requests received and not acknowledged: `-NAK`ed on a rewind or a reconnect.
    held: Vec<String>,
}

impl NatsTransport {
    pub fn new(
        url: &str,
        stream: &str,
        subject: &str,
        durable: &str,
        ack_wait: Duration,
        batch: usize,
    ) -> NatsTransport {
        NatsTransport {
            url: url.to_string(),
            stream: stream.to_string(),
            subject: subject.to_string(),
            durable: durable.to_string(),
            ack_wait,
            batch,
            connected: None,
            incarnation: String::new(),
            held: Vec::new(),
        }
    }

    fn connected(&self) -> Result<&(async_nats::Client, consumer::PullConsumer), TransportError> {
        let connected = super::connected(self.connected.as_ref())?;
        if connected.0.connection_state() != async_nats::connection::State::Connected {
            return Err(TransportError("the connection to NATS was lost".into()));
        }
        Ok(connected)
    }

    /// `-NAK`s the held requests (best effort: unacknowledged ones come again after `ack_wait` anyway).
    async fn nak_held(&mut self) {
        let Some((client, _)) = &self.connected else {
            return;
        };
        for receipt in self.held.drain(..) {
            let _ = client.publish(receipt, "-NAK".into()).await;
        }
        let _ = client.flush().await;
    }
}

fn failed(what: &str, error: impl std::fmt::Display) -> TransportError {
    TransportError(format!("{what}: {error}"))
}

/// One JetStream message as a request; `stream_sequence` is from its reply subject, `incarnation`
/// names the stream (see the module doc).
fn request(
    message: &async_nats::Message,
    incarnation: &str,
    stream_sequence: Option<u64>,
) -> Request {
    let receipt = message.reply.as_ref().map(|r| r.to_string());
    let mut headers = Vec::new();
    if let Some(map) = &message.headers {
        for (name, values) in map.iter() {
            for value in values {
                headers.push((name.to_string(), value.as_str().to_string()));
            }
        }
        // The client keeps headers in a hash map, which has no order: sort by name (stable: the values
        // of one name keep theirs).
        headers.sort_by(|a, b| a.0.cmp(&b.0));
    }
    Request {
        unreadable: match (&receipt, stream_sequence) {
            (Some(_), Some(_)) => None,
            _ => Some("not a JetStream message (no $JS.ACK reply subject)".into()),
        },
        position: stream_sequence.map(|seq| format!("{incarnation}/{seq}")),
        receipt: receipt.unwrap_or_default(),
        headers,
        body: message.payload.to_vec(),
        default_target: None,
        default_key: None,
    }
}

impl NatsTransport {
    /// What the server has for this consumer now, up to `max`, without waiting.
    async fn fetch_now(&self, max: usize) -> Result<Vec<jetstream::Message>, TransportError> {
        let (_, consumer) = self.connected()?;
        let batch = consumer
            .fetch()
            .max_messages(max)
            .messages()
            .await
            .map_err(|e| failed("fetching", e))?;
        collect(batch).await
    }

    /// One request, waiting up to `wait` for it.
    async fn fetch_one(&self, wait: Duration) -> Result<Vec<jetstream::Message>, TransportError> {
        let (_, consumer) = self.connected()?;
        let batch = consumer
            .batch()
            .max_messages(1)
            .expires(wait)
            .messages()
            .await
            .map_err(|e| failed("fetching", e))?;
        collect(batch).await
    }
}

async fn collect(
    mut batch: consumer::pull::Batch,
) -> Result<Vec<jetstream::Message>, TransportError> {
    let mut messages = Vec::new();
    while let Some(message) = batch.next().await {
        messages.push(message.map_err(|e| failed("fetching", e))?);
    }
    Ok(messages)
}

impl Transport for NatsTransport {
    fn connect(&mut self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            self.connected = None;
            let client = connect(&self.url).await?;
            let context = jetstream::new(client.clone());
            let stream = context
                .get_or_create_stream(stream::Config {
                    name: self.stream.clone(),
                    subjects: vec![self.subject.clone()],
                    storage: stream::StorageType::File,
                    // A request acknowledged is gone (a stream that kept them would grow for ever, and a
                    // new consumer would take them all again).
                    retention: stream::RetentionPolicy::WorkQueue,
                    ..Default::default()
                })
                .await
                .map_err(|e| failed(&format!("stream {:?}", self.stream), e))?;
            let created = stream.cached_info().created.unix_timestamp_nanos();
            self.incarnation = format!("{}@{created}", self.stream);
            let consumer = stream
                .create_consumer(consumer::pull::Config {
                    durable_name: Some(self.durable.clone()),
                    filter_subject: self.subject.clone(),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    deliver_policy: consumer::DeliverPolicy::All,
                    // Every request is taken however often it comes again.
                    max_deliver: -1,
                    max_ack_pending: i64::try_from(self.batch.saturating_mul(3).max(1000))
                        .unwrap_or(i64::MAX),
                    ..Default::default()
                })
                .await
                .map_err(|e| failed(&format!("consumer {:?}", self.durable), e))?;
            self.connected = Some((client, consumer));
            self.nak_held().await;
            Ok(())
        })
    }

    fn receive(&mut self, max: usize, wait: Duration) -> Received<'_> {
        Box::pin(async move {
            let max = max.max(1);
            // The server answers a pull at once or at its expiry; this bounds a pull whose answer
            // was lost with the connection.
            let bound = wait + REQUEST_TIMEOUT;
            let received = tokio::time::timeout(bound, async {
                let mut messages = self.fetch_now(max).await?;
                if messages.is_empty() && !wait.is_zero() {
                    // Nothing now: wait for one, then take what came with it. A pull for the whole
                    // batch would hold a lone request until its expiry.
                    messages = self.fetch_one(wait).await?;
                    if !messages.is_empty() && max > 1 {
                        messages.extend(self.fetch_now(max - 1).await?);
                    }
                }
                Ok::<_, TransportError>(messages)
            })
            .await
            .map_err(|_| TransportError(format!("no answer from NATS within {bound:?}")))??;
            let requests: Vec<Request> = received
                .iter()
                .map(|m| {
                    let sequence = m.info().ok().map(|i| i.stream_sequence);
                    request(&m.message, &self.incarnation, sequence)
                })
                .collect();
            self.held.extend(
                requests
                    .iter()
                    .map(|r| r.receipt.clone())
                    .filter(|r| !r.is_empty()),
            );
            Ok(requests)
        })
    }

    fn ack<'a>(&'a mut self, receipts: &'a [String]) -> Acked<'a> {
        Box::pin(async move {
            let (client, _) = self.connected()?;
            let acks = receipts.iter().filter(|r| !r.is_empty()).map(|receipt| {
                // A double ack: the server's reply says the ack is recorded.
                client.request(receipt.clone(), "+ACK".into())
            });
            let answers = futures_util::future::join_all(acks).await;
            if let Some(error) = answers.into_iter().find_map(Result::err) {
                return Err(failed("acknowledging", error));
            }
            let acked: std::collections::HashSet<&String> = receipts.iter().collect();
            self.held.retain(|held| !acked.contains(held));
            Ok(receipts.to_vec())
        })
    }

    fn redelivery_window(&self) -> Duration {
        // What was delivered before comes again `ack_wait` after its delivery at the latest.
        self.ack_wait + Duration::from_secs(10)
    }

    /// Stream sequences grow within one incarnation of the stream, which positions name.
    fn ordered_positions(&self) -> bool {
        true
    }

    fn rewind(&mut self) {
        // The runner calls this from async code and waits a second before the next receive: send the
        // `-NAK`s from a task of their own rather than block here.
        if let Some((client, _)) = &self.connected {
            let client = client.clone();
            let held = std::mem::take(&mut self.held);
            tokio::spawn(async move {
                for receipt in held {
                    let _ = client.publish(receipt, "-NAK".into()).await;
                }
                let _ = client.flush().await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_pairs_and_the_payload_is_the_body() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("delayd-delay", "1s");
        headers.insert("delayd-target", "orders.out");
        headers.append("trace", "t1");
        headers.append("trace", "t2");
        let message = async_nats::Message {
            subject: "delayd.in".into(),
            reply: Some("$JS.ACK.DELAYS.delayd.2.17.9.1764583200000000000.4".into()),
            payload: "body".into(),
            headers: Some(headers),
            status: None,
            description: None,
            length: 0,
        };
        let read = request(&message, "DELAYS@1764583200000000000", Some(17));
        assert_eq!(
            read.position.as_deref(),
            Some("DELAYS@1764583200000000000/17")
        );
        assert_eq!(
            read.receipt,
            "$JS.ACK.DELAYS.delayd.2.17.9.1764583200000000000.4"
        );
        assert_eq!(read.body, b"body");
        assert!(read.unreadable.is_none());
        let pairs: Vec<(&str, &str)> = read
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("delayd-delay", "1s"),
                ("delayd-target", "orders.out"),
                ("trace", "t1"),
                ("trace", "t2")
            ]
        );
        // A core NATS message published to the stream's subject without JetStream has no ack subject.
        let plain = async_nats::Message {
            reply: None,
            ..message
        };
        assert!(request(&plain, "DELAYS@1", None).unreadable.is_some());
    }
}
