//! The AMQP 0-9-1 (RabbitMQ) sink: publishes each due message to the sink's `exchange` (or the one its
//! request named in `delayd-exchange`) with its topic (the request's target) as the routing key; with
//! the default exchange `""` the target is the queue's name.
//!
//! Each publish is persistent (`delivery_mode` 2), `mandatory`, with `message_id` = the delayd id and the
//! headers of its request minus delayd's own (`delayd-*`) plus `delayd-id` (the same on every attempt:
//! what consumers deduplicate on). The channel is in confirm mode; a message counts as delivered only on
//! the broker's ack without a `basic.return` for it (returns are matched to messages by `message_id`,
//! and one batch is in flight on a channel at a time: the sink holds one channel per batch it may have
//! in flight, `max_in_flight`, on one connection). A returned message (no queue bound for its routing key),
//! a nack, or a channel the broker closed over a message (a publish to an exchange that does not exist:
//! it is opened again for the next call) is a failed attempt, retried with the sink's backoff. A broker
//! that cannot be reached (refused, the connection lost, no confirm within 30 s) said nothing about the
//! messages: they wait for it without using an attempt (`SinkOutcome::Unreachable`).

use super::{
    check_targets, require_sink_url, BoxFuture, Delivery, Reporter, Sink, SinkContext, SinkOutcome,
};
use crate::connection::ConnectionState;
use crate::mq::amqp::{close, connect, valid_name, CONNECT_TIMEOUT};
use crate::mq::{MqKind, Targets, EXCHANGE_HEADER};
use crate::setting::{invalid, ConfigError};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use lapin::{Confirmation, PublisherConfirm};
use std::time::Duration;
use tokio::sync::Mutex;

/// Channels at most, whatever `max_in_flight` says (RabbitMQ's `channel_max` is 2,047 by default).
const MAX_CHANNELS: usize = 256;

/// How long a batch may wait for its confirms.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// A `[sinks.NAME]` table of kind `amqp`.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmqpSinkConfig {
    /// Where the broker is, `amqp://user:password@host:5672/vhost`; required.
    pub url: Option<String>,
    /// The exchange to publish to, with the target as the routing key; `""` (the default exchange)
    /// delivers to the queue the target names.
    pub exchange: Option<String>,
    /// Exchanges other than `exchange` a request may name in `delayd-exchange`.
    pub exchanges: Vec<String>,
    /// Glob patterns (`*`, `?`) of the routing keys a request may name; empty: any.
    pub targets: Vec<String>,
}

impl AmqpSinkConfig {
    /// `key`: the table's (`sinks.NAME`).
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        require_sink_url(MqKind::Amqp, key, &self.url)?;
        if self.exchange.as_ref().is_some_and(|e| !valid_name(e)) {
            return Err(invalid(
                &format!("{key}.exchange"),
                "an exchange name has at most 255 bytes of [A-Za-z0-9._:-] (\"\" is the default exchange)",
            ));
        }
        if let Some(bad) = self.exchanges.iter().find(|e| !valid_name(e)) {
            return Err(invalid(
                &format!("{key}.exchanges"),
                format!("{bad:?}: an exchange name has at most 255 bytes of [A-Za-z0-9._:-]"),
            ));
        }
        check_targets(key, &self.targets)
    }

    /// Where the sink may publish.
    pub fn targets(&self) -> Targets {
        let exchange = self.exchange.as_deref().unwrap_or("");
        Targets::new(MqKind::Amqp, &self.targets, exchange, &self.exchanges)
    }

    pub fn build(&self, context: &SinkContext) -> (AmqpSink, ConnectionState) {
        let reporter = context.reporter("amqp");
        let connection = reporter.connection().clone();
        let sink = AmqpSink::new(
            self.url.as_deref().unwrap_or_default(),
            self.exchange.as_deref().unwrap_or(""),
            self.targets(),
            context.max_in_flight,
            reporter,
        );
        (sink, connection)
    }
}

pub struct AmqpSink {
    url: String,
    exchange: String,
    targets: Targets,
    connection: Mutex<Option<Connection>>,
    /// Confirming channels, each held from a batch's first publish to its last confirm: lapin hands a
    /// `basic.return` to whichever confirm it resolves next on the channel, not to its own publish, so
    /// returns are matched to this batch's messages by `message_id`, and no other batch's may be in
    /// flight on the channel meanwhile.
    channels: Vec<Mutex<Option<Channel>>>,
    /// The channel the next batch tries first.
    next: std::sync::atomic::AtomicUsize,
    reporter: Reporter,
}

