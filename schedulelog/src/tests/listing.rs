//! Listings, the timeline and lookups through the buckets' views (listing.rs, view.rs).

use super::*;
use crate::fault::Fault;

/// A message for `topic`, without key or headers.
fn topic_message(deliver_at_ms: i64, topic: &str, body: &str) -> EncodedMessage {
    NewMessage {
        deliver_at_ms,
        topic: topic.into(),
        sink: "broker".into(),
        body: body.as_bytes().to_vec(),
        ..NewMessage::default()
    }
    .encode()
    .unwrap()
}

fn record(log: &ScheduleLog, appended: &Appended, kind: OutcomeKind) {
    let outcome = Outcome {
        seq: appended.location.seq,
        at_ms: T0,
        attempt: 0,
        kind,
    };
    log.record_outcomes(&[(appended.location.bucket, outcome)])
        .unwrap();
}

fn query(status: StatusFilter, limit: usize) -> ListQuery {
    ListQuery {
        from_ms: i64::MIN,
        to_ms: i64::MAX,
        status,
        topic: None,
        limit,
        scan_limit: usize::MAX,
        after: None,
    }
}

/// Every page of a listing, following the cursors; the bodies in the order listed.
fn all_pages(log: &ScheduleLog, mut query: ListQuery) -> (Vec<String>, usize) {
    let (mut bodies, mut pages) = (Vec::new(), 0);
    loop {
        let page = log.list(&query).unwrap();
        pages += 1;
        assert!(page.messages.len() <= query.limit);
        bodies.extend(
            page.messages
                .iter()
                .map(|l| String::from_utf8(l.message.body.clone()).unwrap()),
        );
        match page.next {
            Some(next) => query.after = Some(next.to_string().parse().unwrap()),
            None => return (bodies, pages),
        }
    }
}

#[test]
fn a_listing_goes_bucket_by_bucket_in_due_order_a_page_at_a_time() {
    let (_dir, _, log) = new_log();
    // Appended out of due order, over three hourly buckets, two topics; two due at the same time.
    let due = [
        (3 * HOUR_MS + 5, "a"),
        (HOUR_MS + 900_000, "a"),
        (HOUR_MS + 10, "b"),
        (2 * HOUR_MS + 1, "a"),
        (HOUR_MS + 10, "a"),
        (3 * HOUR_MS, "b"),
        (HOUR_MS + 3_000_000, "a"),
    ];
    let messages = due
        .iter()
        .enumerate()
        .map(|(i, (at, topic))| topic_message(T0 + at, &format!("t.{topic}"), &format!("m{i}")))
        .collect();
    log.append(messages).wait().unwrap();

    // Oldest due first; the two due at once in the order they were appended.
    let expected = ["m2", "m4", "m1", "m6", "m3", "m5", "m0"];
    for limit in [1, 2, 3, 100] {
        let (bodies, pages) = all_pages(&log, query(StatusFilter::Pending, limit));
        assert_eq!(bodies, expected, "limit {limit}");
        // (A full page has a cursor even when nothing follows: the next page is then empty.)
        assert_eq!(pages, expected.len() / limit + 1, "limit {limit}");
    }
    // A topic, and a range of due times: [from, to).
    let mut q = query(StatusFilter::Pending, 2);
    q.topic = Some("t.a".into());
    assert_eq!(all_pages(&log, q.clone()).0, ["m4", "m1", "m6", "m3", "m0"]);
    q.from_ms = T0 + HOUR_MS + 11;
    q.to_ms = T0 + 3 * HOUR_MS + 5;
    assert_eq!(all_pages(&log, q.clone()).0, ["m1", "m6", "m3"]);
    // A scan limit ends a page early, with a cursor that goes on where it stopped.
    q.scan_limit = 1;
    let (bodies, pages) = all_pages(&log, q);
    assert_eq!(bodies, ["m1", "m6", "m3"]);
    assert!(pages >= 3, "{pages} pages");

    // Records appended after a listing are merged into the bucket's due order.
    let later = topic_message(T0 + HOUR_MS + 5, "t.a", "m7");
    log.append(vec![later]).wait().unwrap();
    assert_eq!(
        all_pages(&log, query(StatusFilter::Pending, 3)).0,
        ["m7", "m2", "m4", "m1", "m6", "m3", "m5", "m0"]
    );
    assert!("not a cursor".parse::<ListCursor>().is_err());

    // Delivered ones, more in a bucket than a page may look at: found by the walk in due order, with
    // the same order and cursors as from the outcome index.
    let appended: Vec<Appended> = log
        .append(
            [40, 10, 30, 20]
                .iter()
                .map(|s| topic_message(T0 + 5 * HOUR_MS + s * 1000, "t.d", &format!("d{s}")))
                .collect(),
        )
        .wait()
        .unwrap();
    for a in &appended[..3] {
        record(&log, a, OutcomeKind::Delivered);
    }
    for scan_limit in [1, 2, 3, 100] {
        let mut q = query(StatusFilter::Delivered, 2);
        q.scan_limit = scan_limit;
        assert_eq!(
            all_pages(&log, q).0,
            ["d10", "d30", "d40"],
            "scan limit {scan_limit}"
        );
    }
}

