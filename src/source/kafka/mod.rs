//! The Kafka transport: a consumer group (`group`) on `topics`, with offsets committed by delayd
//! (`enable.auto.commit=false`) only for requests whose batch is durable.
//!
//! - A request's headers are the record's headers (values as UTF-8 text; a null value is empty), its
//!   body the record's value; the record's key is its key when no `delayd-key` (or
//!   `scheduler-target-key`) header gives one (DESIGN.md §11). A header value, or a key needed as the
//!   key, that is not UTF-8 makes the request a dead letter, which keeps it base64-encoded
//!   (`NAME.base64`, `record-key.base64`).
//! - Its receipt: `{topic}/{partition}/{offset}`. An acknowledgement commits, per partition, the highest
//!   offset + 1, synchronously (the group coordinator answered). A commit is a round trip to the
//!   coordinator (100 ms to a second on a busy tansu), so it is put off, and made in the background
//!   while requests keep coming: the durable requests' offsets are committed once the oldest of them
//!   waited a second, when the source is idle or stops (then waited for), and at a revocation (in the
//!   rebalance callback, before the partitions' next owner reads from their committed offset, with
//!   those of a background commit under way). Until a commit is confirmed its requests' positions stay
//!   unacknowledged: after a crash they are read again and recognised.
//! - Its position (what a redelivery is recognised by): `{topic}/{partition}@{epoch}/{offset}`, or the
//!   receipt in epoch 0. A topic deleted and made again starts its offsets at 0 again: the partition's
//!   epoch (epochs.rs) tells its requests from the old topic's.
//! - No read-ahead: a receive asked not to wait returns nothing, so the consumer is polled (and
//!   librdkafka runs a rebalance only inside a poll) only when no request is being written: every one
//!   read before is durable, and the revocation commits it. Partitions revoked by a rebalance therefore
//!   carry nothing durable and uncommitted, and nothing is committed for them afterwards. A rebalance
//!   during a receive drops what that receive had collected (nothing of it is durable): the
//!   partitions' next owner, or this consumer again, reads it from the committed offset.
//! - Static membership: `group.instance.id` is the source's `consumer` name, so a restarted node gets
//!   its partitions back at once instead of after the session timeout. Each node sharing a group needs
//!   its own.
//! - Rewind (a batch that could not be stored) makes the consumer anew: it resumes from the committed
//!   offsets.

mod epochs;

use super::{default_group, Acked, Received, Request, SourceContext, Transport, TransportError};
use crate::mq::kafka::client_config;
use crate::mq::{valid_client_name, MqKind};
use crate::setting::{invalid, ConfigError};
use base64::Engine;
use epochs::Epochs;
use futures_core::future::BoxFuture;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What librdkafka reports from inside a poll (revocations), and the acknowledgements put off, which a
/// revocation commits.
#[derive(Default)]
struct Events {
    revoked: AtomicU64,
    deferred: std::sync::Mutex<Deferred>,
}

/// Receipts of durable requests whose offsets are not committed yet (see the module doc).
#[derive(Default)]
struct Deferred {
    receipts: Vec<String>,
    /// When the oldest of them was put off.
    since: Option<std::time::Instant>,
    /// Being committed in the background.
    committing: Vec<String>,
    /// Committed by a revocation, to be reported by the next `ack` or `flush`.
    committed: Vec<String>,
}

impl Events {
    fn deferred(&self) -> std::sync::MutexGuard<'_, Deferred> {
        self.deferred.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ClientContext for Events {}

/// A commit in the background: the receipts it commits, once done.
type Commit = tokio::task::JoinHandle<Result<Vec<String>, TransportError>>;

/// How long a durable request's offset may wait to be committed (a commit is a round trip to the group
/// coordinator; tansu's take 100 ms to a second).
const COMMIT_EVERY: Duration = Duration::from_secs(1);

/// How long an offset commit may take.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long looking up whether a partition has a committed offset may take.
const EPOCH_TIMEOUT: Duration = Duration::from_secs(10);

/// What the transport knows of a partition it reads.
#[derive(Debug, Clone, Copy)]
struct Partition {
    /// Its epoch (epochs.rs).
    epoch: u64,
    /// The offset after the last record read from it.
    next: i64,
    /// Looked up since the last rebalance.
    current: bool,
}

/// An error a poll returned: librdkafka recovers from most by itself (one broker of several away, a
/// coordinator moving), and the consumer goes on; all brokers away, or a fatal error (this node's
/// `group.instance.id` taken by another), makes it anew.
fn consumption_error(error: KafkaError) -> Result<(), TransportError> {
    let fatal = matches!(error, KafkaError::MessageConsumptionFatal(_))
        || error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown);
    if fatal {
        return Err(failed("consuming", error));
    }
    tracing::warn!(%error, "kafka: the consumer reported an error; it goes on");
    Ok(())
}

