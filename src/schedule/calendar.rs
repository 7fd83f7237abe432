//! A recurring schedule's timing (DESIGN §14): a cron pattern in a time zone, or a fixed interval; its fire
//! times; and what a schedule writes at a given instant. Pure: no clock and no I/O, every time is unix
//! milliseconds passed in, so every rule below is tested with fixed numbers.
//!
//! Invariants:
//! - A calendar's fire times strictly increase, and `next_after(t) > t`.
//! - No fire time lies after 9999-12-31 (the last one `delayd-fire-at` can name); a cron's search also ends
//!   at croner's year 5000.
//! - [`plan`] writes firings oldest first and never one due before its nominal time; given the last written
//!   nominal time as `last`, it never writes a fire time twice.
//!
//! Cron times are wall-clock times of the zone: croner walks the pattern's wall times (a naive, zone-less
//! clock) and this module maps each one to an instant, so the DST rules are ours and not the crate's:
//! - A wall time that exists once fires at that instant.
//! - A wall time that exists twice (clocks go back: 02:30 on the last Sunday of October in Europe/Berlin)
//!   fires once, at its first occurrence. This holds for every pattern: `*/15 * * * *` fires at 02:00,
//!   02:15, 02:30 and 02:45 in the first pass of the repeated hour and not at all in the second, so a
//!   schedule fires once per wall time (Vixie cron would run such wildcard jobs in both passes).
//! - A wall time that does not exist (clocks jump 02:00 → 03:00: 02:30 on the last Sunday of March in
//!   Europe/Berlin) fires at the instant the clocks jump, which reads 03:00 local: the convention of
//!   Vixie/ISC cron and croner for fixed-time jobs, not 03:30 (a shift by the gap's length). Every wall time
//!   in the gap collapses into that one instant, which is also 03:00's own firing when the pattern has one:
//!   one firing, never one per missing wall time.
//!
//! `every` is elapsed time: `anchor + k * period` for `k >= 0`, whatever the zone does.

use chrono::{DateTime, LocalResult, NaiveDateTime, TimeDelta, TimeZone, Timelike};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;

/// A fire time older than `now - MISSED_AFTER_MS` was missed (the node was down or the schedule paused);
/// a younger one is simply written late.
pub const MISSED_AFTER_MS: i64 = 1_000;
/// The most missed firings one [`plan`] writes with [`Catchup::All`], and the most on-time ones.
pub const MAX_CATCHUP: usize = 1_000;
/// The most missed cron fire times counted one by one; past it `Plan::skipped` is a lower bound.
const CRON_COUNT_LIMIT: u64 = 100_000;
/// 9999-12-31T23:59:59.999Z, the last time RFC 3339 (and so `delayd-fire-at`) can write.
const LAST_FIRE_MS: i64 = 253_402_300_799_999;
/// Longer than any repeated range of wall times in the tz database (Antarctica/Troll goes back 2 hours).
const MAX_REPEAT_HOURS: i64 = 3;

/// Why a schedule's timing is refused; `code` is the HTTP problem code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {detail}")]
pub struct InvalidTiming {
    /// `invalid_cron`, `invalid_tz` or `invalid_every`.
    pub code: &'static str,
    pub detail: String,
}

/// What a schedule does with the fire times it missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Catchup {
    /// Skip them all.
    None,
    /// One firing now, named after the newest missed fire time.
    #[default]
    One,
    /// Each one (the newest [`MAX_CATCHUP`]), oldest first, all due now.
    All,
}

/// A parsed timing: cron in a zone, or a fixed interval.
#[derive(Debug, Clone)]
pub struct Calendar {
    kind: Kind,
}

#[derive(Debug, Clone)]
enum Kind {
    Cron(Box<CronInZone>),
    Every(Interval),
}