impl std::fmt::Debug for AmqpSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSink")
            .field("exchange", &self.exchange)
            .field("reporter", &self.reporter)
            .finish_non_exhaustive()
    }
}

/// Why one message could not be published: the first waits for the connection, the second is dead.
enum Unpublishable {
    Connection(String),
    Message(String),
}

/// Why a publish has no confirm.
enum Unconfirmed {
    /// Settled already (not published, or no confirm in time).
    Outcome(SinkOutcome),
    /// Its channel closed: by the broker over this message, or with the connection.
    ChannelClosed(String),
}

impl AmqpSink {
    /// `channels`: the batches it may have in flight (the sink's `max_in_flight`, up to 256).
    pub fn new(
        url: &str,
        exchange: &str,
        targets: Targets,
        channels: usize,
        reporter: Reporter,
    ) -> AmqpSink {
        AmqpSink {
            url: url.to_string(),
            exchange: exchange.to_string(),
            targets,
            connection: Mutex::new(None),
            channels: (0..channels.clamp(1, MAX_CHANNELS))
                .map(|_| Mutex::new(None))
                .collect(),
            next: std::sync::atomic::AtomicUsize::new(0),
            reporter,
        }
    }

    /// A confirming channel in `held`: the one there if it is open, else a new one (on a new
    /// connection if the connection failed).
    async fn channel(&self, held: &mut Option<Channel>) -> Result<Channel, String> {
        let mut open = self.connection.lock().await;
        if let Some(connection) = open.as_ref() {
            if connection.status().connected() {
                match held.as_ref() {
                    Some(channel) if channel.status().connected() => return Ok(channel.clone()),
                    // None yet, or a closed one (say, after a publish to a missing exchange).
                    _ => {
                        let channel = confirming(connection).await?;
                        *held = Some(channel.clone());
                        return Ok(channel);
                    }
                }
            }
            close(connection).await;
            *open = None;
        }
        let connection = connect(&self.url).await.map_err(|e| e.0)?;
        let channel = match confirming(&connection).await {
            Ok(channel) => channel,
            Err(e) => {
                close(&connection).await;
                return Err(e);
            }
        };
        *open = Some(connection);
        *held = Some(channel.clone());
        Ok(channel)
    }

    /// The connection, checked: made again when it is lost.
    async fn ping(&self) -> Result<(), String> {
        let mut open = self.connection.lock().await;
        if open.as_ref().is_some_and(|c| c.status().connected()) {
            return Ok(());
        }
        if let Some(lost) = open.take() {
            close(&lost).await;
        }
        *open = Some(connect(&self.url).await.map_err(|e| e.0)?);
        Ok(())
    }

