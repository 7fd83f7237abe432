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
//!
//! Recurring requests (NATS ADR-51; the runner does the rest, mod.rs): as in a stream with message
//! schedules, the subject a request is published on is its schedule's identity, so a request makes
//! or replaces the schedule of its subject, and the next request on that subject replaces it.
//! - `Nats-Schedule: @every <Go duration>` (`@every 30s`, `@every 5m`, `@every 1h30m`: whole
//!   milliseconds, at least 1 s), `@yearly` (`@annually`), `@monthly`, `@weekly`, `@daily`
//!   (`@midnight`), `@hourly`, or a cron of 6 fields, seconds first (`0 0 9 * * *`, `*/2 * * * * *`);
//!   `Nats-Schedule: @at <RFC 3339>` stays a one-off delivery.
//! - `Nats-Schedule-Time-Zone: Europe/Berlin`: an IANA zone for a cron (default `UTC`); refused
//!   (`invalid_tz`) with `@every` or `@at`, as ADR-51 has it.
//! - Where: `delayd-target` or `Nats-Schedule-Target`; key: `delayd-key`; the firings go to the
//!   source's sink with the request's body and the headers it passes on (all but `delayd-*` and the
//!   `Nats-Schedule*` headers read here; one given more than once, once, its values joined by `,`),
//!   plus `delayd-schedule` and `delayd-fire-at`. The other ADR-51 headers are not read:
//!   `Nats-Schedule-Source`, `Nats-Schedule-TTL` and `Nats-Schedule-Rollup` are passed on as they are.
//! - The schedule's id ([`schedule_id`]): `nats.{source}.{subject}` when that is a valid schedule id
//!   (`[A-Za-z0-9._-]{1,200}`) and the source's name has no `.` (so that the id says where the source's
//!   name ends); otherwise `nats-{hash}.{readable}`, where `hash` is the first 16 hex digits of the
//!   SHA-256 of `{source}/{subject}` and `readable` is `{source}.{subject}` with each character outside
//!   `[A-Za-z0-9._-]` made `_`, the whole cut to 200 bytes. The two forms differ from their fifth
//!   character on, the first one never names two subjects, the second one names two only through a
//!   64-bit hash collision. A schedule made so is listed, paused and deleted through the API like any.

use super::{default_group, Acked, Received, Request, SourceContext, Transport, TransportError};
use crate::mq::nats::{connect, REQUEST_TIMEOUT};
use crate::mq::nats::{valid_name, valid_subject};
use crate::mq::MqKind;
use crate::schedule::valid_id;
use crate::setting::{invalid, ConfigError, Millis};
use async_nats::jetstream::{self, consumer, stream};
use futures_core::future::BoxFuture;
use futures_util::StreamExt;
use sha2::Digest;
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
            &context.name,
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
    /// The source's name, in the ids of the schedules recurring requests make.
    source: String,
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
        source: &str,
        url: &str,
        stream: &str,
        subject: &str,
        durable: &str,
        ack_wait: Duration,
        batch: usize,
    ) -> NatsTransport {
        NatsTransport {
            source: source.to_string(),
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

/// The id of the recurring schedule that requests published on `subject` make for the source
/// `source` (module doc).
pub fn schedule_id(source: &str, subject: &str) -> String {
    let plain = format!("nats.{source}.{subject}");
    if !source.contains('.') && valid_id(&plain) {
        return plain;
    }
    let digest = sha2::Sha256::digest(format!("{source}/{subject}"));
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let readable: String = format!("{source}.{subject}")
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                true => c,
                false => '_',
            },
        )
        .collect();
    let mut id = format!("nats-{hash}.{readable}");
    id.truncate(200); // ASCII: on a character boundary
    id
}

/// One JetStream message as a request of the source `source`; `stream_sequence` is from its reply
/// subject, `incarnation` names the stream (see the module doc).
fn request(
    message: &async_nats::Message,
    source: &str,
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
        schedule_id: Some(schedule_id(source, &message.subject)),
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
                    request(&m.message, &self.source, &self.incarnation, sequence)
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
        let read = request(&message, "in", "DELAYS@1764583200000000000", Some(17));
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
        assert_eq!(read.schedule_id.as_deref(), Some("nats.in.delayd.in"));
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
        assert!(request(&plain, "in", "DELAYS@1", None).unreadable.is_some());
    }

    #[test]
    fn a_subject_names_one_schedule_of_its_source() {
        assert_eq!(read_id("in", "delayd.in.tick"), "nats.in.delayd.in.tick");
        assert_eq!(read_id("orders-in", "a-b_c.9"), "nats.orders-in.a-b_c.9");
        // Not valid as they are: a readable form after a hash of both names.
        let dollar = schedule_id("in", "$SCHED.tick");
        assert!(dollar.starts_with("nats-") && dollar.ends_with(".in._SCHED.tick"));
        assert_eq!(dollar.len(), "nats-".len() + 16 + ".in._SCHED.tick".len());
        let long = schedule_id("in", &format!("t.{}", "x".repeat(300)));
        assert_eq!(long.len(), 200);
        // A source name with a dot would make `nats.a.b.c` name two subjects: hashed, each its own.
        let (dotted, plain) = (schedule_id("a.b", "c"), schedule_id("a", "b.c"));
        assert_eq!(plain, "nats.a.b.c");
        assert!(dotted.starts_with("nats-"));
        assert_ne!(dotted, plain);
        // Subjects that read the same once made readable still differ by their hash.
        assert_ne!(schedule_id("in", "a:b"), schedule_id("in", "a;b"));
        for id in [dollar, long, dotted, schedule_id("in", "ü.ö")] {
            assert!(valid_id(&id), "{id}");
        }
        // The same names, the same id, whatever the run.
        assert_eq!(schedule_id("in", "a:b"), schedule_id("in", "a:b"));
    }

    fn read_id(source: &str, subject: &str) -> String {
        let id = schedule_id(source, subject);
        assert!(valid_id(&id), "{id}");
        id
    }
}
