//! The AMQP 0-9-1 (RabbitMQ) transport: a consumer with manual acknowledgements on one durable queue
//! (declared when missing), `basic.qos` prefetch = twice the source's batch (one batch being stored
//! while the next is received), `basic.ack` after the fsync.
//!
//! - A request's headers are the message's AMQP headers table, each value as text (strings as they are,
//!   integers, floats, decimals and booleans written out: `x-delay` arrives as an integer from the
//!   delayed-message exchange's clients). A header whose value is a table, an array or bytes, or a
//!   string that is not UTF-8, makes the request a dead letter with the reason: delayd keeps text
//!   headers only, and drops nothing silently.
//! - Its position (what a redelivery is recognised by) is the `message_id` property when set; without
//!   one a request redelivered after a crash between the fsync and the ack is scheduled again.
//! - Its receipt is the delivery tag. A batch is acknowledged with one `basic.ack multiple=true` on the
//!   highest tag when its tags are contiguous, else tag by tag. `multiple` is safe: every batch is
//!   either acknowledged whole or rewound, in order, so no lower tag is outstanding on the channel.
//!   AMQP does not answer a `basic.ack`; a `basic.qos` after it does (`qos-ok`), and the broker handles
//!   a channel's methods in order, so once it answered the acknowledgements were taken. One such round
//!   trip confirms the acknowledgements sent in the last 100 ms (and at idle and at a stop), not one per
//!   batch. Until then the runner keeps the batches' positions: a connection lost with the acks unsent
//!   or unconfirmed redelivers them, and they are recognised and not scheduled twice.
//! - Rewind (a batch that could not be stored) reopens the channel: the broker requeues what the old
//!   one had unacknowledged and delivers it again. A `basic.reject requeue` per tag would do too, but
//!   deliveries the client prefetched and buffered meanwhile would then be acknowledged under tags the
//!   broker had requeued; a new channel leaves nothing ambiguous.
//! - Its default target (when no `delayd-target` header says where) is the routing key it was published
//!   with, as with the delayed-message exchange, except the queue's own name (a publish straight to the
//!   queue through the default exchange), which would bring the message back to delayd.
//! - Only `amqp://` (no TLS): delayd is built without a TLS stack for AMQP.

use super::{Acked, Received, Request, SourceContext, Transport, TransportError};
use crate::mq::amqp::{close, connect, CONNECT_TIMEOUT};
use crate::mq::MqKind;
use crate::setting::{invalid, ConfigError};
use futures_core::future::BoxFuture;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection, Consumer};
use std::time::Duration;

/// A `[sources.NAME]` table of kind `amqp`: requests consumed from a durable queue.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmqpSourceConfig {
    /// Where the broker is, `amqp://user:password@host:5672/vhost`; required.
    pub url: Option<String>,
    /// The durable queue requests are consumed from (declared when missing); required.
    pub queue: Option<String>,
}

impl AmqpSourceConfig {
    /// `key`: the table's (`sources.NAME`).
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        let missing = format!(
            "an amqp source needs url ({}) and queue, and has no stream_key",
            MqKind::Amqp.url_example()
        );
        MqKind::Amqp.required_url(key, &self.url, &missing)?;
        match self.queue.as_deref() {
            Some(queue)
                if crate::mq::amqp::valid_name(queue)
                    && !queue.is_empty()
                    && !queue.starts_with("amq.") =>
            {
                Ok(())
            }
            _ => Err(invalid(
                &format!("{key}.queue"),
                "an amqp source needs a queue: 1 to 255 bytes of [A-Za-z0-9._:-], not starting with amq.",
            )),
        }
    }

    pub fn build(&self, context: &SourceContext) -> AmqpTransport {
        AmqpTransport::new(
            self.url.as_deref().unwrap_or_default(),
            self.queue.as_deref().unwrap_or_default(),
            &context.name,
            context.batch,
        )
    }
}

#[derive(Debug)]
pub struct AmqpTransport {
    url: String,
    queue: String,
    consumer_tag: String,
    prefetch: u16,
    open: Option<Open>,
    /// The next receive opens a new channel first (after a rewind).
    reopen: bool,
    /// Receipts whose `basic.ack` was sent and not yet confirmed, and when the first of them was.
    sent: Vec<String>,
    sent_since: Option<std::time::Instant>,
}

/// How long a sent `basic.ack` may wait to be confirmed (by a `basic.qos` round trip): one round trip
/// per batch held the source's loop as long again as its fsync.
const CONFIRM_EVERY: Duration = Duration::from_millis(100);

struct Open {
    connection: Connection,
    channel: Channel,
    consumer: Consumer,
}

impl std::fmt::Debug for Open {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Open")
            .field("channel", &self.channel.id())
            .finish_non_exhaustive()
    }
}

fn failed(what: &str, error: impl std::fmt::Display) -> TransportError {
    TransportError(format!("{what}: {error}"))
}

