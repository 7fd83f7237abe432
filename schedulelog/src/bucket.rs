//! Buckets of delivery time: the first level of the timing wheel.
//!
//! A bucket is a UTC interval `[start, start + segment_minutes)` aligned to the unix epoch, named by its
//! start minute. Each bucket has one schedule segment and one dispatch log, named
//! `{YYYYMMDDTHHMM}Z.{ext}` after the bucket's UTC start, so a name never depends on the machine's time zone.
//!
//! Invariant: a bucket is identified by its start minute since the epoch (`u32`, good until the year
//! 10,000), which is a multiple of `segment_minutes`. Times before the epoch fall into the bucket at 0.

use std::fmt;

/// The width of a bucket in minutes: 5..=60, fixed for a data dir once written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentMinutes(u16);

impl SegmentMinutes {
    pub const MIN: u16 = 5;
    pub const MAX: u16 = 60;
    pub const DEFAULT: SegmentMinutes = SegmentMinutes(60);

    pub fn new(minutes: u16) -> Option<SegmentMinutes> {
        (Self::MIN..=Self::MAX)
            .contains(&minutes)
            .then_some(SegmentMinutes(minutes))
    }

    pub fn get(self) -> u16 {
        self.0
    }

    pub fn width_ms(self) -> i64 {
        i64::from(self.0) * MS_PER_MINUTE
    }
}

impl Default for SegmentMinutes {
    fn default() -> Self {
        Self::DEFAULT
    }
}

const MS_PER_MINUTE: i64 = 60_000;

/// One bucket of delivery time, identified by its UTC start minute since the unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bucket(u32);

impl Bucket {
    /// The bucket holding unix time `ms`.
    pub fn of(ms: i64, width: SegmentMinutes) -> Bucket {
        let minute = ms.max(0) / MS_PER_MINUTE;
        let start = minute - minute % i64::from(width.get());
        Bucket(u32::try_from(start).unwrap_or(u32::MAX - u32::MAX % u32::from(width.get())))
    }

    /// A bucket from its start minute as stored in ids and file headers. An id from outside may name an
    /// unaligned minute: such a bucket simply has no segment.
    pub fn from_start_minute(minute: u32) -> Bucket {
        Bucket(minute)
    }

    pub fn start_minute(self) -> u32 {
        self.0
    }

    pub fn start_ms(self) -> i64 {
        i64::from(self.0) * MS_PER_MINUTE
    }

    pub fn end_ms(self, width: SegmentMinutes) -> i64 {
        self.start_ms() + width.width_ms()
    }

    /// The bucket after this one.
    pub fn next(self, width: SegmentMinutes) -> Bucket {
        Bucket(self.0.saturating_add(u32::from(width.get())))
    }

    /// `YYYYMMDDTHHMMZ`, the stem of this bucket's file names.
    pub fn file_stem(self) -> String {
        self.to_string()
    }

    /// Parses a file stem written by [`Bucket::file_stem`].
    pub fn parse_file_stem(stem: &str) -> Option<Bucket> {
        let b = stem.as_bytes();
        if b.len() != 14 || b[8] != b'T' || b[13] != b'Z' {
            return None;
        }
        let num = |range: std::ops::Range<usize>| -> Option<i64> {
            let s = stem.get(range)?;
            s.bytes()
                .all(|c| c.is_ascii_digit())
                .then(|| s.parse().ok())?
        };
        let (year, month, day) = (num(0..4)?, num(4..6)?, num(6..8)?);
        let (hour, minute) = (num(9..11)?, num(11..13)?);
        if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
            return None;
        }
        let days = days_from_civil(year, month, day);
        let (y2, m2, d2) = civil_from_days(days);
        if (y2, m2, d2) != (year, month, day) {
            return None; // e.g. 20260231
        }
        let start = days * 1440 + hour * 60 + minute;
        u32::try_from(start).ok().map(Bucket)
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let minutes = i64::from(self.0);
        let (year, month, day) = civil_from_days(minutes.div_euclid(1440));
        let in_day = minutes.rem_euclid(1440);
        write!(
            f,
            "{year:04}{month:02}{day:02}T{:02}{:02}Z",
            in_day / 60,
            in_day % 60
        )
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
pub(crate) fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The proleptic Gregorian date of a day count since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: SegmentMinutes = SegmentMinutes(60);

    #[test]
    fn buckets_are_utc_and_aligned() {
        // 2026-12-01T09:30:00.123Z
        let ms = 1_796_117_400_123;
        let b = Bucket::of(ms, HOUR);
        assert_eq!(b.to_string(), "20261201T0900Z");
        assert!(b.start_ms() <= ms && ms < b.end_ms(HOUR));
        let five = SegmentMinutes::new(5).unwrap();
        assert_eq!(Bucket::of(ms, five).to_string(), "20261201T0930Z");
        assert_eq!(Bucket::of(-5, HOUR).to_string(), "19700101T0000Z");
    }

    #[test]
    fn file_stems_round_trip() {
        for minute in [
            0u32,
            60,
            1_440 * 365 * 56 + 17 * 60,
            29_935_260,
            133_000_000,
        ] {
            let b = Bucket(minute);
            assert_eq!(Bucket::parse_file_stem(&b.file_stem()), Some(b), "{b}");
        }
        for bad in [
            "20260231T0000Z",
            "20261201T2400Z",
            "20261201T0960Z",
            "2026120xT0000Z",
            "20261201T0000",
            "+0261201T0000Z",
            "",
        ] {
            assert_eq!(Bucket::parse_file_stem(bad), None, "{bad}");
        }
    }

    #[test]
    fn segment_minutes_range() {
        assert!(SegmentMinutes::new(4).is_none());
        assert!(SegmentMinutes::new(61).is_none());
        assert_eq!(SegmentMinutes::new(5).unwrap().width_ms(), 300_000);
    }

    #[test]
    fn civil_round_trip_over_centuries() {
        for days in (-800_000..3_000_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
