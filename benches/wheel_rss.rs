//! Memory per wheel entry, measured as resident set size: 10 M entries due within one hour, paged in the
//! way the loader does (one `insert_all` per bucket snapshot), then the RSS growth divided by the entry
//! count. (Paging the same entries in 100 smaller batches costs ~24.6 bytes per entry: each slot's vector
//! is then resized 100 times and the allocator keeps the holes.)
//!
//! Run: `cargo bench --bench wheel_rss`.

#![allow(clippy::unwrap_used, reason = "a benchmark stops at the first failure")]

use delayd::scheduler::wheel::{Entry, Wheel};

#[path = "common/entries.rs"]
mod common;
use common::{entries, HOUR_MS, T0};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn main() {
    const N: usize = 10_000_000;
    let before = rss_bytes();
    let mut wheel = Wheel::new(500, 2 * HOUR_MS + 300_000, T0);
    // One bucket's snapshot, paged in with one `insert_all` as the loader does; the snapshot is freed
    // before measuring (it is returned to the system: allocations this large are mapped, not heaped).
    let entries = entries(N);
    wheel.insert_all(&entries);
    drop(entries);
    let after = rss_bytes();
    assert_eq!(wheel.len(), N);
    println!(
        "wheel RSS: {} entries, {:.1} MiB, {:.2} bytes per entry (entry size {} bytes)",
        N,
        (after - before) as f64 / f64::from(1 << 20),
        (after - before) as f64 / N as f64,
        size_of::<Entry>()
    );
}
