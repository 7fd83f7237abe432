//! The Redis Streams transport: `XREADGROUP` in a consumer group, `XACK` after the fsync. An entry's field
//! `body` is the request's body; its other fields are its headers.
//!
//! After each (re)connect this consumer's pending entries (delivered before, never acknowledged: a crash
//! between the fsync and the ack) are read first (`XREADGROUP ... 0`), then new ones (`>`, blocking).
//! The group is created at the stream's start when missing (`XGROUP CREATE ... 0 MKSTREAM`), so that
//! requests written before delayd first ran are taken too.
//!
//! An acknowledgement goes in one round trip with the next read (`XACK`, then `XREADGROUP` without
//! blocking): Redis answers both after one fsync of its log, and the next batch is at hand once the
//! acknowledgement is confirmed. What was read so is pending for this consumer like anything read, so a
//! connection lost before it is handled loses nothing.

use super::{default_group, Acked, Received, Request, SourceContext, Transport, TransportError};
use crate::mq::redis::connect;
use crate::mq::{MqKind, REDIS_BODY};
use crate::setting::{invalid, ConfigError};
use futures_core::future::BoxFuture;
use redis::aio::MultiplexedConnection;
use redis::Value;
use std::time::Duration;

/// A `[sources.NAME]` table of kind `redis`: requests read from a Redis stream by a consumer group.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisSourceConfig {
    /// Where Redis is, `redis://127.0.0.1:6379/`; required.
    pub url: Option<String>,
    /// The stream requests are read from; required.
    pub stream_key: Option<String>,
    /// The consumer group.
    pub group: String,
    /// This node's name in the group, its own among the nodes sharing the group (required): its
    /// unacknowledged requests are read again after a restart under this name (two nodes under one
    /// name would each read the other's again: deliveries twice).
    pub consumer: Option<String>,
}

impl Default for RedisSourceConfig {
    fn default() -> RedisSourceConfig {
        RedisSourceConfig {
            url: None,
            stream_key: None,
            group: default_group(),
            consumer: None,
        }
    }
}

impl RedisSourceConfig {
    /// `key`: the table's (`sources.NAME`).
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        let needs = "a redis source needs url and stream_key (and has no queue)";
        if self.stream_key.as_deref().is_none_or(str::is_empty) {
            return Err(invalid(key, needs));
        }
        MqKind::Redis.required_url(key, &self.url, needs)?;
        // Two nodes under one consumer name read each other's pending entries again on every
        // reconnect: no shared default.
        match self.consumer.as_deref() {
            Some(consumer) if crate::mq::valid_client_name(consumer) => Ok(()),
            Some(_) => Err(invalid(
                &format!("{key}.consumer"),
                "a consumer name is 1 to 249 [A-Za-z0-9._-]",
            )),
            None => Err(invalid(
                &format!("{key}.consumer"),
                "a redis source needs consumer: this node's name in the group, its own among the nodes sharing the group (say its host name)",
            )),
        }
    }

    pub fn build(&self, _context: &SourceContext) -> Result<RedisTransport, TransportError> {
        RedisTransport::new(
            self.url.as_deref().unwrap_or_default(),
            self.stream_key.as_deref().unwrap_or_default(),
            &self.group,
            self.consumer.as_deref().unwrap_or_default(),
        )
    }
}

#[derive(Debug)]
pub struct RedisTransport {
    client: redis::Client,
    stream_key: String,
    group: String,
    consumer: String,
    connection: Option<MultiplexedConnection>,
    /// Read this consumer's pending entries before new ones.
    pending_first: bool,
    /// The pending entries after this id are still to be read (the last one read: the runner may ask
    /// for the next batch before it acknowledged the last).
    pending_after: String,
    /// New entries read with the last acknowledgement, in the same round trip, for the next receive.
    prefetched: Vec<Request>,
    /// The batch size the runner asks for.
    max: usize,
}

impl RedisTransport {
    pub fn new(
        url: &str,
        stream_key: &str,
        group: &str,
        consumer: &str,
    ) -> Result<RedisTransport, TransportError> {
        Ok(RedisTransport {
            client: redis::Client::open(url).map_err(|e| TransportError(e.to_string()))?,
            stream_key: stream_key.to_string(),
            group: group.to_string(),
            consumer: consumer.to_string(),
            connection: None,
            pending_first: true,
            pending_after: "0".into(),
            prefetched: Vec::new(),
            max: 1,
        })
    }
}

fn failed(error: redis::RedisError) -> TransportError {
    TransportError(error.to_string())
}

