//! Scheduler tests on a manual clock: hours of simulated time, restarts, cancels, retries, isolation.
//! The test sink reports every delivery on a channel; tests wait on that channel (and on the scheduler's
//! `settled` reports), never on sleeps.

use super::*;
use crate::sink::{BoxFuture, Delivery, Sink, SinkOutcome, SinkPolicy, SinkRegistry};
use crossbeam_channel::Receiver;
use schedulelog::{ManualClock, MessageState, NewMessage, Options};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A gate a test holds a scheduler task at: it lets one through per permit.
type Gate = Arc<tokio::sync::Semaphore>;

/// Points where a test holds a scheduler thread or task, to run something else at exactly that moment.
/// Each is a signal out (the moment has come) and a gate in (a permit, or a message, per pass).
#[derive(Debug, Default)]
pub(crate) struct Hooks {
    /// A lane has written retries through the WAL and not yet recorded their `retried` outcomes.
    pub retry_written: Option<(Sender<()>, Arc<tokio::sync::Semaphore>)>,
    /// The loader has marked this bucket loaded and not yet taken its snapshot.
    pub loader_marked: Option<(Sender<Bucket>, Receiver<()>)>,
    /// A cancel has taken its message and not yet looked it up.
    pub cancel_begun: Option<(Sender<MessageId>, Arc<tokio::sync::Semaphore>)>,
    /// A due record could not be read (the error's text); signalled once its entry was handed back.
    pub read_failed: Option<Sender<String>>,
    /// A lane held back a due message whose cancel is in progress.
    pub held: Option<Sender<MessageId>>,
    /// A cancel's tombstone is durable (its seq) and the cancel has not yet recorded it.
    pub tombstone_written: Option<(Sender<u64>, Arc<tokio::sync::Semaphore>)>,
}

/// Signals a hook's moment with `value`, then waits at its gate for a permit (one a pass).
async fn pass<T>(hook: Option<(Sender<T>, Gate)>, value: T) {
    if let Some((signal, gate)) = hook {
        let _ = signal.send(value);
        if let Ok(permit) = gate.acquire().await {
            permit.forget();
        }
    }
}

/// A gated hook's two ends: the scheduler's (it signals, then waits at the gate) and the test's (the
/// signals, and the gate, shut, to give a permit a pass).
fn gated_hook<T>() -> ((Sender<T>, Gate), (Receiver<T>, Gate)) {
    let (signal, signals) = crossbeam_channel::unbounded();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    ((signal, gate.clone()), (signals, gate))
}

impl SchedulerState {
    fn hooks(&self) -> std::sync::MutexGuard<'_, Hooks> {
        self.hooks.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) async fn hook_retry_written(&self) {
        let hook = self.hooks().retry_written.clone();
        pass(hook, ()).await;
    }

    pub(crate) fn hook_loader_marked(&self, bucket: Bucket) {
        let hook = self.hooks().loader_marked.clone();
        if let Some((signal, gate)) = hook {
            let _ = signal.send(bucket);
            let _ = gate.recv();
        }
    }

    pub(crate) async fn hook_cancel_begun(&self, id: MessageId) {
        let hook = self.hooks().cancel_begun.clone();
        pass(hook, id).await;
    }

    pub(crate) async fn hook_tombstone_written(&self, seq: u64) {
        let hook = self.hooks().tombstone_written.clone();
        pass(hook, seq).await;
    }

    pub(crate) fn hook_held(&self, id: MessageId) {
        if let Some(signal) = &self.hooks().held {
            let _ = signal.send(id);
        }
    }

    pub(crate) fn hook_read_failed(&self, error: &schedulelog::Error) {
        if let Some(signal) = &self.hooks().read_failed {
            let _ = signal.send(error.to_string());
        }
    }
}

/// 2026-12-01T09:30:00Z
const T0: i64 = 1_796_117_400_000;
const MINUTE: i64 = 60_000;
const HOUR: i64 = 60 * MINUTE;
const WAIT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone)]
struct Received {
    body: String,
    sink: &'static str,
    attempt: u16,
    deliver_at_ms: i64,
    /// The scheduler clock when the sink got it.
    at_ms: i64,
    /// Real time when the sink got it, in microseconds since the epoch.
    at_us: i64,
    /// Whether it came through `deliver_blocking` (else through `deliver`).
    in_place: bool,
}

/// Reports every delivery; answers from a script keyed by body (default: delivered); optionally holds
/// every call until released. With `in_place`, it delivers through `deliver_blocking` (as the built-in
/// broker does), panicking in the first `in_place` calls.
#[derive(Debug)]
struct TestSink {
    name: &'static str,
    clock: Arc<dyn Clock>,
    tx: Sender<Received>,
    script: Mutex<HashMap<String, Vec<SinkOutcome>>>,
    gate: Option<Arc<tokio::sync::Semaphore>>,
    /// Signalled when a call starts, before it waits at the gate.
    entered: Sender<()>,
    /// `Some(panics)`: delivers in place, panicking in that many calls first.
    in_place: Option<AtomicU32>,
}

impl TestSink {
    /// Reports a batch and answers it from the script.
    fn answer(&self, batch: &[Delivery], at_ms: i64, in_place: bool) -> Vec<SinkOutcome> {
        let at_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros() as i64;
        let mut script = self.script.lock().unwrap();
        batch
            .iter()
            .map(|d| {
                let body = String::from_utf8(d.message.body.clone()).unwrap();
                let _ = self.tx.send(Received {
                    body: body.clone(),
                    sink: self.name,
                    attempt: d.message.attempt,
                    deliver_at_ms: d.message.deliver_at_ms,
                    at_ms,
                    at_us,
                    in_place,
                });
                match script.get_mut(&body) {
                    Some(answers) if !answers.is_empty() => answers.remove(0),
                    _ => SinkOutcome::Delivered,
                }
            })
            .collect()
    }
}

impl Sink for TestSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(async move {
            let at_ms = self.clock.now_ms();
            let _ = self.entered.send(());
            if let Some(gate) = &self.gate {
                // Closed when the harness is dropped: a failed test ends instead of hanging here.
                let _ = gate.acquire().await;
            }
            self.answer(batch, at_ms, false)
        })
    }

    fn deliver_blocking(&self, batch: &[Delivery]) -> Option<Vec<SinkOutcome>> {
        let panics = self.in_place.as_ref()?;
        let at_ms = self.clock.now_ms();
        let _ = self.entered.send(());
        let one_less =
            panics.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if one_less.is_ok() {
            panic!("a deliberate panic in deliver_blocking (test)");
        }
        Some(self.answer(batch, at_ms, true))
    }
}

struct Harness {
    dir: tempfile::TempDir,
    clock: Arc<dyn Clock>,
    manual: Option<Arc<ManualClock>>,
    runtime: tokio::runtime::Runtime,
    log: Option<Arc<ScheduleLog>>,
    scheduler: Option<Scheduler>,
    received: Receiver<Received>,
    received_tx: Sender<Received>,
    settled: Receiver<Vec<(MessageId, Settled)>>,
    settled_tx: Sender<Vec<(MessageId, Settled)>>,
    sinks: Vec<(
        &'static str,
        SinkPolicy,
        Option<Arc<tokio::sync::Semaphore>>,
    )>,
    script: HashMap<String, Vec<SinkOutcome>>,
    /// `Some(panics)`: the sinks deliver in place (see [`TestSink`]).
    in_place: Option<u32>,
    dead_letters: Option<Arc<dyn Sink>>,
    /// The delivery lease the scheduler is started with (a cluster leader's).
    lease: Option<Arc<Lease>>,
    entered: Receiver<()>,
    entered_tx: Sender<()>,
}

impl Harness {
    fn manual() -> Harness {
        let manual = Arc::new(ManualClock::new(T0));
        Harness::with_clock(manual.clone(), Some(manual))
    }

