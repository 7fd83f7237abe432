//! File descriptors: the process's limit, how many are open, and how many HTTP connections that leaves.
//!
//! Every connection is a descriptor, and so is every file the storage engine and the broker open: the
//! WAL and the next file it prepares, each open bucket's segment, index and dispatch log, a reader per
//! lookup, the segment logs the lanes read due records from (up to 16), checkpoint files, the broker's
//! commit logs and one consume-queue file per queue of every topic (so storage's share grows as topics
//! are created), and the webhook sinks' outbound connections.
//! When the process runs out, `open` fails with EMFILE wherever it happens to be called next, and that
//! may be a storage write. So HTTP connections are capped (see [`Budget`]) such that they never take
//! the last `limits.reserved_fds` descriptors: whatever else the process opens has those to grow into.
//!
//! Invariant: `other + reserved + REFUSAL_SLOTS + cap <= soft limit`, where `other` is every descriptor
//! open that is not an HTTP connection, measured once a second; the cap is recomputed with it, so a
//! process whose storage grows sheds connections, not storage writes.

use std::io;

/// The open-file limit (`RLIMIT_NOFILE`) before and after [`raise_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raised {
    pub before: u64,
    pub after: u64,
}

/// Raises the soft open-file limit to the hard limit (the most an unprivileged process may): the soft
/// default (often 1,024) is a relic of `select()`, which delayd does not use; the hard limit is what the
/// operator or the service manager (`LimitNOFILE=`) allows.
pub fn raise_limit() -> io::Result<Raised> {
    let (before, _) = rlimit::getrlimit(rlimit::Resource::NOFILE)?;
    let after = rlimit::increase_nofile_limit(u64::MAX)?;
    Ok(Raised { before, after })
}

/// The soft open-file limit: the number of descriptors this process may have open.
pub fn soft_limit() -> io::Result<u64> {
    rlimit::getrlimit(rlimit::Resource::NOFILE).map(|(soft, _)| soft)
}

/// Descriptors open in this process now (Linux: the entries of `/proc/self/fd`, less the one reading
/// it); `Ok(None)` on a system without `/proc`. An error is most likely EMFILE: every descriptor is
/// taken, which is no time to assume that none are.
pub fn open_count() -> io::Result<Option<u64>> {
    match std::fs::read_dir("/proc/self/fd") {
        Ok(entries) => Ok(Some((entries.count() as u64).saturating_sub(1))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Descriptors kept for refusing connections past the cap: a refused connection is still accepted and
/// answered (503 `overloaded`, or its readiness and health probes), for at most a second each. At the
/// cap a connection is accepted only with one of these in hand, so the edge's descriptors stay within
/// `cap + REFUSAL_SLOTS`, and further connections wait in the listen backlog.
pub const REFUSAL_SLOTS: usize = 32;

/// Below this many connections at start, the open-file limit is refused as too low to serve.
pub const MIN_CONNECTIONS: usize = 8;

/// How the connection cap follows from the open-file limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// `limits.max_connections`.
    pub max_connections: usize,
    /// Descriptors left for everything that is not an HTTP connection to grow into.
    pub reserved: u64,
}

impl Budget {
    /// The cap, given the soft limit and the descriptors open that are not HTTP connections: the
    /// configured maximum, or fewer when the limit leaves fewer.
    pub fn cap(&self, soft_limit: u64, other_open: u64) -> usize {
        let left = soft_limit
            .saturating_sub(other_open)
            .saturating_sub(self.reserved)
            .saturating_sub(REFUSAL_SLOTS as u64);
        usize::try_from(left)
            .unwrap_or(usize::MAX)
            .min(self.max_connections)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_the_reserve_free() {
        let budget = Budget {
            max_connections: 1024,
            reserved: 64,
        };
        // Plenty of descriptors: the configured maximum.
        assert_eq!(budget.cap(1 << 20, 40), 1024);
        // A low limit: what is left after storage's descriptors, the reserve and the refusal slots.
        assert_eq!(budget.cap(256, 40), 256 - 40 - 64 - REFUSAL_SLOTS);
        // Storage grew into the limit: no connections rather than a failed storage write.
        assert_eq!(budget.cap(256, 200), 0);
        assert_eq!(budget.cap(0, 0), 0);
    }

    #[test]
    fn the_limit_and_the_count_are_read() {
        let soft = soft_limit().unwrap();
        assert!(soft >= 16, "{soft}");
        let before = open_count().unwrap().expect("/proc/self/fd");
        let file = tempfile::tempfile().unwrap();
        let with_file = open_count().unwrap().unwrap();
        drop(file);
        // Other tests open and close files meanwhile; at least the one opened here counts.
        assert!(with_file >= 1 && before >= 1, "{before} {with_file}");
    }
}
