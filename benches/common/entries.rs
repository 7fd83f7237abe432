//! Wheel entries for the benches: `n` entries due uniformly (pseudo-randomly) over the hour after T0.

use delayd::scheduler::wheel::Entry;

pub const HOUR_MS: i64 = 3_600_000;
/// 2026-12-01T09:00:00Z
pub const T0: i64 = 1_796_115_600_000;

pub fn entries(n: usize) -> Vec<Entry> {
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            Entry::new(
                T0 + (x % HOUR_MS as u64) as i64,
                29_935_260,
                i as u64 * 1024,
                1024,
                7,
            )
        })
        .collect()
}