impl ConsumerContext for Events {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(partitions) = rebalance {
            self.revoked.fetch_add(1, Ordering::SeqCst);
            tracing::info!(
                partitions = partitions.count(),
                "kafka: partitions revoked by a rebalance"
            );
            // Every request read before this poll is durable (no read-ahead): its offset is committed
            // now, before the partitions' next owner reads from the committed offset.
            let mut deferred = self.deferred();
            if deferred.receipts.is_empty() && deferred.committing.is_empty() {
                return;
            }
            // Those being committed too: their commit may come too late (a second one is harmless).
            let all: Vec<String> = (deferred.receipts.iter())
                .chain(&deferred.committing)
                .cloned()
                .collect();
            let committed = commits(&all).and_then(|list| {
                consumer
                    .commit(&list, CommitMode::Sync)
                    .map_err(|e| failed("committing offsets at a revocation", e))
            });
            match committed {
                Ok(()) => {
                    let done = std::mem::take(&mut deferred.receipts);
                    deferred.committed.extend(done);
                    deferred.since = None;
                }
                Err(error) => {
                    tracing::warn!(%error, "kafka: durable requests of revoked partitions are not committed; their next owner may schedule them again")
                }
            }
        }
    }
}

type KafkaConsumer = StreamConsumer<Events>;

/// A `[sources.NAME]` table of kind `kafka`: requests consumed from topics by a consumer group.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaSourceConfig {
    /// The brokers, `kafka://host:9092[,host:9092...]`; required.
    pub url: Option<String>,
    /// The topics requests are consumed from (they must exist); required.
    pub topics: Vec<String>,
    /// The consumer group.
    pub group: String,
    /// This node's `group.instance.id`, its own among the nodes sharing the group (required): static
    /// membership, so a restarted node gets its partitions back at once.
    pub consumer: Option<String>,
}

impl Default for KafkaSourceConfig {
    fn default() -> KafkaSourceConfig {
        KafkaSourceConfig {
            url: None,
            topics: Vec::new(),
            group: default_group(),
            consumer: None,
        }
    }
}

impl KafkaSourceConfig {
    /// `key`: the table's (`sources.NAME`).
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        let missing = format!(
            "a kafka source needs url ({}) and topics, and has no stream_key",
            MqKind::Kafka.url_example()
        );
        MqKind::Kafka.required_url(key, &self.url, &missing)?;
        if self.topics.is_empty() || !self.topics.iter().all(|t| valid_client_name(t)) {
            return Err(invalid(
                &format!("{key}.topics"),
                "a kafka source needs topics: a list of names of 1 to 249 [A-Za-z0-9._-]",
            ));
        }
        // Two nodes under one group.instance.id fence each other: no shared default.
        let Some(consumer) = self.consumer.as_deref() else {
            return Err(invalid(
                &format!("{key}.consumer"),
                "a kafka source needs consumer: this node's group.instance.id, its own among the nodes sharing the group (say its host name)",
            ));
        };
        if !valid_client_name(&self.group) || !valid_client_name(consumer) {
            return Err(invalid(
                key,
                "group and consumer are 1 to 249 [A-Za-z0-9._-]",
            ));
        }
        Ok(())
    }

    /// Keeps the partitions' epochs in a file beside the source's mark.
    pub fn build(&self, context: &SourceContext) -> anyhow::Result<KafkaTransport> {
        KafkaTransport::new(
            self.url.as_deref().unwrap_or_default(),
            &self.topics,
            &self.group,
            self.consumer.as_deref().unwrap_or_default(),
            &context.files,
            &super::mark::beside(&context.name, "kafka-epochs"),
        )
    }
}

