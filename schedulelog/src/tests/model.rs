//! Model-based test: random appends, cancels, outcomes, retries, checkpoints, crashes and clean reopens
//! are applied to the log and to an in-memory model; after every reopen (and at the end) every message's
//! status must agree with the model, and the segments must hold each attempt exactly once. A retry's
//! `retried` outcome is sometimes left unrecorded (as when the log is poisoned right after the retry was
//! written): the lookup must find the newest attempt all the same.

use super::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Append {
        count: usize,
        delay_minutes: u16,
    },
    Cancel(usize),
    Deliver(usize),
    /// A retry; `recorded` says whether its `retried` outcome is recorded.
    Retry {
        index: usize,
        recorded: bool,
    },
    Checkpoint,
    Crash,
    Reopen,
    Advance(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..4, 0u16..300).prop_map(|(count, delay_minutes)| Op::Append { count, delay_minutes }),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<usize>().prop_map(Op::Deliver),
        1 => (any::<usize>(), proptest::bool::weighted(0.7)).prop_map(|(index, recorded)| Op::Retry { index, recorded }),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Crash),
        1 => Just(Op::Reopen),
        1 => (0u16..120).prop_map(Op::Advance),
    ]
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Pending,
    Delivered,
    Cancelled,
}

#[derive(Debug)]
struct Model {
    id: MessageId,
    location: Location,
    body: String,
    attempt: u16,
    state: State,
}

fn check(log: &ScheduleLog, model: &[Model], attempts: usize) {
    for m in model {
        let status = log
            .lookup(m.id)
            .unwrap()
            .unwrap_or_else(|| panic!("{:?} lost", m.id));
        assert_eq!(status.message.body, m.body.as_bytes());
        assert_eq!(status.message.attempt, m.attempt);
        assert_eq!(status.location, m.location);
        let state = match status.state {
            MessageState::Pending => State::Pending,
            MessageState::Delivered { .. } => State::Delivered,
            MessageState::Cancelled { .. } => State::Cancelled,
            MessageState::Dead { .. } | MessageState::Discarded { .. } => {
                panic!("nothing dies in this model")
            }
        };
        assert_eq!(state, m.state, "{:?}", m.id);
    }
    assert_eq!(
        all_messages(log).len(),
        attempts,
        "each attempt stored exactly once"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn log_agrees_with_model(ops in proptest::collection::vec(op(), 1..60)) {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let mut log = Some(ScheduleLog::open(dir.path(), options(&clock)).unwrap());
        let mut model: Vec<Model> = Vec::new();
        let mut attempts = 0;
        for op in ops {
            let current = log.as_ref().unwrap();
            let pending: Vec<usize> = (0..model.len()).filter(|&i| model[i].state == State::Pending).collect();
            let pick = |i: usize| (!pending.is_empty()).then(|| pending[i % pending.len()]);
            match op {
                Op::Append { count, delay_minutes } => {
                    let now = clock.now_ms();
                    let batch: Vec<_> = (0..count)
                        .map(|k| format!("m{}-{k}", model.len()))
                        .collect();
                    let encoded = batch.iter().map(|b| message(now + i64::from(delay_minutes) * 60_000, b)).collect();
                    let appended = current.append(encoded).wait().unwrap();
                    for (a, body) in appended.into_iter().zip(batch) {
                        model.push(Model { id: a.id, location: a.location, body, attempt: 0, state: State::Pending });
                        attempts += 1;
                    }
                }
                Op::Cancel(i) => if let Some(i) = pick(i) {
                    current.cancel(model[i].location).wait().unwrap();
                    model[i].state = State::Cancelled;
                },
                Op::Deliver(i) => if let Some(i) = pick(i) {
                    let m = &mut model[i];
                    let outcome = Outcome { seq: m.location.seq, at_ms: clock.now_ms(), attempt: m.attempt, kind: OutcomeKind::Delivered };
                    current.record_outcomes(&[(m.location.bucket, outcome)]).unwrap();
                    m.state = State::Delivered;
                },
                Op::Retry { index, recorded } => if let Some(i) = pick(index) {
                    let m = &mut model[i];
                    let retry = NewMessage {
                        deliver_at_ms: clock.now_ms() + 90_000,
                        topic: "orders.timeout".into(),
                        key: Some("order-42".into()),
                        headers: vec![("traceparent".into(), "00-abc".into())],
                        sink: "broker".into(),
                        body: m.body.as_bytes().to_vec(),
                        retry_of: Some((m.id, m.attempt + 1)),
                        dedup: false,
                    };
                    let next = current.append(vec![retry.encode().unwrap()]).wait().unwrap()[0];
                    let kind = OutcomeKind::Retried { next: next.location, reason: "503".into() };
                    let outcome = Outcome { seq: m.location.seq, at_ms: clock.now_ms(), attempt: m.attempt, kind };
                    if recorded {
                        current.record_outcomes(&[(m.location.bucket, outcome)]).unwrap();
                    }
                    m.location = next.location;
                    m.attempt += 1;
                    attempts += 1;
                },
                Op::Checkpoint => current.checkpoint().unwrap(),
                Op::Crash | Op::Reopen => {
                    let old = log.take().unwrap();
                    if matches!(op, Op::Crash) { old.crash() } else { old.close().unwrap() }
                    let reopened = ScheduleLog::open(dir.path(), options(&clock)).unwrap();
                    check(&reopened, &model, attempts);
                    log = Some(reopened);
                }
                Op::Advance(minutes) => clock.advance(i64::from(minutes) * 60_000),
            }
        }
        check(log.as_ref().unwrap(), &model, attempts);
    }
}
