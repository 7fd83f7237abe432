//! The wheel's insert and fire rates on one thread, and the loader's entries/s for a segment over 1 GiB.
//!
//! Run: `cargo bench --bench wheel`. The loader bench writes a 1.1 GiB segment under `target/bench-data`
//! once (about half a minute) and then times `ScheduleLog::watch` on it.

#![allow(clippy::unwrap_used, reason = "a benchmark stops at the first failure")]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use delayd::scheduler::wheel::{Entry, Wheel};
use schedulelog::{Bucket, ManualClock, NewMessage, Options, ScheduleLog, SegmentMinutes};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[path = "common/entries.rs"]
mod common;
use common::{entries, HOUR_MS, T0};

fn wheel_rates(c: &mut Criterion) {
    const N: usize = 1_000_000;
    let input = entries(N);
    let mut group = c.benchmark_group("wheel");
    group
        .sample_size(10)
        .throughput(Throughput::Elements(N as u64));
    group.bench_function("insert_1M", |b| {
        b.iter_batched(
            || Wheel::new(500, 2 * HOUR_MS + 300_000, T0),
            |mut wheel| {
                for entry in &input {
                    wheel.insert(*entry);
                }
                wheel
            },
            criterion::BatchSize::LargeInput,
        )
    });
    group.bench_function("fire_1M", |b| {
        b.iter_batched(
            || {
                let mut wheel = Wheel::new(500, 2 * HOUR_MS + 300_000, T0);
                wheel.insert_all(&input);
                wheel
            },
            |mut wheel| {
                // Step from deadline to deadline, as the wheel thread does.
                let mut fired = 0;
                while let Some(now) = wheel.next_deadline() {
                    wheel.advance(now);
                    while wheel.pop_due(now).is_some() {
                        fired += 1;
                    }
                }
                assert_eq!(fired, N);
            },
            criterion::BatchSize::LargeInput,
        )
    });
    group.finish();
}

fn loader_rate(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-data/loader");
    let clock = Arc::new(ManualClock::new(T0));
    let options = || Options {
        clock: clock.clone(),
        ..Options::default()
    };
    let bucket = Bucket::of(T0, SegmentMinutes::DEFAULT);
    // 1.1 M messages of 1 KiB: a 1.1 GiB segment. Built once and kept between runs.
    const MESSAGES: u64 = 1_100_000;
    {
        let log = ScheduleLog::open(&dir, options()).unwrap();
        let have = log.reader(bucket).unwrap().map_or(0, |r| r.len());
        if have < MESSAGES {
            let body = vec![b'x'; 1000];
            for chunk in 0..(MESSAGES - have).div_ceil(1000) {
                let batch = (0..1000)
                    .map(|i| {
                        let at = T0 + ((chunk * 1000 + i) % HOUR_MS as u64) as i64;
                        NewMessage {
                            deliver_at_ms: at,
                            topic: "t".into(),
                            sink: "broker".into(),
                            body: body.clone(),
                            ..NewMessage::default()
                        }
                        .encode()
                        .unwrap()
                    })
                    .collect();
                log.append(batch).wait().unwrap();
            }
        }
        log.close().unwrap();
    }
    let log = ScheduleLog::open(&dir, options()).unwrap();
    let entries = log.reader(bucket).unwrap().unwrap().len();
    let bytes = std::fs::metadata(dir.join(format!("schedule/{bucket}.log")))
        .unwrap()
        .len();
    println!(
        "segment: {entries} messages, {:.2} GiB",
        bytes as f64 / f64::from(1 << 30)
    );
    let mut group = c.benchmark_group("loader");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(10))
        .throughput(Throughput::Elements(entries));
    group.bench_function("watch_1.1GiB_segment", |b| {
        b.iter(|| {
            let snapshot = log.watch(bucket).unwrap();
            log.unwatch(bucket);
            assert_eq!(snapshot.pending.len() as u64, entries);
            // Paging into the wheel is part of loading.
            let mut wheel = Wheel::new(500, 2 * HOUR_MS + 300_000, T0);
            let minute = bucket.start_minute();
            let paged: Vec<Entry> = snapshot
                .pending
                .iter()
                .map(|e| Entry::new(e.deliver_at_ms, minute, e.offset, e.frame_len, e.sink_tag))
                .collect();
            wheel.insert_all(&paged);
            wheel
        })
    });
    group.finish();
}

criterion_group!(benches, wheel_rates, loader_rate);
criterion_main!(benches);