#[test]
fn a_listing_by_status_follows_the_outcomes_and_skips_replaced_attempts() {
    let (_dir, _, log) = new_log();
    let at = |i: i64| T0 + HOUR_MS + i * 1000;
    let appended: Vec<Appended> = log
        .append(
            (0..6)
                .map(|i| topic_message(at(10 - i), "t", &format!("m{i}")))
                .collect(),
        )
        .wait()
        .unwrap();
    record(&log, &appended[0], OutcomeKind::Delivered);
    record(
        &log,
        &appended[1],
        OutcomeKind::Dead {
            reason: "HTTP 400".into(),
        },
    );
    record(&log, &appended[2], OutcomeKind::Cancelled);
    record(
        &log,
        &appended[3],
        OutcomeKind::Dead {
            reason: "gone".into(),
        },
    );
    record(&log, &appended[3], OutcomeKind::Discarded);
    // m4 is retried: its next attempt, in the next bucket, is the one listed.
    let retry = NewMessage {
        retry_of: Some((appended[4].id, 1)),
        ..NewMessage {
            deliver_at_ms: at(10) + HOUR_MS,
            topic: "t".into(),
            key: None,
            headers: Vec::new(),
            sink: "broker".into(),
            body: b"m4 again".to_vec(),
            retry_of: None,
            dedup: false,
        }
    };
    let next = log.append(vec![retry.encode().unwrap()]).wait().unwrap()[0].location;
    let retried = OutcomeKind::Retried {
        next,
        reason: "503".into(),
    };
    record(&log, &appended[4], retried);

    let bodies = |status| all_pages(&log, query(status, 2)).0;
    assert_eq!(bodies(StatusFilter::Pending), ["m5", "m4 again"]);
    assert_eq!(bodies(StatusFilter::Delivered), ["m0"]);
    assert_eq!(bodies(StatusFilter::Dead), ["m1"]);
    assert_eq!(bodies(StatusFilter::Cancelled), ["m2"]);
    assert_eq!(bodies(StatusFilter::Discarded), ["m3"]);
    assert_eq!(
        bodies(StatusFilter::Any),
        ["m5", "m3", "m2", "m1", "m0", "m4 again"]
    );
    let dead = log.list(&query(StatusFilter::Dead, 10)).unwrap();
    assert_eq!(
        dead.messages[0].state,
        MessageState::Dead {
            at_ms: T0,
            reason: "HTTP 400".into()
        }
    );
    let discarded = log.lookup(appended[3].id).unwrap().unwrap();
    assert_eq!(
        discarded.state,
        MessageState::Discarded {
            at_ms: T0,
            reason: "gone".into()
        }
    );

    // The timeline: m0..m5 in one bucket, of which m5 is pending; the retry in the next.
    let counts = log.timeline(i64::MIN, i64::MAX).unwrap();
    let pending: Vec<(u64, u64)> = counts.iter().map(|c| (c.total, c.pending)).collect();
    assert_eq!(pending, [(6, 1), (1, 1)]);
    assert_eq!(counts[1].bucket, next.bucket);
    // A range that ends before the second bucket leaves it out.
    assert_eq!(
        log.timeline(i64::MIN, next.bucket.start_ms())
            .unwrap()
            .len(),
        1
    );

    // The history of the retried message: the first attempt retried, the second pending.
    let status = log.lookup(appended[4].id).unwrap().unwrap();
    let history: Vec<(u16, Option<OutcomeKind>)> = status
        .history
        .iter()
        .map(|a| (a.attempt, a.outcome.as_ref().map(|o| o.kind.clone())))
        .collect();
    assert_eq!(
        history,
        [
            (
                0,
                Some(OutcomeKind::Retried {
                    next,
                    reason: "503".into()
                })
            ),
            (1, None)
        ]
    );
}