impl Calendar {
    /// Parses a schedule's timing. Exactly one of `cron` and `every` is set.
    ///
    /// - `cron`: 5 fields (minute first, second 0) or 6 (second first); day and month names; `@hourly`,
    ///   `@daily` (`@midnight`), `@weekly`, `@monthly`, `@yearly` (`@annually`); croner's `L`, `#`, `W`,
    ///   `?` and `+` (day of month AND day of week; without it either matches, as in Vixie cron). A
    ///   pattern with no fire time from `anchor_ms` on (`0 0 30 2 *`) is refused.
    /// - `every`: `1500ms`, `30s`, `5m`, `1h`, `1d` or bare milliseconds, at least 1 s; fire times are
    ///   `anchor_ms + k * period` for `k >= 0` (the caller passes `start_at`, or the creation time).
    /// - `tz`: an IANA name, `UTC` when `None`. With `every` it must still name a zone, and is ignored.
    pub fn parse(
        cron: Option<&str>,
        every: Option<&str>,
        tz: Option<&str>,
        anchor_ms: i64,
    ) -> Result<Calendar, InvalidTiming> {
        let tz_name = tz.unwrap_or("UTC");
        let tz: Tz = tz_name.parse().map_err(|_| {
            let expected = "expected an IANA name such as Europe/Berlin";
            InvalidTiming {
                code: "invalid_tz",
                detail: format!("unknown time zone {tz_name:?}: {expected}"),
            }
        })?;
        let kind = match (cron, every) {
            (Some(pattern), None) => {
                let cron = CronInZone {
                    cron: parse_cron(pattern)?,
                    tz,
                };
                if cron.next_after(anchor_ms.saturating_sub(1)).is_none() {
                    let never = format!("{pattern:?} never fires");
                    return Err(InvalidTiming {
                        code: "invalid_cron",
                        detail: never,
                    });
                }
                Kind::Cron(Box::new(cron))
            }
            (None, Some(every)) => Kind::Every(Interval {
                anchor_ms,
                period_ms: parse_every(every)?,
            }),
            _ => {
                let detail = "exactly one of cron or every must be set".to_string();
                return Err(InvalidTiming {
                    code: "invalid_cron",
                    detail,
                });
            }
        };
        Ok(Calendar { kind })
    }

    /// The first fire time strictly after `after_ms`, `None` when there is none.
    pub fn next_after(&self, after_ms: i64) -> Option<i64> {
        let next = match &self.kind {
            Kind::Cron(cron) => cron.next_after(after_ms),
            Kind::Every(every) => every.next_after(after_ms),
        };
        next.filter(|at| *at <= LAST_FIRE_MS)
    }

    /// The last fire time strictly before `before_ms`.
    fn prev_before(&self, before_ms: i64) -> Option<i64> {
        match &self.kind {
            Kind::Cron(cron) => cron.prev_before(before_ms),
            Kind::Every(every) => every.prev_before(before_ms),
        }
    }

    /// How many fire times lie in `[from_ms, before_ms)`; a cron's are counted to `CRON_COUNT_LIMIT`.
    fn count_between(&self, from_ms: i64, before_ms: i64) -> u64 {
        match &self.kind {
            Kind::Cron(cron) => cron
                .walk_after(from_ms.saturating_sub(1))
                .map_or(0, |walk| {
                    let limit = CRON_COUNT_LIMIT as usize;
                    walk.take_while(|at| *at < before_ms).take(limit).count() as u64
                }),
            Kind::Every(every) => {
                let count = every.fired_before(before_ms) - every.fired_before(from_ms);
                u64::try_from(count).unwrap_or(0)
            }
        }
    }
}

/// Fire times `anchor_ms + k * period_ms`, `k >= 0`.
#[derive(Debug, Clone, Copy)]
struct Interval {
    anchor_ms: i64,
    period_ms: i64,
}

impl Interval {
    /// How many fire times lie before `at_ms`.
    fn fired_before(self, at_ms: i64) -> i64 {
        let since = i128::from(at_ms) - i128::from(self.anchor_ms);
        if since <= 0 {
            return 0;
        }
        // Fits: a period is at least 1,000 ms.
        i64::try_from((since - 1) / i128::from(self.period_ms) + 1).unwrap_or(i64::MAX)
    }

    fn next_after(self, after_ms: i64) -> Option<i64> {
        let k = self.fired_before(after_ms.checked_add(1)?);
        self.anchor_ms.checked_add(k.checked_mul(self.period_ms)?)
    }

    fn prev_before(self, before_ms: i64) -> Option<i64> {
        let k = self
            .fired_before(before_ms)
            .checked_sub(1)
            .filter(|k| *k >= 0)?;
        self.anchor_ms.checked_add(k.checked_mul(self.period_ms)?)
    }
}

#[derive(Debug, Clone)]
struct CronInZone {
    cron: Cron,
    tz: Tz,
}