    /// One outcome per delivery; `Err` when the MQ could not be reached at all.
    async fn send(&self, batch: &[Delivery]) -> Result<Vec<SinkOutcome>, String> {
        // A free channel, else the next in turn (waiting for its batch).
        let first = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let slots = self.channels.len();
        let mut held =
            match (0..slots).find_map(|i| self.channels[(first + i) % slots].try_lock().ok()) {
                Some(held) => held,
                None => self.channels[first % slots].lock().await,
            };
        let channel = self.channel(&mut held).await?;
        let mut confirms = Vec::with_capacity(batch.len());
        for delivery in batch {
            let named = named_exchange(delivery);
            if let Err(why) = self.targets.check(&delivery.message.topic, named) {
                confirms.push(Err(super::forbidden(&why)));
                continue;
            }
            let published = match self.publish(&channel, delivery).await {
                Ok(confirm) => Ok(confirm),
                Err(Unpublishable::Message(reason)) => Err(SinkOutcome::Dead { reason }),
                Err(Unpublishable::Connection(reason)) => Err(SinkOutcome::Unreachable { reason }),
            };
            confirms.push(published);
        }
        // Every confirm first (one deadline for the batch), then the returns they carry, each matched
        // to its message by `message_id`: the confirm a return comes with may be another message's.
        let deadline = tokio::time::Instant::now() + CONFIRM_TIMEOUT;
        let mut answers = Vec::with_capacity(batch.len());
        let mut returned = std::collections::HashMap::new();
        for confirm in confirms {
            let answer = match confirm {
                Err(outcome) => Err(Unconfirmed::Outcome(outcome)),
                Ok(confirm) => match tokio::time::timeout_at(deadline, confirm).await {
                    Err(_) => {
                        // A late confirm or return must not be taken for the next batch's.
                        *held = None;
                        Err(Unconfirmed::Outcome(SinkOutcome::Unreachable {
                            reason: "amqp: no publisher confirm within 30 s".into(),
                        }))
                    }
                    Ok(Err(e)) => Err(Unconfirmed::ChannelClosed(e.to_string())),
                    Ok(Ok(confirmation)) => Ok(confirmation),
                },
            };
            if let Ok(Confirmation::Ack(Some(back)) | Confirmation::Nack(Some(back))) = &answer {
                if let Some(id) = back.delivery.properties.message_id() {
                    returned.insert(
                        id.to_string(),
                        (back.reply_code, back.reply_text.to_string()),
                    );
                }
            }
            answers.push(answer);
        }
        // A channel closed under a publish: by the broker over this message (a missing exchange), an
        // answer about it, when the connection is still there; else the connection was lost.
        let connected = match answers
            .iter()
            .any(|a| matches!(a, Err(Unconfirmed::ChannelClosed(_))))
        {
            true => (self.connection.lock().await.as_ref())
                .is_some_and(|connection| connection.status().connected()),
            false => true,
        };
        let mut outcomes = Vec::with_capacity(batch.len());
        for (delivery, answer) in batch.iter().zip(answers) {
            let outcome = match (answer, returned.get(&delivery.id.to_string())) {
                (Err(Unconfirmed::Outcome(outcome)), _) => outcome,
                (Err(Unconfirmed::ChannelClosed(e)), _) => {
                    let reason = format!("amqp: publish not confirmed: {e}");
                    match connected {
                        true => retry(reason),
                        false => SinkOutcome::Unreachable { reason },
                    }
                }
                (Ok(_), Some((code, text))) => retry(format!(
                    "amqp: returned unroutable ({code} {text}): no queue is bound to exchange {:?} with routing key {:?}",
                    self.exchange_of(delivery),
                    delivery.message.topic
                )),
                (Ok(Confirmation::Ack(_)), None) => SinkOutcome::Delivered,
                (Ok(Confirmation::Nack(_)), None) => {
                    retry("amqp: the broker nacked the publish".into())
                }
                (Ok(Confirmation::NotRequested), None) => {
                    retry("amqp: the channel is not in confirm mode".into())
                }
            };
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }

    fn exchange_of<'a>(&'a self, delivery: &'a Delivery) -> &'a str {
        named_exchange(delivery).unwrap_or(self.exchange.as_str())
    }

    async fn publish(
        &self,
        channel: &Channel,
        delivery: &Delivery,
    ) -> Result<PublisherConfirm, Unpublishable> {
        let message = &delivery.message;
        let id = delivery.id.to_string();
        let short = |what: &str, text: &str| {
            ShortString::try_new(text).map_err(|_| {
                Unpublishable::Message(format!("{what} {text:?} is longer than 255 bytes"))
            })
        };
        let mut headers = FieldTable::default();
        for (name, value) in &message.headers {
            if super::passed_on(name) {
                headers.insert(
                    short("the header name", name)?,
                    AMQPValue::LongString(LongString::from(value.as_str())),
                );
            }
        }
        headers.insert(
            ShortString::from("delayd-id"),
            AMQPValue::LongString(LongString::from(id.as_str())),
        );
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(short("the id", &id)?)
            .with_headers(headers);
        channel
            .basic_publish(
                short("the exchange", self.exchange_of(delivery))?,
                short("the target", &message.topic)?,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &message.body,
                properties,
            )
            .await
            .map_err(|e| Unpublishable::Connection(format!("amqp: publish: {e}")))
    }
}

/// The exchange a message's request named (`delayd-exchange`), if it named one.
fn named_exchange(delivery: &Delivery) -> Option<&str> {
    delivery
        .message
        .headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(EXCHANGE_HEADER))
        .map(|(_, value)| value.trim())
}

fn retry(reason: String) -> SinkOutcome {
    SinkOutcome::Retry {
        after: None,
        reason,
    }
}

/// A channel in confirm mode (within the connect timeout: a broker that does not answer must not hold
/// the connection's lock, and every batch with it).
async fn confirming(connection: &Connection) -> Result<Channel, String> {
    tokio::time::timeout(CONNECT_TIMEOUT, async {
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| format!("opening a channel: {e}"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| format!("confirm.select: {e}"))?;
        Ok(channel)
    })
    .await
    .map_err(|_| "opening a channel timed out".to_string())?
}

impl Sink for AmqpSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(self.reporter.reported(batch, self.send(batch)))
    }

    fn probe(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.reporter.probed(self.ping()))
    }
}
