//! Prometheus metrics: one recorder per process, every metric described once (names in DESIGN.md §7).
//! No label ever holds a topic, key or id: their number is unbounded. Every series with a bounded label
//! set exists from the start, at 0 ([`register_series`]).

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the recorder (once per process; later calls share it) and returns the handle that renders
/// `/metrics`.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let seconds = [
                0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
            ];
            let records = [
                1.0, 2.0, 5.0, 10.0, 50.0, 100.0, 500.0, 1_000.0, 5_000.0, 10_000.0,
            ];
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                    &seconds,
                )
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        metrics_exporter_prometheus::Matcher::Full(
                            "delayd_wal_batch_records".into(),
                        ),
                        &records,
                    )
                })
                .map(PrometheusBuilder::build_recorder)
                .unwrap_or_else(|_| PrometheusBuilder::new().build_recorder());
            let handle = recorder.handle();
            // Another recorder may be installed already (an embedding program); ours then only renders.
            let _ = metrics::set_global_recorder(recorder);
            describe();
            handle
        })
        .clone()
}

/// Series labelled by sink, made to exist at 0 for every configured sink by [`register_series`]: the
/// metric's name and its other labels, one row per series.
const PER_SINK_COUNTERS: &[(&str, &[(&str, &str)])] = &[
    ("delayd_messages_received_total", &[]),
    ("delayd_messages_delivered_total", &[("outcome", "ok")]),
    ("delayd_messages_delivered_total", &[("outcome", "retry")]),
    ("delayd_messages_delivered_total", &[("outcome", "dead")]),
    ("delayd_messages_postponed_total", &[]),
];

/// Counters with a fixed label set, made to exist at 0 by [`register_series`]: one row per series.
const LABELLED_COUNTERS: &[(&str, &[(&str, &str)])] = &[
    ("delayd_http_timeouts_total", &[("phase", "header")]),
    ("delayd_http_timeouts_total", &[("phase", "body")]),
    ("delayd_http_timeouts_total", &[("phase", "idle")]),
    ("delayd_wal_files_total", &[("from", "spare")]),
    ("delayd_wal_files_total", &[("from", "new")]),
    ("delayd_schedule_firings_total", &[("outcome", "fired")]),
    ("delayd_schedule_firings_total", &[("outcome", "skipped")]),
];

/// Counters without labels, made to exist at 0 by [`register_series`].
const COUNTERS: &[&str] = &[
    "delayd_messages_cancelled_total",
    "delayd_messages_requeued_total",
    "delayd_messages_discarded_total",
    "delayd_wal_poisoned_total",
    "delayd_read_errors_total",
    "delayd_log_corruptions_total",
    "delayd_log_torn_tails_total",
    "delayd_wal_bytes_written_total",
    "delayd_broker_unread_retired_total",
    "delayd_http_connections_refused_total",
];

/// Gauges without labels, made to exist at 0 by [`register_series`].
const GAUGES: &[&str] = &[
    "delayd_pending_messages",
    "delayd_schedules",
    "delayd_wheel_entries",
    "delayd_segments",
    "delayd_disk_full",
    "delayd_http_connections",
    "delayd_http_connections_max",
    "delayd_open_fds",
    "delayd_max_fds",
    "delayd_unreadable_messages",
    "delayd_storage_failed",
    "delayd_key_index_entries",
    "delayd_key_index_bytes",
];

