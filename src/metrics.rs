//! Prometheus metrics: one recorder per process, every metric described once (names in DESIGN.md §7).
//! No label ever holds a topic, key or id: their number is unbounded.

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

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "delayd_messages_received_total",
        "Messages accepted (durable), by sink"
    );
    describe_counter!(
        "delayd_messages_delivered_total",
        "Delivery outcomes, by sink and outcome (ok, retry, dead)"
    );
    describe_counter!(
        "delayd_messages_cancelled_total",
        "Messages cancelled through the API"
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
        "Write and fdatasync of other files, by file: broker (commit log, per delivered batch), dispatch (outcomes, per batch), checkpoint (a whole replay checkpoint, under the replayer's lock)"
    );
    describe_histogram!("delayd_wal_batch_records", "Records per WAL group commit");
    describe_counter!(
        "delayd_wal_bytes_written_total",
        Unit::Bytes,
        "Bytes written to the WAL"
    );
    describe_counter!(
        "delayd_wal_poisoned_total",
        "WAL write or fsync failures (the log then refuses writes)"
    );
    describe_gauge!("delayd_segments", "Schedule segments on disk");
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
        "Due messages that could not be read"
    );
    describe_counter!(
        "delayd_http_requests_total",
        "HTTP requests, by route pattern and status"
    );
    describe_histogram!(
        "delayd_http_request_seconds",
        Unit::Seconds,
        "HTTP request duration, by route pattern"
    );
}