    fn with_clock(clock: Arc<dyn Clock>, manual: Option<Arc<ManualClock>>) -> Harness {
        let (received_tx, received) = crossbeam_channel::unbounded();
        let (settled_tx, settled) = crossbeam_channel::unbounded();
        let (entered_tx, entered) = crossbeam_channel::unbounded();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let mut harness = Harness {
            dir: tempfile::tempdir().unwrap(),
            clock,
            manual,
            runtime,
            log: None,
            scheduler: None,
            received,
            received_tx,
            settled,
            settled_tx,
            sinks: vec![("a", SinkPolicy::default(), None)],
            script: HashMap::new(),
            in_place: None,
            dead_letters: None,
            lease: None,
            entered,
            entered_tx,
        };
        harness.open_log();
        harness
    }

    fn open_log(&mut self) {
        let options = Options {
            clock: self.clock.clone(),
            wal_segment_bytes: 1 << 20,
            ..Options::default()
        };
        self.log = Some(Arc::new(
            ScheduleLog::open(self.dir.path(), options).unwrap(),
        ));
    }

    fn log(&self) -> &Arc<ScheduleLog> {
        self.log.as_ref().unwrap()
    }

    fn set(&self, now_ms: i64) {
        self.manual.as_ref().unwrap().set(now_ms);
    }

    fn start(&mut self) {
        let mut registry = SinkRegistry::new();
        for (name, policy, gate) in &self.sinks {
            let sink = TestSink {
                name,
                clock: self.clock.clone(),
                tx: self.received_tx.clone(),
                script: Mutex::new(self.script.clone()),
                gate: gate.clone(),
                entered: self.entered_tx.clone(),
                in_place: self.in_place.map(AtomicU32::new),
            };
            registry
                .register(name, Arc::new(sink), policy.clone())
                .unwrap();
        }
        let config = SchedulerConfig {
            settled: Some(self.settled_tx.clone()),
            dead_letters: self.dead_letters.clone(),
            lease: self.lease.clone(),
            ..SchedulerConfig::default()
        };
        let scheduler = Scheduler::start(
            self.log().clone(),
            &registry,
            config,
            self.clock.clone(),
            self.runtime.handle(),
        )
        .unwrap();
        self.scheduler = Some(scheduler);
    }

    /// Stops the scheduler and closes the log cleanly, as a graceful shutdown does.
    fn stop(&mut self) {
        if let Some(scheduler) = self.scheduler.take() {
            self.runtime.block_on(scheduler.shutdown());
        }
        let log = self.log.take().unwrap();
        Arc::try_unwrap(log).unwrap().close().unwrap();
    }

    fn schedule(&self, sink: &str, deliver_at_ms: i64, body: &str) -> MessageId {
        self.append(message(sink, deliver_at_ms, body))
    }

    fn append(&self, message: NewMessage) -> MessageId {
        self.log()
            .append(vec![message.encode().unwrap()])
            .wait()
            .unwrap()[0]
            .id
    }

    /// Sink "a", the only one, delivers under `policy`.
    fn lane(&mut self, policy: SinkPolicy) {
        self.sinks = vec![("a", policy, None)];
    }

    /// Sink "a", the only one, delivers under `policy`, each call held at the gate returned (shut: it
    /// lets a call through per permit it is given).
    fn gated_lane(&mut self, policy: SinkPolicy) -> Gate {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        self.sinks = vec![("a", policy, Some(gate.clone()))];
        gate
    }

    /// Starts a lane of four one-message batches at once, held at the gate returned, whose first
    /// message, "A" due at `T0`, finds the destination away (its call let through); `others` (due time
    /// and body) are scheduled with it. Returns once "A" is postponed, the gate shut again: the gate,
    /// and the ids of "A" and of `others`.
    fn start_with_a_found_away(
        &mut self,
        others: &[(i64, &str)],
    ) -> (Gate, MessageId, Vec<MessageId>) {
        self.script.insert("A".into(), vec![away()]);
        let gate = self.gated_lane(one_per_batch(4));
        let a = self.schedule("a", T0, "A");
        let others = others
            .iter()
            .map(|(at, body)| self.schedule("a", *at, body))
            .collect();
        gate.add_permits(1);
        self.start();
        assert_eq!(self.recv().body, "A");
        assert_eq!(self.settle(1), vec![(a, Settled::Postponed)]);
        gate.forget_permits(1);
        self.entered.recv_timeout(WAIT).unwrap();
        (gate, a, others)
    }

    fn scheduler(&self) -> &Scheduler {
        self.scheduler.as_ref().unwrap()
    }

    /// Cancels `id` through the scheduler, as the HTTP edge does.
    fn cancel(&self, id: MessageId) -> Result<Cancelled, CancelError> {
        self.runtime.block_on(self.scheduler().cancel(id))
    }

    /// What the log says of `id` now.
    fn status(&self, id: MessageId) -> schedulelog::MessageStatus {
        self.log()
            .lookup(id)
            .unwrap()
            .expect("the message is in the log")
    }

    fn state(&self, id: MessageId) -> MessageState {
        self.status(id).state
    }

    /// Why `id` is dead; panics if it is not.
    fn dead_reason(&self, id: MessageId) -> String {
        match self.state(id) {
            MessageState::Dead { reason, .. } => reason,
            other => panic!("{other:?}"),
        }
    }

    fn recv(&self) -> Received {
        self.received.recv_timeout(WAIT).expect("a delivery")
    }

    fn recv_n(&self, n: usize) -> Vec<Received> {
        (0..n).map(|_| self.recv()).collect()
    }

    /// Receives `n` deliveries and waits until their outcomes are durable.
    fn recv_settled(&self, n: usize) -> Vec<Received> {
        let received = self.recv_n(n);
        self.settle(n);
        received
    }

    /// Receives a delivery, `body`, and waits until its outcome is durable: `id` delivered.
    fn recv_delivered(&self, id: MessageId, body: &str) -> Received {
        let received = self.recv();
        assert_eq!(received.body, body);
        assert_eq!(self.settle(1), vec![(id, Settled::Delivered)]);
        received
    }

    /// Waits until the outcomes of `n` messages are durable.
    fn settle(&self, n: usize) -> Vec<(MessageId, Settled)> {
        let mut all = Vec::new();
        while all.len() < n {
            all.extend(self.settled.recv_timeout(WAIT).expect("settled outcomes"));
        }
        all
    }

    /// Waits for the outcomes of as many messages as `expected` lists, and asserts that they are those,
    /// in any order.
    fn settle_as(&self, mut expected: Vec<(MessageId, Settled)>) {
        let mut settled = self.settle(expected.len());
        settled.sort();
        expected.sort();
        assert_eq!(settled, expected);
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // Whatever a failed test left held is let go, so that it fails instead of hanging.
        for (_, _, gate) in &self.sinks {
            if let Some(gate) = gate {
                gate.close();
            }
        }
        if let Some(scheduler) = &self.scheduler {
            let mut hooks = scheduler.shared.hooks();
            let retry_gate = hooks.retry_written.take().map(|(_, gate)| gate);
            let cancel_gate = hooks.cancel_begun.take().map(|(_, gate)| gate);
            for gate in [retry_gate, cancel_gate].into_iter().flatten() {
                gate.close();
            }
            hooks.loader_marked = None;
        }
        if let Some(scheduler) = self.scheduler.take() {
            self.runtime.block_on(scheduler.shutdown());
        }
    }
}

/// A message on topic "t" for `sink`.
fn message(sink: &str, deliver_at_ms: i64, body: &str) -> NewMessage {
    NewMessage {
        deliver_at_ms,
        topic: "t".into(),
        sink: sink.into(),
        body: body.as_bytes().to_vec(),
        ..NewMessage::default()
    }
}