impl CronInZone {
    fn walk_after(&self, after_ms: i64) -> Option<CronWalk<'_>> {
        let wall = wall_second(self.tz, after_ms)?;
        Some(CronWalk {
            cron: self,
            wall,
            after_ms,
        })
    }

    fn next_after(&self, after_ms: i64) -> Option<i64> {
        self.walk_after(after_ms)?.next()
    }

    fn prev_before(&self, before_ms: i64) -> Option<i64> {
        let mut wall = wall_second(self.tz, before_ms)?;
        // In the second pass of a repeated range, the range's wall times still ahead fired at their first
        // occurrence, before `before_ms`: walk back from past the range's end.
        if let LocalResult::Ambiguous(_, second) = self.tz.from_local_datetime(&wall) {
            if before_ms >= second.timestamp_millis() {
                wall += TimeDelta::hours(MAX_REPEAT_HOURS);
            }
        }
        let mut inclusive = true;
        loop {
            wall = self.cron.find_previous_occurrence(&wall, inclusive).ok()?;
            inclusive = false;
            let at = instant_of(self.tz, wall)?;
            if at < before_ms {
                return Some(at);
            }
        }
    }
}

/// A cron's fire times after an instant, ascending: the pattern's wall times from that instant's own wall
/// time on, each mapped by [`instant_of`], keeping only those past the last one yielded. The mapping
/// never goes backwards as the wall time goes forwards, so this yields each fire time once.
struct CronWalk<'a> {
    cron: &'a CronInZone,
    wall: NaiveDateTime,
    after_ms: i64,
}

impl Iterator for CronWalk<'_> {
    type Item = i64;

    fn next(&mut self) -> Option<i64> {
        // Ends: each turn moves the wall clock on a second or more, and an instant is never a day behind
        // its wall time, so the instants pass `after_ms`, or croner stops at year 5000.
        loop {
            self.wall = self
                .cron
                .cron
                .find_next_occurrence(&self.wall, false)
                .ok()?;
            let at = instant_of(self.cron.tz, self.wall)?;
            // Not past: the second pass of a repeated range, or a gap already collapsed into its end.
            if at > self.after_ms {
                self.after_ms = at;
                return Some(at);
            }
        }
    }
}

/// The wall time of an instant in `tz`, to the whole second (fire times are whole seconds).
fn wall_second(tz: Tz, at_ms: i64) -> Option<NaiveDateTime> {
    let at = DateTime::from_timestamp_millis(at_ms)?.with_timezone(&tz);
    at.naive_local().with_nanosecond(0)
}

/// The instant a wall time fires at: itself, its first occurrence, or the end of the gap it falls in.
fn instant_of(tz: Tz, wall: NaiveDateTime) -> Option<i64> {
    match tz.from_local_datetime(&wall) {
        LocalResult::Single(at) | LocalResult::Ambiguous(at, _) => Some(at.timestamp_millis()),
        LocalResult::None => gap_end(tz, wall),
    }
}

/// The first instant whose wall time is past `wall`, a time in a gap: the instant the clocks jumped.
fn gap_end(tz: Tz, wall: NaiveDateTime) -> Option<i64> {
    let local = |s: i64| {
        Some(
            DateTime::from_timestamp(s, 0)?
                .with_timezone(&tz)
                .naive_local(),
        )
    };
    // Offsets are under a day, so `wall`'s digits read as UTC, less (plus) a day, is an instant before
    // (after) `wall`. Bisect the seconds between; no zone has a gap and a repeat a day apart.
    let mut before = wall.and_utc().timestamp() - 86_400;
    let mut after = before + 2 * 86_400;
    while after - before > 1 {
        let middle = before + (after - before) / 2;
        if local(middle)? > wall {
            after = middle;
        } else {
            before = middle;
        }
    }
    after.checked_mul(1_000)
}

fn parse_cron(pattern: &str) -> Result<Cron, InvalidTiming> {
    let trimmed = pattern.trim();
    // croner knows every alias but this one.
    let midnight = trimmed.eq_ignore_ascii_case("@midnight");
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
        .parse(if midnight { "@daily" } else { trimmed })
        .map_err(|e| InvalidTiming {
            code: "invalid_cron",
            detail: format!("{pattern:?}: {e}"),
        })
}

fn parse_every(text: &str) -> Result<i64, InvalidTiming> {
    let bad = |why: &str| {
        let expected = "expected 1500ms, 30s, 5m, 1h, 1d or bare milliseconds, at least 1s";
        InvalidTiming {
            code: "invalid_every",
            detail: format!("{text:?} {why}: {expected}"),
        }
    };
    let unit_at = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let unit_ms = match &text[unit_at..] {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad("is not a duration")),
    };
    let count: i64 = text[..unit_at]
        .parse()
        .map_err(|_| bad("is not a duration"))?;
    let period_ms = count
        .checked_mul(unit_ms)
        .ok_or_else(|| bad("is too long"))?;
    if period_ms < 1_000 {
        return Err(bad("is shorter than 1s"));
    }
    Ok(period_ms)
}