fn text(value: Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

/// The entries of an `XREADGROUP` answer for one stream: `[[key, [[id, [field, value, ...]], ...]]]`
/// (RESP2) or a map of key to entries (RESP3); nil when the wait ended with none.
fn entries(answer: Value) -> Result<Vec<Request>, TransportError> {
    let streams = match answer {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(streams) => streams
            .into_iter()
            .filter_map(|s| match s {
                Value::Array(mut pair) if pair.len() == 2 => pair.pop(),
                _ => None,
            })
            .collect::<Vec<_>>(),
        Value::Map(streams) => streams.into_iter().map(|(_, v)| v).collect(),
        other => {
            return Err(TransportError(format!(
                "unexpected XREADGROUP answer {other:?}"
            )))
        }
    };
    let mut requests = Vec::new();
    for stream in streams {
        let Value::Array(list) = stream else { continue };
        for entry in list {
            let Value::Array(mut parts) = entry else {
                continue;
            };
            if parts.len() != 2 {
                continue;
            }
            let fields = parts.pop().unwrap_or(Value::Nil);
            let Some(position) = parts.pop().and_then(text) else {
                continue;
            };
            let mut request = Request {
                position: Some(position.clone()),
                receipt: position,
                headers: Vec::new(),
                body: Vec::new(),
                unreadable: None,
                default_target: None,
                default_key: None,
                schedule_id: None,
            };
            match fields {
                Value::Array(fields) => {
                    let mut fields = fields.into_iter();
                    while let (Some(name), Some(value)) = (fields.next(), fields.next()) {
                        let (Some(name), Value::BulkString(value)) = (text(name), value) else {
                            request.unreadable = Some("a field name is not UTF-8".into());
                            continue;
                        };
                        if name == REDIS_BODY {
                            request.body = value;
                        } else {
                            match String::from_utf8(value) {
                                Ok(value) => request.headers.push((name, value)),
                                Err(e) => request.keep_binary_header(&name, e.as_bytes()),
                            }
                        }
                    }
                }
                // A pending entry deleted from the stream since (XDEL, a trim): nothing to read.
                _ => request.unreadable = Some("the entry was deleted from the stream".into()),
            }
            requests.push(request);
        }
    }
    Ok(requests)
}

impl Transport for RedisTransport {
    fn connect(&mut self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            self.connection = None;
            let mut connection = connect(&self.client).await?;
            let created: redis::RedisResult<Value> = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&self.stream_key)
                .arg(&self.group)
                .arg("0")
                .arg("MKSTREAM")
                .query_async(&mut connection)
                .await;
            match created {
                Ok(_) => {}
                Err(e) if e.code() == Some("BUSYGROUP") => {}
                Err(e) => return Err(failed(e)),
            }
            self.connection = Some(connection);
            self.pending_first = true;
            self.pending_after = "0".into();
            self.prefetched.clear();
            Ok(())
        })
    }

    fn receive(&mut self, max: usize, wait: Duration) -> Received<'_> {
        Box::pin(async move {
            self.max = max.max(1);
            if !self.prefetched.is_empty() {
                return Ok(std::mem::take(&mut self.prefetched));
            }
            let connection = super::connected(self.connection.as_mut())?;
            let mut command = redis::cmd("XREADGROUP");
            command
                .arg("GROUP")
                .arg(&self.group)
                .arg(&self.consumer)
                .arg("COUNT")
                .arg(max.max(1));
            // (BLOCK 0 would wait for ever: without BLOCK, the read takes what is there.)
            if !self.pending_first && !wait.is_zero() {
                command.arg("BLOCK").arg(wait.as_millis().max(1) as u64);
            }
            command
                .arg("STREAMS")
                .arg(&self.stream_key)
                .arg(match self.pending_first {
                    true => self.pending_after.as_str(),
                    false => ">",
                });
            let answer: Value = command.query_async(connection).await.map_err(failed)?;
            let requests = entries(answer)?;
            if self.pending_first {
                match requests.last() {
                    Some(last) => self.pending_after = last.receipt.clone(),
                    None => self.pending_first = false,
                }
            }
            Ok(requests)
        })
    }

    fn ack<'a>(&'a mut self, receipts: &'a [String]) -> Acked<'a> {
        Box::pin(async move {
            if receipts.is_empty() {
                return Ok(Vec::new());
            }
            let connection = super::connected(self.connection.as_mut())?;
            let mut pipe = redis::pipe();
            pipe.cmd("XACK")
                .arg(&self.stream_key)
                .arg(&self.group)
                .arg(receipts)
                .ignore();
            if !self.pending_first {
                pipe.cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg(&self.group)
                    .arg(&self.consumer)
                    .arg("COUNT")
                    .arg(self.max)
                    .arg("STREAMS")
                    .arg(&self.stream_key)
                    .arg(">");
            }
            let answers: Vec<Value> = pipe.query_async(connection).await.map_err(failed)?;
            if let Some(next) = answers.into_iter().next() {
                self.prefetched = entries(next)?;
            }
            Ok(receipts.to_vec())
        })
    }

    /// Entry ids grow within a stream, and in one deleted and made again too (`XADD *` takes them from
    /// the clock): later requests have later ids.
    fn ordered_positions(&self) -> bool {
        true
    }

    fn rewind(&mut self) {
        // What was read and not acknowledged is pending: the pending read takes it again.
        self.prefetched.clear();
        self.pending_first = true;
        self.pending_after = "0".into();
    }
}