/// Watches `channel` for 300 ms, asserting that nothing comes (`what` if something does): a wait that
/// proves a negative, where there is no event to wait for.
fn assert_quiet<T: std::fmt::Debug>(channel: &Receiver<T>, what: &str) {
    let got = channel.recv_timeout(Duration::from_millis(300));
    assert!(got.is_err(), "{what}: {got:?}");
}

/// A deterministic stream of numbers for test data.
fn lcg(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    *seed >> 33
}

#[test]
fn two_simulated_hours_in_order_never_early_exactly_once() {
    let mut h = Harness::manual();
    let mut seed = 7;
    let mut due: Vec<(i64, String)> = (0..600)
        .map(|i| {
            let at = T0 + (lcg(&mut seed) % (2 * HOUR as u64)) as i64;
            (at, format!("m{i}"))
        })
        .collect();
    // Some share a millisecond, some are overdue when they are scheduled.
    due.push((T0 + 10 * MINUTE, "same-a".into()));
    due.push((T0 + 10 * MINUTE, "same-b".into()));
    due.push((T0 - HOUR, "overdue".into()));
    for (at, body) in &due {
        h.schedule("a", *at, body);
    }
    h.start();
    due.sort();
    let mut got = Vec::new();
    let mut times: Vec<i64> = due.iter().map(|(at, _)| (*at).max(T0)).collect();
    times.dedup();
    for t in times {
        h.set(t);
        let expected = due.iter().filter(|(at, _)| (*at).max(T0) == t).count();
        for r in h.recv_n(expected) {
            assert!(
                r.at_ms >= r.deliver_at_ms,
                "{} early: due {} got {}",
                r.body,
                r.deliver_at_ms,
                r.at_ms
            );
            assert_eq!(r.at_ms, t, "{} released at the exact millisecond", r.body);
            got.push(r);
        }
    }
    // A sentinel after everything: once it is here, anything delivered twice would be here too.
    h.set(T0 + 3 * HOUR);
    h.schedule("a", T0 + 3 * HOUR, "sentinel");
    assert_eq!(h.recv().body, "sentinel");
    assert!(h.received.try_recv().is_err());
    let bodies: Vec<&str> = got.iter().map(|r| r.body.as_str()).collect();
    let expected: Vec<&str> = due.iter().map(|(_, b)| b.as_str()).collect();
    let mut sorted_got = bodies.clone();
    sorted_got.sort();
    let mut sorted_expected = expected.clone();
    sorted_expected.sort();
    assert_eq!(sorted_got, sorted_expected, "each exactly once");
    assert!(
        got.windows(2)
            .all(|w| w[0].deliver_at_ms <= w[1].deliver_at_ms),
        "in deliver_at order"
    );
}

#[test]
fn restart_in_the_middle_of_a_bucket_delivers_the_rest_once() {
    let mut h = Harness::manual();
    let dues: Vec<i64> = (0..40).map(|i| T0 + i * 90_000).collect(); // 09:30 .. 10:28:30
    for (i, at) in dues.iter().enumerate() {
        h.schedule("a", *at, &format!("m{i}"));
    }
    h.start();
    let mut delivered = Vec::new();
    for at in dues.iter().take(15) {
        h.set(*at);
        delivered.push(h.recv().body);
    }
    h.settle(15); // outcomes durable before the stop
    h.stop();

    h.open_log();
    h.start();
    for at in dues.iter().skip(15) {
        h.set(*at);
        delivered.push(h.recv().body);
    }
    h.set(T0 + 2 * HOUR);
    h.schedule("a", T0 + 2 * HOUR, "sentinel");
    assert_eq!(h.recv().body, "sentinel");
    let expected: Vec<String> = (0..40).map(|i| format!("m{i}")).collect();
    assert_eq!(delivered, expected);
}

/// A cluster member's scheduler stops when it loses the lead and starts again on the same open log
/// when it wins it back: what was filed meanwhile, and what is filed while it starts (into buckets the
/// first one watched), is delivered once.
#[test]
fn a_scheduler_started_again_on_the_same_log_delivers_each_message_once() {
    let mut h = Harness::manual();
    h.schedule("a", T0 + 1_000, "before");
    h.start();
    h.set(T0 + 1_000);
    assert_eq!(h.recv_settled(1)[0].body, "before");
    h.runtime.block_on(h.scheduler.take().unwrap().shutdown());
    h.schedule("a", T0 + 2_000, "between");
    // Appends into the bucket the first scheduler watched go on while the second one starts.
    let bodies: Vec<String> = (0..300).map(|i| format!("during {i}")).collect();
    std::thread::scope(|s| {
        let log = h.log().clone();
        let writer = s.spawn(move || {
            for (i, body) in (0..300).map(|i| (i, format!("during {i}"))) {
                let message = message("a", T0 + 3_000 + i, &body);
                log.append(vec![message.encode().unwrap()]).wait().unwrap();
            }
        });
        h.start();
        writer.join().unwrap();
    });
    h.set(T0 + 10_000);
    let mut received: Vec<String> = h.recv_n(301).into_iter().map(|r| r.body).collect();
    h.schedule("a", T0 + 20_000, "sentinel");
    h.set(T0 + 20_000);
    received.push(h.recv().body);
    let mut expected = vec!["between".to_string()];
    expected.extend(bodies);
    expected.push("sentinel".into());
    received[..301].sort();
    expected[..301].sort();
    assert_eq!(received, expected, "each once, nothing twice");
}

/// A cluster member hands a batch to a sink only while its delivery lease holds; a batch due while it
/// does not is postponed (no attempt used) and goes once the lease holds again.
#[test]
fn a_batch_goes_to_the_sink_only_while_the_delivery_lease_holds() {
    let mut h = Harness::manual();
    let lease = Arc::new(Lease::new());
    h.lease = Some(lease.clone());
    let id = h.schedule("a", T0 + 1_000, "fenced");
    h.start();
    h.set(T0 + 1_000);
    assert_eq!(h.settle(1), vec![(id, Settled::Postponed)]);
    assert!(h.received.try_recv().is_err(), "nothing went to the sink");
    assert_eq!(h.status(id).state, MessageState::Pending);
    lease.extend_to(std::time::Instant::now() + Duration::from_secs(600));
    // Postponed by the scheduler's clock: it comes round once that moves on.
    h.set(T0 + 2_000);
    let received = h.recv_delivered(id, "fenced");
    assert_eq!(received.attempt, 0, "the postponement used no attempt");
}

#[test]
fn restart_after_a_long_outage_catches_up_oldest_first_at_the_rate_limit() {
    let mut h = Harness::manual();
    h.lane(SinkPolicy {
        rate_per_sec: Some(20.0),
        burst: 5,
        max_in_flight: 1,
        max_batch: 10,
        ..SinkPolicy::default()
    });
    // 60 messages over the next two hours, scheduled in shuffled order.
    let mut seed = 3;
    let mut dues: Vec<i64> = (0..60).map(|i| T0 + 1 + i * 2 * MINUTE).collect();
    for i in (1..dues.len()).rev() {
        dues.swap(i, (lcg(&mut seed) % (i as u64 + 1)) as usize);
    }
    for at in &dues {
        h.schedule("a", *at, &format!("{at}"));
    }
    h.stop();
    // Down for five hours.
    let restart = T0 + 5 * HOUR;
    h.set(restart);
    h.open_log();
    h.start();
    // The burst goes at once, then one message per 50 ms of scheduler time (20/s).
    let mut got: Vec<i64> = h
        .recv_n(5)
        .iter()
        .map(|r| r.body.parse().unwrap())
        .collect();
    h.settle(5);
    assert!(h.received.try_recv().is_err(), "no more than the burst");
    for step in 1..=55 {
        h.set(restart + step * 50);
        let r = h.recv();
        assert_eq!(r.at_ms, restart + step * 50);
        got.push(r.body.parse().unwrap());
        h.settle(1);
        assert!(
            h.received.try_recv().is_err(),
            "no more than the rate allows"
        );
    }
    let mut sorted = got.clone();
    sorted.sort();
    assert_eq!(got, sorted, "oldest first");
    assert_eq!(got.len(), 60);
}