impl AmqpTransport {
    pub fn new(url: &str, queue: &str, source: &str, batch: usize) -> AmqpTransport {
        AmqpTransport {
            url: url.to_string(),
            queue: queue.to_string(),
            consumer_tag: format!("delayd-{source}"),
            prefetch: u16::try_from(batch.saturating_mul(2)).unwrap_or(u16::MAX),
            open: None,
            reopen: false,
            sent: Vec::new(),
            sent_since: None,
        }
    }

    /// Confirms the acknowledgements sent: the broker answers a `basic.qos` after it took them (a
    /// channel's methods are handled in order). Returns their receipts.
    async fn confirm(&mut self) -> Result<Vec<String>, TransportError> {
        if self.sent.is_empty() {
            return Ok(Vec::new());
        }
        let open = super::connected(self.open.as_ref())?;
        tokio::time::timeout(
            CONNECT_TIMEOUT,
            open.channel
                .basic_qos(self.prefetch, BasicQosOptions::default()),
        )
        .await
        .map_err(|_| TransportError("no answer to basic.qos after basic.ack".into()))?
        .map_err(|e| failed("basic.qos after basic.ack", e))?;
        self.sent_since = None;
        Ok(std::mem::take(&mut self.sent))
    }

    /// A channel consuming the queue, on `connection`.
    async fn consume(
        &self,
        connection: &Connection,
    ) -> Result<(Channel, Consumer), TransportError> {
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| failed("opening a channel", e))?;
        channel
            .queue_declare(
                ShortString::from(self.queue.as_str()),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| failed(&format!("declaring the queue {:?}", self.queue), e))?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| failed("basic.qos", e))?;
        let consumer = channel
            .basic_consume(
                ShortString::from(self.queue.as_str()),
                ShortString::from(self.consumer_tag.as_str()),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| failed(&format!("consuming the queue {:?}", self.queue), e))?;
        Ok((channel, consumer))
    }

    /// Replaces the channel: what the old one had unacknowledged is delivered again.
    async fn reopen(&mut self) -> Result<(), TransportError> {
        let open = super::connected(self.open.take())?;
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            open.channel.close(200, ShortString::from("delayd rewinds")),
        )
        .await;
        let (channel, consumer) =
            tokio::time::timeout(CONNECT_TIMEOUT, self.consume(&open.connection))
                .await
                .map_err(|_| TransportError("reopening the channel timed out".into()))??;
        self.opened(Open {
            connection: open.connection,
            channel,
            consumer,
        });
        Ok(())
    }

    /// Holds a new channel (after a connect or a reopen). The acknowledgements sent and not
    /// confirmed went with the old one: unconfirmed, their requests come again (and are recognised).
    fn opened(&mut self, open: Open) {
        self.open = Some(open);
        self.reopen = false;
        self.sent.clear();
        self.sent_since = None;
    }

    fn request(&self, delivery: lapin::message::Delivery) -> Request {
        let mut request = Request {
            position: delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str().to_string())
                .filter(|id| !id.is_empty()),
            receipt: delivery.delivery_tag.to_string(),
            headers: Vec::new(),
            body: delivery.data,
            unreadable: None,
            default_target: Some(delivery.routing_key.as_str().to_string())
                .filter(|key| !key.is_empty() && *key != self.queue),
            default_key: None,
            schedule_id: None,
        };
        if let Some(table) = delivery.properties.headers() {
            for (name, value) in table.inner() {
                match text(value) {
                    Ok(value) => request.headers.push((name.as_str().to_string(), value)),
                    Err(kind) => {
                        // Kept in the dead letter as its rendering.
                        let rendered = format!("{value:?}");
                        request.refuse(format!(
                            "header {:?} is {kind}: delayd keeps text, number and boolean headers only (the dead letter keeps its rendering)",
                            name.as_str()
                        ));
                        request.headers.push((name.as_str().to_string(), rendered));
                    }
                }
            }
        }
        request
    }
}

/// A header value as text; what it is when it has none.
fn text(value: &AMQPValue) -> Result<String, &'static str> {
    Ok(match value {
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        AMQPValue::DecimalValue(d) => {
            let scale = u32::from(d.scale);
            let value = f64::from(d.value) / 10f64.powi(scale as i32);
            format!("{value:.*}", scale as usize)
        }
        AMQPValue::Timestamp(t) => t.to_string(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::LongString(s) => {
            String::from_utf8(s.as_bytes().to_vec()).map_err(|_| "a string that is not UTF-8")?
        }
        AMQPValue::Void => String::new(),
        AMQPValue::FieldArray(_) => return Err("an array"),
        AMQPValue::FieldTable(_) => return Err("a table"),
        AMQPValue::ByteArray(_) => return Err("a byte array"),
    })
}

/// The receipts as one `multiple` ack (the highest tag) when they are contiguous, else each tag.
fn ack_plan(receipts: &[String]) -> Result<(Vec<u64>, bool), TransportError> {
    let mut tags = receipts
        .iter()
        .map(|r| r.parse::<u64>())
        .collect::<Result<Vec<u64>, _>>()
        .map_err(|e| failed("a receipt is not a delivery tag", e))?;
    tags.sort_unstable();
    tags.dedup();
    match (tags.first(), tags.last()) {
        (Some(&low), Some(&high)) if high - low + 1 == tags.len() as u64 => Ok((vec![high], true)),
        _ => Ok((tags, false)),
    }
}

