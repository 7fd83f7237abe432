//! The Kafka sink: produces each due message to the topic its target names, with its key (`delayd-key`,
//! or the request's record key) as the record key, its body as the value, and the headers of its
//! request minus delayd's own (`delayd-*`) plus `delayd-id` (the message id, the same on every attempt:
//! what consumers deduplicate on).
//!
//! The producer is idempotent (`enable.idempotence`) with `acks=all`: a record counts as delivered only
//! on a delivery report without error, after every in-sync replica has it. A broker's error about a
//! record is a failed attempt, retried with the sink's backoff (a topic that does not exist yet among
//! them), except a record the broker can never take (too large for it, a topic name Kafka refuses),
//! which is dead at once. No broker answering (the record timed out in the producer, no broker
//! reachable) uses no attempt: the record waits for one (`SinkOutcome::Unreachable`).

use super::{BoxFuture, Delivery, MqSinkConfig, Reporter, Sink, SinkContext, SinkOutcome};
use crate::connection::ConnectionState;
use crate::mq::kafka::client_config;
use crate::mq::{MqError, MqKind, Targets};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::time::Duration;

/// How long a record may wait for a place in the producer's queue (it is full when the broker is slow
/// or away); the delivery report comes within `message.timeout.ms` after that.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(5);

pub struct KafkaSink {
    config: rdkafka::ClientConfig,
    targets: Targets,
    /// Made anew after a fatal error (an idempotent producer's sequence lost): until then every send
    /// fails.
    producer: std::sync::Mutex<FutureProducer>,
    reporter: Reporter,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("reporter", &self.reporter)
            .finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// The sink a `[sinks.NAME]` table of kind `kafka` describes, and the state of its connection.
    pub fn build(
        config: &MqSinkConfig,
        context: &SinkContext,
    ) -> Result<(KafkaSink, ConnectionState), MqError> {
        let reporter = context.reporter("kafka");
        let connection = reporter.connection().clone();
        let sink = KafkaSink::new(
            config.url.as_deref().unwrap_or_default(),
            context.max_message_bytes,
            config.targets(MqKind::Kafka),
            reporter,
        )?;
        Ok((sink, connection))
    }

    /// `max_message_bytes`: the largest body delayd takes (`limits.max_message_bytes`); the producer
    /// takes records that large, with room for the headers.
    pub fn new(
        url: &str,
        max_message_bytes: usize,
        targets: Targets,
        reporter: Reporter,
    ) -> Result<KafkaSink, MqError> {
        let mut config = client_config(url)?;
        config
            .set("acks", "all")
            .set("enable.idempotence", "true")
            // A report within 30 s rather than librdkafka's default 5 minutes: a cluster away (or a
            // partition without a leader) shows as postponed deliveries within that.
            .set("message.timeout.ms", "30000")
            .set("linger.ms", "2")
            .set(
                "message.max.bytes",
                (max_message_bytes + (256 << 10)).to_string(),
            );
        let producer = config
            .create()
            .map_err(|e| MqError(format!("creating the producer: {e}")))?;
        Ok(KafkaSink {
            config,
            targets,
            producer: std::sync::Mutex::new(producer),
            reporter,
        })
    }

    /// The cluster's metadata: a round trip to a broker (blocking: off the async threads).
    async fn metadata(&self) -> Result<(), String> {
        let producer = self.producer();
        tokio::task::spawn_blocking(move || {
            (producer.client())
                .fetch_metadata(None, Duration::from_secs(5))
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()))
    }

    /// The producer; a new one if the last had a fatal error.
    fn producer(&self) -> FutureProducer {
        let mut producer = self.producer.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((code, reason)) = producer.client().fatal_error() {
            tracing::warn!(?code, %reason, "kafka: the producer had a fatal error; making a new one");
            match self.config.create() {
                Ok(new) => *producer = new,
                Err(error) => tracing::warn!(%error, "kafka: making a new producer failed"),
            }
        }
        producer.clone()
    }

    async fn produce(
        &self,
        producer: &FutureProducer,
        delivery: &Delivery,
    ) -> Result<(), KafkaError> {
        let message = &delivery.message;
        let id = delivery.id.to_string();
        let mut headers = OwnedHeaders::new_with_capacity(message.headers.len() + 1);
        for (name, value) in &message.headers {
            if super::passed_on(name) {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_bytes()),
                });
            }
        }
        headers = headers.insert(Header {
            key: "delayd-id",
            value: Some(id.as_bytes()),
        });
        let mut record = FutureRecord::to(&message.topic)
            .payload(&message.body[..])
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key.as_str());
        }
        producer
            .send(record, QUEUE_TIMEOUT)
            .await
            .map(|_| ())
            .map_err(|(error, _)| error)
    }

    /// Each record's outcome, from its delivery report: never `Err`, as a broker away shows in the
    /// reports (the records time out in the producer).
    async fn send(&self, batch: &[Delivery]) -> Result<Vec<SinkOutcome>, String> {
        let producer = self.producer();
        let refusals: Vec<Option<SinkOutcome>> = (batch.iter())
            .map(|d| self.targets.check(&d.message.topic, None).err())
            .map(|why| why.map(|why| super::forbidden(&why)))
            .collect();
        let sent = batch.iter().zip(&refusals).filter(|(_, r)| r.is_none());
        let results =
            futures_util::future::join_all(sent.map(|(d, _)| self.produce(&producer, d))).await;
        let mut results = results.iter();
        let outcomes: Vec<SinkOutcome> = refusals
            .into_iter()
            .map(|refusal| {
                refusal.unwrap_or_else(|| match results.next() {
                    Some(Ok(())) => SinkOutcome::Delivered,
                    Some(Err(error)) => outcome(error),
                    None => SinkOutcome::Retry {
                        after: None,
                        reason: "kafka: no delivery report".into(),
                    },
                })
            })
            .collect();
        Ok(outcomes)
    }
}

/// What a failed produce means for the message: no broker answered (the record timed out in the
/// producer, no broker is reachable, the producer's queue is full of records waiting for one) said
/// nothing about it.
fn outcome(error: &KafkaError) -> SinkOutcome {
    let reason = format!("kafka: {error}");
    match error.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidTopic,
        ) => SinkOutcome::Dead { reason },
        Some(
            RDKafkaErrorCode::MessageTimedOut
            | RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::QueueFull
            | RDKafkaErrorCode::Fatal,
        ) => SinkOutcome::Unreachable { reason },
        _ => SinkOutcome::Retry {
            after: None,
            reason,
        },
    }
}

impl Sink for KafkaSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(self.reporter.reported(batch, self.send(batch)))
    }

    fn probe(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.reporter.probed(self.metadata()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_the_broker_can_never_take_is_dead_an_unanswered_one_waits_the_rest_retry() {
        for (code, expected) in [
            (RDKafkaErrorCode::MessageSizeTooLarge, "dead"),
            (RDKafkaErrorCode::InvalidTopic, "dead"),
            (RDKafkaErrorCode::UnknownTopicOrPartition, "retry"),
            (RDKafkaErrorCode::MessageTimedOut, "unreachable"),
            (RDKafkaErrorCode::AllBrokersDown, "unreachable"),
        ] {
            let got = match outcome(&KafkaError::MessageProduction(code)) {
                SinkOutcome::Dead { .. } => "dead",
                SinkOutcome::Retry { .. } => "retry",
                SinkOutcome::Unreachable { .. } => "unreachable",
                other => panic!("{code:?}: {other:?}"),
            };
            assert_eq!(got, expected, "{code:?}");
        }
    }
}
