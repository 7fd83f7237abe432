//! Durable append throughput (fsync always), by record size, batch size and number of concurrent
//! submitters, next to the raw synced-write bandwidth of the same disk measured in the same run.
//!
//! Run: `cargo bench -p schedulelog --bench append` (filter with e.g. `-- 1KiB`). The data dir is created
//! under `target/` so that it is on the same disk as the build, not on a tmpfs.

#![allow(clippy::unwrap_used, reason = "a benchmark stops at the first failure")]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use schedulelog::{NewMessage, Options, ScheduleLog};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn bench_dir(name: &str) -> tempfile::TempDir {
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-data");
    std::fs::create_dir_all(&base).unwrap();
    tempfile::Builder::new()
        .prefix(name)
        .tempdir_in(base)
        .unwrap()
}

fn message(body_len: usize) -> NewMessage {
    NewMessage {
        deliver_at_ms: 1_796_117_400_000,
        topic: "orders.timeout".into(),
        key: Some("order-42".into()),
        sink: "broker".into(),
        // The record is ~50 bytes of fixed fields and names plus the body.
        body: vec![b'x'; body_len.saturating_sub(50)],
        ..NewMessage::default()
    }
}

/// Appends `total` records as batches of `batch` from `submitters` threads; returns the elapsed time.
fn run(
    log: &Arc<ScheduleLog>,
    record: &NewMessage,
    total: u64,
    batch: usize,
    submitters: usize,
) -> Duration {
    let encoded = record.encode().unwrap();
    let batches = total.div_ceil(batch as u64);
    let per_thread = batches.div_ceil(submitters as u64);
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..submitters {
            let log = log.clone();
            let encoded = encoded.clone();
            s.spawn(move || {
                for _ in 0..per_thread {
                    log.append(vec![encoded.clone(); batch]).wait().unwrap();
                }
            });
        }
    });
    start.elapsed()
}

/// Like [`run`], but the submitters are tasks on a two-thread tokio runtime awaiting their acks, as the
/// HTTP service's request handlers are: waking a task is much cheaper than waking an OS thread.
fn run_async(log: &Arc<ScheduleLog>, record: &NewMessage, total: u64, tasks: usize) -> Duration {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let encoded = record.encode().unwrap();
    let per_task = total.div_ceil(tasks as u64);
    let start = Instant::now();
    runtime.block_on(async {
        let handles: Vec<_> = (0..tasks)
            .map(|_| {
                let log = log.clone();
                let encoded = encoded.clone();
                tokio::spawn(async move {
                    for _ in 0..per_task {
                        log.append(vec![encoded.clone()]).await.unwrap();
                    }
                })
            })
            .collect();
        for handle in handles {
            handle.await.unwrap();
        }
    });
    start.elapsed()
}

fn durable_appends(c: &mut Criterion) {
    let dir = bench_dir("append");
    let log = Arc::new(ScheduleLog::open(dir.path(), Options::default()).unwrap());
    let mut group = c.benchmark_group("durable_append");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    let cases: &[(&str, usize, usize, usize)] = &[
        // (record size label, bytes, batch, submitters)
        ("100B", 100, 1, 64),
        ("100B", 100, 100, 16),
        ("1KiB", 1024, 1, 1),
        ("1KiB", 1024, 1, 16),
        ("1KiB", 1024, 1, 64),
        ("1KiB", 1024, 10, 64),
        ("1KiB", 1024, 100, 4),
        ("1KiB", 1024, 100, 16),
        ("1KiB", 1024, 1000, 4),
        ("16KiB", 16 * 1024, 1, 64),
        ("16KiB", 16 * 1024, 16, 16),
    ];
    for &(label, bytes, batch, submitters) in cases {
        let record = message(bytes);
        let record_bytes = record.encode().unwrap().frame_len() as u64;
        group.throughput(Throughput::Elements(1));
        let id = BenchmarkId::new(
            format!("{label}({record_bytes}B)"),
            format!("batch{batch}/submitters{submitters}"),
        );
        group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                run(
                    &log,
                    &record,
                    iters.max(batch as u64 * submitters as u64),
                    batch,
                    submitters,
                )
            })
        });
    }
    for tasks in [64usize, 1024] {
        let record = message(1024);
        group.throughput(Throughput::Elements(1));
        let id = BenchmarkId::new("1KiB(1061B)", format!("batch1/async_tasks{tasks}"));
        group.bench_function(id, |b| {
            b.iter_custom(|iters| run_async(&log, &record, iters.max(tasks as u64), tasks))
        });
    }
    group.finish();
}

/// The disk's own synced-write bandwidth: `write` + `fdatasync` of `chunk` bytes into a zero-filled file,
/// which is exactly what one WAL group commit does.
fn raw_synced_writes(c: &mut Criterion) {
    let dir = bench_dir("raw");
    let path = dir.path().join("raw.bin");
    let file_bytes: u64 = 256 << 20;
    {
        let mut f = File::create(&path).unwrap();
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..(file_bytes >> 20) {
            f.write_all(&zeros).unwrap();
        }
        f.sync_all().unwrap();
    }
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let mut group = c.benchmark_group("raw_write_fdatasync");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for chunk in [4usize << 10, 64 << 10, 1 << 20, 4 << 20] {
        let data = vec![0x5au8; chunk];
        group.throughput(Throughput::Bytes(chunk as u64));
        let mut pos = 0u64;
        group.bench_function(
            BenchmarkId::from_parameter(format!("{}KiB", chunk >> 10)),
            |b| {
                b.iter(|| {
                    if pos + chunk as u64 > file_bytes {
                        pos = 0;
                    }
                    file.write_all_at(&data, pos).unwrap();
                    file.sync_data().unwrap();
                    pos += chunk as u64;
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, durable_appends, raw_synced_writes);
criterion_main!(benches);