#[test]
fn a_lookup_reads_outcomes_recorded_after_its_view_was_built_and_never_half_a_frame() {
    let (_dir, _, log) = new_log();
    let a = append_one(&log, T0 + HOUR_MS, "a");
    let b = append_one(&log, T0 + HOUR_MS, "b");
    record(&log, &a, OutcomeKind::Cancelled);
    // The view of the bucket is built here, with one outcome.
    assert_eq!(
        log.lookup(b.id).unwrap().unwrap().state,
        MessageState::Pending
    );
    // Half of b's outcome reaches the file, then the disk is full.
    log.inject_fault(Fault::DispatchAppendsFull(1));
    let delivered = Outcome {
        seq: b.location.seq,
        at_ms: T0 + 7,
        attempt: 0,
        kind: OutcomeKind::Delivered,
    };
    assert!(log
        .record_outcomes(&[(b.location.bucket, delivered.clone())])
        .is_err());
    assert_eq!(
        log.lookup(b.id).unwrap().unwrap().state,
        MessageState::Pending
    );
    assert_eq!(all_pages(&log, query(StatusFilter::Pending, 5)).0, ["b"]);
    // The retry cuts the half frame and appends the whole one: the view reads it from there.
    log.record_outcomes(&[(b.location.bucket, delivered)])
        .unwrap();
    assert_eq!(
        log.lookup(b.id).unwrap().unwrap().state,
        MessageState::Delivered { at_ms: T0 + 7 }
    );
    assert_eq!(log.outcomes_of(b.location).unwrap().unwrap().len(), 1);
    assert!(all_pages(&log, query(StatusFilter::Pending, 5))
        .0
        .is_empty());
    assert_eq!(
        log.lookup(a.id).unwrap().unwrap().state,
        MessageState::Cancelled { at_ms: T0 }
    );
}

#[test]
fn a_record_stored_after_its_time_is_listed_first_in_its_bucket_by_either_path() {
    let (_dir, _, log) = new_log();
    // Due five minutes ago: filed in the bucket of now (T0 is 09:30, so the 09:00 bucket), due before
    // nothing else in it.
    let late = log
        .append(vec![
            topic_message(T0 - 5 * 60_000, "t", "late"),
            topic_message(T0 + 60_000, "t", "soon"),
            topic_message(T0 + 120_000, "t", "then"),
        ])
        .wait()
        .unwrap();
    assert_eq!(late[0].location.bucket, late[1].location.bucket);
    let mut q = query(StatusFilter::Pending, 10);
    assert_eq!(all_pages(&log, q.clone()).0, ["late", "soon", "then"]);
    // Listed by its own time: a range that starts after it leaves it out.
    q.from_ms = T0 - 60_000;
    assert_eq!(all_pages(&log, q).0, ["soon", "then"]);

    // Dead, all three: the outcome index's path and the walk's path give one order, so a cursor from
    // either goes on in the other.
    for a in &late {
        record(&log, a, OutcomeKind::Dead { reason: "r".into() });
    }
    let mut q = query(StatusFilter::Dead, 1);
    q.scan_limit = 100; // from the outcome index
    let first = log.list(&q).unwrap();
    q.scan_limit = 2; // three dead > 2: by the walk
    q.after = first.next;
    let rest = all_pages(&log, q).0;
    let body = |l: &Listed| String::from_utf8(l.message.body.clone()).unwrap();
    assert_eq!(body(&first.messages[0]), "late");
    assert_eq!(rest, ["soon", "then"]);
}

