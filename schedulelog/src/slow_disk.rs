//! A slower disk on demand, for benchmarks: with the `slow-disk` feature, every `fdatasync`/`fsync` the
//! engine (and delayd's broker store) makes waits `DELAYD_SLOW_DISK_SYNC_US` microseconds longer, and
//! every write of 64 KiB or more waits `DELAYD_SLOW_DISK_WRITE_US_PER_MIB` microseconds per MiB longer.
//! The waits are taken one at a time behind one lock, as a disk with one queue would serve them, so a
//! burst of syncs in one thread delays a sync in another: the stalls of a slow day can be reproduced on
//! a fast one and a fix shown by A/B. Without the feature (every production build) the calls compile to
//! nothing.
//!
//! The variables are read once, at the first call; unset or unparsable means 0 (no added latency).

/// Call just before a `fdatasync` or `fsync`.
#[inline]
pub fn sync() {
    #[cfg(feature = "slow-disk")]
    imp::wait(imp::config().sync_us);
}

/// Call just before writing `bytes` bytes to a file.
#[inline]
pub fn write(bytes: usize) {
    #[cfg(feature = "slow-disk")]
    if bytes >= imp::LARGE_WRITE {
        let us = imp::config().write_us_per_mib.saturating_mul(bytes as u64) >> 20;
        imp::wait(us);
    }
    #[cfg(not(feature = "slow-disk"))]
    let _ = bytes;
}

#[cfg(any(test, feature = "slow-disk"))]
mod imp {
    use std::sync::{Mutex, OnceLock};
    use std::time::Duration;

    /// Writes from this size up pay for their bytes (smaller ones are absorbed by the page cache or the
    /// disk's own cache on any disk).
    #[allow(dead_code)] // read by the feature build
    pub(super) const LARGE_WRITE: usize = 64 << 10;

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub(super) struct Config {
        pub sync_us: u64,
        pub write_us_per_mib: u64,
    }

    pub(super) fn parse(sync_us: Option<&str>, write_us_per_mib: Option<&str>) -> Config {
        let number = |v: Option<&str>| v.and_then(|v| v.trim().parse().ok()).unwrap_or(0);
        Config {
            sync_us: number(sync_us),
            write_us_per_mib: number(write_us_per_mib),
        }
    }

    #[allow(dead_code)] // only the feature build reads the environment
    pub(super) fn config() -> Config {
        static CONFIG: OnceLock<Config> = OnceLock::new();
        *CONFIG.get_or_init(|| {
            let var = |name| std::env::var(name).ok();
            parse(
                var("DELAYD_SLOW_DISK_SYNC_US").as_deref(),
                var("DELAYD_SLOW_DISK_WRITE_US_PER_MIB").as_deref(),
            )
        })
    }

    /// Sleeps `us` microseconds holding the one "device" lock.
    #[allow(dead_code)]
    pub(super) fn wait(us: u64) {
        static DEVICE: Mutex<()> = Mutex::new(());
        if us > 0 {
            let _device = DEVICE.lock().unwrap_or_else(|p| p.into_inner());
            std::thread::sleep(Duration::from_micros(us));
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn unset_or_garbage_adds_nothing() {
            assert_eq!(parse(None, None), Config::default());
            assert_eq!(parse(Some("x"), Some("-3")), Config::default());
            let config = parse(Some(" 300 "), Some("3400"));
            assert_eq!((config.sync_us, config.write_us_per_mib), (300, 3400));
        }
    }
}
