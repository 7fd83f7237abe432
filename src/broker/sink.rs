//! The `broker` sink: the lane's deliveries, stored in the broker.

use super::{lock, Broker, BrokerError, Incoming};
use crate::sink::{BoxFuture, Delivery, Sink, SinkOutcome};
use schedulelog::AppendError;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A `[sinks.NAME]` table of kind `broker`: nothing of its own beyond the keys every sink takes (the
/// built-in sink `broker` always exists; a table of that name only tunes it).
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerSinkConfig {}

impl BrokerSinkConfig {
    pub fn build(&self, broker: Arc<Broker>) -> BrokerSink {
        BrokerSink::new(broker)
    }
}

/// The `broker` sink: stores each delivery in the broker, durably, before answering.
#[derive(Debug, Clone)]
pub struct BrokerSink {
    broker: Arc<Broker>,
    /// When a failure was last logged: at most one line every 10 s while they go on.
    last_report: Arc<Mutex<Option<std::time::Instant>>>,
}

impl BrokerSink {
    pub fn new(broker: Arc<Broker>) -> BrokerSink {
        BrokerSink {
            broker,
            last_report: Arc::default(),
        }
    }

    fn report(&self, reason: &str) {
        let mut last = lock(&self.last_report);
        if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
            *last = Some(std::time::Instant::now());
            tracing::error!(%reason, "storing deliveries in the broker failed; they are postponed (delayd_messages_postponed_total) and tried again");
        }
    }

    /// A batch as the broker stores it, stamped as delivered when the lane handed it over.
    fn incoming(&self, batch: &[Delivery]) -> Vec<Incoming> {
        batch
            .iter()
            .map(|d| Incoming {
                topic: d.message.topic.clone(),
                id: d.id.to_string(),
                key: d.message.key.clone(),
                headers: d.message.headers.iter().cloned().collect(),
                deliver_at_ms: d.message.deliver_at_ms,
                delivered_at_ms: d.sent_at_ms,
                attempt: d.message.attempt,
                attempt_at: Some(d.location),
                body: d.message.body.clone(),
            })
            .collect()
    }

    /// Stores a batch and answers each delivery: one the broker holds already (outcomes.rs) is
    /// answered delivered without being stored again. Blocking.
    fn store(&self, batch: &[Delivery]) -> Vec<SinkOutcome> {
        let already = self.broker.stored_already(batch);
        if !already.contains(&true) {
            return self.append(batch);
        }
        let rest: Vec<Delivery> = (batch.iter().zip(&already))
            .filter(|(_, stored)| !**stored)
            .map(|(d, _)| d.clone())
            .collect();
        let mut answers = match rest.is_empty() {
            true => Vec::new(),
            false => self.append(&rest),
        }
        .into_iter();
        (already.into_iter())
            .map(|stored| match stored {
                true => SinkOutcome::Delivered,
                false => answers.next().unwrap_or_else(|| SinkOutcome::Postpone {
                    after: Duration::from_secs(1),
                    reason: "the broker gave no answer for this message".into(),
                }),
            })
            .collect()
    }

    /// Appends `deliveries` and answers each; on a failure they are in doubt (a cluster member's ops
    /// may be committed all the same).
    fn append(&self, deliveries: &[Delivery]) -> Vec<SinkOutcome> {
        let stored = self.broker.append(self.incoming(deliveries));
        if stored.is_err() {
            self.broker.note_in_doubt(deliveries);
        }
        self.answer(deliveries.len(), stored)
    }

    /// The answer for each of `count` deliveries stored together (or not). Trouble with delayd's own
    /// storage is not the message's fault: postponed, using up no attempt (a retry would also copy the
    /// message through the WAL into a segment again, and a few minutes of trouble would make every due
    /// message dead).
    fn answer<T>(&self, count: usize, stored: Result<T, BrokerError>) -> Vec<SinkOutcome> {
        let (reason, disk_full, not_taken) = match stored {
            Ok(_) => return vec![SinkOutcome::Delivered; count],
            Err(e) => (
                e.to_string(),
                e.is_disk_full(),
                // Refused (an op larger than an entry can hold) is no leadership change: reported.
                matches!(
                    e,
                    BrokerError::Replication(ref why) if !matches!(why, AppendError::Refused(_))
                ),
            ),
        };
        let after = if not_taken {
            // A cluster member whose Raft did not take the batch (leadership moving, no quorum):
            // its term stops if it no longer leads; if it still does, soon tried again.
            tracing::debug!(%reason, "the cluster did not take deliveries to the broker");
            Duration::from_secs(1)
        } else if disk_full {
            // Reported once by the disk watch, not for every batch while it lasts.
            tracing::debug!(%reason, "storing deliveries in the broker failed");
            Duration::from_secs(1)
        } else {
            self.report(&reason);
            Duration::from_secs(5)
        };
        vec![SinkOutcome::Postpone { after, reason }; count]
    }
}

impl Sink for BrokerSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(async move {
            let (sink, owned) = (self.clone(), batch.to_vec());
            let stored = tokio::task::spawn_blocking(move || sink.store(&owned)).await;
            stored.unwrap_or_else(|e| {
                let failed = Err::<(), _>(BrokerError::Io {
                    path: PathBuf::from("broker"),
                    source: io::Error::other(e.to_string()),
                });
                self.answer(batch.len(), failed)
            })
        })
    }

    fn deliver_blocking(&self, batch: &[Delivery]) -> Option<Vec<SinkOutcome>> {
        Some(self.store(batch))
    }

    fn outcomes_recorded(&self, batch: &[&Delivery]) {
        self.broker.outcomes_recorded(batch);
    }
}
