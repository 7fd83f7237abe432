//! The Redis Streams sink: `XADD`s each due message to the stream its topic names (the request's
//! `delayd-target`), with the field `body` and its headers as fields, minus delayd's own (`delayd-*`),
//! plus `delayd-id` (the message id, the same on every attempt: what consumers deduplicate on).
//!
//! A batch is one pipeline, one round trip. An entry counts as delivered only on Redis's reply (the entry
//! id); a connection failure retries the batch with the sink's backoff, and a `WRONGTYPE` (the key holds
//! something other than a stream) makes that message dead: no retry can fix it.

use super::{BoxFuture, Delivery, Sink, SinkOutcome};
use crate::link::Link;
use crate::mq::redis::connect;
use redis::aio::MultiplexedConnection;
use redis::Value;
use tokio::sync::Mutex;

#[derive(Debug)]
pub struct RedisSink {
    client: redis::Client,
    connection: Mutex<Option<MultiplexedConnection>>,
    link: Link,
    clock: std::sync::Arc<dyn schedulelog::Clock>,
}

impl RedisSink {
    pub fn new(
        url: &str,
        link: Link,
        clock: std::sync::Arc<dyn schedulelog::Clock>,
    ) -> Result<RedisSink, redis::RedisError> {
        Ok(RedisSink {
            client: redis::Client::open(url)?,
            connection: Mutex::new(None),
            link,
            clock,
        })
    }

    async fn send(&self, batch: &[Delivery]) -> Result<Vec<SinkOutcome>, String> {
        // A multiplexed connection is shared by clones: the lock guards only making it.
        let mut connection = {
            let mut held = self.connection.lock().await;
            if held.is_none() {
                *held = Some(connect(&self.client).await.map_err(|e| e.0)?);
            }
            held.clone().ok_or("not connected")?
        };
        let mut pipe = redis::pipe();
        for delivery in batch {
            let message = &delivery.message;
            let command = pipe
                .cmd("XADD")
                .arg(&message.topic)
                .arg("*")
                .arg("body")
                .arg(&message.body[..])
                .arg("delayd-id")
                .arg(delivery.id.to_string());
            for (name, value) in &message.headers {
                if !name.to_ascii_lowercase().starts_with("delayd-") {
                    command.arg(name).arg(value);
                }
            }
        }
        let answers: Vec<redis::RedisResult<Value>> =
            match pipe.ignore_errors().query_async(&mut connection).await {
                Ok(answers) => answers,
                Err(e) => {
                    *self.connection.lock().await = None; // made again on the next call
                    return Err(e.to_string());
                }
            };
        Ok(batch
            .iter()
            .enumerate()
            .map(|(i, _)| match answers.get(i) {
                Some(Ok(_)) => SinkOutcome::Delivered,
                Some(Err(e)) if e.code() == Some("WRONGTYPE") => SinkOutcome::Dead {
                    reason: format!("XADD: {e}"),
                },
                Some(Err(e)) => SinkOutcome::Retry {
                    after: None,
                    reason: format!("XADD: {e}"),
                },
                None => SinkOutcome::Retry {
                    after: None,
                    reason: "no reply for this XADD".into(),
                },
            })
            .collect())
    }
}

impl Sink for RedisSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(async move {
            match self.send(batch).await {
                Ok(outcomes) => {
                    self.link.up();
                    outcomes
                }
                Err(error) => {
                    self.link.down(self.clock.now_ms(), &error);
                    super::retry_all(batch, &format!("redis: {error}"))
                }
            }
        })
    }
}
