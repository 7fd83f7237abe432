//! The names of topics, sinks, sources and groups, and of targets on another message queue.
//!
//! Invariant: a valid name is safe as a file name (no `/`, not `.` or `..`, at most 200 bytes).

/// Topic, sink and group names: `[A-Za-z0-9._-]{1,200}`, and not only dots (so no name is `.` or `..`
/// and none can leave the data dir when used as a directory name).
pub fn valid_name(name: &str) -> bool {
    (1..=200).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !name.bytes().all(|b| b == b'.')
}

/// A target on another message queue (a Redis stream key, a NATS subject, an AMQP routing key): 1 to 255
/// bytes, no whitespace or control characters. Never a file name.
pub fn valid_target(target: &str) -> bool {
    (1..=255).contains(&target.len())
        && !target.chars().any(|c| c.is_whitespace() || c.is_control())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("orders.timeout"));
        assert!(valid_name("a-b_c.9"));
        assert!(!valid_name(""));
        assert!(!valid_name(".."));
        assert!(!valid_name("."));
        assert!(!valid_name("a/b"));
        assert!(!valid_name("$dead"));
        assert!(!valid_name(&"x".repeat(201)));
    }
}