pub struct KafkaTransport {
    url: String,
    topics: Vec<String>,
    group: String,
    instance: String,
    consumer: Option<Arc<KafkaConsumer>>,
    /// The next receive makes the consumer anew first (after a rewind).
    reopen: bool,
    /// The commit under way in the background, and when it started.
    committing: Option<(Commit, std::time::Instant)>,
    /// By topic and partition.
    partitions: HashMap<(String, i32), Partition>,
    epochs: Epochs,
    /// The revocations counted when the partitions were last marked current.
    revocations_seen: u64,
}

impl std::fmt::Debug for KafkaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaTransport")
            .field("topics", &self.topics)
            .field("group", &self.group)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

fn failed(what: &str, error: impl std::fmt::Display) -> TransportError {
    TransportError(format!("{what}: {error}"))
}

impl KafkaTransport {
    /// `epochs`: the state file in `files` where the partitions' epochs are kept (epochs.rs); an
    /// unreadable one is an error naming it.
    pub fn new(
        url: &str,
        topics: &[String],
        group: &str,
        instance: &str,
        files: &super::StateFiles,
        epochs: &str,
    ) -> anyhow::Result<KafkaTransport> {
        Ok(KafkaTransport {
            url: url.to_string(),
            topics: topics.to_vec(),
            group: group.to_string(),
            instance: instance.to_string(),
            consumer: None,
            reopen: false,
            committing: None,
            partitions: HashMap::new(),
            epochs: Epochs::open(files, epochs)?,
            revocations_seen: 0,
        })
    }

    fn consumer(&self) -> Result<Arc<KafkaConsumer>, TransportError> {
        super::connected(self.consumer.clone())
    }

    /// Sets each request's position, looking up its partition's epoch where it is not known yet (see
    /// the module doc). `revoked`: the consumer's revocations counted when the requests were read.
    async fn set_positions(
        &mut self,
        consumer: &Arc<KafkaConsumer>,
        revoked: u64,
        requests: &mut [Request],
    ) -> Result<(), TransportError> {
        if revoked != self.revocations_seen {
            for partition in self.partitions.values_mut() {
                partition.current = false;
            }
            self.revocations_seen = revoked;
        }
        for request in requests {
            let (topic, partition, offset) = parse_receipt(&request.receipt)?;
            let key = (topic.to_string(), partition);
            let known = self
                .partitions
                .get(&key)
                .filter(|p| p.current && offset >= p.next)
                .map(|p| p.epoch);
            let epoch = match known {
                Some(epoch) => epoch,
                None => {
                    let before = self.partitions.get(&key).map(|p| p.epoch);
                    let (asking, asked) = (consumer.clone(), topic.to_string());
                    let has_commit = tokio::task::spawn_blocking(move || {
                        has_committed_offset(&asking, &asked, partition)
                    })
                    .await
                    .map_err(|e| failed("looking up the committed offset", e))??;
                    let epoch = self
                        .epochs
                        .resolve(topic, partition, has_commit)
                        .await
                        .map_err(|e| failed("saving the partitions' epochs", e))?;
                    if before.is_some_and(|before| before != epoch) {
                        // Offsets of the old topic must not be committed to the new one.
                        let old = format!("{topic}/{partition}/");
                        let mut deferred = consumer.context().deferred();
                        deferred.receipts.retain(|r| !r.starts_with(&old));
                    }
                    epoch
                }
            };
            self.partitions.insert(
                key,
                Partition {
                    epoch,
                    next: offset + 1,
                    current: true,
                },
            );
            request.position = Some(position(topic, partition, epoch, offset));
        }
        Ok(())
    }

