//! The NATS JetStream sink: publishes each due message's body to the subject its topic names (the
//! request's `delayd-target`), with its headers minus delayd's own (`delayd-*`), plus `delayd-id` and
//! `Nats-Msg-Id`, both the message id (the same on every attempt: JetStream drops a second copy within
//! the stream's duplicate window, and consumers can deduplicate on it past that).
//!
//! A batch is published at once and its PubAcks awaited together. A message counts as delivered only on
//! its PubAck (a duplicate's PubAck too: the first copy is stored). A server that cannot be reached (the
//! connection refused or lost, no PubAck in time) said nothing about the messages: they wait for it
//! without using an attempt (`SinkOutcome::Unreachable`). The target subject must be captured
//! by some stream: a subject no stream captures has no responder, and the publish is retried with the
//! sink's backoff (and dead after `max_attempts`), with the reason saying so. A subject with a wildcard
//! or an empty token, a header NATS cannot carry or a message over the server's `max_payload` is dead at
//! once: no retry can fix it.

use super::{
    forbidden, BoxFuture, Delivery, MqSinkConfig, Reporter, Sink, SinkContext, SinkOutcome,
};
use crate::connection::ConnectionState;
use crate::mq::nats::{connect, REQUEST_TIMEOUT};
use crate::mq::{MqKind, Targets};
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use std::str::FromStr;
use tokio::sync::Mutex;

#[derive(Debug)]
pub struct NatsSink {
    url: String,
    targets: Targets,
    connection: Mutex<Option<(async_nats::Client, async_nats::jetstream::Context)>>,
    reporter: Reporter,
}

/// The headers a message is published with, or why it cannot be.
fn headers(delivery: &Delivery) -> Result<HeaderMap, String> {
    let id = delivery.id.to_string();
    let mut map = HeaderMap::new();
    map.insert("delayd-id", id.as_str());
    map.insert("Nats-Msg-Id", id.as_str());
    for (name, value) in &delivery.message.headers {
        // delayd's own, and a Nats-Msg-Id of the application's: the id is the message's. JetStream's
        // publish controls were meant for the request's own stream, not the target's (an expected
        // stream or sequence would fail every attempt there; a rollup would purge the target).
        let lower = name.to_ascii_lowercase();
        if !super::passed_on(name)
            || lower == "nats-msg-id"
            || lower.starts_with("nats-expected-")
            || lower.starts_with("nats-batch-")
            || lower == "nats-rollup"
            || lower == "nats-ttl"
        {
            continue;
        }
        let name = HeaderName::from_str(name)
            .map_err(|_| format!("header {name:?} is not a valid NATS header name"))?;
        let value = HeaderValue::from_str(value)
            .map_err(|_| format!("header {name}: its value cannot be a NATS header value"))?;
        map.append(name, value);
    }
    Ok(map)
}

/// Whether one can publish to `subject`: no wildcard, no empty token.
fn publishable(subject: &str) -> bool {
    !subject.is_empty()
        && subject
            .split('.')
            .all(|token| !token.is_empty() && token != "*" && token != ">")
}

impl NatsSink {
    /// The sink a `[sinks.NAME]` table of kind `nats` describes, and the state of its connection.
    pub fn build(config: &MqSinkConfig, context: &SinkContext) -> (NatsSink, ConnectionState) {
        let reporter = context.reporter("nats");
        let connection = reporter.connection().clone();
        let sink = NatsSink::new(
            config.url.as_deref().unwrap_or_default(),
            config.targets(MqKind::Nats),
            reporter,
        );
        (sink, connection)
    }

    pub fn new(url: &str, targets: Targets, reporter: Reporter) -> NatsSink {
        NatsSink {
            url: url.to_string(),
            targets,
            connection: Mutex::new(None),
            reporter,
        }
    }

    /// The current connection and its JetStream context: made again when the connection is lost, so
    /// that a server away fails at once rather than after a publish timeout.
    async fn connection(
        &self,
    ) -> Result<(async_nats::Client, async_nats::jetstream::Context), String> {
        let mut held = self.connection.lock().await;
        if let Some((client, context)) = held.as_ref() {
            if client.connection_state() == async_nats::connection::State::Connected {
                return Ok((client.clone(), context.clone()));
            }
        }
        *held = None;
        let client = connect(&self.url).await.map_err(|e| e.0)?;
        let context = async_nats::jetstream::new(client.clone());
        *held = Some((client.clone(), context.clone()));
        Ok((client, context))
    }

    /// A round trip to the server (a flush waits for its PONG).
    async fn ping(&self) -> Result<(), String> {
        let (client, _) = self.connection().await?;
        tokio::time::timeout(REQUEST_TIMEOUT, client.flush())
            .await
            .map_err(|_| format!("no answer within {REQUEST_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())
    }

    async fn send(&self, batch: &[Delivery]) -> Result<Vec<SinkOutcome>, String> {
        let (_, context) = self.connection().await?;
        // Publish all, then await every PubAck: one round trip's wait for the batch.
        let mut published: Vec<Result<PublishAckFuture, SinkOutcome>> = Vec::new();
        for delivery in batch {
            let message = &delivery.message;
            if let Err(why) = self.targets.check(&message.topic, None) {
                published.push(Err(forbidden(&why)));
                continue;
            }
            if !publishable(&message.topic) {
                published.push(Err(SinkOutcome::Dead {
                    reason: format!(
                        "{:?} is not a subject one can publish to (a wildcard or an empty token)",
                        message.topic
                    ),
                }));
                continue;
            }
            let headers = match headers(delivery) {
                Ok(headers) => headers,
                Err(reason) => {
                    published.push(Err(SinkOutcome::Dead { reason }));
                    continue;
                }
            };
            let sent = context
                .publish_with_headers(message.topic.clone(), headers, message.body.to_vec().into())
                .await;
            published.push(sent.map_err(|e| outcome(&message.topic, e.kind(), &e)));
        }
        let mut outcomes = Vec::with_capacity(batch.len());
        for (sent, delivery) in published.into_iter().zip(batch) {
            outcomes.push(match sent {
                Ok(ack) => match ack.await {
                    Ok(_) => SinkOutcome::Delivered,
                    Err(e) => outcome(&delivery.message.topic, e.kind(), &e),
                },
                Err(outcome) => outcome,
            });
        }
        Ok(outcomes)
    }
}

/// What a failed publish means for its message: a server that did not answer (no PubAck in time, the
/// connection gone) said nothing about it.
fn outcome(subject: &str, kind: PublishErrorKind, error: &dyn std::fmt::Display) -> SinkOutcome {
    match kind {
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => SinkOutcome::Unreachable {
            reason: format!("nats: {error}"),
        },
        PublishErrorKind::StreamNotFound => SinkOutcome::Retry {
            after: None,
            reason: format!(
                "nats: no stream captures the subject {subject:?} (no responders): add it to a stream's subjects"
            ),
        },
        PublishErrorKind::MaxPayloadExceeded => SinkOutcome::Dead {
            reason: format!("nats: {error}"),
        },
        _ => SinkOutcome::Retry {
            after: None,
            reason: format!("nats: {error}"),
        },
    }
}

impl Sink for NatsSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(self.reporter.reported(batch, self.send(batch)))
    }

    fn probe(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.reporter.probed(self.ping()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_concrete_subjects_are_publishable() {
        for (subject, concrete) in [
            ("orders.out", true),
            ("orders", true),
            ("orders.*", false),
            ("orders.>", false),
            ("orders..out", false),
            (".orders", false),
            ("", false),
        ] {
            assert_eq!(publishable(subject), concrete, "{subject:?}");
        }
    }
}