#[test]
fn cancels_before_and_after_loading() {
    let mut h = Harness::manual();
    let before = h.schedule("a", T0 + 2 * HOUR, "cancelled before loading");
    let after = h.schedule("a", T0 + 10 * MINUTE, "cancelled after loading");
    h.schedule("a", T0 + 2 * HOUR + 1, "kept");
    h.schedule("a", T0, "probe");
    let log = h.log().clone();
    log.cancel(h.status(before).location).wait().unwrap();
    h.start();
    assert_eq!(h.recv().body, "probe");
    h.settle(1);
    h.set(T0 + MINUTE);
    // The bucket of `after` is loaded (it is the current one, and the probe from it came): cancel it
    // through the scheduler.
    assert_eq!(h.cancel(after).unwrap(), Cancelled::Now);
    assert_eq!(
        h.cancel(after).unwrap(),
        Cancelled::Already,
        "a second cancel answers the same"
    );
    h.set(T0 + 10 * MINUTE);
    assert_eq!(h.settle(1), vec![(after, Settled::Cancelled)]);
    h.set(T0 + 2 * HOUR + 1);
    assert_eq!(h.recv().body, "kept");
    assert!(
        h.received.try_recv().is_err(),
        "neither cancelled message was delivered"
    );
    assert!(matches!(h.state(before), MessageState::Cancelled { .. }));
    assert!(matches!(h.state(after), MessageState::Cancelled { .. }));
}

#[test]
fn retries_backoff_and_dead_letters() {
    let mut h = Harness::manual();
    h.script.insert("flaky".into(), vec![retry("503"); 2]);
    h.script.insert("doomed".into(), vec![retry("timeout"); 10]);
    h.script.insert("poison".into(), vec![dead("HTTP 400")]);
    h.script.insert(
        "told".into(),
        vec![retry_after(Duration::from_secs(30), "429")],
    );
    h.lane(SinkPolicy {
        max_attempts: 3,
        ..SinkPolicy::default()
    });
    let flaky = h.schedule("a", T0, "flaky");
    let doomed = h.schedule("a", T0, "doomed");
    let poison = h.schedule("a", T0, "poison");
    let told = h.schedule("a", T0, "told");
    h.start();
    let first = h.recv_settled(4);
    assert!(first.iter().all(|r| r.attempt == 0));

    // Attempt 1 of flaky and doomed: backoff 1 s with jitter in [0.5 s, 1 s].
    h.set(T0 + 499);
    assert!(h.received.try_recv().is_err());
    h.set(T0 + 1_000);
    let second = h.recv_settled(2);
    assert!(second
        .iter()
        .all(|r| r.attempt == 1 && r.deliver_at_ms >= T0 + 500 && r.deliver_at_ms <= T0 + 1_000));
    // Attempt 2: 2 s backoff, jittered; then flaky is delivered and doomed has no attempts left.
    h.set(T0 + 3_000);
    let third = h.recv_settled(2);
    assert!(third.iter().all(|r| r.attempt == 2));
    // `told` asked for 30 s, and gets exactly that.
    h.set(T0 + 29_999);
    assert!(h.received.try_recv().is_err());
    h.set(T0 + 30_000);
    let r = h.recv();
    assert_eq!(
        (r.body.as_str(), r.attempt, r.deliver_at_ms),
        ("told", 1, T0 + 30_000)
    );
    h.settle(1);

    let status = h.status(flaky);
    assert!(matches!(status.state, MessageState::Delivered { .. }));
    assert_eq!(status.message.attempt, 2);
    assert_eq!(h.dead_reason(doomed), "gave up after 3 attempts: timeout");
    assert_eq!(h.dead_reason(poison), "HTTP 400");
    assert!(matches!(h.state(told), MessageState::Delivered { .. }));
}

#[test]
fn a_message_for_an_unknown_sink_is_dead_with_the_reason() {
    let mut h = Harness::manual();
    let id = h.schedule("nowhere", T0, "lost");
    h.start();
    assert_eq!(h.settle(1), vec![(id, Settled::Dead)]);
    assert_eq!(h.dead_reason(id), "no sink named \"nowhere\" is configured");
}

#[test]
fn a_slow_sink_does_not_delay_another() {
    let mut h = Harness::manual();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let slow_policy = SinkPolicy {
        max_in_flight: 1,
        max_batch: 1,
        ..SinkPolicy::default()
    };
    h.sinks = vec![
        ("slow", slow_policy, Some(gate.clone())),
        ("fast", SinkPolicy::default(), None),
    ];
    for i in 0..20 {
        h.schedule("slow", T0 + 1_000, &format!("slow{i}"));
    }
    for i in 0..20 {
        h.schedule("fast", T0 + 1_001 + i, &format!("fast{i}"));
    }
    h.start();
    h.set(T0 + 2_000);
    // The slow sink holds its first call (and reports nothing until released); every fast message
    // arrives meanwhile, though the slow ones were due first.
    let fast = h.recv_n(20);
    assert!(fast.iter().all(|r| r.sink == "fast"), "{fast:?}");
    gate.add_permits(100);
    let slow = h.recv_n(20);
    assert!(slow.iter().all(|r| r.sink == "slow"));
}