    /// Starts committing the offsets put off, in the background, unless a commit is under way.
    fn start_commit(&mut self, consumer: &Arc<KafkaConsumer>) -> Result<(), TransportError> {
        if self.committing.is_some() {
            return Ok(());
        }
        let receipts = {
            let mut deferred = consumer.context().deferred();
            deferred.since = None;
            let receipts = std::mem::take(&mut deferred.receipts);
            deferred.committing.clone_from(&receipts);
            receipts
        };
        if receipts.is_empty() {
            return Ok(());
        }
        let list = commits(&receipts)?;
        let consumer = consumer.clone();
        // A synchronous commit: the coordinator answered (on a blocking thread: it waits as long as
        // librdkafka lets it; `harvest` stops waiting after COMMIT_TIMEOUT).
        let started = std::time::Instant::now();
        let task = tokio::task::spawn_blocking(move || {
            consumer
                .commit(&list, CommitMode::Sync)
                .map(|()| receipts)
                .map_err(|e| failed("committing offsets", e))
        });
        self.committing = Some((task, started));
        Ok(())
    }

    /// The receipts committed since the last call: by a background commit that ended (waiting for it
    /// with `wait`), and by a revocation.
    async fn harvest(
        &mut self,
        consumer: &Arc<KafkaConsumer>,
        wait: bool,
    ) -> Result<Vec<String>, TransportError> {
        let mut confirmed = Vec::new();
        let ended = self
            .committing
            .as_ref()
            .is_some_and(|(task, _)| task.is_finished());
        if let Some((task, started)) = self.committing.take_if(|_| ended || wait) {
            let left = COMMIT_TIMEOUT.saturating_sub(started.elapsed());
            let receipts = tokio::time::timeout(left, task)
                .await
                .map_err(|_| TransportError("committing offsets: no answer".into()))?
                .map_err(|e| failed("committing offsets", e))??;
            consumer.context().deferred().committing.clear();
            confirmed = receipts;
        } else if let Some((_, started)) = &self.committing {
            if started.elapsed() >= COMMIT_TIMEOUT {
                return Err(TransportError("committing offsets: no answer".into()));
            }
        }
        confirmed.append(&mut consumer.context().deferred().committed);
        if !confirmed.is_empty() {
            let partitions: Vec<(String, i32)> = (commits(&confirmed)?.elements().iter())
                .map(|e| (e.topic().to_string(), e.partition()))
                .collect();
            self.epochs
                .committed(&partitions)
                .await
                .map_err(|e| failed("saving the partitions' epochs", e))?;
        }
        Ok(confirmed)
    }

    /// Closes the consumer off the async threads (a close may wait for the broker).
    fn close(&mut self) {
        if let Some(old) = self.consumer.take() {
            tokio::task::spawn_blocking(move || drop(old));
        }
    }
}

/// The position of a record (see the module doc).
fn position(topic: &str, partition: i32, epoch: u64, offset: i64) -> String {
    match epoch {
        0 => format!("{topic}/{partition}/{offset}"),
        epoch => format!("{topic}/{partition}@{epoch}/{offset}"),
    }
}

/// Whether the group has a committed offset for a partition. Blocking.
fn has_committed_offset(
    consumer: &KafkaConsumer,
    topic: &str,
    partition: i32,
) -> Result<bool, TransportError> {
    let mut asked = TopicPartitionList::new();
    asked.add_partition(topic, partition);
    let committed = consumer
        .committed_offsets(asked, EPOCH_TIMEOUT)
        .map_err(|e| failed("looking up the committed offset", e))?;
    let elem = committed.find_partition(topic, partition);
    if let Some(error) = elem.as_ref().and_then(|e| e.error().err()) {
        return Err(failed("looking up the committed offset", error));
    }
    Ok(elem.is_some_and(|e| matches!(e.offset(), Offset::Offset(_))))
}