/// Makes every series with a bounded label set exist from the start, at 0 unless something already
/// counted: a series the exporter has never seen is absent from `/metrics`, and dashboards, alerts on
/// `rate()` or `increase()` and absence checks need it there before the first event (after a restart
/// too). A metric with a bounded label set belongs in one of the lists above.
///
/// Only ever adds 0: the recorder is process-wide and shared by every server in the process (the
/// in-process test servers), so a value someone counted is never reset.
pub fn register_series<'a>(sink_names: impl IntoIterator<Item = &'a str>) {
    for sink in sink_names {
        for (name, labels) in PER_SINK_COUNTERS {
            let mut all = vec![metrics::Label::new("sink", sink.to_string())];
            all.extend(labels.iter().map(|&(k, v)| metrics::Label::new(k, v)));
            metrics::counter!(*name, all).increment(0);
        }
    }
    for (name, labels) in LABELLED_COUNTERS {
        let labels: Vec<metrics::Label> = labels
            .iter()
            .map(|&(k, v)| metrics::Label::new(k, v))
            .collect();
        metrics::counter!(*name, labels).increment(0);
    }
    for name in COUNTERS {
        metrics::counter!(*name).increment(0);
    }
    for name in GAUGES {
        metrics::gauge!(*name).increment(0.0);
    }
    // The running version, for dashboards and for telling an upgrade apart from a restart.
    metrics::gauge!("delayd_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(
        "delayd_storage_failed",
        "1 while /readyz answers storage_failed (a failed WAL write or fsync, a replayer stopped on an error, or a broker store whose failed append could not be undone): the node refuses writes until restarted"
    );
    describe_gauge!(
        "delayd_build_info",
        "Always 1; its version label is the running delayd's version"
    );
    describe_counter!(
        "delayd_messages_received_total",
        "Messages accepted (durable), by sink"
    );
    describe_counter!(
        "delayd_messages_delivered_total",
        "Delivery outcomes, by sink and outcome (ok, retry, dead)"
    );
    describe_counter!(
        "delayd_messages_postponed_total",
        "Deliveries put off without using an attempt, by sink: for trouble of delayd's own (the broker's disk full or its files failing, a panic storing them), or because the sink's MQ could not be reached"
    );
    describe_counter!(
        "delayd_messages_cancelled_total",
        "Messages cancelled through the API (one by one or by a purge)"
    );
    describe_counter!(
        "delayd_messages_requeued_total",
        "Dead messages made a new attempt through the API"
    );
    describe_counter!(
        "delayd_messages_discarded_total",
        "Dead messages put away through the API"
    );
    describe_gauge!(
        "delayd_pending_messages",
        "Messages in the wheel or waiting for their sink"
    );
    describe_gauge!(
        "delayd_wheel_entries",
        "Entries in the in-memory wheel and the sink backlogs"
    );
    describe_histogram!(
        "delayd_delivery_lateness_seconds",
        Unit::Seconds,
        "Time from deliver_at to the sink call"
    );
    describe_histogram!(
        "delayd_wal_fsync_seconds",
        Unit::Seconds,
        "Duration of each WAL fdatasync"
    );
    describe_histogram!(
        "delayd_sync_seconds",
        Unit::Seconds,
        "Write and fdatasync of other files, by file: broker (one commit-log write and sync, shared by the batches stored meanwhile), dispatch (one dispatch-log write and sync, shared by the outcomes recorded meanwhile), checkpoint (a whole replay checkpoint: segment syncs and the store, on a thread of its own), broker_checkpoint (a broker store's checkpoint: its queue files synced and the checkpoint stored, on a thread of its own, every 100,000 messages or 256 MiB)"
    );
    describe_histogram!("delayd_wal_batch_records", "Records per WAL group commit");
    describe_counter!(
        "delayd_wal_bytes_written_total",
        Unit::Bytes,
        "Bytes written to the WAL"
    );
    describe_counter!(
        "delayd_wal_files_total",
        "WAL files a rollover started, by where they came from: spare (a retired file reused) or new (next.tmp: zero-filled when made at a start, else an allocated file, whose first use makes each sync commit the file system's journal)"
    );
    describe_counter!(
        "delayd_wal_poisoned_total",
        "WAL write or fsync failures (the log then refuses writes)"
    );
    describe_gauge!("delayd_segments", "Schedule segments on disk");
    describe_gauge!("delayd_schedules", "Recurring schedules (paused ones too)");
    describe_counter!(
        "delayd_schedule_firings_total",
        "Firings of recurring schedules: written (fired), or missed and not made (skipped, by catchup)"
    );
    describe_gauge!(
        "delayd_key_index_entries",
        "Pending messages with an idempotency key (HTTP dedup, keyed MQ requests) in the in-memory key index"
    );
    describe_gauge!(
        "delayd_key_index_bytes",
        Unit::Bytes,
        "Memory the key index holds: 16 bytes a key, however long the key"
    );
    describe_counter!(
        "delayd_log_torn_tails_total",
        "Torn log tails cut on recovery"
    );
    describe_counter!(
        "delayd_log_corruptions_total",
        "Corruption found in synced log data (an alert)"
    );
    describe_counter!(
        "delayd_read_errors_total",
        "Failed reads of due messages, each try counted (the message stays pending and is tried again)"
    );
    describe_gauge!(
        "delayd_unreadable_messages",
        "Due messages whose last read failed, waiting to be tried again (an alert)"
    );
    describe_gauge!(
        "delayd_disk_full",
        "1 while new messages are refused for want of disk space or a write is blocked by a full disk"
    );
    describe_gauge!(
        "delayd_disk_free_bytes",
        Unit::Bytes,
        "Free space on the data dir's file system"
    );
    describe_gauge!(
        "delayd_broker_bytes",
        Unit::Bytes,
        "Bytes in the broker's commit log segments, by store (main, dead)"
    );
    describe_counter!(
        "delayd_broker_retired_bytes_total",
        Unit::Bytes,
        "Bytes deleted by broker retention, by store (main, dead)"
    );
    describe_counter!(
        "delayd_broker_unread_retired_total",
        "Messages broker retention deleted before a consumer group with a committed offset on their queue read them"
    );
    describe_counter!(
        "delayd_http_requests_total",
        "HTTP requests, by route pattern and status"
    );
    describe_gauge!(
        "delayd_http_connections",
        "HTTP connections being served (not counting those answered 503 past the cap)"
    );
    describe_gauge!(
        "delayd_http_connections_max",
        "The connection cap now: limits.max_connections, or fewer while the open-file limit leaves fewer beside limits.reserved_fds"
    );
    describe_counter!(
        "delayd_http_connections_refused_total",
        "Connections past the cap, answered 503 overloaded (their health and readiness probes as usual) and closed"
    );
    describe_counter!(
        "delayd_http_timeouts_total",
        "Connections ended by a timeout, by phase: header (a request head not complete in time), body (408), idle (nothing in flight, no traffic)"
    );
    describe_gauge!(
        "delayd_open_fds",
        "File descriptors open in the process, read once a second"
    );
    describe_gauge!(
        "delayd_max_fds",
        "The open-file limit (RLIMIT_NOFILE soft limit, raised to the hard limit at start)"
    );
    // Made to exist at 0 by the forwarder itself (`api::forward`), on cluster members only.
    describe_counter!(
        "delayd_cluster_forwarded_requests_total",
        "Requests a cluster follower sent on to the leader, whatever came of them (DESIGN.md §10)"
    );
    describe_counter!(
        "delayd_cluster_snapshots_taken_total",
        "Snapshots this cluster member took of its files (every cluster.snapshot_entries entries)"
    );
    describe_gauge!(
        "delayd_cluster_snapshot_bytes",
        "The size of the newest snapshot this cluster member took"
    );
    describe_counter!(
        "delayd_cluster_snapshot_sent_bytes_total",
        "Snapshot bytes this cluster member sent to members too far behind for its log"
    );
    describe_counter!(
        "delayd_cluster_snapshots_installed_total",
        "Snapshots this cluster member received and swapped in at its start"
    );
    describe_histogram!(
        "delayd_http_request_seconds",
        Unit::Seconds,
        "HTTP request duration, by route pattern"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exporter renders a series that was registered and never counted, with the value 0.
    #[test]
    fn registered_series_render_at_zero() {
        let handle = install();
        // A sink name no other test uses, so its series are 0 whatever else runs in this process.
        register_series(["zero-series-test"]);
        let rendered = handle.render();
        let value = |series: &str| {
            rendered
                .lines()
                .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
                .map(str::to_string)
        };
        assert_eq!(
            value(r#"delayd_messages_received_total{sink="zero-series-test"}"#).as_deref(),
            Some("0"),
            "{rendered}"
        );
        for outcome in ["ok", "retry", "dead"] {
            let series = format!(
                r#"delayd_messages_delivered_total{{sink="zero-series-test",outcome="{outcome}"}}"#
            );
            assert_eq!(value(&series).as_deref(), Some("0"), "{rendered}");
        }
        for phase in ["header", "body", "idle"] {
            let series = format!(r#"delayd_http_timeouts_total{{phase="{phase}"}}"#);
            assert!(value(&series).is_some(), "{series} in\n{rendered}");
        }
        // The unlabelled ones exist (other tests in this process may have counted or set them).
        for name in COUNTERS.iter().chain(GAUGES) {
            assert!(value(name).is_some(), "{name} in\n{rendered}");
        }
    }
}
