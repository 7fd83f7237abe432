//! The Redis Streams sink: `XADD`s each due message to the stream its topic names (the request's
//! `delayd-target`), with the field `body` and its headers as fields, minus delayd's own (`delayd-*`),
//! plus `delayd-id` (the message id, the same on every attempt: what consumers deduplicate on).
//!
//! A batch is one pipeline, one round trip. An entry counts as delivered only on Redis's reply (the entry
//! id); a connection that fails (Redis away, refused, no reply within 15 s) makes the batch wait for it
//! (`SinkOutcome::Unreachable`: no attempt used), an error reply is a failed attempt, and a `WRONGTYPE`
//! (the key holds something other than a stream) makes that message dead: no retry can fix it. So does a target the
//! sink may not publish to (`targets`, `crate::mq::Targets`), and a header named `body` (it would be a
//! second `body` field; the intake refuses both, this catches messages taken before the configuration
//! changed).

use super::{BoxFuture, Delivery, MqSinkConfig, Reporter, Sink, SinkContext, SinkOutcome};
use crate::connection::ConnectionState;
use crate::mq::redis::connect;
use crate::mq::{MqKind, Targets, REDIS_BODY};
use redis::aio::MultiplexedConnection;
use redis::Value;
use tokio::sync::Mutex;

#[derive(Debug)]
pub struct RedisSink {
    client: redis::Client,
    targets: Targets,
    connection: Mutex<Option<MultiplexedConnection>>,
    reporter: Reporter,
}

impl RedisSink {
    /// The sink a `[sinks.NAME]` table of kind `redis` describes, and the state of its connection.
    pub fn build(
        config: &MqSinkConfig,
        context: &SinkContext,
    ) -> Result<(RedisSink, ConnectionState), redis::RedisError> {
        let reporter = context.reporter("redis");
        let connection = reporter.connection().clone();
        let sink = RedisSink::new(
            config.url.as_deref().unwrap_or_default(),
            config.targets(MqKind::Redis),
            reporter,
        )?;
        Ok((sink, connection))
    }

    pub fn new(
        url: &str,
        targets: Targets,
        reporter: Reporter,
    ) -> Result<RedisSink, redis::RedisError> {
        Ok(RedisSink {
            client: redis::Client::open(url)?,
            targets,
            connection: Mutex::new(None),
            reporter,
        })
    }

    /// The connection, made if there is none. A multiplexed connection is shared by clones: the lock
    /// guards only making it.
    async fn connection(&self) -> Result<MultiplexedConnection, String> {
        let mut held = self.connection.lock().await;
        if held.is_none() {
            *held = Some(connect(&self.client).await.map_err(|e| e.0)?);
        }
        held.clone().ok_or_else(|| "not connected".into())
    }

    /// A round trip on the connection (`PING`).
    async fn ping(&self) -> Result<(), String> {
        let mut connection = self.connection().await?;
        let pong: redis::RedisResult<String> =
            redis::cmd("PING").query_async(&mut connection).await;
        if let Err(e) = pong {
            *self.connection.lock().await = None;
            return Err(e.to_string());
        }
        Ok(())
    }

    /// Why a message cannot be published, if it cannot: no retry would change that.
    fn refusal(&self, message: &schedulelog::Message) -> Option<SinkOutcome> {
        if let Err(why) = self.targets.check(&message.topic, None) {
            return Some(super::forbidden(&why));
        }
        message
            .headers
            .iter()
            .any(|(name, _)| name == REDIS_BODY)
            .then(|| SinkOutcome::Dead {
                reason: "a header named \"body\" would overwrite the entry's body field".into(),
            })
    }

    async fn send(&self, batch: &[Delivery]) -> Result<Vec<SinkOutcome>, String> {
        let refusals: Vec<Option<SinkOutcome>> =
            batch.iter().map(|d| self.refusal(&d.message)).collect();
        let mut pipe = redis::pipe();
        let mut commands = 0;
        for (delivery, _) in batch.iter().zip(&refusals).filter(|(_, r)| r.is_none()) {
            let message = &delivery.message;
            let command = pipe
                .cmd("XADD")
                .arg(&message.topic)
                .arg("*")
                .arg(REDIS_BODY)
                .arg(&message.body[..])
                .arg("delayd-id")
                .arg(delivery.id.to_string());
            for (name, value) in &message.headers {
                if super::passed_on(name) {
                    command.arg(name).arg(value);
                }
            }
            commands += 1;
        }
        let answers: Vec<redis::RedisResult<Value>> = match commands {
            0 => Vec::new(),
            _ => {
                let mut connection = self.connection().await?;
                match pipe.ignore_errors().query_async(&mut connection).await {
                    Ok(answers) => answers,
                    Err(e) => {
                        *self.connection.lock().await = None; // made again on the next call
                        return Err(e.to_string());
                    }
                }
            }
        };
        let mut answers = answers.into_iter();
        let answered = |answer: Option<redis::RedisResult<Value>>| match answer {
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
        };
        Ok(refusals
            .into_iter()
            .map(|refusal| refusal.unwrap_or_else(|| answered(answers.next())))
            .collect())
    }
}

impl Sink for RedisSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(self.reporter.reported(batch, self.send(batch)))
    }

    fn probe(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.reporter.probed(self.ping()))
    }
}
