//! The state of a connection to another message queue, kept by each MQ source and MQ sink: whether it
//! is up and the last error. `GET /v1/sources` and `GET /v1/sinks` show it, the gauges
//! `delayd_source_connected{source}` / `delayd_sink_connected{sink}` follow it, and the log says each
//! change once (not every failed retry while the MQ stays away). A source's connection state also
//! counts its requests by outcome since the start.

use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
struct State {
    connected: bool,
    /// Whether anything was reported yet (the first failure is logged even without a success before).
    reported: bool,
    last_error: Option<(i64, String)>,
    failures: u64,
    /// A source's requests by outcome since the start (`scheduled`, `duplicate`, ...).
    handled: std::collections::BTreeMap<&'static str, u64>,
    /// A sink's deliveries put off since the start because its MQ could not be reached.
    postponed: u64,
    /// When the connection was last found up or down.
    checked_at: Option<std::time::Instant>,
}

/// One connection's state; cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct ConnectionState {
    /// `source` or `sink`: the gauge's and the log's word.
    role: &'static str,
    name: String,
    kind: String,
    state: Arc<Mutex<State>>,
}

impl ConnectionState {
    pub fn new(role: &'static str, name: &str, kind: &str) -> ConnectionState {
        let connection = ConnectionState {
            role,
            name: name.to_string(),
            kind: kind.to_string(),
            state: Arc::default(),
        };
        connection.gauge(false);
        connection
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn gauge(&self, up: bool) {
        let value = if up { 1.0 } else { 0.0 };
        match self.role {
            "source" => {
                metrics::gauge!("delayd_source_connected", "source" => self.name.clone()).set(value)
            }
            _ => metrics::gauge!("delayd_sink_connected", "sink" => self.name.clone()).set(value),
        }
    }

    /// The connection works (a command succeeded).
    pub fn up(&self) {
        let mut state = self.state();
        state.checked_at = Some(std::time::Instant::now());
        if !state.connected {
            if state.failures > 0 {
                tracing::info!(role = self.role, name = %self.name, kind = %self.kind, failures = state.failures, "connected again");
            } else {
                tracing::info!(role = self.role, name = %self.name, kind = %self.kind, "connected");
            }
            state.connected = true;
            state.reported = true;
            state.failures = 0;
            self.gauge(true);
        }
    }

    /// The connection failed at `now_ms`: logged when it was up (or at the first failure), counted
    /// otherwise.
    pub fn down(&self, now_ms: i64, error: &str) {
        let mut state = self.state();
        state.checked_at = Some(std::time::Instant::now());
        state.failures += 1;
        state.last_error = Some((now_ms, error.to_string()));
        if state.connected || !state.reported {
            tracing::warn!(role = self.role, name = %self.name, kind = %self.kind, %error, "connection lost or refused; retrying with backoff");
            state.connected = false;
            state.reported = true;
            self.gauge(false);
        }
    }

    /// A sink could not reach its MQ for `count` deliveries (they wait, no attempt used): the
    /// connection is down, and they are counted.
    pub fn unreachable(&self, now_ms: i64, error: &str, count: usize) {
        self.down(now_ms, error);
        self.postponed(count);
    }

    /// `count` deliveries found no answer from a sink's MQ that answered for others (they wait, no
    /// attempt used): counted, the connection unchanged.
    pub fn postponed(&self, count: usize) {
        self.state().postponed += count as u64;
    }

    /// A source handled a request so.
    pub fn handled(&self, outcome: &'static str, count: u64) {
        *self.state().handled.entry(outcome).or_default() += count;
    }

    pub fn is_up(&self) -> bool {
        self.state().connected
    }

    /// How long ago the connection was last found up or down; `None` if never.
    pub fn checked_ago(&self) -> Option<std::time::Duration> {
        self.state().checked_at.map(|at| at.elapsed())
    }

    /// What it says of its connection now (`GET /v1/sources` and `/v1/sinks` show it).
    pub fn snapshot(&self) -> ConnectionSnapshot {
        let state = self.state();
        ConnectionSnapshot {
            name: self.name.clone(),
            kind: self.kind.clone(),
            connected: state.connected,
            handled: state.handled.clone(),
            postponed: state.postponed,
            last_error: state.last_error.clone(),
        }
    }
}

/// A connection's state at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionSnapshot {
    pub name: String,
    pub kind: String,
    pub connected: bool,
    /// A source's requests by outcome since the start.
    pub handled: std::collections::BTreeMap<&'static str, u64>,
    /// A sink's deliveries that found its MQ away since the start.
    pub postponed: u64,
    /// The last error, and when (clock ms).
    pub last_error: Option<(i64, String)>,
}
