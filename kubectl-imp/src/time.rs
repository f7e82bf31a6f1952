//! Times as the plugin shows them: Kubernetes timestamps (RFC 3339) to Unix seconds and back.

use k8s_openapi::jiff::{Timestamp, tz::TimeZone};

/// Unix seconds of an RFC 3339 timestamp.
pub fn parse_time(s: &str) -> Option<f64> {
    let t: Timestamp = s.parse().ok()?;
    Some(t.as_nanosecond() as f64 / 1e9)
}

fn timestamp(secs: f64) -> Timestamp {
    Timestamp::from_nanosecond((secs * 1e9).round() as i128).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// RFC 3339 in UTC, whole seconds when the time has no fraction.
pub fn rfc3339(secs: f64) -> String {
    timestamp(secs).to_string()
}

/// `HH:MM:SS.mmm` in UTC (rounded to the millisecond: an f64 of Unix seconds carries no more).
pub fn format_hms(secs: f64) -> String {
    Timestamp::from_millisecond((secs * 1000.0).round() as i64)
        .unwrap_or(Timestamp::UNIX_EPOCH)
        .to_zoned(TimeZone::UTC)
        .strftime("%H:%M:%S%.3f")
        .to_string()
}

/// Now, in Unix seconds.
pub fn now() -> f64 {
    Timestamp::now().as_nanosecond() as f64 / 1e9
}

/// A duration for a table: `850ms`, `42s`, `3m20s`, `2h5m`.
pub fn human(secs: f64) -> String {
    if secs < 1.0 {
        return format!("{}ms", (secs * 1000.0).round() as i64);
    }
    let s = secs.round() as i64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        _ => format!("{}h{}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_formats() {
        let t = parse_time("2026-01-01T10:20:30.250Z").unwrap();
        assert_eq!(format_hms(t), "10:20:30.250");
        assert_eq!(
            rfc3339(parse_time("2026-01-01T00:00:00Z").unwrap()),
            "2026-01-01T00:00:00Z"
        );
        assert_eq!(parse_time("yesterday"), None);
        assert_eq!(human(0.25), "250ms");
        assert_eq!(human(200.0), "3m20s");
        assert_eq!(human(7500.0), "2h5m");
    }
}