/// The next delivery of the consumer (None: it was cancelled).
async fn next(consumer: &mut Consumer) -> Option<lapin::Result<lapin::message::Delivery>> {
    use futures_core::Stream;
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *consumer).poll_next(cx)).await
}

impl Transport for AmqpTransport {
    fn connect(&mut self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            if let Some(old) = self.open.take() {
                close(&old.connection).await;
            }
            let connection = connect(&self.url).await?;
            let (channel, consumer) =
                match tokio::time::timeout(CONNECT_TIMEOUT, self.consume(&connection)).await {
                    Ok(Ok(consumed)) => consumed,
                    Ok(Err(e)) => {
                        close(&connection).await;
                        return Err(e);
                    }
                    Err(_) => {
                        close(&connection).await;
                        return Err(TransportError("declaring and consuming timed out".into()));
                    }
                };
            self.opened(Open {
                connection,
                channel,
                consumer,
            });
            Ok(())
        })
    }

    fn receive(&mut self, max: usize, wait: Duration) -> Received<'_> {
        Box::pin(async move {
            if self.reopen {
                self.reopen().await?;
            }
            let open = super::connected(self.open.as_mut())?;
            let mut deliveries = Vec::new();
            let gone = || TransportError("the broker cancelled the consumer".into());
            match tokio::time::timeout(wait, next(&mut open.consumer)).await {
                Err(_) => return Ok(Vec::new()),
                Ok(None) => return Err(gone()),
                Ok(Some(delivery)) => {
                    deliveries.push(delivery.map_err(|e| failed("consuming", e))?)
                }
            }
            // Then what has arrived already, without waiting (tokio's timeout polls the future first).
            while deliveries.len() < max {
                match tokio::time::timeout(Duration::ZERO, next(&mut open.consumer)).await {
                    Err(_) => break,
                    Ok(None) => return Err(gone()),
                    Ok(Some(delivery)) => {
                        deliveries.push(delivery.map_err(|e| failed("consuming", e))?)
                    }
                }
            }
            Ok(deliveries.into_iter().map(|d| self.request(d)).collect())
        })
    }

    fn ack<'a>(&'a mut self, receipts: &'a [String]) -> Acked<'a> {
        Box::pin(async move {
            if receipts.is_empty() {
                return Ok(Vec::new());
            }
            let open = super::connected(self.open.as_ref())?;
            let (tags, multiple) = ack_plan(receipts)?;
            for tag in tags {
                open.channel
                    .basic_ack(tag, BasicAckOptions { multiple })
                    .await
                    .map_err(|e| failed("basic.ack", e))?;
            }
            self.sent.extend_from_slice(receipts);
            let since = *self.sent_since.get_or_insert_with(std::time::Instant::now);
            match since.elapsed() >= CONFIRM_EVERY {
                true => self.confirm().await,
                false => Ok(Vec::new()),
            }
        })
    }

    fn flush(&mut self) -> Acked<'_> {
        Box::pin(self.confirm())
    }

    fn redelivery_window(&self) -> Duration {
        // The broker requeues what an old connection left unacknowledged only once it sees that
        // connection dead, which for one cut off without a close takes up to two heartbeat intervals
        // (60 s each by default).
        Duration::from_secs(130)
    }

    fn rewind(&mut self) {
        self.reopen = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receipts(tags: &[u64]) -> Vec<String> {
        tags.iter().map(u64::to_string).collect()
    }

    #[test]
    fn contiguous_tags_are_one_multiple_ack() {
        let plan = |tags: &[u64]| ack_plan(&receipts(tags)).unwrap();
        assert_eq!(plan(&[3, 1, 2]), (vec![3], true));
        assert_eq!(plan(&[7]), (vec![7], true));
        assert_eq!(plan(&[1, 2, 4]), (vec![1, 2, 4], false));
        assert!(ack_plan(&["x".to_string()]).is_err());
    }

    #[test]
    fn header_values_as_text() {
        use lapin::types::{DecimalValue, FieldArray, LongString};
        assert_eq!(text(&AMQPValue::LongInt(1500)), Ok("1500".into()));
        assert_eq!(text(&AMQPValue::LongLongInt(-5)), Ok("-5".into()));
        assert_eq!(text(&AMQPValue::Boolean(true)), Ok("true".into()));
        assert_eq!(
            text(&AMQPValue::LongString(LongString::from("orders"))),
            Ok("orders".into())
        );
        assert_eq!(
            text(&AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 1234
            })),
            Ok("12.34".into())
        );
        assert_eq!(
            text(&AMQPValue::LongString(LongString::from(vec![0xff, 0xfe]))),
            Err("a string that is not UTF-8")
        );
        assert_eq!(
            text(&AMQPValue::FieldArray(FieldArray::default())),
            Err("an array")
        );
    }
}