#[test]
fn a_bucket_is_not_retired_while_an_attempt_it_leads_to_is_pending() {
    let (_dir, clock, log) = new_log();
    let first = append_one(&log, T0 + 60_000, "first");
    record(&log, &first, OutcomeKind::Dead { reason: "r".into() });
    // Requeued (as the API does) to two days later.
    let again = NewMessage {
        deliver_at_ms: T0 + 48 * HOUR_MS,
        topic: "t".into(),
        key: None,
        headers: Vec::new(),
        sink: "broker".into(),
        body: b"again".to_vec(),
        retry_of: Some((first.id, 1)),
        dedup: false,
    };
    let next = log.append(vec![again.encode().unwrap()]).wait().unwrap()[0];
    let retried = OutcomeKind::Retried {
        next: next.location,
        reason: "requeued".into(),
    };
    record(&log, &first, retried);
    let bucket = first.location.bucket;
    clock.set(bucket.end_ms(SegmentMinutes::DEFAULT) + 25 * HOUR_MS);
    assert_eq!(
        log.retire().unwrap(),
        vec![],
        "the requeued attempt is pending"
    );
    assert_eq!(
        log.lookup(first.id).unwrap().unwrap().location,
        next.location
    );
    let delivered = Outcome {
        seq: next.location.seq,
        at_ms: T0,
        attempt: 1,
        kind: OutcomeKind::Delivered,
    };
    log.record_outcomes(&[(next.location.bucket, delivered)])
        .unwrap();
    // Finished, but within its own retention: the first bucket, that its id leads through, is kept.
    assert_eq!(log.retire().unwrap(), vec![]);
    assert!(log.lookup(first.id).unwrap().is_some());
    clock.set(next.location.bucket.end_ms(SegmentMinutes::DEFAULT) + 25 * HOUR_MS);
    assert_eq!(log.retire().unwrap(), vec![bucket, next.location.bucket]);
}

/// A message retried from bucket `from` into `to` (with `attempt` its attempt there).
fn retry_into(log: &ScheduleLog, from: &Appended, attempt: u16, due: i64) -> Appended {
    let retry = NewMessage {
        deliver_at_ms: due,
        topic: "t".into(),
        key: None,
        headers: Vec::new(),
        sink: "broker".into(),
        body: b"again".to_vec(),
        retry_of: Some((from.id, attempt)),
        dedup: false,
    };
    let next = log.append(vec![retry.encode().unwrap()]).wait().unwrap()[0];
    let outcome = Outcome {
        seq: from.location.seq,
        at_ms: T0,
        attempt: attempt - 1,
        kind: OutcomeKind::Retried {
            next: next.location,
            reason: "503".into(),
        },
    };
    log.record_outcomes(&[(from.location.bucket, outcome)])
        .unwrap();
    next
}

#[test]
fn a_message_pending_in_a_later_hour_keeps_only_its_own_hours() {
    let (_dir, clock, log) = new_log();
    // Hour 1: m1, retried into hour 2 and delivered there. Hour 2: m2, retried into hour 3, pending.
    let m1 = append_one(&log, T0 + HOUR_MS, "m1");
    let m2 = append_one(&log, T0 + 2 * HOUR_MS, "m2");
    let m1_again = retry_into(&log, &m1, 1, T0 + 2 * HOUR_MS + 1);
    record(&log, &m1_again, OutcomeKind::Delivered);
    let m2_again = retry_into(&log, &m2, 1, T0 + 3 * HOUR_MS);
    let (hour1, hour2) = (m1.location.bucket, m2.location.bucket);
    assert_eq!(m1_again.location.bucket, hour2);
    clock.set(hour2.end_ms(SegmentMinutes::DEFAULT) + 25 * HOUR_MS);
    // Hour 1's message ended in hour 2, past its retention: hour 1 goes, although hour 2 stays for
    // m2, whose current attempt is pending in hour 3.
    assert_eq!(log.retire().unwrap(), vec![hour1]);
    assert!(log.lookup(m2.id).unwrap().is_some());
    assert_eq!(
        log.lookup(m2.id).unwrap().unwrap().location,
        m2_again.location
    );
}

