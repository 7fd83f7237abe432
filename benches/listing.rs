//! Listings and lookups in a bucket of 10 M pending messages (DESIGN.md §13): how long the next 100
//! pending messages of a topic take to list (the first time, which builds the bucket's due order, and
//! then), and how long a status lookup takes with 1 M outcomes in the bucket's dispatch log, against
//! reading that whole log as lookups did before. Real files in `target/bench-listing` (about 3 GB
//! written; deleted at the end), the storage engine on its own (no HTTP).
//!
//! Run: `cargo bench --bench listing` (`LISTING_MESSAGES=1000000` for a quicker run).

#![allow(clippy::unwrap_used, reason = "a benchmark stops at the first failure")]

use delayd::schedulelog::{
    Appended, ListQuery, ManualClock, NewMessage, Options, Outcome, OutcomeKind, ScheduleLog,
    StatusFilter,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HOUR_MS: i64 = 3_600_000;
/// 2026-12-01T09:00:00Z
const T0: i64 = 1_796_115_600_000;

fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: f64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096.0 / f64::from(1 << 20)
}

/// Median and maximum of `runs` timings of `f`, in ms.
fn time(runs: usize, mut f: impl FnMut(usize)) -> (f64, f64) {
    let mut ms: Vec<f64> = (0..runs)
        .map(|i| {
            let started = Instant::now();
            f(i);
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    (ms[runs / 2], ms[runs - 1])
}

fn main() {
    let n: usize = std::env::var("LISTING_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000_000);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-listing");
    let _ = std::fs::remove_dir_all(&dir);
    let clock = Arc::new(ManualClock::new(T0));
    let log = ScheduleLog::open(
        &dir,
        Options {
            clock: clock.clone(),
            ..Options::default()
        },
    )
    .unwrap();

    // n messages due uniformly over one hour two hours ahead; 1 in 10 on a second topic.
    let bucket_start = T0 + 2 * HOUR_MS;
    let started = Instant::now();
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    let mut ids: Vec<Appended> = Vec::with_capacity(n);
    let body = vec![b'x'; 100];
    let mut acks = std::collections::VecDeque::new();
    for batch in 0..n.div_ceil(10_000) {
        let messages = (batch * 10_000..((batch + 1) * 10_000).min(n))
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                NewMessage {
                    deliver_at_ms: bucket_start + (x % HOUR_MS as u64) as i64,
                    topic: if i % 10 == 9 { "audit" } else { "orders" }.into(),
                    key: None,
                    headers: Vec::new(),
                    sink: "broker".into(),
                    body: body.clone(),
                    retry_of: None,
                    dedup: false,
                }
                .encode()
                .unwrap()
            })
            .collect();
        acks.push_back(log.append(messages));
        if acks.len() > 8 {
            ids.extend(acks.pop_front().unwrap().wait().unwrap());
        }
    }
    for ack in acks {
        ids.extend(ack.wait().unwrap());
    }
    log.checkpoint().unwrap();
    let bucket = ids[0].location.bucket;
    println!(
        "{n} messages stored in {:.1} s; bucket {bucket}",
        started.elapsed().as_secs_f64()
    );

    // 1 M of them (or a tenth) delivered: their outcomes in the bucket's dispatch log.
    let delivered = (n / 10).min(1_000_000);
    for chunk in ids[..delivered].chunks(10_000) {
        let outcomes: Vec<_> = chunk
            .iter()
            .map(|a| {
                let outcome = Outcome {
                    seq: a.location.seq,
                    at_ms: T0,
                    attempt: 0,
                    kind: OutcomeKind::Delivered,
                };
                (a.location.bucket, outcome)
            })
            .collect();
        log.record_outcomes(&outcomes).unwrap();
    }
    println!("{delivered} outcomes recorded");

    let query = |topic: &str| ListQuery {
        from_ms: T0,
        to_ms: i64::MAX,
        status: StatusFilter::Pending,
        topic: Some(topic.into()),
        limit: 100,
        scan_limit: 10_000,
        after: None,
    };
    let rss = rss_mib();
    let (outcomes, _) = time(1, |_| {
        log.lookup(ids[0].id).unwrap().unwrap();
    });
    println!("first lookup in the bucket (reads its {delivered} outcomes: the view's outcome index): {outcomes:.0} ms");
    let (first, _) = time(1, |_| {
        assert_eq!(log.list(&query("orders")).unwrap().messages.len(), 100);
    });
    println!(
        "then the first listing of the next 100 pending (reads the index, builds the due order): {first:.0} ms; RSS +{:.0} MiB in all",
        rss_mib() - rss
    );
    let (median, max) = time(50, |_| {
        assert_eq!(log.list(&query("orders")).unwrap().messages.len(), 100);
    });
    println!(
        "next 100 pending of a topic (9 in 10 messages): median {median:.2} ms, max {max:.2} ms"
    );
    let (median, max) = time(50, |_| {
        assert_eq!(log.list(&query("audit")).unwrap().messages.len(), 100);
    });
    println!(
        "next 100 pending of a topic (1 in 10 messages): median {median:.2} ms, max {max:.2} ms"
    );
    let mut deep = query("orders");
    for _ in 0..1000 {
        deep.after = log.list(&deep).unwrap().next;
    }
    let (median, max) = time(50, |_| {
        assert_eq!(log.list(&deep).unwrap().messages.len(), 100);
    });
    println!("the 1001st page of 100 (cursor): median {median:.2} ms, max {max:.2} ms");
    let (median, max) = time(20, |_| {
        assert_eq!(log.timeline(i64::MIN, i64::MAX).unwrap().len(), 1);
    });
    println!("timeline: median {median:.2} ms, max {max:.2} ms");

    // Lookups: one delivered message in 1,000, the rest pending, spread over the bucket.
    let step = n / 1000;
    let (median, max) = time(1000, |i| {
        let status = log.lookup(ids[i * step].id).unwrap().unwrap();
        assert_eq!(status.message.id, ids[i * step].id);
    });
    println!("status lookup by id: median {median:.3} ms, max {max:.2} ms");
    let (median, _) = time(5, |_| {
        assert!(log.outcomes(bucket).unwrap().len() >= delivered);
    });
    println!(
        "reading the bucket's whole dispatch log ({delivered} outcomes), what each lookup did before: median {median:.0} ms"
    );
    drop(log);
    std::fs::remove_dir_all(&dir).unwrap();
    std::thread::sleep(Duration::from_millis(10));
}