/// Real clock: 10,000 messages due within a few seconds. Prints lateness; asserts none early and a loose
/// bound (the goal, p99 ≤ 10 ms on an idle machine, is measured and reported, not asserted: CI machines
/// are shared).
#[test]
fn real_clock_lateness() {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let mut h = Harness::with_clock(clock.clone(), None);
    h.lane(SinkPolicy {
        max_in_flight: 8,
        max_batch: 256,
        ..SinkPolicy::default()
    });
    h.start();
    let start = clock.now_ms() + 1_500;
    let count = 10_000;
    for chunk in 0..10 {
        let batch: Vec<_> = (0..count / 10)
            .map(|i| {
                let n = chunk * (count / 10) + i;
                let at = start + (n as i64 * 3_000) / count as i64;
                message("a", at, &n.to_string()).encode().unwrap()
            })
            .collect();
        h.log().append(batch).wait().unwrap();
    }
    let got = h.recv_n(count);
    let mut late_us: Vec<i64> = got
        .iter()
        .map(|r| r.at_us - r.deliver_at_ms * 1000)
        .collect();
    late_us.sort();
    let pct = |p: f64| late_us[((late_us.len() - 1) as f64 * p) as usize] as f64 / 1000.0;
    println!(
        "lateness over {count} messages: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
    assert!(
        got.iter().all(|r| r.at_ms >= r.deliver_at_ms),
        "never early"
    );
    assert!(
        pct(0.99) < 1_000.0,
        "p99 lateness under a second even on a loaded machine"
    );
}

/// A cancel while the sink holds an attempt is refused (409 `delivery_in_flight` at the edge): the
/// attempt may still be delivered, so a 200 would be contradicted by a later `delivered`. Once the attempt
/// settled, a cancel answers for what it became.
#[test]
fn a_cancel_while_an_attempt_is_in_flight_is_refused_not_contradicted() {
    let mut h = Harness::manual();
    let gate = h.gated_lane(SinkPolicy::default());
    let id = h.schedule("a", T0, "in flight");
    h.start();
    h.entered
        .recv_timeout(WAIT)
        .expect("the attempt reached the sink");
    assert!(matches!(h.cancel(id), Err(CancelError::InFlight)));
    assert_eq!(h.state(id), MessageState::Pending, "nothing was written");
    gate.add_permits(1);
    h.recv_delivered(id, "in flight");
    assert!(matches!(h.cancel(id), Err(CancelError::AlreadyDelivered)));
    assert!(matches!(h.state(id), MessageState::Delivered { .. }));
}

/// The window of the issue: the lane has written the next attempt through the WAL and not yet recorded
/// the `retried` outcome. A cancel then is refused (the old code cancelled the old attempt, answered 200,
/// and the new attempt fired after its backoff); once the outcome is recorded the cancel takes the new
/// attempt, and nothing of the message is delivered again.
#[test]
fn a_cancel_between_a_written_retry_and_its_outcome_waits_then_stops_the_series() {
    let mut h = Harness::manual();
    h.script.insert("racy".into(), vec![retry("503"); 2]);
    // Due only once the hook is in place.
    let id = h.schedule("a", T0 + 1, "racy");
    h.start();
    let (hook, (written, outcome_gate)) = gated_hook();
    h.scheduler().shared.hooks().retry_written = Some(hook);
    h.set(T0 + 1);
    assert_eq!(h.recv().attempt, 0);
    written
        .recv_timeout(WAIT)
        .expect("attempt 1 is durable, its retried outcome is not recorded");
    assert!(matches!(h.cancel(id), Err(CancelError::InFlight)));
    outcome_gate.add_permits(1);
    assert_eq!(h.settle(1), vec![(id, Settled::Retried)]);
    assert_eq!(h.cancel(id).unwrap(), Cancelled::Now);
    let status = h.status(id);
    assert_eq!(status.message.attempt, 1, "the cancel took the new attempt");
    assert!(matches!(status.state, MessageState::Cancelled { .. }));
    // Attempt 1 was due within a second; an hour later only the sentinel has come.
    h.schedule("a", T0 + HOUR, "sentinel");
    h.set(T0 + HOUR);
    assert_eq!(h.recv().body, "sentinel");
    assert!(
        h.received.try_recv().is_err(),
        "no attempt of the cancelled message started after the 200"
    );
}

/// Cancels `id`, due at `T0` + 1 s, as it comes due: the cancel is held after it took the message, the
/// clock set to the due time, and the cancel let on once the lane has held the message back; `meanwhile`
/// runs while the cancel goes on. Answers the cancel's result.
fn cancel_as_it_comes_due(
    h: &Harness,
    id: MessageId,
    meanwhile: impl FnOnce(),
) -> Result<Cancelled, CancelError> {
    let (hook, (begun, lookup_gate)) = gated_hook();
    let (held_tx, held) = crossbeam_channel::unbounded();
    {
        let mut hooks = h.scheduler().shared.hooks();
        hooks.cancel_begun = Some(hook);
        hooks.held = Some(held_tx);
    }
    std::thread::scope(|s| {
        let cancel = s.spawn(|| h.cancel(id));
        assert_eq!(begun.recv_timeout(WAIT).unwrap(), id);
        h.set(T0 + 1_000);
        assert_eq!(held.recv_timeout(WAIT).unwrap(), id, "the lane holds it");
        lookup_gate.add_permits(1);
        meanwhile();
        cancel.join().unwrap()
    })
}

/// A message that comes due while its cancel is in progress (taken, not yet looked up) is held by the
/// lane, not delivered, and dropped when the cancel succeeds.
#[test]
fn a_message_due_during_its_cancel_is_held_then_dropped() {
    let mut h = Harness::manual();
    let id = h.schedule("a", T0 + 1_000, "due meanwhile");
    h.start();
    assert_eq!(
        cancel_as_it_comes_due(&h, id, || {}).unwrap(),
        Cancelled::Now
    );
    assert_eq!(h.settle(1), vec![(id, Settled::Cancelled)]);
    h.schedule("a", T0 + 2_000, "sentinel");
    h.set(T0 + 2_000);
    assert_eq!(h.recv().body, "sentinel");
    assert!(h.received.try_recv().is_err());
    assert_eq!(h.scheduler().shared.registry().cancelled_len(), 0);
}

/// The replayer may report a cancel's tombstone before the cancel has recorded its seq: the cancel
/// still decides what stays in memory (here nothing: the lane met the entry and dropped it), instead of
/// the report keeping the cancelled location for good.
#[test]
fn a_tombstone_reported_before_its_cancel_ends_leaves_nothing_behind() {
    let mut h = Harness::manual();
    let id = h.schedule("a", T0 + 1_000, "due meanwhile");
    h.start();
    let (hook, (written, written_gate)) = gated_hook();
    h.scheduler().shared.hooks().tombstone_written = Some(hook);
    let cancelled = cancel_as_it_comes_due(&h, id, || {
        written.recv_timeout(WAIT).unwrap();
        // Filed after the tombstone, so reported after it: once this is delivered, the wheel
        // thread has handled the tombstone's report.
        h.schedule("a", T0 + 1_500, "after the tombstone");
        h.set(T0 + 1_500);
        assert_eq!(h.recv().body, "after the tombstone");
        written_gate.add_permits(1);
    });
    assert_eq!(cancelled.unwrap(), Cancelled::Now);
    let settled = h.settle(2);
    assert!(settled.contains(&(id, Settled::Cancelled)), "{settled:?}");
    assert!(h.received.try_recv().is_err());
    assert_eq!(h.scheduler().shared.registry().cancelled_len(), 0);
}

/// Cancels of messages in buckets not loaded stay on disk (their tombstones keep them out of the
/// bucket's snapshot); a cancel in a loaded bucket is held in memory until the lane meets its entry.
#[test]
fn far_future_cancels_stay_on_disk_loaded_ones_in_memory_until_met() {
    let mut h = Harness::manual();
    let far_at = T0 + 30 * 24 * HOUR;
    let far: Vec<MessageId> = (0..50)
        .map(|i| h.schedule("a", far_at + i, &format!("far{i}")))
        .collect();
    let near = h.schedule("a", T0 + 10 * MINUTE, "near");
    h.schedule("a", far_at + HOUR, "sentinel");
    h.schedule("a", T0, "probe");
    h.start();
    assert_eq!(h.recv().body, "probe", "the current bucket is loaded");
    h.settle(1);
    let scheduler = h.scheduler();
    for id in &far {
        assert_eq!(h.cancel(*id).unwrap(), Cancelled::Now);
    }
    h.log().checkpoint().unwrap(); // every tombstone is filed
    assert_eq!(h.cancel(near).unwrap(), Cancelled::Now);
    {
        let registry = scheduler.shared.registry();
        assert_eq!(
            (registry.cancelled_len(), registry.unfiled_len()),
            (1, 0),
            "only the cancel of the loaded bucket is in memory"
        );
    }
    h.set(T0 + 10 * MINUTE);
    assert_eq!(h.settle(1), vec![(near, Settled::Cancelled)]);
    assert_eq!(scheduler.shared.registry().cancelled_len(), 0);
    // A month later the far bucket is loaded: its snapshot leaves the cancelled messages out.
    h.set(far_at + 100);
    h.set(far_at + HOUR);
    assert_eq!(h.recv().body, "sentinel");
    assert!(h.received.try_recv().is_err(), "no cancelled message came");
}

/// A cancel racing the load of its bucket, both ways round: one acknowledged while the loader has marked
/// the bucket but not taken its snapshot; one that took its message before the mark and writes its
/// tombstone only after the snapshot was taken (with the message in it). Neither message is delivered,
/// though both are overdue when their bucket loads.
#[test]
fn a_cancel_racing_the_load_of_its_bucket_is_honoured() {
    let mut h = Harness::manual();
    let due = T0 + HOUR; // 10:30, bucket 10:00
    let first = h.schedule("a", due, "first");
    let second = h.schedule("a", due + 1, "second");
    h.schedule("a", due + 2, "sentinel");
    let bucket = h.status(first).location.bucket;
    h.start();
    let scheduler = h.scheduler();
    let (marked_tx, marked) = crossbeam_channel::unbounded();
    let (go, go_rx) = crossbeam_channel::unbounded();
    let (hook, (begun, lookup_gate)) = gated_hook();
    scheduler.shared.hooks().loader_marked = Some((marked_tx, go_rx));
    scheduler.shared.hooks().cancel_begun = Some(hook);
    // Waits for the loader to mark `bucket`, letting it past any other bucket.
    let wait_for_mark = |target: Bucket| loop {
        let bucket = marked.recv_timeout(WAIT).expect("the loader marks buckets");
        if bucket == target {
            return;
        }
        go.send(()).unwrap();
    };
    std::thread::scope(|s| {
        // `second`'s cancel takes the message before the mark and waits before its lookup.
        let late = s.spawn(|| h.cancel(second));
        assert_eq!(begun.recv_timeout(WAIT).unwrap(), second);
        scheduler.shared.hooks().cancel_begun = None;
        // 10:55: one pass marks 10:00, then 11:00, in that order.
        h.set(T0 + HOUR + 25 * MINUTE);
        wait_for_mark(bucket);
        // Marked, no snapshot yet: `first`'s cancel is acknowledged now.
        assert_eq!(h.cancel(first).unwrap(), Cancelled::Now);
        go.send(()).unwrap();
        // The loader marks 11:00 only after it took 10:00's snapshot (with `second` in it).
        wait_for_mark(bucket.next(h.log().segment_minutes()));
        lookup_gate.add_permits(1);
        assert_eq!(late.join().unwrap().unwrap(), Cancelled::Now);
        go.send(()).unwrap();
    });
    scheduler.shared.hooks().loader_marked = None;
    drop(go);
    // `first` was left out of the snapshot (its tombstone was filed before it was taken); `second` was
    // in it and is dropped by the lane.
    assert_eq!(h.recv().body, "sentinel");
    let mut cancelled = Vec::new();
    while cancelled.is_empty() {
        let batch = h.settled.recv_timeout(WAIT).expect("settled outcomes");
        cancelled.extend(batch.into_iter().filter(|(_, l)| *l == Settled::Cancelled));
    }
    assert_eq!(cancelled, vec![(second, Settled::Cancelled)]);
    h.schedule("a", due + HOUR, "second sentinel");
    h.set(due + HOUR);
    assert_eq!(h.recv().body, "second sentinel");
    assert!(h.received.try_recv().is_err(), "neither was delivered");
    assert_eq!(scheduler.shared.registry().cancelled_len(), 0);
}

/// A sink that delivers in place (the built-in broker) is called on the lane's blocking thread, its
/// answers settled like any other's; a panic there postpones the batch by 5 s (no attempt used, nothing
/// left in flight) instead of losing it until a restart.
#[test]
fn a_sink_that_delivers_in_place_is_called_on_the_lanes_thread_and_a_panic_there_postpones_the_batch(
) {
    let mut h = Harness::manual();
    h.in_place = Some(1);
    h.script.insert(
        "flaky".into(),
        vec![retry_after(Duration::from_secs(2), "busy")],
    );
    let id = h.schedule("a", T0, "flaky");
    h.start();
    assert_eq!(h.settle(1), vec![(id, Settled::Postponed)]);
    let in_flight = |h: &Harness| {
        h.scheduler
            .as_ref()
            .unwrap()
            .shared
            .registry()
            .in_flight_len()
    };
    assert_eq!(in_flight(&h), 0, "the panicked batch was let go");
    // Not back before 5 s: a message due just before comes first.
    h.schedule("a", T0 + 4_999, "sentinel");
    h.set(T0 + 4_999);
    assert_eq!(h.recv().body, "sentinel");
    h.set(T0 + 5_000);
    let first = h.recv();
    assert_eq!(
        (first.body.as_str(), first.attempt, first.in_place),
        ("flaky", 0, true),
        "delivered in place, the panic used no attempt"
    );
    // The script's retry goes through the WAL as from any sink; the next attempt is delivered.
    let mut settled = h.settle(2);
    settled.sort_by_key(|(_, label)| *label);
    assert_eq!(
        settled.iter().map(|(_, l)| *l).collect::<Vec<_>>(),
        [Settled::Delivered, Settled::Retried]
    );
    h.set(T0 + 7_000);
    let second = h.recv();
    assert_eq!(
        (second.body.as_str(), second.attempt, second.in_place),
        ("flaky", 1, true)
    );
    assert_eq!(h.settle(1)[0].1, Settled::Delivered);
    // Each attempt once: a message due after the last comes next.
    h.schedule("a", T0 + 8_000, "last");
    h.set(T0 + 8_000);
    assert_eq!(h.recv().body, "last");
    h.settle(1);
    assert_eq!(in_flight(&h), 0);
}

/// Fails to store the first dead letter it is given, then stores them.
#[derive(Debug, Default)]
struct FlakyLetters {
    calls: Mutex<u32>,
    stored: Mutex<Vec<String>>,
}

impl Sink for FlakyLetters {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        Box::pin(async move {
            let mut calls = self.calls.lock().unwrap();
            *calls += 1;
            if *calls == 1 {
                return vec![retry("disk full"); batch.len()];
            }
            let mut stored = self.stored.lock().unwrap();
            stored.extend(batch.iter().map(|d| d.message.topic.clone()));
            vec![SinkOutcome::Delivered; batch.len()]
        })
    }
}