#[test]
fn a_retry_written_but_not_filed_keeps_the_bucket_it_came_from() {
    let (_dir, clock, log) = new_log();
    // Attempt 0 retried into attempt 1 three hours later, which is retried into attempt 2 at a seq
    // the replayer has not filed (past `filed_below`): as a retry the replayer has not reached, so
    // that no pointer under attempt 0 leads to it yet. The first bucket's link ends at attempt 1.
    let first = append_one(&log, T0 + 60_000, "first");
    let second = retry_into(&log, &first, 1, T0 + 3 * HOUR_MS);
    let not_filed = Location {
        bucket: Bucket::of(T0 + 48 * HOUR_MS, SegmentMinutes::DEFAULT),
        seq: log.filed_below() + 1_000,
    };
    let outcome = Outcome {
        seq: second.location.seq,
        at_ms: T0,
        attempt: 1,
        kind: OutcomeKind::Retried {
            next: not_filed,
            reason: "503".into(),
        },
    };
    log.record_outcomes(&[(second.location.bucket, outcome)])
        .unwrap();
    clock.set(second.location.bucket.end_ms(SegmentMinutes::DEFAULT) + 25 * HOUR_MS);
    assert_eq!(
        log.retire().unwrap(),
        vec![],
        "followed through attempt 1 to attempt 2"
    );
}

#[test]
fn outcomes_read_in_steps_count_the_same_before_and_after_they_are_merged() {
    let (_dir, _, log) = new_log();
    let appended: Vec<Appended> = log
        .append((0..600).map(|i| message(T0 + HOUR_MS + i, "m")).collect())
        .wait()
        .unwrap();
    let outcome = |a: &Appended, kind| {
        let outcome = Outcome {
            seq: a.location.seq,
            at_ms: T0,
            attempt: 0,
            kind,
        };
        (a.location.bucket, outcome)
    };
    let pending = |log: &ScheduleLog| log.timeline(i64::MIN, i64::MAX).unwrap()[0].pending;
    assert_eq!(pending(&log), 600);
    // In steps, each read by a lookup: the view keeps them aside, then merges them (past 256 in tests).
    let mut finished = 0;
    for (step, kind) in [
        (100, OutcomeKind::Delivered),
        (250, OutcomeKind::Cancelled),
        (150, OutcomeKind::Delivered),
    ] {
        let batch: Vec<_> = appended[finished..finished + step]
            .iter()
            .map(|a| outcome(a, kind.clone()))
            .collect();
        log.record_outcomes(&batch).unwrap();
        // The same outcomes again, as a retried append may leave them: counted once.
        log.record_outcomes(&batch[..10]).unwrap();
        finished += step;
        assert_eq!(pending(&log), 600 - finished as u64);
        let state = log
            .lookup(appended[finished - 1].id)
            .unwrap()
            .unwrap()
            .state;
        assert!(!matches!(state, MessageState::Pending), "{state:?}");
        assert_eq!(
            log.lookup(appended[finished].id).unwrap().unwrap().state,
            MessageState::Pending
        );
    }
    let mut q = query(StatusFilter::Cancelled, 100);
    q.scan_limit = 1000;
    assert_eq!(all_pages(&log, q).0.len(), 250);
    assert_eq!(
        all_pages(&log, query(StatusFilter::Pending, 100)).0.len(),
        100
    );
}