/// One record as a request, its position still to be set (it needs the partition's epoch).
fn request(message: &BorrowedMessage<'_>) -> Request {
    let receipt = format!(
        "{}/{}/{}",
        message.topic(),
        message.partition(),
        message.offset()
    );
    let mut request = Request {
        position: None,
        receipt,
        headers: Vec::new(),
        body: message.payload().unwrap_or_default().to_vec(),
        unreadable: None,
        default_target: None,
        default_key: None,
        schedule_id: None,
    };
    if let Some(headers) = message.headers() {
        for header in headers.iter() {
            let value = header.value.unwrap_or_default();
            match std::str::from_utf8(value) {
                Ok(value) => request
                    .headers
                    .push((header.key.to_string(), value.to_string())),
                Err(_) => request.keep_binary_header(header.key, value),
            }
        }
    }
    let keyed = request.headers.iter().any(|(name, _)| {
        name.eq_ignore_ascii_case("delayd-key") || name.eq_ignore_ascii_case("scheduler-target-key")
    });
    match message.key().map(|key| (key, std::str::from_utf8(key))) {
        Some((_, Ok(key))) if !key.is_empty() => request.default_key = Some(key.to_string()),
        Some((key, Err(_))) if !keyed => {
            let encoded = base64::engine::general_purpose::STANDARD.encode(key);
            request.refuse("the record key is not UTF-8 (give delayd-key instead; the dead letter keeps it as record-key.base64)".into());
            request.headers.push(("record-key.base64".into(), encoded));
        }
        _ => {}
    }
    request
}

/// A receipt's topic, partition and offset.
fn parse_receipt(receipt: &str) -> Result<(&str, i32, i64), TransportError> {
    let mut parts = receipt.rsplitn(3, '/');
    let (Some(offset), Some(partition), Some(topic)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(TransportError(format!(
            "{receipt:?} is not a Kafka receipt"
        )));
    };
    let bad = |e: std::num::ParseIntError| failed(&format!("the receipt {receipt:?}"), e);
    Ok((
        topic,
        partition.parse().map_err(bad)?,
        offset.parse().map_err(bad)?,
    ))
}

/// What to commit for a batch: per partition, its highest offset + 1.
fn commits(receipts: &[String]) -> Result<TopicPartitionList, TransportError> {
    let mut next: BTreeMap<(&str, i32), i64> = BTreeMap::new();
    for receipt in receipts {
        let (topic, partition, offset) = parse_receipt(receipt)?;
        let entry = next.entry((topic, partition)).or_insert(offset + 1);
        *entry = (*entry).max(offset + 1);
    }
    let mut list = TopicPartitionList::new();
    for ((topic, partition), offset) in next {
        list.add_partition_offset(topic, partition, Offset::Offset(offset))
            .map_err(|e| failed("a commit", e))?;
    }
    Ok(list)
}