#[test]
fn a_dead_letter_that_cannot_be_stored_at_once_is_stored_later_not_delivered_again() {
    let mut h = Harness::manual();
    let letters = Arc::new(FlakyLetters::default());
    h.dead_letters = Some(letters.clone());
    h.script.insert("poison".into(), vec![dead("HTTP 400"); 2]);
    let id = h.schedule("a", T0, "poison");
    h.start();
    assert_eq!(h.recv().attempt, 0);
    // The dead letter could not be stored the first time: it is stored again (not the message delivered
    // again, which would repeat the receiver's 400), then the outcome is written.
    assert_eq!(h.settle(1), vec![(id, Settled::Dead)]);
    assert!(matches!(h.state(id), MessageState::Dead { .. }));
    assert_eq!(*letters.stored.lock().unwrap(), vec!["$dead".to_string()]);
    assert_eq!(*letters.calls.lock().unwrap(), 2);
    // Had it come round again it would be due a second later: a message due after that comes first.
    h.schedule("a", T0 + 60_000, "sentinel");
    h.set(T0 + 60_000);
    assert_eq!(
        h.recv().body,
        "sentinel",
        "the dead message was delivered again"
    );
}

/// Flips one byte of `needle` in `path` (to make a record's checksum fail, or to undo that).
fn flip_byte_of(path: &std::path::Path, needle: &[u8]) {
    let mut bytes = std::fs::read(path).unwrap();
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("the record is in the file");
    bytes[at] ^= 0x20;
    std::fs::write(path, bytes).unwrap();
}