/// The `delayd-fire-at` header's value: a nominal fire time in RFC 3339, UTC, with milliseconds.
pub fn format_fire_at(ms: i64) -> String {
    crate::timestamp::format_ms(ms)
}

/// One firing to write: its nominal time (what `delayd-fire-at` says) and when it is due (never before
/// nominal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Firing {
    pub nominal_ms: i64,
    pub deliver_at_ms: i64,
}

/// What a schedule writes now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Oldest first.
    pub firings: Vec<Firing>,
    /// Missed fire times not written (catch-up `none` or `one`, or past [`MAX_CATCHUP`]). A lower bound
    /// after a cron missed more than `CRON_COUNT_LIMIT` (100,000).
    pub skipped: u64,
    /// The first fire time after everything written or skipped: what to plan next (`None`: the schedule
    /// has ended, by `end_at` or by its calendar).
    pub next: Option<i64>,
}

/// The timing of one schedule, as [`plan`] needs it.
#[derive(Debug, Clone)]
pub struct Timing {
    pub calendar: Calendar,
    pub start_at_ms: Option<i64>,
    /// Inclusive: a fire time equal to it fires.
    pub end_at_ms: Option<i64>,
    pub catchup: Catchup,
    pub created_at_ms: i64,
}

/// Plans a schedule at `now_ms`; `last` is the nominal time of the last firing written (`None`: none yet).
///
/// The candidates are the fire times after `last`, at or after `start_at` (or the creation time), and at
/// or before `end_at`. One older than `now_ms - MISSED_AFTER_MS` was missed and follows `catchup`: `none`
/// skips it; `one` writes the newest missed one, due now, and skips the rest; `all` writes each one due now,
/// the newest [`MAX_CATCHUP`] of them, skipping the older rest so the schedule resumes in order. Each later
/// candidate up to `until_ms` (the caller's horizon: now, or the next fire time it means to write) is
/// written due at its own time, late if it is already past; at most [`MAX_CATCHUP`] of them, the rest
/// left to `next`.
///
/// Bounded work: an interval counts its missed fire times arithmetically; a cron counts at most
/// `CRON_COUNT_LIMIT` one by one (a per-second cron stopped for 30 days missed 2.6 million) and then
/// reports that bound as `skipped`, while the firings it writes are still the newest missed ones, found
/// walking back from now.
pub fn plan(timing: &Timing, last: Option<i64>, now_ms: i64, until_ms: i64) -> Plan {
    let calendar = &timing.calendar;
    let end_ms = timing.end_at_ms.unwrap_or(i64::MAX);
    let start_ms = timing.start_at_ms.unwrap_or(timing.created_at_ms);
    let after_ms = last.unwrap_or(i64::MIN).max(start_ms.saturating_sub(1));
    let mut cursor = calendar.next_after(after_ms);
    let mut plan = Plan::default();

    // Missed: the fire times in [first, horizon).
    let horizon_ms = now_ms
        .saturating_sub(MISSED_AFTER_MS)
        .min(end_ms.saturating_add(1));
    if let Some(first_ms) = cursor.filter(|first| *first < horizon_ms) {
        let keep = match timing.catchup {
            Catchup::None => 0,
            Catchup::One => 1,
            Catchup::All => MAX_CATCHUP,
        };
        // The newest `keep`, walking back from the horizon; the older rest are only counted.
        let mut before_ms = horizon_ms;
        while plan.firings.len() < keep {
            match calendar.prev_before(before_ms) {
                Some(at) if at >= first_ms => before_ms = at,
                _ => break,
            }
            plan.firings.push(Firing {
                nominal_ms: before_ms,
                deliver_at_ms: now_ms,
            });
        }
        plan.firings.reverse();
        plan.skipped = calendar.count_between(first_ms, before_ms);
        cursor = calendar.next_after(horizon_ms.saturating_sub(1));
    }

    let mut on_time = 0;
    while let Some(at) = cursor.filter(|at| *at <= end_ms.min(until_ms) && on_time < MAX_CATCHUP) {
        plan.firings.push(Firing {
            nominal_ms: at,
            deliver_at_ms: at,
        });
        on_time += 1;
        cursor = calendar.next_after(at);
    }
    plan.next = cursor.filter(|at| *at <= end_ms);
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix ms of `2026-03-29T01:30` (UTC, whole minutes) or of any RFC 3339 time.
    fn ms(time: &str) -> i64 {
        let whole_minutes = time.len() == 16;
        let full = format!("{time}{}", if whole_minutes { ":00Z" } else { "" });
        crate::timestamp::parse_rfc3339(&full).expect("a test time")
    }

    fn cron(pattern: &str, tz: &str) -> Calendar {
        Calendar::parse(Some(pattern), None, Some(tz), 0).expect("a valid cron")
    }

    /// The `count` fire times after `after`, in UTC, without seconds when they are 0.
    fn fires(calendar: &Calendar, after: &str, count: usize) -> String {
        let mut at = ms(after);
        let times: Vec<_> = (0..count)
            .map(|_| {
                at = calendar.next_after(at).expect("a next fire time");
                let full = format_fire_at(at);
                full.replace(":00.000Z", "").replace(".000Z", "")
            })
            .collect();
        times.join(" ")
    }

    #[test]
    fn fields_aliases_and_names() {
        let five = cron("30 9 * * *", "UTC");
        let got = fires(&five, "2026-01-01T09:30", 2);
        assert_eq!(got, "2026-01-02T09:30 2026-01-03T09:30");
        let six = cron("15 30 9 * * *", "UTC");
        let got = fires(&six, "2026-01-01T00:00", 1);
        assert_eq!(got, "2026-01-01T09:30:15");
        let seconds = cron("*/20 * * * * *", "UTC");
        let after = "2026-01-01T00:00:00.500Z";
        let got = fires(&seconds, after, 3);
        assert_eq!(
            got,
            "2026-01-01T00:00:20 2026-01-01T00:00:40 2026-01-01T00:01"
        );
        for (alias, next) in [
            ("@hourly", "2026-01-07T13:00"),
            ("@daily", "2026-01-08T00:00"),
            ("@midnight", "2026-01-08T00:00"),
            ("@weekly", "2026-01-11T00:00"), // Sunday
            ("@monthly", "2026-02-01T00:00"),
            ("@yearly", "2027-01-01T00:00"),
            ("@ANNUALLY", "2027-01-01T00:00"),
        ] {
            let got = fires(&cron(alias, "UTC"), "2026-01-07T12:00", 1);
            assert_eq!(got, next, "{alias}");
        }
        let months = cron("0 0 1 JAN,jul *", "UTC");
        let got = fires(&months, "2026-01-07T12:00", 2);
        assert_eq!(got, "2026-07-01T00:00 2027-01-01T00:00");
        // From Friday 10:00 CET (+01:00) over the weekend to Monday 09:00.
        let weekdays = cron("0 9 * * MON-FRI", "Europe/Berlin");
        let got = fires(&weekdays, "2026-01-09T09:00", 2);
        assert_eq!(got, "2026-01-12T08:00 2026-01-13T08:00");
    }

    #[test]
    fn dst_europe_berlin() {
        // 2026-03-29: 02:00 CET jumps to 03:00 CEST at 01:00Z; 02:30 fires once, as the clocks jump.
        let half_past_two = cron("30 2 * * *", "Europe/Berlin");
        let spring = fires(&half_past_two, "2026-03-28T00:00", 3);
        assert_eq!(spring, "2026-03-28T01:30 2026-03-29T01:00 2026-03-30T00:30");
        // 2026-10-25: 03:00 CEST goes back to 02:00 CET at 01:00Z; 02:30 fires at its first occurrence.
        let autumn = fires(&half_past_two, "2026-10-24T00:00", 3);
        assert_eq!(autumn, "2026-10-24T00:30 2026-10-25T00:30 2026-10-26T01:30");
        // The gap's 02:00..02:45 collapse into 03:00's own firing; the repeated hour fires in its first
        // pass only, and a search from inside the second pass goes on at 03:00 CET.
        let quarters = cron("*/15 * * * *", "Europe/Berlin");
        let spring = fires(&quarters, "2026-03-29T00:40", 3);
        assert_eq!(spring, "2026-03-29T00:45 2026-03-29T01:00 2026-03-29T01:15");
        let autumn = fires(&quarters, "2026-10-25T00:40", 3);
        assert_eq!(autumn, "2026-10-25T00:45 2026-10-25T02:00 2026-10-25T02:15");
        let got = fires(&quarters, "2026-10-25T01:20", 1);
        assert_eq!(got, "2026-10-25T02:00");
        let second_pass = ms("2026-10-25T01:20");
        assert_eq!(
            quarters.prev_before(second_pass),
            Some(ms("2026-10-25T00:45"))
        );
        // A daily 09:00 stays 09:00 local: its instant moves by an hour.
        let nine = cron("0 9 * * *", "Europe/Berlin");
        let got = fires(&nine, "2026-03-28T00:00", 2);
        assert_eq!(got, "2026-03-28T08:00 2026-03-29T07:00");
        let got = fires(&nine, "2026-10-24T00:00", 2);
        assert_eq!(got, "2026-10-24T07:00 2026-10-25T08:00");
    }

    #[test]
    fn dst_new_york_and_sydney() {
        // 2026-03-08 02:00 EST jumps to 03:00 EDT (07:00Z); 2026-11-01 02:00 EDT goes back to 01:00 EST.
        let new_york = |pattern: &str| cron(pattern, "America/New_York");
        let gap = fires(&new_york("30 2 * * *"), "2026-03-07T00:00", 3);
        assert_eq!(gap, "2026-03-07T07:30 2026-03-08T07:00 2026-03-09T06:30");
        let twice = fires(&new_york("30 1 * * *"), "2026-10-31T00:00", 3);
        assert_eq!(twice, "2026-10-31T05:30 2026-11-01T05:30 2026-11-02T06:30");
        let nine = fires(&new_york("0 9 * * *"), "2026-03-07T00:00", 2);
        assert_eq!(nine, "2026-03-07T14:00 2026-03-08T13:00");
        // 2026-04-05 03:00 AEDT goes back to 02:00 AEST (04-04T16:00Z); 2026-10-04 02:00 AEST jumps to
        // 03:00 AEDT (10-03T16:00Z).
        let sydney = cron("30 2 * * *", "Australia/Sydney");
        let autumn = fires(&sydney, "2026-04-03T00:00", 3);
        assert_eq!(autumn, "2026-04-03T15:30 2026-04-04T15:30 2026-04-05T16:30");
        let spring = fires(&sydney, "2026-10-02T00:00", 3);
        assert_eq!(spring, "2026-10-02T16:30 2026-10-03T16:00 2026-10-04T15:30");
    }

    #[test]
    fn a_year_of_half_hours_forwards_and_backwards() {
        // 365 days of 48 wall times, less the gap's 02:00 and 02:30 (collapsed into 03:00's firing); the
        // repeated 02:00 and 02:30 fire once each. Walking back meets the same fire times.
        let calendar = cron("*/30 * * * *", "Europe/Berlin");
        let (mut at, end) = (ms("2025-12-31T23:00") - 1, ms("2026-12-31T23:00"));
        let mut count = 0;
        while let Some(next) = calendar.next_after(at).filter(|next| *next < end) {
            assert_eq!(calendar.prev_before(next + 1), Some(next));
            if count > 0 {
                assert_eq!(calendar.prev_before(next), Some(at), "{next}");
            }
            (at, count) = (next, count + 1);
        }
        assert_eq!(count, 365 * 48 - 2);
    }

    #[test]
    fn month_ends_and_leap_days() {
        let days = fires(&cron("0 0 31 * *", "UTC"), "2026-01-01T00:00", 3);
        assert_eq!(days, "2026-01-31T00:00 2026-03-31T00:00 2026-05-31T00:00");
        let days = fires(&cron("0 0 L * *", "UTC"), "2028-01-01T00:00", 3);
        assert_eq!(days, "2028-01-31T00:00 2028-02-29T00:00 2028-03-31T00:00");
        let leap = fires(&cron("0 0 29 2 *", "UTC"), "2026-01-01T00:00", 2);
        assert_eq!(leap, "2028-02-29T00:00 2032-02-29T00:00");
    }

    #[test]
    fn every_keeps_its_phase() {
        let anchor = ms("2026-03-29T00:00:00.250Z");
        let every = |text: &str| {
            Calendar::parse(None, Some(text), Some("Europe/Berlin"), anchor).expect("valid")
        };
        let thirty = every("30s");
        assert_eq!(thirty.next_after(anchor - 5_000), Some(anchor));
        assert_eq!(thirty.next_after(anchor), Some(anchor + 30_000));
        assert_eq!(thirty.next_after(anchor + 45_000), Some(anchor + 60_000));
        assert_eq!(thirty.prev_before(anchor + 30_000), Some(anchor));
        assert_eq!(thirty.prev_before(anchor), None);
        let periods = [("1500ms", 1_500), ("5m", 300_000), ("1d", 86_400_000)];
        for (text, period_ms) in periods.into_iter().chain([("2000", 2_000)]) {
            let next = every(text).next_after(anchor);
            assert_eq!(next, Some(anchor + period_ms), "{text}");
        }
        // Elapsed time: across Berlin's spring gap (01:00Z) an hour is still an hour.
        let hourly = fires(&every("1h"), "2026-03-29T00:00:00.250Z", 2);
        assert_eq!(hourly, "2026-03-29T01:00:00.250Z 2026-03-29T02:00:00.250Z");
    }

    #[test]
    fn invalid_timings() {
        let code = |cron: Option<&str>, every: Option<&str>, tz: Option<&str>| {
            let refused = Calendar::parse(cron, every, tz, ms("2026-01-01T00:00"));
            refused.expect_err("invalid").code
        };
        let patterns = "61 * * * *|* * * *|0 0 0 1 1 * 2026|@reboot|0 0 30 2 *|0 0 31 4 *|";
        for pattern in patterns.split('|') {
            assert_eq!(code(Some(pattern), None, None), "invalid_cron", "{pattern}");
        }
        let berlin_nine = Some("0 9 * * *");
        assert_eq!(code(berlin_nine, None, Some("Mars/Base")), "invalid_tz");
        assert_eq!(code(None, Some("1m"), Some("Mars/Base")), "invalid_tz");
        for every in "0s 500ms 999 abc  5x -5s 1.5s 1s2 99999999999999999d".split(' ') {
            assert_eq!(code(None, Some(every), None), "invalid_every", "{every}");
        }
        let both = Calendar::parse(Some("* * * * *"), Some("1m"), None, 0).expect_err("both");
        assert_eq!(both.code, "invalid_cron");
        let says = both.detail.contains("exactly one of cron or every");
        assert!(says, "{both}");
        assert_eq!(code(None, None, None), "invalid_cron");
    }

    fn timing(calendar: Calendar, catchup: Catchup, end_at_ms: Option<i64>) -> Timing {
        let created_at_ms = ms("2026-01-01T12:00");
        let start_at_ms = None;
        Timing {
            calendar,
            start_at_ms,
            end_at_ms,
            catchup,
            created_at_ms,
        }
    }

    fn every(text: &str) -> Calendar {
        Calendar::parse(None, Some(text), None, ms("2026-01-01T12:00")).expect("valid")
    }

    /// A plan in UTC times of day: each firing `nominal`, or `nominal@due` when it is due later, then
    /// what was skipped and what is next.
    fn brief(plan: &Plan) -> String {
        let time = |at: i64| format_fire_at(at)[11..19].to_string();
        let mut out = String::new();
        for firing in &plan.firings {
            out += &time(firing.nominal_ms);
            if firing.deliver_at_ms != firing.nominal_ms {
                out += &format!("@{}", time(firing.deliver_at_ms));
            }
            out += " ";
        }
        let next = plan.next.map_or("none".into(), time);
        out + &format!("skipped {} next {next}", plan.skipped)
    }

    /// [`brief`] of the plan's last `count` firings.
    fn brief_last(plan: &Plan, count: usize) -> String {
        let firings = plan.firings[plan.firings.len() - count..].to_vec();
        brief(&Plan {
            firings,
            ..plan.clone()
        })
    }

    #[test]
    fn catch_up_after_a_stop() {
        // Written 12:00, down until 12:10:30: 12:01..12:10 were missed, 12:11 is next.
        let (last, now) = (Some(ms("2026-01-01T12:00")), ms("2026-01-01T12:10:30Z"));
        let every_minute = |catchup| timing(every("1m"), catchup, None);
        let none = plan(&every_minute(Catchup::None), last, now, now);
        assert_eq!(brief(&none), "skipped 10 next 12:11:00");
        let one = plan(&every_minute(Catchup::One), last, now, now);
        assert_eq!(brief(&one), "12:10:00@12:10:30 skipped 9 next 12:11:00");
        let all = plan(&every_minute(Catchup::All), last, now, now);
        let each: String = (1..=10)
            .map(|m| format!("12:{m:02}:00@12:10:30 "))
            .collect();
        assert_eq!(brief(&all), each + "skipped 0 next 12:11:00");
        // Late by less than MISSED_AFTER_MS is on time: due at its own time.
        let late_ms = ms("2026-01-01T12:10:00.500Z");
        let late = plan(&every_minute(Catchup::None), last, late_ms, late_ms);
        assert_eq!(brief(&late), "12:10:00 skipped 9 next 12:11:00");
        // A first plan starts at creation, inclusive, and writes up to `until`.
        let (created, until) = (ms("2026-01-01T12:00"), ms("2026-01-01T12:02"));
        let first = brief(&plan(&every_minute(Catchup::One), None, created, until));
        assert_eq!(first, "12:00:00 12:01:00 12:02:00 skipped 0 next 12:03:00");
        // `start_at` moves the first candidate; `every`'s phase comes from its anchor.
        let mut from_five = every_minute(Catchup::One);
        from_five.start_at_ms = Some(ms("2026-01-01T12:04:30Z"));
        let first = plan(&from_five, None, created, created);
        assert_eq!(brief(&first), "skipped 0 next 12:05:00");
    }

    #[test]
    fn end_at_is_inclusive_and_ends_the_schedule() {
        let (start, end) = (ms("2026-01-01T12:00"), ms("2026-01-01T12:05"));
        let every_minute = timing(every("1m"), Catchup::All, Some(end));
        let hour_later = ms("2026-01-01T13:00");
        let after_end = plan(&every_minute, Some(start), hour_later, hour_later);
        let each: String = (1..=5).map(|m| format!("12:0{m}:00@13:00:00 ")).collect();
        assert_eq!(brief(&after_end), each + "skipped 0 next none");
        let at_end = plan(&every_minute, Some(end - 60_000), end, end);
        assert_eq!(brief(&at_end), "12:05:00 skipped 0 next none");
        let ended = plan(&every_minute, Some(end), end + 1, end + 60_000);
        assert_eq!(ended, Plan::default());
    }

    #[test]
    fn catch_up_all_is_capped() {
        // Every second, down two hours: 7,198 missed, the newest 1,000 written, and the two within
        // MISSED_AFTER_MS of now written on time.
        let start = ms("2026-01-01T12:00");
        let now = start + 7_200_000;
        let every_second = timing(every("1s"), Catchup::All, None);
        let planned = plan(&every_second, Some(start), now, now);
        assert_eq!(planned.firings.len(), MAX_CATCHUP + 2);
        let oldest = brief_last(&planned, MAX_CATCHUP + 2);
        assert!(
            oldest.starts_with("13:43:19@14:00:00 13:43:20@14:00:00 "),
            "{oldest}"
        );
        let newest = brief_last(&planned, 3);
        assert_eq!(
            newest,
            "13:59:58@14:00:00 13:59:59 14:00:00 skipped 6198 next 14:00:01"
        );
    }

    #[test]
    fn per_second_cron_after_30_days_is_bounded() {
        let start = ms("2026-01-01T00:00");
        let now = start + 30 * 86_400_000;
        for (catchup, written) in [(Catchup::One, 1), (Catchup::All, MAX_CATCHUP)] {
            let calendar = cron("* * * * * *", "Europe/Berlin");
            let planned = plan(&timing(calendar, catchup, None), Some(start), now, now);
            // 2,591,997 missed: counted to the bound, and still the newest ones written.
            assert_eq!(planned.skipped, CRON_COUNT_LIMIT);
            assert_eq!(planned.firings.len(), written + 2);
            let oldest_ms = now - 1_000 - 1_000 * written as i64;
            assert_eq!(planned.firings[0].nominal_ms, oldest_ms);
            let newest = brief_last(&planned, 3);
            assert_eq!(
                newest,
                "23:59:58@00:00:00 23:59:59 00:00:00 skipped 100000 next 00:00:01"
            );
        }
    }

    #[test]
    fn catchup_names_and_fire_at() {
        assert_eq!(Catchup::default(), Catchup::One);
        let all = [Catchup::None, Catchup::One, Catchup::All];
        let json = serde_json::to_string(&all).expect("json");
        assert_eq!(json, r#"["none","one","all"]"#);
        let parsed: Catchup = serde_json::from_str(r#""all""#).expect("json");
        assert_eq!(parsed, Catchup::All);
        let fire_at = format_fire_at(ms("2026-12-05T09:00"));
        assert_eq!(fire_at, "2026-12-05T09:00:00.000Z");
    }
}