impl Transport for KafkaTransport {
    fn connect(&mut self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            self.close();
            self.reopen = false;
            // The old consumer's commit is not this connection's (the runner forgets its receipts).
            self.committing = None;
            let mut config = client_config(&self.url)?;
            config
                .set("group.id", &self.group)
                .set("group.instance.id", &self.instance)
                .set("enable.auto.commit", "false")
                .set("enable.auto.offset.store", "false")
                .set("auto.offset.reset", "earliest")
                .set("enable.partition.eof", "false")
                // A broker may hold a fetch that long before it answers, even when records came
                // meanwhile (tansu does; Kafka answers at once): a bound on the time a request waits.
                .set("fetch.wait.max.ms", "50");
            let topics = self.topics.clone();
            // Made, subscribed and probed off the async threads: a consumer that fails is dropped
            // there too (closing one waits for the broker).
            let consumer = tokio::task::spawn_blocking(move || {
                let consumer: KafkaConsumer = config
                    .create_with_context(Events::default())
                    .map_err(|e| failed("creating the consumer", e))?;
                let names: Vec<&str> = topics.iter().map(String::as_str).collect();
                consumer
                    .subscribe(&names)
                    .map_err(|e| failed("subscribing", e))?;
                // Connected once the cluster answers (an unreachable broker is a failed connect).
                consumer
                    .fetch_metadata(Some(&topics[0]), Duration::from_secs(10))
                    .map_err(|e| failed("connecting", e))?;
                Ok::<_, TransportError>(consumer)
            })
            .await
            .map_err(|e| failed("connecting", e))??;
            self.consumer = Some(Arc::new(consumer));
            Ok(())
        })
    }

    fn receive(&mut self, max: usize, wait: Duration) -> Received<'_> {
        Box::pin(async move {
            if wait.is_zero() {
                return Ok(Vec::new()); // no read-ahead: see the module's doc
            }
            if self.reopen {
                self.connect().await?;
            }
            let consumer = self.consumer()?;
            let mut revoked = consumer.context().revoked.load(Ordering::SeqCst);
            let mut requests = Vec::new();
            let mut limit = wait;
            while requests.len() < max.max(1) {
                let next = match tokio::time::timeout(limit, consumer.recv()).await {
                    Err(_) => break,
                    Ok(next) => next,
                };
                // A revocation was served inside that poll: what was read before it is dropped
                // (librdkafka purged those partitions; their next owner, or this consumer again,
                // fetches from the committed offset), what comes after it is of the new assignment.
                let now = consumer.context().revoked.load(Ordering::SeqCst);
                if now != revoked {
                    if !requests.is_empty() {
                        tracing::info!(records = requests.len(), "kafka: a rebalance came while reading; what was read is read again by the partitions' owner");
                    }
                    requests.clear();
                    revoked = now;
                }
                match next {
                    Ok(message) => requests.push(request(&message)),
                    Err(error) => consumption_error(error)?,
                }
                limit = Duration::ZERO;
            }
            self.set_positions(&consumer, revoked, &mut requests)
                .await?;
            Ok(requests)
        })
    }

    /// Puts the commit off (see the module doc) until the oldest request waiting is `COMMIT_EVERY` old,
    /// then commits in the background.
    fn ack<'a>(&'a mut self, receipts: &'a [String]) -> Acked<'a> {
        Box::pin(async move {
            let consumer = self.consumer()?;
            let due = {
                let mut deferred = consumer.context().deferred();
                deferred.receipts.extend_from_slice(receipts);
                let since = *deferred.since.get_or_insert_with(std::time::Instant::now);
                since.elapsed() >= COMMIT_EVERY
            };
            let confirmed = self.harvest(&consumer, false).await?;
            if due {
                self.start_commit(&consumer)?;
            }
            Ok(confirmed)
        })
    }

    fn flush(&mut self) -> Acked<'_> {
        Box::pin(async move {
            let consumer = self.consumer()?;
            let mut confirmed = self.harvest(&consumer, true).await?;
            self.start_commit(&consumer)?;
            confirmed.extend(self.harvest(&consumer, true).await?);
            Ok(confirmed)
        })
    }

    /// A restarted consumer resumes from its committed offsets at once (static membership); one
    /// whose partitions went to another member never sees them again.
    fn redelivery_window(&self) -> Duration {
        Duration::from_secs(60)
    }

    /// Offsets grow within a partition of one epoch, which positions name.
    fn ordered_positions(&self) -> bool {
        true
    }

    fn rewind(&mut self) {
        self.reopen = true;
    }
}

impl Drop for KafkaTransport {
    fn drop(&mut self) {
        // A consumer closed on the async threads would block one; off them if a runtime is there.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_commits_each_partitions_highest_offset_plus_one() {
        let receipts: Vec<String> = ["in/0/7", "in/1/3", "in/0/9", "in/0/8", "other-topic/0/1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let list = commits(&receipts).unwrap();
        let mut got: Vec<(String, i32, Offset)> = list
            .elements()
            .iter()
            .map(|e| (e.topic().to_string(), e.partition(), e.offset()))
            .collect();
        got.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        assert_eq!(
            got,
            [
                ("in".to_string(), 0, Offset::Offset(10)),
                ("in".to_string(), 1, Offset::Offset(4)),
                ("other-topic".to_string(), 0, Offset::Offset(2)),
            ]
        );
        assert!(commits(&["in/x/1".to_string()]).is_err());
        assert!(commits(&["nothing".to_string()]).is_err());
    }

    #[test]
    fn positions_name_the_partitions_epoch() {
        assert_eq!(position("in", 3, 0, 17), "in/3/17");
        assert_eq!(
            position("in", 3, 1796117400000, 17),
            "in/3@1796117400000/17"
        );
    }
}