/// A due message whose record cannot be read stays pending and comes round again: after 1 s for an I/O
/// error (the segment's file is cut short), after 10 min for a corrupt record; once the file is whole
/// again it is delivered. (The old lane logged the error and forgot the entry until a restart.)
#[test]
fn an_unreadable_due_message_is_handed_back_not_forgotten() {
    let mut h = Harness::manual();
    let fragile = h.schedule("a", T0 + MINUTE, "fragile");
    let corrupt = h.schedule("a", T0 + 2 * MINUTE, "corrupt-me");
    h.schedule("a", T0, "probe");
    h.start();
    assert_eq!(h.recv().body, "probe", "the bucket is loaded");
    h.settle(1);
    let scheduler = h.scheduler();
    let (failed_tx, failed) = crossbeam_channel::unbounded();
    scheduler.shared.hooks().read_failed = Some(failed_tx);
    let bucket = h.status(fragile).location.bucket;
    let segment = h.dir.path().join("schedule").join(format!("{bucket}.log"));
    let whole = std::fs::read(&segment).unwrap();

    // An I/O error: the record is past the end of the file (the lane has it open already, from the
    // probe: the same file, cut short).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap()
        .set_len(0)
        .unwrap();
    h.set(T0 + MINUTE);
    let error = failed.recv_timeout(WAIT).expect("the read failed");
    assert!(error.starts_with("I/O error"), "{error}");
    assert_eq!(
        scheduler.shared.unreadable().len(),
        1,
        "counted as unreadable"
    );
    std::fs::write(&segment, &whole).unwrap();
    h.set(T0 + MINUTE + 1_000);
    let r = h.recv_delivered(fragile, "fragile");
    assert_eq!(r.at_ms, T0 + MINUTE + 1_000);
    assert!(scheduler.shared.unreadable().is_empty(), "read at last");

    // A corrupt record: tried again every 10 minutes, delivered once repaired.
    flip_byte_of(&segment, b"corrupt-me");
    h.set(T0 + 2 * MINUTE);
    let error = failed.recv_timeout(WAIT).expect("the read failed");
    assert!(error.starts_with("corrupt log"), "{error}");
    flip_byte_of(&segment, b"Corrupt-me");
    assert!(
        matches!(h.state(corrupt), MessageState::Pending),
        "still pending"
    );
    // Before the 10 minutes are up only a sentinel comes.
    h.schedule("a", T0 + 12 * MINUTE - 1, "sentinel");
    h.set(T0 + 12 * MINUTE - 1);
    assert_eq!(h.recv().body, "sentinel");
    h.set(T0 + 12 * MINUTE);
    let r = h.recv();
    assert_eq!((r.body.as_str(), r.at_ms), ("corrupt-me", T0 + 12 * MINUTE));
    assert!(failed.try_recv().is_err(), "no more failures");
}

/// A sink's own delay (an HTTP `Retry-After`) is capped by the sink's backoff cap: `Retry-After:
/// 99999999999` does not park the message for centuries.
#[test]
fn a_sinks_retry_delay_is_capped_by_the_backoff_cap() {
    let mut h = Harness::manual();
    h.lane(SinkPolicy {
        backoff: crate::sink::Backoff {
            cap: Duration::from_secs(60),
            ..crate::sink::Backoff::default()
        },
        ..SinkPolicy::default()
    });
    let patient = retry_after(Duration::from_secs(99_999_999_999), "HTTP 503");
    h.script.insert("patient".into(), vec![patient]);
    let id = h.schedule("a", T0, "patient");
    h.start();
    assert_eq!(h.recv().attempt, 0);
    assert_eq!(h.settle(1), vec![(id, Settled::Retried)]);
    assert_eq!(h.status(id).message.deliver_at_ms, T0 + 60_000);
    h.set(T0 + 60_000);
    let r = h.recv();
    assert_eq!((r.attempt, r.at_ms), (1, T0 + 60_000));
}

/// Messages sent with an idempotency key are reported once finished, whichever way: delivered, dead or
/// cancelled (so that the HTTP edge's index lets go of their keys). Others are not reported.
#[test]
fn finished_messages_with_an_idempotency_key_are_reported() {
    let mut h = Harness::manual();
    h.script.insert("dies".into(), vec![dead("HTTP 400")]);
    let keyed = |h: &Harness, at: i64, body: &str| {
        h.append(NewMessage {
            key: Some(body.to_string()),
            dedup: true,
            ..message("a", at, body)
        })
    };
    let delivered = keyed(&h, T0, "delivered");
    let dies = keyed(&h, T0, "dies");
    let cancelled = keyed(&h, T0 + HOUR, "cancelled");
    h.schedule("a", T0, "no key");
    h.start();
    let scheduler = h.scheduler();
    let mut finished = scheduler.take_finished_keys().unwrap();
    assert!(scheduler.take_finished_keys().is_none(), "handed out once");
    h.settle(3);
    h.cancel(cancelled).unwrap();
    let mut got: Vec<(String, MessageId)> = (0..3)
        .map(|_| {
            let key = finished.try_recv().expect("a finished key");
            assert_eq!((key.sink.as_str(), key.topic.as_str()), ("a", "t"));
            (key.key, key.id)
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("cancelled".to_string(), cancelled),
            ("delivered".to_string(), delivered),
            ("dies".to_string(), dies)
        ]
    );
    assert!(finished.try_recv().is_err(), "nothing else");
}

/// A destination that cannot be reached uses no attempt however long it stays away: each delivery waits
/// for it, after the sink's backoff for the batches in a row that found it away, with nothing written;
/// an answer from it ends the row. (A sink of 2 attempts would have made the message dead after one
/// failed retry.)
#[test]
fn an_unreachable_destination_uses_no_attempt_and_the_wait_grows() {
    let mut h = Harness::manual();
    h.script.insert("away".into(), vec![away(); 4]);
    h.lane(SinkPolicy {
        max_attempts: 2,
        ..SinkPolicy::default()
    });
    let id = h.schedule("a", T0, "away");
    h.start();
    assert_eq!(h.recv().attempt, 0);
    // Waits of 1 s, 2 s, 4 s and 8 s, each jittered to at least half.
    let mut at = T0;
    for wait_ms in [1_000, 2_000, 4_000, 8_000] {
        assert_eq!(h.settle(1), vec![(id, Settled::Postponed)]);
        h.set(at + wait_ms / 2 - 1);
        assert!(h.received.try_recv().is_err(), "not before half the wait");
        at += wait_ms;
        h.set(at);
        let r = h.recv();
        assert_eq!((r.body.as_str(), r.attempt), ("away", 0), "no attempt used");
    }
    assert_eq!(h.settle(1), vec![(id, Settled::Delivered)]);
    let status = h.status(id);
    assert!(matches!(status.state, MessageState::Delivered { .. }));
    assert_eq!(
        status.history.len(),
        1,
        "one attempt, nothing written for the waits"
    );
}

/// What a sink answers for a message whose destination it could not reach.
fn away() -> SinkOutcome {
    unreachable("connection refused")
}

fn unreachable(reason: &str) -> SinkOutcome {
    SinkOutcome::Unreachable {
        reason: reason.into(),
    }
}

/// A retry after the sink's backoff.
fn retry(reason: &str) -> SinkOutcome {
    SinkOutcome::Retry {
        after: None,
        reason: reason.into(),
    }
}

/// A retry after the delay the sink was told (an HTTP `Retry-After`).
fn retry_after(after: Duration, reason: &str) -> SinkOutcome {
    SinkOutcome::Retry {
        after: Some(after),
        reason: reason.into(),
    }
}

fn dead(reason: &str) -> SinkOutcome {
    SinkOutcome::Dead {
        reason: reason.into(),
    }
}

/// A lane that sends one message per batch, `in_flight` batches at a time.
fn one_per_batch(in_flight: usize) -> SinkPolicy {
    SinkPolicy {
        max_batch: 1,
        max_in_flight: in_flight,
        ..SinkPolicy::default()
    }
}

/// A batch the destination took in part (one message delivered, another not answered: a partition
/// without a leader beside a healthy one) is no outage: the lane goes on at once, and the unanswered
/// message waits on its own, using no attempt.
#[test]
fn a_destination_that_answers_for_some_keeps_the_lane_going() {
    let mut h = Harness::manual();
    h.script
        .insert("stuck".into(), vec![unreachable("message timed out")]);
    // One slot, held by a first call until both are due: they then make one batch.
    let gate = h.gated_lane(SinkPolicy {
        max_in_flight: 1,
        ..SinkPolicy::default()
    });
    let block = h.schedule("a", T0, "block");
    let stuck = h.schedule("a", T0 + 5, "stuck");
    let fine = h.schedule("a", T0 + 5, "fine");
    let later = h.schedule("a", T0 + 10, "later");
    h.start();
    h.entered.recv_timeout(WAIT).unwrap();
    h.set(T0 + 5);
    gate.add_permits(1);
    h.recv_delivered(block, "block");
    let mut first = h.recv_n(2);
    first.sort_by(|x, y| x.body.cmp(&y.body));
    assert_eq!(
        (first[0].body.as_str(), first[1].body.as_str()),
        ("fine", "stuck")
    );
    h.settle_as(vec![
        (stuck, Settled::Postponed),
        (fine, Settled::Delivered),
    ]);
    assert_eq!(first[0].at_ms, first[1].at_ms, "one batch");
    // Not held: due 5 ms later, it goes at once.
    h.set(T0 + 10);
    assert_eq!(h.recv_delivered(later, "later").at_ms, T0 + 10);
    // The unanswered one comes round after the backoff's first step (0.5 to 1 s), attempt 0 still.
    h.set(T0 + 1_000);
    assert_eq!(h.recv_delivered(stuck, "stuck").attempt, 0);
}

/// The batches out together when the destination goes away come back unanswered together: the wait
/// they start is the backoff's first step, not one step more for each of them.
#[test]
fn batches_out_at_an_outage_start_one_wait() {
    let mut h = Harness::manual();
    let bodies = ["A", "B", "C", "D"];
    for body in bodies {
        h.script.insert(body.into(), vec![away()]);
    }
    let gate = h.gated_lane(one_per_batch(4));
    for body in bodies {
        h.schedule("a", T0, body);
    }
    h.start();
    for _ in bodies {
        h.entered
            .recv_timeout(WAIT)
            .expect("four batches out at once");
    }
    gate.add_permits(1);
    assert_eq!(h.recv_n(4).len(), 4);
    assert!(h
        .settle(4)
        .iter()
        .all(|(_, label)| *label == Settled::Postponed));
    // The first step is 0.5 to 1 s; four steps in a row would be 4 to 8 s.
    h.set(T0 + 1_000);
    let mut got = h.recv_n(4);
    got.sort_by(|x, y| x.body.cmp(&y.body));
    assert_eq!(
        got.iter().map(|r| r.body.as_str()).collect::<Vec<_>>(),
        bodies
    );
    assert!(got.iter().all(|r| r.at_ms == T0 + 1_000 && r.attempt == 0));
    assert!(h
        .settle(4)
        .iter()
        .all(|(_, label)| *label == Settled::Delivered));
}

/// A target the sink refuses itself (`forbidden_target`) is no answer from the destination: a probe
/// that holds only such a message leaves the outage on, so the next one found away waits a longer step.
#[test]
fn a_refused_target_does_not_end_an_outage() {
    let mut h = Harness::manual();
    h.script.insert("A".into(), vec![away(), away()]);
    let refuse = crate::sink::forbidden("not in targets");
    h.script.insert("refused".into(), vec![refuse]);
    // One at a time, in order: at the same due time, the one written first goes first.
    h.lane(one_per_batch(1));
    let refused = h.schedule("a", T0 + 400, "refused");
    let a = h.schedule("a", T0, "A");
    h.start();
    assert_eq!(h.recv().body, "A");
    assert_eq!(h.settle(1), vec![(a, Settled::Postponed)]);
    // Due during the wait (0.5 to 1 s): held, then first when it ends.
    h.set(T0 + 400);
    h.set(T0 + 1_000);
    let got = h.recv_n(2);
    assert_eq!(
        (got[0].body.as_str(), got[1].body.as_str()),
        ("refused", "A")
    );
    h.settle_as(vec![(refused, Settled::Dead), (a, Settled::Postponed)]);
    // A second wait in a row: 1 to 2 s (a first step again would be over by T0 + 2 s).
    h.set(T0 + 1_999);
    assert_quiet(&h.received, "tried again too soon");
    h.set(T0 + 3_000);
    assert_eq!(h.recv_delivered(a, "A").attempt, 0);
}

/// A stop while batches wait for a probe's answer ends once the probe is answered: the waiting ones
/// are left pending on disk, and the next start delivers them (the probe's message not again).
#[test]
fn a_stop_during_a_probe_leaves_the_waiting_batches_pending() {
    let mut h = Harness::manual();
    let (gate, a, others) = h.start_with_a_found_away(&[(T0 + 1_000, "B")]);
    let b = others[0];
    // Both due: one is the probe (held at the gate), the other waits for its answer.
    h.set(T0 + 1_000);
    h.entered.recv_timeout(WAIT).expect("the probe");
    let shared = h.scheduler().shared.clone();
    let (received, settled) = (h.received.clone(), h.settled.clone());
    let probe = std::thread::scope(|scope| {
        let stopping = scope.spawn(|| h.stop());
        let deadline = std::time::Instant::now() + WAIT;
        while !shared.stopping.load(Ordering::SeqCst) {
            assert!(std::time::Instant::now() < deadline, "no stop");
            std::thread::yield_now();
        }
        drop(shared);
        gate.add_permits(1);
        let probe = received.recv_timeout(WAIT).expect("the probe").body;
        assert_eq!(settled.recv_timeout(WAIT).unwrap()[0].1, Settled::Delivered);
        stopping.join().unwrap();
        assert!(
            received.try_recv().is_err(),
            "a waiting batch went out at the stop"
        );
        probe
    });
    let waiting = match probe.as_str() {
        "A" => ("B", b),
        _ => ("A", a),
    };
    h.script.clear(); // the destination is back
    h.open_log();
    h.start();
    // Due: delivered at the start; then one due later, behind which a second copy could not hide.
    let mut got = vec![h.recv()];
    h.schedule("a", T0 + 2_000, "last");
    h.set(T0 + 2_000);
    got.push(h.recv());
    assert_eq!(
        got.iter().map(|r| r.body.as_str()).collect::<Vec<_>>(),
        [waiting.0, "last"],
        "the waiting one once, the probe's not again"
    );
    assert_eq!(got[0].attempt, 0);
    let settled = h.settle(2);
    assert!(
        settled.contains(&(waiting.1, Settled::Delivered)),
        "{settled:?} {waiting:?}"
    );
}

/// While the lane waits for an unreachable destination, what comes due is held, unread (never handed to
/// the sink); after the wait one batch goes out alone, and the rest follow once it is answered.
#[test]
fn batches_wait_unread_for_an_unreachable_destination_and_one_tries_it() {
    let mut h = Harness::manual();
    let (gate, _, _) = h.start_with_a_found_away(&[(T0 + 100, "B"), (T0 + 100, "C")]);
    // B and C come due during the wait (500 ms to 1 s): held, not handed to the sink.
    h.set(T0 + 100);
    assert_quiet(&h.entered, "a call during the wait");
    // After it, one batch tries the destination (held at the gate); the others wait for its answer.
    h.set(T0 + 1_000);
    h.entered
        .recv_timeout(WAIT)
        .expect("the batch after the wait");
    assert_quiet(
        &h.entered,
        "a second batch went out before the first was answered",
    );
    gate.add_permits(1);
    let mut got: Vec<Received> = h.recv_n(3);
    got.sort_by(|x, y| x.body.cmp(&y.body));
    assert_eq!(
        got.iter().map(|r| r.body.as_str()).collect::<Vec<_>>(),
        ["A", "B", "C"]
    );
    assert!(got.iter().all(|r| r.at_ms == T0 + 1_000 && r.attempt == 0));
    let settled = h.settle(3);
    assert!(
        settled
            .iter()
            .all(|(_, label)| *label == Settled::Delivered),
        "{settled:?}"
    );
}
